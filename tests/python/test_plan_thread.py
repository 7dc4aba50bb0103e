"""Plans off the forward's critical path (issue 29, points 2 and 5), on
the simulated device, with the planner's thread on (VPAGER_PLAN_THREAD=1;
the other tests plan on the forward's thread, _runner.py):

* no forward waits for a plan: a plan held back on the planner's thread
  lets the forwards run on, and the time charged to the forward's thread
  (a fake clock: each plan and each warm() charges the thread that runs
  it) never includes a plan's compute or a warm;
* a forward's marks are read on its thread, once the GPU ran it;
* a plan made there is applied at a forward's start, on the forward's
  thread, before any unit runs; outputs stay bitwise;
* the forward that takes a placement fills the resident set by prefetch
  as it runs (no warm() stop), and the next one is back to the plan;
* with the placement offload() makes for a schedule guessed from the
  weights' sizes, every forward after the first copies what a steady
  one does;
* a budget that moves is planned for there too;
* the planner's process (planproc.py) plans as this one does;
* ten prompts of four forwards: from the second prompt on, each copies,
  commits and evicts exactly what the one before did.
No timed assertions: counts and the fake clock only.

    make && PYTHONPATH=python python3 tests/python/test_plan_thread.py
"""
import glob
import json
import os
import sys
import tempfile
import types
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)

import vpager.torch as vt  # noqa: E402
from vpager.torch import (  # noqa: E402
    devices, plancache, planproc, schedule, tuner)
from test_torch import PAGE, _scheduled_mlp, delta, environ, mlp  # noqa: E402
from _runner import raises  # noqa: E402
from vpager.governor import governor  # noqa: E402

WAIT = 60.0                 # seconds: only a hung planner reaches it
PLAN_COST = 1.0             # fake seconds a plan charges its thread
WARM_COST = 1.0             # fake seconds a warm() charges its thread


class FakeClock:
    """Fake seconds charged per thread: plans and warms charge the thread
    that runs them; a forward's time is what its thread was charged."""

    def __init__(self):
        self.lock = threading.Lock()
        self.charged = {}

    def charge(self, seconds):
        t = threading.get_ident()
        with self.lock:
            self.charged[t] = self.charged.get(t, 0.0) + seconds

    def of(self, ident):
        with self.lock:
            return self.charged.get(ident, 0.0)


class Patched:
    """tuner.plan_rings (a plan on the forward's thread), tuner.plan_job
    (the planner's) and Tuner.warm charging the fake clock; plans held at
    `gate` until it is set; Tuner.apply recording (thread, busy)."""

    def __init__(self, clock):
        self.clock = clock
        self.gate = threading.Event()
        self.gate.set()
        self.applied = []           # (thread ident, model busy) per apply
        self.plans = 0

    def __enter__(self):
        self.old = (tuner.plan_rings, tuner.plan_job, tuner.Tuner.warm,
                    tuner.Tuner.apply)
        plan_rings, plan_job, warm, apply = self.old

        def charged(fn):
            def plan(*a, **kw):
                assert self.gate.wait(WAIT), "the plan was never let go"
                self.plans += 1
                self.clock.charge(PLAN_COST)
                return fn(*a, **kw)
            return plan

        def warm_charged(tun, *a, **kw):
            self.clock.charge(WARM_COST)
            return warm(tun, *a, **kw)

        def apply_seen(tun, *a, **kw):
            self.applied.append((threading.get_ident(), tun.model.busy()))
            return apply(tun, *a, **kw)
        tuner.plan_rings, tuner.plan_job = charged(plan_rings), \
            charged(plan_job)
        tuner.Tuner.warm, tuner.Tuner.apply = warm_charged, apply_seen
        return self

    def __exit__(self, *exc):
        self.gate.set()
        (tuner.plan_rings, tuner.plan_job, tuner.Tuner.warm,
         tuner.Tuner.apply) = self.old
        return False


def _threaded_mlp(cold_work=None):
    """The scheduled MLP with the planner's thread. cold_work=False: its
    first plan made on the planner from the cold forward and taken at a
    later forward's start (VPAGER_COLD_WORK=0), as the planner's own tests
    count forwards; by default (VPAGER_COLD_WORK on) it is made at the
    cold forward's end."""
    env = {"VPAGER_PLAN_THREAD": "1"}
    if cold_work is not None:
        env["VPAGER_COLD_WORK"] = "1" if cold_work else "0"
    with environ(**env):
        m, x, want, h = _scheduled_mlp()
    assert h.tuner.planner is not None
    return m, x, want, h


def test_forwards_never_wait_for_a_plan():
    clock = FakeClock()
    me = threading.get_ident()
    with Patched(clock) as p:
        m, x, want, h = _threaded_mlp(cold_work=False)
        p.gate.clear()              # the first plan takes "forever"
        for _ in range(4):          # the forwards run on meanwhile
            assert torch.equal(m(x), want)
        assert h.tuner.planner.pending and h.schedule() is None
        assert p.applied == [], p.applied
        p.gate.set()
        assert h.tuner.planner.wait(WAIT)
        assert h.schedule() is None     # ready, not applied between forwards
        # Forwards until measuring ends (each plan taken at a forward's
        # start, the next measured after it).
        for _ in range(3 * tuner.ROUNDS_MAX):
            assert torch.equal(m(x), want)
            assert h.tuner.planner.wait(WAIT)
        assert h.tuner.done and h.schedule() is not None
        assert h.schedule()["resident_weights"] > 0
        assert p.plans >= 1
        # Applied on the forward's thread, at its start (no unit busy).
        assert p.applied and all(t == me and not busy
                                 for t, busy in p.applied), p.applied
        # The forward's thread was charged no plan and no warm.
        assert clock.of(me) == 0.0, clock.charged
        assert sum(clock.charged.values()) == p.plans * PLAN_COST
    for _ in range(2):
        assert torch.equal(m(x), want)
    h.unload()


def test_forwards_are_measured_while_a_plan_is_made():
    """A forward run while a plan is being made is measured too: its
    marks wait for the job (the last such forward's), and the forward
    that takes the plan hands them over at once. On the H100 the node's
    Flux measured 2 of its first 12 forwards when those went unmeasured
    (issue 27's before/after), and ran them on a schedule not settled."""
    with Patched(FakeClock()) as p:
        m, x, want, h = _threaded_mlp(cold_work=False)
        tun = h.tuner
        p.gate.clear()              # the first forward's plan waits
        for _ in range(3):
            assert torch.equal(m(x), want)
        assert tun.planner.pending and tun.rounds == 0
        assert tun.backlog is not None      # the third forward's marks
        p.gate.set()
        assert tun.planner.wait(WAIT)
        assert torch.equal(m(x), want)      # takes the plan: unmeasured
        assert tun.rounds == 1 and h.schedule() is not None
        assert tun.planner.pending and tun.backlog is None
        assert tun.planner.wait(WAIT)
        assert torch.equal(m(x), want)
        assert tun.rounds == 2


def test_marks_are_read_on_the_forwards_thread_once_run():
    """A measured forward's marks are read (its work per unit) on the
    forward's thread, at the next forward's start if the GPU ran it,
    else at a later one's: on CUDA each event read lets go of the GIL, and on
    the planner's thread each waited for the forward's thread to give it
    back (the node's SDXL on the H100: 1.4 s a job, the first plan taken
    at the 8th forward)."""
    me = threading.get_ident()
    with Patched(FakeClock()):
        m, x, want, h = _threaded_mlp(cold_work=False)
        tun = h.tuner
        ran = threading.Event()
        readers = []
        work = tun._work
        tun._ran = lambda mark: ran.is_set()

        def read(*a):
            readers.append(threading.get_ident())
            return work(*a)
        tun._work = read
        # The job held until the third forward's start is checked: done
        # before it (the forward's thread preempted on a loaded machine),
        # that start would take its plan and read the backlog too.
        go, submit = threading.Event(), tun.planner.submit
        tun.planner.submit = lambda job: submit(
            lambda: go.wait(WAIT) and job())
        for _ in range(2):
            assert torch.equal(m(x), want)
        # Not run yet: kept, the planner given nothing, the second
        # forward's marks held back behind it.
        assert tun.unread is not None and not tun.planner.pending
        assert tun.backlog is not None and readers == []
        ran.set()
        assert torch.equal(m(x), want)      # reads the first one's
        assert readers == [me] and tun.unread is None
        go.set()
        assert tun.planner.wait(WAIT)
        assert torch.equal(m(x), want)      # takes its plan
        assert tun.rounds == 1 and h.schedule() is not None
        assert readers == [me, me] and tun.backlog is None
        assert tun.planner.wait(WAIT)
        assert torch.equal(m(x), want)
        assert tun.rounds == 2


def test_a_plan_knows_torchs_peak_of_the_forward_it_measured():
    """A measured forward is handed to the planner at the next root
    forward's start, after the learn hook has read torch's peak of the
    measured one: the plan is made for the room that leaves (the node's
    Flux's first plan, handed over at its forward's end, was made for a
    room 0.9 GB too large and placed anew at the next forward)."""
    with Patched(FakeClock()):
        m, x, want, h = _threaded_mlp(cold_work=False)
        tun = h.tuner
        gov = devices.governor(h.device)
        budget = h.device.info()["budget"]
        seen, inputs = [], tun._inputs
        forwards = []

        def learn(module, args):    # torch's peak grew in the one before
            forwards.append(1)
            if len(forwards) == 2:
                gov.declare_torch(0, budget // 10)

        def read(rings=None):
            got = inputs(rings)
            seen.append(got["total"])
            return got
        tun._inputs = read
        h.root_hooks.set("learn", pre=learn)
        for _ in range(2):
            assert torch.equal(m(x), want)
        assert seen and seen[0] < budget, (seen, budget)
        assert seen[0] == h.device.info()["budget"]
        assert tun.planner.wait(WAIT)


def test_planned_on_the_forwards_thread_when_asked():
    """VPAGER_PLAN_THREAD=0 (the other tests' setting): the plan and the
    warm run at the measured forward's end, on its thread, as before."""
    clock = FakeClock()
    me = threading.get_ident()
    with Patched(clock), environ(VPAGER_PLAN_THREAD="0",
                                 VPAGER_PLACE_EARLY="0"):
        m, x, want, h = _scheduled_mlp()
        assert h.tuner.planner is None
        assert torch.equal(m(x), want)
        assert h.schedule() is not None     # planned at its end
        assert clock.of(me) >= PLAN_COST + WARM_COST, clock.charged
    h.unload()


def test_the_planners_processes_run_below_the_forwards_priority():
    """planproc.start() starts the planner's children at once (a plan the
    forward waits for waits for no interpreter to start), each at a lower
    priority than this process (POSIX: NICE more; Windows: below normal):
    a plan made while forwards run leaves a host-bound forward its core."""
    planproc.start()
    kids = [c.proc for c in planproc._CHILDREN.children]
    assert len(kids) == planproc.WIDTH and all(
        p is not None and p.poll() is None for p in kids), kids
    assert planproc.call("ring_fields", [1e-3], [[4096]], 1 << 20,
                         [1 << 16], 4096, 1e9, 512, 1, 4e-6,
                         5e-4) is not None      # (each child ran its start)
    planproc.call_each("ring_fields", [
        ([1e-3], [[4096]], 1 << 20, [1 << 16], 4096, 1e9, 512, 1, 4e-6,
         5e-4)] * len(kids))
    if hasattr(os, "getpriority"):
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for p in kids:
            assert os.getpriority(os.PRIO_PROCESS, p.pid) >= min(
                mine + planproc.NICE, 19), (mine, p.pid)


def test_the_planners_process_plans_as_this_one():
    """planproc.call("plan_job") (a child interpreter of its own, off the
    GIL) gives what schedule.plan_job gives here: the candidates, the
    pick's merged windows, the kept placement's figures; and so does a
    plan whose ring sizes the children planned one each (call_each)."""
    work = [1e-3 * (1 + (i % 7)) for i in range(60)]
    works = [work, [2 * t for t in work]]
    sizes = [[(64 << 10) * (1 + i % 3), 512] for i in range(60)]
    old = [i % 3 != 0 for i in range(120)]
    args = (work, works, sizes, 6 << 20, [1 << 20], 64 << 10,
            10e9, 512, 1, 4e-6, 5e-4, old, 1 << 20)
    there = planproc.call("plan_job", *args)
    assert there is not None, "no planner's process on this machine"
    here = schedule.plan_job(*args)
    assert there[0] == here
    assert any(not all(f[0]) for _, f in here["cands"])     # some streamed
    assert here["old"] is not None
    e = raises(RuntimeError, planproc.call, "plan_job", "not", "enough")
    assert "planner's process" in str(e), str(e)
    # Ring sizes planned each in a child of its own (call_each), then the
    # pick's windows: the same plan.
    rings = [1 << 20, 3 << 19, 1 << 19]
    args = (work, works, sizes, 6 << 20, rings, 64 << 10, 10e9, 512, 1,
            4e-6, 5e-4, old, 1 << 20)
    each = planproc.call_each("ring_fields", [
        (work, sizes, 6 << 20, [r], 64 << 10, 10e9, 512, 1, 4e-6, 5e-4)
        for r in rings])
    assert [r for cs in each for r, _ in cs] == rings
    # (and those between the pick and the next smaller: the caller's)
    cands = [c for cs in each for c in cs]
    more = schedule.rings_between(
        [(r, schedule.Schedule(*f)) for r, f in cands], 10e9, 64 << 10)
    cands = sorted(cands + [c for r in more for c in planproc.call(
        "ring_fields", work, sizes, 6 << 20, [r], 64 << 10, 10e9, 512, 1,
        4e-6, 5e-4)[0]], key=lambda c: -c[0])
    here = schedule.plan_job(*args)
    assert [r for r, _ in here["cands"]] == [r for r, _ in cands]
    assert planproc.call("plan_job", *args, None, None, cands)[0] == here
    remote = tuner.plan_job(*args[:8], old, 1 << 20, remote=True)
    assert remote.cands[here["pick"][0]][1].resident == \
        here["cands"][here["pick"][0]][1][0]


def test_the_nearest_set_is_planned_off_the_forwards_thread():
    """A plan whose pick keeps another resident set than the one in place:
    the set nearest the old one (schedule.nearest, what Tuner._nearest
    takes when it is predicted within NEAR), its predicted time and its
    windows come from the planner (plan_job's "near"), so the forward that
    takes the plan simulates nothing (first_prompt_sim, 800 units: that
    forward's take 11.5 -> 4.0 ms). Planned.near gives it only for the old
    set, the pick and the keep it was computed for."""
    work = [1e-3 * (1 + (i % 7)) for i in range(60)]
    works = [work, [2 * t for t in work]]
    sizes = [[(64 << 10) * (1 + i % 3), 512] for i in range(60)]
    old = [i < 60 for i in range(120)]
    args = (work, works, sizes, 6 << 20, [1 << 20], 64 << 10,
            10e9, 512, 1, 4e-6, 5e-4, old, 1 << 20, None, tuner.NEAR)
    here = schedule.plan_job(*args)
    pick = [f for _, f in here["cands"]][here["pick"][0]]
    res, t, window, merged = here["near"]
    assert res != pick[0] and res != old
    room = (6 << 20) - (1 << 20) - (64 << 10)
    assert res == schedule.nearest(old, pick[0], sizes, room, 64 << 10, 512)
    assert t <= pick[2] * (1 + tuner.NEAR)
    assert planproc.call("plan_job", *args)[0] == here
    planned = tuner.Planned(6 << 20, here, old, 1 << 20)
    sch = planned.cands[here["pick"][0]][1]
    assert planned.near(old, sch, None) == here["near"]
    assert planned.near(old, sch, [True] * 120) is False    # another keep
    assert planned.near([not r for r in old], sch, None) is False
    near = schedule.Schedule(res, window, t, 0, 0, 0.0)
    assert planned.merged(near) == merged


def test_a_placement_fills_while_it_streams():
    """The forward that takes a new placement fills its resident set by
    prefetch (windows grown by the next units' resident bytes, no units
    held), with no warm(); the forward after it has the planned windows
    and held units back and commits nothing more. (No placement before
    the first forward here: the measured plan may keep that one.)"""
    clock = FakeClock()
    with Patched(clock) as p, environ(VPAGER_PLACE_EARLY="0"):
        m, x, want, h = _threaded_mlp(cold_work=False)
        tun = h.tuner
        s0 = h.stats()["device"]
        for _ in range(3 * tuner.ROUNDS_MAX):
            # A plan for the forward measured meanwhile, handed over by
            # the one that takes a placement, waits: the next forward
            # takes nothing.
            p.gate.clear()
            assert torch.equal(m(x), want)
            if tun.filling is not None:
                break
            p.gate.set()
            assert tun.planner.wait(WAIT)
            s0 = h.stats()["device"]
        assert tun.filling is not None, "no placement was taken"
        filled = delta(h.stats()["device"], s0, "prefetch_bytes",
                       "pages_committed")
        assert filled["pages_committed"] > 0, filled
        planned, held = tun.filling
        units = tun._costs({})[0]
        grown = [u.window for u in units if u is not None]
        assert any(g > (p or 0) for g, p in zip(
            grown, [w for u, w in zip(units, planned) if u is not None]))
        s1 = h.stats()["device"]
        assert torch.equal(m(x), want)
        assert tun.filling is None      # no placement taken anew
        assert [u.window for u in units] == planned
        assert tun.model.held() == held
        after = delta(h.stats()["device"], s1, "pages_committed")
        assert after == {"pages_committed": 0}, after
        # (the plan may still be measuring: only its next placement moves)
        p.gate.set()
        if tun.planner.pending:
            assert tun.planner.wait(WAIT)
        assert clock.of(threading.get_ident()) == 0.0, clock.charged
    h.unload()


def _copies(m, x, want, h, n):
    """n forwards, the planner's end awaited after each (a plan lands at
    a known forward): per forward, (bytes copied to the device, pages
    committed or evicted)."""
    keys = ("fill_bytes", "prefetch_bytes", "staged_bytes",
            "prefetch_dropped_bytes", "pages_committed", "pages_evicted")
    out = []
    for _ in range(n):
        s0 = h.stats()["device"]
        assert torch.equal(m(x), want)
        assert h.tuner.planner.wait(WAIT)
        d = delta(h.stats()["device"], s0, *keys)
        out.append((d["fill_bytes"] + d["prefetch_bytes"] + d["staged_bytes"]
                    - d["prefetch_dropped_bytes"],
                    d["pages_committed"] + d["pages_evicted"]))
    return out


def test_every_forward_after_the_first_copies_as_a_steady_one():
    """offload() places the weights for a schedule guessed from their
    sizes (issue 29, point 2): before any forward the resident set lies
    first, ranked first, the watermark above it, and schedule() is None;
    the first forward fills it, and every later one (while the planner
    works, the one that takes its plan, those after) copies what the
    last one does and commits or evicts no page (exactly where the
    measured plan is the guessed one; else within 1.1 x).
    VPAGER_PLACE_EARLY=0
    places after the first forward: the forward that takes the plan
    copies more. Outputs bitwise."""
    m, x, want, h = _threaded_mlp(cold_work=False)
    assert h.order == "scheduled" and h.schedule() is None
    t = h.tuner
    flags = zip(t._costs({})[3], t.schedule.resident)     # guessed
    placed = {True: [], False: []}
    for e, r in flags:
        placed[r].append(e)
    assert placed[True] and placed[False], placed
    wm = h.vbar.get_watermark() * h.device.page_size
    assert max(e.offset + e.size for e in placed[True]) <= wm <= \
        min(e.offset for e in placed[False])
    guessed = list(t.schedule.resident)
    got = _copies(m, x, want, h, 8)
    steady = got[-1][0]
    if list(t.schedule.resident) == guessed:
        assert all(c == steady and moved == 0 for c, moved in got[1:]), got
    else:
        # The plan comes from measured times (the simulated device's too:
        # its compute is the host's), which may move a weight or two from
        # where the sizes guessed (the H100, and the simulated device on
        # the H100's 16-core host: 1.04 x the steady copies for two
        # forwards, one page moved): within issue 29's 1.1 x a steady step.
        assert all(c <= 1.1 * steady for c, _ in got[1:]), got
    assert h.schedule() is not None
    h.unload()
    with environ(VPAGER_PLACE_EARLY="0"):
        m, x, want, h = _threaded_mlp(cold_work=False)
    assert h.order == "interleaved"
    got = _copies(m, x, want, h, 8)
    assert max(c for c, _ in got[1:]) > got[-1][0], got
    h.unload()


def test_no_plan_from_the_cold_forward_when_asked():
    """VPAGER_COLD_PLAN=0: with the guessed placement in place, the first
    (cold) forward is measured but no plan is made from it: the first
    plan job works from two measured forwards (by default, from one).
    Outputs bitwise throughout; the schedule settles as it does by
    default."""
    for cold, first in (("1", 1), ("0", 2)):
        with Patched(FakeClock()), environ(VPAGER_COLD_PLAN=cold):
            seen = []
            real = tuner.plan_job

            def plan_job(work, works, *a, **kw):
                seen.append(len(works))
                return real(work, works, *a, **kw)
            tuner.plan_job = plan_job
            try:
                m, x, want, h = _threaded_mlp(cold_work=False)
                assert h.tuner.guessed
                _settle(m, x, want, h)
            finally:
                tuner.plan_job = real
            assert seen and seen[0] == first, (cold, seen)
            h.unload()


def test_plan_from_the_cold_forward_without_its_cold_start():
    """VPAGER_COLD_WORK=1: the first (cold) forward, its first hidden
    layer's work 50x the slowest unit's (a cold start), is planned for
    with that unit's work at the median of its kind (the same-shaped
    layers); by default as measured. Outputs stay bitwise."""
    real_work, real_apply = tuner.Tuner._work, tuner.Tuner.apply

    def cold_first(self, calls, start, end):
        work = real_work(self, calls, start, end)
        if not self.rounds:
            # 50x the slowest unit, not 50x its own: the work is measured
            # on the CPU, where a preempted layer ran 13x its kind's.
            slowest = max(work.values())
            for u in work:
                if u.name == "2":
                    work[u] = 50 * slowest
        return work
    for on in ("0", "1"):
        seen = []

        def apply(self, work, *a, **kw):
            seen.append(dict(work))
            return real_apply(self, work, *a, **kw)
        with environ(VPAGER_COLD_WORK=on):
            tuner.Tuner._work, tuner.Tuner.apply = cold_first, apply
            try:
                m, x, want, h = _threaded_mlp()
                _settle(m, x, want, h)
                first = {u.name: t for u, t in seen[0].items()}
                hidden = [first[n] for n in ("4", "6", "8", "10", "12",
                                             "14", "16")]
                if on == "1":
                    assert first["2"] <= max(hidden), (first, hidden)
                else:
                    assert first["2"] > 10 * max(hidden), (first, hidden)
                assert torch.equal(m(x), want)
            finally:
                tuner.Tuner._work, tuner.Tuner.apply = real_work, real_apply
            h.unload()


def test_cold_work_plans_at_the_first_forwards_end():
    """VPAGER_COLD_WORK=1 with the planner's thread: the first (cold)
    forward is planned for and placed at its own end, its resident set
    filled there (the cold step takes what placing costs): schedule()
    answers after one forward, and from the second on each forward copies
    what the last one does, committing and evicting nothing; the later
    plans keep the placement. Outputs bitwise."""
    with environ(VPAGER_COLD_WORK="1"):
        m, x, want, h = _threaded_mlp()
        got = _copies(m, x, want, h, 1)
        assert h.schedule() is not None and h.tuner.rounds == 1
        assert h.tuner.first_now
        placed = list(h.tuner.schedule.resident)
        got += _copies(m, x, want, h, 7)
        steady = got[-1][0]
        if list(h.tuner.schedule.resident) == placed:
            assert all(c == steady and moved == 0
                       for c, moved in got[1:]), got
        else:
            # A later plan 2% faster on the measured times (the simulated
            # device's compute is the host's: noise; on a GPU the cold
            # forward's times are the first kernels') placed anew, once:
            # the copies change at its forward and the one after, then
            # hold.
            changes = sum(1 for (a, _), (b, _) in zip(got[1:], got[2:])
                          if a != b)
            assert changes <= 2 and got[-2][0] == steady, got
        assert h.schedule()["settled"]
        h.unload()


def test_a_plan_from_the_cold_estimate_holds_as_the_step_would():
    """Whether holding the wholly resident units pays (tuner.HOLD_SHARE of
    the step) is judged on the cold estimate over COLD_OVER: the estimate
    runs up to that much over the step (SDXL: 115.7 ms for 83, and its
    360 resident units were not held through its first prompt)."""
    n = 30
    es = [types.SimpleNamespace() for _ in range(n)]
    units = [types.SimpleNamespace(entries=[e], buffers=()) for e in es]
    step = n * tuner.UNIT_HOST / tuner.HOLD_SHARE * 1.5   # not worth it
    sch = types.SimpleNamespace(resident=[True] * n, predicted=step)
    for estimated, want in ((False, 0), (True, n)):
        fake = types.SimpleNamespace(
            estimated=estimated, _costs=lambda w: (None, None, None, es),
            holdable=None, model=types.SimpleNamespace(
                hold=lambda held: held, held=lambda: ()))
        held = tuner.Tuner._hold(fake, units, sch)
        assert len(held) == want, (estimated, len(held))


def test_only_the_cold_plan_picks_its_ring_as_estimated():
    """VPAGER_COLD_WORK=1: the plan made from the cold forward's estimated
    work picks its ring with schedule.pick_ring's estimated (its compute
    overstated: COLD_OVER), on the forward's thread and in the planner's
    job alike; the plans from measured forwards after it do not. Outputs
    bitwise."""
    real = schedule.pick_ring
    seen = []

    def pick(cands, link, estimated=False):
        seen.append(estimated)
        return real(cands, link, estimated)
    schedule.pick_ring = pick
    try:
        with environ(VPAGER_COLD_WORK="1"):
            m, x, want, h = _threaded_mlp()
            assert torch.equal(m(x), want)
            assert h.tuner.rounds == 1 and seen and all(seen), seen
            cold = len(seen)
            assert not h.tuner.estimated
            _settle(m, x, want, h)
            assert len(seen) > cold and not any(seen[cold:]), seen
            h.unload()
    finally:
        schedule.pick_ring = real


def test_after_a_cold_plan_each_forward_measured_is_planned_for():
    """VPAGER_COLD_WORK=1: after the plan made at the cold forward's end
    (its work guessed, coldwork.py) each forward measured is planned for,
    not only the settled one: apply() keeps the placement unless 2%
    slower and takes the windows of the work measured, from the next
    forward on (the H100's Flux ran forwards 2-4 of its first prompt
    5-10% slower on the cold plan's windows than the same placement on
    the settled ones). By default the forwards between the first plan
    and the settled one are not. Outputs bitwise."""
    real = tuner.Tuner.apply
    saved = (tuner.ROUNDS_MAX, tuner.SETTLED, tuner.SETTLED_ABS)
    for on in ("1", "0"):
        seen = []

        def apply(self, work, *a, **kw):
            seen.append(self.rounds)
            return real(self, work, *a, **kw)
        with environ(VPAGER_COLD_WORK=on):
            # Measured to ROUNDS_MAX: forwards between the first plan
            # and the last.
            tuner.Tuner.apply = apply
            tuner.ROUNDS_MAX, tuner.SETTLED, tuner.SETTLED_ABS = 5, -1, -1
            try:
                m, x, want, h = _threaded_mlp()
                _settle(m, x, want, h)
                rounds = h.tuner.rounds
            finally:
                tuner.Tuner.apply = real
                tuner.ROUNDS_MAX, tuner.SETTLED, tuner.SETTLED_ABS = saved
            assert rounds == 5, rounds
            if on == "1":
                assert seen == list(range(1, rounds + 1)), (seen, rounds)
            else:
                assert len(seen) < rounds, (seen, rounds)
            h.unload()


def test_cold_work_kinds():
    """coldwork.warm_work: a unit's work at most its kind's median (the
    name with its numbers masked, the class, the weights' shapes), kinds
    of three or more; a unit of a smaller kind at most the largest of
    those medians (the H100's Flux: its one img_in 160 ms cold, 0.7
    warm); with no kind of three, all as measured."""
    from vpager.torch import coldwork

    class E:
        def __init__(self, shape):
            self.shape, self.dtype = shape, torch.float16

    class U:
        def __init__(self, name, module, shapes):
            self.name, self.module = name, module
            self.entries = [E(s) for s in shapes]
    lin, conv = torch.nn.Linear(1, 1), torch.nn.Conv1d(1, 1, 1)
    blocks = [U("blocks.%d.qkv" % i, lin, [(9, 3), (9,)]) for i in range(4)]
    other = U("blocks.9.qkv", lin, [(8, 3), (8,)])      # another shape
    convs = [U("blocks.%d.qkv" % i, conv, [(9, 3), (9,)]) for i in (5, 6)]
    work = {blocks[0]: 5.0, blocks[1]: 1.0, blocks[2]: 2.0,
            blocks[3]: 3.0, other: 7.0, convs[0]: 9.0, convs[1]: 1.0}
    got = coldwork.warm_work(work)
    assert [got[b] for b in blocks] == [2.5, 1.0, 2.0, 2.5], got
    assert got[other] == 2.5 and got[convs[0]] == 2.5, got
    assert got[convs[1]] == 1.0, got
    assert work[blocks[0]] == 5.0           # the input is left alone
    alone = {other: 7.0, convs[0]: 9.0}     # no kind of three
    assert coldwork.warm_work(alone) == alone


def _settle(m, x, want, h):
    """Forwards, each followed by the planner's end, until schedule()
    says it settled (measuring over, no plan pending); their count."""
    for n in range(1, 4 * tuner.ROUNDS_MAX + 1):
        assert torch.equal(m(x), want)
        assert h.tuner.planner.wait(WAIT)
        sch = h.schedule()
        if sch is not None and sch["settled"]:
            assert h.tuner.done and not h.tuner.planner.pending
            return n
    raise AssertionError("the schedule did not settle")


def test_a_placement_kept_over_a_faster_plan_is_placed_at_a_pause():
    """apply() keeps a placement predicted within 2% of the plan made for
    a forward measured (no forward of a first run stops to place); one
    predicted REFINE slower is marked (tuner.better, here any: REFINE
    -1) and placed at the client's next pause (OffloadHandle.refine():
    the node at a prompt's load), once the schedule settled: the plan
    made on the planner, taken at the next forward's start, its own
    resident set placed. Once; outputs bitwise."""
    saved = tuner.REFINE
    tuner.REFINE = -1.0
    try:
        m, x, want, h = _threaded_mlp()
        t = h.tuner
        assert not h.refine()               # nothing measured yet
        _settle(m, x, want, h)
        assert t.better, "no placement kept over a plan"
        name = next(n for n, _ in m.named_parameters())
        h.set_fill(name, lambda view: None)     # a LoRA's: not refined
        assert not h.refine() and t.better
        h.set_fill(name, None)
        assert torch.equal(m(x), want)          # the fills' own replan
        assert h.tuner.planner.wait(WAIT)
        t.better = True
        replans = t.replans
        assert h.refine() and not t.better and t.replans == replans + 1
        assert not h.refine()               # asked once
        seen = []
        real = tuner.Tuner.apply

        def apply(self, work, *a, **kw):
            seen.append(kw.get("replan"))
            return real(self, work, *a, **kw)
        tuner.Tuner.apply = apply
        try:
            assert h.tuner.planner.wait(WAIT)
            assert torch.equal(m(x), want)  # takes and places it
        finally:
            tuner.Tuner.apply = real
        assert seen == ["refine"], seen
        assert not t.better and h.schedule()["settled"]
        for _ in range(3):
            assert torch.equal(m(x), want)
            assert h.tuner.planner.wait(WAIT)
        assert not h.refine()
        h.unload()
        raises(RuntimeError, h.refine)      # its offload was undone
    finally:
        tuner.REFINE = saved


def test_a_placement_kept_in_place_is_marked_for_the_pause():
    """A placement in a forward whose set _placed kept in place, predicted
    REFINE slower than the plan's own (here made so), marks the plan
    better: the client's next pause (refine()) plans again, there to
    fill what its own set moves if that pays (PAYBACK); a refine's own
    placement marks nothing. Outputs bitwise."""
    real = tuner.Tuner._placed

    def kept_slower(self, lay, flat, sch, w, sizes, ring, keep,
                    refine=False):
        got, placed = real(self, lay, flat, sch, w, sizes, ring, keep,
                           refine)
        if refine:
            return got, placed
        return schedule.Schedule(
            got.resident, got.window, sch.predicted * (1 + 2 * tuner.REFINE)
            + 1e-6, got.streamed, got.resident_bytes,
            got.all_resident), placed
    tuner.Tuner._placed = kept_slower
    try:
        m, x, want, h, full = _settled_a_page_below()
        t = h.tuner
        # A placement for less room (apply()'s "room": no keep path that
        # marks a plan of its own) made between two forwards.
        governor(h.device).declare_budget(full - 4 * PAGE)
        assert t.planner.wait(WAIT) and not t.better
        t.apply(t.work, replan="room")
        assert t.better, "a placement kept in place was not marked"
        assert h.refine() and not t.better
        assert t.planner.wait(WAIT)
        assert torch.equal(m(x), want)      # the refine taken
        assert not t.better and not h.refine()
        for _ in range(2):
            assert torch.equal(m(x), want)
        h.unload()
    finally:
        tuner.Tuner._placed = real


def _settled_a_page_below(pages=1):
    """The threaded MLP settled under its budget less `pages` pages, no
    plan marked better: (m, x, want, h, the full budget)."""
    m, x, want, h = _threaded_mlp()
    full = h.device.info()["budget"]
    governor(h.device).declare_budget(full - pages * PAGE)
    _settle(m, x, want, h)
    h.tuner.better = False
    return m, x, want, h, full


def test_a_budget_grown_since_the_plan_is_planned_for_at_a_pause():
    """The budget grows by less than the watch's GROW (the Governor's
    margin settled: 4% of torch's peak): nothing is planned anew at the
    forwards; at the client's next pause (refine()) the schedule is made
    for the new budget, once, and more stays resident. Outputs bitwise."""
    real, grow = tuner.Tuner._work, tuner.GROW
    # Each unit's work fixed and short, so that more resident is predicted
    # faster whatever the host's speed (the simulated device computes on
    # it: on a quick host the MLP's measured work hides a page's copy, and
    # the refine rightly keeps the placement); the budget grown by a
    # weight's pages, the watch's GROW widened to match.
    tuner.Tuner._work = lambda self, *a: dict.fromkeys(real(self, *a), 1e-5)
    tuner.GROW = 3.0
    try:
        _a_budget_grown_is_planned_for_at_a_pause()
    finally:
        tuner.Tuner._work, tuner.GROW = real, grow


def _a_budget_grown_is_planned_for_at_a_pause():
    m, x, want, h, full = _settled_a_page_below(pages=5)
    t, dev = h.tuner, h.device
    was = t.planned_for
    resident = h.stats()["model"]["resident_bytes"]
    assert not h.refine()                   # the budget as planned for
    governor(dev).declare_budget(full)
    replans = t.replans
    for _ in range(3):                      # within GROW: no plan
        assert torch.equal(m(x), want)
        assert h.tuner.planner.wait(WAIT)
    assert t.replans == replans and t.planned_for == was
    assert h.refine() and t.replans == replans + 1
    assert not h.refine()                   # asked once
    assert h.tuner.planner.wait(WAIT)
    assert torch.equal(m(x), want)          # takes and places it
    assert t.planned_for >= was + 5 * PAGE, (t.planned_for, was)
    for _ in range(2):
        assert torch.equal(m(x), want)
        assert h.tuner.planner.wait(WAIT)
    assert h.stats()["model"]["resident_bytes"] > resident
    assert not h.refine()
    h.unload()


def test_a_refined_placement_no_faster_is_not_placed():
    """refine() plans for a grown budget, but the placement that plan
    comes to (here made to predict a forward slower than the one in
    hand: _placed's set kept in place to spare fills streams more) is
    not placed: the forward after commits and evicts nothing and keeps
    the resident set it had. Outputs bitwise."""
    m, x, want, h, full = _settled_a_page_below()
    t, dev = h.tuner, h.device
    resident = list(t.schedule.resident)
    governor(dev).declare_budget(full)
    real = tuner.Tuner._placed

    def slower(self, *a, **kw):
        sch, placed = real(self, *a, **kw)
        return schedule.Schedule(sch.resident, sch.window, 1e9, sch.streamed,
                                 sch.resident_bytes, sch.all_resident), placed
    tuner.Tuner._placed = slower
    try:
        assert h.refine()
        assert h.tuner.planner.wait(WAIT)
        s0 = h.stats()["device"]
        assert torch.equal(m(x), want)      # takes the plan: kept
        d = delta(h.stats()["device"], s0, "pages_committed",
                  "pages_evicted")
    finally:
        tuner.Tuner._placed = real
    assert d == {"pages_committed": 0, "pages_evicted": 0}, d
    assert list(t.schedule.resident) == resident
    for _ in range(2):
        assert torch.equal(m(x), want)
    h.unload()


def test_a_refine_no_faster_than_the_placement_in_hand_places_nothing():
    """refine()'s plan for a grown budget predicted no REFINE faster than
    the placement in hand (here: that one predicted to take no time) is
    not placed, nor is a placement even chosen for it (_placed's host
    time, 20 ms of a step for the node's Flux)."""
    m, x, want, h, full = _settled_a_page_below()
    t = h.tuner
    resident = list(t.schedule.resident)
    governor(h.device).declare_budget(full)
    saved = tuner.Tuner._predicted, tuner.Tuner._placed
    chosen = []
    tuner.Tuner._predicted = lambda self, old, w, sizes: 0.0
    tuner.Tuner._placed = lambda self, *a: chosen.append(a) or \
        saved[1](self, *a)
    try:
        assert h.refine()
        assert h.tuner.planner.wait(WAIT)
        assert torch.equal(m(x), want)      # takes the plan: kept
    finally:
        tuner.Tuner._predicted, tuner.Tuner._placed = saved
    assert chosen == [] and list(t.schedule.resident) == resident
    h.unload()


def test_the_schedule_says_when_it_settled():
    """schedule()["settled"] (what a benchmark waits for before it times
    the steady state: bench/benchlib.settle): not while a plan is being
    made, nor while forwards are still measured; once it is, the
    forwards after copy what the one before did and commit or evict no
    page, and it stays so."""
    clock = FakeClock()
    with Patched(clock) as p:
        m, x, want, h = _threaded_mlp(cold_work=False)
        p.gate.clear()              # the first plan held
        for _ in range(3):
            assert torch.equal(m(x), want)
            sch = h.schedule()
            assert sch is None or not sch["settled"], sch
        assert h.tuner.planner.pending
        p.gate.set()
        _settle(m, x, want, h)
    got = _copies(m, x, want, h, 4)
    assert all(c == got[0][0] and moved == 0 for c, moved in got), got
    assert h.schedule()["settled"]
    h.unload()


def test_a_new_room_is_planned_off_the_forwards_thread():
    """The device's budget falls after the schedule settled: the watch
    hands the plan for the new room to the planner, a later forward's
    start applies it (the resident set fits the room, steady forwards
    commit nothing), no plan or warm on the forward's thread."""
    clock = FakeClock()
    old = tuner.WATCH_EVERY
    tuner.WATCH_EVERY = 0.0
    try:
        with Patched(clock):
            m, x, want, h = _threaded_mlp(cold_work=False)
            _settle(m, x, want, h)
            first = h.schedule()
            assert first["replans"] == 0 and first["resident_weights"] > 0
            h.device.set_limit(600 << 10)
            assert torch.equal(m(x), want)      # the watch hands it over
            assert h.tuner.planner.pending
            assert h.schedule()["resident_bytes"] == first["resident_bytes"]
            assert h.tuner.planner.wait(WAIT)
            assert torch.equal(m(x), want)      # taken at its start
            low = h.schedule()
            assert low["replans"] == 1, low
            assert low["resident_bytes"] <= (600 - 320) << 10, low
            for _ in range(2):                  # the filling one, then
                assert torch.equal(m(x), want)
            s0 = h.stats()["device"]
            for _ in range(3):
                assert torch.equal(m(x), want)
            d = delta(h.stats()["device"], s0, "pages_committed",
                      "pages_evicted")
            assert d == {"pages_committed": 0, "pages_evicted": 0}, d
            assert clock.of(threading.get_ident()) == 0.0, clock.charged
    finally:
        tuner.WATCH_EVERY = old
    h.unload()


def test_a_weight_given_a_fill_is_planned_on_the_forwards_thread():
    """A streamed weight given a fill (a LoRA): the plan keeping it
    resident is made at the next forward's start on its thread (one
    ring), not handed to the planner, so that forward fills it in its
    resident place: its patch runs once, and its temporaries' peak is
    read as a one-off (hotpath.fill), not as every forward's."""
    old, saved = tuner.WATCH_EVERY, vt._torch_reserved
    tuner.WATCH_EVERY = 0.0
    try:
        m, x, want, h = _threaded_mlp(cold_work=False)
        _settle(m, x, want, h)
        t = h.tuner
        flat = t._costs({})[3]
        streamed = [e.name for e, r in zip(flat, t.schedule.resident)
                    if not r and e.name.endswith("weight")]
        assert streamed
        name = streamed[0]
        h.set_fill(name, lambda v: v.mul_(2))
        ref = mlp(depth=8)              # the same seed's weights
        ref.get_parameter(name).data.mul_(2)
        vt._torch_reserved = lambda index: (0, 0)
        hot = h.hot_path
        hot.learns = True               # torch read as on CUDA: a stand-in
        replans = t.replans
        with torch.no_grad():
            assert torch.equal(m(x), ref(x))
        assert t.replans == replans + 1 and not t.planner.pending
        flat = t._costs({})[3]
        assert dict((e.name, r) for e, r in
                    zip(flat, t.schedule.resident))[name]
        assert hot.peak_before_fills is not None and not hot.streamed_fills
    finally:
        tuner.WATCH_EVERY, vt._torch_reserved = old, saved
    h.hot_path.learns = False
    h.unload()


PROMPTS = 10
STEPS = 4
COUNTS = ("bytes_copied", "staged_bytes", "copies", "pages_committed", "pages_evicted",
          "misses", "fills")


def test_ten_prompts_cost_the_same():
    """10 prompts of STEPS forwards, the planner's thread on: the first
    prompt measures and places; from the second on every prompt copies,
    commits and evicts the same (the node's "second run slower" kind of
    drift would show here). Outputs bitwise throughout."""
    m, x, want, h = _threaded_mlp()
    per_prompt = []
    for _ in range(PROMPTS):
        s0 = h.stats()["device"]
        for _ in range(STEPS):
            assert torch.equal(m(x), want)
            # What a GPU forward's length gives the planner: time to finish.
            assert h.tuner.planner.wait(WAIT)
        per_prompt.append(delta(h.stats()["device"], s0, *COUNTS))
    assert h.tuner.done and h.schedule() is not None
    later = per_prompt[1:]
    assert all(c == later[0] for c in later), per_prompt
    h.unload()


def _remembering(tmp):
    """_threaded_mlp() offloaded with VPAGER_PLAN_CACHE=tmp, settled: the
    file it wrote and the work it remembered ({unit name: seconds})."""
    with environ(VPAGER_PLAN_CACHE=tmp):
        m, x, want, h = _threaded_mlp()
        _settle(m, x, want, h)
        h.unload()
    files = glob.glob(os.path.join(tmp, "plan-*.json"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        got = json.load(f)
    assert got["settled"] is True, got
    return files[0], dict(zip(got["units"], got["work"]))


def test_a_remembered_plan_is_placed_at_the_first_forwards_end():
    """VPAGER_PLAN_CACHE: a model that settled writes each unit's work;
    the same model offloaded again (another process's view: a new
    offload, new weights of the same shapes) plans from that work at its
    first forward's end (schedule()["remembered"]), not from the cold
    forward's, and from the second forward on each copies what the last
    does (at most one later plan 2% faster on the simulated device's
    noisy times). The work remembered settled is trusted: no forward
    after the cold one measured (marks cost a host-bound step). Outputs
    bitwise."""
    real_apply = tuner.Tuner.apply
    with tempfile.TemporaryDirectory() as tmp:
        _, remembered = _remembering(tmp)
        seen = []

        def apply(self, work, *a, **kw):
            seen.append({u.name: t for u, t in work.items()})
            return real_apply(self, work, *a, **kw)
        tuner.Tuner.apply = apply
        try:
            with environ(VPAGER_PLAN_CACHE=tmp):
                m, x, want, h = _threaded_mlp()
                got = _copies(m, x, want, h, 1)
                assert h.schedule() is not None, "no plan at forward 1"
                assert h.schedule()["remembered"] and h.tuner.rounds == 1
                assert seen[0] == remembered, (seen[0], remembered)
                assert h.tuner.done
                marks = []
                h.tuner._mark = lambda *a: marks.append(a)
                got += _copies(m, x, want, h, 7)
                assert h.tuner.rounds == 1 and not marks, len(marks)
        finally:
            tuner.Tuner.apply = real_apply
        steady = got[-1][0]
        assert sum(1 for c, moved in got[1:] if c != steady or moved)\
            <= 1, got
        h.unload()


def test_the_work_measured_is_remembered_before_it_settles():
    """VPAGER_PLAN_CACHE with a schedule that has not settled (SDXL's
    host-bound forwards, measured 6% apart, had not after two prompts):
    the work merged so far is written once a forward after the cold one
    was measured, by the planner's job (no forward's time), or without
    the planner's thread at the client's pause (refine()), once for each
    work; the model offloaded again plans from it at its first
    forward's end."""
    saved = tuner.ROUNDS, tuner.ROUNDS_MAX
    tuner.ROUNDS = tuner.ROUNDS_MAX = 1000          # never settles here
    try:
        for thread in (True, False):
            with tempfile.TemporaryDirectory() as tmp, \
                    environ(VPAGER_PLAN_CACHE=tmp):
                files = os.path.join(tmp, "plan-*.json")
                m, x, want, h = (_threaded_mlp() if thread
                                 else _scheduled_mlp())
                t = h.tuner
                assert torch.equal(m(x), want)
                h.refine()
                assert glob.glob(files) == []   # the cold forward's alone
                while t.rounds < 3:
                    assert torch.equal(m(x), want)
                    assert t.planner is None or t.planner.wait(WAIT)
                assert not t.done
                if not thread:
                    assert glob.glob(files) == []
                    h.refine()
                    path, = glob.glob(files)
                    os.remove(path)
                    h.refine()                  # the same work: not again
                    assert glob.glob(files) == []
                    assert torch.equal(m(x), want)
                    h.refine()
                path, = glob.glob(files)
                with open(path) as f:
                    got = json.load(f)
                assert got["units"] == [u.name for u in t.work]
                assert got["settled"] is False
                h.unload()
                m, x, want, h = _threaded_mlp()
                assert torch.equal(m(x), want)
                assert h.schedule()["remembered"], thread
                # Not settled: measured on.
                assert not h.tuner.done
                for _ in range(3):
                    assert torch.equal(m(x), want)
                    assert h.tuner.planner.wait(WAIT)
                assert h.tuner.rounds > 1
                h.unload()
    finally:
        tuner.ROUNDS, tuner.ROUNDS_MAX = saved


def test_a_plan_cache_file_that_does_not_match_is_ignored():
    """A remembered file that does not read, or names other units, or
    inputs of other shapes (another key): the model plans as it would
    without (one warning, no error), outputs bitwise, and the file is
    written anew once it settles. A folder that cannot be written: one
    warning, the model runs on."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = _remembering(tmp)
        for bad in ("{not json", json.dumps({"version": 1, "units": ["x"],
                                             "work": [1.0]})):
            with open(path, "w") as f:
                f.write(bad)
            with environ(VPAGER_PLAN_CACHE=tmp), \
                    warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                plancache._warned.clear()
                m, x, want, h = _threaded_mlp()
                _settle(m, x, want, h)
                assert not h.schedule()["remembered"]
                h.unload()
            assert any("plan cache" in str(i.message) for i in w), \
                [str(i.message) for i in w]
            with open(path) as f:
                assert json.load(f)["units"] != ["x"]
        # Inputs of another shape: another key, nothing remembered.
        with environ(VPAGER_PLAN_CACHE=tmp):
            m, x, want, h = _threaded_mlp()
            assert torch.equal(m(x[:3]), want[:3])
            assert h.tuner.planner.wait(WAIT)
            assert not h.tuner.remembered
            h.unload()
        blocked = os.path.join(tmp, "a-file")
        open(blocked, "w").close()
        with environ(VPAGER_PLAN_CACHE=os.path.join(blocked, "plans")), \
                warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            plancache._warned.clear()
            m, x, want, h = _threaded_mlp()
            _settle(m, x, want, h)
            h.unload()
        assert any("cannot be written" in str(i.message) for i in w)


def test_the_plan_cache_is_on_by_default_in_the_users_cache_folder():
    """VPAGER_PLAN_CACHE unset: vpager/plans in the user's cache folder
    ($XDG_CACHE_HOME, else ~/.cache; %LOCALAPPDATA% on Windows), where a
    settled model writes its plan; "0" / "off" (any case): none, nothing
    written."""
    saved = os.environ.pop("VPAGER_PLAN_CACHE", None)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with environ(XDG_CACHE_HOME=tmp, LOCALAPPDATA=tmp):
                want = os.path.join(tmp, "vpager", "plans")
                assert plancache.folder() == want, plancache.folder()
                m, x, want_out, h = _threaded_mlp()
                _settle(m, x, want_out, h)
                h.unload()
                assert glob.glob(os.path.join(want, "plan-*.json"))
                for off in ("0", "off", "OFF"):
                    with environ(VPAGER_PLAN_CACHE=off):
                        assert plancache.folder() is None
    finally:
        if saved is not None:
            os.environ["VPAGER_PLAN_CACHE"] = saved


def test_cold_work_plans_as_the_settled_plan_on_the_h100s_logs():
    """bench/cold_plan.py on the H100's Flux logs (bench/data): the plan
    made from the cold forward's work as coldwork.warm_work takes it is
    within 1% of the plan made from the warm work, under the warm work
    (the tuner places anew only for 2%); as measured, 7% off."""
    sys.path.insert(0, os.path.join(_runner.REPO, "bench"))
    import cold_plan
    logs = cold_plan.logs()
    assert len(logs) == 2, logs
    for path in logs:
        head, rows = cold_plan.compare(path)
        got = {name: ratio for name, _, _, ratio, _, _ in rows}
        assert got["cold, coldwork.warm_work"] <= 1.01, (head, rows)
        assert got["cold, as measured"] > 1.05, (head, rows)
        # --rings: a ring of two large units' copies plans at its room's
        # link term; a smaller one stalls (what the ring costs a step).
        head, rows = cold_plan.ring_rows(path)
        got = {ring >> 20: t / term for ring, t, term in rows}
        assert got[378] <= 1.01 and got[160] > 1.2, (head, got)
        # --keep: kept weights beyond the room, as many kept as fit.
        head, rows = cold_plan.keep_rows(path, 8)
        (_, _, free), (_, _, kept) = rows
        assert kept.resident_bytes <= free.resident_bytes + (2 << 20)
        assert "4 kept" in head, head


class _FakeEvent:
    """torch.cuda.Event as the tuner's marks use it, its time a counter."""
    made = 0
    clock = 0.0

    def __init__(self, enable_timing=False):
        type(self).made += 1
        self.t = None

    def record(self, stream=None):
        type(self).clock += 1.0
        self.t = type(self).clock
        self.stream = stream

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return other.t - self.t


class _FakeStream:
    def __init__(self, handle):
        self.cuda_stream = handle


def test_marks_reuse_their_stream_and_events():
    """The CUDA tuner's marks (the hot path's, host-bound models pay two a
    unit): recorded on the Stream object kept for the handle the hot path
    gives (torch.cuda.current_stream asked once), and a forward's events,
    once read, used for the next forward's marks (none made anew); the
    work read from them as before. No GPU: torch.cuda's Event and
    current_stream stand-ins, the Tuner's methods on a bare object."""
    asked = []
    real = torch.cuda.Event, torch.cuda.current_stream
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda *a: asked.append(a) or _FakeStream(7)
    try:
        t = tuner.Tuner.__new__(tuner.Tuner)
        t.cuda, t.target = True, torch.device("cuda", 0)
        t.streams, t.events = {}, []
        units = ["a", "b", "c"]

        def forward():
            start = t._mark()
            calls = []
            for u in units:
                calls.append([u, t._mark(7), None])
                calls[-1][2] = t._mark(7)
            return calls, start, t._mark()
        calls, start, end = forward()
        assert _FakeEvent.made == 8 and len(asked) == 3, (_FakeEvent.made,
                                                         asked)
        work = t._work(calls, start, end)
        # Each unit: the end of its acquire to the next one's start (c: to
        # the end mark, plus the start mark to a's, cyclic): ms -> s.
        assert work == {"a": 0.001, "b": 0.001, "c": 0.002}, work
        assert len(t.events) == 8
        made = _FakeEvent.made
        calls, start, end = forward()
        assert _FakeEvent.made == made and not t.events
        assert len(asked) == 5          # the start and end marks only
        assert t._work(calls, start, end) == work
        # A held unit's call: one event for both its marks (hotpath.hold),
        # pooled once, so no later mark records over another's.
        calls, start, end = forward()
        m = t._mark(7)
        calls[1][1:] = [m, m]
        t.events.clear()
        t._work(calls, start, end)
        assert len({id(e) for e in t.events}) == len(t.events) == 7, \
            len(t.events)
        calls, start, end = forward()
        assert t._work(calls, start, end) == work
        # A handle the current stream does not have (the stand-in's is 7):
        # nothing kept under it.
        t._mark(9)
        assert 7 in t.streams and 9 not in t.streams
    finally:
        torch.cuda.Event, torch.cuda.current_stream = real


def test_a_forward_marks_a_span_of_its_calls():
    """VPAGER_MARK_CALLS=3 on the 10-unit MLP: after the cold forward
    (every call marked: how many a forward makes), each measured forward
    marks at most 3 calls and the start of the next (a span's end), the
    spans of 4 forwards read as one measured forward that has every
    unit's work; the plans and the outputs as ever (bitwise). On a
    host-bound model each mark costs the step (SDXL: 1.15-1.23 x)."""
    spans, works = [], []
    real_read, real_work = tuner.Tuner._spans_read, tuner.Tuner._work

    def spans_read(self, calls, end):
        spans.append((sum(c[0] is not None for c in calls),
                      sum(c[0] is None for c in calls)))
        return real_read(self, calls, end)

    def work(self, calls, start, end):
        got = real_work(self, calls, start, end)
        works.append(set(got))
        return got
    tuner.Tuner._spans_read, tuner.Tuner._work = spans_read, work
    try:
        with environ(VPAGER_MARK_CALLS="3"):
            m, x, want, h = _threaded_mlp()
        t = h.tuner
        units = set(h.tuner.layout.units)
        assert torch.equal(m(x), want)
        assert t.call_count == len(units) == 10, t.call_count
        assert spans == [(10, 0)] and works == [units], (spans, works)
        while t.rounds < 3 and not t.done:
            assert torch.equal(m(x), want)
            assert t.planner.wait(WAIT)
        # Spans of 10 calls in 4: calls 0-1, 2-4, 5-6, 7-9; each but the
        # last with the next call's mark.
        got = spans[1:]
        assert got[:4] == [(2, 1), (3, 1), (2, 1), (3, 0)], got
        assert all(c <= 3 and e <= 1 for c, e in got), got
        assert works and all(w == units for w in works), works
        assert t.rounds >= 2, t.rounds
        for _ in range(3):
            assert torch.equal(m(x), want)
        h.unload()
    finally:
        tuner.Tuner._spans_read, tuner.Tuner._work = real_read, real_work


def test_spans_read_as_one_forward():
    """A CUDA model of 4 unit calls marked 2 a forward (MARK_CALLS): the
    first span (calls 0-1 and the start of call 2) read at the next
    forward's start, its events pooled, the second (calls 2-3, the
    forward's end) read with it as one forward: each unit's work as a
    forward marked whole reads it (the held unit's one mark too; the
    waits in the acquires left out; the cyclic start to the last unit).
    No GPU: torch.cuda's Event and current_stream stand-ins (each mark
    advances their clock 1 ms), the Tuner's methods on a bare object."""
    real = torch.cuda.Event, torch.cuda.current_stream
    torch.cuda.Event = _FakeEvent
    torch.cuda.current_stream = lambda *a: _FakeStream(7)
    try:
        t = tuner.Tuner.__new__(tuner.Tuner)
        t.cuda, t.target, t.tracing = True, torch.device("cuda", 0), False
        t.streams, t.events, t.calls = {}, [], []
        t.layout = types.SimpleNamespace(units=list("abcd"))
        t._drop_spans()
        compute = {"a": 10.0, "b": 20.0, "c": 30.0, "d": 40.0}

        def forward():
            t.calls, t.ncall, t.span = [], 0, t._span()
            t.start = t._mark()
            _FakeEvent.clock += 5.0             # before the first unit
            for u in "abcd":
                if u == "b":
                    t.held(u, 7)
                else:
                    t.before(u, 7)
                    _FakeEvent.clock += 3.0     # its wait for a copy
                    t.after(7)
                _FakeEvent.clock += compute[u]
            end = t._mark()
            return t._spans_read(t.calls, end), end

        t.mark_calls, t.call_count = 0, None
        (calls, start), end = forward()
        assert len(calls) == 4 and t.call_count == 4
        whole = t._work(calls, start, end)
        assert whole == {"a": 0.011, "b": 0.021, "c": 0.031,
                         "d": 0.047}, whole
        t.mark_calls = 2
        for _ in range(2):
            made = _FakeEvent.made
            got, _ = forward()
            assert got is None and t.part_unread is not None
            assert [c[0] for c in t.part_unread[0]] == ["a", "b", None]
            t._read_span()                      # the next forward's start
            assert t.part_unread is None and t.nparts == 1
            (calls, start), end = forward()
            assert t.nparts == 0 and t.parts == []
            assert t._work(calls, start, end) == whole
            assert _FakeEvent.made == made      # every mark from the pool
    finally:
        torch.cuda.Event, torch.cuda.current_stream = real


def test_between_takes_the_least_recent_gap():
    """between.Between on a fake clock: a gap from a measured forward's
    end to the next forward's start, read once the GPU ran it; none
    across a forward that was not marked; the least of the last SAMPLES
    used, at most SHARE of the forward (a pause between prompts is no
    step's); none used unless VPAGER_BETWEEN=1."""
    from vpager.torch import between
    now = [0.0]
    ran = [True]
    with environ(VPAGER_BETWEEN="1"):
        b = between.Between(lambda: now[0], lambda a, c: c - a,
                            lambda m: ran[0])
    assert b.gap(1.0) == 0.0
    b.ended(1)
    now[0] = 0.010
    b.began(2)
    assert b.samples == [], b.samples      # read at a later call
    b.read()
    assert b.samples == [0.010], b.samples
    b.ended(2)
    now[0] = 1.0
    b.began(4)                  # forward 3 began and ended unmarked
    assert b.samples == [0.010] and b.pair is None, b.samples
    b.ended(4)
    now[0] = 6.0                # a pause: a decode, the next prompt
    ran[0] = False
    b.began(5)
    assert b.samples == [0.010] and b.pair is not None
    b.ended(5)
    b.began(6)                  # one pair unread at a time: no new one
    assert b.samples == [0.010] and b.pair[1] == 6.0, b.pair
    ran[0] = True
    b.read()
    assert b.samples == [0.010, 5.0], b.samples
    assert b.gap(1.0) == 0.010 and b.gap(0.02) == 0.02 * between.SHARE
    # SAMPLES gaps of 0.5 s later the 10 ms one is no longer among them.
    for k in range(7, 7 + between.SAMPLES):
        b.ended(k - 1)
        now[0] += 0.5
        b.began(k)
    b.read()
    assert b.samples == [0.5] * between.SAMPLES and b.gap(10.0) == 0.5, \
        b.samples
    # By default forwards are planned back to back: nothing marked.
    off = between.Between(lambda: now[0], lambda a, c: c - a,
                          lambda m: True)
    off.ended(1)
    now[0] += 0.5
    off.began(2)
    off.read()
    assert off.end is None and off.pair is None and off.gap(10.0) == 0.0


def test_the_gap_between_forwards_is_planned_for():
    """The scheduled MLP measured with a pause between its forwards (a
    sampler's own work): the tuner reads each gap and plans for the
    least of them after the last unit (cyclic), in the work lists it
    plans and sets windows from, not in the work it keeps or settles
    on; outputs bitwise. VPAGER_BETWEEN=1 (off by default)."""
    pause = 0.02
    with environ(VPAGER_BETWEEN="1"):
        m, x, want, h = _threaded_mlp()
    t = h.tuner
    assert torch.equal(m(x), want)
    while not t.done:
        time.sleep(pause)
        assert torch.equal(m(x), want)
        assert t.planner.wait(WAIT)
    assert t.between.samples and min(t.between.samples) >= pause, \
        t.between.samples
    gap = t._between()
    assert 0 < gap <= min(t.between.samples), gap
    units, w, _, _ = t._costs(t.work)
    plain = [t.work.get(u, 0.0) for u in units]
    assert w[:-1] == plain[:-1] and abs(w[-1] - plain[-1] - gap) < 1e-12
    assert t._costs({})[1] == [0.0] * len(units)
    assert sum(t.work.values()) == sum(plain)      # kept without it
    inputs = t._inputs()
    assert inputs["between"] == gap
    assert torch.equal(m(x), want)
    h.unload()


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
