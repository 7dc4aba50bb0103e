"""Host memory and file helpers of the drop-in: address space reserved
and committed by range, read-only file maps, reads at offsets. They call
vpager's library (vpager.hostspace: mmap/mprotect/madvise/pread on POSIX,
VirtualAlloc/VirtualFree/MapViewOfFile/overlapped reads on Windows), which
is loaded at the first call, not at import: comfy_aimdo imports no vpager
before init().

The bulk ones run over several threads (_par) when the range is large:
populate() faults memory in, pread_par() reads a file range (a read per
piece). ctypes drops the GIL around each call, so the OS does the work on
every thread at once. Errors are OSError (ENOMEM: no memory to have).
"""

import errno
import mmap
import os
import stat
import sys

from . import _par

__all__ = ["PAGE", "HUGE", "map_anon", "map_file", "unmap_file", "release",
           "commit", "decommit", "discard", "drop_resident", "hugepage",
           "populate", "pread_into", "pread_par", "read_pieces",
           "check_file_range", "fileno", "page_up", "huge_up"]

PAGE = mmap.PAGESIZE


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
# first advice.
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


def page_up(n):
    return (n + PAGE - 1) // PAGE * PAGE


def huge_up(n):
    return (n + HUGE - 1) // HUGE * HUGE


def _space():
    from vpager import hostspace
    return hostspace


def _os_error(e):
    """vpager's error as the OSError the drop-in raises."""
    from vpager import HostOutOfMemory
    return OSError(errno.ENOMEM if isinstance(e, HostOutOfMemory)
                   else errno.EINVAL, str(e))


def _call(fn, *args):
    from vpager import Error
    try:
        return fn(*args)
    except Error as e:
        raise _os_error(e) from None


def map_anon(size, align=0):
    """Reserve `size` bytes of address space (no memory until committed
    and touched), at a multiple of `align` (a power of two) when given: a
    range that starts on a huge page can be backed by huge pages from its
    first byte. release(addr, size) gives it back."""
    return _call(_space().reserve, size, align)


def release(addr, size):
    if addr and size:
        _call(_space().release, addr, page_up(size))


def commit(addr, size):
    """[addr, +size) read-write (zeros; memory on first touch)."""
    if size:
        _call(_space().commit, addr, size)


def decommit(addr, size):
    """[addr, +size)'s memory given back, and its access."""
    if size:
        _call(_space().decommit, addr, size)


def discard(addr, size):
    """[addr, +size)'s memory given back; it stays read-write (zeros)."""
    if size:
        _call(_space().discard, addr, size)


def map_file(fd, size):
    """A read-only mapping of [0, size) of fd."""
    return _call(_space().map_file, fd, size)


def unmap_file(addr, size):
    if addr and size:
        _call(_space().unmap_file, addr, size)


def drop_resident(addr, size):
    """A read-only file mapping's resident pages dropped (read again from
    the file when touched; vpager.host_drop_resident). Never raises."""
    import vpager
    try:
        vpager.host_drop_resident([(addr, size)])
    except vpager.Error:
        pass


def hugepage(addr, size):
    """Transparent huge pages asked for over [addr, +size) where the
    system has them in "madvise" mode (a hint; never raises; nothing when
    THP is False)."""
    if size and _thp():
        try:
            _space().advise_huge(addr, size)
        except Exception:       # noqa: BLE001 (a hint)
            pass


def _populate_one(piece):
    addr, size = piece
    _call(_space().populate, addr, size)


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


def pread_into(fd, addr, size, offset, reader=None):
    """Read exactly `size` bytes of fd at `offset` into host memory at
    addr (reader: a vpager.hostspace.FileReader of fd, else one for this
    call); OSError on an error or a short file."""
    own = reader is None
    if own:
        reader = _call(_space().FileReader, fd)
    try:
        done = 0
        while done < size:
            n = _call(reader.read_at, addr + done, size - done,
                      offset + done)
            if n == 0:
                raise OSError(errno.EIO, "pread: file ends %d bytes short "
                              "of offset %d + %d" % (size - done, offset,
                                                     size))
            done += n
    finally:
        if own:
            reader.close()
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
    with _call(_space().FileReader, fd) as r:
        _par.run(lambda p: pread_into(fd, p[0], p[1], offset + p[0] - addr,
                                      r), pieces, workers=len(pieces))
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
    with _call(_space().FileReader, fd) as r:
        _read_pieces(fd, addr, offset, done, pieces, r)


def _read_pieces(fd, addr, offset, done, pieces, reader):
    """read_pieces' reads and hand-overs; every read has ended when it
    returns (the reader may close then)."""
    futs = _par.submit_all(
        lambda p: pread_into(fd, p[0], p[1], offset + p[0] - addr, reader),
        pieces)
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
