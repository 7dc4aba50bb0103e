"""vpager.torch: run a PyTorch module whose weights vpager pages in.

    import vpager.torch
    h = vpager.torch.offload(model, device="cuda", budget="20G")
    y = model(x)                     # as before; weights stream as needed
    print(h.stats()["hits"], h.residency())
    h.unload()                       # parameters are ordinary tensors again

    # Or with the weights straight from a file, the model never in memory:
    model = build_model(device="meta")       # shapes only
    h = vpager.torch.offload(model, device="cuda", budget="20G",
                             weights_from="model.safetensors")

What offload() does
  * Places every parameter, and every persistent floating-point buffer, of
    the module in one VBAR, in module order (named_parameters order, which
    is usually execution order), each at an ALIGN-byte boundary, then in
    execution order after the first forward (see Placement order). Shared
    parameters are placed once.
  * Copies their bytes into one HostBuf at the same offsets (so vpager
    merges neighbouring copies) and makes them vpager weights whose source
    is that host copy. The host copy is then the only full copy: each
    parameter's storage is replaced by a placeholder (one NaN, or 0,
    expanded to the shape: .shape, .dtype, .device and numel() stay right).
  * Makes every "unit" acquire its weights before its forward and release
    them after it: a unit is a module that owns parameters itself (not only
    through children), or one of the FUSED types (torch's transformer
    layers, whose fast path reads their children's weights without calling
    the children; offload(units=...) adds types), and lies below no other
    unit; its weights are all those of its subtree (so
    nn.MultiheadAttention, which reads out_proj.weight without calling
    out_proj, is one unit). For plain models the units are the leaves
    (Linear, Conv, LayerNorm, Embedding).
    The unit's forward is wrapped (an instance attribute `forward`): one
    vp_acquire for the unit's weights, each parameter's .data set to a
    tensor view of the returned address (views of resident VBAR addresses
    are built once, staged ones cached per staging address), the original
    forward, then the placeholders back and one vp_release on the current
    stream. A unit whose forward raises still releases.

Placement order
  vpager prefetches, and evicts, in VBAR offset order, so the weights
  should lie there in the order the forward uses them. offload() places
  them in module order; the module's first complete forward records the
  order in which the units run (a forward pre-hook and a forward hook on
  the module, removed after that forward). If it differs from module order
  (a model declaring its layers in another order than it calls them), the
  weights are re-placed once, right after that forward: in the order of
  the units' first use, units the forward did not run last, in module
  order. Re-placing keeps the VBAR, its counters and the host copy: it
  evicts the VBAR's pages (waiting for work that may still read them),
  destroys the weights and makes them again at the new offsets with the
  same sources, so the next forward fills them anew (a one-time cost). The
  host copy stays in module order (copies of one unit's weights still
  merge). A first forward run inside h.acquired(), or one that raised,
  records nothing: the next one does. offload(reorder=False) keeps module
  order; h.units() and h.layout() show the placement. Forwards that call
  the units in different orders keep the first one's.
  The default eviction order is interleaved: the weights that do not fit
  are spread through the model, so their copies overlap the compute of the
  resident ones from the start of each forward (with "tail" the resident
  prefix computes first while the copy engine waits for room). Eviction
  takes whole groups of weights (vpager.h, VP_ORDER_INTERLEAVED): weights
  are placed in groups that start on a page boundary, each holding at
  least 1/32 of the weights or half the staging ring, whichever is less
  (but 4 pages or more), and ending where the least padding is needed.

Weights from safetensors files
  offload(module, ..., weights_from=path) takes the weights from a
  safetensors file whose keys are the module's state_dict() names (of
  tied tensors one name is enough, as safetensors' save_model writes
  them; if several are there, the first is used). The module's tensors are
  only a description: they may be on the meta device (nn.Linear(..., device=
  "meta")) or uninitialised, and are never read; meta tensors are replaced
  by new Parameter objects (placeholders, no memory). Each parameter's
  source is the file (vp_st_source): vpager reads it through its file
  reader (pinned bounce slots, the page cache) whenever the weight is
  filled or staged, so the model is never materialised in host memory and
  there is no host copy (stats()["host_bytes"] counts what there is).
  Buffers (which training mode updates in place) get a pinned host copy
  read from the file, and the state_dict tensors vpager does not manage
  (integer buffers such as BatchNorm's num_batches_tracked, empty
  parameters) are loaded from the file into the module. The file stays
  open, and must not change, until unload() or close(); state_dict() and
  unload() read it. load_safetensors(h_or_module, path) does the same for
  a module already offloaded: its parameters' sources become the file and
  its host copy is freed. The file is matched against the module first:
  a tensor missing from the file, one the module lacks, or a dtype or
  shape mismatch raises ValueError naming every such tensor, and nothing
  changes (the module keeps its weights; a meta module stays on meta).
  The trade-off: a file source is read (and, on CUDA, bounced through
  pinned slots) at each fill or miss, where a pinned host copy is copied
  straight at link speed; a budget that holds the model, or the page
  cache, hides it.

The module keeps working with the usual calls: eval()/train(),
torch.no_grad(), torch.inference_mode(), forward hooks, state_dict() (which
returns CPU copies taken from the host copy). Gradients of the weights are
not supported: offload() sets requires_grad=False on the parameters it
manages (unload() restores the flags). Gradients with respect to inputs
work: a weight that autograd saves for backward is cloned first, since the
memory behind the view is reused after the release. A forward that returns
a view of a weight gets a copy too.

Limits (each detected and raised as an error, never silently wrong):
  * offloading a module or parameter that is already offloaded (ValueError);
  * a managed parameter or buffer replaced after offload (module.weight =
    nn.Parameter(...)), or converted (.to(), .half()): RuntimeError at the
    unit's next forward, naming it; load_state_dict(): RuntimeError;
  * sparse, quantized, meta or non-contiguous parameters (ValueError before
    anything changes; make them contiguous first; with weights_from, meta
    and non-contiguous ones are fine);
  * a CUDA model on the simulated device (ValueError);
  * using a module after its handle was closed (RuntimeError).
Code that reads a parameter outside the forward of the unit holding it
(say, a parent's forward using child.weight directly) sees the placeholder:
NaN values for floating dtypes. Wrap such code in `with h.acquired():`.
An offloaded module is not thread-safe (one forward at a time).

Devices and budget
  The module computes on `device`: a CUDA device ("cuda", "cuda:1", 1), or
  "cpu"/"sim": the simulated device, whose memory is host memory, so the
  tensors are CPU tensors (tests and CI). By default: the device the
  module's parameters are on. A CPU module can be offloaded to a GPU (the
  usual case: it does not fit there); unload() brings it back to the CPU.
  `budget` caps the device memory vpager uses (pages, staging ring):
  a cap on vpager's own commits (vp_device_set_limit). Several
  modules share one device, and its budget, through open_device():

      d = vpager.torch.open_device("cuda", budget="20G")
      ha = vpager.torch.offload(a, dev=d); hb = vpager.torch.offload(b, dev=d)

  The module that starts a forward moves its VBAR to the top of the
  priority list (vp_vbar_prioritize), so pressure evicts the other's pages.

Activations first (CUDA)
  vpager's budget is polled against the device's free memory, so torch's
  allocator growing shrinks what vpager may commit. Each root forward also
  (at most one every 2 ms) sets the device's headroom to the larger of the
  user's (the device's when vpager.torch first used it) and what torch may
  still grab: its peak (max_memory_reserved) minus what it holds now
  (memory_reserved), plus a margin (5% of the peak, at most 256 MiB; an
  OOM retry raises it); stats()["activation_headroom"] shows it. If torch
  still runs out of memory inside a unit's forward, every unpinned weight
  page is evicted (vp_device_free_memory), torch's cache is emptied and the
  forward is run once more; a second failure is re-raised with a message.

unload() vs close()
  unload(): parameters become ordinary tensors on their original device
  again (from the host copy), wrappers and hooks are removed, vpager objects
  freed; the module works as before offload(). close(): vpager objects are
  freed and nothing is restored (no copy back, for when the module is done
  with); the module is left unusable: its forward and state_dict() raise
  RuntimeError. A `with offload(...) as h:` block unloads at its end.
"""

import contextlib
import ctypes
import functools
import os
import time
import weakref

import torch

from . import _lib
from ._torch_files import load_unmanaged as _load_unmanaged
from ._torch_files import match_file as _match_file
from ._torch_placement import group_room as _group_room
from ._torch_placement import groups as _groups
from ._torch_placement import place as _place
from ._torch_placement import round_up as _round_up
from ._views import nbytes as _nbytes
from ._views import placeholder as _placeholder
from ._views import view
from .device import Device
from .errors import Error
from .options import default_options, parse_size
from .weights import Source, WeightBatch

__all__ = ["offload", "open_device", "load_safetensors", "Offloaded", "view",
           "ALIGN", "FUSED"]

ALIGN = 512             # bytes; each weight starts at such a boundary
_SLOT_ALIGN = 256       # the staging ring's slot alignment (src/stream.c)
_STAGED_VIEWS = 8       # staged views cached per weight
_RESIDENT = _lib.VP_ACQUIRED_RESIDENT
_ALL = 1 << 62          # "evict everything unpinned"

_OPEN, _UNLOADED, _CLOSED = "open", "unloaded", "closed"

_OOM = getattr(torch.cuda, "OutOfMemoryError", None)

# Modules whose forward may read their children's weights without calling
# the children (torch's fused fast paths): each is one unit, whole.
FUSED = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
         torch.nn.MultiheadAttention)


def _is_oom(e):
    if _OOM is not None:
        return isinstance(e, _OOM)
    return isinstance(e, RuntimeError) and "out of memory" in str(e)


def _size(value):
    if value is None or isinstance(value, int):
        return value
    return parse_size(value)


def _parse_device(device):
    if isinstance(device, str) and device == "sim":
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def _cuda_index(target):
    return (target.index if target.index is not None
            else torch.cuda.current_device())


# -------------------------------------------------------------- devices

class _DevState:
    """What vpager.torch keeps per vpager.Device."""

    __slots__ = ("top", "users", "owned", "sync", "user_headroom", "learned",
                 "oom_margin", "learned_at", "__weakref__")

    def __init__(self, dev, owned):
        self.top = None            # the Offloaded whose VBAR is on top
        self.users = set()         # live Offloaded handles on the device
        self.owned = owned         # opened by vpager.torch: closed with
        # the last user
        # Simulated streams in worker mode run copies later, on a thread;
        # torch's CPU ops run now, in the caller: wait for the copies.
        info = dev.info()
        self.sync = dev.backend == "sim" and bool(info["async_copies"])
        # Activations first (CUDA): the headroom the device had when
        # vpager.torch first used it is the user's; the learned one is
        # never below it, and is put back when the last model leaves.
        self.user_headroom = info["headroom"]
        self.learned = 0           # torch's peak - what it holds + margin
        self.oom_margin = 0        # raised by each OOM retry
        self.learned_at = float("-inf")  # when a forward last learned


_DEVSTATES = weakref.WeakKeyDictionary()


def _devstate(dev, owned=False):
    ds = _DEVSTATES.get(dev)
    if ds is None:
        ds = _DEVSTATES[dev] = _DevState(dev, owned)
    return ds


# Activations first: how far torch's caching allocator may still grow.
_LEARN_EVERY = 0.002           # seconds between two learns by forwards
_MARGIN_FRAC = 20              # margin: 1/20 (5%) of torch's peak ...
_MARGIN_MAX = 256 << 20        # ... but at most 256 MiB
_OOM_MARGIN_MAX = 4 << 30      # what OOM retries may raise it to


def _torch_reserved(index):
    """(bytes torch's caching allocator holds on CUDA device `index` now,
    the most it has held). A seam: the tests replace it.

    torch.cuda.memory_reserved() flattens every allocator statistic into a
    new dict (about 200 us on the H200 host): read the two numbers from the
    nested statistics instead where this torch has them."""
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    if nested is not None:
        try:
            r = nested(index)["reserved_bytes"]["all"]
            return int(r["current"]), int(r["peak"])
        except (KeyError, TypeError, RuntimeError):
            pass
    return (torch.cuda.memory_reserved(index),
            torch.cuda.max_memory_reserved(index))


def _learn_headroom(dev, ds, index):
    """Set the device's headroom so that vpager leaves torch room for the
    activations of the forward about to run; returns the headroom set.

    cuMemGetInfo (the budget's device_free_now) already counts what torch's
    allocator holds as used, so that needs no room kept for it; what must
    stay free is how much more torch may grab during this forward: its peak
    (max_memory_reserved, over the process's life: never reset, since
    resetting would clobber the user's own peak statistics) minus what it
    holds now, plus a margin for a forward that goes a little further
    than any before (5% of the peak, at most 256 MiB; each OOM retry raises
    it). Never below the user's headroom."""
    reserved, peak = _torch_reserved(index)
    margin = max(min(peak // _MARGIN_FRAC, _MARGIN_MAX), ds.oom_margin)
    ds.learned = max(peak - reserved, 0) + margin
    head = max(ds.user_headroom, ds.learned)
    dev.set_headroom(head)
    return head


def _apply_budget(dev, budget):
    """Let vpager use at most `budget` bytes of the device, however much
    torch allocates later (the headroom still keeps device memory free)."""
    dev.set_limit(budget)


def _open(target, budget, lookahead, need, options):
    opts = dict(options)
    if target.type == "cuda":
        opts.setdefault("backend", "cuda")
        opts.setdefault("device_index", _cuda_index(target))
    else:
        opts.setdefault("backend", "sim")
        if budget is not None:
            opts.setdefault("sim_capacity", budget)
    if lookahead is not None:
        opts["lookahead"] = lookahead
    if "staging_size" not in opts:
        # The ring is charged to the budget; it must hold a unit's missed
        # weights at once, and twice that lets one unit's copies overlap
        # the previous unit's compute.
        staging = default_options()["staging_size"]
        if budget is not None:
            staging = min(staging, max(budget // 4, 2 * need))
        opts["staging_size"] = max(staging, need)
    if "lookahead" not in opts and "VPAGER_LOOKAHEAD" not in os.environ:
        # Prefetch may fill the whole ring ahead: a shorter lookahead
        # leaves the copy engine idle under long runs of resident weights
        # (H200, 32-layer decoder prefill: 114.5 ms at the ring's 512 MiB,
        # 117.8 ms at the library's 256 MiB default).
        opts["lookahead"] = parse_size(opts["staging_size"])
    dev = Device(**opts)
    try:
        if budget is not None:
            _apply_budget(dev, budget)
    except BaseException:
        dev.close()
        raise
    return dev


def open_device(device=None, budget=None, lookahead=None, **options):
    """A vpager.Device for torch modules, to share between offload(...,
    dev=d) calls: `device` "cuda"/"cuda:N"/N for a GPU, "cpu"/"sim" for the
    simulated device (default: CUDA when torch has it, else sim); `budget`
    bytes (int or "20G") of device memory vpager may use in all; options:
    any vp_options_t field (vpager.OPTION_NAMES). Close it yourself (after
    the models on it are unloaded or closed)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _open(_parse_device(device), _size(budget), _size(lookahead), 0,
                 options)


def _resolve_target(src, device, dev):
    """The torch device a module whose parameters are on `src` computes on,
    given offload()'s `device` and `dev` arguments."""
    if src.type not in ("cpu", "cuda"):
        raise ValueError("vpager.torch: parameters on %s cannot be offloaded "
                         "(their bytes are needed)" % src)
    if dev is not None:
        if dev.backend == "sim":
            target = torch.device("cpu")
        else:
            target = torch.device("cuda", dev.options["device_index"])
        if device is not None:
            want = _parse_device(device)
            if want.type == "cuda" and want.index is None \
                    and target.type == "cuda":
                want = target
            if want != target:
                raise ValueError("vpager.torch: device=%s but the vpager "
                                 "device serves %s" % (want, target))
    elif device is not None:
        target = _parse_device(device)
    else:
        target = src
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if target.type not in ("cpu", "cuda"):
        raise ValueError("vpager.torch: cannot run on %s (cuda, or cpu for "
                         "the simulated device)" % target)
    if src.type == "cuda" and target.type == "cpu":
        raise ValueError("vpager.torch: the module's parameters are on %s "
                         "but the simulated device (CPU tensors) was asked "
                         "for: offload onto a CUDA device, or move the "
                         "module to the CPU first" % src)
    return target


# ----------------------------------------------------- what gets managed

class _Entry:
    """One managed tensor: a vpager weight."""

    __slots__ = ("index", "name", "tensor", "is_param", "dtype", "shape",
                 "size", "offset", "src_device", "requires_grad", "host",
                 "file_addr", "src", "rview", "staged", "ph", "ph_ptr", "cur",
                 "curv")

    def __init__(self, index, name, tensor, is_param):
        self.index = index
        self.name = name                  # qualified name (first place)
        self.tensor = tensor              # the Parameter / buffer object
        self.is_param = is_param
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.size = _nbytes(tensor.dtype, self.shape)
        self.offset = 0
        self.src_device = tensor.device
        self.requires_grad = bool(tensor.requires_grad)
        self.host = None                  # CPU tensor over the HostBuf
        self.file_addr = None             # or: its bytes in the mapped file
        self.src = None                   # its vpager.Source
        self.rview = None                 # view of its VBAR address
        self.staged = {}                  # staging address -> view
        self.ph = None                    # placeholder
        self.ph_ptr = 0
        self.cur = 0                      # address while acquired, else 0
        self.curv = None                  # the view set while acquired


class _Unit:
    """A module whose forward acquires a group of weights."""

    __slots__ = ("prefix", "name", "module", "entries", "slots", "buffers",
                 "batch", "depth", "saved_forward", "had_forward", "pack")

    def __init__(self, prefix, module):
        self.prefix = prefix    # qualified name in the offloaded module
        self.name = prefix or "<root>"
        self.module = module
        self.entries = []       # _Entry, in placement order
        self.slots = []         # (dict, key, tensor, qualified name)
        self.buffers = []       # (owner module, _Entry) of managed buffers
        self.batch = None
        self.depth = 0
        self.saved_forward = None
        self.had_forward = False
        self.pack = None


def _managed_buffer(owner, name, buf):
    return (buf is not None and (buf.is_floating_point() or buf.is_complex())
            and name not in owner._non_persistent_buffers_set
            and buf.numel() > 0)


def _check_tensor(qual, t, from_file=False):
    h = getattr(t, "_vpager_handle", None)
    if h is not None:
        if h._state is _CLOSED:
            raise ValueError("vpager.torch: %s belonged to an offloaded "
                             "module that was closed: its weights were freed"
                             % qual)
        if h._state is _OPEN:
            raise ValueError("vpager.torch: %s is already offloaded (%r); "
                             "unload() it first" % (qual, h))
    if t.layout != torch.strided:
        raise ValueError("vpager.torch: %s is a %s tensor; only dense "
                         "(strided) tensors can be offloaded"
                         % (qual, t.layout))
    if t.is_quantized:
        raise ValueError("vpager.torch: %s is quantized (%s); its bytes are "
                         "not a plain array" % (qual, t.dtype))
    if from_file:
        return              # its bytes come from the file: any device, strides
    if t.device.type == "meta":
        raise ValueError("vpager.torch: %s is on the meta device: it has no "
                         "bytes to offload (load the weights first, or "
                         "offload(..., weights_from=path))" % qual)
    if not t.is_contiguous():
        raise ValueError("vpager.torch: %s is not contiguous (strides %s); "
                         "make it contiguous before offload (e.g. p.data = "
                         "p.data.contiguous())" % (qual, t.stride()))


def _unit_rule(units):
    """A predicate: is this module a unit of its own, whole subtree?"""
    if units is None:
        return lambda m: isinstance(m, FUSED)
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, (tuple, list, set, frozenset)):
        types = tuple(units) + FUSED
        return lambda m: isinstance(m, types)
    if callable(units):
        return lambda m: isinstance(m, FUSED) or bool(units(m))
    raise TypeError("vpager.torch.offload: units= takes module types or a "
                    "predicate, not %s" % type(units).__name__)


def _collect(module, whole=None, from_file=False):
    """Units, entries and owners of a module; raises ValueError (changing
    nothing) for what cannot be offloaded. whole(m): m is a unit, whole.
    from_file: the bytes will come from a file (meta tensors are fine)."""
    whole = whole or _unit_rule(None)
    units = []
    seen_units = set()
    owners = {}     # id(module) -> (module, [(name, _Entry)]) it holds

    def owns(m):
        return (any(p is not None and p.numel() > 0
                    for p in m._parameters.values())
                or any(_managed_buffer(m, n, b)
                       for n, b in m._buffers.items()))

    def visit(m, prefix):
        if id(m) in seen_units:
            return
        seen_units.add(id(m))
        if owns(m) or (whole(m) and any(True for _ in m.parameters())):
            units.append(_Unit(prefix.rstrip("."), m))
            return
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    entries = []
    by_id = {}
    for u in units:
        in_unit = set()
        for mname, sub in u.module.named_modules(prefix=u.prefix):
            sp = mname + "." if mname else ""
            items = [(n, p, True) for n, p in sub._parameters.items()
                     if p is not None and p.numel() > 0]
            items += [(n, b, False) for n, b in sub._buffers.items()
                      if _managed_buffer(sub, n, b)]
            for n, t, is_param in items:
                qual = sp + n
                e = by_id.get(id(t))
                if e is None:
                    _check_tensor(qual, t, from_file)
                    e = _Entry(len(entries), qual, t, is_param)
                    by_id[id(t)] = e
                    entries.append(e)
                u.slots.append((sub._parameters if is_param else sub._buffers,
                                n, t, qual))
                held = owners.setdefault(id(sub), (sub, {}))[1]
                held[n] = e
                if not is_param:
                    u.buffers.append((sub, e))
                if id(t) not in in_unit:
                    in_unit.add(id(t))
                    u.entries.append(e)
    owners = [(m, sorted(held.items())) for m, held in owners.values()]
    return units, entries, owners


def _unmanaged(module, managed):
    """(dict, key, tensor, is_param) of tensors left as they are (integer
    and non-persistent buffers, empty parameters)."""
    out = []
    seen = set()
    for m in module.modules():
        for d, is_param in ((m._parameters, True), (m._buffers, False)):
            for k, t in d.items():
                if t is None or id(t) in managed or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((d, k, t, is_param))
    return out


def _cuda_stream(target):
    return torch.cuda.current_stream(target).cuda_stream


def _unpack(t):
    return t


def _sources(dev, entries, align, st=None, plan=None):
    """Where each entry's bytes live: [(host, file_addr, Source)] and the
    HostBuf holding the host copies (None if no entry has one).

    Without a file every entry gets a slot of one new HostBuf (in entries'
    order, align-aligned: the VBAR's offsets when that is their order),
    filled from its tensor; a CPU tensor is pointed at its slot at once,
    so its old storage can go. With a file (st, plan from _match_file),
    parameters get a FILE source (vp_st_source) and no host copy; buffers,
    which training mode updates in place, get a HostBuf slot filled from
    the file."""
    base = st.mmap()[0] if st is not None else 0
    slots = [None] * len(entries)
    hosted = []
    for i, e in enumerate(entries):
        if st is not None and e.is_param:
            info = plan[e]
            slots[i] = (None, base + info.offset, st.source(info.index))
        else:
            hosted.append(i)
    if not hosted:
        return None, slots
    offsets, total = _place([entries[i] for i in hosted], align)
    hb = dev.alloc_hostbuf(total)
    moved = []
    try:
        with torch.no_grad(), torch.inference_mode(False):
            host = torch.frombuffer(
                (ctypes.c_uint8 * total).from_address(hb.ptr),
                dtype=torch.uint8)
            for i, off in zip(hosted, offsets):
                e = entries[i]
                h = host[off:off + e.size].view(e.dtype).view(e.shape)
                if st is not None:
                    ctypes.memmove(h.data_ptr(), base + plan[e].offset,
                                   e.size)
                else:
                    h.copy_(e.tensor.detach())
                    if e.src_device.type == "cpu":
                        # The host copy serves until the placeholders go
                        # in: the old storage can go now (peak host memory
                        # = one model, not two).
                        e.tensor.data = h
                        moved.append(e)
                slots[i] = (h, None, Source.from_host(hb.ptr + off))
    except BaseException:
        with torch.no_grad(), torch.inference_mode(False):
            for e in moved:
                e.tensor.data = e.tensor.data.clone()
        hb.close()
        raise
    return hb, slots


# ------------------------------------------------------------- offload

def offload(module, device=None, budget=None, lookahead=None, order=None,
            dev=None, units=None, align=ALIGN, weights_from=None,
            reorder=True, **options):
    """Page `module`'s weights through vpager; returns an Offloaded handle.

    device: where it computes ("cuda", "cuda:N", N, or "cpu"/"sim" for the
        simulated device); default: where its parameters are. A
        vpager.Device may be passed here too (same as dev=).
    budget: bytes (int or "8G") of device memory vpager may use.
    lookahead: bytes prefetched past each acquire (vp_device_set_lookahead;
        default for a device offload() opens: the staging ring's size,
        unless VPAGER_LOOKAHEAD is set).
    order: the VBAR's eviction order: "interleaved" (the default unless
        VPAGER_ORDER or the evict_order option says otherwise: the weights
        that do not fit are spread through the model, so their copies
        overlap the resident weights' compute) or "tail" (the last weights
        are the ones streamed). See "Placement order" in the module doc.
    dev: a vpager.Device to use (from open_device(), shared with other
        models); budget and lookahead then change that device.
    units: module types (or a predicate on modules) whose forward reads
        their children's weights directly, so that each is acquired whole
        (added to vpager.torch.FUSED: torch's transformer layers and
        attention).
    weights_from: a safetensors file (keys: the module's state_dict names)
        to take the weights from instead of the module's tensors, which may
        then be on the meta device or uninitialised: parameters are read
        from the file when needed (no host copy), the rest is loaded from
        it now. See "Weights from safetensors files" in the module doc.
    reorder: re-place the weights in the order the first forward uses them
        (default True; see "Placement order" in the module doc).
    options: vp_options_t fields for the device offload opens (page_size,
        staging_size, sim_capacity, ...); not allowed with dev.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError("vpager.torch.offload: a torch.nn.Module, not %s"
                        % type(module).__name__)
    if isinstance(device, Device):
        if dev is not None and dev is not device:
            raise ValueError("vpager.torch.offload: two different "
                             "vpager.Device objects given")
        dev, device = device, None
    if dev is not None and options:
        raise TypeError("vpager.torch.offload: options (%s) apply only to a "
                        "device offload() opens, not to dev="
                        % ", ".join(sorted(options)))
    budget, lookahead = _size(budget), _size(lookahead)
    if align < 1 or align & (align - 1):
        raise ValueError("vpager.torch.offload: align must be a power of "
                         "two, not %r" % align)
    from_file = weights_from is not None
    if from_file and not os.path.isfile(weights_from):
        raise ValueError("vpager.torch.offload: weights_from=%r is not a "
                         "file" % (weights_from,))
    if order is None and "VPAGER_ORDER" not in os.environ and \
            "evict_order" not in options:
        order = "interleaved"
    swapped = _unmeta(module) if from_file else []
    try:
        return _offload(module, device, budget, lookahead, order, dev, units,
                        align, weights_from, reorder, options, swapped)
    except BaseException:
        for d, k, old in swapped:
            d[k] = old
        raise


def _unmeta(module):
    """With weights_from, meta tensors are replaced by CPU placeholders (a
    meta tensor's .data cannot be set to a real one): new Parameter objects
    (the same one wherever one was shared), or buffers. Returns [(dict,
    key, old tensor)] to put them back on failure. A meta buffer that is not
    persistent (so no file holds it): ValueError, nothing changed."""
    swapped, new = [], {}
    for m in module.modules():
        for k in m._non_persistent_buffers_set:
            b = m._buffers.get(k)
            if b is not None and b.device.type == "meta":
                raise ValueError(
                    "vpager.torch.offload: buffer %r of %s is on the meta "
                    "device and is not persistent, so no file holds it: "
                    "make it a real tensor first" % (k, type(m).__name__))
    with torch.no_grad(), torch.inference_mode(False):
        for m in module.modules():
            for d, is_param in ((m._parameters, True), (m._buffers, False)):
                for k, t in list(d.items()):
                    if t is None or t.device.type != "meta":
                        continue
                    r = new.get(id(t))
                    if r is None:
                        ph = _placeholder(t.dtype, t.shape, "cpu")
                        r = (torch.nn.Parameter(ph, t.requires_grad)
                             if is_param else ph)
                        new[id(t)] = r
                    swapped.append((d, k, t))
                    d[k] = r
    return swapped


def _offload(module, device, budget, lookahead, order, dev, units, align,
             weights_from, reorder, options, swapped):
    from_file = weights_from is not None
    units, entries, owners = _collect(module, _unit_rule(units), from_file)
    if not entries:
        raise ValueError("vpager.torch.offload: %s has no parameters or "
                         "floating-point buffers to offload"
                         % type(module).__name__)
    srcs = {e.src_device for e in entries}
    if len(srcs) > 1:
        raise ValueError("vpager.torch.offload: parameters are on several "
                         "devices (%s); move the module to one first"
                         % ", ".join(sorted(str(s) for s in srcs)))
    target = _resolve_target(srcs.pop(), device, dev)
    offsets, _ = _place(entries, align)
    for e, off in zip(entries, offsets):
        e.offset = off
    # Room for any order of the weights (re-placement keeps the VBAR).
    vbar_size = sum(_round_up(e.size, align) for e in entries)
    need = max(sum(_round_up(e.size, _SLOT_ALIGN) for e in u.entries)
               for u in units)
    return Offloaded(module, units, entries, owners, vbar_size, need, target,
                     dev, budget, lookahead, order, options, align,
                     weights_from, reorder,
                     {id(d[k]) for d, k, _ in swapped})


def load_safetensors(module_or_handle, path):
    """Fill an offloaded module's weights from the safetensors file `path`
    (keys: the module's state_dict names); returns its Offloaded handle.
    The parameters' sources become the file (read through vpager's file
    reader when a unit needs them; the host copy is freed), the buffers
    and the tensors vpager does not manage are loaded from it now. Tensors
    missing from the file or the module, or of another dtype or shape:
    ValueError naming them, and nothing changes. To start from a module
    that holds no weights (meta device), use offload(..., weights_from=)."""
    h = module_or_handle
    if not isinstance(h, Offloaded):
        if not isinstance(h, torch.nn.Module):
            raise TypeError("vpager.torch.load_safetensors: an offloaded "
                            "module or its Offloaded handle, not %s"
                            % type(h).__name__)
        module, h = h, None
        for t in list(module.parameters()) + list(module.buffers()):
            h = getattr(t, "_vpager_handle", None)
            if h is not None:
                break
        if h is None:
            raise ValueError("vpager.torch.load_safetensors: %s is not "
                             "offloaded: offload(module, ..., weights_from="
                             "path) pages its weights from the file"
                             % type(module).__name__)
        if h.module is not module:
            raise ValueError("vpager.torch.load_safetensors: this %s is part "
                             "of an offloaded %s: load the whole module's "
                             "file into it" % (type(module).__name__,
                                               type(h.module).__name__))
    return h.load_safetensors(path)


class Offloaded:
    """The handle offload() returns: module, device (the vpager.Device),
    vbar, target (the torch device it computes on), order (the VBAR's
    eviction order, "interleaved" or "tail"); stats(), residency(),
    layout(), prioritize(), acquired(), load_safetensors(), unload(),
    close(). See the module doc."""

    def __init__(self, module, units, entries, owners, vbar_size, need,
                 target, dev, budget, lookahead, order, options,
                 align=ALIGN, weights_from=None, reorder=True, fresh=()):
        self.module = module
        self._owners = owners
        self.target = target
        self._units = units
        self._entries = entries
        self._align = align
        self._state = _OPEN
        self._hooks = []
        self._order_hooks = []
        self._moved = []
        self._held = 0              # acquired() blocks open
        self._rec = None            # units in the order a forward ran them
        self._rec_seen = set()
        owned = dev is None
        if owned:
            dev = _open(target, budget, lookahead, need, options)
        vb = hb = st = None
        try:
            ds = _devstate(dev, owned)
            if not owned:
                self._check_staging(dev, need)
                if budget is not None:
                    _apply_budget(dev, budget)
                if lookahead is not None:
                    dev.set_lookahead(lookahead)
            plan = loads = None
            if weights_from is not None:
                st = dev.open_safetensors(weights_from)
                plan, loads = _match_file(module, entries, st,
                                          "offload(weights_from=...)")
            groups = _groups(dev, order, entries)
            if groups is not None:      # re-place: groups need the page
                offsets, _ = _place(entries, align, groups)
                for e, off in zip(entries, offsets):
                    e.offset = off
            vb = dev.create_vbar(vbar_size + _group_room(groups, vbar_size))
            if order is not None:
                vb.set_order(order)
            hb, slots = _sources(dev, entries, align, st, plan)
            for e, (host, addr, src) in zip(entries, slots):
                e.host, e.file_addr, e.src = host, addr, src
            ws = vb.create_weights([e.offset for e in entries],
                                   [e.size for e in entries],
                                   [e.src for e in entries])
            if loads:
                _load_unmanaged(st, loads, fresh)
        except BaseException:
            with torch.no_grad(), torch.inference_mode(False):
                for e in entries:
                    if e.host is not None and e.tensor.data_ptr() == \
                            e.host.data_ptr():
                        e.tensor.data = e.host.clone()
                    e.host = e.src = e.file_addr = None
            for obj in (vb, hb, st):
                if obj is not None:
                    try:
                        obj.close()
                    except Error:
                        pass
            if owned:
                _DEVSTATES.pop(dev, None)
                dev.close()
            raise
        self.device = dev
        self.vbar = vb
        self._hb = hb
        self._st = st
        self._weights = ws
        self._groups = groups
        self.order = "tail" if groups is None else "interleaved"
        self._batches()
        self._ds = ds
        ds.users.add(self)
        if target.type == "cuda":
            self._stream = functools.partial(_cuda_stream, target)
            self._index = _cuda_index(target)
        else:
            self._stream = int          # int() == 0: the default stream
            self._index = 0
        self._install(reorder)

    def _batches(self):
        ws, dev = self._weights, self.device
        for u in self._units:
            u.batch = WeightBatch(dev, [ws[e.index] for e in u.entries])

    # ------------------------------------------------------ installing
    @staticmethod
    def _check_staging(dev, need):
        page = dev.page_size
        ring = _round_up(max(dev.options["staging_size"], page), page)
        if need > ring:
            raise ValueError("vpager.torch: a module of this model needs %d "
                             "bytes of staging at once, the device's ring "
                             "holds %d: open the device with staging_size "
                             ">= %d" % (need, ring, need))

    def _install(self, reorder=True):
        module, target = self.module, self.target
        managed = {id(e.tensor) for e in self._entries}
        with torch.no_grad(), torch.inference_mode(False):
            for e in self._entries:
                t = e.tensor
                if e.is_param:
                    t.requires_grad_(False)
                e.ph = _placeholder(e.dtype, e.shape, target)
                e.ph_ptr = e.ph.data_ptr()
                t.data = e.ph
                t._vpager_handle = self
            for d, k, t, is_param in _unmanaged(module, managed):
                if t.device == target:
                    continue
                moved = t.to(target)
                self._moved.append((d, k, t, is_param, t.device))
                if is_param:
                    t.data = moved
                else:
                    d[k] = moved
        if any(e.src_device.type == "cuda" for e in self._entries):
            torch.cuda.empty_cache()    # the old storage is vpager's now
        for u in self._units:
            u.pack = functools.partial(self._pack, u)
            fwd = u.module.forward
            u.had_forward = "forward" in u.module.__dict__
            u.saved_forward = u.module.__dict__.get("forward")
            u.module.forward = self._wrap(u, fwd)
        for m, items in self._owners:
            self._hooks.append(m._register_state_dict_hook(
                functools.partial(self._state_dict_hook, items)))
            self._hooks.append(m._register_load_state_dict_pre_hook(
                functools.partial(self._load_hook, items)))
        if target.type == "cuda":     # activations first: see _learn()
            self._hooks.append(module.register_forward_pre_hook(
                self._learn_hook))
        if reorder and len(self._units) > 1:
            self._order_hooks = [
                module.register_forward_pre_hook(self._order_start),
                module.register_forward_hook(self._order_end)]

    def _wrap(self, unit, fwd):
        enter, leave, call = self._enter, self._leave, self._call
        writeback = self._writeback
        escapes = self._escapes
        owner = self

        @functools.wraps(fwd)
        def forward(*args, **kwargs):
            if owner._rec is not None:  # the first forward: record the order
                owner._record(unit)
            if unit.depth:              # the unit calls itself: weights set
                return fwd(*args, **kwargs)
            stream, prev = enter(unit)
            unit.depth = 1
            ok = False
            try:
                if torch.is_grad_enabled():
                    with torch.autograd.graph.saved_tensors_hooks(unit.pack,
                                                                  _unpack):
                        out = call(unit, fwd, args, kwargs)
                else:
                    out = call(unit, fwd, args, kwargs)
                out = escapes(unit, out)
                if unit.buffers:
                    writeback(unit)
                ok = True
            finally:
                unit.depth = 0
                leave(unit, stream, prev, ok)
            return out

        forward._vpager_unit = unit
        return forward

    # ------------------------------------------------ activations first
    def _learn_hook(self, module, args):
        # Reading torch's statistics costs ~30 us: at most once every
        # _LEARN_EVERY seconds, so short forwards do not pay it each time
        # (a bigger forward in between is what the OOM retry is for).
        now = time.monotonic()
        if now - self._ds.learned_at >= _LEARN_EVERY:
            self._ds.learned_at = now
            self._learn()

    def _learn(self):
        """At the start of each root forward (CUDA only: the simulated
        device has no torch allocator to learn from): keep free what
        torch may still grab (_learn_headroom). Two torch calls and one
        vp call per root forward."""
        if self._state is _OPEN and not self.device.closed:
            _learn_headroom(self.device, self._ds, self._index)

    # --------------------------------------------------- placement order
    def _record(self, unit):
        if unit not in self._rec_seen:
            self._rec_seen.add(unit)
            self._rec.append(unit)

    def _order_start(self, module, args):
        self._rec = []
        self._rec_seen = set()

    def _order_end(self, module, args, out):
        rec, self._rec = self._rec, None
        self._rec_seen = set()
        if rec is None or self._state is not _OPEN or self.device.closed:
            return
        if self._held or any(u.depth for u in self._units):
            return                  # inside acquired(): the next forward
        for hk in self._order_hooks:
            hk.remove()
        self._order_hooks = []
        self._replace(rec)

    def _replace(self, first):
        """Place the weights anew in the VBAR: those of the units in
        `first` in that order, then the others in their order so far."""
        units, seen = [], set()
        for u in list(first) + self._units:
            if u not in seen:
                seen.add(u)
                units.append(u)
        entries, placed = [], set()
        for u in units:
            for e in u.entries:
                if e not in placed:
                    placed.add(e)
                    entries.append(e)
        entries += [e for e in self._entries if e not in placed]
        if [id(e) for e in entries] != [id(e) for e in self._entries]:
            offsets, _ = _place(entries, self._align, self._groups)
            self._swap(entries, offsets, [e.src for e in entries])
        self._units = units

    def _swap(self, entries, offsets, sources):
        """Re-create the weights: entries[i] at VBAR offset offsets[i] with
        source sources[i]. The VBAR's pages are evicted first (eviction
        waits for the work that may still read them), so every weight is
        filled anew when next acquired. All or nothing: on failure the old
        weights are made again (or, if even that fails, the handle is
        closed) and the error raised."""
        vb = self.vbar
        old = [(e, e.offset, e.src) for e in self._entries]
        vb.free_memory(_ALL)
        self._weights.close()
        try:
            ws = vb.create_weights(offsets, [e.size for e in entries],
                                   sources)
        except BaseException:
            try:
                self._weights = vb.create_weights(
                    [o for _, o, _ in old], [e.size for e, _, _ in old],
                    [s for _, _, s in old])
                self._batches()
            except BaseException:
                self.close()
            raise
        for i, e in enumerate(entries):
            e.index, e.offset, e.src = i, offsets[i], sources[i]
            e.rview = None
            e.staged = {}
        self._entries = entries
        self._weights = ws
        self._batches()
        vb.prioritize()             # eviction lowered the watermark
        self._ds.top = self

    # ------------------------------------------------------- hot path
    def _check_open(self):
        if self._state is not _OPEN:
            raise RuntimeError(
                "vpager.torch: this module's offload was %s%s" % (
                    self._state, "; its weights were freed (close())"
                    if self._state is _CLOSED else ""))
        if self.device.closed:
            raise RuntimeError("vpager.torch: the vpager.Device of this "
                               "offloaded module was closed")

    def _enter(self, unit):
        """Acquire a unit's weights and point its tensors at them; returns
        (stream, what to restore at release)."""
        self._check_open()
        for d, key, t, qual in unit.slots:
            if d.get(key) is not t:
                raise RuntimeError(
                    "vpager.torch: %s (in %s) was replaced after offload(); "
                    "its weights are vpager's: unload() before changing "
                    "parameters, then offload again" % (qual, unit.name))
        entries = unit.entries
        for e in entries:
            if not e.cur and e.tensor.data_ptr() != e.ph_ptr:
                raise RuntimeError(
                    "vpager.torch: %s was changed after offload() (by .to(), "
                    ".half(), .data = ...?); unload() first, change the "
                    "module, then offload again" % e.name)
        ds = self._ds
        if ds.top is not self:
            self.vbar.prioritize()
            ds.top = self
        stream = self._stream()
        batch = unit.batch
        ptrs = batch.acquire(stream)
        prev = [(e.cur, e.curv) for e in entries]
        try:
            if ds.sync:
                self.device.synchronize(stream)
            flags = batch.flags
            for i, e in enumerate(entries):
                p = ptrs[i]
                if flags[i] & _RESIDENT:
                    v = e.rview
                    if v is None:
                        v = e.rview = view(p, e.dtype, e.shape, self.target)
                else:
                    v = e.staged.get(p)
                    if v is None:
                        if len(e.staged) >= _STAGED_VIEWS:
                            e.staged.clear()
                        v = e.staged[p] = view(p, e.dtype, e.shape,
                                               self.target)
                e.tensor.data = v
                e.cur, e.curv = p, v
        except BaseException:
            self._leave(unit, stream, prev, False)
            raise
        return stream, prev

    def _leave(self, unit, stream, prev, raise_errors):
        for e, (p, v) in zip(unit.entries, prev):
            e.tensor.data = v if p else e.ph
            e.cur, e.curv = p, v
        try:
            unit.batch.release(stream)
        except Error:
            if raise_errors:
                raise
            # An exception is already on its way out; it is the news.

    def _call(self, unit, fwd, args, kwargs):
        try:
            return fwd(*args, **kwargs)
        except Exception as e:
            if not _is_oom(e):
                raise
            first = str(e)  # not e: its frames hold the activations
        freed = self.device.free_memory(_ALL)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        # The learned headroom was too small: raise its margin (doubling,
        # from twice the usual cap), now for the rest of this forward too.
        ds = self._ds
        ds.oom_margin = min(max(2 * ds.oom_margin, 2 * _MARGIN_MAX),
                            _OOM_MARGIN_MAX)
        if self.target.type == "cuda":
            self._learn()
        try:
            return fwd(*args, **kwargs)
        except Exception as e:
            if not _is_oom(e):
                raise
            raise type(e)(
                "vpager.torch: out of device memory in %s (%s) even after "
                "vpager evicted %d bytes of unpinned weights and torch "
                "emptied its cache; lower offload()'s budget or the batch. "
                "First failure: %s. Second: %s"
                % (unit.name, type(unit.module).__name__, freed, first, e)
            ) from e

    @staticmethod
    def _aliases(unit, t):
        """True if tensor t lies in memory of the unit's acquired weights."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return False
        p = t.data_ptr()
        for e in unit.entries:
            if e.cur and e.cur <= p < e.cur + e.size:
                return True
        return False

    def _pack(self, unit, t):
        # Autograd saves t for backward, which runs after the release.
        return t.clone() if self._aliases(unit, t) else t

    def _escapes(self, unit, out):
        """out, with tensors that view the weights replaced by copies."""
        aliases = self._aliases
        if isinstance(out, torch.Tensor):
            return out.clone() if aliases(unit, out) else out
        if isinstance(out, (tuple, list)) and any(aliases(unit, x)
                                                  for x in out):
            items = [x.clone() if aliases(unit, x) else x for x in out]
            if isinstance(out, list):
                return items
            return type(out)(*items) if hasattr(out, "_fields") \
                else tuple(items)
        if isinstance(out, dict) and any(aliases(unit, x)
                                         for x in out.values()):
            return type(out)((k, x.clone() if aliases(unit, x) else x)
                             for k, x in out.items())
        return out

    def _writeback(self, unit):
        """In training mode modules update buffers in place (BatchNorm's
        running stats): copy them to the host copy, the weights' source,
        so a refill brings the new values."""
        with torch.no_grad():
            for owner, e in unit.buffers:
                if owner.training:
                    e.host.copy_(e.curv)

    # -------------------------------------------------------- state_dict
    @staticmethod
    def _host_copy(e):
        """A new CPU tensor with the weight's bytes (host copy or file)."""
        if e.host is not None:
            return e.host.clone()
        with torch.inference_mode(False):
            out = torch.empty(e.shape, dtype=e.dtype)
        if e.size:
            ctypes.memmove(out.data_ptr(), e.file_addr, e.size)
        return out

    def _state_dict_hook(self, items, module, state_dict, prefix,
                         local_metadata):
        self._check_open()
        with torch.no_grad(), torch.inference_mode(False):
            for name, e in items:
                key = prefix + name
                if key in state_dict:
                    state_dict[key] = self._host_copy(e)

    def _load_hook(self, items, state_dict, prefix, *rest):
        for name, e in items:
            if prefix + name in state_dict and self._state is not _UNLOADED:
                raise RuntimeError(
                    "vpager.torch: load_state_dict() into an offloaded "
                    "module (%s%s): load before offload(), or unload() "
                    "first" % (prefix, name))

    # ------------------------------------------------------------ public
    def __repr__(self):
        return ("<vpager.torch.Offloaded %s of %s: %d weights, %d bytes on "
                "%s>" % (self._state, type(self.module).__name__,
                         len(self._entries), self.weight_bytes,
                         self.target))

    def __enter__(self):
        return self

    def __deepcopy__(self, memo):
        raise TypeError("vpager.torch: an offloaded module cannot be copied "
                        "or pickled (its weights live in vpager); copy it "
                        "before offload(), or unload() first")

    def __reduce_ex__(self, protocol):
        self.__deepcopy__(None)

    def __exit__(self, *exc):
        if self._state is _OPEN:
            self.unload()
        return False

    @property
    def closed(self):
        """True once unload() or close() ran."""
        return self._state is not _OPEN

    @property
    def weight_bytes(self):
        return sum(e.size for e in self._entries)

    def units(self):
        """[(qualified name, module, [weight names])] in placement order."""
        return [(u.name, u.module, [e.name for e in u.entries])
                for u in self._units]

    def layout(self):
        """[(weight name, VBAR offset, bytes, "host" or "file")] in VBAR
        order: where each weight lives and where its bytes come from."""
        self._check_open()
        return [(e.name, e.offset, e.size,
                 "host" if e.host is not None else "file")
                for e in self._entries]

    def load_safetensors(self, path):
        """vpager.torch.load_safetensors(self, path): see there."""
        self._check_open()
        self._idle("load_safetensors")
        dev = self.device
        st = dev.open_safetensors(path)
        hb = None
        try:
            plan, loads = _match_file(self.module, self._entries, st,
                                      "load_safetensors")
            hb, slots = _sources(dev, self._entries, self._align, st, plan)
            self._swap(list(self._entries), [e.offset for e in self._entries],
                       [src for _, _, src in slots])
        except BaseException:
            for obj in (hb, st):
                if obj is not None:
                    try:
                        obj.close()
                    except Error:
                        pass
            raise
        for e, (host, addr, src) in zip(self._entries, slots):
            e.host, e.file_addr = host, addr
        old = (self._hb, self._st)
        self._hb, self._st = hb, st
        with torch.no_grad(), torch.inference_mode(False):
            _load_unmanaged(st, loads)
        for obj in old:
            if obj is not None:
                obj.close()
        return self

    def stats(self):
        """The VBAR's counters (vpager.STAT_NAMES: hits, fills, misses,
        acquires, weight_fills, weight_staged, ...), plus "device": the
        device's counters (all models on it), "weights", "weight_bytes",
        "vbar_bytes", "resident_bytes", "units", "host_bytes" (the
        pinned host copy), "file_weights" (weights read from a file) and
        "activation_headroom" (CUDA: what the last forward learned torch
        may still grab, margin included; the device's headroom is the
        larger of it and the user's; 0 before a forward and on the
        simulated device)."""
        self._check_open()
        s = self.vbar.stats()
        s["device"] = self.device.stats()
        s["weights"] = len(self._entries)
        s["weight_bytes"] = self.weight_bytes
        s["vbar_bytes"] = self.vbar.size
        s["resident_bytes"] = self.vbar.loaded_size()
        s["units"] = len(self._units)
        s["host_bytes"] = self._hb.size if self._hb is not None else 0
        s["file_weights"] = sum(e.host is None for e in self._entries)
        s["activation_headroom"] = self._ds.learned
        return s

    def residency(self):
        """One byte per VBAR page: vpager.PAGE_RESIDENT | PAGE_PINNED."""
        self._check_open()
        return self.vbar.residency()

    def report(self, json=False):
        """The device's report (all models on it): text, or parsed JSON."""
        self._check_open()
        return self.device.report(json=json)

    def prioritize(self):
        """Move this model's VBAR to the top of the device's priority list
        (done automatically when its forward starts after another model's)."""
        self._check_open()
        self.vbar.prioritize()
        self._ds.top = self

    @contextlib.contextmanager
    def acquired(self, *modules):
        """Acquire weights for the block: those of the given submodules
        (their subtrees), or every weight of the model (then the staging
        ring must hold all that is not resident). For code that reads
        parameters outside the forward of the unit holding them; forwards
        inside the block use the same tensors."""
        self._check_open()
        if modules:
            ids = {id(t) for m in modules
                   for t in list(m.parameters()) + list(m.buffers())}
            entries = [e for e in self._entries if id(e.tensor) in ids]
        else:
            entries = self._entries
        whole = _Unit("acquired()", self.module)
        whole.entries = entries
        whole.batch = WeightBatch(self.device,
                                  [self._weights[e.index] for e in entries])
        held = {id(e) for e in entries}
        covered = [u for u in self._units
                   if all(id(e) in held for e in u.entries)]
        stream, prev = self._enter(whole)
        for u in covered:
            u.depth += 1
        self._held += 1
        ok = False
        try:
            yield self.module
            ok = True
        finally:
            self._held -= 1
            for u in covered:
                u.depth -= 1
            self._leave(whole, stream, prev, ok)

    def _idle(self, what):
        if self._held or any(u.depth for u in self._units):
            raise RuntimeError("vpager.torch: %s() inside the module's "
                               "forward" % what)

    def unload(self):
        """Parameters back as ordinary tensors on their original device
        (from the host copy), requires_grad restored, wrappers and hooks
        removed, vpager objects freed. The module works as before offload().
        A second call does nothing; after close() it raises."""
        if self._state is _UNLOADED:
            return self.module
        if self._state is _CLOSED:
            raise RuntimeError("vpager.torch: unload() after close(): the "
                               "weights were freed")
        self._check_open()          # the device (and host copy) still there
        self._idle("unload")
        # Device memory first: a GPU model needs the room to come back.
        self.vbar.close()
        with torch.no_grad(), torch.inference_mode(False):
            for e in self._entries:
                t = e.tensor
                if e.host is None:          # file-backed
                    t.data = self._host_copy(e).to(e.src_device)
                else:
                    t.data = (e.host.clone() if e.src_device.type == "cpu"
                              else e.host.to(e.src_device))
                if e.is_param:
                    t.requires_grad_(e.requires_grad)
            for d, k, t, is_param, where in self._moved:
                if is_param:
                    t.data = t.data.to(where)
                elif d.get(k) is not None:
                    d[k] = d[k].to(where)
        self._state = _UNLOADED
        self._uninstall()
        self._free()
        return self.module

    def close(self):
        """Free the vpager objects without restoring the weights; the module
        is left unusable (its forward and state_dict() raise RuntimeError).
        A second call, or close() after unload(), does nothing."""
        if self._state is not _OPEN:
            return
        self._idle("close")
        self._state = _CLOSED
        for e in self._entries:
            e.rview = e.curv = None
            e.staged = {}
        self._free()

    def _uninstall(self):
        for u in self._units:
            if u.had_forward:
                u.module.forward = u.saved_forward
            else:
                u.module.__dict__.pop("forward", None)
            u.batch = None
        for h in self._hooks + self._order_hooks:
            h.remove()
        self._hooks = []
        self._order_hooks = []
        self._rec = None
        for e in self._entries:
            e.rview = e.curv = None
            e.staged = {}
            try:
                del e.tensor._vpager_handle
            except AttributeError:
                pass

    def _free(self):
        for e in self._entries:
            e.host = e.file_addr = e.src = None
        ds, dev = self._ds, self.device
        errors = []
        for obj in (self.vbar, self._hb, self._st):
            if obj is None:
                continue
            try:
                obj.close()
            except Error as e:
                errors.append(e)
        ds.users.discard(self)
        if ds.top is self:
            ds.top = None
        if ds.owned and not ds.users and not dev.closed:
            _DEVSTATES.pop(dev, None)
            dev.close()
        elif not ds.users and not dev.closed and ds.learned:
            try:                    # the device is the user's again
                dev.set_headroom(ds.user_headroom)
            except Error as e:
                errors.append(e)
            ds.learned = 0
        if errors:
            raise errors[0]
