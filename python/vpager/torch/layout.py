"""An offloaded module's VBAR and what lies in it: the entries at their
offsets (placement.py), their sources (sources.py: a HostBuf of host
copies, or a safetensors file), the vpager weights made over them and one
WeightBatch per unit. Built all or nothing; re-created in place when the
weights move (re-placement) or change source (load_safetensors)."""

from .. import PAGE_RESIDENT, env
from ..errors import Error
from ..governor import NO_LIMIT, governor
from ..weights import WeightBatch
from .files import load_unmanaged, match_file
from .hostload import HostLoad
from .hostpolicy import FILE, IN_PLACE
from .placement import first_placement, groups
from .sources import release_host, sources
from .units import refuse_copy

ALL = 1 << 62           # "evict everything unpinned"
COPY_BEHIND = "VPAGER_COPY_BEHIND"      # =0: the host copy before offload()
#                                         returns (hostload.py)


class Layout:
    """vbar, weights (vpager.Weights), hb (the HostBuf, or the HostLoad
    that filled the copy behind offload(), or None), st (the
    SafeTensors file, or None), entries in VBAR order, units in placement
    order, align, groups (placement.groups(), None for tail-first)."""

    __reduce_ex__ = refuse_copy   # reached from the module's hooks

    def __init__(self, dev, units, entries, align):
        self.device = dev
        self.units = units
        self.entries = entries
        self.align = align
        self.groups = None
        self.vbar = self.weights = self.hb = self.st = None
        self.hbytes = None      # sources.HostBytes: in place, FILE fds
        self.loading = None     # HostLoad: the host copy filling behind
        self._filled = False    # its bytes all there (the windows open)
        self.load_times = {}    # seconds: host_alloc_s, host_fill_s
        self.fill_changes = 0   # weights given or rid of a fill (patches)
        self.placed = object()  # a new token whenever the weights move
        self.watermark = None   # bytes: a schedule's (on_top keeps it)

    @classmethod
    def build(cls, dev, plan):
        """The layout of a Plan (plan.py) on dev. On failure what was made
        is closed and the module's tensors keep their bytes."""
        lay = cls(dev, plan.units, plan.entries, plan.settings.align)
        try:
            lay._build(plan)
        except BaseException:
            release_host(plan.entries)
            lay.close()
            raise
        return lay

    def _build(self, plan):
        s, dev, entries = plan.settings, self.device, self.entries
        match = loads = None
        if s.weights_from is not None:
            self.st = dev.open_safetensors(s.weights_from)
            match, loads = match_file(plan.module, entries, self.st,
                                      "offload(weights_from=...)")
        self.groups = groups(dev, s.order, entries)
        offsets, size = first_placement(entries, self.align, self.groups,
                                        dev.page_size, s.scheduled)
        for e, off in zip(entries, offsets):
            e.offset = off
        self.vbar = dev.create_vbar(size)
        if s.order is not None:
            self.vbar.set_order(s.order)
        custom = None
        if s.sources is not None:       # offload(sources=): the caller's
            custom = []
            for e in entries:
                src = s.sources(e.name, e.tensor)
                if src is not None:
                    e.keep = e.tensor.data
                custom.append(src)
        # Behind offload() only when asked: on the H100 the copy behind
        # ran at 5.6 GiB/s against 7.5 made before, so offload and first
        # forward took 1.80 s against 1.61 (bench/RESULTS.md, twentieth
        # session); never with outside="host" (the tensors are the copy).
        hb, slots, self.hbytes = sources(
            dev, entries, self.align, self.st, match, custom,
            self.load_times, _streamed(plan, dev),
            type(plan.module).__name__,
            behind=s.outside != "host" and env.flag(COPY_BEHIND, False))
        if isinstance(hb, HostLoad):
            self.loading = hb
        else:
            self.hb = hb
        for e, (host, addr, src) in zip(entries, slots):
            e.host, e.file_addr, e.src = host, addr, src
        self.weights = self.vbar.create_weights(
            [e.offset for e in entries], [e.size for e in entries],
            [e.src for e in entries])
        if loads:
            load_unmanaged(self.st, loads, plan.fresh)
        self.batches()

    def weight(self, e):
        """The vpager weight of entry e."""
        return self.weights[e.index]

    def batches(self, units=None):
        dev, weight = self.device, self.weight
        units = self.units if units is None else units
        for u in units:
            u.batch = WeightBatch(dev, [weight(e) for e in u.entries])
        # New weights use the device's lookahead: the windows again.
        self.set_windows(units if self.copying else
                         [u for u in units if u.window is not None])

    def set_windows(self, units):
        """Each unit's weights prefetch its window (unit.window; None: the
        device's lookahead) after their acquire (vp_weight_set_lookahead):
        set when the windows or the weights change, never per forward,
        and the device's setting is left alone. While the host copy fills
        behind offload() every window is 0 (no weight is copied before its
        own unit waited for it) and unit.window waits for its end."""
        closed = self.copying
        self.weights.set_windows(
            (e.index, 0 if closed else u.window)
            for u in units if u is not None for e in u.entries)

    @property
    def copying(self):
        """Whether the host copy filling behind offload() lacks bytes."""
        return self.loading is not None and not self.loading.filled

    def _adopt_copy(self):
        """The host copy filling behind offload(), stopped (or its last
        page-locking waited for), becomes the layout's HostBuf."""
        lo, self.loading = self.loading, None
        if lo is not None:
            lo.cancel()
            self.hb = lo

    def wait_loaded(self, entries=None):
        """Until the host copy filling behind offload() holds the bytes of
        `entries` (None: all of them: any reader but a unit's acquire).
        Once every byte is there the windows open; once it is page-locked
        too it becomes the layout's HostBuf. RuntimeError if the copy
        failed. On the thread that runs the model's calls (its lock)."""
        lo = self.loading
        if lo is None:
            return
        lo.wait(entries)
        if lo.filled and not self._filled:
            self._filled = True
            self.set_windows(self.units)
        if lo.finished:         # it is the host copy now (its HostBufs)
            self.loading = None
            self.hb = lo
            self.load_times.update(host_fill_s=lo.fill_s,
                                   host_alloc_s=lo.lock_s)

    @property
    def host_bytes(self):
        """Bytes of the pinned host copy (filled or filling)."""
        if self.loading is not None:
            return self.loading.total
        return self.hb.size if self.hb is not None else 0

    def on_top(self):
        """The VBAR to the top of the device's priority list
        (vp_vbar_prioritize), its watermark lifted to the schedule's
        (self.watermark: the resident runs, so the streamed weights still
        miss at once, staged through the ring, and take no other model's
        pages) or, unscheduled, to the whole VBAR."""
        self.vbar.prioritize()
        if self.watermark is not None:
            self.vbar.set_watermark(self.watermark)

    def set_source(self, e, src):
        """Entry e's weight takes its bytes from `src` from now on
        (vp_weight_set_source): only e is filled anew, at its next acquire,
        and it keeps its place in the order prefetch follows. BusyError
        while e is acquired."""
        self.weights.set_source(e.index, src)
        e.src = src

    def resident_now(self):
        """A predicate: entry e's pages are all resident now (the VBAR's
        residency read once, here)."""
        flags = self.vbar.residency()
        page = self.device.page_size

        def resident(e):
            return e.size > 0 and all(
                flags[p] & PAGE_RESIDENT for p in range(
                    e.offset // page, (e.offset + e.size - 1) // page + 1))
        return resident

    def swap_source(self, e, src):
        """Entry e's weight takes the same bytes from `src` from now on
        (vp_weight_swap_source: src holds what its last acquire used, as
        its fill left them): nothing an acquire used is filled again.
        BusyError while e is acquired."""
        self.weights.swap_source(e.index, src)
        e.src = src

    def swap(self, entries, offsets, srcs, on_lost):
        """Re-create the weights: entries[i] at VBAR offset offsets[i] with
        source srcs[i]. The VBAR's pages are evicted first (eviction waits
        for the work that may still read them), so every weight is filled
        anew when next acquired. All or nothing: on failure the old
        weights are made again (or, if even that fails, on_lost() is
        called) and the error raised. srcs None: move() instead (nothing
        evicted, the weights left where they lie keep their bytes)."""
        if srcs is None:
            return self.move(entries, offsets)
        vb = self.vbar
        old = [(e, e.offset, e.src) for e in self.entries]
        vb.free_memory(ALL)
        self.weights.close()
        try:
            ws = vb.create_weights(offsets, [e.size for e in entries], srcs)
        except BaseException:
            try:
                self.weights = vb.create_weights(
                    [o for _, o, _ in old], [e.size for e, _, _ in old],
                    [s for _, _, s in old])
                self.batches()
            except BaseException:
                on_lost()
            raise
        for i, e in enumerate(entries):
            e.index, e.offset, e.src = i, offsets[i], srcs[i]
            e.rview = e.hparam = None
        self.entries = entries
        self.weights = ws
        self.placed = object()
        self.batches()

    def move(self, entries, offsets):
        """Place the weights anew without making them again
        (vp_weights_move): entries (all of them, in the order prefetch is
        to follow) at offsets[i]. A weight left where it lies keeps its
        bytes if its pages are resident; a moved one is filled at its next
        acquire. Pages are neither committed nor evicted here; the
        weights, their batches and windows stay. All or nothing."""
        self.weights.move([e.index for e in entries], offsets)
        for e, off in zip(entries, offsets):
            if e.offset != off:
                e.offset = off
                e.rview = e.hparam = None
        self.entries = entries
        self.placed = object()

    def reload(self, module, path, swap):
        """The weights' sources become the safetensors file at `path`
        (load_safetensors()), swap(entries, offsets, sources) re-creating
        them; ValueError, nothing changed, if the file does not match the
        module."""
        self.wait_loaded()
        self._adopt_copy()      # (closed with the old sources below)
        dev, entries = self.device, self.entries
        st = dev.open_safetensors(path)
        hb = hbytes = None
        try:
            match, loads = match_file(module, entries, st, "load_safetensors")
            hb, slots, hbytes = sources(dev, entries, self.align, st, match,
                                        model=type(module).__name__)
            swap(list(entries), [e.offset for e in entries],
                 [src for _, _, src in slots])
        except BaseException:
            _close_quietly((hb, st, hbytes))
            raise
        for e, (host, addr, src) in zip(self.entries, slots):
            e.host, e.file_addr = host, addr
        old = (self.hb, self.st, self.hbytes)
        self.hb, self.st, self.hbytes = hb, st, hbytes
        load_unmanaged(st, loads)
        for obj in old:
            if obj is not None:
                obj.close()

    def describe(self):
        """[(weight name, VBAR offset, bytes, "host", "file" (a file's
        bytes, in place or read: hostpolicy) or "source": a source of the
        caller's, offload(sources=))]."""
        kinds = self.hbytes.kinds if self.hbytes is not None else {}
        return [(e.name, e.offset, e.size,
                 "host" if e.host is not None else
                 "file" if e.file_addr is not None or e.keep is None
                 or kinds.get(e) in (IN_PLACE, FILE) else "source")
                for e in self.entries]

    def close(self):
        """Close the VBAR (its weights with it), the HostBuf and the file;
        returns the errors met (each object is closed regardless)."""
        errors = []
        self._adopt_copy()      # the copier stopped, then closed
        for obj in (self.vbar, self.hb, self.st):
            if obj is None:
                continue
            try:
                obj.close()
            except Error as e:
                errors.append(e)
        if self.hbytes is not None:     # after the weights reading them
            errors += self.hbytes.close()
        return errors


def _close_quietly(objs):
    for obj in objs:
        if obj is not None:
            try:
                obj.close()
            except Error:
                pass


def _streamed(plan, dev):
    """Bytes a step streams, as offload() can tell before any forward: the
    weights past the budget (offload(budget=), else the device's limit
    from its Governor; 0: none known, or they fit)."""
    budget = plan.settings.budget
    if not budget:
        limit = governor(dev).limit
        budget = limit if 0 < limit < NO_LIMIT else 0
    total = sum(e.size for e in plan.entries)
    return max(total - budget, 0) if budget else 0
