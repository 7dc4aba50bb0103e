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
"""

import ctypes
import os

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


class HostBuffer:
    """HostBuffer(size, prewarm=0, max_grow_size=0, mark_cold=True).

    `size` bytes are extended (and registered) at once; `prewarm` bytes of
    them are touched now; the reservation is the largest of size,
    max_grow_size and the machine's RAM (address space only), so extend()
    keeps the address. mark_cold is accepted (no effect)."""

    def __init__(self, size, prewarm=0, max_grow_size=0, mark_cold=True):
        self.size = 0
        self._base = 0
        self._cap = 0
        self._mapped = 0                # bytes made read-write
        self._want_cap = max(int(size), int(max_grow_size or 0))
        self._regs = {}                 # offset -> (size, vpager.HostBuf)
        self.mark_cold = mark_cold
        if size:
            self.extend(int(size))
            if prewarm:
                ctypes.memset(self._base, 0, min(int(prewarm), self.size))

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
        size = int(size)
        if size < 0:
            raise ValueError("extend(%d)" % size)
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
        return self._base + old

    def _move(self, need):
        """Reallocate: a bigger reservation, the bytes copied over, the
        registrations redone (the address changes)."""
        regs = [(off, n) for off, (n, _) in sorted(self._regs.items())]
        for off in list(self._regs):
            self.unregister(off)
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
        size = int(size)
        if size < 0 or size > self.size:
            raise ValueError("truncate(%d) of a %d-byte buffer"
                             % (size, self.size))
        if do_unregister:
            for off in [o for o, (n, _) in self._regs.items()
                        if o + n > size]:
                self.unregister(off)
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
        offset, size = int(offset), int(size)
        if offset < 0 or size <= 0 or offset + size > self.size:
            raise ValueError("register [%d, +%d) of a %d-byte buffer"
                             % (offset, size, self.size))
        if offset in self._regs:
            raise ValueError("offset %d is registered already" % offset)
        dev = _pin_device()
        if dev is None:
            return
        try:
            hb = dev.register_hostbuf(self._base + offset, size)
        except control._vpager.Error as e:
            raise RuntimeError("HostBuffer.register: %s" % e) from None
        self._regs[offset] = (size, hb)

    def unregister(self, offset):
        reg = self._regs.pop(int(offset), None)
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
