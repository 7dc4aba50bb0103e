"""Devices for vpager.torch: the torch device a module computes on, the
vpager.Device it pages through (opened here with a staging ring sized to
the budget and the device, or shared by the caller), and activations
first: on CUDA, the headroom that leaves torch's allocator room."""

import sys
import time
import warnings
import weakref
from typing import Any, Union

import torch

from .. import BACKEND_SIM, env, gpu_backend
from ..device import Device
from ..errors import BusyError, Error
from ..governor import governor
from ..options import default_options, parse_size
from .config import Size, size_argument, torch_device, warn_budget_over
from .lend import Lender
from .placement import round_up

__all__ = ["open_device"]


def parse_device(device):
    if isinstance(device, str) and device == "sim":
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def cuda_index(target):
    return (target.index if target.index is not None
            else torch.cuda.current_device())


# ------------------------------------------------- which torch device

def _asks_for_sim(options):
    backend = (options or {}).get("backend")
    return backend in ("sim", BACKEND_SIM)


def default_device(options=None):
    """Where a CPU module computes when no device is named: CUDA when torch
    has it (unless the options ask for backend="sim"), else the simulated
    device (CPU tensors)."""
    if not _asks_for_sim(options) and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


_SIM_NOTED = [False]    # warned once in this process


def note_simulated(asked, stacklevel=3):
    """Warn, once per process, that vpager.torch runs on the simulated
    device: asked for (device="cpu"/"sim"), or because torch has no CUDA."""
    if _SIM_NOTED[0]:
        return
    _SIM_NOTED[0] = True
    why = ("device=%r was asked for" % (asked,) if asked is not None
           else "torch has no CUDA device")
    warnings.warn("vpager.torch: %s, so the model runs on vpager's simulated "
                  "device: its memory is host memory, tensors are CPU tensors "
                  "and compute is the CPU's (meant for tests and CI; with a "
                  "GPU, pass device=\"cuda\")" % why, RuntimeWarning,
                  stacklevel=stacklevel)


def _shared_target(dev, device):
    """The torch device a shared vpager.Device serves; ValueError if
    offload()'s device= names another."""
    if dev.backend == "sim":
        target = torch.device("cpu")
    else:
        target = torch.device("cuda", dev.options["device_index"])
    if device is not None:
        want = parse_device(device)
        if want.type == "cuda" and want.index is None \
                and target.type == "cuda":
            want = target
        if want != target:
            raise ValueError("vpager.torch: device=%s but the vpager "
                             "device serves %s" % (want, target))
    return target


def resolve_target(src, device, dev, options=None):
    """The torch device a module whose parameters are on `src` computes on,
    given offload()'s `device` and `dev` arguments (and its options: an
    explicit backend="sim" asks for the simulated device). A CUDA module
    stays on its GPU; a CPU one goes to CUDA when torch has it."""
    if src.type not in ("cpu", "cuda"):
        raise ValueError("vpager.torch: parameters on %s cannot be offloaded "
                         "(their bytes are needed)" % src)
    if dev is not None:
        target = _shared_target(dev, device)
    elif device is not None:
        target = parse_device(device)
    elif src.type == "cuda":
        target = src
    else:
        target = default_device(options)
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


# ------------------------------------------------------- per device

class DevState:
    """What vpager.torch keeps per vpager.Device (its limit, headroom and
    lookahead are its Governor's: gov)."""

    __slots__ = ("_top", "users", "owned", "sync", "gov", "lender",
                 "__weakref__")

    def __init__(self, dev, owned):
        self._top = None           # the Offloaded whose VBAR is on top
        # Both weak: a handle whose module was dropped can die (and leave
        # the ledger: vpager.torch.ledger's finalizer).
        self.users = weakref.WeakSet()  # live Offloaded handles on the device
        self.owned = owned         # opened by vpager.torch: closed with
        # the last user
        # Simulated streams in worker mode run copies later, on a thread;
        # torch's CPU ops run now, in the caller: wait for the copies.
        info = dev.info()
        self.sync = dev.backend == "sim" and bool(info["async_copies"])
        # Activations first (CUDA), the budget, the prefetch windows: the
        # device's one Governor (vpager.governor) derives and writes them.
        self.gov = governor(dev)
        # torch's idle cache lent to the ring between forwards (lend.py).
        self.lender = Lender(dev)

    @property
    def top(self):
        return self._top() if self._top is not None else None

    @top.setter
    def top(self, handle):
        self._top = weakref.ref(handle) if handle is not None else None


DEVSTATES = weakref.WeakKeyDictionary()
# Devices whose staging ring open_for() sized (staging_size not given): a
# model attached later may grow it (attach()).
SIZED_RINGS = weakref.WeakSet()


def devstate(dev, owned=False):
    ds = DEVSTATES.get(dev)
    if ds is None:
        ds = DEVSTATES[dev] = DevState(dev, owned)
    return ds


def leave(dev, ds, handle):
    """`handle` no longer uses dev: the device is closed with its last
    user if vpager.torch opened it, else its headroom is the user's
    again. Returns the errors met."""
    errors = []
    ds.users.discard(handle)
    if ds.top is handle:
        ds.top = None
    if ds.owned and not ds.users and not dev.closed:
        DEVSTATES.pop(dev, None)
        dev.close()
    elif not ds.users and not dev.closed:
        try:
            ds.gov.forget_learned()
        except Error as e:
            errors.append(e)
    return errors


# ------------------------------------------------ activations first

LEARN_EVERY = 0.002            # seconds between two learns by forwards


def torch_reserved(index):
    """(bytes torch's caching allocator holds on CUDA device `index` now,
    the most it has held). vpager.torch._torch_reserved is this function,
    and is the seam: the tests replace it there.

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


def torch_reserved_now(index):
    """The bytes torch's caching allocator holds on CUDA device `index`
    now (through the seam, vpager.torch._torch_reserved)."""
    return sys.modules[__package__]._torch_reserved(index)[0]


def torch_peak(dev, index):
    """The most torch's caching allocator has held on CUDA device `index`
    (through the seam, vpager.torch._torch_reserved) as dev's Governor
    reads it (Governor.peak_seen)."""
    counter = sys.modules[__package__]._torch_reserved(index)[1]
    return governor(dev).peak_seen(counter)


def learn_headroom(dev, index, force=False, before=None):
    """Declare torch's memory on CUDA device `index` to dev's Governor
    (at most every LEARN_EVERY s unless force), so that vpager leaves
    torch room for the activations of the forward about to run; returns
    the headroom, or None when it was learned too recently.

    before: torch's peak (torch_peak) before vpager's own work on the
    device since the last learn, done once (fills of resident weights: a
    LoRA's patch computed at an acquire). If that work raised it, or torch
    holds more than it now (the work's temporaries, freed but cached: a
    peak masked before reads lower than what torch holds), they go back
    to the device (empty_cache) and the Governor reads the raised peak
    as `before` (Governor.mask_torch_peak). (fp8 Flux with a LoRA at half
    its bytes, H100: torch held 1.5-1.7 GB of the fills' cache at a
    forward's start under a masked 0.95 GB peak, and the limit fell from
    1.48 to 0.51-0.83 GB for that forward.)

    cuMemGetInfo (the budget's device_free_now) already counts what torch's
    allocator holds as used, so that needs no room kept for it; what must
    stay free is how much more torch may grab during this forward: its peak
    (max_memory_reserved, over the process's life: vpager never resets it,
    and the Governor keeps the largest it has read, for a client that does
    to measure its own work: bench/comfyui_run.py per prompt, which made
    each prompt's first forward plan for 0.9 GB more than the activations
    left) minus what it holds now, plus the margin (vpager.governor)."""
    gov = governor(dev)
    now = time.monotonic()
    if not force and now - gov.learned_at < LEARN_EVERY:
        return None
    gov.learned_at = now
    read = sys.modules[__package__]._torch_reserved
    reserved, peak = read(index)
    # (The Governor's peak, not the counter: a client may have reset the
    # counter since the work raised it.)
    if before is not None and max(gov.peak_seen(peak), reserved) > before:
        torch.cuda.empty_cache()
        reserved, peak = read(index)
        gov.mask_torch_peak(peak, before)
    return gov.declare_torch(reserved, peak)


# ------------------------------------------------------ the ring

_RING_SHARE = 4         # the ring takes at most 1/4 of what vpager may use


def ring_size(room, need, page, budget=True):
    """Staging ring bytes for a device on which vpager may commit `room`
    bytes, for a model whose largest unit stages `need` bytes at once. At
    most the default staging_size and a quarter of room; with a budget
    twice need if that is more (one unit's copies then overlap the
    previous unit's compute). Never below need, and need alone when more
    would not fit in room."""
    default = default_options()["staging_size"]
    ring = min(default, room // _RING_SHARE)
    if budget:
        ring = max(ring, min(default, 2 * need))
    if ring_pages(ring, page) > room:
        ring = need
    return max(ring, need)


def ring_pages(ring, page):
    """Device bytes a ring of `ring` bytes takes: whole pages, one or more."""
    return round_up(max(ring, page), page)


def _refusal(fn, ring, room, budget, largest, fixed):
    if budget is not None:
        what = "a budget of %d bytes" % budget
        if room < budget:
            what += " (of which the device can give %d now)" % room
    else:
        what = "what the device can give now (%d bytes)" % room
    if largest is None:
        return ("vpager.torch.%s: %s cannot hold the %d-byte staging ring: "
                "lower staging_size or raise the budget" % (fn, what, ring))
    unit, need = largest
    if fixed:
        hint = "staging_size >= %d and a budget that holds the ring" % need
    elif budget is not None:
        hint = "a budget of at least %d bytes" % ring
    else:
        hint = "a device with at least %d bytes free" % ring
    return ("vpager.torch.%s: %s cannot hold the staging ring: unit %s (%s) "
            "needs %d bytes of it at once for its weights, and the ring takes "
            "%d bytes of device memory (whole pages); give %s"
            % (fn, what, unit.name, type(unit.module).__name__, need, ring,
               hint))


def check_ring(dev, room, budget, largest, fn="offload", fixed=True):
    """ValueError unless dev's staging ring holds the largest unit's weights
    (largest: (unit, bytes) or None) and fits in `room` (None: unchecked)."""
    page = dev.page_size
    ring = ring_pages(dev.options["staging_size"], page)
    if largest is not None and largest[1] > ring:
        unit, need = largest
        raise ValueError("vpager.torch: unit %s (%s) of this model needs %d "
                         "bytes of staging at once, the device's ring holds "
                         "%d: open the device with staging_size >= %d"
                         % (unit.name, type(unit.module).__name__, need, ring,
                            need))
    if room is not None and ring > room:
        raise ValueError(_refusal(fn, ring, room, budget, largest, fixed))


# ------------------------------------------------------- opening

# Pages of a device offload() opens for a scheduled model (tuner.py): the
# resident weights lie together (placement.place_resident_first), so large
# pages waste at most one page of the budget; a GPU keeps the device's
# default (32 MiB: cross-process releases and fills cost ~2 ms/GiB of VMM
# calls on the H200, 2 MiB pages ~20), the simulated device, whose models
# in tests are a few MiB, 2 MiB pages (or its granularity).
SIM_SCHEDULED_PAGE = 2 << 20


def scheduled_page(target, opts):
    """The page size for a scheduled model's device, None for the
    default: opts (vp_options_t fields) and VPAGER_PAGE_SIZE win."""
    if target.type == "cuda" or "page_size" in opts or \
            env.given("VPAGER_PAGE_SIZE"):
        return None
    gran = parse_size(opts.get("sim_granularity", 0) or 0)
    return max(SIM_SCHEDULED_PAGE, gran)


def _options(target, budget, lookahead, options, scheduled=False):
    opts = dict(options)
    page = scheduled_page(target, opts) if scheduled else None
    if page is not None:
        opts["page_size"] = page
    if target.type == "cuda":
        opts.setdefault("backend", gpu_backend())  # ROCm torch: "hip"
        opts.setdefault("device_index", cuda_index(target))
    else:
        opts.setdefault("backend", "sim")
        if budget is not None:
            opts.setdefault("sim_capacity", budget)
    if lookahead is not None:
        opts["lookahead"] = lookahead
    return opts


def _open_with(opts, budget, ring, auto_lookahead):
    opts = dict(opts)
    if ring is not None:
        opts["staging_size"] = ring
    if auto_lookahead:
        # Prefetch may fill the whole ring ahead: a shorter lookahead
        # leaves the copy engine idle under long runs of resident weights
        # (H200, 32-layer decoder prefill: 114.5 ms at the ring's 512 MiB,
        # 117.8 ms at the library's 256 MiB default).
        opts["lookahead"] = parse_size(opts["staging_size"])
    dev = Device(**opts)
    try:
        if budget is not None:
            # A cap on vpager's own commits, however much torch allocates
            # later (the headroom still keeps device memory free).
            governor(dev).declare_budget(budget)
    except BaseException:
        dev.close()
        raise
    return dev


def open_for(target, budget, lookahead, options, largest=None,
             fn="offload", scheduled=False):
    """A new vpager.Device for `target`, the budget applied. Unless the
    options set staging_size, the ring is sized by ring_size() from the
    budget and what the device can give (vp_device_info's budget: free
    memory less the headroom, capped by the budget); the device is opened
    again when that differs from the first guess. ValueError, nothing left
    open, when that room cannot hold the ring the largest unit needs."""
    opts = _options(target, budget, lookahead, options, scheduled)
    need = largest[1] if largest is not None else 0
    auto_lookahead = ("lookahead" not in opts and
                      not env.given("VPAGER_LOOKAHEAD"))
    sized = "staging_size" not in opts
    ring = None
    budgeted = budget is not None
    if sized:       # the first guess: the budget, or no limit
        ring = ring_size(budget if budgeted else 1 << 62, need, 1, budgeted)
    dev = _open_with(opts, budget, ring, auto_lookahead)
    try:
        room = dev.info()["budget"]
        if sized and ring != ring_size(room, need, dev.page_size, budgeted):
            ring = ring_size(room, need, dev.page_size, budgeted)
            dev.close()
            dev = _open_with(opts, budget, ring, auto_lookahead)
            room = dev.info()["budget"]
        check_ring(dev, room, budget, largest, fn, fixed=not sized)
    except BaseException:
        dev.close()
        raise
    if sized:
        SIZED_RINGS.add(dev)
    return dev


def attach(dev, budget, lookahead, largest):
    """Set a shared device up for one more model: its ring must hold the
    largest unit, and fit in a budget given here, which is then applied. A
    ring vpager.torch sized (open_device() without staging_size) grows to
    the largest unit first when the budget holds it and no staged weight
    is acquired now; one the caller sized stays."""
    if largest is not None and dev in SIZED_RINGS:
        page = dev.page_size
        grown = ring_pages(largest[1], page)
        room = budget if budget is not None else dev.info()["budget"]
        if grown > ring_pages(dev.options["staging_size"], page) and \
                grown <= room:
            try:
                dev.set_staging_size(grown)
            except BusyError:
                pass                # check_ring() says what is needed
    check_ring(dev, budget, budget, largest)
    gov = governor(dev)
    if budget is not None:
        gov.declare_budget(budget)
    if lookahead is not None:
        gov.declare_lookahead(lookahead)


def open_device(device: Any = None, budget: Size = None,
                lookahead: Size = None, **options: Union[int, str]) -> Device:
    """A vpager.Device for torch modules, to share between offload(...,
    dev=d) calls: `device` "cuda"/"cuda:N"/N for a GPU, "cpu"/"sim" for the
    simulated device (default: CUDA when torch has it, else sim, with a
    warning); `budget` bytes (an int, or "20G"/"20GiB" = 20 * 2**30,
    "20GB" = 20 * 10**9) of device memory vpager may use in all; options:
    any vp_options_t field (vpager.OPTION_NAMES). Without staging_size,
    the staging ring is sized to the budget and to what the device can
    give. Close it yourself (after the models on it are unloaded or
    closed)."""
    target = (torch_device(device, "open_device") if device is not None
              else default_device(options))
    budget = size_argument("open_device", "budget", budget, 1)
    dev = open_for(target, budget,
                   size_argument("open_device", "lookahead", lookahead),
                   options, fn="open_device")
    warn_budget_over(dev, budget, "open_device")
    if target.type == "cpu":
        note_simulated(device)
    return dev
