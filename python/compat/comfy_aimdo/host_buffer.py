"""comfy_aimdo.host_buffer on vpager: an address-stable growable host
region, page-locked piecewise through vpager (vp_hostbuf_register).

The region is an anonymous mapping reserved once (address space only, on
the first extend: HostBuffer(0, 0, 0) costs nothing) and made usable as it
is extended; it never moves unless extend(..., reallocate=True) must grow
past the reservation. Each registered piece is its own vpager host buffer,
keyed by its offset (unregister(offset)); register=False leaves the new
part ordinary page-aligned memory the caller may register itself. Pinning
uses the lowest-index vpager device and its pin budget; before init, or
over the budget, memory stays pageable (correct, slower), as in vpager.

A caller that registers a register=False part itself (cudaHostRegister at
the address extend() returned, as ComfyUI >= 0.38 does) may unregister it
itself too, and the buffer stays mapped. truncate(n, do_unregister=True)
and close() drop such registrations past n (each part once, by its start
address, through the CUDA driver: a part the caller unregistered already
answers "not registered", which is ignored); do_unregister=False leaves
them to the caller. vpager's own registrations are never touched by that:
a part is either the buffer's (register=True or register()) or the
caller's.
"""

import ctypes
import operator
import os
import sys

from . import _libc, control

__all__ = ["HostBuffer"]


def _ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40


def _pin_device():
    devs = control.devices()
    for i in sorted(devs):
        if not devs[i].closed:
            return devs[i]
    return None


def _external_unregister(ptr):
    """Drop a registration the caller made itself at host address `ptr`
    (the start of a register=False part): cuMemHostUnregister when the
    caller can have registered it (the machine has CUDA, or torch has
    initialised CUDA); nothing otherwise, as on the simulated device (its
    host memory needs no registration). True when something was
    unregistered. Tests replace this to see the calls."""
    torch = sys.modules.get("torch")
    try:
        torch_cuda = torch is not None and torch.cuda.is_initialized()
    except Exception:
        torch_cuda = False
    if not torch_cuda and not control._probe_cuda():
        return False
    devs = control.devices()
    ordinal = min([i for i, d in devs.items()
                   if not d.closed and d.backend != "sim"] or [0])
    try:
        from . import _cuda
        return _cuda.host_unregister(ptr, ordinal) == 0
    except OSError:
        return False


MAX_BYTES = 1 << 56          # past any address space: refused outright


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
    are made usable and touched now (also past `size`: with size 0, as
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
        self._mapped = 0                # bytes made read-write
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
            end = _libc.page_up(min(n, self._cap))
            if end > self._mapped:
                _libc.protect(self._base + self._mapped, end - self._mapped,
                              _libc.PROT_READ | _libc.PROT_WRITE)
                self._mapped = end
            _libc.populate(self._base, end)
        except OSError as e:
            raise RuntimeError("HostBuffer(prewarm=%d): %s" % (n, e)) \
                from None

    # ------------------------------------------------------------ memory
    def _reserve(self, need):
        cap = _libc.page_up(max(need, self._want_cap, _ram()))
        self._base = _libc.map_anon(cap)
        self._cap = cap

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
            end = _libc.page_up(new)
            if end > self._mapped:
                _libc.protect(self._base + self._mapped, end - self._mapped,
                              _libc.PROT_READ | _libc.PROT_WRITE)
                self._mapped = end
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
        old_base, old_cap, old_mapped = self._base, self._cap, self._mapped
        self._want_cap = max(self._want_cap, need * 2)
        self._reserve(need)
        self._mapped = 0
        if old_mapped:
            _libc.protect(self._base, old_mapped,
                          _libc.PROT_READ | _libc.PROT_WRITE)
            self._mapped = old_mapped
            ctypes.memmove(self._base, old_base, self.size)
        _libc.unmap(old_base, old_cap)
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
        keep = _libc.page_up(size)
        if self._base and keep < self._mapped:
            pinned_past = any(o + n > keep for o, (n, _) in
                              self._regs.items())
            if not pinned_past:
                _libc.advise(self._base + keep, self._mapped - keep,
                             _libc.MADV_DONTNEED)
                _libc.protect(self._base + keep, self._mapped - keep,
                              _libc.PROT_NONE)
                self._mapped = keep
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
        `stream`."""
        size, offset = int(size), int(offset)
        if offset < 0 or offset + size > self.size:
            raise ValueError("read_file_slice: [%d, +%d) is past the %d-byte"
                             " buffer" % (offset, size, self.size))
        fd = _libc.fileno(file)
        if size:
            _libc.pread_into(fd, self._base + offset, size, int(file_offset))
        if device_ptr and size:
            _upload(self._base + offset, size, device_ptr, stream, device,
                    self)

    def read_file_to_device(self, file, file_offset, size, stream, device_ptr,
                            device=-1, mark_cold=True):
        """File bytes straight to device memory at device_ptr, ordered on
        `stream` (through vpager's file reader when device_ptr is pinned
        VBAR memory); raises on failure."""
        fd = _libc.fileno(file)
        size = int(size)
        if size:
            dev = _device_of(device_ptr, device)
            vp = control._vpager
            try:
                dev.file_read_to_device(fd, int(file_offset), size,
                                        device_ptr, stream)
            except (vp.NotPinnedError, vp.RangeError, vp.InvalidArgument):
                # Not vpager memory: read, upload, wait.
                tmp = ctypes.create_string_buffer(size)
                _libc.pread_into(fd, ctypes.addressof(tmp), size,
                                 int(file_offset))
                _upload(ctypes.addressof(tmp), size, device_ptr, stream,
                        device, tmp, wait=True)
        if mark_cold:
            _libc.drop_cache(fd, int(file_offset), size)

    def cleanup_file_reader(self):
        """Nothing to free: vpager's file reader belongs to the device."""

    # -------------------------------------------------------------- life
    def close(self):
        for off in list(self._regs):
            self.unregister(off)
        if self._parts:
            self._drop_parts(0, True)
        if self._base:
            _libc.unmap(self._base, self._cap)
        self._base = self._cap = self._mapped = self.size = 0

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


def _upload(src, size, device_ptr, stream, device, keep, wait=False):
    """Host [src, +size) to device_ptr on `stream`: vpager's copy for
    pinned VBAR memory; else torch (CUDA) or a plain copy (the simulated
    device's memory is host memory)."""
    dev = _device_of(device_ptr, device)
    vp = control._vpager
    try:
        dev.copy_to_device(device_ptr, src, size, stream)
        return
    except (vp.NotPinnedError, vp.RangeError, vp.InvalidArgument):
        pass
    if dev.backend == "sim":
        dev.synchronize(stream)
        ctypes.memmove(device_ptr, src, size)
        return
    import torch
    from vpager import _views
    idx = [i for i, d in control.devices().items() if d is dev][0]
    cuda = torch.device("cuda", idx)
    dst = _views.view(device_ptr, torch.uint8, (size,), cuda)
    host = _views.view(src, torch.uint8, (size,), "cpu")
    s = torch.cuda.ExternalStream(stream, device=cuda) if stream else \
        torch.cuda.default_stream(cuda)
    with torch.cuda.stream(s):
        dst.copy_(host, non_blocking=True)
    if wait:
        s.synchronize()
