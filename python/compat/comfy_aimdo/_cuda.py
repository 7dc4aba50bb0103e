"""The CUDA driver through ctypes, for the one thing vpager's API does not
do: unregistering host memory that a client page-locked itself
(cudaHostRegister on part of a HostBuffer, as ComfyUI >= 0.38 does).

Driver calls leave the CUDA runtime's error state alone (a failed runtime
call would be reported again by torch's next error check). No torch, no
vpager: importable anywhere; libcuda is loaded on the first call.
"""

import ctypes
import threading

__all__ = ["host_unregister", "NOT_REGISTERED"]

NOT_REGISTERED = 713        # CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
_cu = None
_lock = threading.Lock()


def _fn(cu, *names):
    for n in names:
        f = getattr(cu, n, None)
        if f is not None:
            return f
    raise OSError("libcuda has none of %s" % ", ".join(names))


def _load():
    global _cu
    with _lock:
        if _cu is not None:
            return _cu
        cu = ctypes.CDLL("libcuda.so.1")
        vp, pvp, pint = (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.POINTER(ctypes.c_int))
        fns = {
            "init": (_fn(cu, "cuInit"), [ctypes.c_uint]),
            "unregister": (_fn(cu, "cuMemHostUnregister"), [vp]),
            "current": (_fn(cu, "cuCtxGetCurrent"), [pvp]),
            "device": (_fn(cu, "cuDeviceGet"), [pint, ctypes.c_int]),
            "retain": (_fn(cu, "cuDevicePrimaryCtxRetain"), [pvp,
                                                            ctypes.c_int]),
            "release": (_fn(cu, "cuDevicePrimaryCtxRelease_v2",
                            "cuDevicePrimaryCtxRelease"), [ctypes.c_int]),
            "push": (_fn(cu, "cuCtxPushCurrent_v2", "cuCtxPushCurrent"),
                     [vp]),
            "pop": (_fn(cu, "cuCtxPopCurrent_v2", "cuCtxPopCurrent"), [pvp]),
        }
        for f, args in fns.values():
            f.argtypes = args
            f.restype = ctypes.c_int
        if fns["init"][0](0) != 0:
            raise OSError("cuInit failed")
        _cu = {k: f for k, (f, _) in fns.items()}
        return _cu


def host_unregister(ptr, ordinal=0):
    """cuMemHostUnregister(ptr): in the thread's current context, else in
    device `ordinal`'s primary context. Returns the CUresult (0: it was
    registered and is not any more; NOT_REGISTERED: it was not). OSError
    when the driver cannot be loaded."""
    cu = _load()
    ctx = ctypes.c_void_p()
    if cu["current"](ctypes.byref(ctx)) == 0 and ctx.value:
        return cu["unregister"](ptr)
    dev = ctypes.c_int()
    rc = cu["device"](ctypes.byref(dev), int(ordinal))
    if rc != 0:
        return rc
    rc = cu["retain"](ctypes.byref(ctx), dev.value)
    if rc != 0:
        return rc
    try:
        rc = cu["push"](ctx)
        if rc != 0:
            return rc
        try:
            return cu["unregister"](ptr)
        finally:
            cu["pop"](ctypes.byref(ctypes.c_void_p()))
    finally:
        cu["release"](dev.value)
