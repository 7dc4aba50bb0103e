"""comfy_aimdo.host_buffer on vpager: an address-stable growable host
region, page-locked piecewise through vpager (vp_hostbuf_register).

The region is an anonymous mapping reserved once (address space only, on
the first extend: HostBuffer(0, 0, 0) costs nothing), starting on a huge
page and advised for transparent huge pages (MADV_HUGEPAGE), and made
usable as it is extended: read-write to the next huge page and populated
there and then (MADV_POPULATE_WRITE over several threads for a large
extend, _par), so that a client's cudaHostRegister of it pins memory that
is there (at the speed of touched memory) instead of faulting every page
in one by one. It never moves unless extend(..., reallocate=True) must
grow past the reservation. Each registered piece is its own vpager host
buffer, keyed by its offset (unregister(offset)); register=False leaves the new
part ordinary page-aligned memory the caller may register itself. Pinning
uses the lowest-index vpager device and its pin budget; before init, or
over the budget, memory stays pageable (correct, slower), as in vpager.

A caller that registers a register=False part itself (cudaHostRegister at
the address extend() returned, as ComfyUI >= 0.38 does) may unregister it
itself too, and the buffer stays mapped. truncate(n, do_unregister=True)
and close() drop such registrations past n (each part once, by its start
address, through vpager's vp_host_unregister: a part the caller
unregistered already answers "not registered", which is ignored);
do_unregister=False leaves them to the caller. vpager's own registrations are never touched by that:
a part is either the buffer's (register=True or register()) or the
caller's.

File reads (read_file_slice, read_file_to_device) check the range
against the file first (OSError, nothing read), then read large ranges in
pieces over several threads (pread into the destination); chained to a
device upload, each finished run of pieces is uploaded while later ones
are read. read_file_to_device goes through this module's file reader: a
few pinned staging slots per device, each slot's upload overlapping the
next slot's reads (a small read to pinned VBAR memory: vpager's own file
reader).
"""

import ctypes
import operator
import sys

from . import _hostio, _par, control

__all__ = ["HostBuffer"]


def _ram():
    from vpager import _sysmem
    return _sysmem.ram_total() or 1 << 40


def _pin_device():
    devs = control.devices()
    for i in sorted(devs):
        if not devs[i].closed:
            return devs[i]
    return None


def _external_unregister(ptr):
    """Drop a registration the caller made itself at host address `ptr`
    (the start of a register=False part) through vpager
    (vp_host_unregister, in the lowest-index open CUDA device's context:
    torch's, the primary context); nothing without one, as on the
    simulated device (its host memory needs no registration). True when
    something was unregistered. Tests replace this to see the calls."""
    devs = control.devices()
    cuda = [i for i, d in devs.items() if not d.closed and d.backend != "sim"]
    if not cuda:
        return False
    try:
        return devs[min(cuda)].host_unregister(ptr)
    except control._vpager.Error:
        return False


MAX_BYTES = 1 << 56          # past any address space: refused outright


def _quietly(fn, *args):
    """An undo step on a failure path: the failure's error is the one to
    raise."""
    try:
        fn(*args)
    except OSError:
        pass


def _nbytes(value, what, none=None):
    """A byte count: an int (or a whole float) in 0..MAX_BYTES; None gives
    `none` where that is not None, else a TypeError."""
    if value is None and none is not None:
        return none
    try:
        n = _index(value)
    except TypeError:
        raise TypeError("HostBuffer: %s must be an int, not %s"
                        % (what, type(value).__name__)) from None
    if n < 0 or n > MAX_BYTES:
        raise ValueError("HostBuffer: %s must be in 0..2**56 bytes, not %d"
                         % (what, n))
    return n


def _index(value):
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or \
                value != int(value):
            raise TypeError("not a whole number")
        return int(value)
    return operator.index(value)


class HostBuffer:
    """HostBuffer(size, prewarm=0, max_grow_size=0, mark_cold=True).

    `size` bytes are extended (and registered) at once; the first
    `prewarm` bytes of the region (at most a quarter of the machine's RAM)
    are made usable and populated now (also past `size`: with size 0, as
    HostBuffer(0, 64 MiB, max) does, the first extends then land on
    populated memory; a truncate() below them returns them like any other
    memory); the reservation is the
    largest of size, prewarm, max_grow_size and the machine's RAM (address
    space only), so extend() keeps the address. mark_cold is accepted (no
    effect). HostBuffer(0, 0, 0) reserves nothing."""

    def __init__(self, size=0, prewarm=0, max_grow_size=0, mark_cold=True):
        self.size = 0
        self._base = 0
        self._cap = 0
        self._mapped = 0                # bytes made read-write (whole HUGE)
        self._populated = 0             # bytes of that faulted in
        self._regs = {}                 # offset -> (size, vpager.HostBuf)
        self._parts = {}                # offset -> size: register=False parts
        size = _nbytes(size, "size")
        prewarm = _nbytes(prewarm, "prewarm", none=0)
        self._want_cap = max(size, prewarm,
                             _nbytes(max_grow_size, "max_grow_size", none=0))
        self.mark_cold = mark_cold
        if size:
            self.extend(size)
        if prewarm:
            self._prewarm(min(prewarm, _ram() // 4))

    def _prewarm(self, n):
        try:
            if not self._base:
                self._reserve(n)
            self._make_usable(min(n, self._cap))
        except OSError as e:
            raise RuntimeError("HostBuffer(prewarm=%d): %s" % (n, e)) \
                from None

    # ------------------------------------------------------------ memory
    def _reserve(self, need):
        """Address space for the buffer, starting on a huge page and
        advised for transparent huge pages (no memory yet)."""
        cap = _hostio.huge_up(max(need, self._want_cap, _ram()))
        self._base = _hostio.map_anon(cap, align=_hostio.HUGE)
        self._cap = cap
        _hostio.hugepage(self._base, cap)

    def _make_usable(self, end):
        """Make [0, end) read-write and faulted in: the mapping grows in
        whole huge pages, and what it adds is populated at once (over
        several threads when large), so the client's cudaHostRegister of
        it pins memory that is there instead of faulting it in 4 KiB at a
        time. On failure (out of memory) what this call added is returned
        and OSError raised."""
        end = min(_hostio.huge_up(end), self._cap)
        if end <= self._populated:
            return
        old_mapped, old_populated = self._mapped, self._populated
        try:
            if end > self._mapped:
                _hostio.commit(self._base + self._mapped, end - self._mapped)
                self._mapped = end
            _hostio.populate(self._base + self._populated,
                           end - self._populated)
            self._populated = end
        except OSError:
            _quietly(_hostio.discard, self._base + old_populated,
                     self._mapped - old_populated)
            if self._mapped > old_mapped:
                _quietly(_hostio.decommit, self._base + old_mapped,
                         self._mapped - old_mapped)
            self._mapped, self._populated = old_mapped, old_populated
            raise

    def get_raw_address(self):
        """The base address (0 until something was extended)."""
        return self._base

    def extend(self, size, reallocate=False, register=True):
        """Grow by `size` bytes; returns the address of the new part.
        RuntimeError when it cannot grow (past the reservation without
        reallocate, or out of memory)."""
        size = _nbytes(size, "extend(size)")
        old = self.size
        new = old + size
        try:
            if not self._base:
                self._reserve(new)
            elif new > self._cap:
                if not reallocate:
                    raise RuntimeError("HostBuffer: %d bytes are past the %d "
                                       "reserved" % (new, self._cap))
                self._move(new)
            self._make_usable(new)
        except OSError as e:
            raise RuntimeError("HostBuffer.extend(%d): %s" % (size, e)) \
                from None
        self.size = new
        if register and size:
            self.register(old, size)
        elif size:
            self._parts[old] = size
        return self._base + old

    def _drop_parts(self, size, unregister):
        """Forget the register=False parts past `size` (trimming one that
        straddles it), dropping the caller's registrations of those that
        end past it first when `unregister`."""
        for off in sorted(self._parts):
            n = self._parts[off]
            if off + n <= size:
                continue
            if unregister:
                _external_unregister(self._base + off)
            if off < size and not unregister:
                self._parts[off] = size - off
            else:
                del self._parts[off]

    def _move(self, need):
        """Reallocate: a bigger reservation, the bytes copied over, the
        registrations redone (the address changes)."""
        regs = [(off, n) for off, (n, _) in sorted(self._regs.items())]
        for off in list(self._regs):
            self.unregister(off)
        self._drop_parts(0, True)       # the old addresses go away
        old_base, old_cap = self._base, self._cap
        old_mapped, old_populated = self._mapped, self._populated
        self._want_cap = max(self._want_cap, need * 2)
        self._reserve(need)
        self._mapped = self._populated = 0
        try:
            self._make_usable(old_populated)
        except OSError:
            _hostio.release(self._base, self._cap)
            self._base, self._cap = old_base, old_cap
            self._mapped, self._populated = old_mapped, old_populated
            for off, n in regs:
                self.register(off, n)
            raise
        ctypes.memmove(self._base, old_base, self.size)
        _hostio.release(old_base, old_cap)
        for off, n in regs:
            self.register(off, n)

    def truncate(self, size, do_unregister=True):
        """Shrink to `size` bytes: the memory past it is returned to the
        system (registrations there are dropped first when do_unregister;
        otherwise they stay until unregister()). The address stays."""
        size = _nbytes(size, "truncate(size)")
        if size > self.size:
            raise ValueError("truncate(%d) of a %d-byte buffer"
                             % (size, self.size))
        do_unregister = bool(do_unregister)
        if do_unregister:
            for off in [o for o, (n, _) in self._regs.items()
                        if o + n > size]:
                self.unregister(off)
        self._drop_parts(size, do_unregister)
        keep = _hostio.page_up(size)
        if self._base and keep < self._populated:
            pinned_past = any(o + n > keep for o, (n, _) in
                              self._regs.items())
            if not pinned_past:
                # The memory past the new size goes back (the rest of its
                # page is zeroed, so extend() always gives zeroed memory);
                # the mapping stays read-write to the next huge page.
                ctypes.memset(self._base + size, 0, keep - size)
                _hostio.discard(self._base + keep, self._populated - keep)
                self._populated = keep
                keep_map = min(_hostio.huge_up(keep), self._cap)
                if keep_map < self._mapped:
                    _hostio.decommit(self._base + keep_map,
                                   self._mapped - keep_map)
                    self._mapped = keep_map
        self.size = size

    def register(self, offset, size):
        """Page-lock [offset, +size) through vpager (a no-op before any
        device is open; over the pin budget the memory stays pageable)."""
        offset = _nbytes(offset, "register(offset)")
        size = _nbytes(size, "register(size)")
        if size <= 0 or offset + size > self.size:
            raise ValueError("register [%d, +%d) of a %d-byte buffer"
                             % (offset, size, self.size))
        if offset in self._regs:
            raise ValueError("offset %d is registered already" % offset)
        # The part is the buffer's from now on: never the caller's to drop.
        self._parts.pop(offset, None)
        dev = _pin_device()
        if dev is None:
            return
        try:
            hb = dev.register_hostbuf(self._base + offset, size)
        except control._vpager.Error as e:
            raise RuntimeError("HostBuffer.register: %s" % e) from None
        self._regs[offset] = (size, hb)

    def unregister(self, offset):
        """Unpin what register() (or extend()) pinned at `offset`; nothing
        when it pinned nothing there (a caller's own registration of a
        register=False part is the caller's to drop)."""
        reg = self._regs.pop(_nbytes(offset, "unregister(offset)"), None)
        if reg is not None and not reg[1].closed:
            reg[1].close()

    # ------------------------------------------------------------- files
    def read_file_slice(self, file, file_offset, size, offset=0, stream=0,
                        device_ptr=0, device=-1):
        """Read `size` bytes of the file at file_offset into the buffer at
        `offset`; then, if device_ptr, upload them there ordered on
        `stream`. Large slices are read over several threads (_par), and
        with device_ptr each finished run of pieces is uploaded while the
        next ones are read. OSError (nothing read) when the range is not
        in the file; ValueError when it is not in the buffer."""
        size = _nbytes(size, "read_file_slice(size)")
        offset = _nbytes(offset, "read_file_slice(offset)")
        file_offset = _nbytes(file_offset, "read_file_slice(file_offset)")
        device_ptr = _index(device_ptr) if device_ptr else 0
        if offset + size > self.size:
            raise ValueError("read_file_slice: [%d, +%d) is past the %d-byte"
                             " buffer" % (offset, size, self.size))
        fd = _hostio.fileno(file)
        if not size:
            return
        _hostio.check_file_range(fd, file_offset, size)
        dst = self._base + offset
        if not device_ptr:
            _hostio.pread_par(fd, dst, size, file_offset)
            return
        up = _Uploader(device_ptr, stream, device)
        _hostio.read_pieces(fd, dst, size, file_offset,
                          lambda a, n: up.upload(a - dst, a, n, self))

    def read_file_to_device(self, file, file_offset, size, stream, device_ptr,
                            device=-1, mark_cold=True):
        """File bytes straight to device memory at device_ptr (pinned VBAR
        memory or any other of the device's memory), ordered on `stream`;
        raises on failure (OSError, nothing read, when the range is not in
        the file). Through vpager's file reader (vp_file_read_to_address):
        its pinned bounce slots per device, each read over _par.threads()
        threads, each slot's upload overlapping the next slot's reads."""
        fd = _hostio.fileno(file)
        size = _nbytes(size, "read_file_to_device(size)")
        file_offset = _nbytes(file_offset, "read_file_to_device(file_offset)")
        device_ptr = _index(device_ptr)
        if size:
            _hostio.check_file_range(fd, file_offset, size)
            _device_of(device_ptr, device).file_read_to_address(
                fd, file_offset, size, device_ptr, stream, _par.threads())
        if mark_cold:
            _hostio.drop_cache(fd, file_offset, size)

    def cleanup_file_reader(self):
        """Free the file reader's staging slots on every open device (made
        again on the next read_file_to_device)."""
        for dev in control.devices().values():
            if not dev.closed:
                dev.release_file_reader()

    # -------------------------------------------------------------- life
    def close(self):
        for off in list(self._regs):
            self.unregister(off)
        if self._parts:
            self._drop_parts(0, True)
        if self._base:
            _hostio.release(self._base, self._cap)
        self._base = self._cap = self._mapped = self.size = 0
        self._populated = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _device_of(device_ptr, device):
    if device is not None and not (isinstance(device, int) and device < 0):
        return control.get_devctx(device)
    from . import model_vbar
    for vb in list(model_vbar._vbars):
        if not vb.closed and vb.base <= device_ptr < vb.base + vb.size:
            return vb.device
    dev = _pin_device()
    if dev is None:
        raise RuntimeError("comfy_aimdo: no device is initialised")
    return dev


class _Uploader:
    """Host memory to device memory from device_ptr on, ordered on
    `stream`: vpager's copy for pinned VBAR memory; else torch (CUDA) or a
    plain copy (the simulated device's memory is host memory). What it
    is is found on the first upload and kept for the next ones."""

    def __init__(self, device_ptr, stream, device):
        self.dev = _device_of(device_ptr, device)
        self.ptr = device_ptr
        self.stream = stream
        self.how = None                 # "vpager", "sim" or "torch"
        self._torch = None              # (torch, stream object, views)

    def upload(self, dst_off, src, size, keep=None):
        """[src, +size) to device_ptr + dst_off."""
        dst = self.ptr + dst_off
        vp = control._vpager
        if self.how in (None, "vpager"):
            try:
                self.dev.copy_to_device(dst, src, size, self.stream)
                self.how = "vpager"
                return
            except (vp.NotPinnedError, vp.RangeError, vp.InvalidArgument):
                if self.how == "vpager":
                    raise
        if self.dev.backend == "sim":
            self.how = "sim"
            self.dev.synchronize(self.stream)
            ctypes.memmove(dst, src, size)
            return
        self.how = "torch"
        torch, s, cuda, views = self._torch_stream()
        d = views.view(dst, torch.uint8, (size,), cuda)
        h = views.view(src, torch.uint8, (size,), "cpu")
        with torch.cuda.stream(s):
            d.copy_(h, non_blocking=True)

    def _torch_stream(self):
        if self._torch is None:
            import torch
            from vpager import _views
            idx = [i for i, d in control.devices().items()
                   if d is self.dev][0]
            cuda = torch.device("cuda", idx)
            s = torch.cuda.ExternalStream(self.stream, device=cuda) \
                if self.stream else torch.cuda.default_stream(cuda)
            self._torch = (torch, s, cuda, _views)
        return self._torch

    def fence(self):
        """A callable that returns once what was uploaded so far has been
        read from host memory."""
        if self.how == "torch":
            torch, s = self._torch[0], self._torch[1]
            ev = torch.cuda.Event()
            ev.record(s)
            return ev.synchronize
        if self.how == "sim" or self.how is None:
            return _nothing
        dev, stream = self.dev, self.stream
        if dev.backend != "sim" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            try:
                idx = [i for i, d in control.devices().items()
                       if d is dev][0]
                cuda = torch.device("cuda", idx)
                s = torch.cuda.ExternalStream(stream, device=cuda) \
                    if stream else torch.cuda.default_stream(cuda)
                ev = torch.cuda.Event()
                ev.record(s)
                return ev.synchronize
            except Exception:           # noqa: BLE001
                pass
        return lambda: dev.synchronize(stream)


def _nothing():
    pass
