"""comfy_aimdo.vram_buffer on vpager: a scratch region of device memory.

VRAMBuffer(max_size, device) reserves a VBAR (address space only: creating
one costs microseconds); get(size, offset) commits and pins the pages of
[offset, offset+size) that are not pinned yet, and they stay pinned until
the buffer is destroyed (close(), or garbage collection), which returns
the memory. A new VBAR is at the top of vpager's priority list, so its
commits evict model weights first.
"""

import numbers

from . import control

__all__ = ["VRAMBuffer"]


def _size(n):
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, numbers.Integral):
        raise TypeError("VRAMBuffer: a size must be an int, not %r" % (n,))
    n = int(n)
    if n >= 1 << 63:
        raise MemoryError("VRAMBuffer: %d bytes are past any address space"
                          % n)
    return n


class VRAMBuffer:
    def __init__(self, max_size, device=0):
        self._vbar = None
        self.max_size = _size(max_size)
        if self.max_size < 0:
            raise ValueError("VRAMBuffer(%d): a negative size" % max_size)
        dev, index = control._device_for(device)
        vp = control._vpager
        try:
            self._vbar = dev.create_vbar(max(self.max_size, 1))
        except (vp.OutOfMemory, vp.HostOutOfMemory, vp.LimitError,
                vp.DeviceError) as e:
            raise MemoryError("VRAMBuffer(%d): %s" % (max_size, e)) from None
        self.device = dev
        self.device_index = index
        self.base = self._vbar.base
        self._ps = dev.page_size
        self._pinned = set()            # page indices pinned here

    def get(self, size, offset=0):
        """(self, address, size) of [offset, offset+size), committed; a
        MemoryError when the memory cannot be had."""
        size, offset = _size(size), _size(offset)
        if offset < 0 or size < 0 or offset + size > self.max_size:
            raise MemoryError("VRAMBuffer.get: [%d, +%d) is past %d bytes"
                              % (offset, size, self.max_size))
        if size:
            ps = self._ps
            first, last = offset // ps, (offset + size - 1) // ps
            run = None
            for p in list(range(first, last + 1)) + [None]:
                if p is not None and p not in self._pinned:
                    run = p if run is None else run
                    continue
                if run is not None:
                    end = p if p is not None else last + 1
                    self._pin(run, end)
                    run = None
        return (self, self.base + offset, size)

    def _pin(self, p0, p1):
        ps = self._ps
        off, n = p0 * ps, (p1 - p0) * ps
        n = min(n, self._vbar.size - off)
        ok, _ = self._vbar.fault(off, n, gens=False)
        if not ok:
            # Make room once (lowest-priority VBARs first), then retry.
            self.device.free_memory(n)
            ok, _ = self._vbar.fault(off, n, gens=False)
        if not ok:
            raise MemoryError("VRAMBuffer: cannot commit %d bytes on device "
                              "%d" % (n, self.device_index))
        self._pinned.update(range(p0, p1))

    def size(self):
        """Bytes committed (whole pages)."""
        return min(len(self._pinned) * self._ps, self._vbar.size)

    def close(self, stream=0):
        """Unpin everything (fenced on `stream`) and free the VBAR."""
        vb = getattr(self, "_vbar", None)
        if vb is None or vb.closed:
            return
        for p in sorted(self._pinned):
            vb.unpin(p * self._ps, self._ps, stream)
        self._pinned.clear()
        vb.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
