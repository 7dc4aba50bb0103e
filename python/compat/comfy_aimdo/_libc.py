"""Small libc helpers (mmap, mprotect, madvise, pread) through ctypes.
No torch, no vpager: importable anywhere.

The bulk ones run over several threads (_par) when the range is large:
populate() faults memory in (MADV_POPULATE_WRITE, or writing it where the
kernel lacks that), pread_par() reads a file range (pread per piece).
ctypes drops the GIL around each call, so the kernel does the work on
every thread at once.

POSIX only: on Windows (no libc with mmap, madvise, pread) importing it
works and every call that needs libc raises OSError(ENOSYS) saying so
(docs/windows.md).
"""

import ctypes
import errno
import mmap
import os
import stat
import sys

from . import _par

__all__ = ["libc", "PAGE", "HUGE", "map_anon", "map_file", "unmap",
           "protect", "advise", "hugepage", "populate", "pread_into",
           "pread_par", "read_pieces", "check_file_range", "fileno",
           "page_up", "huge_up"]

class _NoLibc:
    """libc where there is none (Windows): each use raises."""

    def __getattr__(self, name):
        raise OSError(errno.ENOSYS, "comfy_aimdo on vpager: %s() is POSIX "
                      "only; host buffers and model mappings of the drop-in "
                      "are not implemented on Windows yet" % name)


_vp = ctypes.c_void_p
_sz = ctypes.c_size_t


def _load_libc():
    if sys.platform == "win32":
        return _NoLibc()
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = _vp
    lib.mmap.argtypes = [_vp, _sz, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [_vp, _sz]
    lib.mprotect.restype = ctypes.c_int
    lib.mprotect.argtypes = [_vp, _sz, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [_vp, _sz, ctypes.c_int]
    lib.pread.restype = ctypes.c_ssize_t
    lib.pread.argtypes = [ctypes.c_int, _vp, _sz, ctypes.c_long]
    return lib


libc = _load_libc()
PAGE = mmap.PAGESIZE
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23    # Linux >= 5.14
MAP_FAILED = (1 << (8 * ctypes.sizeof(_vp))) - 1


def _huge_size():
    if not sys.platform.startswith("linux"):
        return 2 << 20
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            n = int(f.read())
        if n >= PAGE and n & (n - 1) == 0:
            return n
    except (OSError, ValueError):
        pass
    return 2 << 20


HUGE = _huge_size()         # a transparent huge page (2 MiB on x86-64)
# hugepage() advises (VPAGER_COMPAT_THP=0: it does nothing); read at the
# first advice (vpager.env: comfy_aimdo imports no vpager before init()).
THP = None


def _thp():
    global THP
    if THP is None:
        from vpager import env
        THP = env.flag("VPAGER_COMPAT_THP", True)
    return THP

# Pieces the bulk calls split into: at least this big, at most threads().
POPULATE_PIECE = 8 << 20
READ_PIECE = 4 << 20
_ALIGN = 64 << 10           # piece edges, in destination addresses

_populate_write = True      # False once the kernel refused it (EINVAL)


def page_up(n):
    return (n + PAGE - 1) // PAGE * PAGE


def huge_up(n):
    return (n + HUGE - 1) // HUGE * HUGE


def _err(what):
    e = ctypes.get_errno()
    return OSError(e, "%s: %s" % (what, os.strerror(e)))


def map_anon(size, prot=PROT_NONE, align=0):
    """Reserve `size` bytes of address space (no memory until protected
    read-write and touched), at a multiple of `align` (a power of two)
    when given: a range that starts on a huge page can be backed by huge
    pages from its first byte."""
    extra = align if align > PAGE else 0
    p = libc.mmap(None, size + extra, prot,
                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if p is None or p == MAP_FAILED:
        raise _err("mmap(%d)" % size)
    if extra:
        start = (p + align - 1) & ~(align - 1)
        if start > p:
            libc.munmap(p, start - p)
        if p + extra > start:
            libc.munmap(start + size, p + extra - start)
        p = start
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


def hugepage(addr, size):
    """MADV_HUGEPAGE over [addr, +size): transparent huge pages where the
    system has them in "madvise" mode (a hint; never raises; nothing when
    THP is False)."""
    if size and _thp():
        libc.madvise(addr, size, MADV_HUGEPAGE)


def _populate_one(piece):
    """Fault one piece in, writable: MADV_POPULATE_WRITE, or (the kernel
    lacks it: EINVAL) zeroing it, which the memory is already. OSError when
    the memory is not there to have (ENOMEM: out of memory)."""
    global _populate_write
    addr, size = piece
    while _populate_write:
        if libc.madvise(addr, size, MADV_POPULATE_WRITE) == 0:
            return
        e = ctypes.get_errno()
        if e == errno.EINTR:
            continue
        if e == errno.EINVAL:
            _populate_write = False
            break
        raise OSError(e, "madvise(MADV_POPULATE_WRITE) of %d bytes: %s"
                      % (size, os.strerror(e)))
    ctypes.memset(addr, 0, size)


def _split(addr, size, piece, align, workers):
    """[(address, bytes)] covering [addr, +size): about size / workers
    each but at least `piece` (one piece when it is small), inner edges
    at multiples of `align` in addresses."""
    n = max(1, min(workers, size // piece))
    if n == 1:
        return [(addr, size)]
    step = (size + n - 1) // n
    edges = [addr]
    for k in range(1, n):
        e = (addr + k * step) // align * align
        if edges[-1] < e < addr + size:
            edges.append(e)
    edges.append(addr + size)
    return [(edges[i], edges[i + 1] - edges[i])
            for i in range(len(edges) - 1)]


def mem_available():
    """MemAvailable in bytes (vpager._sysmem), None when unknown."""
    from vpager import _sysmem
    return _sysmem.ram_available()


CHECK_AVAILABLE = 64 << 20   # populating more: first see that it is there


def populate(addr, size, workers=None):
    """Fault [addr, +size) in, writable (read-write, zero or otherwise
    unused memory), over up to `workers` (default _par.threads()) threads
    for a large range: MADV_POPULATE_WRITE, or writing zeros where the
    kernel lacks it. OSError (ENOMEM) when the memory cannot be had (more
    than MemAvailable is refused before anything is touched); part of the
    range may be populated then."""
    if not size:
        return
    if size >= CHECK_AVAILABLE:
        avail = mem_available()
        if avail is not None and size > avail:
            # Faulting it all in would wake the OOM killer, not fail.
            raise OSError(errno.ENOMEM, "populating %d bytes: the system "
                          "has %d available" % (size, avail))
    pieces = _split(addr, size, POPULATE_PIECE, HUGE,
                    _par.threads() if workers is None else workers)
    _par.run(_populate_one, pieces, workers=len(pieces))


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
            if e == errno.EINTR:
                continue
            raise _err("pread")
        if n == 0:
            raise OSError(errno.EIO, "pread: file ends %d bytes short of "
                          "offset %d + %d" % (size - done, offset, size))
        done += n
    return done


MAX_OFFSET = (1 << 63) - 1


def check_file_range(fd, offset, size):
    """OSError, before anything is read, when [offset, +size) is not in
    the file: a negative or too large offset, or (a regular file) one that
    ends past the file's end. Other files (pipes, devices) are left to
    pread to judge."""
    if offset < 0 or size < 0 or offset + size > MAX_OFFSET:
        raise OSError(errno.EINVAL, "file range [%d, +%d) is not a file "
                      "offset range" % (offset, size))
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and offset + size > st.st_size:
        raise OSError(errno.EIO, "pread: file ends %d bytes short of offset "
                      "%d + %d (it has %d bytes)"
                      % (offset + size - max(st.st_size, offset), offset,
                         size, st.st_size))


def _read_plan(addr, size, piece, workers):
    return _split(addr, size, piece, _ALIGN, workers)


def pread_par(fd, addr, size, offset, workers=None):
    """pread_into over up to `workers` (default _par.threads()) threads,
    one contiguous piece each (at least READ_PIECE bytes), all finished
    when it returns (an error is raised after every piece ended)."""
    if not size:
        return 0
    pieces = _read_plan(addr, size, READ_PIECE,
                        _par.threads() if workers is None else workers)
    if len(pieces) == 1:
        return pread_into(fd, addr, size, offset)
    _par.run(lambda p: pread_into(fd, p[0], p[1], offset + p[0] - addr),
             pieces, workers=len(pieces))
    return size


def read_pieces(fd, addr, size, offset, done, piece=None):
    """Read [offset, +size) of fd to addr in pieces over _par.threads()
    threads and call done(piece_addr, nbytes) on the calling thread for
    each run of finished pieces, in file order, as soon as it is complete
    (to pass it on, e.g. upload it, while later pieces are read). Pieces:
    `piece` bytes, default size / (2 threads) within 4..32 MiB (each
    upload costs some microseconds of Python; and a caller's next call
    overlaps this one's last uploads anyway). Returns
    once every read finished; the first error (a read's or done's) is
    raised then, and no piece after a failed one is passed to done."""
    if not size:
        return
    t = _par.threads()
    if piece is None:
        piece = min(32 << 20, max(4 << 20, size // (2 * t)))
    count = max(1, min(size // piece, 4096))
    if t <= 1 or count <= 1:
        pread_into(fd, addr, size, offset)
        done(addr, size)
        return
    pieces = _read_plan(addr, size, 1, count)
    futs = _par.submit_all(
        lambda p: pread_into(fd, p[0], p[1], offset + p[0] - addr), pieces)
    first, i = None, 0
    try:
        while i < len(futs):
            futs[i].result()
            j = i + 1
            while j < len(futs) and futs[j].done() and \
                    futs[j].exception() is None:
                j += 1
            start = pieces[i][0]
            done(start, pieces[j - 1][0] + pieces[j - 1][1] - start)
            i = j
    except BaseException as e:          # noqa: BLE001
        first = e
        for f in futs[i:]:
            f.cancel()
        for f in futs[i:]:
            if not f.cancelled():
                try:
                    f.result()
                except BaseException:   # noqa: BLE001
                    pass
    if first is not None:
        raise first


def drop_cache(fd, offset=0, size=0):
    """posix_fadvise(DONTNEED): a hint; never raises."""
    try:
        os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
