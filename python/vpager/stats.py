"""vp_stats_t as a dict. The names come from _lib.STAT_FIELDS (the copy of
VP_STAT_FIELDS), _lib.STAT_GAUGES and _lib.STAT_ADDED."""

import ctypes

from . import _lib
from ._lib import LibraryError, vp_stats_t
from .errors import check

__all__ = ["STAT_NAMES", "read_stats"]

# Keys of the dicts that stats() returns, in struct order.
STAT_NAMES = _lib.STAT_FIELDS + _lib.STAT_GAUGES + _lib.STAT_ADDED


class _Probe(ctypes.Structure):
    # Room past our struct: a library with a larger vp_stats_t says so by
    # filling more of it (it copies min(size, its size) and sets size).
    _fields_ = [("stats", vp_stats_t), ("extra", ctypes.c_uint8 * 256)]


def read_stats(fn, handle):
    """Call vp_device_stats or vp_vbar_stats and return a dict."""
    probe = _Probe()
    probe.stats.size = ctypes.sizeof(_Probe)
    check(fn(handle, ctypes.byref(probe.stats)))
    s = probe.stats
    if s.size != ctypes.sizeof(vp_stats_t) or s.version != _lib.STATS_VERSION:
        raise LibraryError("vpager: the library's vp_stats_t is %d bytes, "
                           "version %d; this binding's is %d bytes, version "
                           "%d: library and binding do not match"
                           % (s.size, s.version, ctypes.sizeof(vp_stats_t),
                              _lib.STATS_VERSION))
    return {name: getattr(s, name) for name in STAT_NAMES}
