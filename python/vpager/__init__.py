"""vpager: demand paging of model weights into GPU memory.

A ctypes binding of libvpager, one to one with include/vpager.h (which
documents every call); no policy lives here. One shared library serves
every Python version: nothing is compiled against Python.

    import vpager
    with vpager.Device(backend="sim", sim_capacity="1G") as dev:
        vb = dev.create_vbar(4 << 30)
        ok, gens = vb.fault(0, 1 << 20)
        ...

Errors are vpager.Error (a subclass per VP_E* code) carrying the code, its
name and vp_last_error()'s message. Objects that own C objects (Device,
Vbar, HostBuf, Weights, SafeTensors) free them exactly once: close(), a
with block, or garbage collection as a last resort; a closed one raises
HandleError when used.

The library (libvpager.so; vpager.dll on Windows) is found through
VPAGER_LIBRARY, else inside this package (pip install .), else at
<repo>/build/ (make, then PYTHONPATH=python).
"""

import ctypes
import sys

from . import _lib
from ._buffer import BufferRef
from ._lib import LibraryError, library_path
from .device import Device
from .errors import (BusyError, DeviceError, Error, HandleError,
                     HostOutOfMemory, InvalidArgument, LimitError,
                     NoDeviceError, NotPinnedError, OutOfMemory, RangeError,
                     TryAgain, Unsupported, check, err_name, last_error,
                     strerror)
from .hostbuf import (HostBuf, HostMapping, host_drop_resident, host_mappings,
                      host_memory)
from .options import OPTION_NAMES, default_options, parse_size
from .safetensors import SafeTensors, TensorInfo
from .stats import STAT_NAMES
from .vbar import Vbar
from .weights import Source, Weight, WeightBatch, Weights

__version__ = "0.1.0"
VERSION = (0, 1, 0)  # VP_VERSION_MAJOR, _MINOR, _PATCH

# Codes.
OK = _lib.VP_OK
MISS = _lib.VP_MISS
EINVAL = _lib.VP_EINVAL
EHANDLE = _lib.VP_EHANDLE
ENOMEM = _lib.VP_ENOMEM
ERANGE = _lib.VP_ERANGE
EBUSY = _lib.VP_EBUSY
ENOTPINNED = _lib.VP_ENOTPINNED
ENODEV = _lib.VP_ENODEV
EDEVICE = _lib.VP_EDEVICE
EAGAIN = _lib.VP_EAGAIN
EOOM = _lib.VP_EOOM
EUNSUPPORTED = _lib.VP_EUNSUPPORTED
ELIMIT = _lib.VP_ELIMIT

# Log levels.
LOG_NONE = _lib.VP_LOG_NONE
LOG_ERROR = _lib.VP_LOG_ERROR
LOG_WARN = _lib.VP_LOG_WARN
LOG_INFO = _lib.VP_LOG_INFO
LOG_DEBUG = _lib.VP_LOG_DEBUG
LOG_TRACE = _lib.VP_LOG_TRACE

# Options' enums.
BACKEND_AUTO = _lib.VP_BACKEND_AUTO
BACKEND_CUDA = _lib.VP_BACKEND_CUDA
BACKEND_SIM = _lib.VP_BACKEND_SIM
BACKEND_HIP = _lib.VP_BACKEND_HIP
ORDER_TAIL_FIRST = _lib.VP_ORDER_TAIL_FIRST
ORDER_INTERLEAVED = _lib.VP_ORDER_INTERLEAVED
ORDER_CUSTOM = _lib.VP_ORDER_CUSTOM
ORDER_NAMES = tuple(_lib.ORDERS)    # the orders by name: "tail", ...
SIM_SYNC = _lib.VP_SIM_SYNC
SIM_WORKER = _lib.VP_SIM_WORKER

# vp_sim_inject kinds.
SIM_FAIL_COMMIT = _lib.VP_SIM_FAIL_COMMIT
SIM_TRANSIENT = _lib.VP_SIM_TRANSIENT
SIM_SET_CAPACITY = _lib.VP_SIM_SET_CAPACITY
SIM_BREAK = _lib.VP_SIM_BREAK
SIM_SET_SOFT_LIMIT = _lib.VP_SIM_SET_SOFT_LIMIT
SIM_SET_DESKTOP = _lib.VP_SIM_SET_DESKTOP
SIM_MAP_APART = _lib.VP_SIM_MAP_APART

# vp_vbar_residency bits.
PAGE_RESIDENT = _lib.VP_PAGE_RESIDENT
PAGE_PINNED = _lib.VP_PAGE_PINNED

# Source kinds and vp_acquire flags.
SOURCE_NONE = _lib.VP_SOURCE_NONE
SOURCE_HOST = _lib.VP_SOURCE_HOST
SOURCE_FILE = _lib.VP_SOURCE_FILE
ACQUIRED_RESIDENT = _lib.VP_ACQUIRED_RESIDENT
ACQUIRED_STAGED = _lib.VP_ACQUIRED_STAGED
ACQUIRED_COPIED = _lib.VP_ACQUIRED_COPIED
ACQUIRED_EMPTY = _lib.VP_ACQUIRED_EMPTY
# vp_device_lend_staging: ranges lent at once.
LENT_RANGES = _lib.VP_LENT_RANGES


def set_log_level(level):
    """vp_set_log_level(): an int 0-5 or a name (none, error, warn, info,
    debug, trace)."""
    if isinstance(level, str):
        if level not in _lib.LOG_LEVELS:
            raise InvalidArgument(EINVAL, "VP_EINVAL", "log level %r is not "
                                  "one of %s" % (level,
                                                 ", ".join(_lib.LOG_LEVELS)))
        level = _lib.LOG_LEVELS[level]
    check(_lib.C.vp_set_log_level(level))


def get_log_level():
    """vp_get_log_level()."""
    return _lib.C.vp_get_log_level()


def device_count(backend="cuda"):
    """vp_device_count(): the devices of `backend` ("cuda", "hip" or
    "sim"), none opened; for a GPU backend the GPUs its driver sees, 0
    without a driver."""
    if backend not in ("cuda", "hip", "sim"):
        raise InvalidArgument(EINVAL, "VP_EINVAL", "backend %r is not "
                              "'cuda', 'hip' or 'sim'" % (backend,))
    n = ctypes.c_int(0)
    check(_lib.C.vp_device_count(_lib.BACKENDS[backend], ctypes.byref(n)))
    return n.value


def gpu_backend():
    """The vpager backend of torch's "cuda" devices: "hip" when torch is a
    ROCm build (torch.version.hip is set), else "cuda". Torch is not
    imported here: without it loaded, "cuda". The one place vpager.torch
    and the comfy_aimdo layer choose a GPU backend."""
    version = getattr(sys.modules.get("torch"), "version", None)
    return "hip" if getattr(version, "hip", None) else "cuda"


__all__ = [
    "Device", "Vbar", "HostBuf", "HostMapping", "host_drop_resident",
    "host_mappings", "host_memory", "Weights", "Weight", "WeightBatch",
    "Source", "SafeTensors", "TensorInfo", "BufferRef",
    "Error", "InvalidArgument", "HandleError", "HostOutOfMemory",
    "RangeError", "BusyError", "NotPinnedError", "NoDeviceError",
    "DeviceError", "TryAgain", "OutOfMemory", "Unsupported", "LimitError",
    "LibraryError", "check", "strerror", "err_name", "last_error",
    "library_path", "parse_size", "default_options", "OPTION_NAMES",
    "STAT_NAMES", "set_log_level", "get_log_level", "device_count",
    "gpu_backend",
]
