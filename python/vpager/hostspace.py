"""vpager.hostspace: host address space reserved once and committed by
range, and files mapped read-only or read at offsets, through the library
(vp_host_reserve and its kin, vp_file_map, vp_file_read_at): one set of
calls on POSIX and Windows, no device needed. Addresses are ints; ranges
within a reservation are whole pages (page_size()). Errors are vpager's
(InvalidArgument, HostOutOfMemory) naming the call."""

import ctypes
from typing import Any

from ._fds import NativeFd
from ._lib import C
from .errors import check

__all__ = ["page_size", "reserve", "commit", "populate", "discard",
           "decommit", "advise_huge", "release", "map_file", "unmap_file",
           "FileReader"]

_PAGE = []


def page_size() -> int:
    """The OS's page: ranges given to the calls below are multiples."""
    if not _PAGE:
        out = ctypes.c_uint64()
        check(C.vp_host_page_size(ctypes.byref(out)))
        _PAGE.append(out.value)
    return _PAGE[0]


def reserve(size: int, align: int = 0) -> int:
    """Address space for `size` bytes (rounded up to pages), no access and
    no memory yet, starting at a multiple of `align` (a power of two; 0:
    the OS's own). release(addr, size) gives it back whole."""
    out = ctypes.c_void_p()
    check(C.vp_host_reserve(size, align, ctypes.byref(out)))
    return out.value


def commit(addr: int, size: int) -> None:
    """Make [addr, +size) read-write: zeros, memory on first touch."""
    check(C.vp_host_commit(addr, size))


def populate(addr: int, size: int) -> None:
    """Fault committed [addr, +size) in now, writable; HostOutOfMemory
    where the OS says the memory is not there. The call drops the GIL:
    threads may populate pieces of a range at once."""
    check(C.vp_host_populate(addr, size))


def discard(addr: int, size: int) -> None:
    """Give [addr, +size)'s memory back, leaving it read-write (zeros when
    next read)."""
    check(C.vp_host_discard(addr, size))


def decommit(addr: int, size: int) -> None:
    """Give [addr, +size)'s memory back and its access with it."""
    check(C.vp_host_decommit(addr, size))


def advise_huge(addr: int, size: int) -> None:
    """Ask for transparent huge pages over [addr, +size) (Linux; a hint)."""
    check(C.vp_host_advise_huge(addr, size))


def release(addr: int, size: int) -> None:
    """Give a whole reservation (reserve()'s address and size) back."""
    check(C.vp_host_release(addr, size))


def map_file(fd: int, size: int) -> int:
    """The address of the first `size` bytes of Python's fd `fd` (a
    regular file at least that long) mapped read-only; unmap_file(addr,
    size) undoes it. The mapping outlives the fd."""
    out = ctypes.c_void_p()
    with NativeFd(fd) as nfd:
        check(C.vp_file_map(nfd.fd, size, ctypes.byref(out)))
    return out.value


def unmap_file(addr: int, size: int) -> None:
    check(C.vp_file_unmap(addr, size))


class FileReader:
    """Reads of Python's fd `fd` at offsets into host memory (pread; on
    Windows overlapped reads of a handle of the library's), from any
    number of threads at once; close() (or `with`) lets the fd go."""

    def __init__(self, fd: int):
        self._nfd = NativeFd(fd)

    def read_at(self, addr: int, n: int, offset: int) -> int:
        """One read of up to n bytes at `offset` into addr: the bytes
        read, 0 at the file's end."""
        got = ctypes.c_uint64()
        check(C.vp_file_read_at(self._nfd.fd, addr, n, offset,
                                ctypes.byref(got)))
        return got.value

    def close(self) -> None:
        self._nfd.close()

    def __enter__(self) -> "FileReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
