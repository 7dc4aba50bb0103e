"""vpager.Device: vp_device_* , streams, copies and the simulated device's
launch and fault injection."""

import ctypes
import json as _json

from . import _lib
from ._buffer import as_buffer
from ._fds import NativeFd
from ._handle import Handle
from ._lib import C, vp_device_info_t, vp_device_t, vp_stream_t
from .errors import InvalidArgument, check
from .options import make_options, options_dict
from .stats import read_stats

__all__ = ["Device"]

_u64 = ctypes.c_uint64
_byref = ctypes.byref


def _fileno(f):
    return f if isinstance(f, int) else f.fileno()


class Device(Handle):
    """An open device: vp_device_open() with options.

    Device(backend="sim", sim_capacity="1G", page_size="2M", ...): every
    keyword is a vp_options_t field (see vpager.OPTION_NAMES), set after
    vp_options_init() (defaults, then VPAGER_* variables). Enum fields take
    their names ("auto"/"cuda"/"hip"/"sim", "tail"/"interleaved",
    "sync"/"worker"); byte counts take ints or "32M"-style strings.

    Streams are plain ints (vp_stream_t; 0 is the default stream; on CUDA a
    CUstream value). Host buffers given to copy_to_device/copy_to_host and
    callbacks given to sim_launch are held until that stream is
    synchronized through this object (or destroyed, or the device closed):
    C may still use them until the stream reaches the work.
    """

    _kind = "device"

    def __init__(self, backend=None, **options):
        if backend is not None:
            options["backend"] = backend
        opts = make_options(**options)
        h = vp_device_t()
        check(C.vp_device_open(_byref(opts), _byref(h)))
        self._init_handle(h)
        self.options = options_dict(opts)
        self._pending = {}          # stream -> [objects C may still use]
        self._launch_errors = {}    # stream -> [exceptions from sim_launch]
        try:
            self._page_size = self.info()["page_size"]
        except BaseException:
            self.close()
            raise

    def _free(self):
        check(C.vp_device_close(self._h))

    def _mark_closed(self):
        super()._mark_closed()
        self._pending = {}

    # ------------------------------------------------------------- device
    @property
    def backend(self):
        """"cuda", "hip" or "sim"."""
        name = C.vp_device_backend(self._handle())
        if name is None:
            check(_lib.VP_EHANDLE)
        return name.decode()

    @property
    def page_size(self):
        self._handle()
        return self._page_size

    def info(self):
        """vp_device_info() as a dict."""
        info = vp_device_info_t()
        check(C.vp_device_info(self._handle(), _byref(info)))
        return {name: getattr(info, name) for name, _ in info._fields_}

    def stats(self):
        """vp_device_stats() as a dict (vpager.STAT_NAMES)."""
        return read_stats(C.vp_device_stats, self._handle())

    def report(self, json=False):
        """vp_device_report(): the text report, or the JSON one parsed."""
        h = self._handle()
        needed = ctypes.c_size_t()
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            rc = C.vp_device_report(h, 1 if json else 0, buf, size,
                                    _byref(needed))
            if rc == _lib.VP_ERANGE and needed.value + 1 > size:
                size = needed.value + 1
                continue
            check(rc)
            break
        text = buf.value.decode()
        return _json.loads(text) if json else text

    def set_headroom(self, nbytes):
        check(C.vp_device_set_headroom(self._handle(), nbytes))

    def set_shared_headroom(self, nbytes):
        """vp_device_set_shared_headroom(): what this device asks every
        vpager process on the GPU to keep free (-1: its headroom)."""
        check(C.vp_device_set_shared_headroom(self._handle(), nbytes))

    def set_limit(self, nbytes):
        """Cap what this device may commit (2**64 - 1: no cap)."""
        check(C.vp_device_set_limit(self._handle(), nbytes))

    def free_memory(self, nbytes):
        """Evict unpinned pages, lowest priority first; returns bytes freed."""
        freed = _u64()
        check(C.vp_device_free_memory(self._handle(), nbytes, _byref(freed)))
        return freed.value

    def reclaimable(self):
        """Bytes that eviction could free now."""
        out = _u64()
        check(C.vp_device_reclaimable(self._handle(), _byref(out)))
        return out.value

    def reset_limits(self):
        check(C.vp_device_reset_limits(self._handle()))

    def set_lookahead(self, nbytes):
        check(C.vp_device_set_lookahead(self._handle(), nbytes))

    def set_staging_size(self, nbytes):
        """vp_device_set_staging_size: the ring is freed (after the work
        reading it) and reopened at this size by the next miss; BusyError
        while a staged weight is acquired. options["staging_size"]
        follows."""
        check(C.vp_device_set_staging_size(self._handle(), nbytes))
        self.options["staging_size"] = nbytes

    def lend_staging(self, addr, nbytes, stream=0):
        """vp_device_lend_staging: [addr, +nbytes) of the caller's device
        memory (idle between two forwards) for the staging ring until
        reclaim_staging; copies into it wait for `stream`'s work so far."""
        check(C.vp_device_lend_staging(self._handle(), addr, nbytes, stream))

    def reclaim_staging(self, stream=0, force=False):
        """vp_device_reclaim_staging: True once the lent memory is the
        caller's again for work queued on `stream` after this call; False
        while a weight staged there is acquired, or (force False) waits
        for its acquire."""
        rc = C.vp_device_reclaim_staging(self._handle(), stream, int(force))
        if rc == _lib.VP_EBUSY:
            return False
        check(rc)
        return True

    def set_pin_budget(self, nbytes):
        check(C.vp_device_set_pin_budget(self._handle(), nbytes))

    # ------------------------------------------- the ledger (vpager.ledger)
    def ledger_snapshot(self):
        from . import ledger
        return ledger.snapshot(self)

    def ledger_free_memory(self, nbytes):
        from . import ledger
        return ledger.free_memory(self, nbytes)

    def set_external_reserved(self, nbytes):
        from . import ledger
        ledger.set_external_reserved(self, nbytes)

    # ------------------------------------------------------------ streams
    def create_stream(self):
        """vp_stream_create(): a new stream (an int)."""
        s = vp_stream_t()
        check(C.vp_stream_create(self._handle(), _byref(s)))
        return s.value

    def destroy_stream(self, stream):
        """vp_stream_destroy(). Buffers and callbacks still held for the
        stream are synchronized first, so none is let go early."""
        h = self._handle()
        if self._pending.get(stream):
            self.synchronize(stream)
        check(C.vp_stream_destroy(h, stream))
        self._pending.pop(stream, None)

    def synchronize(self, stream=0):
        """vp_stream_synchronize(); then lets go of what the stream's queued
        work held, and raises the first exception a sim_launch callback on
        it raised, if any."""
        rc = C.vp_stream_synchronize(self._handle(), stream)
        # The C side waits for the queued work even when it fails.
        self._pending.pop(stream, None)
        errors = self._launch_errors.pop(stream, None)
        check(rc)
        if errors:
            raise errors[0]

    def _hold(self, stream, obj):
        self._pending.setdefault(stream, []).append(obj)

    def copy_to_device(self, dst_addr, src, size=None, stream=0):
        """vp_copy_to_device(): copy a bytes-like object (or a BufferRef, or
        an int address with size) into pinned VBAR memory at dst_addr.
        size defaults to the whole buffer."""
        h = self._handle()
        buf = as_buffer(src, False, size)
        check(C.vp_copy_to_device(h, dst_addr, buf.address, buf.size, stream))
        self._hold(stream, buf)

    def copy_to_host(self, dst, src_addr, size=None, stream=0):
        """vp_copy_to_host(): copy pinned VBAR memory into a writable buffer
        (bytearray, memoryview, ctypes array, ...; or an int address with
        size). The bytes are there once the stream is synchronized."""
        h = self._handle()
        buf = as_buffer(dst, True, size)
        check(C.vp_copy_to_host(h, buf.address, src_addr, buf.size, stream))
        self._hold(stream, buf)

    def read(self, src_addr, size, stream=0):
        """Copy pinned VBAR memory to a new bytes object, synchronizing the
        stream (copy_to_host + synchronize)."""
        out = bytearray(size)
        self.copy_to_host(out, src_addr, size, stream)
        self.synchronize(stream)
        return bytes(out)

    def file_read_to_device(self, fd, offset, size, dst_addr, stream=0):
        """vp_file_read_to_device(): fd is an int or has fileno()."""
        with NativeFd(_fileno(fd)) as n:
            check(C.vp_file_read_to_device(self._handle(), n.fd, offset,
                                           size, dst_addr, stream))

    def file_read_to_address(self, fd, offset, size, dst_addr, stream=0,
                             threads=1):
        """vp_file_read_to_address(): file bytes to any device memory of
        this device (pinned VBAR memory, or memory another allocator made:
        a torch tensor; on the simulated device, host memory), through the
        file reader's slots, each read over `threads` threads (1..64)."""
        with NativeFd(_fileno(fd)) as n:
            check(C.vp_file_read_to_address(self._handle(), n.fd, offset,
                                            size, dst_addr, stream, threads))

    def soft_limit(self):
        """vp_device_soft_limit(): the platform's soft memory limit for
        this process on the device (NVML's for its cgroup on CUDA), in
        bytes, or None where there is none."""
        n = ctypes.c_uint64(0)
        check(C.vp_device_soft_limit(self._handle(), ctypes.byref(n)))
        return n.value or None

    def host_unregister(self, ptr):
        """vp_host_unregister(): drop a page-lock registration another
        library made at host address `ptr` (a client's cudaHostRegister).
        True when one was dropped; False when ptr was not registered (the
        simulated device registers nothing: always True there)."""
        try:
            check(C.vp_host_unregister(self._handle(), ptr))
        except InvalidArgument:
            return False
        return True

    def release_file_reader(self):
        """vp_file_reader_release(): free the file reader's bounce slots
        (made again by the next read)."""
        check(C.vp_file_reader_release(self._handle()))

    # ------------------------------------------------- simulated device only
    def sim_launch(self, fn, stream=0):
        """vp_sim_launch(): run fn() on the stream as if it were a kernel
        (sync mode: now; worker mode: later, on the stream's thread). The
        callback is kept alive until the stream is synchronized here; an
        exception it raises is re-raised by synchronize(stream) (or at once
        when the launch ran synchronously)."""
        h = self._handle()
        errors = self._launch_errors

        def trampoline(_arg):
            try:
                fn()
            except BaseException as e:  # not across the C frames
                errors.setdefault(stream, []).append(e)

        cfn = _lib.SIM_LAUNCH_FN(trampoline)
        self._hold(stream, cfn)
        check(C.vp_sim_launch(h, stream, cfn, None))
        if errors.get(stream):
            raise errors.pop(stream)[0]

    def sim_inject(self, kind, n=0):
        """vp_sim_inject(): kind is vpager.SIM_FAIL_COMMIT, SIM_TRANSIENT,
        SIM_SET_CAPACITY, SIM_BREAK, SIM_SET_SOFT_LIMIT, SIM_SET_DESKTOP or
        SIM_MAP_APART."""
        check(C.vp_sim_inject(self._handle(), kind, n))

    # ---------------------------------------------------- objects it makes
    def create_vbar(self, size):
        from .vbar import Vbar
        return Vbar(self, size)

    def alloc_hostbuf(self, size, max_size=None):
        from .hostbuf import HostBuf
        return HostBuf(self, size, max_size)

    def register_hostbuf(self, buffer, size=None):
        from .hostbuf import HostBuf
        return HostBuf.register(self, buffer, size)

    def open_safetensors(self, path):
        from .safetensors import SafeTensors
        return SafeTensors(self, path)

    def batch(self, weights):
        """A WeightBatch over these weights (see vpager.WeightBatch)."""
        from .weights import WeightBatch
        return WeightBatch(self, weights)

    def acquire(self, weights, stream=0):
        """vp_acquire() on a list of weights, building the arrays on each
        call: (ptrs, flags) lists. For a hot loop use a WeightBatch."""
        b = self.batch(weights)
        b.acquire(stream)
        return list(b.ptrs), list(b.flags)

    def release(self, weights, stream=0):
        """vp_release() on a list of weights."""
        self.batch(weights).release(stream)
