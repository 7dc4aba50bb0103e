"""vpager.ledger: the GPU's ledger that every vpager process on it shares
(vp_ledger_*, vp_vbar_set_label, vp_device_set_external_reserved; see the
"ledger" section of include/vpager.h).

    import vpager, vpager.ledger as ledger
    dev = vpager.Device(backend="sim", sim_shared="demo")
    vb = dev.create_vbar(1 << 30)
    ledger.set_label(vb, "unet")
    ledger.snapshot(dev)          # every participant and its VBARs, a dict
    ledger.free_memory(dev, n)    # least recently used first, all processes
    ledger.names()                # this machine's ledgers, no device needed
    ledger.read("sim-demo")       # one of them, read only

`python -m vpager top` shows them live.
"""

import ctypes
import json

from . import _lib
from ._lib import C
from .errors import check

__all__ = ["LABEL_MAX", "set_label", "label", "set_external_reserved",
           "set_external_floor",
           "snapshot", "free_memory", "names", "read"]

LABEL_MAX = _lib.VP_LABEL_MAX


def _json(call):
    """Call fn(buf, len, &needed) until the text fits (it may grow between
    two calls: other processes change the ledger), then parse it."""
    size = 1 << 16
    needed = ctypes.c_size_t()
    while True:
        buf = ctypes.create_string_buffer(size)
        rc = call(buf, size, ctypes.byref(needed))
        if rc == _lib.VP_ERANGE:
            size = 2 * (needed.value + 1)
            continue
        check(rc)
        return json.loads(buf.value.decode("ascii", "replace"))


def set_label(vbar, text):
    """vp_vbar_set_label(): printable ASCII without " or \\, under
    LABEL_MAX bytes ("" clears it)."""
    check(C.vp_vbar_set_label(vbar._handle(), text.encode()))


def label(vbar):
    """vp_vbar_label()."""
    buf = ctypes.create_string_buffer(LABEL_MAX)
    check(C.vp_vbar_label(vbar._handle(), buf, LABEL_MAX))
    return buf.value.decode()


def set_external_reserved(device, nbytes):
    """vp_device_set_external_reserved(): what the framework's allocator
    holds now (e.g. torch.cuda.memory_reserved(); not the peak)."""
    check(C.vp_device_set_external_reserved(device._handle(), int(nbytes)))


def snapshot(device):
    """vp_ledger_snapshot() as a dict: {"ledger", "joined", "device",
    "processes": [{"pid", "command", "vbars": [...]}, ...], "requests"};
    {"joined": False, "reason": ...} when the device has no ledger."""
    h = device._handle()
    return _json(lambda b, n, need: C.vp_ledger_snapshot(h, b, n, need))


def free_memory(device, nbytes, keep=()):
    """vp_ledger_free_memory(): free nbytes of device memory over every
    participant, least recently used VBAR first; returns the bytes freed
    (less than nbytes when nothing else could be freed). keep: VBARs of
    this process (any device) left alone (vp_ledger_free_memory_keep)."""
    freed = ctypes.c_uint64()
    keep = [v._handle() for v in keep]
    if not keep:
        check(C.vp_ledger_free_memory(device._handle(), int(nbytes),
                                      ctypes.byref(freed)))
        return freed.value
    arr = (_lib.vp_vbar_t * len(keep))(*keep)
    check(C.vp_ledger_free_memory_keep(device._handle(), int(nbytes), arr,
                                       len(keep), ctypes.byref(freed)))
    return freed.value


def set_external_floor(device, nbytes):
    """vp_device_set_external_floor(): the least the framework's allocator
    holds once warmed up (measured once)."""
    check(C.vp_device_set_external_floor(device._handle(), int(nbytes)))


def names():
    """vp_ledger_list(): the names of this machine's ledgers."""
    return _json(C.vp_ledger_list)


def read(name):
    """vp_ledger_read(): one ledger by name, as snapshot() gives it (read
    only: the reader does not join)."""
    raw = name.encode()
    return _json(lambda b, n, need: C.vp_ledger_read(raw, b, n, need))
