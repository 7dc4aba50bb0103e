"""vpager.Error and its subclasses, one per VP_E* code; check(rc)."""

from . import _lib
from ._lib import C

__all__ = [
    "Error", "InvalidArgument", "HandleError", "HostOutOfMemory",
    "RangeError", "BusyError", "NotPinnedError", "NoDeviceError",
    "DeviceError", "TryAgain", "OutOfMemory", "Unsupported", "LimitError",
    "check", "strerror", "err_name", "last_error", "closed_error",
]


class Error(RuntimeError):
    """A failed vpager call.

    code: the negative VP_E* code; name: its name ("VP_EINVAL");
    message: what vp_last_error() said (or the code's description).
    """

    def __init__(self, code, name=None, message=None):
        if name is None:
            name = _NAMES.get(code, "VP_E%d" % code)
        if message is None:
            message = _TEXTS.get(code, "error %d" % code)
        super().__init__(code, name, message)
        self.code = code
        self.name = name
        self.message = message

    def __str__(self):
        return "%s: %s" % (self.name, self.message)


class InvalidArgument(Error, ValueError):
    """VP_EINVAL"""


class HandleError(Error):
    """VP_EHANDLE: invalid, stale (closed) or foreign handle."""


class HostOutOfMemory(Error, MemoryError):
    """VP_ENOMEM: out of host memory."""


class RangeError(Error):
    """VP_ERANGE"""


class BusyError(Error):
    """VP_EBUSY: the object is in use (pinned pages, acquired weights)."""


class NotPinnedError(Error):
    """VP_ENOTPINNED"""


class NoDeviceError(Error):
    """VP_ENODEV"""


class DeviceError(Error):
    """VP_EDEVICE: the device is broken."""


class TryAgain(Error):
    """VP_EAGAIN: transient device error."""


class OutOfMemory(Error):
    """VP_EOOM: out of device memory."""


class Unsupported(Error):
    """VP_EUNSUPPORTED: not supported by this backend."""


class LimitError(Error):
    """VP_ELIMIT: an internal limit (staging ring, page count) was reached."""


_CLASSES = {
    _lib.VP_EINVAL: InvalidArgument,
    _lib.VP_EHANDLE: HandleError,
    _lib.VP_ENOMEM: HostOutOfMemory,
    _lib.VP_ERANGE: RangeError,
    _lib.VP_EBUSY: BusyError,
    _lib.VP_ENOTPINNED: NotPinnedError,
    _lib.VP_ENODEV: NoDeviceError,
    _lib.VP_EDEVICE: DeviceError,
    _lib.VP_EAGAIN: TryAgain,
    _lib.VP_EOOM: OutOfMemory,
    _lib.VP_EUNSUPPORTED: Unsupported,
    _lib.VP_ELIMIT: LimitError,
}
# Used when the library is not there to ask (messages made by the binding).
_NAMES = {code: "VP_" + name for name, code, _ in _lib.ERRNO_MAP}
_TEXTS = {code: text for _, code, text in _lib.ERRNO_MAP}


def error_class(code):
    return _CLASSES.get(code, Error)


def strerror(code):
    """vp_strerror(code): a static description of a code."""
    return C.vp_strerror(code).decode()


def err_name(code):
    """vp_err_name(code): "VP_EINVAL" and the like."""
    return C.vp_err_name(code).decode()


def last_error():
    """vp_last_error(): the last failure of this thread ("" if none)."""
    return C.vp_last_error().decode(errors="replace")


def check(rc):
    """Raise the Error for a negative code; return rc otherwise (VP_OK, or
    VP_MISS, which is not an error)."""
    if rc >= 0:
        return rc
    msg = C.vp_last_error().decode(errors="replace")
    name = C.vp_err_name(rc).decode()
    if not msg:
        msg = C.vp_strerror(rc).decode()
    raise _CLASSES.get(rc, Error)(rc, name, msg)


def closed_error(what):
    """The HandleError for a Python object whose C object is gone."""
    return HandleError(_lib.VP_EHANDLE, "VP_EHANDLE",
                       "%s is closed (its C object was freed)" % what)
