"""The forward hot path of an offloaded module: each unit's forward is
wrapped so that one vp_acquire brings its weights (each parameter's .data
a view of the returned address: resident views built once, staged ones
cached by staging address, one cache for the handle's weights), the
original forward runs, and the placeholders go back before one vp_release
on the current stream. Around it: an out-of-memory retry (evict vpager's
unpinned pages, empty torch's cache, run once more), autograd aliasing
(tensors autograd saves, or the forward returns, that view a weight are
copied: that memory is reused after the release), buffer write-back in
training mode, and on CUDA the activation headroom learned at each root
forward. Units the schedule keeps wholly resident may be held instead:
their weights acquired once for the whole root forward (hold()), a
Parameter over each put in its module's place (a dict store, not a .data
swap), their modules meanwhile calling their own forward through a bare
wrapper (no acquire, no prefetch: the acquire before them already queued
what a top-up would; the root copies what it returns of them)."""

import functools
import threading
import time

import torch

from .. import ACQUIRED_COPIED, ACQUIRED_RESIDENT, PAGE_RESIDENT
from ..errors import Error
from ..weights import WeightBatch
from .devices import (LEARN_EVERY, cuda_index, learn_headroom, torch_peak,
                      torch_reserved_now)
from .layout import ALL
from .patches import refill
from .serial import new_lock
from .units import Unit, refuse_copy
from .views import Region, view

# Staged views cached per handle, by (address, dtype, shape): the ring
# hands a weight a different slot on each pass, so a cache per weight
# would miss almost always, but the slot addresses repeat (a view costs
# ~10-30 us to build, more than the rest of an acquire).
_STAGED_VIEWS = 4096
# Learns in a row that read a streamed weight's fill's peak as a one-off
# while the keeper is about to keep its result (learn()): the forwards a
# buffer takes to be page-locked, armed and caught (fp8 Flux's 1.5 GiB:
# ~0.45 s of page-locking, then two forwards).
KEEP_WAITS = 12
_RESIDENT = ACQUIRED_RESIDENT
_COPIED = ACQUIRED_COPIED
_PAGE_RESIDENT = PAGE_RESIDENT
# bytes.translate tables: a flag byte to 1 where the bit is missing, so
# that a run of flags is checked in C ("1 in ...") rather than a flag at
# a time (hold() checks every held weight and page at each forward).
_NOT_PAGE_RESIDENT = bytes(0 if v & PAGE_RESIDENT else 1 for v in range(256))
_NOT_RESIDENT = bytes(0 if v & ACQUIRED_RESIDENT else 1 for v in range(256))

_OOM = getattr(torch.cuda, "OutOfMemoryError", None)
# Why hold() let a forward's held units take the per-unit path: a tensor
# was changed (enter() says how), a page was evicted, the acquire failed,
# or it staged a weight (the budget shrank since the schedule).
UNHELD = ("changed", "evicted", "failed", "staged")


class _NoTuner:
    on = False          # tuner.Tuner.on: a forward is being measured


_NO_TUNER = _NoTuner()


def _page_runs(entries, page):
    """The pages the entries' bytes lie in, as [first, end) runs."""
    runs = []
    for p in sorted({p for e in entries if e.size
                     for p in range(e.offset // page,
                                    (e.offset + e.size - 1) // page + 1)}):
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def is_oom(e):
    """torch's OutOfMemoryError, or a RuntimeError saying "out of memory"
    (what CUDA errors raised outside the caching allocator say)."""
    if _OOM is not None and isinstance(e, _OOM):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e)


def _cuda_stream(target):
    return torch.cuda.current_stream(target).cuda_stream


# The current stream's handle in one call (torch 2.x; what its compiler
# uses): ~0.2 us instead of ~2 for building a torch.cuda.Stream per unit.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _unpack(t):
    return t


class HotPath:
    """Acquire and release for one model's units. owner: what the device's
    priority list names when the model is on top (ds.top: its handle); ds:
    the device's DevState; recorder: the replace.Recorder whose record()
    the first forward feeds; check_open() raises unless the model may run,
    is_open() says whether it is open and its device too."""

    __reduce_ex__ = refuse_copy   # reached from the module's hooks

    def __init__(self, owner, layout, ds, target, recorder, check_open,
                 is_open):
        self.owner = owner
        self.device = layout.device
        self.layout = layout
        self.vbar = layout.vbar
        self.ds = ds
        self.target = target
        self.recorder = recorder
        self.tuner = _NO_TUNER      # build.assemble sets the Tuner, if any
        self.keeper = None          # ... and the KeptFills (keptfills.py)
        self.staged = {}            # (address, dtype, shape) -> view
        # Views cut from one tensor over the VBAR and one over the ring.
        end = self.vbar.base + self.vbar.size
        self.resident_views = Region(target, lambda p: end)
        dev = self.device
        self.staged_views = Region(
            target, lambda p: p + dev.options["staging_size"])
        self.held = None            # WeightBatch of the held units' weights
        self.held_units = ()        # the units whose weights hold() takes
        self.holding = None         # the stream, while they are held
        # Forwards whose held units took the per-unit path, by why (hold():
        # stats()["model"]["unheld_forwards"]): a slow steady state shows
        # whether the held units ran held.
        self.unheld = dict.fromkeys(UNHELD, 0)
        self._held_of = None        # the placement `held` was made for
        self._held_runs = []        # their VBAR pages, as [first, end) runs
        self._held_swaps = []       # (module dict, wrapped, bare, unit)
        self._held_cur = []         # (Entry, address) as last acquired
        self._bared = []            # held units running bare, while held
        self._held_span = (0, 0)    # [lowest, highest) held address
        self._held_entries = []     # the held weights' Entries, in order
        self._held_slots = []       # (dict, key, tensor, Entry) of them
        self._held_ptrs = None      # the addresses hparams were made for
        self.fills = 0              # fills run (set_fill), and their bytes
        self.fill_bytes = 0
        # Weights a fill rewrote on a GPU stream, with an event recorded
        # after it, until it completes: the C library orders its copies
        # across streams, not torch's kernels, so another stream that
        # acquires such a weight resident waits for the event.
        self.fill_marks = {}        # Entry -> (stream, torch.cuda.Event)
        self._filled = []           # Entries filled by this acquire
        # torch's peak before the first fill since the last learn, or
        # since the forwards with streamed fills began (None: no fill);
        # the streamed weights whose fill ran since the last learn (their
        # temporaries come back at each of their fills: a peak of every
        # forward, until none runs: kept fills, resident, or gone), and
        # the learns in a row that masked such a peak all the same (the
        # keeper was about to keep them: learn()); learns: torch's
        # allocator is read (CUDA).
        self.peak_before_fills = None
        self.streamed_fills = set()
        self.keep_waits = 0
        self.learns = target.type == "cuda"
        self.blocks = 0             # acquired() blocks open
        self._check_open = check_open
        self._is_open = is_open
        # One forward at a time (serial.py): the root's calls, each unit's
        # forward and the handle's changes take it.
        self.lock = new_lock()
        self.holder = None          # the thread whose forward holds
        # The device's loans of torch's cache to the ring (lend.py), made
        # at the root forward's start, where the last forward's last unit
        # that streams (lend_unit) prefetches into them (lend_before).
        self.lender = ds.lender
        self.lend_unit = None
        if target.type == "cuda":
            self.index = cuda_index(target)
            self.stream = (functools.partial(_RAW_STREAM, self.index)
                           if _RAW_STREAM is not None else
                           functools.partial(_cuda_stream, target))
            ds.lender.use(target, self.index, functools.partial(
                torch_reserved_now, self.index), ds.gov.torch_peak)
        else:
            self.stream = int           # int() == 0: the default stream
            self.index = 0

    def wrap(self, unit, fwd):
        """The forward installed on unit.module in place of `fwd`."""
        enter, leave, call = self.enter, self.leave, self.call
        writeback, escapes = self.writeback, self.escapes
        aliases, retry = self.aliases, self.retry
        grad_enabled, Tensor = torch.is_grad_enabled, torch.Tensor
        recorder = self.recorder
        unit.pack = functools.partial(self.pack, unit)
        run_held = self.run_held
        lock = self.lock
        lender = self.lender

        @functools.wraps(fwd)
        def forward(*args, **kwargs):
            with lock:      # re-entrant: free on the forward's own thread
                return run(*args, **kwargs)

        def run(*args, **kwargs):
            if recorder.rec is not None:    # the first forward: the order
                recorder.record(unit)
            if unit.depth:              # the unit calls itself: weights set
                return fwd(*args, **kwargs)
            if unit.held and self.holding is not None \
                    and not grad_enabled() and self.stream() == self.holding:
                return run_held(unit, fwd, args, kwargs)
            # (autograd turned on inside the forward, or another stream:
            # acquired again here, as any unit, its saved tensors copied)
            stream, prev = enter(unit)
            unit.depth = 1
            ok = False
            try:
                if grad_enabled():
                    with torch.autograd.graph.saved_tensors_hooks(unit.pack,
                                                                  _unpack):
                        out = call(unit, fwd, args, kwargs)
                else:           # call(), inline: the hot path of inference
                    first = None
                    try:
                        out = fwd(*args, **kwargs)
                    except Exception as e:
                        if not is_oom(e):
                            raise
                        first = str(e)  # not e: its frames hold activations
                    if first is not None:
                        out = retry(unit, fwd, args, kwargs, first)
                if isinstance(out, Tensor):     # escapes(), inline
                    if aliases(unit, out):
                        out = out.clone()
                else:
                    out = escapes(unit, out)
                if unit.buffers:
                    writeback(unit)
                ok = True
            finally:
                unit.depth = 0
                leave(unit, stream, prev, ok)
                if lender.pieces:   # lent memory back once it is unused
                    lender.released()
            return out

        forward._vpager_unit = unit
        unit.wrapped = forward
        unit.bare = self._bare(unit, fwd, forward)
        return forward

    def _bare(self, unit, fwd, forward):
        """What a held unit's module calls while the root holds its
        weights (hold() puts it in place of `forward`): its own forward,
        the out-of-memory retry around it. Autograd on or another stream
        take `forward`, the per-unit path, as they would in it."""
        grad_enabled, stream, retry = (torch.is_grad_enabled, self.stream,
                                       self.retry)
        ident = threading.get_ident

        @functools.wraps(fwd)
        def bare(*args, **kwargs):
            # Another thread waits in `forward` for the model's lock.
            s = stream()
            if grad_enabled() or s != self.holding \
                    or ident() != self.holder:
                return forward(*args, **kwargs)
            tuner = self.tuner
            if tuner.on:        # a measured forward: its one mark
                tuner.held(unit, s)
            try:
                return fwd(*args, **kwargs)
            except Exception as e:
                if not is_oom(e):
                    raise
                first = str(e)  # not e: its frames hold activations
            return retry(unit, fwd, args, kwargs, first)

        bare._vpager_unit = unit
        return bare

    def enter(self, unit):
        """Acquire a unit's weights and point its tensors at them; returns
        (stream, what to restore at release)."""
        self._check_open()
        for d, key, t, qual in unit.slots:
            x = d.get(key)
            if x is not t and (self.holding is None or not any(
                    x is e.hparam for e in unit.entries)):
                raise RuntimeError(
                    "vpager.torch: %s (in %s) was replaced after offload(); "
                    "its weights are vpager's: unload() before changing "
                    "parameters, then offload again" % (qual, unit.name))
        entries = unit.entries
        if self.layout.loading is not None:     # its bytes may be on the way
            self.layout.wait_loaded(entries)        # (hostload.py)
        held = False            # an outer unit holds one of them (shared)
        for e in entries:
            if e.cur:
                held = True
            elif e.tensor.data_ptr() != e.ph_ptr:
                raise RuntimeError(
                    "vpager.torch: %s was changed after offload() (by .to(), "
                    ".half(), .data = ...?); unload() first, change the "
                    "module, then offload again" % e.name)
        ds = self.ds
        if ds.top is not self.owner:
            self.layout.on_top()
            ds.top = self.owner
        stream = self.stream()
        lender = self.lender
        if lender.pieces and lender.owner is not self:
            lender.take_back_unless(self)   # another model's forward lent it
        batch = unit.batch      # its prefetch: its weights' window (tuner)
        tuner = self.tuner
        try:
            if tuner.on:
                tuner.before(unit, stream)
                ptrs = batch.acquire(stream)
                tuner.after(stream)
            else:
                ptrs = batch.acquire(stream)
        except BaseException:
            # A failed acquire may leave bytes it copied in resident,
            # not rewritten by their fill: filled anew next time.
            refill(self.layout, entries)
            raise
        # What leave() restores: None for placeholders everywhere.
        prev = [(e.cur, e.curv) for e in entries] if held else None
        try:
            if self.fill_marks:
                self._after_fills(entries, stream)
            if ds.sync:
                self.device.synchronize(stream)
            flags = batch.flags
            staged = self.staged
            for i, e in enumerate(entries):
                p = ptrs[i]
                if flags[i] & _RESIDENT:
                    v = e.rview
                    if v is None:
                        v = e.rview = self.resident_views.view(
                            p, e.dtype, e.shape)
                else:
                    k = (p, e.dtype, e.shape)
                    v = staged.get(k)
                    if v is None:
                        if len(staged) >= _STAGED_VIEWS:
                            staged.clear()
                        # (lent memory: its own view, the ring's base kept)
                        v = staged[k] = (
                            view(p, e.dtype, e.shape, self.target)
                            if lender.holds(p) else
                            self.staged_views.view(p, e.dtype, e.shape))
                e.tensor.data = v
                e.cur, e.curv = p, v
                # Bytes fresh from the source, rewritten on the device
                # (patches.set_fill: a patch computed at fill).
                if e.fill is not None and flags[i] & _COPIED:
                    self.fill(e, v, flags[i] & _RESIDENT)
            if self._filled:
                self._mark_fills(stream)
        except BaseException:
            del self._filled[:]
            self.leave(unit, stream, prev, False)
            refill(self.layout, entries)
            raise
        return stream, prev

    def fill(self, e, v, resident=False):
        """Weight e's fill (patches.set_fill) over its fresh bytes in v
        (resident: v lies in its resident place, else in the ring);
        after an out-of-memory error (a fill that raises leaves the bytes
        as they were) once more, with vpager's unpinned pages evicted and
        torch's cache emptied, as retry() does for a forward. The keeper
        copies the result to the host if it armed a buffer for it."""
        self.fills += 1
        self.fill_bytes += e.size
        if self.learns:
            if self.peak_before_fills is None:
                self.peak_before_fills = torch_peak(self.device,
                                                   self.index)
            if not resident:
                self.streamed_fills.add(e)
        try:
            e.fill(v)
        except Exception as x:
            if not is_oom(x):
                raise
            # No room for a fill's temporaries: the streamed fills' peak
            # is read as it is until none runs (learn()); if learn() was
            # reading it as a one-off, that was the cause, not the
            # activations' headroom (its margin stays).
            masked = self.keep_waits > 0
            self.keep_waits = KEEP_WAITS
            self._make_room(margin=not masked)
            e.fill(v)
        if v.is_cuda:
            self._filled.append(e)
        if self.keeper is not None:
            self.keeper.ran(e, v)

    def _mark_fills(self, stream):
        """An event after the fills this acquire ran on `stream`, kept for
        each weight they rewrote (fill_marks)."""
        ev = torch.cuda.Event()
        ev.record()
        for e in self._filled:
            self.fill_marks[e] = (stream, ev)
        del self._filled[:]

    def _after_fills(self, entries, stream):
        """The current stream (`stream`) waits for the fills other streams
        ran on these weights and that may not have completed; marks of
        completed fills are dropped."""
        marks = self.fill_marks
        for e in entries:
            m = marks.get(e)
            if m is None:
                continue
            if m[1].query():
                del marks[e]
            elif m[0] != stream:
                m[1].wait()

    @staticmethod
    def leave(unit, stream, prev, raise_errors):
        if prev is None:
            for e in unit.entries:
                e.tensor.data = e.ph
                e.cur = 0
                e.curv = None
        else:
            for e, (p, v) in zip(unit.entries, prev):
                # (a held weight: acquired, its tensor a placeholder)
                e.tensor.data = e.ph if v is None else v
                e.cur, e.curv = p, v
        try:
            unit.batch.release(stream)
        except Error:
            if raise_errors:
                raise
            # An exception is already on its way out; it is the news.

    # ------------------------------------------------ acquired() blocks
    def busy(self):
        """True inside a unit's forward, an acquired() block or while the
        root holds its units."""
        return bool(self.blocks or self.holding is not None
                    or any(u.depth for u in self.layout.units))

    def _whole(self, module, modules):
        """A Unit holding the weights of `modules` (all if none), and the
        units it covers."""
        lay = self.layout
        entries = lay.entries
        if modules:
            ids = {id(t) for m in modules
                   for t in list(m.parameters()) + list(m.buffers())}
            entries = [e for e in entries if id(e.tensor) in ids]
        whole = Unit("acquired()", module)
        whole.entries = entries
        whole.batch = WeightBatch(self.device,
                                  [lay.weight(e) for e in entries])
        held = {id(e) for e in entries}
        covered = [u for u in lay.units
                   if all(id(e) in held for e in u.entries)]
        return whole, covered

    def acquired(self, module, modules):
        """Offloaded.acquired()'s block (a generator yielding `module`),
        under the model's lock."""
        with self.lock:         # the block is a forward's (serial.py)
            whole, covered = self._whole(module, modules)
            stream, prev = self.enter(whole)
            for u in covered:
                u.depth += 1
            self.blocks += 1
            ok = False
            try:
                yield module
                ok = True
            finally:
                self.blocks -= 1
                for u in covered:
                    u.depth -= 1
                self.leave(whole, stream, prev, ok)

    # ------------------------------------------------ held units
    def set_held(self, units):
        """The units whose weights the root forward holds from now on
        (the tuner's choice; () for none)."""
        self.unhold()
        for u in self.held_units:
            u.held = False
        # Held weights are swapped in as Parameters: units with other
        # tensors take the per-unit path.
        units = tuple(u for u in units
                      if all(type(t) is torch.nn.Parameter
                             for _, _, t, _ in u.slots))
        self.held_units = units
        self.held = self._held_of = None
        for u in units:
            u.held = True
        if units:
            self._held_batch()

    def _held_batch(self):
        """The held weights' WeightBatch, made again whenever the layout
        re-created or moved the weights (Layout.swap, Layout.move: their
        handles or pages changed)."""
        lay = self.layout
        if self._held_of is not lay.placed:
            entries = [e for u in self.held_units for e in u.entries]
            # Its own prefetch would start after the last held weight:
            # none; the acquire before each run of held units covers theirs.
            self.held = WeightBatch(lay.device,
                                    [lay.weight(e) for e in entries],
                                    lookahead=0)
            self._held_entries = entries
            of = {id(e.tensor): e for e in entries}
            self._held_slots = [(d, key, t, of[id(t)])
                                for u in self.held_units
                                for d, key, t, _ in u.slots]
            self._held_ptrs = None
            self._held_runs = _page_runs(entries, lay.device.page_size)
            self._held_swaps = [(u.module.__dict__, u.wrapped, u.bare, u)
                                for u in self.held_units]
            self._held_of = lay.placed
        return self.held

    def _unheld(self, why):
        self.unheld[why] += 1
        return False

    def _held_evicted(self):
        """True if a page of the held weights is not resident: another
        model took it since. Their acquire would then refill them all
        before the first unit; the per-unit path refills each under the
        compute before it."""
        runs = self._held_runs
        if not runs:
            return False
        flags = self.vbar.residency(runs[-1][1])
        return any(1 in flags[a:b].translate(_NOT_PAGE_RESIDENT)
                   for a, b in runs)

    def wrap_root(self, fwd):
        """The root module's forward: around an inference forward, the
        held units' weights are acquired and their views set once."""
        grad_enabled = torch.is_grad_enabled

        @functools.wraps(fwd)
        def forward(*args, **kwargs):
            if self.lend_unit is not None and self.lender.cache is not None:
                self.lend_before()
            if (self.held is None or self.holding is not None
                    or grad_enabled()
                    or self.recorder.rec is not None or not self.hold()):
                out = fwd(*args, **kwargs)
            else:
                try:
                    out = self._escape(fwd(*args, **kwargs),
                                       self._aliases_held, None)
                finally:
                    self.unhold()
            if self.lender.early and self.lend_unit is not None \
                    and self.lender.cache is not None:
                self.lend_after()
            return out

        return forward

    def lend_before(self):
        """At the root forward's start: the blocks torch's cache holds
        free then lent to the ring, and the last forward's last streamed
        unit's prefetch carried on into them (this forward's weights after
        those the ring holds: lend.py)."""
        if self.recorder.rec is not None or torch.is_grad_enabled() or \
                self.holding is not None:
            return
        if self.lender.lend_at_start(self, self.stream()):
            self._prefetch_into_loan()

    def lend_after(self):
        """At the root forward's end (VPAGER_LEND_EARLY): the loan
        borrowed, its first bytes lent to the ring and the prefetch
        carried on into them, to land in the pause before the next
        forward (copies queued longer hold up the client's own copies of
        its inputs, which wait behind them on the copy engine: lend.py);
        the rest is lent at the next forward's start."""
        if self.recorder.rec is not None or torch.is_grad_enabled() or \
                self.holding is not None:
            return
        if self.lender.lend(self, self.stream(), first=self.lender.early):
            self._prefetch_into_loan(self.lender.sm)

    def _prefetch_into_loan(self, programs=0):
        """The last streamed unit's prefetch, on into what was just lent
        (programs: by SMs, VPAGER_LEND_SM; the forward's output stands if
        it fails: the loan comes back)."""
        try:
            self.lend_unit.batch.prefetch(programs)
        except Error:
            self.lender.take_back()

    def hold(self):
        """Acquire the held units' weights on the current stream and put
        Parameters over them in their modules' place. False, nothing held,
        the units taking the per-unit path: for this forward if a page of
        theirs was evicted (_held_evicted) or a tensor was changed (enter()
        says how); until the next schedule if the acquire fails or stages
        one (the budget shrank since the schedule)."""
        self._check_open()
        self.layout.wait_loaded()       # the whole host copy (hostload.py)
        batch = self._held_batch()
        flat = self._held_slots
        for d, key, t, e in flat:
            if d.get(key) is not t or e.cur or t.data_ptr() != e.ph_ptr:
                return self._unheld("changed")  # enter() says what
        if self._held_evicted():
            return self._unheld("evicted")
        ds = self.ds
        if ds.top is not self.owner:    # as enter() does
            self.layout.on_top()
            ds.top = self.owner
        stream = self.stream()
        fills = any(e.fill is not None for e in self._held_entries)
        try:
            ptrs = batch.acquire(stream)    # no prefetch (_held_batch)
        except Error:           # e.g. misses the ring cannot hold at once
            refill(self.layout, self._held_entries)     # as enter()
            self.set_held(())
            return self._unheld("failed")   # the per-unit path meets it
        flags = batch.flags
        try:
            if self.fill_marks:
                self._after_fills(self._held_entries, stream)
            if ds.sync:         # the bytes landed before a fill reads them
                self.device.synchronize(stream)
            if fills:
                for i, e in enumerate(self._held_entries):
                    if e.fill is not None and flags[i] & _COPIED:
                        self.fill(e, view(ptrs[i], e.dtype, e.shape,
                                          self.target),
                                  flags[i] & _RESIDENT)
                if self._filled:
                    self._mark_fills(stream)
        except BaseException:
            del self._filled[:]
            batch.release(stream)
            refill(self.layout, self._held_entries)
            raise
        if 1 in bytes(flags).translate(_NOT_RESIDENT):
            batch.release(stream)
            self.set_held(())
            return self._unheld("staged")
        self.holding = stream
        self.holder = threading.get_ident()
        try:
            if bytes(ptrs) != self._held_ptrs:  # placed anew: new views
                self._held_params(ptrs)
            for e, p in self._held_cur:
                e.cur = p       # acquired; e.tensor keeps its placeholder
            for d, key, t, e in flat:
                d[key] = e.hparam
            # Bare, unless something else sits in the module's forward
            # (the root's own wrapper, when the root is a held unit).
            bared = self._bared
            for d, wrapped, bare, u in self._held_swaps:
                if d.get("forward") is wrapped:
                    d["forward"] = bare
                    bared.append(u)
        except BaseException:
            self.unhold()
            raise
        return True

    def _held_params(self, ptrs):
        """The Parameters hold() puts in the modules: one per held weight,
        over its VBAR address (made again when the weights move)."""
        lo, hi = ptrs[0], 0
        for e, p in zip(self._held_entries, ptrs):
            if e.rview is None or e.rview.data_ptr() != p:
                e.rview = self.resident_views.view(p, e.dtype, e.shape)
            if e.hparam is None or e.hparam.data_ptr() != p:
                e.hparam = torch.nn.Parameter(e.rview, requires_grad=False)
            lo, hi = min(lo, p), max(hi, p + e.size)
        self._held_span = (lo, hi)
        self._held_ptrs = bytes(ptrs)
        self._held_cur = list(zip(self._held_entries, list(ptrs)))

    def unhold(self):
        """The modules' own Parameters (placeholders) back, and the held
        weights released on the stream hold() took them on."""
        stream = self.holding
        if stream is None:
            return
        self.holding = self.holder = None
        for u in self._bared:
            d = u.module.__dict__
            if d.get("forward") is u.bare:
                d["forward"] = u.wrapped
        self._bared.clear()
        for d, key, t, e in self._held_slots:
            if d.get(key) is e.hparam:
                d[key] = t
        for e in self._held_entries:
            e.cur = 0
        self.held.release(stream)

    def lend_at(self, unit):
        """The forward's last unit that streams, whose prefetch goes on
        into a loan made at the next forward's start (ModelAccess)."""
        self.lend_unit = unit

    def give_back(self):
        """The loan this model's forward made of torch's cache, back."""
        self.lender.take_back_of(self)

    def run_held(self, unit, fwd, args, kwargs):
        """A held unit's call that is not bare (the root is the unit): the
        prefetch its acquire would run (its weights' window), then its
        forward (with the out-of-memory retry)."""
        unit.batch.prefetch()
        return self.escapes(unit, self.call(unit, fwd, args, kwargs))

    def call(self, unit, fwd, args, kwargs):
        """fwd(*args, **kwargs), run once more after an out-of-memory
        error once vpager's unpinned pages are evicted and torch's cache
        emptied; a second one is re-raised, saying so."""
        try:
            return fwd(*args, **kwargs)
        except Exception as e:
            if not is_oom(e):
                raise
            first = str(e)  # not e: its frames hold the activations
        return self.retry(unit, fwd, args, kwargs, first)

    def _make_room(self, margin=True):
        """After an out-of-memory error: vpager's unpinned pages evicted,
        torch's cache emptied, the learned headroom's margin raised (if
        `margin`); returns the bytes evicted."""
        self.lender.take_back()     # torch's blocks, if lent
        freed = self.device.free_memory(ALL)
        # The eviction lowered the watermarks: the next acquire puts the
        # model on top again, so its weights are filled, not only staged.
        self.ds.top = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if margin:                  # the learned headroom was too small
            self.ds.gov.raise_oom_margin()
        return freed

    def retry(self, unit, fwd, args, kwargs, first):
        """call()'s second attempt, after the out-of-memory error `first`
        (its message)."""
        freed = self._make_room()
        if self.target.type == "cuda":      # the margin, for this forward too
            self.learn()
        try:
            return fwd(*args, **kwargs)
        except Exception as e:
            if not is_oom(e):
                raise
            raise type(e)(
                "vpager.torch: out of device memory in %s (%s) even after "
                "vpager evicted %d bytes of unpinned weights and torch "
                "emptied its cache; lower offload()'s budget or the batch. "
                "First failure: %s. Second: %s"
                % (unit.name, type(unit.module).__name__, freed, first, e)
            ) from e

    # ------------------------------------------------ autograd aliasing
    @staticmethod
    def aliases(unit, t):
        """True if tensor t lies in memory of the unit's acquired weights."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return False
        p = t.data_ptr()
        for e in unit.entries:
            if e.cur and e.cur <= p < e.cur + e.size:
                return True
        return False

    def pack(self, unit, t):
        # Autograd saves t for backward, which runs after the release.
        return t.clone() if self.aliases(unit, t) else t

    def _aliases_held(self, _, t):
        """True if tensor t lies in memory of the held weights."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return False
        p = t.data_ptr()
        lo, hi = self._held_span
        return lo <= p < hi and any(self.aliases(u, t)
                                    for u in self.held_units)

    def escapes(self, unit, out):
        """out, with tensors that view the unit's weights replaced by
        copies."""
        return self._escape(out, self.aliases, unit)

    @staticmethod
    def _escape(out, aliases, unit):
        """out, with the tensors for which aliases(unit, t) replaced by
        copies (a tensor, or a tuple, list or dict of them)."""
        if isinstance(out, torch.Tensor):
            return out.clone() if aliases(unit, out) else out
        if isinstance(out, (tuple, list)) and any(aliases(unit, x)
                                                  for x in out):
            items = [x.clone() if aliases(unit, x) else x for x in out]
            if isinstance(out, list):
                return items
            return type(out)(*items) if hasattr(out, "_fields") \
                else tuple(items)
        if isinstance(out, dict) and any(aliases(unit, x)
                                         for x in out.values()):
            return type(out)((k, x.clone() if aliases(unit, x) else x)
                             for k, x in out.items())
        return out

    @staticmethod
    def writeback(unit):
        """In training mode modules update buffers in place (BatchNorm's
        running stats): copy them to the host copy, the weights' source,
        so a refill brings the new values."""
        with torch.no_grad():
            for owner, e in unit.buffers:
                if owner.training:
                    e.host.copy_(e.curv)

    # ------------------------------------------------ activations first
    def learn_hook(self, module, args):
        # Reading torch's statistics costs ~30 us: at most once every
        # LEARN_EVERY seconds, so short forwards do not pay it each time
        # (a bigger forward in between is what the OOM retry is for).
        if time.monotonic() - self.ds.gov.learned_at >= LEARN_EVERY or \
                self.peak_before_fills is not None:
            self.learn()

    def learn(self):
        """At the start of each root forward (CUDA only: the simulated
        device has no torch allocator to learn from): keep free what
        torch may still grab (devices.learn_headroom: the Governor). Two
        torch calls, and one vp call when the headroom changes, per root
        forward. Fills since the last learn: the peak their temporaries
        raised is not the activations' (devices.learn_headroom), unless
        a streamed weight's fill was among them: it runs again, its peak
        counts until a forward runs none. Not while the keeper is about
        to keep every such fill (KeptFills.will_keep), for KEEP_WAITS
        learns at most: fp8 Flux with a LoRA at half its bytes (H100)
        counted the 1 GB of patch math its streamed weights ran at their
        first fills, the plan shrank to no resident weight until the
        fills were kept and the watch saw the room back, a second later
        (its LoRA prompts 1.14-1.24 x L). While they are masked, the
        fills' temporaries may run past the budget for a few forwards:
        an out-of-memory error in one evicts vpager's pages, and their
        peak counts from then on (fill())."""
        ran, self.streamed_fills = self.streamed_fills, set()
        before = self.peak_before_fills
        if not ran:
            self.peak_before_fills, self.keep_waits = None, 0
        elif self.keep_waits < KEEP_WAITS and self.keeper is not None \
                and self.keeper.will_keep(ran):
            self.keep_waits += 1
        else:
            before = None
        if self._is_open():
            learn_headroom(self.device, self.index, force=True,
                           before=before)
