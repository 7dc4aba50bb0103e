"""The node's engine, free of ComfyUI: one model's weights in a VBAR of a
shared vpager.Device, in the manner of vpager.torch's units.

A *unit* is a module whose forward reads its own weights (for ComfyUI: an
op of comfy.ops, Linear, Conv, norms, Embedding). Its forward is wrapped
(an instance attribute, as vpager.torch does): one vp_acquire for its
weights, each parameter's .data set to a view of the returned device
address, the original forward (ComfyUI's op, which casts on the GPU when
the stored dtype is not the compute dtype), then the CPU tensor back and
one vp_release on the current stream. vpager fills, stages and prefetches
on its copy stream; the op only ever computes on views.

Outside the forward a parameter holds a CPU tensor with the weight's
(unpatched) bytes: the pinned host copy, or ComfyUI's memory-mapped file
tensor when the weight's source is the file. So code that reads a weight
outside its op's forward sees the right values on the CPU (as under
ComfyUI's own dynamic loading), never garbage.

Sources: a pinned host copy (one HostBuf, at the VBAR's offsets so copies
of neighbours merge), or, when asked (ComfyUI's --fast-disk) and the
tensor is a slice of an open file, the file region itself (vpager's file
reader, no host copy). A patched weight (LoRA) gets a source of its own,
a pinned copy of the patched bytes; set_patched() swaps the source of
that weight only (vp_weight_destroy and a new weight at the same offset),
so only the weights whose patch changed are refilled.
"""

import concurrent.futures
import ctypes
import functools
import os
import time

import torch

import vpager
from vpager import _lib
from vpager.weights import Source, WeightBatch
from vpager.torch import ALIGN, view

try:    # the interleaved order's page-aligned groups (vpager.torch)
    from vpager.torch.placement import group_room as _group_room
    from vpager.torch.placement import groups as _groups
    from vpager.torch.placement import place as _place
except ImportError:         # pragma: no cover - an older vpager
    _groups = _place = _group_room = None

ALL = 1 << 62               # "evict everything unpinned"
_RESIDENT = _lib.VP_ACQUIRED_RESIDENT
_STAGED_VIEWS = 8
_OOM = getattr(torch.cuda, "OutOfMemoryError", None)


def is_oom(e):
    if _OOM is not None and isinstance(e, _OOM):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e)


def nbytes(t):
    return t.numel() * t.element_size()


def round_up(x, a):
    return (x + a - 1) // a * a


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


COPY_THREADS = 8            # threads making the host copy
_COPY_CHUNK = 64 << 20      # bytes a thread copies at a time


def copy_all(pairs):
    """dst.copy_(src) for each (dst, src) of CPU tensors, over a few
    threads in chunks (torch's copies release the GIL): reading a model
    out of ComfyUI's file mapping runs at memory speed, not one core's."""
    jobs = []
    for dst, src in pairs:
        n = dst.numel()
        if n == 0:
            continue
        step = max(_COPY_CHUNK // max(dst.element_size(), 1), 1)
        d, s = dst.view(-1), src.reshape(-1)
        for i in range(0, n, step):
            jobs.append((d[i:i + step], s[i:i + step]))
    threads = min(COPY_THREADS, len(jobs), os.cpu_count() or 1)
    if threads <= 1:
        for d, s in jobs:
            d.copy_(s)
        return

    def one(job):
        with torch.no_grad():
            job[0].copy_(job[1])
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))


class Entry:
    """One managed parameter: a vpager weight."""

    __slots__ = ("key", "module", "pname", "param", "dtype", "shape", "size",
                 "offset", "cpu", "host", "file", "base_src", "src", "w",
                 "unit", "rview", "staged", "patch", "patch_hb")

    def __init__(self, key, module, pname, param):
        self.key = key                  # state-dict key, e.g. "a.b.weight"
        self.module = module
        self.pname = pname
        self.param = param
        self.dtype = param.dtype
        self.shape = tuple(param.shape)
        self.size = nbytes(param)
        self.offset = 0
        self.cpu = param.data           # what .data holds outside forward
        self.host = None                # CPU view of its host copy slot
        self.file = None                # (fd, offset) when file-sourced
        self.base_src = None            # the unpatched source
        self.src = None                 # the source of its vpager weight
        self.w = None                   # its vpager.Weight
        self.unit = None
        self.rview = None               # view of its VBAR address
        self.staged = {}                # staging address -> view
        self.patch = None               # the patch set it was filled with
        self.patch_hb = None            # HostBuf of the patched bytes


class Unit:
    __slots__ = ("name", "module", "entries", "batch", "depth",
                 "had_forward", "saved_forward", "used")

    def __init__(self, name, module, entries):
        self.used = False       # acquired since the recording began
        self.name = name
        self.module = module
        self.entries = entries
        self.batch = None
        self.depth = 0
        self.had_forward = False
        self.saved_forward = None


class DevState:
    """Per vpager.Device: the pager on top of its priority list, and the
    memory kept for torch's activations (CUDA): user_headroom (what stays
    free, from the flags), budget (bytes this process may use on the GPU,
    weights and activations together, or None: no cap but the headroom)."""

    def __init__(self, dev, user_headroom, budget=None):
        self.top = None
        self.user_headroom = user_headroom
        self.budget = budget
        self.learned = 0
        self.limit = None
        self.learned_at = float("-inf")
        self.oom_margin = 0
        self.sync = dev.backend == "sim" and bool(dev.info()["async_copies"])


_DEVSTATES = {}


def devstate(dev, budget=None):
    """The DevState of dev (made at its first use, with `budget`)."""
    ds = _DEVSTATES.get(id(dev))
    if ds is None or ds[0] is not dev:
        ds = _DEVSTATES[id(dev)] = (dev, DevState(dev, dev.info()["headroom"],
                                                  budget))
    return ds[1]


LEARN_EVERY = 0.002
MARGIN_MAX = 256 << 20


def torch_reserved(index):
    """(bytes torch's caching allocator holds on CUDA device `index`, the
    most it has held): the seam the tests replace."""
    return (torch.cuda.memory_reserved(index),
            torch.cuda.max_memory_reserved(index))


def learn_headroom(dev, ds, index):
    """Activations first. What torch may still grab in the forward about to
    run (its peak reserved minus what it holds now, plus a margin: 5% of the
    peak, at most 256 MiB, raised by each OOM retry) stays free on top of
    the flags' headroom; with a budget (ComfyUI's --reserve-vram: the
    device's total less it), vpager may commit the budget less torch's
    peak and the margin, so weights and activations share the budget."""
    reserved, peak = torch_reserved(index)
    margin = max(min(peak // 20, MARGIN_MAX), ds.oom_margin)
    ds.learned = max(peak - reserved, 0) + margin
    dev.set_headroom(ds.user_headroom + ds.learned)
    if ds.budget is not None:
        limit = max(ds.budget - peak - margin, 0)
        if limit != ds.limit:
            dev.set_limit(limit)
            # A lower cap binds at the next commit; pages already resident
            # over it are given back now, so activations find their room.
            if ds.limit is None or limit < ds.limit:
                over = dev.stats()["committed_bytes"] - limit
                if over > 0:
                    dev.free_memory(over)
                    ds.top = None   # the next acquire: on top again
            ds.limit = limit
    return ds.learned


class Pager:
    """One model's weights in a VBAR of `dev` (a vpager.Device shared by
    every model on that GPU). units: [(name, module, [(key, pname)])] in
    execution order (module order for ComfyUI's models); target: the
    torch device the ops compute on (cuda:N, or cpu for the simulated
    device); prefer_file: file sources where the tensor is a file slice
    (file_slice(t) -> (fd, offset) or None); budget: the device's budget
    for weights and activations together (see learn_headroom), set by
    the first pager on the device."""

    def __init__(self, dev, target, units, prefer_file=False,
                 file_slice=comfy_file_slice, label=None, budget=None):
        self.dev = dev
        self.target = torch.device(target)
        self.ds = devstate(dev, budget)
        self.units = []
        self.entries = []
        for name, module, params in units:
            es = []
            for key, pname in params:
                p = module._parameters[pname]
                e = Entry(key, module, pname, p)
                e.unit = len(self.units)
                es.append(e)
            if es:
                self.units.append(Unit(name, module, es))
                self.entries.extend(es)
        self.by_key = {e.key: e for e in self.entries}
        self.vbar = self.hb = None
        self.closed = False
        self.refills = 0                # weights whose source was swapped
        self.replaced = 0               # re-placements in execution order
        self.recorded = []              # units in the order first acquired
        self.recording = True
        try:
            self._build(prefer_file, file_slice, label)
        except BaseException:
            self._close_objects()
            raise
        self._install()

    # ------------------------------------------------------------ build
    def _place(self, entries):
        """VBAR offsets of entries in this order, and the grouping. The
        interleaved eviction order (vpager.torch's default): the weights
        that do not fit are spread through the model, so their copies
        overlap the resident ones' compute."""
        grouping = (_groups(self.dev, "interleaved", entries)
                    if _groups is not None else None)
        if _place is not None:
            offsets, _end = _place(entries, ALIGN, grouping)
        else:
            offsets, end = [], 0
            for e in entries:
                end = round_up(end, ALIGN)
                offsets.append(end)
                end += e.size
        return offsets, grouping

    def _build(self, prefer_file, file_slice, label):
        dev, entries = self.dev, self.entries
        offsets, grouping = self._place(entries)
        for e, off in zip(entries, offsets):
            e.offset = off
        # Room for the weights in any order (re-placement keeps the VBAR).
        size = sum(round_up(e.size, ALIGN) for e in entries)
        room = _group_room(grouping, size) if _group_room else 0
        self.vbar = dev.create_vbar(max(size, 1) + room)
        if grouping is not None:
            self.vbar.set_order("interleaved")
        if label:
            try:
                self.vbar.label = label
            except Exception:       # pragma: no cover - label too long
                pass
        hosted = []
        for e in entries:
            fs = file_slice(e.cpu) if prefer_file else None
            if fs is not None:
                e.file = fs
                e.base_src = Source(_lib.VP_SOURCE_FILE, fd=fs[0],
                                    file_offset=fs[1], keep=e.cpu)
            else:
                hosted.append(e)
        if hosted:
            total = round_up(max(e.offset + e.size for e in hosted), ALIGN)
            self.hb = dev.alloc_hostbuf(total)
            base = self.hb.ptr
            # Outside inference mode: these become the parameters' data.
            with torch.no_grad(), torch.inference_mode(False):
                buf = torch.frombuffer(
                    (ctypes.c_uint8 * total).from_address(base),
                    dtype=torch.uint8)
                pairs = []
                for e in hosted:
                    h = buf[e.offset:e.offset + e.size].view(e.dtype)
                    pairs.append((h.view(e.shape), e.cpu.detach()))
                copy_all(pairs)
                for e, (h, _) in zip(hosted, pairs):
                    e.host = h
                    e.base_src = Source.from_host(base + e.offset)
                    # The host copy is the CPU tensor now: the old storage
                    # (ComfyUI's mapping or RAM) can go.
                    e.cpu = h
                    e.param.data = h
        for e in entries:
            e.src = e.base_src
        self._make_weights()

    def _make_weights(self):
        entries = self.entries
        ws = self.vbar.create_weights([e.offset for e in entries],
                                      [e.size for e in entries],
                                      [e.src for e in entries])
        for i, e in enumerate(entries):
            e.w = ws[i]
            e.rview = None
            e.staged = {}
        for u in self.units:
            self._batch(u)

    def _batch(self, u):
        u.batch = WeightBatch(self.dev, [e.w for e in u.entries])

    # ------------------------------------------------------- installing
    def _install(self):
        for u in self.units:
            fwd = u.module.forward
            u.had_forward = "forward" in u.module.__dict__
            u.saved_forward = u.module.__dict__.get("forward")
            u.module.forward = self._wrap(u, fwd)

    def _uninstall(self):
        for u in self.units:
            if u.had_forward:
                u.module.forward = u.saved_forward
            else:
                u.module.__dict__.pop("forward", None)

    def _wrap(self, unit, fwd):
        enter, leave, call = self._enter, self._leave, self._call

        @functools.wraps(fwd)
        def forward(*args, **kwargs):
            if unit.depth:
                return fwd(*args, **kwargs)
            stream = enter(unit)
            unit.depth = 1
            ok = False
            try:
                out = call(unit, fwd, args, kwargs)
                ok = True
            finally:
                unit.depth = 0
                leave(unit, stream, ok)
            return out

        forward._vpager_comfyui_unit = unit
        return forward

    def _stream(self):
        if self.target.type == "cuda":
            return torch.cuda.current_stream(self.target).cuda_stream
        return 0

    def prioritize(self, force=False):
        """This model's VBAR on top of the device's priority list (the last
        model used keeps its pages longest), its watermark raised again
        after an eviction lowered it."""
        if force or self.ds.top is not self:
            self.vbar.prioritize()
            self.ds.top = self

    def _evicted(self):
        """After vpager evicted on our request: the next acquire puts the
        model on top again (eviction lowers the VBAR's watermark)."""
        self.ds.top = None

    def _enter(self, unit):
        if self.closed:
            raise RuntimeError("vpager ComfyUI node: %s ran after its model's "
                               "pager was closed" % unit.name)
        self.prioritize()
        if self.recording and not unit.used:
            unit.used = True
            self.recorded.append(unit)
        stream = self._stream()
        batch = unit.batch
        ptrs = batch.acquire(stream)
        try:
            if self.ds.sync:
                self.dev.synchronize(stream)
            flags = batch.flags
            target = self.target
            for i, e in enumerate(unit.entries):
                p = ptrs[i]
                if flags[i] & _RESIDENT:
                    v = e.rview
                    if v is None:
                        v = e.rview = view(p, e.dtype, e.shape, target)
                else:
                    v = e.staged.get(p)
                    if v is None:
                        if len(e.staged) >= _STAGED_VIEWS:
                            e.staged.clear()
                        v = e.staged[p] = view(p, e.dtype, e.shape, target)
                e.param.data = v
        except BaseException:
            self._leave(unit, stream, False)
            raise
        return stream

    @staticmethod
    def _leave(unit, stream, raise_errors):
        for e in unit.entries:
            e.param.data = e.cpu
        try:
            unit.batch.release(stream)
        except vpager.Error:
            if raise_errors:
                raise

    def _call(self, unit, fwd, args, kwargs):
        """fwd(), once more after an out-of-memory error with vpager's
        unpinned pages evicted and torch's cache emptied."""
        try:
            return fwd(*args, **kwargs)
        except Exception as e:
            if not is_oom(e):
                raise
        self.dev.free_memory(ALL)
        self._evicted()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        self.ds.oom_margin = min(max(2 * self.ds.oom_margin, 2 * MARGIN_MAX),
                                 4 << 30)
        self.learn(force=True)
        return fwd(*args, **kwargs)

    def learn(self, force=False):
        """Activations first (CUDA): see learn_headroom()."""
        if self.target.type != "cuda" or self.closed:
            return
        now = time.monotonic()
        if force or now - self.ds.learned_at >= LEARN_EVERY:
            self.ds.learned_at = now
            learn_headroom(self.dev, self.ds, self.target.index or 0)

    # ---------------------------------------------------- re-placement
    def finish_recording(self):
        """After the model's first forward (or at its next load): if its
        units ran in another order than they lie in the VBAR (ComfyUI's
        models declare modules in another order than they call them:
        Flux's double blocks run image and text streams interleaved), the
        weights are placed again in the order of first use, units not used
        last, in module order, so vpager's prefetch and eviction follow
        execution. Once; returns True if it re-placed. Same VBAR, same
        sources: every weight refills once (the next forward's cost)."""
        if not self.recording or self.closed or not self.recorded:
            return False
        if any(u.depth for u in self.units):
            return False
        self.recording = False
        order = self.recorded + [u for u in self.units if not u.used]
        self.recorded = []
        if all(a is b for a, b in zip(order, self.units)):
            return False
        self._replace(order)
        return True

    def _replace(self, units):
        entries = [e for u in units for e in u.entries]
        old = [(e, e.offset) for e in self.entries]
        old_units = self.units
        # Eviction waits for the work that may still read the pages.
        self.vbar.free_memory(ALL)
        for e in self.entries:
            e.w.weights.destroy(e.w.index)
            e.w = None
        offsets, _ = self._place(entries)
        for i, u in enumerate(units):
            for e in u.entries:
                e.unit = i
        for e, off in zip(entries, offsets):
            e.offset = off
        self.units, self.entries = units, entries
        try:
            self._make_weights()
        except BaseException:
            # Back to the old places (or, failing that, closed).
            self.units = old_units
            self.entries = [e for e, _ in old]
            for i, u in enumerate(old_units):
                for e in u.entries:
                    e.unit = i
            for e, off in old:
                e.offset = off
            try:
                self._make_weights()
            except BaseException:
                self.close()
            raise
        self.replaced += 1
        self.prioritize(force=True)

    def layout(self):
        """[(key, VBAR offset, bytes)] in VBAR order."""
        return sorted(((e.key, e.offset, e.size) for e in self.entries),
                      key=lambda x: x[1])

    # ---------------------------------------------------------- patches
    def set_patched(self, key, patch, make):
        """Weight `key` is to hold the bytes `make()` returns (a tensor of
        its dtype and shape: the patched weight), filled for the patch set
        `patch` (compared with same_patch); patch None: its own bytes.
        Swaps the weight's source only when the patch set changed; returns
        True if it did (the weight refills at its next acquire)."""
        e = self.by_key[key]
        if same_patch(e.patch, patch):
            return False
        if patch is None:
            self._swap(e, e.base_src, None)
            e.patch = None
            return True
        t = make()
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise ValueError("patched %s is %s %s, the weight %s %s"
                             % (key, t.dtype, tuple(t.shape), e.dtype,
                                e.shape))
        hb = self.dev.alloc_hostbuf(max(e.size, 1))
        try:
            with torch.no_grad(), torch.inference_mode(False):
                dst = torch.frombuffer(
                    (ctypes.c_uint8 * max(e.size, 1)).from_address(hb.ptr),
                    dtype=torch.uint8)[:e.size].view(e.dtype).view(e.shape)
                dst.copy_(t.detach())
            self._swap(e, Source.from_host(hb.ptr), hb)
        except BaseException:
            hb.close()
            raise
        e.patch = patch
        return True

    def _swap(self, e, src, hb):
        """The weight at e's offset gets source `src`: its old weight is
        destroyed, its pages' contents dropped with it, a new one made."""
        ws = e.w.weights
        ws.destroy(e.w.index)
        nw = self.vbar.create_weights([e.offset], [e.size], [src])
        e.w = nw[0]
        e.src = src
        self._batch(self.units[e.unit])
        old, e.patch_hb = e.patch_hb, hb
        if old is not None:
            old.close()
        self.refills += 1

    def patched_keys(self):
        return [e.key for e in self.entries if e.patch is not None]

    # ----------------------------------------------------------- ledger
    @property
    def weight_bytes(self):
        return sum(e.size for e in self.entries)

    def loaded_size(self):
        """Bytes of this model's weights resident in VRAM."""
        return 0 if self.closed else self.vbar.loaded_size()

    def free_memory(self, nbytes):
        """Evict at least `nbytes` of this model's unpinned pages if it
        has them; returns the bytes freed."""
        if self.closed or nbytes <= 0:
            return 0
        freed = self.vbar.free_memory(min(int(nbytes), ALL))
        self._evicted()
        return freed

    def host_bytes(self):
        """Host memory held for sources: the host copy and patched copies."""
        n = self.hb.size if self.hb is not None else 0
        return n + sum(e.patch_hb.size for e in self.entries
                       if e.patch_hb is not None)

    def stats(self):
        s = self.vbar.stats()
        s["weights"] = len(self.entries)
        s["weight_bytes"] = self.weight_bytes
        s["resident_bytes"] = self.vbar.loaded_size()
        s["units"] = len(self.units)
        s["file_weights"] = sum(e.file is not None for e in self.entries)
        s["patched_weights"] = len(self.patched_keys())
        s["refills"] = self.refills
        s["replaced"] = self.replaced
        return s

    # ------------------------------------------------------------ close
    def close(self):
        """Wrappers out, parameters back to CPU tensors of their own (the
        host copy is freed), vpager objects closed. The model is then as
        ComfyUI loaded it (its own path can take it)."""
        if self.closed:
            return
        if any(u.depth for u in self.units):
            raise RuntimeError("vpager ComfyUI node: close() inside a forward")
        self._uninstall()
        # The device closed first (process exit, tests): the host copy is
        # gone with it; the parameters get empty stand-ins, not dangling
        # memory.
        gone = self.dev.closed or (self.hb is not None and self.hb.closed)
        with torch.no_grad(), torch.inference_mode(False):
            for e in self.entries:
                if e.host is not None:
                    e.cpu = (torch.zeros((), dtype=e.dtype).expand(e.shape)
                             if gone else e.host.clone())
                e.param.data = e.cpu
                e.host = e.rview = None
                e.staged = {}
        self.closed = True
        if self.ds.top is self:
            self.ds.top = None
        self._close_objects()

    def _close_objects(self):
        for e in self.entries:
            if e.patch_hb is not None and not e.patch_hb.closed:
                e.patch_hb.close()
                e.patch_hb = None
            e.w = e.base_src = e.src = None
        for obj in (self.vbar, self.hb):
            if obj is not None and not obj.closed:
                obj.close()


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
