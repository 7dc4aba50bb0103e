"""How much of torch's CUDA cache no allocation touches across the pause
between two forwards: the memory a loan to the staging ring could hold
without torch growing (vpager.torch.lend; every loan of torch's largest
free blocks so far made torch reserve more, bench/RESULTS.md, forty-
fourth to forty-eighth sessions).

bench/comfyui_run.py, with VPAGER_BENCH_IDLE_CACHE=N, records torch's
allocation history from step N's start to the end of step N+1 and marks
three moments with an allocation of its own of a size nothing else asks
for: "tail" (the last single block's call in forward N: about where the
Lender lends, before the last streamed unit's acquire), "end" (forward
N returned) and "head" (the second double block's call in forward N+1:
the forward's first streamed weights used, where a loan comes back).
For the windows tail..head and end..head it prints, as TAG + JSON, the
bytes of torch's large segments that no block alive in the window
covers, and the largest such ranges (sizes and addresses: with
VPAGER_LEND=1 a loan made at the forward's end is alive in both
windows, and the Lender's log names its blocks' addresses).

    python3 bench/idle_cache.py LOG     # the TAG lines of a log
"""
import sys

TAG = "COMFYUI_IDLE_CACHE "
GRAIN = 512
# Marker sizes (bytes): 512-byte multiples no model asks for, small
# enough for torch's small pool (the large segments stay as they are).
MARKS = {"tail": 1031 * GRAIN, "end": 1033 * GRAIN, "head": 1039 * GRAIN}
TOP = 8
MIN_RANGE = 8 << 20         # lend.MIN_PIECE: smaller ranges are no loan


def _union(ranges):
    """[(lo, hi)] merged, sorted."""
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def _minus(whole, used):
    """The parts of range `whole` outside the sorted merged `used`."""
    lo, hi = whole
    out, at = [], lo
    for a, b in used:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def idle(segments, live_at_start, trace, first, last):
    """Idle ranges of the large segments in the window trace[first..last]:
    segments [(address, size)], live_at_start [(address, size)] (blocks
    allocated when the trace began), trace the history's events (dicts
    with action, addr, size). A block counts as in use from its "alloc"
    to its "free_completed"; the window's used ranges are those in use
    at its start and every block allocated inside it."""
    live = {a: s for a, s in live_at_start}
    for ev in trace[:first]:
        act = ev.get("action")
        if act == "alloc":
            live[ev["addr"]] = ev["size"]
        elif act == "free_completed":
            live.pop(ev["addr"], None)
    used = [(a, a + s) for a, s in live.items()]
    for ev in trace[first:last + 1]:
        if ev.get("action") == "alloc":
            used.append((ev["addr"], ev["addr"] + ev["size"]))
    used = _union(used)
    out = []
    for a, s in segments:
        out.extend(_minus((a, a + s), used))
    return sorted(out, key=lambda r: r[0] - r[1])


def marks(trace):
    """{name: index of its marker's alloc} for MARKS found in trace."""
    by_size = {v: k for k, v in MARKS.items()}
    out = {}
    for i, ev in enumerate(trace):
        if ev.get("action") == "alloc" and ev.get("size") in by_size:
            out.setdefault(by_size[ev["size"]], i)
    return out


def summarize(snap, live_at_start):
    """The TAG line's dict from torch.cuda.memory._snapshot() taken at the
    window's end and the blocks live when the history began."""
    segs = [(s["address"], s["total_size"])
            for s in snap.get("segments") or ()
            if s.get("segment_type") == "large"]
    traces = [t for t in snap.get("device_traces") or () if t]
    if not traces:
        return {"error": "no allocation history recorded"}
    trace = traces[0]
    at = marks(trace)
    out = {"large_segments_mb": round(sum(s for _, s in segs) / 1e6, 1),
           "events": len(trace), "marks": sorted(at)}
    for start in ("tail", "end"):
        if start not in at or "head" not in at or at[start] > at["head"]:
            continue
        rs = idle(segs, live_at_start, trace, at[start], at["head"])
        big = [r for r in rs if r[1] - r[0] >= MIN_RANGE]
        out[start + "_to_head"] = {
            "idle_mb": round(sum(b - a for a, b in rs) / 1e6, 1),
            "idle_in_ranges_of_8mib_mb": round(
                sum(b - a for a, b in big) / 1e6, 1),
            "largest_mb": [round((b - a) / 1e6, 1) for a, b in rs[:TOP]],
            "largest_at": ["0x%x" % a for a, _ in rs[:TOP]]}
    return out


def live_blocks(snapshot_segments):
    """[(address, size)] of the blocks allocated in torch.cuda.memory_
    snapshot()'s segments."""
    out = []
    for seg in snapshot_segments:
        for b in seg.get("blocks") or ():
            if b.get("state") != "inactive":
                out.append((b["address"], b["size"]))
    return out


class IdleCache:
    """The allocation history over steps `step` and `step` + 1 of each
    prompt (step_done() is told when each step ends), the marks made by
    hooks on Flux's blocks; summary holds summarize()'s dict."""

    def __init__(self, diffusion_model, step):
        import torch
        self.torch, self.step = torch, step
        self.on, self.summary = False, None
        self.now = 1                # the step running, 1-based
        self.live = []
        self.hooks = []
        doubles = getattr(diffusion_model, "double_blocks", None)
        singles = getattr(diffusion_model, "single_blocks", None)
        if not doubles or len(doubles) < 2 or not singles:
            self.summary = {"error": "not a Flux model: no blocks to mark"}
            return
        self.hooks = [
            singles[-1].register_forward_pre_hook(
                lambda m, a: self._mark("tail", self.step)),
            diffusion_model.register_forward_hook(
                lambda m, a, o: self._mark("end", self.step)),
            doubles[1].register_forward_pre_hook(
                lambda m, a: self._mark("head", self.step + 1))]
        if step == 1:
            self._start()

    def _mark(self, name, at):
        if self.on and self.now == at:
            self.torch.empty(MARKS[name], dtype=self.torch.uint8,
                             device="cuda")

    def _start(self):
        mem = self.torch.cuda.memory
        try:
            self.live = live_blocks(self.torch.cuda.memory_snapshot())
            try:                    # no stacks: the step's own pace
                mem._record_memory_history(max_entries=400000,
                                           context=None)
            except (TypeError, ValueError):
                mem._record_memory_history(max_entries=400000)
        except Exception as e:      # the run goes on without it
            self.summary = {"error": "no history recorded: %s" % e}
            return
        self.on = True

    def step_done(self, step):
        """`step` (0-based, as ComfyUI's callback counts) has ended."""
        self.now = step + 2             # the next step, 1-based
        if self.on and step == self.step:     # step N + 1 ended
            try:
                snap = self.torch.cuda.memory._snapshot()
                self.summary = summarize(snap, self.live)
            except Exception as e:      # a diagnostic must not end the run
                self.summary = {"error": "no summary: %s" % e}
            self.remove()
        elif not self.on and self.summary is None and \
                step + 2 == self.step:
            self._start()

    def remove(self):
        if self.on:
            self.torch.cuda.memory._record_memory_history(enabled=None)
            self.on = False
        for h in self.hooks:
            h.remove()
        self.hooks = []


def main(argv):
    for path in argv:
        with open(path) as f:
            for line in f:
                if TAG in line:
                    print(path, line.split(TAG, 1)[1].rstrip())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) or 0)
