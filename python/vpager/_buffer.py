"""Host memory of Python objects for C: the address of any contiguous
buffer (bytes, bytearray, memoryview, array.array, mmap, ctypes arrays,
numpy arrays...), held exported until released so it cannot move or be
freed while C may still use it."""

import ctypes
from ctypes import POINTER, Structure, c_char_p, c_int, c_ssize_t, c_void_p

from . import _lib
from .errors import InvalidArgument

__all__ = ["BufferRef", "as_buffer"]


class _Py_buffer(Structure):
    _fields_ = [
        ("buf", c_void_p),
        ("obj", c_void_p),
        ("len", c_ssize_t),
        ("itemsize", c_ssize_t),
        ("readonly", c_int),
        ("ndim", c_int),
        ("format", c_char_p),
        ("shape", POINTER(c_ssize_t)),
        ("strides", POINTER(c_ssize_t)),
        ("suboffsets", POINTER(c_ssize_t)),
        ("internal", c_void_p),
    ]


_PyBUF_SIMPLE = 0          # contiguous bytes
_PyBUF_WRITABLE = 0x0001

_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, POINTER(_Py_buffer), c_int]
_get_buffer.restype = c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [POINTER(_Py_buffer)]
_release_buffer.restype = None


class BufferRef:
    """A held, contiguous host buffer: .address and .size (bytes).

    BufferRef(obj, writable=False) exports obj's buffer (raises
    InvalidArgument for objects without a contiguous buffer, or a read-only
    one when writable is asked); BufferRef(address, size=n) wraps a raw
    address. release() (or garbage collection) lets the object go.
    """

    __slots__ = ("address", "size", "_view", "__weakref__")

    def __init__(self, obj, writable=False, size=None):
        self._view = None
        if isinstance(obj, int):
            if size is None:
                raise InvalidArgument(_lib.VP_EINVAL, None, "a raw address "
                                      "needs an explicit size")
            if obj == 0:
                raise InvalidArgument(_lib.VP_EINVAL, None, "address is 0")
            self.address, self.size = obj, int(size)
            return
        view = _Py_buffer()
        flags = _PyBUF_SIMPLE | (_PyBUF_WRITABLE if writable else 0)
        try:
            _get_buffer(obj, ctypes.byref(view), flags)
        except (BufferError, TypeError) as e:
            raise InvalidArgument(
                _lib.VP_EINVAL, None,
                "%s is not a contiguous%s buffer: %s"
                % (type(obj).__name__, " writable" if writable else "", e)
            ) from None
        self._view = view
        self.address = view.buf or 0
        self.size = view.len
        if size is not None:
            if size > self.size:
                self.release()
                raise InvalidArgument(_lib.VP_EINVAL, None, "size %d is past "
                                      "the buffer's %d bytes"
                                      % (size, view.len))
            self.size = int(size)

    def release(self):
        view, self._view = self._view, None
        if view is not None:
            _release_buffer(ctypes.byref(view))

    def __del__(self):
        try:
            self.release()
        except Exception:
            pass


def as_buffer(obj, writable=False, size=None):
    """obj if it is a BufferRef already, else BufferRef(obj, ...)."""
    if isinstance(obj, BufferRef):
        if size is not None and size > obj.size:
            raise InvalidArgument(_lib.VP_EINVAL, None, "size %d is past the "
                                  "buffer's %d bytes" % (size, obj.size))
        return obj
    return BufferRef(obj, writable, size)
