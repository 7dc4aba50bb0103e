"""comfy_aimdo.model_vbar on vpager: a model's weights in one VBAR.

ModelVBAR(size, device) is a vpager VBAR (32 MiB pages; address space
only) with a 512-byte-aligned bump allocator. An allocation is the tuple
(vbar, absolute_address, size). vbar_fault(alloc) pins its pages and
returns the range's signature: array('I') of the pages' generations (one
per 32 MiB page, then zeros, `size // 32 MiB + 2` entries), or None on a
miss. Pins are counted per page by vpager, so ranges may overlap and span
allocations.

The hit path (issue 12): ComfyUI faults and unpins every weight of every
forward, so vbar_fault / vbar_unpin cost one ctypes call each and little
else. What a range needs for its calls (a vp_range_t with its VBAR, offset
and size, its signature length, a zeroed signature to copy) is worked out
and checked once, at its first fault, and kept in its ModelVBAR keyed by
the id of the range's tuple (and checked against its address and size, so
a recycled id only costs a slower call). The calls are vp_fault_range /
vp_unpin_range (the same as vp_fault / vp_unpin, on a range described
once: the binding's vpager.vbar.PreparedRange and prepared_calls(),
without argtypes, given ctypes objects made beforehand): converting
arguments is most of a ctypes call's cost, and a pointer made by byref()
once is the cheapest argument there is. vp_fault_range writes the generations into the range's buffer (an
array('I') of the signature's length) and zeroes the rest; the signature
returned is a copy of it, so it holds the pages' generations exactly as
vp_fault gives them. That buffer is shared by threads: C writes it only
in a fault that pins every page of the range, under the device lock, and
Python copies it while that pin is held, so pages cannot change in
between and any fault that writes it meanwhile writes the same values.
Everything else shared between threads is never written once made.
"""

import array
import numbers
import weakref

from . import control

__all__ = ["ModelVBAR", "vbar_fault", "vbar_unpin", "vbar_signature_compare",
           "vbars_reset_watermark_limits", "vbars_analyze", "ALIGN"]

ALIGN = 512
_vbars = weakref.WeakSet()      # live ModelVBARs
_FAST_MAX = 1 << 16             # ranges remembered per ModelVBAR


def _sig_len(size):
    return size // control.PAGE_SIZE + 2


_fault_range = _unpin_range = None      # _fast_calls(), once loaded
_STREAM0 = _stream_arg = None           # vpager.vbar's, once loaded
_ZERO = 0
_id = id
_array = array.array


def _fast_calls():
    """libvpager's vp_fault_range and vp_unpin_range on prepared ranges
    (vpager.vbar.prepared_calls: no argument conversion)."""
    global _fault_range, _unpin_range, _STREAM0, _stream_arg
    if _fault_range is None:
        from vpager import vbar
        _STREAM0, _stream_arg = vbar.STREAM0, vbar.stream_arg
        _fault_range, _unpin_range = vbar.prepared_calls()
    return _fault_range, _unpin_range


class ModelVBAR:
    """Reserve `size` bytes of device addresses on `device` (an index, a
    "cuda:N" string or a torch.device); MemoryError on failure."""

    def __init__(self, size, device=0):
        size = _int(size, "ModelVBAR(size)")
        if size < 0:
            raise ValueError("ModelVBAR(size): %d bytes" % size)
        if size >= 1 << 63:
            raise MemoryError("ModelVBAR(%d): past any address space" % size)
        dev, index = control._device_for(device)
        vp = control._vpager
        try:
            self._vbar = dev.create_vbar(max(int(size), 1))
        except (vp.OutOfMemory, vp.HostOutOfMemory, vp.LimitError,
                vp.DeviceError) as e:
            raise MemoryError("ModelVBAR(%d): %s" % (size, e)) from None
        self.device = dev
        self.device_index = index
        self.size = int(size)
        self.base = self._vbar.base
        self._vsize = self._vbar.size   # fixed: read once, not per fault
        self._page = dev.info()["page_size"]
        self._fast = {}                 # id(range) -> _entry (module doc)
        _fast_calls()                   # the hit path's two calls, loaded
        self.offset = 0                 # the bump allocator's next byte
        _vbars.add(self)
        # Named in the GPU's ledger (`python -m vpager top`, issue 14).
        self._vbar.label = "comfy_aimdo %d MiB #%d" % (size >> 20,
                                                       len(_vbars))

    # ---------------------------------------------------------- allocation
    def alloc(self, n):
        n = _int(n, "ModelVBAR.alloc(size)")
        if n < 0:
            raise ValueError("alloc(%d)" % n)
        start = (self.offset + ALIGN - 1) // ALIGN * ALIGN
        if start + n > self.size:
            raise MemoryError("ModelVBAR: %d bytes at offset %d do not fit "
                              "in %d" % (n, start, self.size))
        self.offset = start + n
        return (self, self.base + start, n)

    def _off(self, address, size):
        if type(address) is not int or type(size) is not int:
            address = _int(address, "address")
            size = _int(size, "size")
        if size < 0:
            raise ValueError("range 0x%x %d: negative size" % (address, size))
        off = address - self.base
        if off < 0 or off + size > self._vsize:
            raise ValueError("range 0x%x +%d is outside this ModelVBAR"
                             % (address, size))
        return off

    # -------------------------------------------------------- fault, unpin
    def _entry(self, key, address, size):
        """What the hit path needs for the range [address, +size), checked
        (the errors _off raises) and remembered under `key` (the id of the
        range's tuple): (address, size, byref of its vp_range_t, the
        signature's length as c_size_t, the range's generations buffer and
        its address as a c_void_p; module doc). None when the
        range takes the plain path: size 0, or pages smaller than the
        signature's 32 MiB (more generations than signature entries)."""
        off = self._off(address, size)
        if self._vbar.closed:
            self._vbar._handle()                # raises HandleError
        size = int(size)
        n = _sig_len(size)
        if size == 0 or (off + size - 1) // self._page - off // self._page \
                >= n:
            return None
        r = self._vbar.prepare_range(off, size, n)
        e = (address, size, r.ref, r.nsig, r.gens, r.gens_ptr, r)
        fast = self._fast
        if len(fast) >= _FAST_MAX:
            fast.clear()
        fast[key] = e
        return e

    def _failed(self, rc):
        """A negative code of the hit path, raised as the plain path
        raises it (HandleError naming this VBAR once it is closed)."""
        if self._vbar.closed:
            self._fast.clear()
            self._vbar._handle()
        from vpager.errors import check
        check(rc)

    def fault(self, address, size):
        """Pin [address, +size): its signature, or None on a miss."""
        off = self._off(address, size)
        size = int(size)
        n = _sig_len(size)
        if size == 0:
            return array.array("I", bytes(4 * n))
        ok, gens = self._vbar.fault(off, size)
        if not ok:
            return None
        sig = array.array("I", gens)
        if len(sig) < n:
            sig.extend([0] * (n - len(sig)))
        return sig

    def unpin(self, address, size, stream=0):
        off = self._off(address, size)
        size = int(size)
        if size:
            self._vbar.unpin(off, size, _stream(stream))

    # ------------------------------------------------------------ priority
    def prioritize(self):
        self._vbar.prioritize()

    def deprioritize(self):
        self._vbar.deprioritize()

    def loaded_size(self):
        return self._vbar.loaded_size()

    def set_watermark_limit(self, nbytes):
        self._vbar.set_watermark_limit(None if nbytes is None
                                       else int(nbytes))

    def set_watermark(self, nbytes):
        self._vbar.set_watermark(min(int(nbytes), self._vbar.size))

    def free_memory(self, nbytes):
        return self._vbar.free_memory(int(nbytes))

    def get_nr_pages(self):
        return self._vbar.page_count

    def get_watermark(self):
        return self._vbar.get_watermark()

    def get_residency(self):
        return list(self._vbar.residency())

    # -------------------------------------------------------------- life
    def close(self):
        """Free the VBAR (vpager.BusyError while pages are pinned)."""
        self._vbar.close()
        self._fast.clear()

    @property
    def closed(self):
        return self._vbar.closed

    def __repr__(self):
        return "<comfy_aimdo.ModelVBAR %d bytes at 0x%x on device %d>" % (
            self.size, self.base, self.device_index)


def _int(value, what):
    """An int from an int (or a whole float); TypeError otherwise."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError("%s must be an int, not %r" % (what, value))


def _stream(stream):
    """A stream argument as vpager takes it: an int handle, or a torch
    stream's (cuda_stream); None is the default stream."""
    if type(stream) is int and stream >= 0:
        return stream
    if stream is None:
        return 0
    if isinstance(stream, numbers.Integral) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError("stream handle %d" % stream)
        return int(stream)
    handle = getattr(stream, "cuda_stream", None)
    if isinstance(handle, numbers.Integral):
        return int(handle)
    raise TypeError("stream must be an int handle or a torch stream, not %r"
                    % (stream,))


def _unpack(alloc, what):
    """(vbar, address, size) of an allocation (as alloc() makes, or a
    synthetic span over several); TypeError for anything else."""
    try:
        vbar, address, size = alloc
    except (TypeError, ValueError):
        raise TypeError("%s: %r is not an allocation (vbar, address, size)"
                        % (what, alloc)) from None
    if type(vbar) is not ModelVBAR and not isinstance(vbar, ModelVBAR):
        raise TypeError("%s: %r is not a ModelVBAR allocation" % (what, alloc))
    return vbar, address, size


def vbar_fault(alloc):
    """Signature of the allocation's range after pinning it, or None when
    it cannot be made resident (a normal outcome; a broken device raises
    RuntimeError). The range may be a synthetic (vbar, first address,
    span) over several allocations: its signature stays equal exactly
    while every page of the span stays resident and is not refilled."""
    try:
        vbar, address, size = alloc
        e = vbar._fast.get(_id(alloc))
    except (TypeError, ValueError, AttributeError):
        vbar, address, size = _unpack(alloc, "vbar_fault")  # raises
        e = None
    if e is None or e[0] != address or e[1] != size:
        e = _entry(vbar, alloc, address, size, "vbar_fault")
        if e is None:
            return vbar.fault(address, size)
    rc = _fault_range(e[2], e[5], e[3])
    if rc == 0:
        return e[4][:]          # a copy while the pages are pinned
    if rc == 1:                                     # VP_MISS
        return None
    vbar._failed(rc)


def vbar_unpin(alloc, stream=0):
    """Unpin what vbar_fault(alloc) pinned; None is a no-op."""
    if alloc is None:
        return
    try:
        vbar, address, size = alloc
        e = vbar._fast.get(_id(alloc))
    except (TypeError, ValueError, AttributeError):
        vbar, address, size = _unpack(alloc, "vbar_unpin")  # raises
        e = None
    if e is None or e[0] != address or e[1] != size:
        e = _entry(vbar, alloc, address, size, "vbar_unpin")
        if e is None:
            return vbar.unpin(address, size, stream)
    if stream is _ZERO:                 # the default (0 is one object)
        rc = _unpin_range(e[2], _STREAM0)
    else:
        rc = _unpin_range(e[2], _stream_arg(_stream(stream)))
    if rc:
        vbar._failed(rc)


def _entry(vbar, alloc, address, size, what):
    """The hit path's entry of a range seen for the first time (or whose
    id was recycled); TypeError for what is not a ModelVBAR's range."""
    if type(vbar) is not ModelVBAR and not isinstance(vbar, ModelVBAR):
        _unpack(alloc, what)                        # raises TypeError
    return vbar._entry(_id(alloc), address, size)


def _as_bytes(sig):
    if isinstance(sig, array.array):
        return sig.tobytes()
    if isinstance(sig, (bytes, bytearray, memoryview)):
        return bytes(sig)
    if hasattr(sig, "numpy"):             # a torch tensor
        return sig.cpu().numpy().tobytes()
    return array.array("I", sig).tobytes()


def vbar_signature_compare(a, b):
    """False if either is None; ValueError when lengths differ; else True
    exactly when every page of the range stayed resident and was not
    refilled between the two faults."""
    if a is None or b is None:
        return False
    if type(a) is _array and type(b) is _array and a.typecode == b.typecode:
        if len(a) == len(b):                    # vbar_fault's signatures
            return a == b                       # (elementwise, in C)
    a, b = _as_bytes(a), _as_bytes(b)
    if len(a) != len(b):
        raise ValueError("signatures of different lengths (%d and %d bytes)"
                         % (len(a), len(b)))
    return a == b


def vbars_reset_watermark_limits():
    """Lift every VBAR's watermark limit on every device."""
    for dev in control.devices().values():
        if not dev.closed:
            dev.reset_limits()


def vbars_analyze(device=None):
    """Resident ModelVBAR bytes on `device` (every device when None); 0
    before init."""
    if control.lib is None:
        return 0
    want = None if device is None else control._index(device)
    total = 0
    for vb in list(_vbars):
        if vb.closed or (want is not None and vb.device_index != want):
            continue
        total += vb.loaded_size()
    return total
