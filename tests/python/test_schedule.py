"""vpager.torch.schedule: the scheduler's decisions from given costs (no
device, no torch needed to decide; the module is imported on its own).

    PYTHONPATH=python python3 tests/python/test_schedule.py"""

import importlib.util
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _runner import main  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_PATH = os.path.join(_HERE, "..", "..", "python", "vpager", "torch",
                     "schedule.py")
_REPO = os.path.join(_HERE, "..", "..")
_spec = importlib.util.spec_from_file_location("vp_schedule", _PATH)
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)     # pure: no vpager library, no torch

MB = 10 ** 6
MS = 1e-3
PAGE = 2 << 20
LINK = 50e9                     # 50 GB/s: 100 MB in 2 ms


def flags(sch):
    return ["R" if r else "s" for r in sch.resident]


def test_all_fits_all_resident():
    work = [1 * MS] * 4
    sizes = [[10 * MB]] * 4
    sch = S.plan(work, sizes, room=1 << 30, page=PAGE, link=LINK,
                 ring=64 << 20)
    assert all(sch.resident) and sch.streamed == 0
    assert sch.window == [0, 0, 0, 0]
    assert abs(sch.predicted - 4 * MS) < 1e-12


def test_ring_sizes_keep_link_time():
    # small units: 1-3 x need would be a few MiB, too little to absorb
    # the host's jitter; the floor is 2 ms of link (100 MB at 50 GB/s)
    rings = S.ring_sizes(2 << 20, 384 << 20, LINK)
    assert rings == [384 << 20, int(S.RING_SECONDS * LINK)]
    # big units: the floor is below need and changes nothing; each of
    # 1-3 x need comes also with the room first-fit slots leave, in pages
    need = 200 * MB
    up = [-(-int(k * need / S.FRAGMENTATION + 1) // PAGE) * PAGE
          for k in (3, 2, 1)]
    assert S.ring_sizes(need, 1 << 30, LINK, PAGE) == [
        1 << 30, up[0], 3 * need, up[1], 2 * need, up[2], need]
    # a current ring at or below the floor is the only choice
    assert S.ring_sizes(2 << 20, 64 << 20, LINK) == [64 << 20]
    assert S.ring_sizes(2 << 20, 384 << 20, None)[-1] == 2 << 20


def test_ring_for_two_slots_double_buffers():
    # Copy-bound: each 100 MB weight copies 2 ms under its predecessor's
    # 1 ms. A ring of 2 x need holds one slot after fragmentation, so each
    # copy waits for the unit before it; the next ring size tried holds two
    # and keeps the copy engine busy.
    need = 100 * MB
    work, sizes = [1 * MS] * 4, [[need]] * 4
    res = [False] * 4
    rings = S.ring_sizes(need, 1 << 30, LINK, PAGE)
    two = [r for r in rings if 2 * need < r < 3 * need][0]

    def plan(r):
        return S.plan(work, sizes, 0, PAGE, LINK, r).predicted
    assert abs(plan(two) - 4 * 2 * MS) < 1e-6, plan(two)
    assert plan(2 * need) > 4 * 2.5 * MS, plan(2 * need)
    assert S.plan(work, sizes, 0, PAGE, LINK, two).resident == res


def test_a_ring_that_wraps_counts_whole():
    # Its pages mapped twice, a ring's slots wrap past its end: all of it
    # holds slots (share WRAPS), so 2 x need double-buffers, the sizes
    # tried need no first-fit room, and the same plan is no slower.
    need = 100 * MB
    assert S.usable(300 * MB) == int(300 * MB * S.FRAGMENTATION)
    assert S.usable(300 * MB, S.WRAPS) == 300 * MB
    up = [-(-k * need // PAGE) * PAGE for k in (3, 2, 1)]
    assert S.ring_sizes(need, 1 << 30, LINK, PAGE, S.WRAPS) == [
        1 << 30, up[0], 3 * need, up[1], 2 * need, up[2], need]
    work, sizes = [1 * MS] * 4, [[need]] * 4

    def plan(share):
        return S.plan(work, sizes, 0, PAGE, LINK, 2 * need,
                      share=share).predicted
    assert abs(plan(S.WRAPS) - 4 * 2 * MS) < 1e-6, plan(S.WRAPS)
    assert plan(S.FRAGMENTATION) > 4 * 2.5 * MS
    only_ring = up[1]           # a budget with no room beside the ring
    got = S.plan_job(work, [work], sizes, only_ring, [2 * need], PAGE, LINK,
                     512, 0, 0.0, 0.0, None, None, share=S.WRAPS)
    ring, fields = got["cands"][0]
    assert ring == 2 * need and fields[2] == plan(S.WRAPS)


def test_simulate_by_hand():
    # Unit 0 computes 3 ms with its weight resident; unit 1's 100 MB weight
    # (2 ms of copy) streams under it: nothing waits, 4 ms a forward.
    work, sizes = [3 * MS, 1 * MS], [[10 * MB], [100 * MB]]
    t = S.simulate(work, sizes, [True, False], LINK, ring=256 << 20)
    assert abs(t - 4 * MS) < 1e-9, t
    # Two streamed 100 MB weights after 1 ms of compute: the copies take
    # 4 ms a forward: copy-bound.
    work, sizes = [1 * MS, 0.1 * MS, 0.1 * MS], [[MB], [100 * MB],
                                                  [100 * MB]]
    t = S.simulate(work, sizes, [True, False, False], LINK, ring=256 << 20)
    assert abs(t - 4 * MS) < 2e-5, t
    # A ring of one weight: the second copy waits for unit 1 to finish.
    t1, starts, cstarts, streamed = S.simulate(
        work, sizes, [True, False, False], LINK, ring=101 * MB, detail=True)
    assert t1 > t and len(cstarts) == 2
    assert cstarts[1] >= starts[1] + work[1] - 1e-12


def _dit(blocks):
    """A DiT-like forward: per block a modulation linear (100 MB, ~no
    compute: a 1 x d input), then a linear computing 2 ms (100 MB)."""
    work, sizes, kinds = [], [], []
    for _ in range(blocks):
        work += [0.01 * MS, 2 * MS]
        sizes += [[100 * MB], [100 * MB]]
        kinds += ["mod", "heavy"]
    return work, sizes, kinds


def test_stream_what_compute_hides():
    # Room for half the weights: a copy hides only under the compute
    # before it, so the modulation weights (each after a heavy linear)
    # stream and the heavy ones (each after a modulation) stay resident;
    # the first modulation follows the forward's start (the copies of the
    # next forward start under the last heavy units): it may stay, and a
    # last heavy one stream in its place.
    work, sizes, kinds = _dit(8)
    total = sum(s for ss in sizes for s in ss)
    ring = 150 * MB              # one weight in flight at a time
    sch = S.plan(work, sizes, room=total // 2 + 4 * PAGE, page=PAGE,
                 link=LINK, ring=ring)
    streamed = [k for k, r in zip(kinds, sch.resident) if not r]
    assert streamed.count("mod") >= 7, flags(sch)
    assert all(sch.resident[i] for i in range(1, 14, 2)), flags(sch)
    assert sch.resident_bytes <= total // 2 + 4 * PAGE
    # Every copy hides: the forward takes its compute.
    assert sch.predicted <= sch.all_resident * 1.01, sch
    # Streaming the other half (every heavy one, each after a modulation
    # that hides nothing) makes each heavy unit wait for its copy.
    by_bytes = [i % 2 == 0 for i in range(len(kinds))]
    t = S.simulate(work, sizes, by_bytes, LINK, int(ring * 0.9))
    assert t > sch.predicted * 1.2, (t, sch.predicted)


def test_kept_weights_stay_resident_if_a_plan_fits():
    # Weights with a fill (a patch computed at every fill) are kept
    # resident: of the modulation weights the plan above streams, the
    # first three are kept and others stream in their place, within the
    # same room. Kept weights that cannot all be resident: as many of
    # them as fit, first in order.
    work, sizes, kinds = _dit(8)
    total = sum(s for ss in sizes for s in ss)
    room, ring = total // 2 + 4 * PAGE, 150 * MB
    free = S.plan(work, sizes, room, PAGE, LINK, ring)
    mods = [i for i, r in enumerate(free.resident) if not r][:3]
    keep = [i in mods for i in range(len(kinds))]
    sch = S.plan(work, sizes, room, PAGE, LINK, ring, keep=keep)
    assert all(sch.resident[i] for i in mods), flags(sch)
    assert sch.resident_bytes <= room
    assert sch.streamed >= free.streamed
    # Every modulation weight and two heavy ones: 1000 MB for 800 MB.
    heavy = [i for i, k in enumerate(kinds) if k == "heavy"][:2]
    keep = [k == "mod" or i in heavy for i, k in enumerate(kinds)]
    some = S.plan(work, sizes, room, PAGE, LINK, ring, keep=keep)
    assert some.resident_bytes <= room
    held = sum(r for r, k in zip(some.resident, keep) if k)
    was = sum(r for r, k in zip(free.resident, keep) if k)
    assert 7 <= held < sum(keep) and held > was, (held, was, flags(some))


def test_kept_beyond_the_room_planned_once():
    """Kept weights beyond the room: how many fit is found from picks
    alone (_fits_at_most), then one full plan is made (fp8 Flux's LoRA
    change: 6 full plans, 139 ms on the H100's host), and the answer is
    the one a bisection over full plans gives."""
    import random
    rng = random.Random(5)
    for trial in range(6):
        work, sizes, kinds = _dit(6 + trial)
        total = sum(s for ss in sizes for s in ss)
        room, ring = total // (2 + trial % 3) + 4 * PAGE, 150 * MB
        keep = [k != "tiny" and rng.random() < 0.6 for k in kinds]
        n = len(keep)
        least = max(s for ss in sizes for s in ss) // S.TINY
        kept = [i for i, k in enumerate(keep) if k]

        def first(k):
            return [i in kept[:k] for i in range(n)]

        def full(k):
            return S._best(work, sizes, room, PAGE, LINK, ring, 0.0, 512,
                           least, first(k))
        # The reference: a bisection over full plans.
        want = full(len(kept))
        if want is None:
            lo, hi = 0, len(kept)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                got = full(mid)
                if got is None:
                    hi = mid
                else:
                    lo, want = mid, got
        if want is None:
            want = S._best(work, sizes, room, PAGE, LINK, ring, 0.0, 512,
                           least)
        calls = []
        best = S._best
        S._best = lambda *a, **k: (calls.append(1), best(*a, **k))[1]
        try:
            got = S.choose(work, sizes, room, PAGE, LINK, ring, keep=keep)
        finally:
            S._best = best
        assert got == want, (trial, flags_of(got), flags_of(want))
        assert len(calls) <= 2, (trial, len(calls))


def flags_of(res):
    return "".join("R" if r else "s" for r in res)


def test_tiny_weights_stay_resident():
    # Each heavy unit carries a bias and a norm of a few KB beside its
    # 100 MB weight: streaming those would free nothing and cost a copy
    # each; only the big weights stream.
    work, sizes, _ = _dit(8)
    sizes = [ss + [12 * 1024, 256] for ss in sizes]
    total = sum(s for ss in sizes for s in ss)
    sch = S.plan(work, sizes, room=total // 2, page=PAGE, link=LINK,
                 ring=250 * MB)
    sz = [s for ss in sizes for s in ss]
    assert sch.streamed > 0
    assert all(r for s, r in zip(sz, sch.resident) if s < MB), flags(sch)


def test_window_in_time_not_bytes():
    # A 10 ms unit, then four streamed 10 MB weights computing nothing:
    # all four copies must start under the long unit, so the window at
    # its acquire (and the one before) covers the four, 40 MB; after
    # that the copies are ahead and each window is the rest.
    link = 10e9                 # 10 MB: 1 ms
    work = [0.1 * MS, 10 * MS] + [0.01 * MS] * 4
    sizes = [[MB], [MB]] + [[10 * MB]] * 4
    res = [True, True, False, False, False, False]
    win = S.windows(work, sizes, res, link, ring=64 << 20)
    assert win[0] == 40 * MB, win          # before the long unit
    assert win[1] == 40 * MB, win
    # Byte-counted lookahead of 10 MB would have started one copy only:
    t = S.simulate(work, sizes, res, link, ring=64 << 20)
    assert abs(t - sum(work)) < 1e-6        # predicted: no unit waits
    # The same four weights after a unit computing 0.1 ms: nothing hides
    # them, the window still starts them all as early as possible.
    work2 = [0.1 * MS, 0.1 * MS] + [0.01 * MS] * 4
    win2 = S.windows(work2, sizes, res, link, ring=64 << 20)
    assert win2[1] >= 10 * MB


def test_the_last_acquires_fill_the_ring_with_the_next_forward():
    # From the unit of the forward's last streamed weight on, the next
    # acquire is the next forward's first, after the host's time between
    # forwards: those acquires prefetch what the ring holds of the next
    # forward's first weights, however early their copies would start.
    link = 10e9
    work = [1 * MS] * 6
    sizes = [[10 * MB]] * 6
    res = [True, False, False, True, False, True]
    for ring in (25 * MB, 35 * MB):
        win = S.windows(work, sizes, res, link, ring=ring)
        fits = (ring // (10 * MB)) * 10 * MB
        assert win[4] == win[5] == fits, (ring, win)
    # The ring holds the whole streamed set: the acquires take it all.
    assert S.windows(work, sizes, res, link, ring=64 * MB)[5] == 30 * MB
    # A ring smaller than the next forward's first weight: their windows
    # stay as the timing gives them (at least that weight).
    assert S.windows(work, sizes, res, link, ring=5 * MB)[5] >= 10 * MB


def test_pick_ring_prefers_fewer_bytes_among_ties():
    """Rings whose plans predict within RING_TIE of the fastest are as
    fast: the one copying the fewest bytes is used (the node's Flux 4 GiB
    candidates of an H200 run), then the larger ring; a plan predicted
    clearly faster wins whatever it copies."""
    def cand(ring_mib, ms, gb):
        return (ring_mib << 20, S.Schedule([], [], ms * MS, int(gb * 1e9),
                                           0, 0.0))
    h200 = [cand(512, 138.965, 7.40), cand(448, 138.953, 7.32),
            cand(378, 139.281, 7.26), cand(288, 143.696, 7.19)]
    assert S.pick_ring(h200, 55e9) is h200[2]
    assert S.pick_ring([cand(512, 100.0, 5.0), cand(448, 100.5, 5.0)], 55e9) \
        [0] == 512 << 20
    fast = [cand(512, 95.0, 5.3), cand(252, 100.0, 5.0)]
    assert S.pick_ring(fast, 55e9) is fast[0]
    assert S.pick_ring(fast[1:], 55e9) is fast[1]


def test_pick_ring_takes_the_deepest_ring_when_copies_hide():
    """Among rings as fast whose plans hide every copy under a compute
    that keeps the link BUSY, the largest is used whatever it copies (the
    node's fp8 Flux at half its bytes, an H100 run's candidates); one
    whose copies show is not counted as hidden, and copies that leave the
    link mostly idle take the fewest bytes (SDXL's host-bound steps)."""
    LINK = 55.1e9
    def cand(ring_mib, ms, gb, all_ms):
        return (ring_mib << 20, S.Schedule([], [], ms * MS, int(gb * 1e9),
                                           0, all_ms * MS))
    h100 = [cand(512, 94.602, 4.147, 94.602), cand(224, 94.602, 3.848, 94.602),
            cand(189, 96.499, 3.820, 94.602), cand(160, 96.129, 3.782, 94.602)]
    assert S.pick_ring(h100, LINK) is h100[0]
    assert S.pick_ring(h100[1:], LINK) is h100[1]
    # The largest ring's copies show (0.5% over its work): the fewest
    # bytes among the tie, as when none hides.
    shows = [cand(512, 95.1, 4.147, 94.602), cand(224, 95.0, 3.848, 94.602)]
    assert S.pick_ring(shows, LINK) is shows[1]
    # One hidden plan in the tie is taken over a larger ring that shows.
    mixed = [cand(512, 95.2, 4.147, 94.602), cand(224, 94.602, 3.848, 94.602)]
    assert S.pick_ring(mixed, LINK) is mixed[1]
    # The same plans with copies of under half the compute (a link four
    # times as fast): the fewest bytes.
    assert S.pick_ring(h100, 4 * LINK) is h100[1]


def test_pick_ring_from_the_cold_estimate_takes_the_deepest_hidden_ring():
    """A plan from the cold forward's estimated work (an overstatement:
    the link looks idler than it is) counts its link busy at COLD_OVER
    times less: the largest ring whose plan hides its copies; one whose
    copies show still does not count, and a link idle even so takes the
    fewest bytes. The candidates: the node's GGUF Q8_0 Flux on an H100,
    its cold plan (204 ms estimated for a 113 ms step)."""
    LINK = 55.15e9

    def cand(ring_mib, ms, gb, all_ms):
        return (ring_mib << 20, S.Schedule([], [], ms * MS, int(gb * 1e9),
                                           0, all_ms * MS))
    cold = [cand(512, 204.114, 4.366, 204.114),
            cand(224, 204.114, 4.068, 204.114),
            cand(160, 204.114, 4.027, 204.114),
            cand(134, 204.240, 3.990, 204.114)]
    assert S.pick_ring(cold, LINK) is cold[3]       # the fewest bytes
    assert S.pick_ring(cold, LINK, estimated=True) is cold[0]
    shows = [cand(512, 205.0, 4.366, 204.114)] + cold[1:]
    assert S.pick_ring(shows, LINK, estimated=True) is shows[1]
    # A link four times as fast: 9% busy by the estimate.
    assert S.pick_ring(cold, 4 * LINK, estimated=True) is cold[3]
    # schedule.plan_job picks the same (the planner's process).
    work = [2 * MS] * 4
    sizes = [[64 * MB]] * 4
    out = S.plan_job(work, [work], sizes, 200 * MB, [128 << 20, 64 << 20],
                     PAGE, LINK, 512, 0, 0, 0, None, None, estimated=True)
    cands = out["cands"]
    i = out["pick"][0]
    assert i == 0 or not cands[0][1][2] <= cands[0][1][5] * 1.001, cands


def test_ring_bounds_a_unit():
    # A unit whose weights do not fit in the ring stays resident: under
    # the schedule it would have to stage whole.
    work = [2 * MS, 2 * MS, 2 * MS]
    sizes = [[10 * MB], [300 * MB], [10 * MB]]
    total = sum(s for ss in sizes for s in ss)
    sch = S.plan(work, sizes, room=total - 15 * MB, page=PAGE, link=LINK,
                 ring=256 << 20)
    assert sch.resident[1], flags(sch)


def test_resident_pages_counted():
    # Resident pages: the resident weights lie together, whole pages of
    # their sum (placement.place_resident_first), however they interleave
    # with streamed ones.
    sizes = [[PAGE // 2], [PAGE // 2], [PAGE // 2]]
    assert S.resident_pages(sizes, [True, True, True], PAGE) == PAGE * 2
    assert S.resident_pages(sizes, [True, False, True], PAGE) == PAGE
    assert S.resident_pages(sizes, [True, True, False], PAGE) == PAGE



def test_guess_spreads_the_streamed_bytes_evenly():
    # Before any forward (no compute measured): the fewest streamed bytes
    # whose resident pages fit, spread evenly over the weights' bytes;
    # tiny weights resident; all resident when all fit.
    sizes = [[10 * MB, 1000]] * 20
    room = 100 * MB
    res = S.guess(sizes, room, PAGE, 64 << 20)
    assert S.resident_pages(sizes, res, PAGE) <= room
    assert all(res[1::2])                               # the tiny ones
    big = res[0::2]
    assert 9 <= big.count(False) <= 11, flags_of(big)
    assert all(not all(big[i:i + 3]) for i in range(0, 18)), flags_of(big)
    assert S.guess(sizes, 1 << 30, PAGE, 64 << 20) == [True] * 40


def test_nearest_moves_few_weights():
    # A plan made again: the resident set nearest the old one that fits,
    # kept weights (a LoRA's fills) resident, the best plan's streamed
    # weights dropped first (largest first), or its resident ones added
    # while there is room; None when the kept ones alone do not fit.
    sizes = [[4 * PAGE]] * 10
    old = [True] * 5 + [False] * 5
    best = [False, True, True, True, True, True, False, False, False, False]
    keep = [False] * 9 + [True]
    room = 5 * 4 * PAGE + PAGE
    near = S.nearest(old, best, sizes, room, PAGE, keep=keep)
    assert near[9] and not near[0], flags_of(near)          # kept; dropped
    assert near[1:5] == [True] * 4 and sum(near) == 5, flags_of(near)
    # More room: the best plan's resident weights join, no others.
    near = S.nearest(old, best, sizes, room + 8 * PAGE, PAGE, keep=keep)
    assert near[:6] == [True] * 6 and sum(near) == 7, flags_of(near)
    assert S.resident_pages(sizes, near, PAGE) <= room + 8 * PAGE
    # Less room: dropped down to what fits, the kept weight stays.
    near = S.nearest(old, best, sizes, 2 * 4 * PAGE + PAGE, PAGE, keep=keep)
    assert near[9] and sum(near) == 2, flags_of(near)
    assert S.nearest(old, best, sizes, 2 * PAGE, PAGE, keep=keep) is None


def flags_of(res):
    return "".join("R" if r else "s" for r in res)


def test_decisions_are_stable():
    # The same costs give the same schedule (the order stays across
    # forwards: it is decided once, and deterministically).
    work, sizes, _ = _dit(6)
    total = sum(s for ss in sizes for s in ss)
    a = S.plan(work, sizes, total // 3, PAGE, LINK, 256 << 20)
    b = S.plan(list(work), [list(s) for s in sizes], total // 3, PAGE, LINK,
               256 << 20)
    assert a.resident == b.resident and a.window == b.window
    assert a.resident_bytes <= total // 3


def test_copy_bound_streams_the_minimum():
    # Little compute (decode-like): every byte streamed costs link time;
    # the schedule streams no more than the room forces.
    work = [0.05 * MS] * 32
    sizes = [[50 * MB]] * 32
    total = 32 * 50 * MB
    room = total // 2
    sch = S.plan(work, sizes, room, PAGE, LINK, 128 << 20)
    assert sch.resident_bytes <= room
    assert sch.streamed <= total - room + 50 * MB + PAGE, sch
    assert sch.predicted <= (sch.streamed / LINK) * 1.05 + sum(work), sch



def _blocks():
    """Flux's single blocks in miniature: modulation (little compute),
    linear1, linear2, 16 times over, in MiB."""
    MiB = 1 << 20
    sizes, work = [], []
    for _ in range(16):
        sizes += [[54 * MiB], [126 * MiB], [90 * MiB]]
        work += [0.5 * MS, 1.2 * MS, 1.5 * MS]
    return sizes, work


def test_rings_between_the_pick_and_the_next_smaller_are_tried():
    # With 32 MiB pages the coarse sizes pick 384 MiB; 320 MiB holds a
    # modulation, a linear1 and a linear2 twice over too and leaves 64
    # MiB more for resident weights: predicted 2% faster.
    MiB = 1 << 20
    page = 32 * MiB
    sizes, work = _blocks()
    total = sum(s[0] for s in sizes) // 2
    coarse = S.plan_rings(work, sizes, total, [r * MiB for r in
                                               (512, 384, 288, 256)],
                          page, LINK, 512, 1)
    assert S.pick_ring(coarse, LINK)[0] == 384 * MiB
    assert S.rings_between(coarse, LINK, page) == [352 * MiB, 320 * MiB]
    both = S.plan_rings_between(coarse, work, sizes, total, page, LINK,
                                512, 1)
    assert [r // MiB for r, _ in both] == [512, 384, 352, 320, 288, 256]
    ring, sch = S.pick_ring(both, LINK)
    assert ring == 320 * MiB
    assert sch.predicted < 0.99 * dict(coarse)[384 * MiB].predicted
    # plan_job (the planner's processes' whole job) tries them too
    out = S.plan_job(work, [work], sizes, total, [r * MiB for r in
                                                  (512, 384, 288, 256)],
                     page, LINK, 512, 1, 0.0, 5e-4, None, None)
    i, _ = out["pick"]
    assert out["cands"][i][0] == 320 * MiB


def test_rings_between_none_for_one_ring_or_the_smallest():
    MiB = 1 << 20
    page = 32 * MiB
    sizes, work = _blocks()
    total = sum(s[0] for s in sizes) // 2
    one = S.plan_rings(work, sizes, total, [384 * MiB], page, LINK, 512, 1)
    assert S.rings_between(one, LINK, page) == []
    # every copy hidden: the deepest ring is wanted, nothing between
    # (1.5 ms a unit: 72 ms of compute, 57 ms of copies under it)
    hidden = S.plan_rings([1.5 * MS] * len(work), sizes, total,
                          [512 * MiB, 256 * MiB], page, LINK, 512, 1)
    assert S.pick_ring(hidden, LINK)[0] == 512 * MiB
    assert S.rings_between(hidden, LINK, page) == []
    # the smallest ring picked: nothing smaller to try
    light = S.plan_rings([50 * MS] * len(work), sizes, total,
                         [512 * MiB, 256 * MiB], page, LINK, 512, 1)
    assert S.pick_ring(light, LINK)[0] == 256 * MiB
    assert S.rings_between(light, LINK, page) == []
    # (and a 2 MiB page: at most BETWEEN sizes, spread, whole pages)
    coarse = S.plan_rings(work, sizes, total, [384 * MiB, 288 * MiB],
                          PAGE, LINK, 512, 1)
    more = S.rings_between(coarse, LINK, PAGE)
    if S.pick_ring(coarse, LINK)[0] == 384 * MiB:
        assert len(more) == S.BETWEEN, more
        assert all(288 * MiB < r < 384 * MiB and r % PAGE == 0
                   for r in more), more


def test_ring_wrap_runs():
    """bench/ring_wrap.py (the wrapping ring's figures in bench/RESULTS.md)
    runs as written on a stored trace: at every pause the ring that wraps
    runs the plan it picks no slower than the first-fit ring its own."""
    import subprocess
    out = subprocess.run(
        [sys.executable, os.path.join(_REPO, "bench", "ring_wrap.py"),
         os.path.join(_REPO, "bench", "data",
                      "flux6_diag_node6_h100_s42c10.log"),
         "--ring", "352", "320", "288", "--gaps", "0", "2.5"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    picked = [[float(x) for x in re.findall(r"MiB ([0-9.]+) ms", ln)]
              for ln in out.stdout.splitlines() if "picked:" in ln]
    assert len(picked) == 2, out.stdout
    for first_fit, wraps in picked:
        assert wraps <= first_fit, out.stdout
    out = subprocess.run(
        [sys.executable, os.path.join(_REPO, "bench", "ring_wrap.py"),
         os.path.join(_REPO, "bench", "data",
                      "flux6_diag_node6_h100_s42c10.log"),
         "--ring", "320", "--rooms", "-64", "0"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cells = re.findall(r"([+-]\d+): ([0-9.]+) / ([0-9.]+) \| ([0-9.]+)",
                       out.stdout)
    assert len(cells) == 2, out.stdout
    for _, predicted, ran, wraps in cells:
        assert float(ran) >= float(predicted) - 0.5 and \
            float(wraps) <= float(ran), out.stdout


def test_pause_replan_runs():
    """bench/pause_replan.py (the pause's figures in bench/RESULTS.md)
    runs as written on a stored trace: a pause costs the plan its length
    with the ring at its first-fit share, less with the whole ring."""
    import subprocess
    out = subprocess.run(
        [sys.executable, os.path.join(_REPO, "bench", "pause_replan.py"),
         os.path.join(_REPO, "bench", "data",
                      "flux6_diag_node6_h100_s42c10.log"),
         "--room", "5482940923", "--link", "55.2", "--ring", "320",
         "--gaps", "0", "5.4"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ms = [[float(x) for x in re.findall(r"(?:share|ring) ([0-9.]+) ms", ln)]
          for ln in out.stdout.splitlines() if ln.startswith("  pause ")]
    (share0, _), (share, whole) = ms
    assert abs(share - share0 - 5.4) < 0.05, out.stdout
    assert whole < share, out.stdout


if __name__ == "__main__":
    main(globals())
