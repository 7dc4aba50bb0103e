"""Small libc helpers (mmap, mprotect, madvise, pread) through ctypes.
No torch, no vpager: importable anywhere."""

import ctypes
import os

__all__ = ["libc", "PAGE", "map_anon", "map_file", "unmap", "protect",
           "advise", "populate", "pread_into", "fileno", "page_up"]

libc = ctypes.CDLL(None, use_errno=True)
_vp = ctypes.c_void_p
_sz = ctypes.c_size_t
libc.mmap.restype = _vp
libc.mmap.argtypes = [_vp, _sz, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.restype = ctypes.c_int
libc.munmap.argtypes = [_vp, _sz]
libc.mprotect.restype = ctypes.c_int
libc.mprotect.argtypes = [_vp, _sz, ctypes.c_int]
libc.madvise.restype = ctypes.c_int
libc.madvise.argtypes = [_vp, _sz, ctypes.c_int]
libc.pread.restype = ctypes.c_ssize_t
libc.pread.argtypes = [ctypes.c_int, _vp, _sz, ctypes.c_long]

PAGE = os.sysconf("SC_PAGE_SIZE")
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MADV_DONTNEED = 4
MADV_POPULATE_WRITE = 23    # Linux >= 5.14
MAP_FAILED = (1 << (8 * ctypes.sizeof(_vp))) - 1


def page_up(n):
    return (n + PAGE - 1) // PAGE * PAGE


def _err(what):
    e = ctypes.get_errno()
    return OSError(e, "%s: %s" % (what, os.strerror(e)))


def map_anon(size, prot=PROT_NONE):
    """Reserve `size` bytes of address space (no memory until protected
    read-write and touched)."""
    p = libc.mmap(None, size, prot,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if p is None or p == MAP_FAILED:
        raise _err("mmap(%d)" % size)
    return p


def map_file(fd, size):
    """A read-only private mapping of [0, size) of fd."""
    p = libc.mmap(None, size, PROT_READ, MAP_PRIVATE, fd, 0)
    if p is None or p == MAP_FAILED:
        raise _err("mmap(fd %d, %d)" % (fd, size))
    return p


def unmap(addr, size):
    if addr and size and libc.munmap(addr, size) != 0:
        raise _err("munmap")


def protect(addr, size, prot):
    if size and libc.mprotect(addr, size, prot) != 0:
        raise _err("mprotect")


def advise(addr, size, advice):
    if size and libc.madvise(addr, size, advice) != 0:
        raise _err("madvise")


def populate(addr, size):
    """Fault [addr, +size) in, writable (read-write memory): one
    MADV_POPULATE_WRITE, or a write per page where the kernel lacks it."""
    if not size:
        return
    if libc.madvise(addr, size, MADV_POPULATE_WRITE) == 0:
        return
    ctypes.memset(addr, 0, size)


def fileno(f):
    """An int descriptor, or an object with fileno()."""
    return f if isinstance(f, int) else f.fileno()


def pread_into(fd, addr, size, offset):
    """Read exactly `size` bytes of fd at `offset` into host memory at
    addr; OSError on an error or a short file."""
    done = 0
    while done < size:
        n = libc.pread(fd, addr + done, size - done, offset + done)
        if n < 0:
            e = ctypes.get_errno()
            if e == 4:      # EINTR
                continue
            raise _err("pread")
        if n == 0:
            raise OSError("pread: file ends %d bytes short of offset %d + %d"
                          % (size - done, offset, size))
        done += n
    return done


def drop_cache(fd, offset=0, size=0):
    """posix_fadvise(DONTNEED): a hint; never raises."""
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
