"""The ComfyUI node's QuantizedTensor weights (issue 26 points 3 and 6),
without ComfyUI and without float8 dtypes (CI's torch 1.13): a stand-in
tensor subclass shaped like comfy_kitchen's QuantizedTensor (a wrapper
over an int8 payload and a float32 per-tensor scale, its Params a frozen
dataclass, torch's flatten protocol; the layout named as ComfyUI's int8
one) and a stand-in of ComfyUI's mixed-precision Linear (dequantizes its
weight in its forward; convert_weight / set_weight requantize for LoRA,
as 0.33's do), on vpager's simulated device.

    make && PYTHONPATH=python:integrations python3 tests/python/test_comfyui_quantized.py

Checked: the payload and scale are paged as their stored bytes (the VBAR
holds int8 + float32, not a dequantized copy), outputs bitwise equal to the
resident model under a budget that stages and evicts, a LoRA on quantized
weights equal to ComfyUI's legacy bake (patch_weight_to_device through the
op's set_weight, requantized), the patch's removal, the op as loaded after
the node hands the model back, and an unsupported layout falling back
with one log line naming it.
"""

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("integrations", "python")

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import test_comfyui_node as base  # noqa: E402  (the node's stand-ins)
from test_comfyui_node import (CPU, K, DiT, env, logs, run,  # noqa: E402
                               glue)
from comfyui import quantized  # noqa: E402


# ------------------------------------------------- the stand-in tensor

@dataclasses.dataclass(frozen=True)
class Params:
    """comfy_kitchen's BaseLayoutParams: scale, orig_dtype, orig_shape."""
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: tuple


class QTensor(torch.Tensor):
    """A QuantizedTensor of the same shape as comfy_kitchen's: no storage
    of its own (a wrapper subclass of the logical shape and dtype), the
    int8 payload in _qdata, the scale in its Params; flattened into
    "_qdata" and "_param_scale" as comfy_kitchen's is."""

    @staticmethod
    def __new__(cls, qdata, layout, params):
        return torch.Tensor._make_wrapper_subclass(
            cls, params.orig_shape, dtype=params.orig_dtype,
            device=qdata.device, requires_grad=False)

    def __init__(self, qdata, layout, params):
        self._qdata = qdata
        self._layout_cls = layout
        self._params = params

    def __tensor_flatten__(self):
        self._param_scale = self._params.scale
        return ["_qdata", "_param_scale"], {"layout": self._layout_cls,
                                            "params": self._params}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        params = dataclasses.replace(ctx["params"],
                                     scale=inner["_param_scale"])
        return QTensor(inner["_qdata"], ctx["layout"], params)

    def dequantize(self):
        return self._qdata.to(torch.float32) * self._params.scale

    def requantize_from_float(self, w, seed=0):
        return from_float(w, self._layout_cls, seed)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            a = args[0]
            return QTensor(a._qdata, a._layout_cls, a._params)

        def plain(x):
            return x.dequantize() if isinstance(x, QTensor) else x
        return func(*[plain(a) for a in args],
                    **{k: plain(v) for k, v in kwargs.items()})


def from_float(w, layout="TensorWiseINT8Layout", seed=0):
    """The per-tensor int8 quantization (ComfyUI's recalculated scale:
    amax / 127); seed > 0 rounds stochastically (a seeded generator), as
    set_weight does with string_to_seed(key)."""
    w = w.to(torch.float32)
    scale = (w.abs().amax() / 127.0).clamp(min=1e-12)
    x = w / scale
    if seed:
        g = torch.Generator().manual_seed(seed)
        x = torch.floor(x + torch.rand(x.shape, generator=g))
    else:
        x = torch.round(x)
    q = x.clamp(-127, 127).to(torch.int8)
    return QTensor(q, layout, Params(scale.reshape(()), torch.float32,
                                     tuple(w.shape)))


class QLinear(base.Linear):
    """ComfyUI's mixed-precision Linear, reduced: its forward dequantizes
    a quantized weight (else casts a plain one); convert_weight and
    set_weight are what patch_weight_to_device calls around a LoRA."""

    def forward(self, x):
        w = self.weight
        w = w.dequantize() if isinstance(w, QTensor) else w.to(x.dtype)
        for f in self.weight_function:
            w = f(w)
        return nn.functional.linear(x, w.to(x.dtype), self.bias)

    def convert_weight(self, weight, inplace=False, **kw):
        return weight.dequantize() if isinstance(weight, QTensor) else weight

    def set_weight(self, weight, inplace_update=False, seed=None,
                   return_weight=False, **kw):
        if isinstance(self.weight, QTensor):
            weight = self.weight.requantize_from_float(weight, seed=seed)
        else:
            weight = weight.to(self.weight.dtype)
        if return_weight:
            return weight
        self.weight = nn.Parameter(weight, requires_grad=False)


def string_to_seed(key):
    return sum(key.encode()) % 9973 + 1


def patch_weight_to_device(self, key, device_to=None, inplace_update=False,
                           return_weight=False, force_cast=False):
    """ComfyUI 0.33's, with its op hooks: the weight and the op's
    convert_/set_ functions (get_key_weight), the LoRA in float32 on the
    dequantized weight, set_weight (requantized, seeded) to finish."""
    o, n = base.resolve_attr(self.model, key)
    weight = getattr(o, n)
    set_func = getattr(o, "set_" + n, None)
    convert_func = getattr(o, "convert_" + n, None)
    if key not in self.patches and not force_cast:
        return weight
    if key not in self.backup and not return_weight:
        self.backup[key] = base.Backup(weight)
    temp = weight.to(torch.float32) if not isinstance(weight, QTensor) \
        else weight
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    temp = temp.to(torch.float32, copy=True)
    out = base.calculate_weight(self.patches[key], temp, key) \
        if key in self.patches else temp
    if set_func is None:
        out = out.to(weight.dtype)
        if return_weight:
            return out
        base.set_attr_param(self.model, key, out)
        return None
    return set_func(out, inplace_update=inplace_update,
                    seed=string_to_seed(key), return_weight=return_weight)


class QPatcherDynamic(base.ModelPatcherDynamic):
    patch_weight_to_device = patch_weight_to_device


class QPatcher(base.ModelPatcher):
    """ComfyUI's legacy ModelPatcher: a LoRA baked in at load."""
    patch_weight_to_device = patch_weight_to_device


H = 512         # the blocks' hidden width: 32 KiB of int8 an op


def qmodel(layout="TensorWiseINT8Layout", seed=0, scale_shape=(), h=H):
    """The stand-in DiT with every block's Linear quantized (the norms and
    the root's own parameter stay plain, as a scaled-fp8 checkpoint's
    non-quantized layers do); scale_shape: the scales' shape as the file
    stored them."""
    m = DiT(op=QLinear, seed=seed, h=h)
    for blk in m.diffusion_model.blocks:
        for op in (blk.up, blk.down):
            q = from_float(op.weight.data, layout)
            q = QTensor(q._qdata, layout, dataclasses.replace(
                q._params, scale=q._params.scale.reshape(scale_shape)))
            op.weight = nn.Parameter(q, requires_grad=False)
    return m


class QEnv:
    """env()'s node class over QPatcherDynamic."""

    def __init__(self, e):
        self.e = e
        self.cls = glue.make_class(e.comfy, QPatcherDynamic)

    def patcher(self, model):
        return self.cls(model, CPU, CPU)


def stored_bytes(m):
    """Bytes of the unit weights as stored: payload + scale + bias."""
    n = 0
    for blk in m.diffusion_model.blocks:
        for op in (blk.up, blk.down):
            w = op.weight
            n += w._qdata.numel() + 4 + op.bias.numel() * 4
    return n


# ---------------------------------------------------------------- tests

def test_plan_takes_quantized_ops():
    m = qmodel()
    plan = glue.plan_model(m, base.comfy_ns())
    assert plan.why is None, plan.why
    keys = [key for _, _, ps in plan.units for key, _ in ps]
    assert "diffusion_model.blocks.0.up.weight" in keys
    assert quantized.is_quantized(m.diffusion_model.blocks[0].up.weight)
    assert not quantized.is_quantized(m.diffusion_model.pos)


def test_quantized_paged_bitwise():
    """The parts (int8 payload, float32 scale) are vpager's weights: the
    VBAR holds their stored bytes; outputs equal the resident model's,
    bitwise, on a device too small for them (staged, evicted)."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m, ref = qmodel(), qmodel()
        want = run(ref)
        qe = QEnv(e)
        p = qe.patcher(m)
        assert p.partially_load(CPU) == 0
        assert p.vpager_active()
        pager = m._vpager_pager
        for _ in range(3):
            assert torch.equal(run(m), want)
        s = p.vpager_stats()["model"]
        assert s["quantized_weights"] == 12, s
        # 12 payloads, 12 scales, 12 biases: vpager.torch's weights.
        assert len(pager.layout()) == 36
        assert s["weight_bytes"] == stored_bytes(m) < \
            sum(op.weight.numel() * 4 for blk in m.diffusion_model.blocks
                for op in (blk.up, blk.down))
        assert s["weight_bytes"] > 256 * K
        op = m.diffusion_model.blocks[0].up
        # Outside the forward the op holds its own QuantizedTensor; the
        # parts hold their bytes in host memory.
        assert isinstance(op.weight, QTensor)
        parts = [k for k in op._parameters if k.startswith(quantized.PART)]
        assert sorted(parts) == ["_vpager_q_weight_param_scale",
                                 "_vpager_q_weight_qdata"], parts
        assert torch.equal(op._parameters["_vpager_q_weight_qdata"],
                           ref.diffusion_model.blocks[0].up.weight._qdata)
        # Inside it, the op's weight is a QTensor over vpager's memory.
        seen = []
        orig = QTensor.dequantize

        def spy(self):
            seen.append((type(self), self._qdata.data_ptr()))
            return orig(self)
        QTensor.dequantize = spy
        try:
            assert torch.equal(run(m), want)
        finally:
            QTensor.dequantize = orig
        assert len(seen) == 12 and all(t is QTensor for t, _ in seen)
        host = {op.weight._qdata.data_ptr()
                for blk in m.diffusion_model.blocks
                for op in (blk.up, blk.down)}
        assert not host & {ptr for _, ptr in seen}
        # Handed back to ComfyUI: the ops as loaded.
        p._vp_leave()
        assert not any(k.startswith(quantized.PART) for k in op._parameters)
        assert "forward" not in op.__dict__
        assert isinstance(op.weight, QTensor)
        assert torch.equal(run(m), want)


def test_quantized_lora_as_comfyui_bakes_it():
    """A LoRA on quantized weights: the node's parts are those of the
    weight ComfyUI's patch_weight_to_device makes (dequantized, patched
    in float32, requantized by the op's set_weight with the key's seed),
    so outputs equal the legacy ModelPatcher's bake; the removal refills
    the stored bytes."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m = qmodel()
        want0 = run(qmodel())
        qe = QEnv(e)
        p = qe.patcher(m)
        p.partially_load(CPU)
        k1 = "diffusion_model.blocks.1.up.weight"
        k2 = "diffusion_model.blocks.4.down.bias"
        g = torch.Generator().manual_seed(7)
        d1 = torch.randn(H, 64, generator=g) * 0.01
        d2 = torch.randn(64, generator=g) * 0.01
        q = p.clone()
        q.add_patches({k1: ("diff", (d1,)), k2: ("diff", (d2,))}, 0.8)
        q.partially_load(CPU)
        assert q._vp_refilled == 2
        # ComfyUI's legacy load of the same patches.
        ref = qmodel()
        lp = QPatcher(ref, CPU, CPU)
        lp.patches = {k: v[:] for k, v in q.patches.items()}
        for k in lp.patches:
            lp.patch_weight_to_device(k, device_to=CPU)
        assert isinstance(ref.diffusion_model.blocks[1].up.weight, QTensor)
        want1 = run(ref)
        assert not torch.equal(want1, want0)
        assert torch.equal(run(m), want1)
        assert torch.equal(run(m), want1)
        # Removed: the base model's bytes again.
        p.partially_load(CPU)
        assert p._vp_refilled == 2
        assert torch.equal(run(m), want0)


def _legacy(patches):
    """The outputs of ComfyUI's legacy bake of `patches` into a fresh
    quantized model."""
    ref = qmodel()
    lp = QPatcher(ref, CPU, CPU)
    lp.patches = {k: v[:] for k, v in patches.items()}
    for k in lp.patches:
        lp.patch_weight_to_device(k, device_to=CPU)
    return run(ref)


def test_quantized_lora_patched_at_fill():
    """A LoRA on every quantized weight, on a device that stages some of
    them: the payload is patched at each fill from its own bytes (no
    host copy of it; only the requantized scales are host copies), and
    the outputs equal the legacy bake on every forward, at two strengths
    and after the removal."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m = qmodel()
        want0 = run(qmodel())
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        pager = p._vp()
        host0 = pager.host_bytes()
        g = torch.Generator().manual_seed(11)
        diffs = {"diffusion_model.blocks.%d.%s.weight" % (i, n):
                 torch.randn(*getattr(blk, n).weight.shape, generator=g)
                 * 0.02 for i, blk in enumerate(m.diffusion_model.blocks)
                 for n in ("up", "down")}
        for strength in (1.0, 0.6):
            q = p.clone()
            q.add_patches({k: ("diff", (d,)) for k, d in diffs.items()},
                          strength)
            q.partially_load(CPU)
            assert q._vp_refilled == 12
            s = pager.stats()["model"]
            assert s["host_patched_weights"] == 0, s
            assert s["host_patched_bytes"] == 12 * 4, s     # the scales
            assert pager.host_bytes() == host0 + 12 * 4
            want = _legacy(q.patches)
            assert not torch.equal(want, want0)
            f0 = pager.stats()["model"]["patch_fills"]
            for _ in range(3):
                assert torch.equal(run(m), want)
            fills = pager.stats()["model"]["patch_fills"] - f0
            # Every payload once, the staged ones at each forward.
            assert fills > 12, fills
            # The op's own scale copied to the device once, kept there.
            split = pager.by_key[
                "diffusion_model.blocks.0.up.weight"].split
            assert list(split.own_kept) == [("cpu", "_param_scale")], \
                split.own_kept
        p.partially_load(CPU)
        assert p._vp_refilled == 12
        assert pager.host_bytes() == host0
        assert torch.equal(run(m), want0)


def test_quantized_lora_reads_the_host_copy_not_the_loaded_tensor():
    """A LoRA's patched scales (make(): the whole weight patched outside
    the forward) are computed from vpager's host copy of the parts, not
    from the QuantizedTensor ComfyUI loaded: that one's payload lies in
    the checkpoint's mapping, and reading it faulted the patched weights'
    file pages into the process (scaled fp8 + LoRA on the H100: RSS +0.46
    GiB at the first LoRA, +0.32 at the second, outside vpager's pinned
    memory). Here the loaded payloads are overwritten after the load:
    the outputs still equal the legacy bake."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m = qmodel()
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        pager = p._vp()
        g = torch.Generator().manual_seed(5)
        diffs = {"diffusion_model.blocks.%d.%s.weight" % (i, n):
                 torch.randn(*getattr(blk, n).weight.shape, generator=g)
                 * 0.02 for i, blk in enumerate(m.diffusion_model.blocks)
                 for n in ("up", "down")}
        for key in diffs:   # the loaded tensors, as if no longer readable
            pager.by_key[key].split.weight._qdata.fill_(99)
        q = p.clone()
        q.add_patches({k: ("diff", (d,)) for k, d in diffs.items()}, 0.7)
        q.partially_load(CPU)
        assert q._vp_refilled == 12
        want = _legacy(q.patches)
        for _ in range(2):
            assert torch.equal(run(m), want)


def test_quantized_patch_failing_between_parts():
    """A patch whose second part cannot be set (its set_source or
    set_fill raising): the parts are left mixed, so the next load, even
    of the patch set they had before (none), sets them all again: the
    base outputs."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m = qmodel()
        want0 = run(qmodel())
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        k = "diffusion_model.blocks.1.up.weight"
        d = torch.randn(H, 64, generator=torch.Generator().manual_seed(5))
        q = p.clone()
        q.add_patches({k: ("diff", (d * 0.05,))})
        h = p._vp().h
        calls = []

        def second_fails(real):
            def call(name, tensor=None):
                calls.append(name)
                if len(calls) == 2:
                    raise RuntimeError("no memory for the second part")
                return real(name, tensor)
            return call

        h.set_source = second_fails(h.set_source)
        h.set_fill = second_fails(h.set_fill)
        try:
            q.partially_load(CPU)
            assert False, "the failing part did not raise"
        except RuntimeError as err:
            assert "second part" in str(err), err
        finally:
            del h.set_source, h.set_fill
        assert len(calls) == 2
        p.partially_load(CPU)
        assert torch.equal(run(m), want0)


def test_quantized_lora_scale_stored_as_one_element():
    """Scales a file stored as [1] (requantizing gives []): the patched
    parts keep the loaded shapes, outputs equal the legacy bake."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m = qmodel(scale_shape=(1,))
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        k = "diffusion_model.blocks.2.down.weight"
        d = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
        q = p.clone()
        q.add_patches({k: ("diff", (d * 0.01,))})
        q.partially_load(CPU)
        assert q._vp_refilled == 1 and q.vpager_active()
        ref = qmodel(scale_shape=(1,))
        lp = QPatcher(ref, CPU, CPU)
        lp.patches = {k: list(q.patches[k])}
        lp.patch_weight_to_device(k, device_to=CPU)
        assert ref.diffusion_model.blocks[2].down.weight._params.scale \
            .shape == ()
        assert torch.equal(run(m), run(ref))


def test_patch_changing_the_layout_falls_back():
    """A patch whose set_weight gives no QuantizedTensor of the loaded
    layout: the node cannot page it; the model goes ComfyUI's way with
    one log line naming the weight."""
    class Dequantizing(QLinear):
        def set_weight(self, weight, return_weight=False, **kw):
            return QLinear.set_weight(
                self, weight, return_weight=return_weight, **kw).dequantize()

    with env() as e:
        m = qmodel()
        op = m.diffusion_model.blocks[0].up
        op.__class__ = Dequantizing
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        assert p.vpager_active()
        k = "diffusion_model.blocks.0.up.weight"
        q = p.clone()
        q.add_patches({k: ("diff", (torch.zeros(H, 64),))})
        with logs() as lines:
            q.partially_load(CPU)
        assert not q.vpager_active() and m.comfy_loaded == 1
        assert len(lines) == 1 and k in lines[0], lines
        assert "TensorWiseINT8Layout" in lines[0], lines
        assert not any(x.startswith(quantized.PART) for x in op._parameters)


def test_unsupported_layout_falls_back():
    """A QuantizedTensor of a layout the node does not know goes to
    ComfyUI's own path, with one log line naming the layout."""
    with env() as e:
        m = qmodel(layout="SomePackedLayout")
        want = run(qmodel(layout="SomePackedLayout"))
        qe = QEnv(e)
        with logs() as lines:
            p = qe.patcher(m)
            p.partially_load(CPU)
            p.partially_load(CPU)
        assert not p.vpager_active() and m.comfy_loaded == 2
        assert len(lines) == 1 and "SomePackedLayout" in lines[0], lines
        assert "QuantizedTensor" in lines[0], lines
        op = m.diffusion_model.blocks[0].up
        assert not any(k.startswith(quantized.PART) for k in op._parameters)
        assert torch.equal(run(m), want)


def test_tiny_quantized_ops_are_units():
    """Quantized ops below the node's 16 KiB (which it would otherwise
    load ComfyUI's way, force_cast: dequantized and requantized) are
    units, their stored bytes paged; a QuantizedTensor that is no op's
    weight or bias falls back, named."""
    with env() as e:
        m, ref = qmodel(h=32), qmodel(h=32)
        plan = glue.plan_model(m, base.comfy_ns())
        assert plan.why is None and len(plan.units) == 12, plan.why
        assert not any(k.endswith("up.weight") for k, _m, _k in plan.forced)
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        assert p.vpager_active()
        assert torch.equal(run(m), run(ref))
    m = qmodel(h=32)
    m.diffusion_model.pos = nn.Parameter(
        from_float(m.diffusion_model.pos.data), requires_grad=False)
    why = glue.plan_model(m, base.comfy_ns()).why
    assert why == ("diffusion_model.pos is a QuantizedTensor that is not a "
                   "ComfyUI op's weight or bias"), why


def test_parts_refused_when_not_plain():
    """Parts the node cannot page (not in host memory, empty): the
    reason names the weight and the part."""
    m = qmodel()
    op = m.diffusion_model.blocks[2].down
    w = op.weight
    op.weight = nn.Parameter(QTensor(w._qdata, w._layout_cls, Params(
        torch.empty(0), w._params.orig_dtype, w._params.orig_shape)),
        requires_grad=False)
    why = glue.plan_model(m, base.comfy_ns()).why
    assert "blocks.2.down.weight" in why and "_param_scale" in why, why
    assert "empty" in why, why


def _count_builds(cls):
    """Patches cls.__tensor_unflatten__ to count its calls: (list whose
    length is the count, undo)."""
    calls = []
    orig = cls.__dict__["__tensor_unflatten__"]

    def counted(inner, ctx, outer_size, outer_stride):
        calls.append(1)
        return orig.__func__(inner, ctx, outer_size, outer_stride)
    cls.__tensor_unflatten__ = staticmethod(counted)

    def undo():
        cls.__tensor_unflatten__ = orig
    return calls, undo


def _seen_weights():
    """Patches QTensor.dequantize (what QLinear's forward calls on its
    weight) to record the weights it is called on: (the list, undo)."""
    seen = []
    orig = QTensor.dequantize

    def spy(self):
        seen.append(self)
        return orig(self)
    QTensor.dequantize = spy

    def undo():
        QTensor.dequantize = orig
    return seen, undo


def test_quantized_wrapper_built_once():
    """Issue 26 (scaled fp8 slower than ComfyUI): the wrapper an op
    computes with is built once, over the parts themselves, and follows
    vpager's acquires, resident or staged: no __tensor_unflatten__ in a
    settled forward (building one is tens of microseconds of host time
    per op on a host-bound model). It keeps what ComfyUI's op reads:
    the class, Parameter-ness (_is_param), the parts' device, and bytes
    at the address vpager acquired; outputs stay bitwise equal."""
    for capacity in (256 * K, 8 << 20):     # staged and evicted; resident
        with env(capacity=capacity, staging=128 * K) as e:
            m, ref = qmodel(), qmodel()
            want = run(ref)
            p = QEnv(e).patcher(m)
            p.partially_load(CPU)
            for _ in range(7):              # recorded, measured, settled
                assert torch.equal(run(m), want)
            calls, undo = _count_builds(QTensor)
            seen, unspy = _seen_weights()
            try:
                for _ in range(3):
                    assert torch.equal(run(m), want)
            finally:
                undo()
                unspy()
            assert calls == [], (capacity, len(calls))
            assert len(seen) == 36, len(seen)
            ops = [op for blk in m.diffusion_model.blocks
                   for op in (blk.up, blk.down)]
            for w in seen:
                assert type(w) is QTensor and w._is_param, type(w)
                assert isinstance(w, nn.Parameter)
                assert w.device == CPU and w.dtype == ops[0].weight.dtype
            # One wrapper per op, forward after forward, in the op's
            # shape (up and down differ).
            assert len({id(w) for w in seen}) == 12
            assert [tuple(w.shape) for w in seen[:12]] == \
                [tuple(op.weight.shape) for op in ops]
            host = {op.weight._qdata.data_ptr() for op in ops}
            assert not host & {w._qdata.data_ptr() for w in seen}


@dataclasses.dataclass(frozen=True)
class CopyingParams(Params):
    """A layout's Params that converts its scale (as comfy_kitchen's fp8
    and nvfp4 Params do for a scale not in float32): the wrapper then
    holds a copy, not the part."""

    def __post_init__(self):
        object.__setattr__(self, "scale", self.scale.clone())


def test_quantized_wrapper_of_a_copying_layout():
    """A layout whose wrapper holds a copy of a part is built anew for
    each forward (a copy follows neither vpager's .data swaps nor new
    bytes at a reused staging address): bitwise equal, staged."""
    with env(capacity=256 * K, staging=128 * K) as e:
        m, ref = qmodel(), qmodel()
        for model in (m, ref):
            for blk in model.diffusion_model.blocks:
                for op in (blk.up, blk.down):
                    w = op.weight
                    op.weight = nn.Parameter(QTensor(
                        w._qdata, w._layout_cls, CopyingParams(
                            w._params.scale, w._params.orig_dtype,
                            w._params.orig_shape)), requires_grad=False)
        want = run(ref)
        p = QEnv(e).patcher(m)
        p.partially_load(CPU)
        for _ in range(6):
            assert torch.equal(run(m), want)
        calls, undo = _count_builds(QTensor)
        try:
            assert torch.equal(run(m), want)
        finally:
            undo()
        assert len(calls) == 12, len(calls)


def test_mixed_precision_plain_weights_paged():
    """A mixed-precision op whose weight is plain (a layer the checkpoint
    left unquantized: set_weight/convert_weight on the op) is paged as
    any weight; a LoRA on it goes through its set_weight."""
    with env() as e:
        m, ref = DiT(op=QLinear), DiT(op=QLinear)
        qe = QEnv(e)
        p = qe.patcher(m)
        p.partially_load(CPU)
        assert p.vpager_active()
        assert torch.equal(run(m), run(ref))


def test_bench_quant_ops_ways():
    """bench/bench_quant_ops.py's ways on CPU with the stand-ins: "split"
    (the node's wrapper, built once) and "rebuild" (by the parts'
    addresses at each forward, the node before its fix) compute what the
    op computes on its own weight, bitwise."""
    import runpy
    ns = runpy.run_path(os.path.join(REPO, "bench", "bench_quant_ops.py"),
                        run_name="bench_quant_ops")
    a = ns["parse"](["--comfyui", "x"])
    assert (a.pairs, a.tokens, a.budget_half) == (16, 4096, False)
    assert a.deps == os.path.join(os.path.dirname(os.path.abspath("x")),
                                  "pydeps")
    want = run(qmodel())
    for rebuild in (False, True):
        m = qmodel()
        splits = ns["install_splits"](m, quantized, rebuild=rebuild)
        assert len(splits) == 12
        calls, undo = _count_builds(QTensor)
        try:
            for _ in range(3):
                assert torch.equal(run(m), want)
        finally:
            undo()
        # Built once each (live, or cached by the same addresses).
        assert len(calls) == 12, (rebuild, len(calls))
        assert all((s.live is None) == rebuild for s in splits)
        for s in splits:
            s.remove()
        assert torch.equal(run(m), want)


def test_bench_quant_matrix():
    """bench_node.py --quant: bench/comfyui_run.py's --quant option (the
    tensors a converter quantizes, passed to every child), the checkpoint
    per format, each cell's runs and the verdict (the node's latents equal
    to resident's or legacy's). Children are stand-ins (no GPU, no
    ComfyUI, no float8 in CI's torch)."""
    import runpy
    import tempfile
    ns = runpy.run_path(os.path.join(REPO, "bench", "bench_node.py"),
                        run_name="bench_node")
    cr = ns["harness"]()
    sd = {"img_in.weight": torch.zeros(8, 4),
          "double_blocks.0.img_attn.qkv.weight": torch.zeros(24, 8),
          "double_blocks.0.img_attn.qkv.bias": torch.zeros(24),
          "double_blocks.0.img_attn.norm.key_norm.scale": torch.zeros(8),
          "single_blocks.0.linear1.weight": torch.zeros(32, 8),
          "final_layer.linear.weight": torch.zeros(4, 8)}
    assert cr.quant_keys(sd) == ["double_blocks.0.img_attn.qkv.weight",
                                 "single_blocks.0.linear1.weight"]
    a = cr.parse(["--comfyui", "x", "--quant", "scaled_fp8"])
    args = cr.common_args(a)
    assert args[args.index("--quant") + 1] == "scaled_fp8"
    with _runner_quiet():
        _runner.raises(SystemExit, cr.parse, ["--comfyui", "x", "--quant",
                                              "scaled_fp8", "--weight-dtype",
                                              "fp8_e5m2"])
    assert "quantized: scaled_fp8" in cr.inputs_line(a)
    ours = ns["split_args"](["--quant", "scaled_fp8", "--fp8-lora",
                             "on"])[0]
    assert ns["quant_formats"](ours) == ["scaled_fp8"]
    _runner.raises(SystemExit, ns["quant_formats"], {"quant": "fp7"})
    assert ns["quant_runs"](False) == ["resident", "nodehalf", "half"]
    assert ns["quant_runs"](True)[-1] == "legacy"

    labels = ["base", "lora_a", "removed"]
    lat = {"resident": "RRR", "legacy": "LLL", "nodehalf": "RLR",
           "half": "RXR"}
    seen = []
    gen = {"bytes": 2 * base.GiB_, "w_max": 1 << 20, "path": "ck",
           "link_GBps": 50.0, "tensors": 9, "quant": {"layers": 2},
           "held": {"default": {"bytes": 2 * base.GiB_, "w_max": 1 << 20}}}

    def child(run):
        seen.append(run)
        return {"reps": [{"label": lb, "steps_ms": [90.0, 10.0, 10.0],
                          "latent_sha256": lat[run][i] * 64,
                          "torch_peak_reserved": 1 << 28,
                          "torch_reserved": 1 << 28, "device_used": 1 << 30}
                         for i, lb in enumerate(labels)]}

    def run_child(a_, kind, extra, log):
        if kind == "gen":
            seen.append("gen:%s:%s" % (a_.quant, a_.lora))
            return dict(gen)
        return child(extra[extra.index("--tag") + 1])
    g = ns["quant_matrix"].__globals__
    saved = (cr.run_child, g["run_node_child"], g["say"], g["report"])
    lines = []
    try:
        cr.run_child = run_child
        g["run_node_child"] = lambda cr_, a, run, *rest: child(run)
        g["say"] = lambda *x: lines.append(" ".join(map(str, x)))
        g["report"] = lambda *x: None
        with tempfile.TemporaryDirectory() as out:
            a.workdir = out
            summary = {"runs": {}}
            rc = ns["quant_matrix"](cr, a, ours, out, summary)
            assert rc == 0, lines
            assert seen == ["gen:scaled_fp8:True", "resident", "nodehalf",
                            "half", "legacy"], seen
            assert sorted(summary["quant"]) == ["scaled_fp8_lora"]
            lat["nodehalf"] = "RXR"
            seen[:] = []
            ours["reuse"] = True        # gen.json of the first pass
            assert ns["quant_matrix"](cr, a, ours, out, summary) == 2
            assert not any(x.startswith("gen:") for x in seen), seen
    finally:
        (cr.run_child, g["run_node_child"], g["say"], g["report"]) = saved
    table = lines[lines.index(next(x for x in lines
                                   if x.startswith("quantized checkpoints"))):]
    assert any("scaled_fp8" in x and "RLR" in x for x in table), table
    assert any("nodehalf: budget" in x and "x L" in x for x in lines)


class _runner_quiet:
    """argparse's error message to a buffer, not the test's output."""

    def __enter__(self):
        import io
        self.saved, sys.stderr = sys.stderr, io.StringIO()

    def __exit__(self, *exc):
        sys.stderr = self.saved


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
