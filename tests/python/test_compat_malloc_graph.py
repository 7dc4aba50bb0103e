"""comfy_aimdo.malloc_graph driven as ComfyUI 0.35-0.38 drives it
(comfy/model_prefetch.py of ComfyUI 0.38, read through the search tools;
issue 12 section 3), on vpager's simulated device without a GPU.

    make && PYTHONPATH=python:python/compat python3 \
        tests/python/test_compat_malloc_graph.py

`Prefetch` below is a re-statement, in this project's words, of the call
sequence that file makes (no ComfyUI code is copied): its module state
(one graph per Python thread in a dict, a break counter, a rogue counter,
a "used" flag), malloc_graph_begin / _end / _scope, the pause context
comfy-kitchen gets as its allocation context, cleanup after every node,
and the malloc-graph and VBAR parts of prefetch_queue_pop: iterate(scope)
per block and iterate(None) after the last block or on a CUDA-graph hit;
the capture stream's first use with the graph paused (BLAS workspace);
the warm pass under use_stream(capture stream); the capture sequence
pause() / resume() around making the graph, a device sync, pause(sync=
True), use_stream(capture stream) with resume() / core / pause() inside
the capture, resume(sync=True); graph hits keyed on vbar_fault of the
block's whole span (`_v_block`) compared with the capture-time signature.
CUDA graphs and streams are stand-ins here (the pass-through graph only
follows the stream objects); the VBARs are vpager's (simulated device).
"""

import contextlib
import gc
import os
import sys
import threading
import types
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python", "python/compat")
from _runner import raises  # noqa: E402

from comfy_aimdo import control, malloc_graph, model_vbar  # noqa: E402
from test_compat import fresh  # noqa: E402  (deinit, init, device 0)

MiB = 1 << 20
PAGE = 32 * MiB


# ------------------------------------------------------------ stand-ins

class Stream:
    """A torch stream stand-in (the graph accepts anything with .device)."""

    def __init__(self, name):
        self.name = name
        self.device = types.SimpleNamespace(type="cpu", index=None)

    def __repr__(self):
        return "<stream %s>" % self.name


class CudaGraph:
    """torch.cuda.CUDAGraph stand-in: counts captures, replays, resets."""

    def __init__(self, log):
        self.log = log
        self.captured = None

    def replay(self):
        self.log.append("replay")

    def reset(self):
        self.log.append("reset")


class Runtime:
    """What model_prefetch asks of torch / model_management, faked."""

    def __init__(self):
        self.main = Stream("main")
        self.log = []
        self.current = self.main

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        self.log.append("new stream")
        return Stream("capture")

    @contextlib.contextmanager
    def stream(self, s):                       # torch.cuda.stream(s)
        old, self.current = self.current, s
        try:
            yield
        finally:
            self.current = old

    @contextlib.contextmanager
    def capture(self, graph, s):                # torch.cuda.graph(g, s)
        self.log.append("capture begin")
        with self.stream(s):
            yield
        graph.captured = s
        self.log.append("capture end")

    def synchronize(self):
        self.log.append("sync")

    def blas_workspace(self):
        self.log.append("blas workspace")


class Leaf:
    """A comfy op with a VBAR allocation (`_v`)."""

    def __init__(self, vbar, nbytes):
        self._v = vbar.alloc(nbytes)


class Block:
    """A transformer block: its ops, and `_v_block`, the span over all
    their allocations (as ComfyUI ≥ 0.38's loader builds for units)."""

    def __init__(self, vbar, sizes):
        self.leaves = [Leaf(vbar, n) for n in sizes]
        first = self.leaves[0]._v
        last = self.leaves[-1]._v
        self._v_block = (vbar, first[1], last[1] + last[2] - first[1])

    def modules(self):
        return [self] + self.leaves


# ----------------------------------------------------------- the driver

class _Pause:
    """Pauses the calling thread's graph while it is active for ComfyUI."""

    def __init__(self, prefetch, sync):
        self.prefetch, self.sync = prefetch, sync

    def _graph(self):
        g = self.prefetch.graphs.get(threading.get_ident())
        return g if g is not None and g._comfy_active else None

    def __enter__(self):
        g = self._graph()
        if g is not None:
            g.pause(sync=self.sync)

    def __exit__(self, *exc):
        g = self._graph()
        if g is not None:
            g.resume(sync=self.sync)


class Prefetch:
    """The model_prefetch call sequence (see the module's docstring)."""

    def __init__(self, enabled=True, assert_breaks=False,
                 cuda_graphs=True, runtime=None):
        self.enabled = enabled
        self.assert_breaks = assert_breaks
        self.cuda_graphs = cuda_graphs
        self.rt = runtime or Runtime()
        self.graphs = {}                  # thread ident -> MallocGraph
        self.breaks = self.rogues = 0
        self.used = False
        self.queues = []
        self.warmed = weakref.WeakSet()
        self.capture_streams = {}
        self.logged = []
        self.iterates = []                # (scope asked, result) per call
        self.kitchen_context = _Pause(self, False)
        self.core_streams = []            # the graph's stream in each core

    # --- malloc_graph_begin / _end / cleanup / scope / pause
    def begin(self, device="cuda:0"):
        if not self.enabled:
            return
        tid = threading.get_ident()
        g = self.graphs.get(tid)
        if g is None:
            g = malloc_graph.record(self.rt.current_stream(device),
                                    self.assert_breaks)
            g._comfy_cuda_graph_modules = weakref.WeakSet()
            self.graphs[tid] = g
        else:
            g.push()
        self.kitchen_context = self.pause()
        g._comfy_active = True
        self.used = True

    def end(self):
        tid = threading.get_ident()
        g = self.graphs.get(tid)
        if g is not None and g._comfy_active:
            try:
                broke = g.pop()
            except Exception:
                # ComfyUI drops the graph without abort() here.
                self.graphs.pop(tid, None)
                g._comfy_active = False
                raise
            g._comfy_active = False
            if broke:
                self.breaks += 1

    def cleanup_graph(self):
        g = self.graphs.pop(threading.get_ident(), None)
        if g is None:
            return
        if g._comfy_active:
            g._comfy_active = False
            try:
                g.abort()
            except Exception as e:  # noqa: BLE001 (ComfyUI logs it)
                self.logged.append("abort failed: %s" % e)
        for module in list(g._comfy_cuda_graph_modules):
            self.drop_graph(module)
        self.rogues += g.rogue_count
        del g

    @contextlib.contextmanager
    def scope(self, device="cuda:0"):
        self.begin(device)
        try:
            yield
        except BaseException:
            self.cleanup_graph()
            raise
        self.end()

    def pause(self, sync=False):
        """pause_malloc_graph(sync): a reusable context (comfy-kitchen
        keeps one as its allocation context and enters it many times)."""
        return _Pause(self, sync)

    # --- cleanup after every node (execution.py)
    def cleanup_queues(self):
        self.cleanup_graph()
        for queue in self.queues:
            for entry in queue:
                if isinstance(entry, tuple):
                    module, leaves = entry[1]
                    self.unpin_prefetched(module, leaves)
        self.queues = []
        self.warmed.clear()
        if self.used:
            self.logged.append("Comfy model compiler graph breaks: %d, "
                               "rogues: %d" % (self.breaks, self.rogues))
        self.breaks = self.rogues = 0
        self.used = False

    def drop_graph(self, module):
        graph = getattr(module, "_comfy_graph", None)
        if graph is not None:
            graph["graph"].reset()
            del module._comfy_graph

    def unpin_prefetched(self, module, leaves):
        for s in leaves:
            sig = getattr(s, "_prefetch_sig", False)
            if sig is False:
                continue
            if sig is not None:
                model_vbar.vbar_unpin(s._v)
            del s._prefetch_sig
        if getattr(module, "_v_block_faulted", False):
            model_vbar.vbar_unpin(module._v_block)
            del module._v_block_faulted

    # --- make_prefetch_queue / prefetch_queue_pop
    def make_queue(self, blocks):
        queue = [None] + list(blocks) + [None]
        self.queues.append(queue)
        return queue

    def _iterate(self, g, name):
        broke = g.iterate(name)
        self.iterates.append((name, broke))
        if broke:
            self.breaks += 1

    def pop(self, queue, device, module, core=None, enable_graph=False,
            scope=None):
        g = self.graphs.get(threading.get_ident())
        if g is not None and not g._comfy_active:
            g = None
        enable_graph = (enable_graph and g is not None and self.cuda_graphs
                        and getattr(module, "_v_block", None) is not None)
        if queue is None:
            if g is not None and scope is not None:
                self._iterate(g, scope if module is not None else None)
            if core is not None:
                core()
            return
        cs = None
        if enable_graph:
            cs = self.capture_streams.get(device)
            if cs is None:
                cs = self.rt.new_stream(device)
                g.pause()                 # BLAS workspace outside the graph
                with self.rt.stream(cs):
                    self.rt.blas_workspace()
                g.resume()
                self.capture_streams[device] = cs
        signature, hit = None, False
        graph = getattr(module, "_comfy_graph", None) if enable_graph else None
        if graph is not None:
            signature = model_vbar.vbar_fault(module._v_block)
            if signature is not None:
                module._v_block_faulted = True
                hit = model_vbar.vbar_signature_compare(signature,
                                                        graph["signature"])
        if g is not None and scope is not None:
            self._iterate(g, scope if module is not None and not hit
                          else None)
        consumed = queue.pop(0)
        if consumed is not None:
            done_module, leaves = consumed[1]
            self.unpin_prefetched(done_module, leaves)
        if hit:
            queue[0] = (None, (module, []))
            graph["graph"].replay()
            return
        fully = False
        target = queue[0]
        if target is not None:
            leaves = [s for s in target.modules() if hasattr(s, "_v")]
            fully = True
            for s in leaves:                # cast_modules_with_vbar
                s._prefetch_sig = model_vbar.vbar_fault(s._v)
                fully = fully and s._prefetch_sig is not None
            queue[0] = (None, (module, leaves))
        if core is None:
            return
        if enable_graph and fully and module in self.warmed:
            if signature is None:
                signature = model_vbar.vbar_fault(module._v_block)
                if signature is not None:
                    module._v_block_faulted = True
            if signature is not None:
                self.drop_graph(module)
                g.pause()
                cg = CudaGraph(self.rt.log)
                g.resume()
                self.rt.synchronize()
                g.pause(sync=True)
                with g.use_stream(cs):
                    with self.rt.capture(cg, cs):
                        g.resume()
                        core()
                        g.pause()
                g.resume(sync=True)
                cg.replay()
                module._comfy_graph = {"graph": cg, "signature": signature}
                g._comfy_cuda_graph_modules.add(module)
                return
        if cs is None:
            core()
        else:
            with self.rt.stream(cs), g.use_stream(cs):
                core()
            self.warmed.add(module)

    # --- one forward of a model with `blocks`, as a DiT's forward does it
    def forward(self, blocks, enable_graph=False, prefetch=True,
                device="cuda:0", core=None):
        queue = self.make_queue(blocks) if prefetch else None
        self.begin(device)
        for b in blocks:
            self.pop(queue, device, b, core=lambda b=b: self._core(b, core),
                     enable_graph=enable_graph, scope="block")
        self.pop(queue, device, None, scope="block")
        self.end()

    def _core(self, block, extra):
        g = self.graphs.get(threading.get_ident())
        self.core_streams.append(g.stream if g is not None else None)
        # comfy-kitchen's own allocations, under the context begin() gave it
        # (the same object, entered again and again).
        with self.kitchen_context:
            with self.kitchen_context:
                pass
        if extra is not None:
            extra(block)


# ------------------------------------------------------------- helpers

def no_graph_on_this_thread():
    g = malloc_graph.active_graph()
    if g is not None:
        g.abort()
    gc.collect()


def model(vbar, nblocks=4, sizes=(16 * MiB, 16 * MiB)):
    return [Block(vbar, sizes) for _ in range(nblocks)]


def all_unpinned(vbar):
    """Every page of vbar can be evicted: no pin left behind."""
    vbar.free_memory(1 << 62)
    return vbar.loaded_size() == 0


# --------------------------------------------------------------- tests

def test_sampler_loop_records_once_then_pushes():
    """Steps of a sampler: the first forward records, later ones push on
    the same graph; per block iterate("block"), iterate(None) after the
    last; pop() is False (no break); the graph stays between forwards,
    inactive for ComfyUI, and is dropped (not aborted) at the node's end;
    the next node records a new one on the same thread."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    first = None
    for step in range(5):
        p.forward(blocks)
        g = p.graphs[threading.get_ident()]
        if first is None:
            first = g
        assert g is first, "a later forward recorded a new graph"
        assert g.active and g.depth == 0 and g._comfy_active is False
        assert malloc_graph.active_graph() is g
    assert p.breaks == 0
    assert p.iterates == ([("block", False)] * 4 + [(None, False)]) * 5
    assert p.core_streams == [p.rt.main] * 20
    ref = weakref.ref(first)
    del g, first
    p.cleanup_queues()
    assert ref() is None, "ComfyUI dropped the graph; something holds it"
    assert p.logged == ["Comfy model compiler graph breaks: 0, rogues: 0"]
    assert malloc_graph.active_graph() is None
    p.forward(blocks)                       # the next node
    assert malloc_graph.active_graph() is p.graphs[threading.get_ident()]
    p.cleanup_queues()
    assert malloc_graph.active_graph() is None
    assert all_unpinned(vb)
    vb.close()


def test_cuda_graph_warm_capture_and_hits():
    """enable_graph: the first forward makes the capture stream (graph
    paused for the BLAS workspace) and runs every block on it under
    use_stream (warm); the second captures each block (pause, resume,
    sync, pause(sync=True), use_stream, resume/core/pause inside the
    capture, resume(sync=True)); later forwards fault each block's span,
    find the capture-time signature unchanged and replay: iterate(None)
    for a hit. Streams and pauses are restored after every block."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    rt = p.rt
    p.forward(blocks, enable_graph=True)                    # warm
    g = p.graphs[threading.get_ident()]
    cs = p.capture_streams["cuda:0"]
    assert rt.log == ["new stream", "blas workspace"]
    assert p.core_streams == [cs] * 4 and g.stream is rt.main
    assert set(p.warmed) == set(blocks)
    p.forward(blocks, enable_graph=True)                    # capture
    assert rt.log[2:] == ["sync", "capture begin", "capture end",
                          "replay"] * 4
    assert p.core_streams[4:] == [cs] * 4
    assert all(b._comfy_graph["graph"].captured is cs for b in blocks)
    assert set(g._comfy_cuda_graph_modules) == set(blocks)
    assert g.stream is rt.main and g.depth == 0
    n = len(rt.log)
    for _ in range(3):                                      # hits
        p.forward(blocks, enable_graph=True)
    assert rt.log[n:] == ["replay"] * 12, rt.log[n:]
    assert len(p.core_streams) == 8, "a hit ran the block's code"
    hits = p.iterates[10:]
    assert hits == ([(None, False)] * 4 + [(None, False)]) * 3, hits
    assert p.breaks == 0 and g.depth == 0
    del g                                # ComfyUI holds it only in its dict
    p.cleanup_queues()
    assert rt.log[-4:] == ["reset"] * 4          # graphs dropped
    assert all(not hasattr(b, "_comfy_graph") for b in blocks)
    assert malloc_graph.active_graph() is None
    assert all_unpinned(vb)
    vb.close()


def test_evicted_span_is_not_replayed():
    """After the blocks' pages were evicted (free_memory, as ComfyUI's
    partially_unload does) no block replays: its span's fault misses or
    gives a new signature, so iterate("block") and its code runs; once
    resident again (prioritize, as a reload does) it is captured again and
    the forward after replays every block."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    for _ in range(3):                  # warm, capture, hits
        p.forward(blocks, enable_graph=True)
    assert [s for s, _ in p.iterates[10:]] == [None] * 5
    assert vb.free_memory(1 << 62) >= 4 * PAGE and vb.loaded_size() == 0
    vb.prioritize()
    ran = len(p.core_streams)
    p.forward(blocks, enable_graph=True)
    assert [s for s, _ in p.iterates[15:]] == ["block"] * 4 + [None]
    assert len(p.core_streams) == ran + 4, "an evicted block was replayed"
    assert p.rt.log.count("capture begin") == 8      # captured again
    p.forward(blocks, enable_graph=True)
    assert [s for s, _ in p.iterates[20:]] == [None] * 5
    assert len(p.core_streams) == ran + 4
    p.cleanup_queues()
    assert all_unpinned(vb)
    vb.close()


def test_under_a_small_budget_pins_stay_balanced():
    """A budget of 2 pages for 4 one-page blocks: pages are evicted
    between forwards, so some blocks miss (their code runs) and a block
    replays only while its span's signature is unchanged; pins balance."""
    no_graph_on_this_thread()
    fresh(budget_pages=2)
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    for _ in range(6):
        p.forward(blocks, enable_graph=True)
    late = [s for s, _ in p.iterates[10:]]
    misses = late.count("block")
    assert misses >= 1, "4 pages cannot all stay resident in 2"
    assert len(p.core_streams) == 8 + misses
    assert p.breaks == 0
    p.cleanup_queues()
    assert all_unpinned(vb)
    vb.close()


def test_exception_in_a_scope_aborts_and_frees_the_thread():
    """malloc_graph_scope: an exception inside it aborts the active graph
    (cleanup) and the exception goes on; rogue_count is read after abort;
    the thread may record again at once."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    p.forward(blocks)                       # a graph exists, inactive
    try:
        with p.scope():
            g = p.graphs[threading.get_ident()]
            assert g._comfy_active and g.depth == 1
            p.pop(None, "cuda:0", blocks[0], scope="block")
            with p.pause(sync=True):
                raise ValueError("node failed")
    except ValueError:
        pass
    else:
        raise AssertionError("the exception was swallowed")
    assert not g.active and g.rogue_count == 0 and g.peak_used == 0
    assert threading.get_ident() not in p.graphs
    assert malloc_graph.active_graph() is None
    with p.scope():                         # records a new one
        assert p.graphs[threading.get_ident()] is not g
    p.cleanup_queues()
    assert p.logged == ["Comfy model compiler graph breaks: 0, rogues: 0"]
    assert all_unpinned(vb)
    vb.close()


def test_a_failing_pop_drops_the_graph_without_abort():
    """If pop() raises, ComfyUI forgets the graph without abort(); once it
    is garbage, the thread records again."""
    no_graph_on_this_thread()
    p = Prefetch()
    p.begin()
    g = p.graphs[threading.get_ident()]
    g.pop()                                 # the client's scope is gone
    raises(RuntimeError, p.end)
    assert threading.get_ident() not in p.graphs and g.active
    raises(RuntimeError, malloc_graph.record, None)   # still referenced
    del g
    p.begin()                               # a new record
    assert p.graphs[threading.get_ident()].depth == 1
    p.end()
    p.cleanup_queues()
    assert malloc_graph.active_graph() is None


def test_inactive_graph_is_not_driven():
    """Between forwards (graph inactive for ComfyUI) prefetch_queue_pop
    does not touch it, and the pause context is a no-op."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch()
    p.forward(blocks, enable_graph=True)
    g = p.graphs[threading.get_ident()]
    n = len(p.iterates)
    q = p.make_queue(blocks)
    for b in blocks:
        p.pop(q, "cuda:0", b, core=lambda: None, enable_graph=True,
              scope="block")
    p.pop(q, "cuda:0", None, scope="block")
    with p.pause(sync=True):
        assert g.depth == 0
    assert len(p.iterates) == n and g.depth == 0 and g.active
    p.cleanup_queues()
    assert all_unpinned(vb)
    vb.close()


def test_disabled_compiler_records_nothing():
    """--disable-comfy-compiler (or no aimdo): begin/end/pop do nothing
    to malloc_graph; the blocks still run and pins stay balanced."""
    no_graph_on_this_thread()
    fresh()
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    blocks = model(vb)
    p = Prefetch(enabled=False)
    ran = []
    for _ in range(2):
        p.forward(blocks, enable_graph=True, core=ran.append)
    assert ran == blocks * 2 and p.graphs == {} and p.iterates == []
    assert malloc_graph.active_graph() is None
    p.cleanup_queues()
    assert p.logged == []
    assert all_unpinned(vb)
    vb.close()


def test_no_prefetch_queue_only_iterates():
    """A model without prefetch (queue None) still opens a scope per
    block: iterate("block") each, iterate(None) at the end, core runs."""
    no_graph_on_this_thread()
    p = Prefetch()
    blocks = [types.SimpleNamespace(name=i) for i in range(3)]
    ran = []
    for _ in range(2):
        p.forward(blocks, prefetch=False, core=ran.append)
    assert ran == blocks * 2
    assert p.iterates == ([("block", False)] * 3 + [(None, False)]) * 2
    p.cleanup_queues()
    assert malloc_graph.active_graph() is None


def test_assert_graph_breaks_flag_and_threads():
    """--assert-graph-breaks reaches record(); every thread (ComfyUI's
    prompt worker, a custom node's thread) has its own graph, driven
    concurrently, none seeing the others'."""
    no_graph_on_this_thread()
    fresh()
    vbars = [model_vbar.ModelVBAR(4 * PAGE, 0) for _ in range(4)]
    models = [model(vb, nblocks=2, sizes=(MiB, 3 * MiB)) for vb in vbars]
    out, errors = {}, []

    def worker(i):
        try:
            blocks = models[i]
            p = Prefetch(assert_breaks=True)
            for _ in range(20):
                p.forward(blocks, enable_graph=(i % 2 == 0))
            g = p.graphs[threading.get_ident()]
            out[i] = (g.assert_graph_breaks, p.breaks,
                      malloc_graph.active_graph() is g)
            del g
            p.cleanup_queues()
            out[i] += (malloc_graph.active_graph() is None,)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((i, repr(e)))
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [], errors
    assert out == {i: (True, 0, True, True) for i in range(4)}, out
    for vb in vbars:
        assert all_unpinned(vb)
        vb.close()


def test_a_thread_that_ended_does_not_block_a_new_one():
    """ComfyUI keeps graphs per thread ident; a thread that ended while
    its graph was still referenced must not block a later thread (which
    often gets the same ident) from recording, nor lend it its graph.
    Tried a few times, as ident reuse is up to the platform."""
    no_graph_on_this_thread()
    reused = 0
    for _ in range(8):
        kept, seen = [], []

        def first():
            kept.append((threading.get_ident(), malloc_graph.record(None)))

        def second():
            try:
                same = threading.get_ident() == kept[0][0]
                p = Prefetch()
                p.forward([types.SimpleNamespace()], prefetch=False)
                mine = p.graphs[threading.get_ident()]
                refused = None
                try:
                    kept[0][1].push()
                except RuntimeError as e:
                    refused = str(e)
                seen.append((same, mine is not kept[0][1], refused,
                             malloc_graph.active_graph() is mine))
                del mine
                p.cleanup_queues()
            except Exception as e:  # noqa: BLE001 (reported below)
                seen.append(repr(e))
        for fn in (first, second):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        assert len(seen) == 1 and isinstance(seen[0], tuple), seen
        same, new_graph, refused, active = seen[0]
        assert new_graph and active and refused is not None, seen
        if same:
            assert "has ended" in refused, refused
            reused += 1
        kept[0][1].abort()                  # from another thread: allowed
        assert not kept[0][1].active
    print("     thread ident reused in %d of 8 tries" % reused)


if __name__ == "__main__":
    sys.exit(_runner.main(globals(), timing=True, after_all=control.deinit))
