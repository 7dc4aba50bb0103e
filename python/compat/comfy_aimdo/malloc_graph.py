"""comfy_aimdo.malloc_graph on vpager: the memory compiler's interface, in
pass-through form.

In comfy_aimdo this records the sequence of allocations a torch stream
makes and replays it from an arena of device pages. Here the arena is not
implemented: every allocation goes to torch's own allocator, so a client
runs exactly as with the compiler's arena disabled. What is kept is the
interface and its rules, so that clients written for it (ComfyUI >= 0.35's
comfy/model_prefetch.py) run unchanged and their misuse is still caught:

* record(stream, assert_graph_breaks=False) starts a MallocGraph on the
  calling thread and opens its first scope. A thread has at most one
  active graph (active_graph() returns it): a second record() there is a
  RuntimeError until the first is aborted or garbage-collected. A graph's
  methods refuse calls from other threads, abort() excepted. A graph
  belongs to its thread, not to the thread's ident: once the thread has
  ended, a new thread that gets the same ident may record() and the old
  graph refuses its calls.
* push(name=None) opens a nested scope; pop() closes the innermost one
  (and any scope iterate() left open inside it) and returns whether it
  "broke" (here: never, False). A graph whose scopes are all closed stays
  active; push() reopens one.
* iterate(name=None) closes the scope the last iterate() opened, if it is
  still the innermost, and opens `name` in its place (None only closes);
  False: nothing breaks.
* pause(sync=False) / resume(sync=False) nest: allocations made while
  paused are not the graph's (they do not count in peak_used). sync asks
  for pending work to settle; the pass-through graph holds no memory, so
  there is nothing to settle.
* use_stream(stream) is a context manager: the graph follows `stream`
  inside the block and the previous stream again after it.
* abort() ends the graph after an exception (a second abort() is a no-op);
  every other call after it is a RuntimeError. The attributes stay
  readable.
* peak_used: the most bytes torch's allocator held on the graph's stream's
  device while a scope was open and the graph not paused, from torch's
  memory statistics (torch's own peak counters are read, never reset):
  exact when that was a new device-wide peak, else the highest value seen
  at the graph's scope boundaries. 0 on CPU (and the simulated device).
  virtual_bytes, physical_bytes, rogue_count: 0 (no arena, no
  allocations of the graph's own, so none outlive an abort).

Every error is a RuntimeError. Importing this module imports neither torch
nor vpager; record() reaches torch only to find a CUDA stream's device.
"""

import contextlib
import gc
import sys
import threading
import weakref

__all__ = ["record", "MallocGraph"]

_MAX_DEPTH = 1 << 16            # nested scopes one graph may hold
_lock = threading.RLock()
_active = {}                    # thread ident -> weakref to its MallocGraph
_tls = threading.local()


def _token():
    """An object unique to the calling thread for its lifetime. Thread
    idents are reused once a thread has ended (a new thread often gets a
    dead one's), so a graph names its thread by this token, not by the
    ident alone: a graph whose thread has ended neither blocks a new
    thread's record() nor takes calls from it."""
    t = getattr(_tls, "token", None)
    if t is None:
        t = _tls.token = object()
    return t


# ------------------------------------------------------------ arguments

def _check_stream(stream, what):
    """None (the current stream) or a torch stream: anything with a device
    or a CUDA handle, as torch.cuda.Stream, ExternalStream, torch.Stream."""
    if stream is None:
        return None
    if isinstance(stream, (str, bytes, bool, int, float, complex)):
        raise RuntimeError("%s: %r is not a torch stream (a torch.cuda."
                           "Stream, or None for the current one)"
                           % (what, stream))
    for attr in ("device", "cuda_stream", "stream_id"):
        try:
            getattr(stream, attr)
            return stream
        except Exception:
            continue
    raise RuntimeError("%s: %r is not a torch stream (a torch.cuda.Stream, "
                       "or None for the current one)" % (what, stream))


def _check_name(name, what):
    if name is None or isinstance(name, str):
        return name
    raise RuntimeError("%s: a scope name is a str or None, not %r"
                       % (what, type(name).__name__))


def _truth(value, what):
    try:
        return bool(value)
    except Exception as e:
        raise RuntimeError("%s: %r is not a flag: %s" % (what, value, e)) \
            from None


# ---------------------------------------------------------- torch stats

def _cuda_index(stream):
    """The CUDA device index a stream belongs to, or None (CPU, no CUDA,
    or torch never imported: then nothing ran on a GPU through it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        if stream is None:
            return torch.cuda.current_device()
        dev = getattr(stream, "device", None)
        if dev is None or getattr(dev, "type", None) != "cuda":
            return None
        idx = getattr(dev, "index", None)
        return torch.cuda.current_device() if idx is None else int(idx)
    except Exception:
        return None


def _stats(index):
    """(allocated now, allocated peak) of torch on CUDA device `index`, or
    None when torch cannot say."""
    if index is None:
        return None
    torch = sys.modules.get("torch")
    try:
        s = torch.cuda.memory_stats(index)
        return (int(s.get("allocated_bytes.all.current", 0)),
                int(s.get("allocated_bytes.all.peak", 0)))
    except Exception:
        return None


# ---------------------------------------------------------------- graph

class MallocGraph:
    """An allocation graph of one stream on one thread (see the module's
    documentation). Made by record(), not directly. Clients may set
    attributes of their own on it."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("a MallocGraph is made by comfy_aimdo.malloc_graph"
                           ".record(stream)")

    @classmethod
    def _start(cls, stream, assert_graph_breaks):
        g = object.__new__(cls)
        g._owner = threading.get_ident()
        g._token = _token()
        g._stream = stream
        g._device = _cuda_index(stream)
        g._streams = []             # saved streams of open use_stream blocks
        g._frames = []              # open scopes: ("push" | "iter", name)
        g._paused = 0
        g._aborted = False
        g._peak = 0
        g._marks = {}               # device -> torch's peak when last seen
        g.assert_graph_breaks = assert_graph_breaks
        return g

    # ------------------------------------------------------- attributes
    @property
    def peak_used(self):
        if self._frames and not self._paused and not self._aborted:
            self._sample()
        return self._peak

    @property
    def virtual_bytes(self):
        return 0

    @property
    def physical_bytes(self):
        return 0

    @property
    def rogue_count(self):
        return 0

    @property
    def stream(self):
        """The stream the graph follows now (None: the current one)."""
        return self._stream

    @property
    def active(self):
        """True until abort()."""
        return not self._aborted

    @property
    def depth(self):
        """Scopes open now."""
        return len(self._frames)

    def __repr__(self):
        return ("<comfy_aimdo.MallocGraph (pass-through) %s, %d scope(s) "
                "open%s, peak_used %d>"
                % ("aborted" if self._aborted else "active",
                   len(self._frames), ", paused" if self._paused else "",
                   self._peak))

    # ---------------------------------------------------------- checks
    def _check(self, what):
        if self._aborted:
            raise RuntimeError("MallocGraph.%s after abort()" % what)
        if _token() is not self._token:
            raise RuntimeError("MallocGraph.%s from thread %d: the graph "
                               "records on thread %d%s" % (
                                   what, threading.get_ident(), self._owner,
                                   " (which has ended)" if
                                   threading.get_ident() == self._owner
                                   else ""))

    # ------------------------------------------------------------ peak
    def _counting(self):
        return bool(self._frames) and not self._paused

    def _sample(self):
        """Fold in what torch held since the last look (while counting)."""
        st = _stats(self._device)
        if st is None:
            return
        cur, peak = st
        mark = self._marks.get(self._device)
        if mark is not None and peak > mark:
            self._peak = max(self._peak, peak)   # a new peak, reached here
        self._marks[self._device] = peak
        self._peak = max(self._peak, cur)

    def _rebase(self):
        """Start counting from now: what came before is not the graph's."""
        st = _stats(self._device)
        if st is not None:
            self._marks[self._device] = st[1]
            self._peak = max(self._peak, st[0])

    # ---------------------------------------------------------- scopes
    def _open(self, kind, name):
        if len(self._frames) >= _MAX_DEPTH:
            raise RuntimeError("MallocGraph: more than %d nested scopes"
                               % _MAX_DEPTH)
        starting = not self._frames
        self._frames.append((kind, name))
        if starting and not self._paused:
            self._rebase()

    def _close_to(self, n):
        if self._counting():
            self._sample()
        del self._frames[n:]

    def push(self, name=None):
        """Open a nested scope (`name`: a named sub-graph)."""
        self._check("push")
        name = _check_name(name, "MallocGraph.push")
        self._open("push", name)

    def pop(self):
        """Close the innermost pushed scope (and what iterate() left open in
        it); True if it broke: never, in pass-through form."""
        self._check("pop")
        for i in range(len(self._frames) - 1, -1, -1):
            if self._frames[i][0] == "push":
                self._close_to(i)
                return False
        raise RuntimeError("MallocGraph.pop: no scope is open (pop without "
                           "record() or push())")

    def iterate(self, name=None):
        """Close the scope the last iterate() opened, if it is the innermost
        one, and open `name` (None: only close). Whether the closed scope
        broke: never, in pass-through form."""
        self._check("iterate")
        name = _check_name(name, "MallocGraph.iterate")
        if not self._frames:
            raise RuntimeError("MallocGraph.iterate: no scope is open")
        if self._frames[-1][0] == "iter":
            self._frames.pop()
        if name is not None:
            self._open("iter", name)
        return False

    # ---------------------------------------------------- pause, resume
    def pause(self, sync=False):
        """Let the stream's allocations bypass the graph until resume()
        (pauses nest)."""
        self._check("pause")
        _truth(sync, "MallocGraph.pause(sync)")
        if self._counting():
            self._sample()
        self._paused += 1

    def resume(self, sync=False):
        """End the innermost pause()."""
        self._check("resume")
        _truth(sync, "MallocGraph.resume(sync)")
        if not self._paused:
            raise RuntimeError("MallocGraph.resume without pause()")
        self._paused -= 1
        if self._counting():
            self._rebase()

    # ------------------------------------------------------------ stream
    def use_stream(self, stream):
        """A context manager: the graph follows `stream` inside the
        with-block, the previous stream after it (the arguments are checked
        now, the switch happens on entry)."""
        self._check("use_stream")
        stream = _check_stream(stream, "MallocGraph.use_stream")
        return self._use_stream(stream)

    @contextlib.contextmanager
    def _use_stream(self, stream):
        self._check("use_stream")
        if self._counting():
            self._sample()
        self._streams.append((self._stream, self._device))
        self._stream, self._device = stream, _cuda_index(stream)
        if self._counting():
            self._rebase()
        try:
            yield self
        finally:
            # After an abort() inside the block there is nothing to restore.
            if not self._aborted and self._streams:
                if self._counting():
                    self._sample()
                self._stream, self._device = self._streams.pop()
                if self._counting():
                    self._rebase()

    # --------------------------------------------------------------- end
    def abort(self):
        """End the graph (after an exception): scopes, pauses and streams are
        dropped and the thread may record() again. A second abort() does
        nothing."""
        if self._aborted:
            return
        if self._counting():
            self._sample()
        self._aborted = True
        self._frames.clear()
        self._paused = 0
        self._streams.clear()
        _release(self._owner, self)


def _release(owner, graph):
    with _lock:
        ref = _active.get(owner)
        if ref is not None and ref() in (graph, None):
            del _active[owner]


def _forget(owner, ref):
    """Weakref callback: the graph was collected."""
    with _lock:
        if _active.get(owner) is ref:
            del _active[owner]


def _taken(owner):
    """Whether the calling thread (ident `owner`) has an active graph; an
    entry left by an ended thread of the same ident is dropped."""
    with _lock:
        ref = _active.get(owner)
        if ref is None:
            return False
        g = ref()
        if g is None or g._aborted or g._token is not _token():
            del _active[owner]
            return False
        return True


def record(stream, assert_graph_breaks=False):
    """Start a MallocGraph of `stream` (a torch stream; None: the current
    one) on the calling thread, with its first scope open. RuntimeError
    when the thread has an active graph already, or for a bad argument.
    assert_graph_breaks: a graph break would raise (none happen here)."""
    stream = _check_stream(stream, "record")
    flag = _truth(assert_graph_breaks, "record(assert_graph_breaks)")
    owner = threading.get_ident()
    if _taken(owner):
        gc.collect()            # a dropped graph caught in a cycle
        if _taken(owner):
            raise RuntimeError(
                "record: this thread has an active MallocGraph already "
                "(one per thread: abort() it, or drop it, first)")
    g = MallocGraph._start(stream, flag)
    with _lock:
        _active[owner] = weakref.ref(g, lambda r, o=owner: _forget(o, r))
    g._open("push", None)
    return g


def active_graph():
    """The calling thread's active MallocGraph, or None."""
    with _lock:
        ref = _active.get(threading.get_ident())
        g = ref() if ref is not None else None
        if g is None or g._aborted or g._token is not _token():
            return None
        return g
