"""The node's glue over vpager.torch, free of ComfyUI: one model's weights
offloaded by vpager.torch.offload() onto a vpager.Device shared by every
model on that GPU.

vpager.torch does the paging: its units (here: the ComfyUI ops the
patcher chose, through offload(tensors=)), the wrapped forwards (one
vp_acquire per op, the op's parameters views of the returned addresses,
ComfyUI's op computing on them, casting on the GPU when the stored dtype
is not the compute dtype), the placement (for a schedule guessed from
the weights' sizes when they do not fit, before the first forward; the
order of use recorded in the first forward of the diffusion model:
offload(root=)), the copy schedule (measured unit times: the resident
set, the prefetch windows; offload(schedule=True) on the shared device),
the OOM retry
and the ledger. With offload(outside="host") a parameter holds a CPU
tensor with its (unpatched) bytes outside its op's forward, as under
ComfyUI's own dynamic loading.

What is ComfyUI's and stays here: the dtype each weight is held in on
the GPU (ComfyUI's dynamic path holds a weight in the dtype its op
declares, <param>_comfy_model_dtype, converting the file's bytes on the
GPU with a plain cast when the file has another one: a UNet loaded with
weight_dtype fp8 from a bf16 file; convert_host() does that conversion
once, on the same device, before vpager.torch takes the weight), the
sources (vpager.torch's pinned host copy, made from ComfyUI's
memory-mapped file or from the converted tensor, or with --fast-disk
the file region itself: offload(sources=)), patch identity
(same_patch: only weights whose patch set changed get a new source,
Offloaded.set_source), and ComfyUI's flags: --vram-headroom and
--reserve-vram's budget, which weights and torch's activations share,
declared to the device's Governor (vpager.governor), which derives the
device's limit and headroom from them and from torch's memory."""

import time

import torch

import vpager.torch
import vpager.torch.ledger as _ledger
from vpager.governor import governor
from vpager.torch import hostpolicy
from vpager.torch.devices import learn_headroom, torch_peak
from vpager.weights import Source

from . import quantized
from .patch_stage import CarriedPatches, PatchStage

ALL = 1 << 62               # "evict everything unpinned"


def nbytes(t):
    return t.numel() * t.element_size()


CONVERT_CHUNK = 16 << 20    # bytes of the source converted at a time
CONVERT_THREADS = 8         # threads copying to and from the staging


def convert_host(items, target):
    """[(t, dtype)] (CPU tensors) -> [a new CPU tensor holding t cast to
    dtype], cast the way ComfyUI's dynamic path casts a weight into VRAM
    (comfy.ops: the file's bytes copied to the GPU, then a plain copy_
    into a tensor of the declared dtype; no stochastic rounding): chunk by
    chunk on `target`, the GPU the model computes on, so the very same
    conversion kernel runs (on the simulated device, the CPU), then back
    to the host. On a GPU the chunks go through two pinned staging pairs
    on a stream of their own: the host fills one (several threads) while
    the GPU converts the other."""
    outs, jobs = [], []
    with torch.no_grad(), torch.inference_mode(False):
        for t, dtype in items:
            src = t.detach()
            out = torch.empty(tuple(src.shape), dtype=dtype)
            outs.append(out)
            n = src.numel()
            step = max(CONVERT_CHUNK // max(src.element_size(), 1), 1)
            a, b = src.reshape(-1), out.view(-1)
            for i in range(0, n, step):
                jobs.append((a[i:i + step], b[i:i + step]))
        if target.type == "cpu":
            for a, b in jobs:
                b.copy_(a)
        elif jobs:
            _convert_on_gpu(jobs, target)
    return outs


def _host_staging(nbytes):
    """A pinned staging buffer, else (no pinned memory to be had) a pageable
    one: its copies are slower, never an error."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError:
        return torch.empty(nbytes, dtype=torch.uint8)


def _convert_on_gpu(jobs, target):
    """convert_host's GPU pipeline over jobs [(source chunk, destination
    chunk)] (CPU tensors, contiguous)."""
    import concurrent.futures

    def size(t):
        return t.numel() * t.element_size()

    def pieces(dst, src):           # a copy split for the threads
        n = dst.numel()
        step = max((n + CONVERT_THREADS - 1) // CONVERT_THREADS, 1)
        return [(dst[i:i + step], src[i:i + step]) for i in range(0, n, step)]

    stream = torch.cuda.Stream(target)
    big_in = max(size(a) for a, _b in jobs)
    big_out = max(size(b) for _a, b in jobs)
    slots = []
    with torch.cuda.device(target), torch.cuda.stream(stream), \
            concurrent.futures.ThreadPoolExecutor(CONVERT_THREADS) as pool:

        def copy(dst, src):
            list(pool.map(lambda p: p[0].copy_(p[1]), pieces(dst, src)))

        def finish(slot):           # the chunk's result to its destination
            _a, b = slot["job"]
            slot["event"].synchronize()
            copy(b, slot["pin_out"][:size(b)].view(b.dtype))
            slot["job"] = None

        for _ in range(2):
            slots.append({
                "pin_in": _host_staging(big_in),
                "pin_out": _host_staging(big_out),
                "gin": torch.empty(big_in, dtype=torch.uint8, device=target),
                "gout": torch.empty(big_out, dtype=torch.uint8,
                                    device=target),
                "event": torch.cuda.Event(), "job": None})
        try:
            for i, (a, b) in enumerate(jobs):
                slot = slots[i % 2]
                if slot["job"] is not None:
                    finish(slot)
                pin = slot["pin_in"][:size(a)].view(a.dtype)
                copy(pin, a)
                gin = slot["gin"][:size(a)].view(a.dtype)
                gout = slot["gout"][:size(b)].view(b.dtype)
                gin.copy_(pin, non_blocking=True)
                gout.copy_(gin)             # the conversion, as ComfyUI's
                slot["pin_out"][:size(b)].view(b.dtype).copy_(
                    gout, non_blocking=True)
                slot["event"].record(stream)
                slot["job"] = (a, b)
            for slot in slots:
                if slot["job"] is not None:
                    finish(slot)
        finally:
            stream.synchronize()
            # The staging goes back to the device (and the pinned pairs
            # to the host): blocks cached on a stream of their own would
            # stay reserved, room the budget's weights no longer have.
            slots = None
            torch.cuda.empty_cache()
            host_empty = getattr(torch._C, "_host_emptyCache", None)
            if host_empty is not None:
                host_empty()


def comfy_file_slice(t):
    """(fd, file offset) of a tensor that ComfyUI's safetensors loader
    mapped from a file (its storage tagged _comfy_tensor_file_slice), when
    the tensor is the whole, contiguous storage; else None."""
    try:
        storage = (t.untyped_storage() if hasattr(t, "untyped_storage")
                   else t.storage())
    except Exception:       # pragma: no cover - exotic tensors
        return None
    info = getattr(storage, "_comfy_tensor_file_slice", None)
    if info is None or not t.is_contiguous() or t.storage_offset() != 0:
        return None
    fd, _lock, offset, size = info[:4]
    if size < nbytes(t) or not isinstance(fd, int):
        return None
    return fd, offset


class Entry:
    """One managed parameter of the model (a vpager.torch weight, or for a
    QuantizedTensor one per part: split): its state-dict key, op,
    parameter name and object, and the patch set its source was made
    for."""

    __slots__ = ("key", "module", "pname", "param", "dtype", "shape", "size",
                 "file", "patch", "split", "host_patched",
                 "host_patched_bytes", "stage", "carried")

    def __init__(self, key, module, pname, param, split=None):
        self.key = key
        self.module = module
        self.pname = pname
        self.param = param
        self.dtype = param.dtype
        self.shape = tuple(param.size())    # of its bytes (units.Entry)
        self.split = split              # quantized.Split, or None
        self.size = split.size if split is not None else nbytes(param)
        self.file = None                # (fd, offset) when file-sourced
        self.patch = None               # the patch set it was filled with
        self.host_patched = False       # its patched bytes: a host copy
        self.host_patched_bytes = 0     # (of a QuantizedTensor's parts,
        #                                 all but a payload patched at fill)
        self.stage = None               # patched at fill: its PatchStage
        self.carried = None             # applied by its op: CarriedPatches


class Pager:
    """One model's weights on `dev` (a vpager.Device shared by every model
    on that GPU) through vpager.torch.offload(model, ...). units: [(name,
    module, [(key, pname)])] (the patcher's plan: ComfyUI ops); the other
    parameters and buffers stay ComfyUI's. target: the torch device the
    ops compute on (cuda:N, or cpu for the simulated device); root: the
    module whose forward is one step (the diffusion model), default the
    model; prefer_file: file sources where the tensor is a file slice
    (file_slice(t) -> (fd, offset) or None); budget: the device's budget
    for weights and activations together (--reserve-vram), declared to
    its Governor with the device's headroom (ComfyUI's flags) by the
    first pager on the device; dtypes: {key: dtype} the dtype each
    weight is to be held in on the device (ComfyUI's: its op's declared
    dtype), default its own; a weight stored in another dtype is
    converted first (convert_host: as ComfyUI's dynamic path casts it)
    and gets its original tensor back at close(). ValueError (nothing
    changed) if a weight cannot be held in the dtype asked for."""

    def __init__(self, dev, target, model, units, prefer_file=False,
                 file_slice=comfy_file_slice, label=None, budget=None,
                 root=None, dtypes=None):
        self.dev = dev
        self.target = torch.device(target)
        self.gov = governor(dev)
        if self.gov.flags is None:      # ComfyUI's flags, once per device
            self.gov.declare_flags(self.gov.user_headroom, budget)
        self.entries = []
        self.closed = True              # until offload() took the model
        self.refills = 0                # weights whose source was swapped
        # (parameter, its original tensor) of the weights converted here
        t0 = time.perf_counter()
        self.converted = self._convert(units, dtypes or {})
        self.convert_s = time.perf_counter() - t0
        try:
            self._open(model, units, prefer_file, file_slice, label, root,
                       dtypes or {})
        except BaseException:
            self._restore()
            raise

    def _convert(self, units, dtypes):
        """Weights stored in another dtype than `dtypes` asks: each
        parameter's tensor becomes its conversion (convert_host); returns
        [(parameter, original tensor)]. A tied weight asked in two dtypes,
        or no memory to convert on the GPU: ValueError, nothing changed."""
        want = {}
        for _name, module, params in units:
            for key, pname in params:
                p = module._parameters[pname]
                d = dtypes.get(key, p.dtype)
                if want.setdefault(id(p), (p, d, key))[1] != d:
                    raise ValueError(
                        "%s is tied to %s, held in %s, but its op declares "
                        "%s" % (key, want[id(p)][2], want[id(p)][1], d))
        todo = [(p, d) for p, d, _key in want.values() if p.dtype != d]
        try:
            outs = convert_host([(p.data, d) for p, d in todo], self.target)
        except RuntimeError as e:
            if "out of memory" not in str(e):
                raise
            # ComfyUI's own path takes the model (ValueError).
            raise ValueError("converting %d weights to their ops' dtype on "
                             "%s ran out of memory" % (len(todo), self.target))
        done = []
        for (p, _d), out in zip(todo, outs):
            done.append((p, p.data))
            p.data = out
        # A weight converted from ComfyUI's mapping of the file: the pages
        # read leave the RSS (the originals stay mapped for close()).
        hostpolicy.drop_copied((t.data_ptr(), nbytes(t)) for _p, t in done
                               if t.device.type == "cpu")
        return done

    def _restore(self):
        """The converted parameters get their original tensors back; the
        quantized ops lose their parts and forward wrappers."""
        for p, t in self.converted:
            p.data = t
        self.converted = []
        for e in self.entries:
            if e.split is not None:
                e.split.remove()

    def _open(self, model, units, prefer_file, file_slice, label, root,
              dtypes):
        dev = self.dev
        splits = {}             # id(QuantizedTensor) -> its first key
        for _name, module, params in units:
            for key, pname in params:
                p = module._parameters[pname]
                split = None
                if quantized.is_quantized(p):
                    if splits.setdefault(id(p), key) != key:
                        raise ValueError("%s is a QuantizedTensor tied to %s"
                                         % (key, splits[id(p)]))
                    split = quantized.Split(key, module, pname, p)
                e = Entry(key, module, pname, p, split)
                want = dtypes.get(key, e.dtype)
                if e.dtype != want:     # never page other bytes than asked
                    raise ValueError("%s would be held in %s, its op "
                                     "declares %s" % (key, e.dtype, want))
                self.entries.append(e)
                if split is not None:   # its parts in, its forward wrapped
                    split.install()
        conv = {id(p) for p, _t in self.converted}
        self.by_key = {e.key: e for e in self.entries}
        # vpager.torch names a weight by its first key (a tensor tied to
        # several ops is one weight there, in each op's unit).
        first = {}
        for e in self.entries:
            first.setdefault(id(e.param), e.key)
        self.vt_name = {e.key: first[id(e.param)] for e in self.entries}
        by_key = self.by_key
        # A quantized weight's parts are vpager.torch's weights (by their
        # qualified names), not the wrapper.
        parts = {n: p for e in self.entries if e.split is not None
                 for n, (_pn, p, _a) in zip(e.split.names, e.split.parts)}

        def chosen(name, t):
            e = by_key.get(name)
            if e is not None:
                return e.split is None and e.param is t
            return parts.get(name) is t

        files = {}
        if prefer_file:
            for e in self.entries:
                if id(e.param) in conv:
                    continue        # the file holds the unconverted bytes
                if e.split is not None:
                    for n, (_pn, p, _a) in zip(e.split.names, e.split.parts):
                        fs = file_slice(p.data)
                        if fs is not None:
                            e.file = fs
                            files[n] = Source.from_file(fs[0], fs[1],
                                                        keep=p.data)
                    continue
                fs = file_slice(e.param.data)
                if fs is not None:
                    e.file = fs
                    files[e.key] = Source.from_file(fs[0], fs[1],
                                                    keep=e.param.data)

        def source(name, t):
            return files.get(name)      # name: a first key (vt_name)

        self.h = vpager.torch.offload(
            model, dev=dev, tensors=chosen,
            sources=source if files else None, outside="host",
            root=root if root is not None else model, schedule=True)
        self.closed = False
        if label:
            try:
                _ledger.name(self.h, label)
            except Exception:       # pragma: no cover - label too long
                pass

    # ------------------------------------------------------- the pager
    @property
    def vbar(self):
        return self.h.vbar

    @property
    def units(self):
        """vpager.torch's units: [(name, module, [weight names])]."""
        return self.h.units()

    @property
    def recording(self):
        return not self.closed and self.h.recording

    @property
    def replaced(self):
        return self.h.replaced

    @property
    def oom_margin(self):
        """The margin OOM retries raised (the device's Governor's)."""
        return self.gov.oom_margin

    def prioritize(self, force=False):
        """This model's VBAR on top of the device's priority list (the last
        model used keeps its pages longest)."""
        self.h.prioritize()

    def pause(self):
        """A sampling ended: what the model's last forward lent of torch's
        cache back before the work in between (vpager.torch's pause())."""
        if not self.closed:
            self.h.pause()

    def learn(self, force=False, before=None):
        """Activations first (CUDA): torch's memory declared to the
        device's Governor (vpager.torch.devices.learn_headroom; before:
        torch's peak before patches computed on the device since, whose
        temporaries are not the activations')."""
        if self.target.type != "cuda" or self.closed:
            return
        learn_headroom(self.dev, self.target.index or 0, force,
                       before=before)

    def refine(self):
        """Between prompts: a faster plan than the placement kept while
        the schedule measured placed now (OffloadHandle.refine)."""
        if self.closed:
            return False
        return self.h.refine()

    def torch_peak(self):
        """torch's peak on the device now (None: not CUDA)."""
        if self.target.type != "cuda" or self.closed:
            return None
        return torch_peak(self.dev, self.target.index or 0)

    def finish_recording(self):
        """Weights placed in the order their units ran, if the diffusion
        model's forward has not done it (a VAE's decode): once."""
        if self.closed:
            return False
        return self.h.place_by_use()

    def layout(self):
        """[(key, VBAR offset, bytes)] in VBAR order (of a tied tensor,
        its first key)."""
        return [(k, off, n) for k, off, n, _ in self.h.layout()]

    # ---------------------------------------------------------- patches
    def set_patched(self, key, patch, make, fill=None):
        """Weight `key` is to hold the patched weight for the patch set
        `patch` (compared with same_patch); patch None: its own bytes.
        fill(view): rewrites the weight's own bytes in `view` (a device
        tensor) into the patched ones, on the device, each time they are
        filled from their source (patch at fill, vpager.torch's
        set_fill: no host copy); make(): the patched weight (a tensor of
        its dtype and shape), copied to a host source of its own without
        fill. A QuantizedTensor's (split) parts: make() is the patched
        QuantizedTensor, its parts but the payload host copies, the
        payload patched by fill (it must compute what make() did), or
        without fill a host copy too. Changes the weight
        only when the patch set changed; returns True if it did (the
        weight refills at its next acquire)."""
        e = self.by_key[key]
        if same_patch(e.patch, patch):
            return False
        if e.split is not None:
            # ComfyUI's patching requantizes (the op's set_weight): each
            # part's source is the patched weight's part; with a fill the
            # payload's is its own bytes, patched at fill (fill computes
            # what make() did, from the same bytes on the same device).
            srcs = e.split.sources(None if patch is None else make())
            # Set one by one: until all are, the parts are of no patch set
            # (an error between two leaves them mixed: the next load, of
            # any patch set, sets them all again).
            e.patch = _MIXED
            at_fill = e.split.payload if patch is not None and \
                fill is not None else -1
            for i, (name, src) in enumerate(zip(e.split.names, srcs)):
                if i == at_fill:
                    self.h.set_fill(name, fill)
                else:
                    self.h.set_source(name, src)
            e.host_patched = patch is not None and at_fill < 0
            e.host_patched_bytes = 0 if patch is None else sum(
                quantized.nbytes(p) for i, (_n, p, _a)
                in enumerate(e.split.parts) if i != at_fill)
        elif fill is not None or patch is None:
            self.h.set_fill(self.vt_name[key],
                            None if patch is None else fill)
            e.host_patched = False
            e.host_patched_bytes = 0
        else:
            self.h.set_source(self.vt_name[key], make())
            e.host_patched = True
            e.host_patched_bytes = e.size
        e.patch = patch
        # The patch set its fills compute from, staged on the device once
        # the weight streams (patch_stage); a new set starts on the host.
        e.stage = PatchStage() if patch is not None and fill is not None \
            else None
        self.refills += 1
        return True

    def carry_patch(self, key, patch, host=None, place=None):
        """Weight `key` holds its own bytes for the patch set `patch`: its
        op applies the patches at each use (ComfyUI-GGUF's quantized
        weights carry them on the tensor), so nothing refills. place(p)
        puts p where the op reads it: `host` (the op's form of `patch`)
        copied to the device at once (patch_stage.CarriedPatches), until
        drop_stages places `host` again. The set it replaces is the
        caller's to take off (a weight left unpatched: place nothing)."""
        e = self.by_key[key]
        e.patch = patch
        e.carried = None if patch is None or place is None else \
            CarriedPatches(host, place, self.target)

    def patched_keys(self):
        return [e.key for e in self.entries if e.patch is not None]

    # ----------------------------------------------------------- ledger
    @property
    def weight_bytes(self):
        return sum(e.size for e in self.entries)

    def loaded_size(self):
        """Bytes of this model's weights resident in VRAM."""
        return 0 if self.closed else self.h.vbar.loaded_size()

    def free_memory(self, nbytes):
        """Evict at least `nbytes` of this model's unpinned pages if it
        has them; returns the bytes freed."""
        if self.closed or nbytes <= 0:
            return 0
        freed = self.h.free_memory(nbytes)
        if freed < nbytes:
            freed += self.drop_stages()
        return freed

    def drop_stages(self):
        """The patch sets staged on the device (patch_stage) let go: the
        fills compute from ComfyUI's again until a weight's next two, the
        ops that carry theirs from the host's until it changes; returns
        their bytes (torch's cache holds them until emptied)."""
        n = 0
        for e in self.entries:
            if e.stage is not None and e.stage.bytes:
                n += e.stage.bytes
                e.stage = PatchStage()
            if e.carried is not None:
                n += e.carried.drop()
        return n

    def host_bytes(self):
        """Host memory held for sources: the host copy, the patched
        copies, and the fills kept for streamed weights patched at fill
        (vpager.torch's keptfills.py; the others have none)."""
        if self.closed:
            return 0
        s = self.h.stats()["model"]
        return s["host_bytes"] + s["kept_fill_bytes"] + sum(
            e.host_patched_bytes for e in self.entries)

    def stats(self):
        """vpager.torch's stats() shape (python/README.md, "stats()"),
        the node's own figures in "model": its weights as ComfyUI holds
        them, converted_weights, quantized_weights, convert_ms,
        patched_weights, host_patched_weights (patched weights with a
        host copy), host_patched_bytes (those copies' bytes: of a
        QuantizedTensor patched at fill its small parts only),
        patch_staged_bytes (patch sets copied to the device, for the
        fills of streamed weights and for the ops that apply them at each
        use: patch_stage), refills, patch_fills,
        patch_fill_bytes."""
        s = self.h.stats()
        m = s["model"]
        m["weights"] = len(self.entries)
        m["weight_bytes"] = self.weight_bytes
        m["file_weights"] = sum(e.file is not None for e in self.entries)
        m["converted_weights"] = len(self.converted)
        m["quantized_weights"] = sum(e.split is not None
                                     for e in self.entries)
        m["convert_ms"] = self.convert_s * 1e3
        m["patched_weights"] = len(self.patched_keys())
        m["host_patched_weights"] = sum(e.host_patched
                                        for e in self.entries)
        m["host_patched_bytes"] = sum(e.host_patched_bytes
                                      for e in self.entries)
        # Patches computed at fill (on the device) since offload, and the
        # bytes they rewrote: a streamed patched weight's at each fill.
        m["patch_fills"] = self.h.hot_path.fills
        m["patch_fill_bytes"] = self.h.hot_path.fill_bytes
        m["patch_staged_bytes"] = sum(
            (e.stage.bytes if e.stage is not None else 0) +
            (e.carried.bytes if e.carried is not None else 0)
            for e in self.entries)
        m["refills"] = self.refills
        return s

    # ------------------------------------------------------------ close
    def close(self):
        """Wrappers out, parameters back to CPU tensors of their own (the
        host copy is freed; a converted weight gets its original tensor
        back), vpager objects closed. The model is then as ComfyUI loaded
        it (its own path can take it)."""
        if self.closed:
            return
        if self.h.busy:
            raise RuntimeError("vpager ComfyUI node: close() inside a forward")
        self.closed = True
        self.drop_stages()
        try:
            if self.dev.closed or self.h.closed:
                # The device closed first (process exit, tests): the host
                # copy is gone with it; close() gives the parameters
                # placeholders (file-sourced ones keep ComfyUI's file
                # tensor), not dangling memory.
                try:
                    self.h.close()
                except Exception:   # pragma: no cover - already gone
                    pass
                return
            self.h.unload()
        finally:
            self._restore()


# Entry.patch of a QuantizedTensor whose parts set_patched() left mixed
# (an error between two parts): same_patch() matches no patch set with it.
_MIXED = [object()]


def _same(a, b):
    """Equal for filling: the same object; tuples and lists item by item;
    tensors only when they are the same tensor; other values by ==."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def same_patch(a, b):
    """Two patch sets (lists of ComfyUI patch tuples (strength_patch,
    patch data, strength_model, offset, function)) give the same weight
    when they match item by item: the same patch objects (LoRA adapters,
    tensors), equal strengths and offsets, the same function. None is no
    patch. So a patcher clone, or a cached LoRA node's output, refills
    nothing; a new strength or another LoRA refills the weights it
    touches."""
    if a is None or b is None:
        return a is b
    return _same(list(a), list(b))
