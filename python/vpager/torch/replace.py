"""Re-placement in execution order. vpager prefetches, and evicts, in VBAR
offset order, so the weights should lie there in the order the forward
uses them. offload() places them in module order; the module's first
complete forward records the order in which its units run, and if that
differs the weights are placed anew once, right after that forward (the
VBAR, its counters and the host copy stay; the weights are made again at
the new offsets with the same sources, so the next forward fills them).
A scheduled model's weights are placed by its schedule (tuner.py): for
it only the order of use changes here, nothing moves."""

from .placement import place
from .units import refuse_copy


def new_order(first, units, entries):
    """(units, entries) with those of the units in `first` first, in that
    order, then the others in their order so far."""
    order, seen = [], set()
    for u in list(first) + units:
        if u not in seen:
            seen.add(u)
            order.append(u)
    placed, done = [], set()
    for u in order:
        for e in u.entries:
            if e not in done:
                done.add(e)
                placed.append(e)
    placed += [e for e in entries if e not in done]
    return order, placed


class Recorder:
    """Records the order of the units in the module's first complete
    forward (the "record" slot of the root's RootHooks, emptied once it
    has re-placed), then re-places the layout's weights in that order.
    ready() says whether a forward that just ended may re-place
    (not inside acquired(), the handle still open); swap(entries, offsets,
    sources) re-creates the weights. rec is not None while a forward is
    being recorded: the units' wrappers call record() then. Recording
    starts at install(), so finish() can re-place by the order units ran
    in outside the module's forward (models whose root forward never
    runs); replaced counts the re-placements (0 or 1). keep_offsets: a
    schedule places the weights (tuner.py): only the order prefetch
    follows and the units' order change, the weights stay where they lie
    with their bytes (Layout.move)."""

    __reduce_ex__ = refuse_copy   # reached from the module's hooks

    def __init__(self, layout, ready, swap, hooks, keep_offsets=False):
        self.layout = layout
        self.ready = ready
        self.swap = swap
        self.root_hooks = hooks
        self.keep_offsets = keep_offsets
        self.rec = None
        self.seen = set()
        self.recording = False
        self.replaced = 0

    def install(self):
        self.root_hooks.set("record", pre=self._start, post=self._end)
        self.recording = True
        self.rec = []

    def finish(self):
        """Re-place now by the order recorded so far (if any unit ran and
        it differs from the placement); once. Returns True if it did."""
        rec = self.rec
        if not self.recording or not rec or not self.ready():
            return False
        self.remove()
        return self.replace(rec)

    def remove(self):
        if self.recording:
            self.root_hooks.clear("record")
            self.recording = False
        self.rec = None
        self.seen = set()

    def record(self, unit):
        if unit not in self.seen:
            self.seen.add(unit)
            self.rec.append(unit)

    def _start(self, module, args):
        self.rec = []
        self.seen = set()

    def _end(self, module, args, out):
        rec, self.rec = self.rec, None
        self.seen = set()
        if rec is None or not self.ready():
            return                  # the next forward records
        self.remove()
        self.replace(rec)

    def replace(self, first):
        lay = self.layout
        units, entries = new_order(first, lay.units, lay.entries)
        moved = [id(e) for e in entries] != [id(e) for e in lay.entries]
        if moved and self.keep_offsets:
            self.swap(entries, [e.offset for e in entries], None)
            self.replaced += 1
        elif moved:
            offsets, _ = place(entries, lay.align, lay.groups)
            self.swap(entries, offsets, [e.src for e in entries])
            self.replaced += 1
        lay.units = units
        return moved
