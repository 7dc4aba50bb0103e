"""Weights and streaming: vp_source_t, vp_weights_create, vp_weight_destroy,
vp_acquire and vp_release (through WeightBatch)."""

import ctypes
import operator

from . import _lib
from ._buffer import BufferRef, as_buffer
from ._fds import NativeFd
from ._handle import Handle
from ._lib import C, vp_source_t, vp_weight_t
from .errors import InvalidArgument, check, closed_error

__all__ = ["Source", "Weights", "Weight", "WeightBatch"]

_c_u64 = ctypes.c_uint64
_c_u8 = ctypes.c_uint8


def _window(nbytes):
    """A window in bytes for C: None is VP_LOOKAHEAD_DEVICE."""
    if nbytes is None:
        return _lib.VP_LOOKAHEAD_DEVICE
    n = operator.index(nbytes)
    if not 0 <= n < _lib.VP_LOOKAHEAD_DEVICE:
        raise _einval("vpager: a prefetch window of %r bytes (0 to 2**64 - "
                      "2, or None for the device's lookahead)" % nbytes)
    return n


def _einval(msg):
    return InvalidArgument(_lib.VP_EINVAL, "VP_EINVAL", msg)


class Source:
    """Where a weight's bytes come from (vp_source_t).

    Source.none(): the caller fills them (VP_ACQUIRED_EMPTY).
    Source.from_host(buffer): host memory, held as long as the weight
        exists (fastest inside a pinned HostBuf: pass hostbuf.view(...)).
        A raw int address is taken as is (the caller keeps it valid).
    Source.from_file(fd, offset): a region of an open file (an int fd, or
        an object with fileno(), which is held).
    """

    __slots__ = ("kind", "host", "fd", "file_offset", "keep")

    def __init__(self, kind=_lib.VP_SOURCE_NONE, host=None, fd=-1,
                 file_offset=0, keep=None):
        self.kind = kind
        self.host = host            # HOST: a BufferRef, or a raw int address
        self.fd = fd
        self.file_offset = file_offset
        self.keep = keep            # e.g. the SafeTensors owning the fd

    @classmethod
    def none(cls):
        return cls()

    @classmethod
    def from_host(cls, buffer, size=None):
        if isinstance(buffer, int):
            return cls(_lib.VP_SOURCE_HOST, host=buffer)
        return cls(_lib.VP_SOURCE_HOST, host=as_buffer(buffer, False, size))

    @classmethod
    def from_file(cls, fd, offset=0, keep=None):
        """keep: more to hold as long as the source (say, the tensor whose
        file region it is)."""
        held = [] if keep is None else [keep]
        if not isinstance(fd, int):
            held.append(fd)
            fd = fd.fileno()
        # The library's fd for it (another on Windows: _fds), held too.
        native = NativeFd(fd)
        if native.fd != fd:
            held.append(native)
        keep = held[0] if len(held) == 1 else tuple(held) or None
        return cls(_lib.VP_SOURCE_FILE, fd=native.fd, file_offset=offset,
                   keep=keep)

    @property
    def host_address(self):
        h = self.host
        return h.address if isinstance(h, BufferRef) else (h or 0)

    def _fill(self, s):
        s.kind = self.kind
        s.host = self.host_address or None
        s.fd = self.fd
        s.file_offset = self.file_offset

    def __repr__(self):
        if self.kind == _lib.VP_SOURCE_HOST:
            return "Source.from_host(0x%x)" % self.host_address
        if self.kind == _lib.VP_SOURCE_FILE:
            return "Source.from_file(fd=%d, offset=%d)" % (self.fd,
                                                           self.file_offset)
        if self.kind == _lib.VP_SOURCE_NONE:
            return "Source.none()"
        return "Source(kind=%d)" % self.kind


def _as_source(obj):
    if obj is None:
        return Source()
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, vp_source_t):
        return Source(obj.kind, obj.host or None, obj.fd, obj.file_offset)
    return Source.from_host(obj)


class Weights(Handle):
    """vp_weights_create(vbar, offsets, sizes, sources): n weights of one
    VBAR, weight i being [offsets[i], +sizes[i]) with sources[i].

    sources (optional, else every source is NONE) items: None, a Source, a
    vp_source_t, or a bytes-like object (a HOST source, held while the
    weight exists; it must hold at least sizes[i] bytes). close() destroys
    every weight still there (BusyError while one is acquired); destroy(i)
    one of them; set_source(i, source) gives weight i another source
    (swap_source: one holding the bytes it has); move(indices, offsets) places some anew. w[i] is a Weight (for
    WeightBatch); .handles is the ctypes array of vp_weight_t."""

    _kind = "weights"

    def __init__(self, vbar, offsets, sizes, sources=None):
        offsets = list(offsets)
        sizes = list(sizes)
        n = len(offsets)
        if len(sizes) != n:
            raise _einval("vp_weights_create: %d offsets but %d sizes"
                          % (n, len(sizes)))
        c_off = (_c_u64 * n)(*offsets)
        c_size = (_c_u64 * n)(*sizes)
        srcs = None
        keep = []
        if sources is not None:
            sources = [_as_source(s) for s in sources]
            if len(sources) != n:
                raise _einval("vp_weights_create: %d weights but %d sources"
                              % (n, len(sources)))
            srcs = (vp_source_t * n)()
            for i, src in enumerate(sources):
                if (src.kind == _lib.VP_SOURCE_HOST
                        and isinstance(src.host, BufferRef)
                        and src.host.size < sizes[i]):
                    raise _einval("vp_weights_create: source %d holds %d "
                                  "bytes, the weight %d" % (i, src.host.size,
                                                            sizes[i]))
                src._fill(srcs[i])
            keep = sources
        handles = (vp_weight_t * n)()
        check(C.vp_weights_create(vbar._handle(), n, c_off, c_size, srcs,
                                  handles))
        self._init_handle(handles, vbar)
        self._keep = keep
        self.vbar = vbar
        self.device = vbar.device
        self.offsets = tuple(offsets)
        self.sizes = tuple(sizes)
        self._alive = [True] * n
        # Each weight's window as last set (vp_weight_set_lookahead's value)
        self._windows = [_lib.VP_LOOKAHEAD_DEVICE] * n

    @property
    def handles(self):
        return self._handle()

    def __repr__(self):
        if self._closed:
            return "<vpager.Weights closed>"
        return "<vpager.Weights n=%d>" % len(self._alive)

    @property
    def id(self):
        raise AttributeError("Weights holds several handles: use .ids")

    @property
    def ids(self):
        return [w.id for w in self._handle()]

    def __len__(self):
        return len(self._alive)

    def __getitem__(self, i):
        n = len(self._alive)
        if isinstance(i, slice):
            return [Weight(self, j) for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("weight index %d out of range (%d weights)"
                             % (i, n))
        return Weight(self, i)

    def __iter__(self):
        return (Weight(self, i) for i in range(len(self._alive)))

    def destroy(self, i):
        """vp_weight_destroy() of weight i (BusyError while acquired)."""
        hs = self._handle()
        if not self._alive[i]:
            raise closed_error("weight %d of this vpager.Weights" % i)
        check(C.vp_weight_destroy(hs[i]))
        self._alive[i] = False
        if self._keep:
            self._keep[i] = None
        if not any(self._alive):
            self._mark_closed()

    def set_source(self, i, source):
        """vp_weight_set_source() of weight i: its bytes come from
        `source` (as in the constructor) from its next acquire on; it keeps
        its place (BusyError while acquired)."""
        self._source(i, source, C.vp_weight_set_source,
                     "vp_weight_set_source")

    def swap_source(self, i, source):
        """vp_weight_swap_source() of weight i: `source` holds the bytes
        its last acquire used (as the caller left them), so what an
        acquire used stays valid and is not filled again; what prefetch
        copied ahead of an acquire is filled from `source` (BusyError
        while acquired)."""
        self._source(i, source, C.vp_weight_swap_source,
                     "vp_weight_swap_source")

    def _source(self, i, source, call, name):
        hs = self._handle()
        if not self._alive[i]:
            raise closed_error("weight %d of this vpager.Weights" % i)
        src = _as_source(source)
        if (src.kind == _lib.VP_SOURCE_HOST and isinstance(src.host, BufferRef)
                and src.host.size < self.sizes[i]):
            raise _einval("%s: the source holds %d bytes, the weight %d"
                          % (name, src.host.size, self.sizes[i]))
        c = vp_source_t()
        src._fill(c)
        check(call(hs[i], ctypes.byref(c)))
        if not self._keep:
            self._keep = [None] * len(self._alive)
        self._keep[i] = src

    def move(self, indices, offsets):
        """vp_weights_move(): weight indices[k] goes to VBAR offset
        offsets[k]. One whose offset changes is filled anew at its next
        acquire; one left where it is keeps its fill (a resident weight
        costs no copy). Prefetch then follows `indices` in that order,
        then the others. All or nothing (BusyError while one is
        acquired)."""
        indices, offsets = list(indices), list(offsets)
        n = len(indices)
        if len(offsets) != n:
            raise _einval("vp_weights_move: %d weights but %d offsets"
                          % (n, len(offsets)))
        hs = self._handle()
        for i in indices:
            if not self._alive[i]:
                raise closed_error("weight %d of this vpager.Weights" % i)
        check(C.vp_weights_move(self.vbar._handle(), n,
                                (vp_weight_t * n)(*[hs[i] for i in indices]),
                                (_c_u64 * n)(*offsets)))
        new = list(self.offsets)
        for i, off in zip(indices, offsets):
            new[i] = off
        self.offsets = tuple(new)

    def set_window(self, i, nbytes):
        """vp_weight_set_lookahead() of weight i: the prefetch after an
        acquire that ends with it runs `nbytes` ahead (0: none) instead of
        the device's lookahead; None: the device's again. Allowed while
        acquired."""
        self.set_windows(((i, nbytes),))

    def set_windows(self, pairs):
        """set_window(i, nbytes) for each (i, nbytes) of `pairs`, in order;
        a weight's window as already set costs no call (each plan applied
        sets every weight's: SDXL's 1168)."""
        hs = self._handle()
        alive, now = self._alive, self._windows
        for i, nbytes in pairs:
            if not alive[i]:
                raise closed_error("weight %d of this vpager.Weights" % i)
            n = _window(nbytes)
            if n != now[i]:
                check(C.vp_weight_set_lookahead(hs[i], n))
                now[i] = n

    def window(self, i):
        """Weight i's own prefetch window (vp_weight_get_lookahead); None:
        it uses the device's lookahead."""
        hs = self._handle()
        if not self._alive[i]:
            raise closed_error("weight %d of this vpager.Weights" % i)
        out = _c_u64()
        check(C.vp_weight_get_lookahead(hs[i], ctypes.byref(out)))
        return None if out.value == _lib.VP_LOOKAHEAD_DEVICE else out.value

    def _free(self):
        hs = self._h
        for i, alive in enumerate(self._alive):
            if alive:
                check(C.vp_weight_destroy(hs[i]))
                self._alive[i] = False

    def batch(self, indices=None):
        """A WeightBatch over these weights (all, or the given indices)."""
        items = (self if indices is None
                 else [Weight(self, i) for i in indices])
        return WeightBatch(self.device, list(items))


class Weight:
    """One weight of a Weights group (a light reference)."""

    __slots__ = ("weights", "index")

    def __init__(self, weights, index):
        self.weights = weights
        self.index = index

    @property
    def handle(self):
        return self.weights.handles[self.index]

    @property
    def id(self):
        return self.handle.id

    @property
    def offset(self):
        return self.weights.offsets[self.index]

    @property
    def size(self):
        return self.weights.sizes[self.index]

    def __repr__(self):
        return "<vpager.Weight %d of %r>" % (self.index, self.weights)


class WeightBatch:
    """A fixed list of weights (of one device, possibly of several VBARs),
    for the hot path: the ctypes arrays of handles, pointers and flags are
    built once; acquire()/release() call vp_acquire/vp_release straight
    away, with no allocation per call.

        batch = WeightBatch(device, weights)    # Weights, or Weight items
        ptrs = batch.acquire(stream)            # ctypes c_uint64 array
        ... use ptrs[i], batch.flags[i] ...
        batch.release(stream)

    Pass each VBAR's weights in execution order, a layer per batch. Handles
    are checked by the C side: a destroyed weight gives HandleError.
    lookahead (bytes; 0: none): every acquire of the batch prefetches that
    far (vp_acquire_ahead) instead of its last weight's window; None (the
    default): the weight's window, else the device's lookahead."""

    __slots__ = ("device", "n", "handles", "ptrs", "flags", "_args",
                 "_acquire", "_release", "_prefetch", "_window", "_last",
                 "_owners", "_n", "_stream", "_stream_id")

    def __init__(self, device, weights, lookahead=None):
        items = list(weights)
        handles = []
        owners = []
        for w in items:
            if isinstance(w, Weights):
                handles.extend(w.handles)
                owners.append(w)
            elif isinstance(w, Weight):
                handles.append(w.handle)
                owners.append(w.weights)
            else:
                raise TypeError("WeightBatch takes Weights or Weight items, "
                                "not %s" % type(w).__name__)
        n = len(handles)
        self.device = device
        self.n = n
        self.handles = (vp_weight_t * n)(*handles)
        self.ptrs = (_c_u64 * n)()
        self.flags = (_c_u8 * n)()
        self._owners = tuple({id(o): o for o in owners}.values())
        # Called without argtypes (_lib.unchecked): every argument is a
        # ctypes object of its C type, the stream's kept for the next call.
        self._acquire = _lib.unchecked("vp_acquire")
        ahead = None
        if lookahead is not None:      # one more argument, made once
            ahead = _c_u64(_window(lookahead))
            acquire_ahead = _lib.unchecked("vp_acquire_ahead")
            self._acquire = (lambda dev, hs, n, s, ptrs, flags:
                             acquire_ahead(dev, hs, n, s, ptrs, flags, ahead))
        self._release = _lib.unchecked("vp_release")
        self._prefetch = _lib.unchecked("vp_prefetch")
        if lookahead is not None:      # the acquire's window, as above
            prefetch_ahead = _lib.unchecked("vp_prefetch_ahead")
            self._prefetch = (lambda dev, w: prefetch_ahead(dev, w, ahead))
        # vp_prefetch_sm's window: the batch's, else (0) the weight's own
        self._window = ahead if lookahead is not None else _c_u64(0)
        self._last = handles[-1] if n else None
        self._args = device._handle()
        self._n = ctypes.c_size_t(n)
        self._stream_id = 0
        self._stream = _c_u64(0)

    def __len__(self):
        return self.n

    def acquire(self, stream=0):
        """vp_acquire(): returns self.ptrs (device addresses); self.flags
        gets the VP_ACQUIRED_* bits."""
        s = self._stream
        if stream != self._stream_id:
            s = self._c_stream(stream)
        rc = self._acquire(self._args, self.handles, self._n, s, self.ptrs,
                           self.flags)
        if rc:
            check(rc)
        return self.ptrs

    def _c_stream(self, stream):
        s = _c_u64(operator.index(stream))     # an int, as argtypes asked
        if s.value != stream:
            raise OverflowError("vpager: stream %r is not a uint64" % stream)
        self._stream, self._stream_id = s, stream
        return s

    def prefetch(self, programs=0):
        """vp_prefetch() after the batch's last weight (vp_prefetch_ahead
        with the batch's lookahead): the prefetch its acquire would run,
        acquiring nothing. programs > 0: vp_prefetch_sm(), its copies from
        page-locked memory read by that many blocks of SMs, not the copy
        engine (for while the GPU waits for its host)."""
        if self._last is not None:
            if programs:
                rc = C.vp_prefetch_sm(self._args, self._last,
                                      self._window, programs)
            else:
                rc = self._prefetch(self._args, self._last)
            if rc:
                check(rc)

    def release(self, stream=0):
        """vp_release(): work queued on `stream` so far may still read the
        weights."""
        s = self._stream
        if stream != self._stream_id:
            s = self._c_stream(stream)
        rc = self._release(self._args, self.handles, self._n, s)
        if rc:
            check(rc)
