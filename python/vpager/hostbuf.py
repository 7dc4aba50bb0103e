"""vpager.HostBuf: host memory for weights' host copies (vp_hostbuf_*);
vpager.host_memory(): the machine's RAM as the library reads it;
vpager.host_mappings(): this process's file mappings (vp_host_mappings)."""

import ctypes
from dataclasses import dataclass
from typing import Iterable, List, Tuple

from . import _lib
from ._buffer import as_buffer
from ._handle import Handle
from ._lib import (C, vp_host_mapping_t, vp_host_memory_t, vp_hostbuf_info_t,
                   vp_hostbuf_t)
from .errors import check

__all__ = ["HostBuf", "HostMapping", "host_drop_resident", "host_mappings",
           "host_memory"]

_byref = ctypes.byref


def host_memory():
    """vp_host_memory() as a dict: total (bytes of RAM), available (bytes
    available without swapping), limit (the lowest cgroup or job object
    memory limit over this process; 0 none); 0 where unknown. Linux and
    Windows alike, no device needed."""
    out = vp_host_memory_t()
    check(C.vp_host_memory(_byref(out)))
    return {"total": out.total, "available": out.available,
            "limit": out.limit}


@dataclass(frozen=True)
class HostMapping:
    """One file mapping of this process: [start, end) shows the file at
    path from file_offset on; file_id tells files apart (Linux: the inode;
    Windows: the file index). written: where it cannot be told, any
    private mapping counts as written."""
    start: int
    end: int
    file_offset: int
    file_id: int
    writable: bool      # the process may write to it
    private: bool       # copy on write: its writes leave the file alone
    written: bool       # private, and a page of it is no longer the file's
    path: str


def host_mappings() -> List[HostMapping]:
    """vp_host_mappings(): this process's file mappings in address order
    (Linux: /proc/self/smaps; Windows: the views of files that show a file
    from its start). No device needed."""
    n = ctypes.c_size_t(0)
    cap, arr = 0, None
    while True:
        check(C.vp_host_mappings(arr, cap, _byref(n)))
        if n.value <= cap:
            break
        cap = n.value + 16          # more may appear meanwhile
        arr = (vp_host_mapping_t * cap)()
    return [HostMapping(m.start, m.start + m.size, m.file_offset, m.file_id,
                        bool(m.flags & _lib.VP_MAPPING_WRITABLE),
                        bool(m.flags & _lib.VP_MAPPING_PRIVATE),
                        bool(m.flags & _lib.VP_MAPPING_WRITTEN),
                        m.path.decode("utf-8", "replace"))
            for m in (arr[:n.value] if arr is not None else [])]


def host_drop_resident(spans: Iterable[Tuple[int, int]]) -> int:
    """vp_host_drop_resident(): of the host bytes [(address, size)] a copy
    was made of, those lying whole in a file mapping this process may not
    write (a private one: where none of their pages was ever written)
    leave its resident set (the file's cache keeps them; a touch reads
    them back); any other span is left alone. Returns the bytes dropped.
    No device needed."""
    spans = [(a, n) for a, n in spans if n > 0]
    if not spans:
        return 0
    addrs = (ctypes.c_uint64 * len(spans))(*(a for a, _ in spans))
    sizes = (ctypes.c_uint64 * len(spans))(*(n for _, n in spans))
    dropped = ctypes.c_uint64(0)
    check(C.vp_host_drop_resident(len(spans), addrs, sizes, _byref(dropped)))
    return dropped.value


class HostBuf(Handle):
    """HostBuf(device, size, max_size=None): vp_hostbuf_alloc() of `size`
    zeroed bytes that may grow in place to max_size (default: size).
    HostBuf.register(device, buffer): vp_hostbuf_register() of an existing
    buffer, which is held until the HostBuf is closed.

    The memory is at .ptr and never moves; view() gives a ctypes array over
    it. Views must not be used after close() (nor after the device closes):
    the memory is gone then, as in C."""

    _kind = "hostbuf"

    def __init__(self, device, size, max_size=None, _register=None):
        h = vp_hostbuf_t()
        if _register is not None:
            buf = _register
            check(C.vp_hostbuf_register(device._handle(), buf.address,
                                        buf.size, _byref(h)))
        else:
            if max_size is None:
                max_size = size
            check(C.vp_hostbuf_alloc(device._handle(), size, max_size,
                                     _byref(h)))
        self._init_handle(h, device)
        self.device = device
        if _register is not None:
            self._keep.append(_register)

    @classmethod
    def register(cls, device, buffer, size=None):
        """Page-lock an existing writable-or-not contiguous buffer (bytes-like,
        BufferRef, or an int address with size)."""
        return cls(device, None, None, _register=as_buffer(buffer, False, size))

    def _free(self):
        check(C.vp_hostbuf_free(self._h))

    def info(self):
        """vp_hostbuf_info() as a dict: ptr, size, max_size, pinned_bytes."""
        info = vp_hostbuf_info_t()
        check(C.vp_hostbuf_info(self._handle(), _byref(info)))
        return {"ptr": info.ptr or 0, "size": info.size,
                "max_size": info.max_size, "pinned_bytes": info.pinned_bytes}

    @property
    def ptr(self):
        return self.info()["ptr"]

    @property
    def size(self):
        return self.info()["size"]

    @property
    def max_size(self):
        return self.info()["max_size"]

    @property
    def pinned_bytes(self):
        return self.info()["pinned_bytes"]

    def grow(self, size):
        """vp_hostbuf_grow(): grow in place to `size` (<= max_size)."""
        check(C.vp_hostbuf_grow(self._handle(), size))

    def view(self, offset=0, size=None):
        """A ctypes c_char array over [offset, offset+size) of the buffer
        (size defaults to the rest). It keeps this HostBuf object alive but
        is invalid once the HostBuf is closed."""
        info = self.info()
        if size is None:
            size = info["size"] - offset
        if offset < 0 or size < 0 or offset + size > info["size"]:
            from .errors import RangeError
            raise RangeError(_lib.VP_ERANGE, "VP_ERANGE", "view [%d, +%d) is past the "
                             "buffer's %d bytes" % (offset, size,
                                                    info["size"]))
        arr = (ctypes.c_char * size).from_address(info["ptr"] + offset)
        arr._vpager_owner = self
        return arr
