"""A schedule made again for the device's new room that the device cannot
take (torch grew into the room between the plan and its placement: the
node's LoRA patches did, on the H200) keeps the forwards running on the
ring they had, with one warning; it never fails every later forward.
Weights given a fill (a LoRA patch computed on the device) are planned
again at once, resident. A placement leaves the weights it keeps
resident where they lie: only the moved ones are copied again. A model
back on top of a shared device keeps its schedule's watermark.
    make && PYTHONPATH=python python3 tests/python/test_replan.py
"""
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)

from vpager.errors import OutOfMemory  # noqa: E402
from vpager.torch import tuner  # noqa: E402
from test_torch import (  # noqa: E402
    K, PAGE, _scheduled_mlp, _scheduled_offload, cuda_layers, delta, environ,
    frozen_copy, mlp, no_pins, sim_opts, watching_every_forward)
import vpager.torch as vt  # noqa: E402


def test_replan_failure_keeps_the_ring():
    m, x, want, h = _scheduled_mlp()
    old_every, old_warm = tuner.WATCH_EVERY, tuner.Tuner.warm
    tuner.WATCH_EVERY = 0.0
    try:
        for _ in range(3):
            assert torch.equal(m(x), want)
        ring = h.device.options["staging_size"]

        def warm(self, *a, **kw):
            # What the device said on the H200: the new ring did not fit.
            self.layout.device.set_staging_size(512 << 20)
            raise OutOfMemory(-1, "vp_acquire", "no device memory for the "
                              "512 MiB staging ring (test)")
        tuner.Tuner.warm = warm
        h.device.set_limit(600 << 10)       # the room moved: a replan
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                assert torch.equal(m(x), want)
        said = [str(w.message) for w in seen
                if "schedule was not made again" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in seen]
        assert "OutOfMemory" in said[0], said
        assert h.device.options["staging_size"] == ring, (
            h.device.options["staging_size"], ring)
    finally:
        tuner.WATCH_EVERY, tuner.Tuner.warm = old_every, old_warm
    assert torch.equal(m(x), want)
    assert no_pins(h)
    h.unload()


def test_the_plans_count_the_ring_as_the_device_maps_it():
    """A ring whose pages the device maps twice (staging_wrap, the
    default: the simulated device on Linux, CUDA) wraps: the plans count
    all of it. Without (staging_wrap=0), first fit's share; outputs the
    same either way."""
    from vpager.torch import schedule
    for wrap in (1, 0):
        m = mlp(depth=8)
        x = torch.randn(8, 64)
        want = frozen_copy(m)(x)
        opts = dict(sim_opts(), page_size=PAGE)
        del opts["lookahead"]
        h = vt.offload(m, device="cpu", budget=900 * K, staging_size=320 * K,
                       staging_wrap=wrap, **opts)
        for _ in range(3):
            assert torch.equal(m(x), want)
        wraps = bool(wrap) and sys.platform != "win32"
        assert h.device.info()["staging_wraps"] == wraps
        assert h.tuner.share() == (schedule.WRAPS if wraps
                                   else schedule.FRAGMENTATION)
        assert h.schedule()["ring_wraps"] == wraps
        h.unload()


def _planned(h):
    """{weight name: resident in the schedule applied}."""
    t = h.tuner
    flat = t._costs({})[3]
    return {e.name: r for e, r in zip(flat, t.schedule.resident)}


def test_a_weight_given_a_fill_is_planned_resident():
    """A weight the schedule streams is given a fill (the node's LoRA
    patch, computed on the device at every fill: on the H200 +28% a
    step): the next forward's start plans again keeping it resident, so
    its fill runs once, not every forward; outputs stay those of the
    patched model. Rid of the fill, the plan is made again without it."""
    m = mlp(depth=8)
    x = torch.randn(8, 64)
    ref = frozen_copy(m)
    want = ref(x)
    h = _scheduled_offload(m)
    for _ in range(5):
        assert torch.equal(m(x), want)
    t = h.tuner
    assert t.done and t.schedule is not None
    planned = _planned(h)
    streamed = [n for n, r in planned.items() if not r]
    assert streamed, planned
    name = streamed[0]
    h.set_fill(name, lambda v: v.mul_(2))
    patched = frozen_copy(ref)
    patched.get_parameter(name).data.mul_(2)
    want2 = patched(x)
    replans = t.replans
    hot, saved = h.hot_path, vt._torch_reserved
    hot.learns = True           # torch read as on CUDA: a stand-in
    vt._torch_reserved = lambda index: (0, 0)
    try:
        assert torch.equal(m(x), want2)
    finally:
        vt._torch_reserved = saved
        hot.learns = False
    assert t.replans == replans + 1 and _planned(h)[name], _planned(h)
    # Planned before this forward's acquires: its fill ran in its
    # resident place (once: the next learn masks the peak it raised).
    assert hot.peak_before_fills is not None and not hot.streamed_fills
    fills = h.hot_path.fills
    for _ in range(3):
        assert torch.equal(m(x), want2)
    assert h.hot_path.fills == fills, (h.hot_path.fills, fills)
    # The same fill set again: no new plan.
    h.set_fill(name, lambda v: v.mul_(2))
    assert torch.equal(m(x), want2) and t.replans == replans + 1
    h.set_fill(name, None)
    assert torch.equal(m(x), want) and t.replans == replans + 2
    for _ in range(2):
        assert torch.equal(m(x), want)
    assert no_pins(h)
    h.unload()


def test_the_room_coming_back_is_planned_for():
    """The room shrinks (a replan for less) and comes back by less than
    GROW: the budget back to the one planned for before it shrank is
    planned for again (torch's peak masked again after a LoRA's fills),
    as many weights resident as before it shrank."""
    m, x, want, h = _scheduled_mlp()
    with watching_every_forward():
        for _ in range(5):
            assert torch.equal(m(x), want)
        t = h.tuner
        full = h.device.info()["budget"]
        first = h.schedule()
        replans = t.replans
        h.device.set_limit(full * 95 // 100)    # 5% less: a replan
        for _ in range(2):
            assert torch.equal(m(x), want)
        assert t.replans == replans + 1, (t.replans, replans)
        assert t.roomier == full and t.planned_for < full
        h.device.set_limit(full)                # the room +8%: under GROW
        for _ in range(2):
            assert torch.equal(m(x), want)
        assert t.replans == replans + 2 and t.roomier is None
        back = h.schedule()
        assert back["planned_for"] == full == first["planned_for"], back
        assert back["resident_bytes"] >= first["resident_bytes"], back
        for _ in range(2):                      # and no more
            assert torch.equal(m(x), want)
        assert t.replans == replans + 2
    h.unload()


class _E:
    def __init__(self, size):
        self.size = size


def test_kept_weights_stay_and_the_rest_fill_the_gaps():
    """placement.place_kept: kept weights keep their offsets, the other
    resident ones fill the gaps before and between them (next fit, at
    the alignment) or go after them, the streamed ones start at the page
    boundary after all of those; no two overlap. With none kept it is
    place_resident_first's compact placement. runs_smallest_first: the
    order kept weights are given up in when they take too many pages
    (place_moving_least)."""
    from vpager.torch.placement import (pages_touched, place_kept,
                                        place_moving_least,
                                        place_resident_first,
                                        runs_smallest_first, scheduled_ranks)
    page = 64 * K
    es = [_E(n * K) for n in (10, 20, 30, 80, 50, 60, 5, 3)]
    cur = [0, 10 * K, 30 * K, 64 * K, 104 * K, 154 * K, 214 * K, 300 * K]
    resident = [True, True, False, True, True, False, True, True]
    kept = [False, True, False, False, True, False, False, False]
    offs, end = place_kept(es, resident, kept, cur, 512, page)
    assert offs[1] == 10 * K and offs[4] == 104 * K, offs  # kept
    assert offs[0] == 0, offs                   # the first gap
    assert offs[3] == 154 * K, offs             # no gap holds 80K: after
    assert offs[6] == 30 * K and offs[7] == 35 * K, offs   # the second
    assert offs[2] == 256 * K and offs[5] == 286 * K and end == 346 * K
    spans = sorted((o, o + e.size) for o, e in zip(offs, es))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert pages_touched(es, offs, resident, page) == {0, 1, 2, 3}
    # The ranks: every page a resident weight touches under the
    # watermark (the pages they take), wherever in its run it lies.
    ranks = scheduled_ranks(es, offs, resident, page, end // page + 1)
    assert set(ranks[:4]) == {0, 1, 2, 3}, ranks
    none = [False] * len(es)
    assert place_kept(es, resident, none, cur, 512, page) == \
        place_resident_first(es, 512, page, resident)
    # place_moving_least: the kept placement where its 4 pages fit the
    # room; in the 3 the compact one takes, kept weights given up until
    # it fits: run by run e1 goes and e4 (50K) stays, e3 taking e1's
    # place in the first gap (best fit, largest first); from the top down
    # e4 would go and e1 (20K) stay: the order keeping more bytes wins.
    big = 1 << 30
    assert place_moving_least(es, resident, kept, cur, 512, page, 4,
                              big) == (offs, end, kept)
    offs3, end3, kept3 = place_moving_least(es, resident, kept, cur, 512,
                                            page, 3, big)
    assert len(pages_touched(es, offs3, resident, page)) <= 3
    assert kept3 == [i == 4 for i in range(8)], kept3
    assert offs3[4] == 104 * K and offs3[3] == 0, offs3
    # Nor past the VBAR: the kept placement ends at 346K (e3 after e4),
    # the one keeping e4 alone at 282K (e3 in the first gap).
    offs4, end4, kept4 = place_moving_least(es, resident, kept, cur, 512,
                                            page, 4, 300 * K)
    assert end4 <= 300 * K and kept4 == kept3, (end4, kept4)
    # Kept weights are given up run by run, the smallest run first: e0
    # and e1 (30K, no whole page between them), then e4 (50K), then e3
    # (80K; more than a page from either).
    kept = [True, True, False, True, True, False, False, False]
    cur = [0, 10 * K, 30 * K, 200 * K, 400 * K, 0, 0, 0]
    assert runs_smallest_first(es, cur, kept, page) == [0, 1, 4, 3]


def test_a_joining_weight_goes_where_it_touches_no_new_page():
    """place_kept puts a joining weight at a gap's start or its end,
    wherever it touches the fewest pages no weight touches yet: 20K at
    this gap's start (120K) would cross into page 2; at its end (230K) it
    shares page 3 with the kept weight after it: 3 pages, not 4."""
    from vpager.torch.placement import pages_touched, place_kept
    page = 64 * K
    es = [_E(120 * K), _E(20 * K), _E(6 * K), _E(40 * K)]
    cur = [0, 400 * K, 250 * K, 300 * K]
    resident = [True, True, True, False]
    kept = [True, False, True, False]
    offs, end = place_kept(es, resident, kept, cur, 512, page)
    assert offs[1] == 230 * K, offs
    assert pages_touched(es, offs, resident, page) == {0, 1, 3}
    assert offs[3] == 256 * K and end == 296 * K, (offs, end)   # streamed


def test_a_resident_set_in_one_run_keeps_most_of_it():
    """The GPU's case (a Flux prompt's fourth step kept 283 MB of an 8 GB
    resident set): the resident set lies in one run, two of its weights
    leave (30K holes) and two of 40K join, which no hole holds, so kept
    in place it takes one page more than the room. Given up run by run
    the one run goes whole (nothing kept, everything copied again); from
    the top down, two weights move into the holes and the joiners after
    a lower top: 6 of the 8 kept weights stay."""
    from vpager.torch.placement import (highest_first, pages_touched,
                                        place_moving_least,
                                        runs_smallest_first)
    page = 64 * K
    es = [_E(30 * K)] * 10 + [_E(40 * K)] * 2
    cur = [30 * K * i for i in range(10)] + [320 * K, 360 * K]
    now = [True] * 10 + [False] * 2
    resident = [i not in (3, 6) for i in range(12)]
    now = [n and r for n, r in zip(now, resident)]
    assert len(set(runs_smallest_first(es, cur, now, page))) == 8
    assert highest_first(cur, now)[:2] == [9, 8]
    offs, end, kept = place_moving_least(es, resident, now, cur, 512, page,
                                         5, 1 << 30)
    assert len(pages_touched(es, offs, resident, page)) <= 5
    assert kept == [True, True, True, False, True, True, False, True,
                    False, False, False, False], kept
    assert offs[8] == 90 * K and offs[9] == 180 * K, offs   # the holes
    assert offs[10] == 240 * K and offs[11] == 280 * K, offs
    assert all(offs[i] == cur[i] for i in range(12) if kept[i])


def test_kept_weights_all_stay_and_a_joiner_streams_instead():
    """placement.place_streaming_least, the other way to place the case
    above: every weight resident now stays where it lies (nothing filled
    again), and the pages over the room are freed by streaming the
    joiners that went above the kept ones (80K more a forward, against
    60K filled again by place_moving_least); a weight `keep` flags (a
    fill) never streams: a kept one does instead; None where nothing
    may stream."""
    from vpager.torch.placement import pages_touched, place_streaming_least
    page = 64 * K
    es = [_E(30 * K)] * 10 + [_E(40 * K)] * 2
    cur = [30 * K * i for i in range(10)] + [320 * K, 360 * K]
    resident = [i not in (3, 6) for i in range(12)]
    now = [r and i < 10 for i, r in enumerate(resident)]
    res, offs, end, kept = place_streaming_least(es, resident, now, cur,
                                                 512, page, 5, 1 << 30)
    assert kept == now and res == now, (kept, res)
    assert all(offs[i] == cur[i] for i in range(10) if now[i])
    assert len(pages_touched(es, offs, res, page)) <= 5
    # A fill on joiner 10: it stays resident (in a gap it does not fit:
    # above the kept ones), a kept weight streams instead.
    keep = [i == 10 for i in range(12)]
    res, offs, end, kept = place_streaming_least(es, resident, now, cur,
                                                 512, page, 5, 1 << 30, keep)
    assert res[10] and not res[11] and sum(res[:10]) < sum(now), res
    assert len(pages_touched(es, offs, res, page)) <= 5
    assert all(offs[i] == cur[i] for i in range(12) if kept[i])
    assert place_streaming_least(es, resident, now, cur, 512, page, 5,
                                 1 << 30, [True] * 12) is None
    assert place_streaming_least(es, resident, now, cur, 512, page, 5,
                                 200 * K) is None       # past the VBAR


def test_a_refine_fills_again_what_its_faster_forwards_pay_for():
    """Tuner._placed where the plan's own set fills some weights resident
    now again and keeping every one in place streams a little more
    (within NEAR): a placement made in a forward keeps them in place; a
    refine (the client's pause) fills them again when the forwards it
    speeds pay for the fill within PAYBACK, else keeps them too."""
    from types import SimpleNamespace as NS
    from vpager.torch import schedule
    n, link, fill = 4, 1e9, 10 << 20         # 10.5 ms to fill again
    es = [NS(size=fill, offset=i * fill) for i in range(n)]
    sch = schedule.Schedule([True, True, False, False], [0] * n, 0.100,
                            2 * fill, 2 * fill, 0.09)
    lay = NS(vbar=NS(loaded_size=lambda: 2 * fill, size=1 << 30), align=512,
             device=NS(page_size=fill))
    placed = ([0, fill, 0, 0], 2 * fill, [True, False, False, False])

    def tuner_for(slower):
        other = schedule.Schedule([True, False, True, False], [0] * n,
                                  0.100 + slower, 3 * fill, 2 * fill, 0.09)
        return NS(schedule=sch, relocate=False, heading=None, fill_now=False,
                  link=link, _trace=lambda msg: None,
                  _now=lambda lay, flat, res: [True, True, False, False],
                  _placement=lambda *a: placed, _room_pages=lambda ring: 2,
                  _schedule_for=lambda *a: other), other
    alt = ([True, False, True, False], [0, 0, fill, 0], 2 * fill,
           [True, False, True, False])
    saved = tuner.place_streaming_least
    tuner.place_streaming_least = lambda *a: alt
    try:
        pays = fill / link / tuner.PAYBACK     # a forward's share of it
        for slower, refine, want in (
                (1.5 * pays, False, "kept"),    # in a forward: in place
                (1.5 * pays, True, "filled"),   # a refine: pays the fill
                (0.5 * pays, True, "kept"),     # ... not within PAYBACK
                (0.0030, False, "filled")):     # beyond NEAR (2%)
            assert 1.5 * pays < 0.100 * tuner.NEAR < 0.0030
            t, other = tuner_for(slower)
            got = tuner.Tuner._placed(t, lay, es, sch, [], [], 0, None,
                                      refine)
            assert got == ((sch, placed) if want == "filled" else
                           (other, alt[1:])), (slower, refine, got)
    finally:
        tuner.place_streaming_least = saved


def _copied(d):
    return d["fill_bytes"] + d["prefetch_bytes"] + d["staged_bytes"] - \
        d["prefetch_dropped_bytes"]


KEYS = ("fill_bytes", "prefetch_bytes", "staged_bytes",
        "prefetch_dropped_bytes", "pages_committed", "pages_evicted")


def _placed_at(m, x, want, h, limit):
    """The budget set to `limit`, then two forwards (bitwise): (the
    placing forward's KEYS deltas, the next one's, schedule()); the next
    one is steady: only the streamed weights copied, no page committed or
    evicted (a resident one ranked past the watermark would be staged
    every time)."""
    s0 = h.stats()["device"]
    h.device.set_limit(limit)
    assert torch.equal(m(x), want)
    s1 = h.stats()["device"]
    assert torch.equal(m(x), want)
    steady = delta(h.stats()["device"], s1, *KEYS)
    sch = h.schedule()
    assert _copied(steady) <= sch["streamed_bytes"], (steady, sch)
    assert steady["pages_committed"] == 0, steady
    assert steady["pages_evicted"] == 0, steady
    return delta(s1, s0, *KEYS), steady, sch


def _relocating():
    """_scheduled_mlp() with VPAGER_RELOCATE=1."""
    with environ(VPAGER_RELOCATE="1"):
        return _scheduled_mlp()


def test_moved_weights_are_copied_on_the_device():
    """VPAGER_RELOCATE=1: a schedule made again for a smaller and a larger
    room is placed apart from the weights resident before
    (placement.place_apart), and those resident before and after are
    copied on the device from where they lay (relocated_bytes), not again
    from their sources: the placing forward copies from the host no more
    than a steady one plus the weights that join the resident set.
    Outputs bitwise; steady again after."""
    m, x, want, h = _relocating()
    moved = 0
    with watching_every_forward():
        for _ in range(3):
            assert torch.equal(m(x), want)
        for limit in (600 * K, 900 * K):
            before = _planned(h)
            placing, steady, sch = _placed_at(m, x, want, h, limit)
            after = _planned(h)
            joined = sum(e.size for e in h.vbar_layout.entries
                         if after[e.name] and not before[e.name])
            moved += sch["relocated_bytes"]
            assert sch["relocated_bytes"] <= sch["kept_bytes"], sch
            assert _copied(placing) <= _copied(steady) + joined + \
                sch["resident_bytes"] - sch["kept_bytes"], (placing, steady)
    assert moved > 0
    assert no_pins(h)
    h.unload()


def test_moved_weights_copy_no_stale_bytes():
    """VPAGER_RELOCATE=1: resident weights given a fill, then rid of it
    (their bytes in place are the fill's, their source their own again),
    the budget moved at once: the placements that move them copy their
    sources' bytes (hold() acquires them where they lie first, which
    fills them there), not the stale ones. Outputs bitwise the unfilled
    model's (before hold() acquired, each of these was wrong)."""
    m, x, want, h = _relocating()
    moved = 0
    with watching_every_forward():
        for _ in range(3):
            assert torch.equal(m(x), want)
        names = [n for n, r in _planned(h).items()
                 if r and n.endswith("weight")]
        assert names
        for n in names:
            h.set_fill(n, lambda v: v.mul_(2))
        for _ in range(2):
            assert not torch.equal(m(x), want)
        for n in names:
            h.set_fill(n, None)
        for limit in (600 * K, 900 * K, 700 * K):
            h.device.set_limit(limit)
            assert torch.equal(m(x), want)
            moved += h.schedule()["relocated_bytes"]
    assert moved > 0
    assert no_pins(h)
    h.unload()


def test_cuda_moved_weights_copied_on_the_device_bitwise():
    """On CUDA (skipped without), VPAGER_RELOCATE=1: 40 layers of
    1024x1024 float32 at 60% of their bytes, the budget lowered and
    raised: each schedule made again copies the weights it moves inside
    the device, and every output is bitwise the resident model's."""
    if not torch.cuda.is_available():
        _runner.skip("no CUDA device")
    m, ref, x, total = cuda_layers()
    want = ref(x)
    with environ(VPAGER_RELOCATE="1"), watching_every_forward():
        h = vt.offload(m, device="cuda", budget=int(total * 0.6),
                       page_size="2M")
        moved = 0
        with torch.no_grad():
            for limit in (None, 0.4, 0.6, 0.5):
                if limit is not None:
                    h.device.set_limit(int(total * limit))
                for _ in range(4):
                    assert torch.equal(m(x), want)
                moved += h.schedule()["relocated_bytes"]
        assert moved > 0
        h.unload()


def test_a_new_plan_copies_only_what_moved():
    """The schedule is placed (before the first forward, guessed; after
    it, measured), then made again for a smaller and a larger room: each
    time the weights resident before and after stay where they lie
    (kept_bytes), and the placing
    forward copies no more than a steady one plus the resident weights
    that moved; no pages are committed or evicted once steady again.
    Outputs bitwise."""
    m, x, want, h = _scheduled_mlp()
    with watching_every_forward():
        for _ in range(3):
            assert torch.equal(m(x), want)
        assert h.schedule()["kept_bytes"] <= \
            h.schedule()["resident_bytes"], h.schedule()
        for limit in (600 * K, 900 * K):
            lay = h.vbar_layout
            was = {e.name: e.offset for e in lay.entries}
            placing, steady, sch = _placed_at(m, x, want, h, limit)
            planned = _planned(h)
            stayed = sum(e.size for e in lay.entries if planned[e.name]
                         and was[e.name] == e.offset)
            assert 0 < sch["kept_bytes"] <= stayed, (sch, stayed)
            assert _copied(placing) <= _copied(steady) + \
                sch["resident_bytes"] - sch["kept_bytes"], (placing, steady)
    assert no_pins(h)
    h.unload()


def test_toward_steps_from_one_resident_set_to_another():
    """schedule.toward: what leaves the resident set in place is at most
    `limit` bytes (at least one weight; more only when the set does not
    fit the room), the weights the new set keeps fill the room left
    (two pages of it kept free: rounding and the holes), the new set
    itself once what leaves fits in limit; None if nothing fits."""
    from vpager.torch import schedule
    page = 64 * K
    sizes = [[40 * K] * 4, [40 * K] * 4]            # 8 weights, 2 units
    old = [True] * 4 + [False] * 4
    best = [False] * 4 + [True] * 4
    room = 10 * page
    step = schedule.toward(old, best, sizes, room, page, 512, None, 50 * K)
    gone = [i for i in range(8) if old[i] and not step[i]]
    assert len(gone) == 1, step                     # 40 K of 50 K
    added = [i for i in range(8) if step[i] and not old[i]]
    assert added and all(best[i] for i in added), step
    assert schedule.resident_pages(sizes, step, page, 512) <= room
    assert schedule.toward(old, best, sizes, room, page, 512, None,
                           160 * K) == best
    one = schedule.toward(old, best, sizes, room, page, 512, None, 1)
    assert sum(1 for i in range(8) if old[i] and not one[i]) == 1, one
    # A room the old set does not fit: as much leaves as it takes.
    small = schedule.toward(old, best, sizes, 4 * page, page, 512, None,
                            1)
    assert schedule.resident_pages(sizes, small, page, 512) <= 4 * page
    assert schedule.toward(old, best, sizes, page, page, 512, [True] * 8,
                           1) is None               # what must stay


def _scheduled(m, x):
    """m offloaded under 0.6 of its bytes, four forwards run (a schedule
    in place): (h, forward, bytes the last forward copied); forward()
    runs one, bitwise, and returns the bytes it copied."""
    want = frozen_copy(m)(x)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    opts = dict(sim_opts(), page_size=PAGE)
    del opts["lookahead"]
    h = vt.offload(m, device="cpu", budget=int(total * 0.6),
                   staging_size=192 * K, **opts)
    keys = ("fill_bytes", "prefetch_bytes", "staged_bytes",
            "prefetch_dropped_bytes")

    def forward():
        s0 = h.stats()["device"]
        assert torch.equal(m(x), want)
        d = delta(h.stats()["device"], s0, *keys)
        return (d["fill_bytes"] + d["prefetch_bytes"] + d["staged_bytes"]
                - d["prefetch_dropped_bytes"])
    for _ in range(4):
        before = forward()
    return h, forward, before


def _far_plan():
    """An MLP scheduled under 0.6 of its bytes, and a plan (target) whose
    resident set is far from the one in place: (h, forward, target,
    bytes the last forward copied)."""
    h, forward, before = _scheduled(mlp(width=128, depth=32),
                                    torch.randn(8, 64))
    t = h.tuner
    units, w, sizes, flat = t._costs(t.work)
    cur = list(t.schedule.resident)
    room = sum(e.size for e, r in zip(flat, cur) if r)
    # The plan: the weights streamed now (the tiny ones as they are).
    res, used = [], 0
    for e, r in zip(flat, cur):
        take = e.size < 4 * K and r or (
            not r and e.size >= 4 * K and used + e.size <= room)
        used += e.size if take and not r else 0
        res.append(bool(take))
    target = t._schedule_for(res, w, sizes, t.ring)
    moving = sum(e.size for e, a, b in zip(flat, cur, res) if a and not b)
    assert moving > 4 * tuner.STEP * target.streamed
    return h, forward, target, before


def _heading_for(t, target, steps=True):
    """t.apply() taking `target` as its plan (steps on: t.heading set)."""
    old_plan, old_near = tuner.Tuner.plan, tuner.Tuner._nearest
    tuner.Tuner.plan = lambda self, *a, **kw: (target, self.ring)
    tuner.Tuner._nearest = lambda self, old, sch, *a: sch
    try:
        t.apply(t.work, replan="room")
    finally:
        tuner.Tuner.plan, tuner.Tuner._nearest = old_plan, old_near
    assert not steps or t.heading is not None and t.heading[0] is target


def test_a_placement_far_from_the_one_in_place_moves_in_steps():
    """A plan whose resident set is far from the one in place (the first
    measured forward's against the guessed placement, on the H100 kept
    0 of 7.2 GB: that forward 1.42 x a steady one) is placed in steps
    (Tuner.heading): each forward that takes one copies again at most
    STEP of a steady forward's bytes more than the one before did, the
    weights kept where they lie; the last step is the plan itself;
    outputs bitwise throughout."""
    h, forward, target, before = _far_plan()
    assert _in_steps(h, forward, target, before) > 3
    assert h.tuner.kept_bytes > 0 or h.tuner.relocated_bytes > 0


def _in_steps(h, forward, target, before):
    """_far_plan()'s target taken in steps: each forward that takes one
    copies at most STEP of a steady forward's bytes more than the one
    before did, the last step is the target; returns the steps taken."""
    t = h.tuner
    with environ(VPAGER_PLACE_STEPS="1"):   # (_runner turns steps off)
        _heading_for(t, target)
        steps = 1
        while t.heading is not None:
            steps += 1
            got = forward()
            assert got <= before + tuner.STEP * target.streamed + PAGE, \
                (steps, got, before)
            assert steps < 40
            before = got
    assert t.schedule.resident == target.resident or \
        list(t.schedule.resident) == list(target.resident)
    for _ in range(2):
        forward()
    return steps


def test_steps_copy_the_weights_they_move_on_the_device():
    """VPAGER_RELOCATE=1 with steps (VPAGER_PLACE_STEPS=1): each step is
    placed apart from the weights resident before and copies those it
    keeps on the device (relocated_bytes), so a step never gives up for
    the fills a kept weight's hole would cost; every step within STEP of
    a steady forward's bytes, the target reached, outputs bitwise."""
    with environ(VPAGER_RELOCATE="1"):
        h, forward, target, before = _far_plan()
    t = h.tuner
    moved, given_up = [], []
    place, quit_ = t._place, t._given_up

    def placing(*a, **kw):
        place(*a, **kw)
        moved.append(t.relocated_bytes)
    t._place = placing
    t._given_up = lambda why: (given_up.append(why), quit_(why))
    assert _in_steps(h, forward, target, before) > 3
    assert not given_up, given_up
    assert sum(moved) > 0, moved
    assert no_pins(h)


def test_a_tight_plan_keeps_every_weight_and_streams_a_joiner():
    """A plan whose resident set fills the room to the page, some weights
    resident now left out of it (holes) and streamed ones joining: kept
    where they lie the weights take more pages than the room, and
    place_moving_least would fill some of them again. Where keeping every
    one and streaming some joiners instead is predicted within NEAR, the
    tuner takes that (kept_bytes: all the weights resident before and
    after); where it is not, the plan's own set. Outputs bitwise."""
    from vpager.torch.placement import place_resident_first, pages_touched
    for near, keeps in ((10.0, True), (-1.0, False)):
        # Weights of 64K and 80K (pages of 64K): a 64K one's hole holds
        # no 80K one.
        torch.manual_seed(0)
        layers = []
        for _ in range(12):
            layers += [torch.nn.Linear(128, 160), torch.nn.ReLU(),
                       torch.nn.Linear(160, 128), torch.nn.ReLU(),
                       torch.nn.Linear(128, 128)]
        h, forward, _ = _scheduled(torch.nn.Sequential(*layers).eval(),
                                   torch.randn(8, 128))
        t = h.tuner
        units, w, sizes, flat = t._costs(t.work)
        cur = list(t.schedule.resident)
        page = h.device.page_size
        room = t._room_pages(t.ring)

        def pages(res):
            offs, _ = place_resident_first(flat, h.vbar_layout.align, page,
                                           res)
            return len(pages_touched(flat, offs, res, page))
        res = list(cur)
        holes = [i for i, r in enumerate(cur) if r and flat[i].size == page]
        for i in holes[1:4]:
            res[i] = False
        for i, r in enumerate(cur):         # joiners, to the page
            if not r and flat[i].size > page:
                res[i] = True
                if pages(res) > room:
                    res[i] = False
        assert pages(res) == room and len(holes) >= 4, (pages(res), room)
        target = t._schedule_for(res, w, sizes, t.ring)
        both = sum(e.size for e, a, b in zip(flat, cur, res) if a and b)
        old_near = tuner.NEAR
        tuner.NEAR = near
        try:
            with environ(VPAGER_PLACE_STEPS="0"):
                _heading_for(t, target, steps=False)
        finally:
            tuner.NEAR = old_near
        assert (t.kept_bytes == both) is keeps, (near, t.kept_bytes, both)
        assert (t.schedule is not target) is keeps
        for _ in range(2):
            forward()
        h.unload()


def test_the_spare_pages_are_the_variables():
    """VPAGER_SPARE_PAGES sets the pages a plan leaves free beside the
    resident set and the ring (default SPARE_PAGES); a bad value warns
    and keeps the default. Outputs bitwise with none spare."""
    m, x, want, h = _scheduled_mlp()
    try:
        for _ in range(3):      # measured, planned
            assert torch.equal(m(x), want)
        t = h.tuner
        base = t._room_pages(t.ring)
        with environ(VPAGER_SPARE_PAGES="0"):
            assert tuner.spare_pages() == 0
            assert t._room_pages(t.ring) == base + tuner.SPARE_PAGES
            for _ in range(2):
                assert torch.equal(m(x), want)
        with environ(VPAGER_SPARE_PAGES="lots"), warnings.catch_warnings(
                record=True) as got:
            warnings.simplefilter("always")
            assert tuner.spare_pages() == tuner.SPARE_PAGES
        assert any("VPAGER_SPARE_PAGES" in str(w.message) for w in got)
    finally:
        h.unload()


def test_steps_stop_short_of_a_refill_for_a_small_gain():
    """A step whose placement would fill much of the resident set again
    (the weights kept leave holes the next ones do not fit in: on the
    H100 the node's Flux's last step moved 2.4 of 5.0 GB for 1.9%
    predicted, the next prompt's steps 1.4-2.2x a steady one) is not
    taken when the placement in place is predicted within NEAR of the
    plan: the steps stop there. Further from it, it is taken."""
    for gain, stops in ((1.01, True), (1.5, False)):
        h, forward, target, before = _far_plan()
        t = h.tuner
        placement = t._placement

        def refill_all(lay, flat, resident, ring):
            offsets, end, stay = placement(lay, flat, resident, ring)
            # The plan itself: nothing kept in place.
            if list(resident) == list(target.resident):
                stay = [False] * len(stay)
            return offsets, end, stay
        t._placement = refill_all
        with environ(VPAGER_PLACE_STEPS="1"):
            _heading_for(t, target)
            steps = 1
            while t.heading is not None:
                # The gain the plan has over the step in place.
                target.predicted = t.schedule.predicted / gain
                steps += 1
                forward()
                assert steps < 40
        reached = list(t.schedule.resident) == list(target.resident)
        assert reached is not stops, (gain, steps)
        forward()
        h.unload()


def test_a_budget_back_and_forth_is_planned_every_time():
    """The budget moves between two rooms ten times: each move is planned
    again and placed (the resident set follows the room; kept placements
    never creep past the VBAR, where a plan would be dropped), outputs
    bitwise, no pins left."""
    m, x, want, h = _scheduled_mlp()
    with watching_every_forward():
        for _ in range(3):
            assert torch.equal(m(x), want)
        got = []
        for i in range(10):
            limit = (600 if i % 2 == 0 else 900) * K
            h.device.set_limit(limit)
            for _ in range(2):
                assert torch.equal(m(x), want)
            sch = h.schedule()
            assert sch["replans"] == i + 1, (i, sch)
            assert sch["resident_bytes"] <= limit - 320 * K, (i, sch)
            got.append(sch["resident_bytes"])
            assert max(e.offset + e.size
                       for e in h.vbar_layout.entries) <= h.vbar.size
        # (the larger room holds more: the measured plans may differ)
        assert all(a < b for a, b in zip(got[0::2], got[1::2])), got
    assert no_pins(h)
    h.unload()


def _layers_scheduled():
    """(h, ref, forward, patched): 300 layers of weights smaller than a
    page offloaded at 60% and run to a schedule; ref, a frozen copy the
    test patches as it patches h; forward() runs one, its output checked
    against ref's as it is then, and returns the bytes it copied;
    patched, 20 of the weights the schedule streams, spread over the
    model."""
    from torch import nn
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(96, 96) for _ in range(300)]).eval()
    x = torch.randn(4, 96)
    ref = frozen_copy(m)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    h = vt.offload(m, device="cpu", budget=int(total * 0.6),
                   staging_size=512 * K, **dict(sim_opts(), lookahead=None))
    keys = ("fill_bytes", "prefetch_bytes", "staged_bytes",
            "prefetch_dropped_bytes")

    def forward():
        s0 = h.stats()["device"]
        with torch.no_grad():
            assert torch.equal(m(x), ref(x))
        return _copied(delta(h.stats()["device"], s0, *keys))
    for _ in range(4):
        forward()
    t = h.tuner
    flat = t._costs({})[3]
    streamed = [e for e, r in zip(flat, t.schedule.resident)
                if not r and e.size > 4096]
    return h, ref, forward, streamed[::len(streamed) // 20][:20]


def test_fills_planned_again_move_only_the_patched_weights():
    """300 layers of weights smaller than a page, a schedule in place;
    20 streamed weights are given a fill (a LoRA): the plan made again
    keeps them resident and is the resident set nearest the one in place
    (Tuner._nearest), so its placement leaves nearly all of that where it
    lies (it refilled all of it: every patched weight's fill computed
    again) and the placing forward copies little more than a steady one
    plus the patched weights. Outputs those of the patched model."""
    h, ref, forward, patched = _layers_scheduled()
    for e in patched:
        h.set_fill(e.name, lambda v: v.mul_(2))
        ref.get_parameter(e.name).data.mul_(2)
    placing = forward()                 # planned again at its start
    steady = forward()
    sch = h.schedule()
    assert sch["replans"] == 1 and all(_planned(h)[e.name] for e in patched)
    assert sch["kept_bytes"] >= 0.8 * sch["resident_bytes"], sch
    assert placing <= steady + 2 * sum(e.size for e in patched), (
        placing, steady)
    assert no_pins(h)
    h.unload()


def test_fills_taken_away_keep_the_ring_and_the_placement():
    """The LoRA workflow's last prompt: 20 streamed weights given a fill
    are planned resident, then rid of it. Each plan made for fills tries
    only the ring in use (the room and the work are those it was chosen
    for: on the H100 the node's Flux swung between two rings at each
    LoRA change, placing every weight anew), and rid of the fills the
    placement stays where it is when it is predicted within 2% of the
    new plan: the next forward copies what a steady one does plus the
    weights whose fills went (filled from their own bytes). Outputs those
    of the model as it is at each point."""
    h, ref, forward, patched = _layers_scheduled()
    t = h.tuner
    rings = []
    real = tuner.plan_rings

    def plan_rings(work, sizes, total, tried, *a, **kw):
        rings.append(list(tried))
        return real(work, sizes, total, tried, *a, **kw)
    tuner.plan_rings = plan_rings
    # (a ring vpager.torch sized would have it try others too)
    t._rings = lambda dev, need: [t.ring + 4 * PAGE, t.ring]
    try:
        for e in patched:
            h.set_fill(e.name, lambda v: v.mul_(2))
            ref.get_parameter(e.name).data.mul_(2)
        forward()                       # planned again, placed
        forward()
        resident = list(t.schedule.resident)
        steady = forward()
        for e in patched:
            h.set_fill(e.name, None)
            ref.get_parameter(e.name).data.div_(2)
        placing = forward()             # planned again: nothing moves
        forward()
    finally:
        tuner.plan_rings = real
    assert rings == [[t.ring], [t.ring]], (rings, t.ring)
    assert h.schedule()["replans"] == 2
    assert list(t.schedule.resident) == resident
    # (and up to a page more: the windows are made again for the work;
    # and 5% of a step: under load the simulated device's prefetches land
    # late now and then, and the acquire copies a weight again, which
    # once put a make check 70 KB over; placing anew would copy the
    # resident set again, about 6 MB)
    assert placing <= steady * 1.05 + sum(e.size for e in patched) + PAGE, (
        placing, steady)
    assert no_pins(h)
    h.unload()


def test_two_scheduled_models_take_turns_within_their_schedules():
    """Two scheduled models on one device that holds neither whole run in
    turns: each one's forward puts it back on top of the device, its
    watermark lifted only to its schedule's resident runs (Layout.on_top),
    so its streamed weights still go through the ring: a forward commits
    no more pages than its resident set takes and copies each weight at
    most once (the whole VBAR's watermark had it commit pages for its
    streamed weights too, evicting its own: 23 pages and 2.71 MB a
    forward for this 2.19 MB model). Outputs bitwise."""
    opts = dict(sim_opts(), page_size=PAGE)
    del opts["lookahead"]
    dev = vt.open_device("sim", budget=1400 * K, staging_size=320 * K,
                         **opts)
    keys = ("pages_committed", "fill_bytes", "prefetch_bytes",
            "staged_bytes", "prefetch_dropped_bytes")
    try:
        a, b = mlp(depth=8, seed=1), mlp(depth=8, seed=2)
        x = torch.randn(8, 64)
        wa, wb = frozen_copy(a)(x), frozen_copy(b)(x)
        largest = max(p.numel() * p.element_size() for p in a.parameters())
        ha = vt.offload(a, dev=dev, schedule=True)
        hb = vt.offload(b, dev=dev, schedule=True)
        placed = {}                     # each model's set at the last forward
        with torch.no_grad():
            for i in range(5):
                for h, m, want in ((ha, a, wa), (hb, b, wb)):
                    now = h.tuner.schedule and list(h.tuner.schedule.resident)
                    s0 = h.stats()["device"]
                    assert torch.equal(m(x), want)
                    d = delta(h.stats()["device"], s0, *keys)
                    sch = h.schedule()
                    taking = placed.get(id(h)) != now
                    placed[id(h)] = now
                    if i < 2 or sch is None:
                        continue        # measured, placed
                    assert h.vbar.get_watermark() * PAGE <= \
                        h.vbar_layout.watermark, i
                    assert d["pages_committed"] * PAGE <= \
                        sch["resident_bytes"], (i, d, sch)
                    # A forward that takes a new placement (a later plan
                    # on a noisy host's measures) may stage a weight its
                    # page's prefetch fills too. On a fast host one
                    # prefetch the ring dropped before its weight's turn
                    # may be staged again (H100: 2.30 MB of 2.19, 2 runs
                    # of 13): once, at most the largest weight.
                    if not taking:
                        assert _copied(d) <= h.weight_bytes + largest, (i, d)
        ha.unload()
        hb.unload()
    finally:
        dev.close()



def test_placement_kept_bench_runs():
    """bench/placement_kept.py (the placement figures in bench/RESULTS.md)
    runs as written: a row per page size, case and seed."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, os.path.join(root, "bench", "placement_kept.py"),
         "--seeds", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [r for r in out.stdout.splitlines() if r.startswith(("2M", "32M"))]
    assert len(rows) == 8, out.stdout

if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
