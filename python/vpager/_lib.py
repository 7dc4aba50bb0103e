"""Loading libvpager.so (vpager.dll on Windows) and the ctypes
declarations of include/vpager.h.

Everything here is written out by hand from the header (nothing is parsed at
run time); tests/python/test_binding.py checks it against the header.

The library (library_name(): libvpager.so, or vpager.dll on Windows) is
found, in this order:
  1. the file named by the environment variable VPAGER_LIBRARY (then only
     it: a wrong path is an error that names VPAGER_LIBRARY);
  2. the library inside this package (placed there by `pip install .`);
  3. the in-tree build, <repo>/build/<library name> (after `make`).
Importing vpager never fails for want of the library: the first call that
needs it raises LibraryError saying how to build it.
"""

import ctypes
import os
import sys
from ctypes import (POINTER, Structure, c_char, c_char_p, c_int, c_int64,
                    c_size_t, c_uint8, c_uint32, c_uint64, c_void_p)

from . import env as _env

__all__ = ["C", "load", "library_path", "LibraryError"]

# ------------------------------------------------------------------ codes

VP_OK = 0
VP_MISS = 1
# name, code, text: VP_ERRNO_MAP in the header.
ERRNO_MAP = (
    ("EINVAL", -1, "invalid argument"),
    ("EHANDLE", -2, "invalid, stale or foreign handle"),
    ("ENOMEM", -3, "out of host memory"),
    ("ERANGE", -4, "range outside the VBAR"),
    ("EBUSY", -5, "object is in use (pinned pages)"),
    ("ENOTPINNED", -6, "range is not pinned"),
    ("ENODEV", -7, "no usable device for this backend"),
    ("EDEVICE", -8, "device is broken"),
    ("EAGAIN", -9, "transient device error, try again"),
    ("EOOM", -10, "out of device memory"),
    ("EUNSUPPORTED", -11, "not supported by this backend"),
    ("ELIMIT", -12, "internal limit reached"),
)
for _name, _code, _text in ERRNO_MAP:
    globals()["VP_" + _name] = _code

VP_LOG_NONE, VP_LOG_ERROR, VP_LOG_WARN = 0, 1, 2
VP_LOG_INFO, VP_LOG_DEBUG, VP_LOG_TRACE = 3, 4, 5
LOG_LEVELS = {"none": 0, "error": 1, "warn": 2, "info": 3, "debug": 4,
              "trace": 5}

VP_BACKEND_AUTO, VP_BACKEND_CUDA, VP_BACKEND_SIM, VP_BACKEND_HIP = 0, 1, 2, 3
BACKENDS = {"auto": 0, "cuda": 1, "sim": 2, "hip": 3}
VP_ORDER_TAIL_FIRST, VP_ORDER_INTERLEAVED, VP_ORDER_CUSTOM = 0, 1, 2
ORDERS = {"tail": 0, "interleaved": 1}
VP_SIM_SYNC, VP_SIM_WORKER = 0, 1
VP_LENT_RANGES = 8      # vp_device_lend_staging: ranges lent at once
# vp_weight_set_lookahead: the weight uses the device's lookahead
VP_LOOKAHEAD_DEVICE = (1 << 64) - 1
SIM_STREAMS = {"sync": 0, "worker": 1}

VP_SIM_FAIL_COMMIT = 1
VP_SIM_TRANSIENT = 2
VP_SIM_SET_CAPACITY = 3
VP_SIM_BREAK = 4
VP_SIM_SET_SOFT_LIMIT = 5
VP_SIM_SET_DESKTOP = 6
VP_SIM_MAP_APART = 7

VP_PAGE_RESIDENT = 0x1
VP_PAGE_PINNED = 0x2

VP_LABEL_MAX = 64

VP_SOURCE_NONE, VP_SOURCE_HOST, VP_SOURCE_FILE = 0, 1, 2

VP_ACQUIRED_RESIDENT = 0x1
VP_ACQUIRED_STAGED = 0x2
VP_ACQUIRED_COPIED = 0x4
VP_ACQUIRED_EMPTY = 0x8

UINT64_MAX = (1 << 64) - 1

# ---------------------------------------------------------------- structs


class vp_options_t(Structure):
    _fields_ = [
        ("size", c_uint32),
        ("backend", c_int),
        ("device_index", c_int),
        ("page_size", c_uint64),
        ("headroom", c_int64),
        ("poll_interval_us", c_uint32),
        ("evict_order", c_int),
        ("sim_capacity", c_uint64),
        ("sim_granularity", c_uint64),
        ("sim_streams", c_int),
        ("sim_shared", c_char * 64),
        ("sim_fail_nth", c_int64),
        ("staging_size", c_uint64),
        ("lookahead", c_uint64),
        ("pin_budget", c_uint64),
        ("file_slots", c_uint32),
        ("file_slot_size", c_uint64),
        ("ledger", c_char * 64),
        ("ledger_timeout_us", c_uint32),
        ("staging_wrap", c_int),
    ]


class vp_device_t(Structure):
    _fields_ = [("id", c_uint64)]


class vp_vbar_t(Structure):
    _fields_ = [("id", c_uint64)]


class vp_hostbuf_t(Structure):
    _fields_ = [("id", c_uint64)]


class vp_weight_t(Structure):
    _fields_ = [("id", c_uint64)]


class vp_st_t(Structure):
    _fields_ = [("id", c_uint64)]


vp_stream_t = c_uint64


class vp_range_t(Structure):
    _fields_ = [("vbar", vp_vbar_t), ("offset", c_uint64), ("size", c_uint64)]


class vp_device_info_t(Structure):
    _fields_ = [
        ("page_size", c_uint64),
        ("granularity", c_uint64),
        ("total_memory", c_uint64),
        ("free_memory", c_uint64),
        ("committed", c_uint64),
        ("budget", c_uint64),
        ("headroom", c_int64),
        ("async_copies", c_int),
        ("shared_headroom", c_int64),
        ("kept_free", c_uint64),
        ("staging_wraps", c_int),
    ]


# VP_STAT_FIELDS, in order: the one place the binding lists the counters.
STAT_FIELDS = (
    "faults",
    "hits",
    "fills",
    "misses",
    "unpins",
    "pages_committed",
    "pages_evicted",
    "evict_waits",
    "commit_failures",
    "commit_retries",
    "watermark_misses",
    "budget_misses",
    "budget_polls",
    "bytes_copied",
    "acquires",
    "weight_fills",
    "weight_staged",
    "fill_bytes",
    "staged_bytes",
    "copies",
    "stream_waits",
    "prefetch_bytes",
    "prefetch_used_bytes",
    "prefetch_dropped_bytes",
    "ring_waits",
    "host_pinned_bytes",
    "pin_fallback_bytes",
    "file_bytes_read",
)
# Gauges after the counters ("now" values), then the counters added since
# (in the reserved tail's place), then what is left of it.
STAT_GAUGES = ("committed_bytes", "pinned_bytes", "machine_pinned_bytes")
STAT_ADDED = ("sm_copy_bytes",)
STATS_RESERVED = 6
STATS_VERSION = 1


class vp_stats_t(Structure):
    _fields_ = ([("size", c_uint32), ("version", c_uint32)] +
                [(name, c_uint64) for name in
                 STAT_FIELDS + STAT_GAUGES + STAT_ADDED] +
                [("reserved", c_uint64 * STATS_RESERVED)])


STATS_SIZE = 8 + 8 * (len(STAT_FIELDS) + len(STAT_GAUGES) + len(STAT_ADDED) +
                      STATS_RESERVED)
if ctypes.sizeof(vp_stats_t) != STATS_SIZE:  # pragma: no cover
    raise ImportError("vpager: vp_stats_t is %d bytes in ctypes, expected %d"
                      % (ctypes.sizeof(vp_stats_t), STATS_SIZE))


class vp_host_memory_t(Structure):
    _fields_ = [
        ("total", c_uint64),
        ("available", c_uint64),
        ("limit", c_uint64),
    ]


class vp_host_mapping_t(Structure):
    _fields_ = [
        ("start", c_uint64),
        ("size", c_uint64),
        ("file_offset", c_uint64),
        ("file_id", c_uint64),
        ("flags", c_uint32),
        ("path", c_char * 1024),
    ]


VP_MAPPING_WRITABLE = 0x1
VP_MAPPING_PRIVATE = 0x2
VP_MAPPING_WRITTEN = 0x4


class vp_hostbuf_info_t(Structure):
    _fields_ = [
        ("ptr", c_void_p),
        ("size", c_uint64),
        ("max_size", c_uint64),
        ("pinned_bytes", c_uint64),
    ]


class vp_source_t(Structure):
    _fields_ = [
        ("kind", c_int),
        ("host", c_void_p),
        ("fd", c_int),
        ("file_offset", c_uint64),
    ]


class vp_st_tensor_t(Structure):
    _fields_ = [
        ("name", c_char_p),
        ("dtype", c_char * 16),
        ("ndim", c_uint32),
        ("shape", c_uint64 * 8),
        ("offset", c_uint64),
        ("size", c_uint64),
    ]


# Fixed sizes on LP64 (x86-64, aarch64): a changed header shows up here.
EXPECTED_SIZES = {
    vp_options_t: 248,
    vp_device_info_t: 88,
    vp_hostbuf_info_t: 32,
    vp_source_t: 32,
    vp_st_tensor_t: 112,
    vp_range_t: 24,
}
if ctypes.sizeof(c_void_p) == 8:
    for _t, _n in EXPECTED_SIZES.items():
        if ctypes.sizeof(_t) != _n:  # pragma: no cover
            raise ImportError("vpager: %s is %d bytes in ctypes, expected %d"
                              % (_t.__name__, ctypes.sizeof(_t), _n))

SIM_LAUNCH_FN = ctypes.CFUNCTYPE(None, c_void_p)

# ------------------------------------------------------------- prototypes

_i, _u64, _i64, _sz, _p = c_int, c_uint64, c_int64, c_size_t, c_void_p
P = POINTER
_dev, _vb, _hb, _w, _st = vp_device_t, vp_vbar_t, vp_hostbuf_t, vp_weight_t, vp_st_t
_s = vp_stream_t

# name: (restype, argtypes), in header order. Every VP_API function.
PROTOTYPES = {
    # errors
    "vp_strerror": (c_char_p, [_i]),
    "vp_err_name": (c_char_p, [_i]),
    "vp_last_error": (c_char_p, []),
    # logging
    "vp_set_log_level": (_i, [_i]),
    "vp_get_log_level": (_i, []),
    # options
    "vp_options_init": (_i, [P(vp_options_t)]),
    "vp_parse_size": (_i, [c_char_p, P(c_uint64)]),
    # device
    "vp_device_open": (_i, [P(vp_options_t), P(vp_device_t)]),
    "vp_device_close": (_i, [_dev]),
    "vp_device_backend": (c_char_p, [_dev]),
    "vp_device_info": (_i, [_dev, P(vp_device_info_t)]),
    "vp_device_set_headroom": (_i, [_dev, _i64]),
    "vp_device_set_shared_headroom": (_i, [_dev, _i64]),
    "vp_device_set_limit": (_i, [_dev, _u64]),
    "vp_device_free_memory": (_i, [_dev, _u64, P(c_uint64)]),
    "vp_device_reclaimable": (_i, [_dev, P(c_uint64)]),
    "vp_device_reset_limits": (_i, [_dev]),
    # streams
    "vp_stream_create": (_i, [_dev, P(vp_stream_t)]),
    "vp_stream_destroy": (_i, [_dev, _s]),
    "vp_stream_synchronize": (_i, [_dev, _s]),
    "vp_copy_to_device": (_i, [_dev, _u64, _p, _u64, _s]),
    "vp_copy_to_host": (_i, [_dev, _p, _u64, _u64, _s]),
    "vp_sim_launch": (_i, [_dev, _s, SIM_LAUNCH_FN, _p]),
    "vp_sim_inject": (_i, [_dev, _i, _u64]),
    # VBAR
    "vp_vbar_create": (_i, [_dev, _u64, P(vp_vbar_t)]),
    "vp_vbar_destroy": (_i, [_vb]),
    "vp_vbar_base": (_i, [_vb, P(c_uint64)]),
    "vp_vbar_size": (_i, [_vb, P(c_uint64)]),
    "vp_vbar_page_count": (_i, [_vb, P(c_uint64)]),
    "vp_vbar_device": (_i, [_vb, P(vp_device_t)]),
    "vp_vbar_prioritize": (_i, [_vb]),
    "vp_vbar_deprioritize": (_i, [_vb]),
    "vp_vbar_set_order": (_i, [_vb, _i]),
    "vp_vbar_set_ranks": (_i, [_vb, P(c_uint32), _sz]),
    "vp_vbar_set_watermark": (_i, [_vb, _u64]),
    "vp_vbar_get_watermark": (_i, [_vb, P(c_uint64)]),
    "vp_vbar_set_watermark_limit": (_i, [_vb, _u64]),
    "vp_vbar_get_watermark_limit": (_i, [_vb, P(c_uint64)]),
    "vp_fault": (_i, [_vb, _u64, _u64, P(c_uint32), _sz]),
    "vp_unpin": (_i, [_vb, _u64, _u64, _s]),
    "vp_fault_range": (_i, [P(vp_range_t), P(c_uint32), _sz]),
    "vp_unpin_range": (_i, [P(vp_range_t), _s]),
    "vp_vbar_free_memory": (_i, [_vb, _u64, P(c_uint64)]),
    "vp_vbar_loaded_size": (_i, [_vb, P(c_uint64)]),
    "vp_vbar_residency": (_i, [_vb, P(c_uint8), _sz]),
    # host memory
    "vp_host_memory": (_i, [P(vp_host_memory_t)]),
    "vp_host_mappings": (_i, [P(vp_host_mapping_t), _sz, P(_sz)]),
    "vp_host_drop_resident": (_i, [_sz, P(c_uint64), P(c_uint64),
                                   P(c_uint64)]),
    "vp_host_page_size": (_i, [P(c_uint64)]),
    "vp_host_reserve": (_i, [_u64, _u64, P(_p)]),
    "vp_host_commit": (_i, [_p, _u64]),
    "vp_host_populate": (_i, [_p, _u64]),
    "vp_host_discard": (_i, [_p, _u64]),
    "vp_host_decommit": (_i, [_p, _u64]),
    "vp_host_advise_huge": (_i, [_p, _u64]),
    "vp_host_release": (_i, [_p, _u64]),
    "vp_file_map": (_i, [_i, _u64, P(_p)]),
    "vp_file_unmap": (_i, [_p, _u64]),
    "vp_file_read_at": (_i, [_i, _p, _u64, _u64, P(c_uint64)]),
    "vp_hostbuf_alloc": (_i, [_dev, _u64, _u64, P(vp_hostbuf_t)]),
    "vp_hostbuf_register": (_i, [_dev, _p, _u64, P(vp_hostbuf_t)]),
    "vp_hostbuf_grow": (_i, [_hb, _u64]),
    "vp_hostbuf_info": (_i, [_hb, P(vp_hostbuf_info_t)]),
    "vp_hostbuf_free": (_i, [_hb]),
    "vp_device_set_pin_budget": (_i, [_dev, _u64]),
    # weights and streaming
    "vp_weights_create": (_i, [_vb, _sz, P(c_uint64), P(c_uint64),
                               P(vp_source_t), P(vp_weight_t)]),
    "vp_weight_destroy": (_i, [_w]),
    "vp_weights_move": (_i, [_vb, _sz, P(vp_weight_t), P(c_uint64)]),
    "vp_weight_set_source": (_i, [_w, P(vp_source_t)]),
    "vp_weight_swap_source": (_i, [_w, P(vp_source_t)]),
    "vp_weight_set_lookahead": (_i, [_w, _u64]),
    "vp_weight_get_lookahead": (_i, [_w, P(c_uint64)]),
    "vp_acquire": (_i, [_dev, P(vp_weight_t), _sz, _s, P(c_uint64),
                        P(c_uint8)]),
    "vp_acquire_ahead": (_i, [_dev, P(vp_weight_t), _sz, _s, P(c_uint64),
                              P(c_uint8), _u64]),
    "vp_release": (_i, [_dev, P(vp_weight_t), _sz, _s]),
    "vp_prefetch": (_i, [_dev, _w]),
    "vp_prefetch_ahead": (_i, [_dev, _w, _u64]),
    "vp_prefetch_sm": (_i, [_dev, _w, _u64, c_uint32]),
    "vp_device_set_lookahead": (_i, [_dev, _u64]),
    "vp_device_set_staging_size": (_i, [_dev, _u64]),
    "vp_device_lend_staging": (_i, [_dev, _u64, _u64, _s]),
    "vp_device_reclaim_staging": (_i, [_dev, _s, _i]),
    # files
    "vp_file_read_to_device": (_i, [_dev, _i, _u64, _u64, _u64, _s]),
    "vp_file_read_to_address": (_i, [_dev, _i, _u64, _u64, _u64, _s,
                                     c_uint32]),
    "vp_file_reader_release": (_i, [_dev]),
    "vp_file_descriptor": (_i, [ctypes.c_ssize_t, P(c_int)]),
    "vp_file_descriptor_close": (_i, [_i]),
    # what callers would otherwise ask the driver
    "vp_device_count": (_i, [_i, P(c_int)]),
    "vp_host_unregister": (_i, [_dev, c_void_p]),
    "vp_device_soft_limit": (_i, [_dev, P(c_uint64)]),
    "vp_st_open": (_i, [_dev, c_char_p, P(vp_st_t)]),
    "vp_st_close": (_i, [_st]),
    "vp_st_count": (_i, [_st, P(c_size_t)]),
    "vp_st_tensor": (_i, [_st, _sz, P(vp_st_tensor_t)]),
    "vp_st_find": (_i, [_st, c_char_p, P(c_size_t)]),
    "vp_st_source": (_i, [_st, _sz, P(vp_source_t)]),
    "vp_st_load": (_i, [_st, _sz, P(c_size_t), _vb, P(c_uint64), _s]),
    "vp_st_mmap": (_i, [_st, P(c_void_p), P(c_uint64)]),
    "vp_st_drop_pages": (_i, [_st]),
    # ledger
    "vp_vbar_set_label": (_i, [_vb, c_char_p]),
    "vp_vbar_label": (_i, [_vb, P(c_char), _sz]),
    "vp_device_set_external_reserved": (_i, [_dev, _u64]),
    "vp_ledger_snapshot": (_i, [_dev, P(c_char), _sz, P(c_size_t)]),
    "vp_ledger_free_memory": (_i, [_dev, _u64, P(c_uint64)]),
    "vp_ledger_free_memory_keep": (_i, [_dev, _u64, P(_vb), _sz,
                                        P(c_uint64)]),
    "vp_device_set_external_floor": (_i, [_dev, _u64]),
    "vp_ledger_list": (_i, [P(c_char), _sz, P(c_size_t)]),
    "vp_ledger_read": (_i, [c_char_p, P(c_char), _sz, P(c_size_t)]),
    # stats
    "vp_device_stats": (_i, [_dev, P(vp_stats_t)]),
    "vp_vbar_stats": (_i, [_vb, P(vp_stats_t)]),
    "vp_device_report": (_i, [_dev, _i, P(c_char), _sz, P(c_size_t)]),
}

# ---------------------------------------------------------------- loading


class LibraryError(OSError):
    """libvpager.so (vpager.dll) could not be found or loaded, or does not
    match."""


_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))

_lib = None
_path = None
_error = None


def library_name() -> str:
    """The library's file name here: vpager.dll on Windows, else
    libvpager.so (read at each call: sys.platform)."""
    return "vpager.dll" if sys.platform == "win32" else "libvpager.so"


def _build_hint(name):
    return ("build it with `make` in the vpager repository (the binding "
            "then finds build/%s when run from the tree with "
            "PYTHONPATH=python), install the package with `pip install .` "
            "from the repository root, or set VPAGER_LIBRARY to the path of "
            "a %s" % (name, name))


def _candidates():
    """[(where, absolute path)] to try, in order (module doc)."""
    path = _env.text("VPAGER_LIBRARY")
    if path:
        return [("VPAGER_LIBRARY", os.path.abspath(path))]
    name = library_name()
    out = [("package", os.path.join(_HERE, name))]
    if os.path.isfile(os.path.join(_REPO, "include", "vpager.h")):
        out.append(("tree", os.path.join(_REPO, "build", name)))
    return out


def _declare(lib):
    for name, (restype, argtypes) in PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryError("vpager: %s has no symbol %s: the library is "
                               "older than this binding; rebuild it (%s)"
                               % (_path, name, _build_hint(library_name()))
                               ) from None
        fn.restype = restype
        fn.argtypes = argtypes
    # The library says how big its vp_options_t is.
    opts = vp_options_t()
    lib.vp_options_init(ctypes.byref(opts))
    if opts.size != ctypes.sizeof(vp_options_t):
        raise LibraryError("vpager: %s has a %d-byte vp_options_t, this "
                           "binding %d: library and binding do not match"
                           % (_path, opts.size, ctypes.sizeof(vp_options_t)))


def load():
    """Load the library (once) and return the ctypes.CDLL."""
    global _lib, _path, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise LibraryError(_error)
    tried = []
    for where, path in _candidates():
        if not os.path.exists(path):
            tried.append("%s (%s: not there)" % (path, where))
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            tried.append("%s (%s: %s)" % (path, where, e))
            continue
        _path = path
        try:
            _declare(lib)
        except LibraryError as e:
            _error = str(e)
            raise
        _lib = lib
        return lib
    name = library_name()
    _error = ("vpager: %s not found; tried %s. To fix: %s"
              % (name, "; ".join(tried), _build_hint(name)))
    raise LibraryError(_error)


def library_path():
    """The path of the loaded library (loads it first)."""
    load()
    return _path


def unchecked(name):
    """A second ctypes function for C function `name`, returning int, with
    no argtypes: ctypes then converts no argument (about half the cost of
    a call with argtypes, ~1 us of the hot path's ~4 for vp_acquire and
    vp_release). Every argument must be a ctypes object of the declared
    type: a Structure for a handle (passed by value), c_size_t, c_uint64,
    an array for a pointer. For the hot path only."""
    fn = _UNCHECKED.get(name)
    if fn is None:
        if PROTOTYPES[name][0] is not c_int:
            raise ValueError("vpager: %s does not return int" % name)
        lib = load()
        fn = lib._FuncPtr((name, lib))
        fn.restype = c_int
        # One per name: a placement makes a WeightBatch per unit (800 for
        # an SDXL UNet), each asking for three.
        _UNCHECKED[name] = fn
    return fn


_UNCHECKED = {}


class _Functions:
    """C.vp_xxx: the declared function, loading the library on first use."""

    def __getattr__(self, name):
        if name not in PROTOTYPES:
            raise AttributeError(name)
        fn = getattr(load(), name)
        setattr(self, name, fn)
        return fn


C = _Functions()
