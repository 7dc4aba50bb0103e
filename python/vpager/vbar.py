"""vpager.Vbar: a reserved range of device addresses (vp_vbar_*, vp_fault,
vp_unpin)."""

import ctypes

from . import _lib
from ._handle import Handle
from ._lib import C, vp_vbar_t
from .errors import InvalidArgument, RangeError, check
from .stats import read_stats

__all__ = ["Vbar", "PreparedRange", "prepared_calls", "stream_arg",
           "STREAM0"]

_u64 = ctypes.c_uint64
_byref = ctypes.byref


def _order(order):
    if isinstance(order, str):
        if order not in _lib.ORDERS:
            raise InvalidArgument(_lib.VP_EINVAL, "VP_EINVAL",
                                  "order %r is not one of %s"
                                  % (order, ", ".join(_lib.ORDERS)))
        return _lib.ORDERS[order]
    return order


class Vbar(Handle):
    """vp_vbar_create(device, size): `size` bytes of device addresses,
    rounded up to whole pages. close() is vp_vbar_destroy() (BusyError while
    pages are pinned; the Vbar then stays open). Closing the device, or the
    Vbar, frees its weights."""

    _kind = "vbar"

    def __init__(self, device, size):
        h = vp_vbar_t()
        check(C.vp_vbar_create(device._handle(), size, _byref(h)))
        self._init_handle(h, device)
        self.device = device
        self._npages = self.page_count     # fixed for the VBAR's life

    def _free(self):
        check(C.vp_vbar_destroy(self._h))

    def _get(self, fn):
        out = _u64()
        check(fn(self._handle(), _byref(out)))
        return out.value

    # ----------------------------------------------------------- geometry
    @property
    def base(self):
        """Device virtual address of offset 0 (never moves)."""
        return self._get(C.vp_vbar_base)

    @property
    def size(self):
        return self._get(C.vp_vbar_size)

    @property
    def page_count(self):
        return self._get(C.vp_vbar_page_count)

    def device_handle(self):
        """vp_vbar_device(): the id of the device this VBAR belongs to."""
        d = _lib.vp_device_t()
        check(C.vp_vbar_device(self._handle(), _byref(d)))
        return d.id

    # ----------------------------------------------------------- priority
    def prioritize(self):
        check(C.vp_vbar_prioritize(self._handle()))

    def deprioritize(self):
        check(C.vp_vbar_deprioritize(self._handle()))

    def set_order(self, order):
        """order: vpager.ORDER_TAIL_FIRST / ORDER_INTERLEAVED, or "tail" /
        "interleaved". BusyError unless no page is resident."""
        check(C.vp_vbar_set_order(self._handle(), _order(order)))

    def set_ranks(self, pages):
        """vp_vbar_set_ranks: pages[r] is the page of rank r (pages[0] is
        evicted last), a permutation of the VBAR's pages. BusyError unless
        no page is resident."""
        pages = list(pages)
        arr = (ctypes.c_uint32 * max(len(pages), 1))(*pages)
        check(C.vp_vbar_set_ranks(self._handle(), arr, len(pages)))

    def set_watermark(self, nbytes):
        check(C.vp_vbar_set_watermark(self._handle(), nbytes))

    def get_watermark(self):
        """In pages."""
        return self._get(C.vp_vbar_get_watermark)

    def set_watermark_limit(self, nbytes):
        """nbytes None means no limit (UINT64_MAX)."""
        if nbytes is None:
            nbytes = _lib.UINT64_MAX
        check(C.vp_vbar_set_watermark_limit(self._handle(), nbytes))

    def get_watermark_limit(self):
        """In pages (the page count when there is no limit)."""
        return self._get(C.vp_vbar_get_watermark_limit)

    @property
    def watermarks(self):
        """(watermark, limit), both in pages."""
        return self.get_watermark(), self.get_watermark_limit()

    # ------------------------------------------------------ fault and unpin
    def fault(self, offset, size, gens=True):
        """vp_fault(): make [offset, offset+size) resident and pin it.

        Returns (True, gens) when resident and pinned (gens: a list of the
        range's page generations, or None with gens=False), (False, None)
        on VP_MISS (nothing pinned). Errors raise."""
        h = self._handle()
        if gens and size > 0:
            ps = self.device._page_size
            # Never more than the VBAR has: a range past it is C's ERANGE.
            n = min((offset + size - 1) // ps - offset // ps + 1,
                    self._npages)
            arr = (ctypes.c_uint32 * n)()
            rc = C.vp_fault(h, offset, size, arr, n)
        else:
            arr = None
            rc = C.vp_fault(h, offset, size, None, 0)
        if rc == _lib.VP_MISS:
            return False, None
        check(rc)
        return True, (list(arr) if arr is not None else None)

    def unpin(self, offset, size, stream=0):
        """vp_unpin(): drop one pin per page and fence them on `stream`."""
        check(C.vp_unpin(self._handle(), offset, size, stream))

    def prepare_range(self, offset, size, nsig):
        """A PreparedRange of [offset, +size) for prepared_calls(), with
        room for `nsig` generations (the rest zeroed by each fault)."""
        self._handle()
        return PreparedRange(self._h, offset, size, nsig)

    def free_memory(self, nbytes):
        """Evict unpinned pages of this VBAR; returns bytes freed."""
        freed = _u64()
        check(C.vp_vbar_free_memory(self._handle(), nbytes, _byref(freed)))
        return freed.value

    def loaded_size(self):
        """Bytes resident."""
        return self._get(C.vp_vbar_loaded_size)

    def residency(self, n=None):
        """vp_vbar_residency(): bytes, one per page (the first n pages, all
        by default), each VP_PAGE_RESIDENT | VP_PAGE_PINNED bits."""
        h = self._handle()
        if n is None:
            n = self._npages
        elif n > self._npages:
            raise RangeError(_lib.VP_ERANGE, "VP_ERANGE", "residency: %d "
                             "flags asked of %d pages" % (n, self._npages))
        flags = (ctypes.c_uint8 * n)()
        check(C.vp_vbar_residency(h, flags, n))
        return bytes(flags)

    def stats(self):
        """vp_vbar_stats() as a dict (vpager.STAT_NAMES)."""
        return read_stats(C.vp_vbar_stats, self._handle())

    @property
    def label(self):
        """The VBAR's name in the ledger and reports (vpager.ledger)."""
        from . import ledger
        return ledger.label(self)

    @label.setter
    def label(self, text):
        from . import ledger
        ledger.set_label(self, text)

    # ------------------------------------------------------------ weights
    def create_weights(self, offsets, sizes, sources=None):
        """vp_weights_create(): see vpager.Weights."""
        from .weights import Weights
        return Weights(self, offsets, sizes, sources)


# ------------------------------------------------------ the prepared path

class PreparedRange:
    """[offset, +size) of a Vbar described once (a vp_range_t) for a
    caller that faults and unpins the same range every forward (the
    drop-in's vbar_fault/vbar_unpin): converting arguments is most of a
    ctypes call's cost, so the arguments are made here, once. ref: the
    range by reference; nsig: the generations' count (c_size_t); gens:
    array('I') the fault writes the generations into; gens_ptr: its
    address. Valid while its Vbar is open (the calls return VP_EHANDLE
    after)."""

    __slots__ = ("range", "ref", "nsig", "gens", "gens_ptr")

    def __init__(self, h, offset, size, nsig):
        import array
        self.range = _lib.vp_range_t(h, offset, size)
        self.ref = _byref(self.range)
        self.nsig = ctypes.c_size_t(nsig)
        self.gens = array.array("I", bytes(4 * nsig))      # never resized
        self.gens_ptr = ctypes.c_void_p(self.gens.buffer_info()[0])


_PREPARED = []


def prepared_calls():
    """(fault, unpin): vp_fault_range(ref, gens_ptr, nsig) and
    vp_unpin_range(ref, stream) of PreparedRanges, without argument
    conversion (_lib.unchecked), returning the C code (0, VP_MISS = 1, or
    negative: vpager.check(rc) raises it). stream: stream_arg(handle) or
    STREAM0."""
    if not _PREPARED:
        _PREPARED.extend((_lib.unchecked("vp_fault_range"),
                          _lib.unchecked("vp_unpin_range")))
    return _PREPARED[0], _PREPARED[1]


STREAM0 = _u64(0)               # the default stream, for the unpin call


def stream_arg(handle):
    """A stream handle (int) as prepared_calls()'s unpin takes it."""
    return _u64(handle)
