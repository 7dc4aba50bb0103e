"""vpager.torch.ledger: vpager.torch's models in the GPU's ledger (the
shared ledger of every vpager process on a device: vpager.ledger).

    import vpager.torch, vpager.torch.ledger as ml
    h = vpager.torch.offload(unet, budget="12G")   # labelled "UNet2D..." 
    ml.name(h, "unet")                # or a name of your own
    ml.info(h)                        # {"name", "size", "loaded_size",
                                      #  "reclaimable", "pinned"}
    ml.models("cuda:0")               # this process's live models there
    ml.free_memory("cuda:0", 8 << 30, keep=[h])   # make 8 GiB free
    ml.unload_all("cuda:0")           # every model idle, every process

Every offload() handle is tracked here (Offloaded calls track()):
  - its VBAR is labelled with the module's class name until name() says
    otherwise;
  - a handle that dies without unload() (its module dropped) leaves the
    ledger: a weakref finalizer closes its VBAR (and a device vpager.torch
    opened for it once no model uses it);
  - a model whose pages free_memory()/unload_all() took, or another
    process took while it was idle (no forward for COME_BACK_IDLE s), comes
    back at its next forward: it is put on top of its device's priority
    list, which lifts its watermark (pages taken away otherwise stay
    misses, so two busy processes do not take pages back and forth);
  - before each forward, at most every PUBLISH_EVERY s, torch's
    instantaneous reserved bytes are published as the process's external
    reservation (never the peak), and after the first forward, once, its
    floor (what torch holds once warmed up);
  - where NVML reports a memory soft limit for this process's cgroup
    (MPS v3 / cgroup dmem), vpager's limit on the device stays under it:
    soft limit - torch's reservation (absent: nothing changes).

free_memory(device, nbytes, keep) is ComfyUI's minimal-eviction walk over
every process on the GPU: it frees only the shortfall (nbytes - device free
memory now), least recently used model first whatever process holds it,
re-measuring device free memory between steps, never a model in keep,
never one in use (pinned).
"""

import sys
import time
import weakref

from .. import ledger as _vl
from ..device import Device
from ..governor import governor
from ..vbar import Vbar
from .config import torch_device

__all__ = ["track", "name", "info", "models", "free_memory", "unload_all",
           "publish", "PUBLISH_EVERY", "COME_BACK_IDLE"]

PUBLISH_EVERY = 0.004       # s between two reservations published
COME_BACK_IDLE = 0.5        # s without a forward: a new use
_LIMIT_EVERY = 1.0          # s between two NVML soft-limit reads
_LIMIT_MARGIN = 256 << 20   # kept under the soft limit

_RECORDS = {}               # id(handle) -> _Record, live handles only
_DEVICES = weakref.WeakKeyDictionary()   # vpager.Device -> _DevPub


class _Record:
    """What the ledger keeps of one Offloaded handle (never the handle)."""

    __slots__ = ("ref", "vbar", "device", "ds", "module", "name",
                 "last_forward", "finalizer")


class _DevPub:
    """Per device: when torch's reservation was last published, whether
    the floor was, and the platform limit state."""

    __slots__ = ("last", "floor_done", "index", "limit_at")

    def __init__(self, index):
        self.last = float("-inf")
        self.floor_done = False
        self.index = index          # CUDA index, None on the sim
        self.limit_at = float("-inf")


def _clean_label(text):
    """Printable ASCII without quote or backslash, under LABEL_MAX."""
    out = "".join(c if " " <= c <= "~" and c not in "\"\\" else "_"
                  for c in str(text))
    return out[:_vl.LABEL_MAX - 1]


# ------------------------------------------------------------- tracking

def track(handle, ds, hooks, label=None, budget=None):
    """Put an Offloaded handle in the ledger (offload() does it): its label,
    the forward hooks (publishing, coming back: the "ledger" slot of its
    root's RootHooks `hooks`), the finalizer. ds: its device's DevState;
    budget: the limit offload() set on the device (None: no cap), which
    the platform's soft limit may lower."""
    key = id(handle)
    if key in _RECORDS:
        if label is not None:
            name(handle, label)
        return
    r = _Record()
    r.ref = weakref.ref(handle)
    r.vbar, r.device, r.ds = handle.vbar, handle.device, ds
    r.module = weakref.ref(handle.module)
    r.last_forward = float("-inf")
    r.name = None
    _RECORDS[key] = r
    r.finalizer = weakref.finalize(handle, _gone, key, r.vbar, r.device,
                                   r.ds)
    name(handle, label if label is not None else type(handle.module).__name__)
    index = handle.target.index if handle.target.type == "cuda" else None
    if r.device not in _DEVICES:
        _DEVICES[r.device] = _DevPub(index)
    hooks.set("ledger",
              pre=lambda module, args, _r=r: _before_forward(_r),
              post=lambda module, args, out, _r=r: _after_forward(_r))
    _platform_limit(r.device, _DEVICES[r.device], force=True)


def _gone(key, vbar, device, ds):
    """The handle died (garbage, or the interpreter exits): out of the
    ledger. Its VBAR is closed here if unload()/close() did not, and a
    device vpager.torch opened for it once nobody uses it. (An unloaded
    or closed handle that lives on keeps its record; _live() skips it.)"""
    _RECORDS.pop(key, None)
    try:
        if not vbar.closed:
            vbar.close()
        # (iterating: the dying handle's weak entry may not be gone yet)
        if ds.owned and not any(True for _ in ds.users) \
                and not device.closed:
            from .devices import DEVSTATES
            DEVSTATES.pop(device, None)
            device.close()
    except Exception:   # a finalizer never raises
        pass


def _record(handle):
    r = _RECORDS.get(id(handle))
    if r is None or r.ref() is not handle:
        raise ValueError("vpager.torch.ledger: %r is not a live offload() "
                         "handle" % (handle,))
    return r


def _live():
    """(record, handle) of every live, open handle."""
    out = []
    for r in list(_RECORDS.values()):
        h = r.ref()
        if h is None or h.closed or r.vbar.closed:
            continue
        out.append((r, h))
    return out


# --------------------------------------------------------------- naming

def name(handle, text):
    """Name a model (its VBAR's label): printable ASCII, other characters
    become '_', cut to vpager.ledger.LABEL_MAX - 1 bytes."""
    r = _record(handle)
    r.name = _clean_label(text)
    r.vbar.label = r.name
    return r.name


def info(handle):
    """{"name", "size" (weight bytes), "vbar_size", "loaded_size" (bytes
    resident), "pinned" (in use now), "reclaimable" (resident, not
    pinned)} of one model."""
    r = _record(handle)
    s = r.vbar.stats()
    loaded = s["committed_bytes"]
    return {"name": r.name, "size": handle.weight_bytes,
            "vbar_size": r.vbar.size, "loaded_size": loaded,
            "pinned": s["pinned_bytes"],
            "reclaimable": max(loaded - s["pinned_bytes"], 0)}


def _torch_device(device):
    # "sim" is the CPU; a name torch does not know: ValueError naming it.
    return torch_device(device, "ledger", present=False)


def _same(target, want):
    if target.type != want.type:
        return False
    if want.type != "cuda" or want.index is None:
        return True
    return target.index == want.index


def _handles_on(device):
    """Live handles computing on `device`: a vpager.Device, a torch device
    (or "cuda:N", N, "cpu" for the simulated device), or None for all."""
    out = []
    for r, h in _live():
        if device is None:
            out.append((r, h))
        elif isinstance(device, Device):
            if r.device is device:
                out.append((r, h))
        elif _same(h.target, _torch_device(device)):
            out.append((r, h))
    return out


def models(device=None):
    """info() of every live model of this process on `device` (all when
    None), least recently used first."""
    hs = sorted(_handles_on(device), key=lambda rh: rh[0].last_forward)
    return [dict(info(h), handle=h) for r, h in hs]


# -------------------------------------------------------------- freeing

def _devices_of(device):
    devs = []
    for r, h in _handles_on(device):
        if r.device not in devs and not r.device.closed:
            devs.append(r.device)
    if isinstance(device, Device) and device not in devs \
            and not device.closed:
        devs.append(device)
    return devs


def _keep_vbars(keep):
    """VBARs of keep's items: Offloaded handles, their modules, Vbars."""
    out = []
    by_module = {}
    for r, h in _live():
        m = r.module()
        if m is not None:
            by_module[id(m)] = r.vbar
    for k in keep or ():
        if isinstance(k, Vbar):
            out.append(k)
        elif id(k) in by_module:
            out.append(by_module[id(k)])
        elif getattr(k, "vbar", None) is not None and \
                isinstance(k.vbar, Vbar):
            out.append(k.vbar)
        else:
            raise ValueError("vpager.torch.ledger: keep=[...] takes offload() "
                             "handles, their modules or VBARs, not %r" % (k,))
    return [v for v in out if not v.closed]


def _mark_evicted(before):
    """Models whose loaded size dropped: at their next forward they go on
    top of their device's list again (their watermark lifted)."""
    for r, h in _live():
        was = before.get(id(r))
        if was is not None and r.vbar.loaded_size() < was:
            if r.ds.top is h:
                r.ds.top = None


def free_memory(device, nbytes, keep=()):
    """Make `nbytes` of device memory free with the fewest evictions, over
    every vpager process on the GPU: only the shortfall (nbytes - free now)
    is freed, least recently used model first, never one in keep or in
    use. device: a torch device ("cuda:0", 0, "cpu" for the simulated
    device) or a vpager.Device. Returns the bytes freed (less than the
    shortfall when nothing else was reclaimable)."""
    kv = _keep_vbars(keep)
    devs = _devices_of(device)
    if not devs:
        return 0
    dev = devs[0]
    free_now = dev.info()["free_memory"]
    if free_now >= nbytes:
        return 0
    before = {id(r): r.vbar.loaded_size() for r, h in _live()}
    freed = _vl.free_memory(dev, nbytes - free_now, kv)
    _mark_evicted(before)
    return freed


def unload_all(device, keep=()):
    """Every model not in use and not in keep gives its device memory back,
    in every vpager process on the GPU (OOM recovery, a "free memory"
    request, a no-cache mode). The models stay usable: each comes back at
    its next forward. Returns the bytes freed."""
    kv = _keep_vbars(keep)
    devs = _devices_of(device)
    if not devs:
        return 0
    before = {id(r): r.vbar.loaded_size() for r, h in _live()}
    freed = _vl.free_memory(devs[0], 1 << 62, kv)
    for d in devs[1:]:      # other devices of ours on the same GPU
        freed += _vl.free_memory(d, 1 << 62, kv)
    _mark_evicted(before)
    return freed


# --------------------------------------------- forwards: publish, come back

def _reserved(index):
    """torch's reserved bytes on CUDA device `index` now (the seam of
    vpager.torch: _torch_reserved)."""
    return sys.modules[__package__]._torch_reserved(index)[0]


def publish(device, force=False):
    """Publish torch's instantaneous reservation on a vpager.Device now (at
    most every PUBLISH_EVERY s unless force); returns it, or None on the
    simulated device or when it was published too recently."""
    pub = _DEVICES.get(device)
    if pub is None or pub.index is None or device.closed:
        return None
    now = time.monotonic()
    if not force and now - pub.last < PUBLISH_EVERY:
        return None
    pub.last = now
    reserved = _reserved(pub.index)
    device.set_external_reserved(reserved)
    if now - pub.limit_at >= _LIMIT_EVERY:
        _platform_limit(device, pub, reserved=reserved)
    return reserved


def _before_forward(r):
    now = time.monotonic()
    h = r.ref()
    if h is not None and now - r.last_forward > COME_BACK_IDLE and \
            r.ds.top is h:
        r.ds.top = None         # idle long: a new use, it comes back
    r.last_forward = now
    publish(r.device)


def _after_forward(r):
    pub = _DEVICES.get(r.device)
    if pub is None or pub.index is None or r.device.closed:
        return
    if pub.floor_done:
        publish(r.device)
        return
    pub.floor_done = True       # warmed up: measured once
    _vl.set_external_floor(r.device, publish(r.device, force=True))


# ------------------------------------------------ headroom from the platform

def platform_soft_limit(index):
    """The platform's soft memory limit for this process on CUDA device
    `index` (bytes), or None where there is none: vp_device_soft_limit on
    the vpager device offload() opened for it (what NVML reports for this
    process's cgroup: MPS v3 / dmem limits; none without NVML or on an
    older driver)."""
    for device, pub in list(_DEVICES.items()):
        if pub.index == index and not device.closed:
            return device.soft_limit()
    return None


def _platform_limit(device, pub, reserved=None, force=False):
    """Declare the platform's soft limit (and torch's reservation) to the
    device's Governor, which keeps vpager's limit under it:
    min(the user's budget, soft - reserved - margin)."""
    if pub.index is None or device.closed:
        return
    pub.limit_at = time.monotonic()
    soft = sys.modules[__name__].platform_soft_limit(pub.index)
    gov = governor(device)
    if soft is None and gov.platform.soft is None:
        return
    if soft is not None and reserved is None:
        reserved = _reserved(pub.index)
    gov.declare_platform(soft, sys.modules[__name__]._LIMIT_MARGIN,
                         reserved)
