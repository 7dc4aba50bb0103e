"""A torch module's state_dict against a safetensors file (vpager.torch's
weights_from= and load_safetensors): matching names, dtypes and shapes, and
loading the tensors vpager does not manage."""

import ctypes

import torch

# safetensors dtype names (vp_st_tensor_t.dtype) of torch dtypes.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
              torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.complex64: "C64"}
for _name, _st in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                   ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                   ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                   ("float8_e8m0fnu", "F8_E8M0"), ("uint16", "U16"),
                   ("uint32", "U32"), ("uint64", "U64")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _ST_DTYPES[getattr(torch, _name)] = _st


def _state_items(module, prefix=""):
    """(name, dict, key, tensor, is_param) of what module.state_dict() holds
    (parameters and persistent buffers; a shared tensor once per name)."""
    for k, p in module._parameters.items():
        if p is not None:
            yield prefix + k, module._parameters, k, p, True
    for k, b in module._buffers.items():
        if b is not None and k not in module._non_persistent_buffers_set:
            yield prefix + k, module._buffers, k, b, False
    for name, child in module._modules.items():
        if child is not None:
            yield from _state_items(child, prefix + name + ".")


def match_file(module, entries, st, fn):
    """Match a safetensors file to module.state_dict()'s names: returns
    ({entry: TensorInfo}, [(dict, key, is_param, TensorInfo)] for the
    state_dict tensors vpager does not manage). ValueError, naming the
    tensors, for tensors missing from the file or the module, or of another
    dtype or shape; nothing is changed."""
    infos = {}
    for t in st:
        infos[t.name] = t
    by_id = {id(e.tensor): e for e in entries}
    groups = {}
    order = []
    for name, d, k, t, is_param in _state_items(module):
        g = groups.get(id(t))
        if g is None:
            g = groups[id(t)] = ([], d, k, t, is_param)
            order.append(g)
        g[0].append(name)
    problems = []
    known = set()
    for m in module.modules():
        for k in m._non_persistent_buffers_set:
            b = m._buffers.get(k)
            if b is not None and b.device.type == "meta":
                problems.append("buffer %r of %s is on the meta device and "
                                "not in any file (it is not persistent)"
                                % (k, type(m).__name__))
    plan = {}
    loads = []
    for names, d, k, t, is_param in order:
        known.update(names)
        e = by_id.get(id(t))
        dtype = e.dtype if e is not None else t.dtype
        shape = e.shape if e is not None else tuple(t.shape)
        want = _ST_DTYPES.get(dtype)
        present = [n for n in names if n in infos]
        if not present:
            problems.append("tensor %r is missing from the file" % names[0])
            continue
        if want is None:
            problems.append("tensor %r is %s, which safetensors has no name "
                            "for" % (names[0], dtype))
            continue
        bad = False
        for n in present:
            ti = infos[n]
            if ti.dtype != want or tuple(ti.shape) != shape:
                problems.append(
                    "tensor %r is %s %s in the file but %s %s (%s) in the "
                    "module" % (n, ti.dtype, list(ti.shape), want, list(shape),
                                str(dtype).replace("torch.", "")))
                bad = True
        if bad:
            continue
        if e is not None:
            plan[e] = infos[present[0]]
        else:
            loads.append((d, k, is_param, infos[present[0]]))
    for e in entries:
        if e not in plan and not problems:
            problems.append("tensor %r is not in the module's state_dict"
                            % e.name)
    extra = [n for n in infos if n not in known]
    problems += ["unexpected tensor %r (the module's state_dict has no such "
                 "name)" % n for n in extra]
    if problems:
        more = len(problems) - 8
        raise ValueError(
            "vpager.torch.%s: %s does not match the module (nothing was "
            "loaded): %s%s" % (fn, st.path, "; ".join(problems[:8]),
                               "; and %d more" % more if more > 0 else ""))
    return plan, loads


def _file_tensor(info, addr, dtype):
    """A new CPU tensor with a tensor's bytes from the mapped file."""
    with torch.inference_mode(False):
        out = torch.empty(tuple(info.shape), dtype=dtype)
    if info.size:
        ctypes.memmove(out.data_ptr(), addr, info.size)
    return out


def load_unmanaged(st, loads, fresh=()):
    """Fill the state_dict tensors vpager does not manage (integer buffers,
    empty parameters) from the file: in place, or, for placeholders of meta
    tensors (ids in `fresh`), as new CPU tensors."""
    base = st.mmap()[0]
    with torch.no_grad(), torch.inference_mode(False):
        for d, k, is_param, info in loads:
            t = d[k]
            new = _file_tensor(info, base + info.offset, t.dtype)
            if id(t) in fresh or t.device.type == "meta":
                if is_param:
                    t.data = new
                else:
                    d[k] = new
            else:
                t.data.copy_(new)
