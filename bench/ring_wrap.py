"""What a staging ring whose slots wrap buys a settled plan, offline.

Reads a forward's units and measured work from a schedule trace
(VPAGER_SCHEDULE_LOG=1), plans it as the tuner does for each ring size
(schedule.plan_rings, one spare page) and simulates each plan's steady
forward, with a pause of G ms after its last unit (the sampler: the copy
engine runs on, the compute waits), on two rings:

* first fit: staging.c's ring before its pages were mapped twice (and
  still with VPAGER_STAGING_WRAP=0, on HIP, on Windows' simulated
  device): a slot that does not fit before the end starts at 0 and the
  tail goes unused until the slots before it are free. Planned at the
  first-fit share (schedule.FRAGMENTATION), as the plans were; simulated
  slot by slot where its clock hand puts each (first_fit_forward below), so
  the figure is what that ring does, not what its plan predicts.
* wraps: the ring's pages mapped twice, back to back: a slot runs on past
  the end into the start, the ring a plain FIFO of bytes. Planned and
  simulated at the whole ring (schedule.WRAPS).

Per pause it prints each ring size's step on both, then the step of the
ring each planner picks (schedule.pick_ring over the sizes given), and
their difference. With --rooms, per ring and per room (the trace's, moved
by each of the given MiB: another budget, another placement) the
first-fit plan's prediction, the step its slots give placed so, and the
wrapping ring's step (its prediction), no pause: how far the first-fit
ring's real placement strays from what its plan predicts. Needs no torch
and no GPU.

    python3 bench/ring_wrap.py bench/data/flux6_diag_node6_h100_s42c10.log \\
        --ring 448 378 352 320 288 256 --gaps 0 2.5 4
    python3 bench/ring_wrap.py bench/data/flux6_diag_node6_h100_s42c10.log \\
        --ring 320 --rooms -64 -32 0 32 64
"""
import os
import sys

from pause_replan import load_schedule, read_trace, trace_arguments

PER_COPY = 4e-6     # tuner.PER_COPY
SPARE_PAGES = 1     # tuner.SPARE_PAGES


def first_fit_forward(S, work, sizes, resident, link, ring, per_copy,
                      cycles=4):
    """schedule.simulate() with the slots placed as a first-fit ring that
    does not wrap places them: each at the end of the one before, or at 0
    where it does not fit before the ring's end (the tail left unused);
    its copy waits for the units of the slots it overwrites. Seconds per
    forward, the last of `cycles` back to back."""
    n = len(work)
    streamed = [(u, s) for (u, s), r in zip(S.flat(sizes), resident)
                if not r]
    m = len(streamed)
    if not m:
        return float(sum(work))
    slots = [S._round(s, S.SLOT_ALIGN) for _, s in streamed]
    cost = [S.copy_seconds(s, link, per_copy) for _, s in streamed]
    unit_of = [u for u, _ in streamed]
    first_of, last_of = {}, {}
    for k, u in enumerate(unit_of):
        first_of.setdefault(u, k)
        last_of[u] = k
    done = [None] * (cycles * n)
    ends = []           # per copy, in issue order: when it is done
    live = []           # (start, end, copy index) of the slots held
    state = {"engine": 0.0, "next": 0}

    def copy_upto(g_end, now):
        while len(ends) < g_end:
            g = len(ends)
            k = g % m
            at = state["next"]
            if at + slots[k] > ring:
                at = 0
            free_at = 0.0
            keep = []
            for a, b, o in live:
                if a < at + slots[k] and b > at:
                    d = done[(o // m) * n + unit_of[o % m]]
                    free_at = max(free_at, now if d is None else d)
                else:
                    keep.append((a, b, o))
            live[:] = keep
            start = max(state["engine"], free_at)
            state["engine"] = start + cost[k]
            ends.append(state["engine"])
            live.append((at, at + slots[k], g))
            state["next"] = at + slots[k]

    prev = start = 0.0
    for c in range(cycles):
        start = prev
        for u in range(n):
            ready = prev
            k = last_of.get(u)
            if k is not None:
                copy_upto(c * m + k + 1, prev)
                ready = max([ready] + ends[c * m + first_of[u]:c * m + k + 1])
            prev = done[c * n + u] = ready + work[u]
    return prev - start


def rooms(S, a, work, sizes, room, link, page, rings):
    """--rooms: per ring and room, the first-fit plan's prediction, its
    step on the first-fit ring, and the wrapping ring's step."""
    for ring in rings:
        print("  ring %d MiB, room +MiB: first fit predicted / ran | wraps "
              "ran" % (ring >> 20))
        cells, worst = [], 0.0
        for d in a.rooms:
            r = room + (d << 20)
            [(_, ff)] = S.plan_rings(work, sizes, r, [ring], page, link, 512,
                                     SPARE_PAGES, PER_COPY)
            ran = first_fit_forward(S, work, sizes, ff.resident, link, ring,
                                    PER_COPY)
            [(_, wr)] = S.plan_rings(work, sizes, r, [ring], page, link, 512,
                                     SPARE_PAGES, PER_COPY, share=S.WRAPS)
            worst = max(worst, ran - ff.predicted)
            cells.append("%+d: %.2f / %.2f | %.2f" % (
                d, ff.predicted * 1e3, ran * 1e3, wr.predicted * 1e3))
        print("    " + "  ".join(cells))
        print("    first fit ran at most %.2f ms over its prediction"
              % (worst * 1e3))
    return 0


def main(argv=None):
    ap = trace_arguments(__doc__, [448, 378, 352, 320, 288, 256],
                         [0.0, 2.5, 4.0])
    ap.add_argument("--rooms", type=int, nargs="+",
                    help="rooms to plan for, MiB from the trace's")
    a = ap.parse_args(argv)
    S = load_schedule()
    units, work, sizes, room, link = read_trace(a)
    page = a.page << 20
    rings = sorted({r << 20 for r in a.ring}, reverse=True)
    print("trace %s: %d units, %.2f ms of work; room %.3f GB, link %.1f "
          "GB/s" % (os.path.basename(a.trace), len(units), sum(work) * 1e3,
                    room / 1e9, link / 1e9))
    if a.rooms:
        return rooms(S, a, work, sizes, room, link, page, rings)
    cands = {share: S.plan_rings(work, sizes, room, rings, page, link, 512,
                                 SPARE_PAGES, PER_COPY, share=share)
             for share in (S.FRAGMENTATION, S.WRAPS)}
    picks = {share: S.pick_ring(c, link)[0] for share, c in cands.items()}
    for g in a.gaps:
        w = list(work)
        w[-1] += g / 1e3        # the pause after the last unit
        step = {}
        for share, cs in cands.items():
            for ring, sch in cs:
                if share == S.WRAPS:
                    t = S.simulate(w, sizes, sch.resident, link, ring,
                                   PER_COPY)
                else:
                    t = first_fit_forward(S, w, sizes, sch.resident, link,
                                          ring, PER_COPY)
                step[share, ring] = t
        print("  pause %.1f ms: %s" % (g, "  ".join(
            "%d MiB first fit %.2f / wraps %.2f ms" % (
                r >> 20, step[S.FRAGMENTATION, r] * 1e3,
                step[S.WRAPS, r] * 1e3) for r in rings)))
        ff, wr = picks[S.FRAGMENTATION], picks[S.WRAPS]
        a_ms = step[S.FRAGMENTATION, ff] * 1e3
        b_ms = step[S.WRAPS, wr] * 1e3
        print("    picked: first fit %d MiB %.2f ms, wraps %d MiB %.2f ms: "
              "%+.2f ms a step (%+.1f%%)" % (ff >> 20, a_ms, wr >> 20, b_ms,
                                            b_ms - a_ms,
                                            100 * (b_ms / a_ms - 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
