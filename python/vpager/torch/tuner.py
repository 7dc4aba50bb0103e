"""The measured forward and the schedule applied (schedule.py decides).

Before any forward, when the weights do not all fit, offload() places
them for a schedule guessed from their sizes (guess(): the measured one
keeps that placement unless it predicts a clear gain, and a placement
anew leaves the weights both keep resident where they lie, _placement).

The module's first complete forward (not inside acquired(), not one that
raised) is measured: a mark before and after each unit's acquire (CUDA:
timing events on the compute stream, so the acquire's wait for copies
falls between the two and is left out; the simulated device: the host
clock, its compute being the CPU's), one at the start and one at the end
of the forward. A unit's work is the time from the end of its acquire to
the start of the next unit's: its own compute and what the module
computes before the next unit. The link is timed once per process and
GPU (a pinned host-to-device copy); the simulated device uses a fixed
figure, so its decisions depend only on the measured compute.

Right after that forward (after the re-placement in execution order,
replace.py), schedule.plan() picks the resident set, the staging ring
(among the sizes the largest unit allows, when vpager.torch sized it)
and each unit's prefetch window; the weights are placed again, the
resident ones together at the start (placement.place_resident_first),
the VBAR gets the matching eviction order (vp_vbar_set_ranks: resident
runs first), and each unit's acquire sets the device's lookahead to its
window. All of it once: the order stays the same for every later forward, unless the
device's budget moves (other processes, torch's activations): then the
schedule is made again from the measured costs for the room there is
(WATCH_EVERY), so weights it counted resident and lost are streamed in
its windows, not missed one by one."""

import sys
import threading
import time
import warnings

import torch

from .. import PAGE_RESIDENT, env
from ..errors import BusyError, Error
from ..hostbuf import HostBuf
from ..weights import WeightBatch
from . import coldwork, plancache, planproc, relocate, schedule, views
from .between import Between
from .devices import learn_headroom, ring_pages
from .placement import (pages_touched, place_apart, place_moving_least,
                        place_streaming_least,
                        place_resident_first, scheduled_ranks, staging_need)

PER_COPY = 4e-6             # seconds a copy costs beyond its bytes
SLACK = 1.5                 # a window up to this much larger is kept
# Pages of the budget a plan leaves free beside the resident set and the
# ring (torch may take a little between two watches, below). Each is link
# time every forward (32 MiB: 0.6 ms on the H200): one, not two.
SPARE_PAGES = 1
SPARE = "VPAGER_SPARE_PAGES"


def spare_pages():
    """The pages a plan leaves free (VPAGER_SPARE_PAGES, else SPARE_PAGES)."""
    given = env.count(SPARE)
    return SPARE_PAGES if given is None else given

# Forwards measured: the first fills the weights (VMM calls, copies,
# first-use work on the host) and its device time runs long (H200: Flux
# 2.1-2.7x, a Llama prefill 2.5-5x its resident time). The first one's
# plan runs the next forwards; at least ROUNDS are measured, then more
# until the work measured (the least per unit so far) drops by less than
# SETTLED, at most ROUNDS_MAX, and the last one's plan stays (its weights
# placed again only if the resident set or the ring changed). In ComfyUI
# the second SDXL forward still ran 1.3-2.1x its steady time (host-bound:
# 845, 203, 185, 174, 131 ms), and a plan made from it thought every copy
# hidden. Plans in between are made only if the budget moved (SHRINK,
# GROW below): SDXL's 794 units cost ~1 s of host time a plan. A drop
# under SETTLED_ABS is settled too (the host clock's jitter on a small
# model on the simulated device).
ROUNDS = 2
ROUNDS_MAX = 5
SETTLED = 0.05
SETTLED_ABS = 2e-3
LOST_CALLS = 64             # unit calls per unit in one forward, at most
# A measured forward marks at most about MARK_CALLS unit calls (a timing
# event before and after each): a model with more is measured a span of
# its calls a forward, the spans of ceil(calls / MARK_CALLS) forwards
# read as one measured forward (each span's last unit ends at a mark on
# the next call). On a host-bound step every mark costs: SDXL's 794
# units (~1230 marks) measured forwards 2-4 of the first prompt at
# 1.15-1.23 x the steady step on the H100. VPAGER_MARK_CALLS=0: every
# call in every measured forward.
MARK_CALLS = 300
MARK_CALLS_ENV = "VPAGER_MARK_CALLS"
MARK_STREAMS = 64           # streams whose Stream object _mark keeps
MARK_EVENTS = 4             # events kept for marks, per unit call
MARGIN = 5e-4               # seconds: windows start copies this early
SIM_LINK = 10e9             # bytes/s assumed on the simulated device
# Holding the wholly resident units for the whole forward (HotPath.hold)
# saves each of their calls the per-unit path: an acquire and a release
# (~5 us of host time a unit for plain modules on the H200's host,
# bench_torch section 5, 2026-12-01), and under the ComfyUI node ~30 us
# (the hooks around ComfyUI's ops; a cProfile of SDXL's host-bound step
# on the H100, 2026-12-06): done when that adds up to HOLD_SHARE of the
# predicted forward. Judged at 5 us, SDXL's 362 resident units fell
# under 2% of a 93 ms prediction and went unheld: its steady step 1.27-
# 1.36 x resident's, 1.09-1.11 held. Judged at 2%, Flux's 56 resident
# units (1.7 ms) went unheld in every measured plan, though its double
# blocks ran host-bound on a slow H100 host (the GPU reached each call as
# the host queued it; 10 ms a step over resident's there, step_timeline,
# 2026-12-07). VPAGER_HOLD=0 turns it off.
UNIT_HOST = 30e-6
HOLD_SHARE = 0.005
# After the schedule: at a root forward's start, at most once a second,
# the device's budget (what this device may commit: its limit, or free
# memory less the headroom, which other processes and torch change) less
# its staging ring is read; below 97% or above 115% of what the schedule
# was planned for, the schedule is made again from the measured costs
# (none measured anew).
# (Looked at once when the Governor moved the limit, fp8 Flux with a
# LoRA at half its bytes on the H100 replanned up and down within each
# prompt, its kept fills lost at each move: with the LoRA 1.23-1.40 x L
# against 1.14 once a second; bench/RESULTS.md, thirty-third session.)
WATCH_EVERY = 1.0
SHRINK, GROW = 0.97, 1.15
_LINKS = {}                 # CUDA device index -> measured bytes/s
# Plans are computed off the forward's thread (_Planner; the arithmetic
# in planproc's child processes, one per ring size): the next root
# forward's start reads a measured forward's marks (once the GPU ran it,
# after torch's peak of it was learned) and hands them over; the plan is
# applied at the start of the first forward after it is ready (before
# any unit). The forwards in between are measured too, the last one's
# marks handed over when the plan is taken (on the H100 the node's Flux
# measured 2 of its first 12 forwards when they were not, and ran them
# unsettled). SDXL's 794 units took 1.4 s a plan in one child on the
# H100, 0.14 s with a child per ring and schedule.py's loops made lean
# (the first plan taken at the 4th forward, not the 8th); on the
# simulated device an 800-unit stack took 232 ms to plan against a 45 ms
# forward (bench/first_prompt_sim.py). On by default since measured on
# the H200 (800 units: worst forward after the first 3.4x a steady one,
# 9.1x with plans on the forward's thread); VPAGER_PLAN_THREAD=0 makes
# plans at the measured forward's end, on its thread (the tests'
# setting: their schedules land at a known forward).
PLAN_THREAD = "VPAGER_PLAN_THREAD"
# A placement applied at a forward's start fills its resident set during
# that forward (no warm() stop): each unit's window grows by the resident
# bytes of the next FILL_UNITS units, so prefetch commits and fills them
# on the copy stream while earlier units compute, as it copies the
# streamed ones; the planned windows (and the held units, whose batch
# would fill at the forward's start) come back at the next forward's.
FILL_UNITS = 2
# The plan from the first (cold) forward picks its ring on cold times,
# where every ring predicted within 1% (H100, Flux 9.4 GiB at 6 GiB: 288
# MiB, the settled plan 378, placed anew: 1.3 MB of 5.0 GB kept in place,
# a 197 ms step against 94). VPAGER_COLD_PLAN=0: while a guessed
# placement is in place (guess()), the first forward is not planned for;
# the first plan is the second's (with the planner's thread). Not the
# default until measured on a GPU (bench_node's "nocold" runs).
COLD_PLAN = "VPAGER_COLD_PLAN"
# VPAGER_COLD_WORK (default on; =0 off): the first (cold) forward is
# planned for at its own end (in the planner's processes, this thread
# waiting), each unit's work at most the median of its kind (coldwork.py),
# and its resident set filled there: the cold step takes what placing
# costs. Later plans keep the placement, its ring too, unless one is 2%
# faster; each forward measured after it is planned for (its windows).
# Off, the first plan is made on the planner's thread and taken at a later
# forward's start, which then pays the placement (H100, Flux 9.4 GiB at 6
# GiB: 163-233 ms steps against 95). Measured (H100, bench/RESULTS.md,
# thirtieth session), the node's Flux at 6 GiB, the first prompt's worst
# step after the first over a steady one: 1.07, 1.14, 1.65 and, with the
# plan in the planner's processes and the windows of each forward
# measured, 1.08 (off: 1.62-2.46); its first prompt 0.83-0.95 x ComfyUI's
# path (off: 0.83-0.89); at 4 GiB 1.03 (off 1.62). A model run again
# plans from its remembered work instead (plancache).
COLD_WORK = "VPAGER_COLD_WORK"
# VPAGER_RELOCATE=1: a placement made anew lies apart from the pages of
# the weights resident now (placement.place_apart), and those it keeps
# resident are copied on the device from where they lay (relocate.py),
# not filled again from the host: a moved weight costs no link time (a
# weight with a fill is filled again). Measured (H100, twenty-ninth
# session; the CUDA test in test_replan.py, bench_node's "move" runs):
# bitwise, 3.5-4.3 GB relocated in 32-43 ms of host time a placement,
# but placed apart it moves the whole resident set (each step of a
# placement in steps paid it again): no cheaper than filling what
# really moved. Stays off.
RELOCATE = "VPAGER_RELOCATE"
# Before the first forward, when the weights do not all fit, a schedule
# planned from a model of the costs places them (Tuner.guess): each unit
# computes GUESS times as long as its weights take to copy (H200: a
# Flux-class DiT step ~0.5, an SDXL UNet at 1024^2 ~2; decoding far less).
GUESS = 1.0
PLACE_EARLY = "VPAGER_PLACE_EARLY"      # =0: no placement before a forward
# A plan made again takes the resident set nearest the one in place when
# that is predicted at most NEAR slower (_nearest): its placement then
# copies only the weights that changed (the same 2% a measured plan needs
# to place anew at all).
NEAR = 0.02
# ... but a refine (at the client's pause) fills again what its own set
# moves when the forwards it speeds pay for that fill within this many
# (a prompt or two: 20-30 steps each are usual): the node's Flux at 6 GiB
# kept every weight in place, in the first prompt and at the margin's
# settling, and streamed 54 MB a step more than its plan (1.0 ms, 1.1%
# of every later step) to spare one 720 MB fill (13 ms).
PAYBACK = 30
# VPAGER_PLACE_STEPS=1: a placement moves toward its schedule in steps
# (schedule.toward): each forward that takes one copies again what leaves
# the resident set, at most this share of a steady forward's copies.
# Off by default: the node's Flux 9.4 GiB at 6 GiB, in steps and in one
# forward in the same call, H200 then H100: steady 1.104 / 1.079 x L in
# steps, 1.069 / 1.068 in one; prompts 2-4 97.0-100.0 / 94.8-110.8 ms
# in steps (the steps toward the settled plan ran through prompt 2),
# 93.8-95.0 / 93.7-93.9 in one; first prompt 2.29 / 1.72 s in steps,
# 2.12 / 1.86 in one. Its worst step after the first is 1.64 / 1.39 x a
# steady one in steps, 2.25 / 2.11 in one: issue 29's 1.1 missed either way.
# With RELOCATE each step lies apart and copies the weights it keeps on
# the device: a step then costs only what leaves (no holes to fill).
STEP = 0.1
PLACE_STEPS = "VPAGER_PLACE_STEPS"      # =1: a placement in steps
# A placement kept over a plan predicted at least REFINE faster (the 2%
# above spares the first prompt's forwards a placement's stop) is placed
# anew at the client's next pause (refine(): the node, at a prompt's
# load). The node's Flux 9.4 GiB at 6 GiB on the H100 kept its cold
# plan's placement, predicted 1.0% slower than the settled one: every
# later step 97 ms against 93.7 for the tree that placed anew.
REFINE = 0.005
# ... and so is a plan for a budget grown by REFINE (and a page) since the
# schedule's (the Governor's margin settled once torch's peak held, or
# another process left: the watch moves for GROW only), if predicted
# faster than the placement in hand.
# A forward measured again whose plan picks another ring keeps the ring
# and placement in hand when they are predicted within RING_KEEP of it,
# the pick placed at the next pause (refine()): the node's Flux at 6 GiB
# on the H100 placed its warm plan's 320 MiB ring over the cold plan's
# 416 in the first prompt's 4th step (135 ms against a 92 ms step).
RING_KEEP = 0.05


def measure_link(index, device):
    """Pinned host-to-device bytes per second on CUDA device `index`: the
    best of five 64 MiB copies on a side stream; once per process. The
    host side is a vpager HostBuf of `device` (vpager's Device), freed
    after: torch's pinned allocator would keep its 64 MiB for the
    process's life (host RSS, issue 28)."""
    link = _LINKS.get(index)
    if link is not None:
        return link
    n = 64 << 20
    try:
        buf = HostBuf(device, n)
    except Error:
        # No pinned memory to be had: vpager's copies are pageable too.
        buf, host = None, torch.empty(n, dtype=torch.uint8)
    else:
        host = views.view(buf.ptr, torch.uint8, (n,), "cpu")
    try:
        best = _best_copy(host, index)
    finally:
        del host
        if buf is not None:
            buf.close()
    link = _LINKS[index] = n / max(best, 1e-9)
    return link


def _best_copy(host, index):
    """Seconds of the fastest of five copies of `host` to CUDA device
    `index`, on a side stream."""
    dev = torch.empty(host.numel(), dtype=torch.uint8,
                      device=torch.device("cuda", index))
    s = torch.cuda.Stream(device=index)
    # dev's block may be one the forward's kernels, still queued on the
    # current stream, freed: the side stream writes it after them.
    s.wait_stream(torch.cuda.current_stream(index))
    best = float("inf")
    with torch.cuda.stream(s):
        for _ in range(5):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record(s)
            dev.copy_(host, non_blocking=True)
            b.record(s)
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
    return best


def enabled(settings, dev_given):
    """Whether offload() schedules: not with VPAGER_SCHEDULE=0, not when
    an eviction order was asked for (order=, VPAGER_ORDER or the
    evict_order option); on a shared device (dev=) only when asked
    (schedule=True); never with schedule=False."""
    if not env.flag("VPAGER_SCHEDULE", True) or settings.schedule is False:
        return False
    if dev_given and settings.schedule is not True:
        return False
    return settings.order_asked is False


class _Planner:
    """One worker thread that runs plan jobs off the forward's thread.
    submit(job) while none is pending; take() the finished job's
    (result, error) once, else None; wait() until no job runs (tests).
    The thread ends when it has no job; the next submit starts one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._done = None           # (result, error) of the last job
        self.pending = False        # a job submitted, its answer not taken

    def submit(self, job):
        with self._lock:
            if self.pending:
                raise RuntimeError("vpager.torch: a plan is being made")
            self.pending = True
            self._idle.clear()
        threading.Thread(target=self._run, args=(job,), daemon=True,
                         name="vpager-plan").start()

    def _run(self, job):
        try:
            out = (job(), None)
        except BaseException as e:  # noqa: BLE001 (handed to the forward)
            out = (None, e)
        with self._lock:
            self._done = out
        self._idle.set()

    def take(self):
        with self._lock:
            out, self._done = self._done, None
            if out is not None:
                self.pending = False
            return out

    def wait(self, timeout=None):
        return self._idle.wait(timeout)


class _NoRoom(Exception):
    """The VBAR has no room for a schedule's placement: keep the layout."""


class Tuner:
    """Measures one forward and applies the schedule (see the module's
    doc). model: the access.ModelAccess the handle gives it (busy,
    may_replace, swap, hold, ...); hooks: the root's RootHooks (its
    "measure" and "watch" slots are the tuner's); windows:
    set each unit's lookahead (off when lookahead= or VPAGER_LOOKAHEAD
    was given); resize: may change the ring (off when staging_size= or
    VPAGER_STAGING was given). on is True while a forward is measured:
    the hot path then calls before() and after() around each acquire."""

    def __init__(self, model, hooks, layout, ds, target, windows, resize):
        self.model = model
        self.root_hooks = hooks
        self.layout = layout
        self.ds = ds
        self.target = target
        self.windows = windows
        self.resize = resize
        self.cuda = target.type == "cuda"
        self.on = False
        self.done = False
        self.calls = []
        self.start = None
        # Spans (MARK_CALLS): this forward's unit calls so far, the span
        # of them it marks [lo, hi) (hi's start marked too: where the
        # span's last unit ends), whether the call before() saw is marked,
        # the spans read so far (their calls' marks as seconds, _read_span),
        # how many, the first one's start, the last one marked while the
        # GPU may still run it, and how many calls a forward makes.
        self.ncall = 0
        self.span = None
        self.marking = False
        self.parts = []
        self.nparts = 0
        self.parts_start = None
        self.part_unread = None
        self.call_count = None
        # The GPU's time between two root forwards (between.py): with
        # VPAGER_BETWEEN=1 the plan adds it to the last unit's work.
        self.between = Between(self._mark, self._seconds, self._ran)
        got = env.count(MARK_CALLS_ENV)
        self.mark_calls = MARK_CALLS if got is None else got
        self.schedule = None        # the Schedule applied, once done
        self.ring = None            # the ring it chose
        self.ring_top = None        # the ring before the first plan
        self.rings = []             # plan()'s candidates: (ring, Schedule)
        self.link = None
        self.rounds = 0             # forwards measured
        self.work = None            # unit -> the least work measured
        self.works = []             # each measured forward's unit -> work
        self.planned_for = None     # the budget the schedule was made for
        # The budget planned for before the room shrank (SHRINK) since:
        # the room coming back to it is planned for again, though less
        # than GROW (a peak of torch's masked again, another process
        # gone: Flux with a LoRA kept 0.54 GB fewer weights resident).
        self.roomier = None
        self.replans = 0            # schedules made again for the room
        # A placement kept though a plan predicted REFINE faster was made
        # (apply(): a measured plan's, or its own set's kept in place):
        # placed at refine().
        self.better = False
        self.watch_at = 0.0
        self.fills_planned = 0      # layout.fill_changes the plan knew
        self.watching = False       # the room watched, once done
        # Plans made off the forward's thread (PLAN_THREAD), else None.
        self.planner = _Planner() if env.flag(PLAN_THREAD, True) else None
        self.backlog = None         # marks of a forward measured meanwhile
        self.streams = {}           # raw stream handle -> its Stream (_mark)
        self.events = []            # timing events read, for marks again
        self.shape = None           # _costs()'s lists, with what made them
        self.holdable = None        # _hold()'s (units, resident, candidates)
        self.last_streamed = None   # ... and _last_streamed()'s unit
        self.unread = None          # marks whose forward the GPU still runs
        self.filling = None         # (planned windows, held units) to restore
        self.kept_bytes = 0         # resident bytes the last placement kept
        self.guessed = False        # self.schedule is guess()'s
        self.guess_order = []       # id() of its weights, in its order
        self.heading = None         # (Schedule, ring) placed step by step
        self.forwards = 0           # root forwards begun
        self._streamed = (None, frozenset())   # streamed()'s, per schedule
        # VPAGER_SCHEDULE_LOG: what each forward and plan job came to.
        self.tracing = env.flag("VPAGER_SCHEDULE_LOG", False)
        self.units_traced = False   # _trace_work named the units
        # VPAGER_COLD_PLAN=0: no plan from the cold first forward while a
        # guessed placement is in place (COLD_PLAN below).
        self.cold_plan = env.flag(COLD_PLAN, True)
        self.cold_work = env.flag(COLD_WORK, True)
        self.fill_now = False       # a placement's resident set warmed now
        self.relocate = env.flag(RELOCATE, False)
        self.relocated_bytes = 0    # the last placement's device copies
        self.first_now = False      # the first plan made at its forward's end
        self.cache_key = None       # plancache's key, once a forward ran
        self.estimated = False      # planning from coldwork's estimate
        self._ring_share = None     # share(): read from the device once
        self.remembered = False     # the first plan made from plancache's
        self.remembered_work = None  # the work _remember() saved last

    def install(self):
        """Measure from the next root forward on (the planner's processes
        started meanwhile: the first plan may be made at its end)."""
        self.root_hooks.set("measure", pre=self._begin, post=self._end)
        if self.planner is not None:
            planproc.start()

    def guess(self):
        """Before any forward, when the weights do not all fit the room:
        the placement of a schedule from a model of the costs (streaming
        spread evenly over the bytes, schedule.guess; windows for units
        that compute GUESS times their copy time), made as a measured
        one's is (the resident set together at the VBAR's start, ranked
        first, the watermark above it, each unit's window), no units
        held. The first forwards (the cold measured one, those run while
        the planner works) then fill a resident set and keep it, instead
        of paging the whole model through the interleaved order, and the
        measured schedule's placement leaves what the two share where it
        lies (place_kept). schedule() stays None until a measured one.
        True if it placed; a failure leaves offload()'s placement
        (warned). VPAGER_PLACE_EARLY=0 turns it off."""
        if not env.flag(PLACE_EARLY, True):
            return False
        try:
            return self._guess()
        except Exception as e:      # noqa: BLE001 (outputs stay right)
            warnings.warn("vpager.torch: no placement before the first "
                          "forward (%s: %s); the measured schedule's comes "
                          "after it" % (type(e).__name__, e), RuntimeWarning)
            return False

    def _guess(self):
        lay = self.layout
        dev = lay.device
        page = dev.page_size
        self._measure_link()
        units, _, sizes, flat = self._costs({})
        total = dev.info()["budget"]
        ring = dev.options["staging_size"]
        every = schedule.resident_pages(sizes, [True] * len(flat), page,
                                        lay.align)
        if not flat or every + ring_pages(ring, page) <= total:
            return False        # all fit: the measured plan keeps them all
        room = total - ring_pages(ring, page) - spare_pages() * page
        resident = schedule.guess(sizes, room, page, ring, lay.align)
        if resident is None or not any(resident):
            return False
        offsets, end = place_resident_first(flat, lay.align, page, resident)
        if end > lay.vbar.size:
            return False
        self.model.swap(flat, offsets, None)    # nothing resident yet
        lay.groups = None
        lay.vbar.set_ranks(scheduled_ranks(flat, offsets, resident, page,
                                           lay.vbar.size // page))
        lay.watermark = len(pages_touched(flat, offsets, resident,
                                          page)) * page
        lay.vbar.set_watermark(lay.watermark)
        work = [GUESS * sum(ss) / self.link for ss in sizes]
        eff = schedule.usable(ring, self.share())
        wins = schedule.windows(work, sizes, resident, self.link, eff,
                                PER_COPY, MARGIN)
        if self.windows:        # as _windows sets them
            for u, win in zip(units, smooth(wins)):
                if u is not None:
                    u.window = win
            lay.set_windows(units)
        self.model.scheduled()
        # The schedule in place: the first measured plan keeps its
        # resident set unless it predicts a clear gain (apply()).
        self.schedule = schedule.Schedule(
            resident, wins,
            schedule.simulate(work, sizes, resident, self.link, eff,
                              PER_COPY),
            sum(e.size for e, r in zip(flat, resident) if not r),
            schedule.resident_pages(sizes, resident, page, lay.align),
            float(sum(work)))
        self.ring, self.planned_for, self.guessed = ring, total, True
        self.guess_order = [id(e) for e in flat]
        return True

    def _old(self):
        """self.schedule, its resident flags in the weights' order now:
        guess()'s were in offload()'s order, which the re-placement in
        the order of use (replace.py) may have changed since."""
        sch = self.schedule
        if sch is None or not self.guessed:
            return sch
        was = dict(zip(self.guess_order, sch.resident))
        res = [was.get(id(e), False) for e in self._costs({})[3]]
        if res == sch.resident:
            return sch
        return schedule.Schedule(res, sch.window, sch.predicted, sch.streamed,
                                 sch.resident_bytes, sch.all_resident)

    def describe(self):
        """Offloaded.schedule(): None before the first schedule, else
        predicted_ms and all_resident_ms (the forward, predicted; its
        measured compute), streamed_bytes (copied per forward),
        resident_bytes, resident_weights, staging (the ring), ring_wraps
        (its slots run past its end: the plans count all of it), link
        (bytes/s), planned_for (the device budget it was made for),
        replans (times made again since, for another budget), measured
        (forwards measured: two, or more until their work settles),
        windows (lookahead bytes per unit, placement order, or None),
        held_units (units acquired once per inference forward:
        HotPath.hold), kept_bytes (resident bytes the last placement left
        where they lay, not copied again), relocated_bytes (of those,
        moved and copied on the device: VPAGER_RELOCATE), rings (the ring
        sizes the last
        plan tried: staging, predicted_ms, streamed_bytes), settled
        (measuring is over, no plan is being made or placed step by step:
        the forwards from here on run this schedule)."""
        sch = self.schedule
        if sch is None or self.guessed:
            return None
        return {"predicted_ms": sch.predicted * 1e3,
                "all_resident_ms": sch.all_resident * 1e3,
                "streamed_bytes": sch.streamed,
                "resident_bytes": sch.resident_bytes,
                "resident_weights": sum(sch.resident),
                "held_units": len(self.model.held()),
                "kept_bytes": self.kept_bytes,
                "relocated_bytes": self.relocated_bytes,
                "remembered": self.remembered,
                "staging": self.ring,
                "ring_wraps": self.share() == schedule.WRAPS,
                "link": self.link,
                "planned_for": self.planned_for, "replans": self.replans,
                "measured": self.rounds,
                "settled": bool(self.done and self.heading is None and
                                not self._planning()),
                "rings": [{"staging": r, "predicted_ms": c.predicted * 1e3,
                           "streamed_bytes": c.streamed}
                          for r, c in self.rings],
                "windows": list(sch.window) if self.windows else None}

    def streamed(self):
        """The weights the schedule in place streams, once it is settled
        (describe()'s "settled") and was made for the fills there are now;
        None before (keptfills.py keeps only what stays streamed)."""
        sch = self.schedule
        if sch is None or self.guessed or not self.done or \
                self.heading is not None or self._planning() or \
                self.fills_planned != self.layout.fill_changes:
            return None
        if self._streamed[0] is not sch:
            flat = self._costs({})[3]       # the order of sch.resident
            self._streamed = (sch, frozenset(
                e for e, r in zip(flat, sch.resident) if not r))
        return self._streamed[1]

    def remove(self):
        """No more measuring, nor watching the room."""
        self._stop_measuring()
        self._stop_watching()

    def _stop_measuring(self):
        self.root_hooks.clear("measure")
        self.on = False
        self.calls = []
        self._drop_spans()
        self.backlog = None
        self.unread = None

    def _stop_watching(self):
        if self.watching:
            self.root_hooks.clear("watch")
            self.watching = False

    def _done(self, save=True):
        """Measuring is over: from now on watch the room (WATCH_EVERY).
        save: remember the work as settled (not for work read from there)."""
        self.done = True
        self._stop_measuring()
        if save and self.cache_key is not None and self.work:
            plancache.save(self.cache_key, self.work, settled=True)
        if not self.watching:
            self.root_hooks.set("watch", pre=self._watch)
            self.watching = True

    def _watch(self, module, args):
        self._filled()
        if self._planning():
            self._take()            # a plan for the new room, once ready
            return
        if self.heading is not None:
            self._next_step()
            return
        if self.schedule is None or self.planned_for is None:
            return
        # Weights given a fill (a LoRA) or rid of one since the plan:
        # planned again at once, keeping them resident (_keep).
        fills = self.layout.fill_changes != self.fills_planned
        now = time.monotonic()
        if not fills and now < self.watch_at:
            return
        self.watch_at = now + WATCH_EVERY
        if not self.model.may_replace():
            return
        moved = self._room_moved()
        if not (fills or moved):
            return
        self.replans += 1
        # Only fills changed (a LoRA given, changed or taken away): the
        # room and the measured work are those the ring was chosen for,
        # so the plan keeps that ring (another one places every weight
        # anew: Flux 9.4 GiB at 6 GiB on the H100 swung between 378 and
        # 252 MiB rings at each LoRA change, 2-3 steps 1.3-2x slower).
        reason = "room" if moved else "fills"
        rings = None if moved else [self.ring]
        # Fills alone: planned now, on this thread (one ring: 6 ms of
        # planning for Flux's 138 units on the dev machine), so that this
        # forward fills the weights given one in their resident places:
        # their patch runs once, a fill whose peak the next learn reads
        # as a one-off (hotpath.fill). Planned on the planner, this
        # forward streamed them: their patches' temporaries read as every
        # forward's (torch's peak 0.91 -> 1.39 GB, Flux at 6 GiB with a
        # LoRA: its room replanned 0.54 GB smaller, steps 8% slower than
        # the tree before issue 28).
        if moved:
            self._plan_soon(reason)
            return
        self._replan(reason, None, rings)

    def _plan_soon(self, reason):
        """A plan made again for `reason` ("room", "refine") on the
        planner, if there is one (taken at a later forward's start;
        SDXL: 1.4 s a plan on one core), else now."""
        if self.planner is None:
            self._replan(reason, None)
            return
        inputs, work, works = self._inputs(), self.work, list(self.works)
        self.planner.submit(lambda: ("replan", reason, self._plan_from(
            inputs, work, works)))

    def refine(self):
        """At a pause of the client's (the node: a prompt's load), once
        the schedule has settled: if its placement was kept over a plan
        predicted at least REFINE faster (apply()), or the budget grew by
        REFINE since it was planned (_room_grew), plan again from the
        work measured (on the planner, if there is one: taken at the next
        forward's start) and place that plan, so that the next forward
        pays the placement once, not the forwards of a first prompt. Not
        while a weight has a fill. True if a plan was asked for. Without
        the planner's thread (whose jobs do it), the work measured so far
        is remembered (plancache) before the schedule settles."""
        if self.planner is None and self.rounds >= 2:
            self._remember(self.work)
        if self.schedule is None or not self.done or \
                self.heading is not None or self._planning() or \
                not (self.better or self._room_grew()) or \
                not self.model.may_replace():
            return False
        # Not with fills (a LoRA's): their own replans keep the weights
        # that have one resident; a plan placed anew at a LoRA prompt's
        # load streamed some, their patch math at every step (the node's
        # Flux at 6 GiB, H100: LoRA steps 103-108 ms against 99-100).
        if self.fills_planned != self.layout.fill_changes or any(
                e.fill is not None or e.kept is not None
                for e in self._costs({})[3]):
            return False
        self.better = False
        self.replans += 1
        self._plan_soon("refine")
        return True

    def _remember(self, work):
        """The work merged so far (a forward after the cold one measured)
        saved under the plan cache's key until _done() saves the settled
        work: SDXL's host-bound forwards, measured 6% apart, had not
        settled after two prompts, and the next process planned from its
        cold forward again. Once for each work; on the planner's thread
        where there is one (a file written is no forward's time)."""
        if self.done or self.cache_key is None or not work or \
                work is self.remembered_work:
            return
        if plancache.save(self.cache_key, work):
            self.remembered_work = work

    def _replan(self, reason, planned, rings=None):
        try:
            self.apply(self.work, replan=reason, planned=planned,
                       rings=rings)
        except Exception as e:      # noqa: BLE001 (outputs stay right)
            self._stop_watching()
            warnings.warn("vpager.torch: the copy schedule was not made "
                          "again for the device's new room (%s: %s); no "
                          "more tries" % (type(e).__name__, e),
                          RuntimeWarning)

    def _room_grew(self):
        """True if the device's budget is REFINE (and a page) above what
        the schedule was planned for."""
        if self.planned_for is None:
            return False
        dev = self.layout.device
        grown = dev.info()["budget"] - self.planned_for
        return grown >= max(dev.page_size, self.planned_for * REFINE)

    def _room_moved(self):
        """True if the room for weights (the budget less the ring: another
        model's offload() may have grown a shared device's ring) is outside
        SHRINK..GROW of what the schedule was planned for, or the budget
        came back to what it was before the room last shrank."""
        dev = self.layout.device
        page = dev.page_size
        budget = dev.info()["budget"]
        if self.roomier is not None and budget >= SHRINK * self.roomier:
            return True
        room = budget - ring_pages(dev.options["staging_size"], page)
        was = max(self.planned_for - ring_pages(self.ring, page), page)
        return not SHRINK * was <= room <= GROW * was

    # ------------------------------------------------------------ marks
    def _mark(self, raw=None):
        """A point in time on the current stream: a timing event (CUDA), the
        host clock (the simulated device). raw: the stream's handle, which
        the hot path has (torch.cuda.current_stream costs ~20 us, two a
        unit: on the node's SDXL, host-bound, 1588 marks were ~30 ms of a
        measured forward's host time); its Stream object is kept, and
        the events a forward's marks were read from are used again
        (_work), not made and destroyed by the thousand."""
        if self.cuda:
            pool = self.events
            ev = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
            s = self.streams.get(raw) if raw is not None else None
            if s is None:
                s = torch.cuda.current_stream(self.target)
                if raw is not None and raw == s.cuda_stream:
                    if len(self.streams) >= MARK_STREAMS:
                        self.streams.clear()
                    self.streams[raw] = s
            ev.record(s)
            return ev
        return time.perf_counter()

    def _seconds(self, a, b):
        if self.cuda and not isinstance(a, float):      # (float: _read_span)
            return max(a.elapsed_time(b), 0.0) / 1e3
        return max(b - a, 0.0)

    def _ran(self, mark):
        """Whether the GPU ran the work before `mark` (CUDA: its event)."""
        return not self.cuda or mark.query()

    def _lost(self):
        """True (marking stopped) when a measured forward raised (its end
        hook never ran) and units ran outside one since: the next forward
        measures."""
        if self.ncall < LOST_CALLS * len(self.layout.units):
            return False
        self.on = False
        self.calls.clear()
        return True

    def _marks(self, stream):
        """Whether this call is marked (its index in the forward's span),
        counting it; the call at the span's end gets an end mark alone."""
        i = self.ncall
        self.ncall = i + 1
        span = self.span
        if span is None or span[0] <= i < span[1]:
            return True
        if i == span[1]:
            self.calls.append([None, self._mark(stream), None])
        return False

    def before(self, unit, stream=None):
        self.marking = False
        if not self._lost():
            if self._marks(stream):
                self.calls.append([unit, self._mark(stream), None])
                self.marking = True

    def after(self, stream=None):
        if self.marking:
            self.calls[-1][2] = self._mark(stream)

    def held(self, unit, stream=None):
        """A held unit's call (hotpath.hold: its weights acquired at the
        root's start, nothing for it to wait for): one mark, both its
        start and where its work begins. On the node's SDXL (host-bound)
        a measured forward that took every unit through enter() instead
        ran 17-24 ms over an 83 ms step."""
        if not self._lost():
            if self._marks(stream):
                m = self._mark(stream)
                self.calls.append([unit, m, m])

    # ------------------------------------------------------------ hooks
    def _trace(self, what):
        if self.tracing:
            sys.stderr.write("vpager.torch tuner (forward %d, %d measured):"
                             " %s\n" % (self.forwards, self.rounds, what))

    def _trace_work(self, what, work):
        """Under VPAGER_SCHEDULE_LOG: each unit's work (ms, in the
        forward's order), the data a cold plan's estimate is judged by."""
        if self.tracing:
            if not self.units_traced:
                self.units_traced = True
                self._trace("units (name:bytes): %s" % " ".join(
                    "%s:%d" % (u.name, sum(e.size for e in u.entries))
                    for u in work))
            self._trace("%s work (ms): %s" % (what, " ".join(
                "%.3f" % (t * 1e3) for t in work.values())))

    def _begin(self, module, args):
        if self.model.busy():
            return
        self.forwards += 1
        self.between.began(self.forwards)
        self._filled()
        self._read_span()
        if self.unread is not None:
            self._submit(*self.unread)      # to the planner, if it ran
        if self._planning() and self._take():
            # The forward that takes a plan runs unmeasured (its placement
            # fills as it runs); while one is being made they are
            # measured (_end keeps the last one's marks for the next job).
            return
        if self.heading is not None and not self._planning():
            # A step toward the schedule placed (this forward fills it;
            # measured all the same: each unit's least work is kept). Not
            # while a plan is being made: it is made for the placement in
            # place, which its take keeps where it can.
            self._next_step()
        if self.done:
            return
        if self.layout.copying:
            # Its units wait for the host copy (hostload.py): their times
            # say how fast the copy fills, not what they compute.
            self._trace("not measured: the host copy runs")
            return
        self.calls = []
        self.ncall = 0
        self.span = self._span()
        self.start = self._mark()
        self.on = True

    def _span(self):
        """The calls [lo, hi) the forward marks (MARK_CALLS), the next
        span of the last forward's calls; None: every call."""
        n, per = self.call_count, self.mark_calls
        if not per or n is None or n <= per:
            return None
        k = -(-n // per)
        i = self.nparts + (self.part_unread is not None)
        return (i * n // k, (i + 1) * n // k)

    def _drop_spans(self):
        self.parts, self.nparts = [], 0
        self.parts_start = self.part_unread = None

    def _spans_read(self, calls, end):
        """(calls, start) of the forward measured, or None while the spans
        of one are being marked (each kept unread until the GPU ran it,
        then read as seconds: _read_span); the last span's are marks."""
        span, n = self.span, self.ncall
        self.span = None
        if span is None:
            self.call_count = n
            self._drop_spans()
            return calls, self.start
        if n != self.call_count:
            # Another number of calls (another input shape, a branch): its
            # spans start again.
            self._trace("its calls changed (%d, were %d): spans dropped"
                        % (n, self.call_count))
            self.call_count = n
            self._drop_spans()
            return None
        self._read_span(wait=True)
        if span[1] < n:
            self.part_unread = (calls, self.start, end)
            self._trace("calls %d-%d of %d marked" % (span[0], span[1] - 1,
                                                       n))
            return None
        # The last span's start, between the spans read and its calls: a
        # mark for the pool only.
        calls = self.parts + [[None, self.start, None]] + calls
        start, k = self.parts_start, self.nparts + 1
        self._drop_spans()
        self._trace("calls %d-%d of %d marked: %d forwards read as one"
                    % (span[0], n - 1, n, k))
        return calls, start

    def _read_span(self, wait=False):
        """The span marked last, once the GPU ran it (wait: now), into
        self.parts: each call's marks as seconds on a clock of its own,
        [u, s, s], the next call's at s + its work, so _work reads them
        as it reads marks; its span's end [None, s, None]. Its events go
        back to the pool. A forward reads the span before it, not every
        span's at once (~4 us a call on the H100: SDXL's 794 read in 3.1
        ms)."""
        got = self.part_unread
        if got is None:
            return
        calls, start, end = got
        if self.cuda:
            if not self._ran(end):
                if not wait:
                    return
                end.synchronize()
            read, s = [], 0.0
            for i, (u, _, e) in enumerate(calls):
                if u is None:
                    read.append([None, s, None])
                    continue
                read.append([u, s, s])
                nxt = calls[i + 1][1] if i + 1 < len(calls) else end
                s += self._seconds(e, nxt)
            first = -self._seconds(start, calls[0][1])
            self._pool(calls, start, end)
            calls, start = read, first
        self.parts += calls
        if not self.nparts:
            self.parts_start = start
        self.nparts += 1
        self.part_unread = None

    def _end(self, module, args, out):
        if not self.on:
            return
        self.on = False
        self._end_measured(args)
        self.between.ended(self.forwards)   # after what it placed

    def _end_measured(self, args):
        calls, self.calls = self.calls, []
        if not calls or any(c[0] is not None and c[2] is None
                            for c in calls) or \
                not self.model.may_replace():
            self._trace("its marks dropped (%d calls)" % len(calls))
            return                  # the next forward measures
        end = self._mark()
        got = self._spans_read(calls, end)
        if got is None:
            return
        calls, start = got
        if not self.rounds and plancache.folder() is not None:
            self.cache_key = plancache.key(
                plancache.device_name(self.target, self.model.cuda_index),
                self.layout.units, args)
        if not self.rounds and not self._planning() and (
                self.cold_work or plancache.exists(self.cache_key)):
            self._plan_now(calls, start, end)
            return
        if self.planner is not None:
            if self._planning():        # handed over once it is taken
                self.backlog = (calls, start, end)
                self._trace("measured while a plan is made")
            else:
                # Handed over at the next root forward's start, after the
                # learn hook read torch's peak of this one: the node's
                # Flux's first plan, made for a room 0.9 GB too large,
                # was placed anew at the next forward (2x a steady one).
                self.unread = (calls, start, end)
                self._trace("measured")
            return
        work = self._work(calls, start, end)
        work, settled = self._merge(work)
        if self._measured(work, settled, self._free_to_wait()):
            self._apply_safely(work)

    def _plan_now(self, calls, start, end):
        """VPAGER_COLD_WORK (the default) or a plan cache that remembers
        this model (plancache.py), the first measured (cold) forward:
        planned for (in the planner's processes, this thread waiting) and
        placed at its own end, on its thread, the resident set filled
        now (warm()): its marks read once the GPU ran it, torch's
        peak learned, each unit's work the one remembered, else at most
        its kind's median (coldwork.py). The cold step, long anyway,
        takes what placing costs; later plans keep this placement, its
        ring too, unless one is 2% faster (apply())."""
        t0 = time.perf_counter()
        raw = self._work(calls, start, end)     # (waits for its end)
        t1 = time.perf_counter()
        self._trace_work("cold", raw)
        if self.cuda:
            learn_headroom(self.layout.device, self.model.cuda_index,
                           force=True)
        got = plancache.load(self.cache_key, list(raw)) \
            if self.cache_key is not None else None
        work, settled = got if got is not None else (None, False)
        self._trace("the cold forward's end waited for %.1f ms, torch's "
                    "peak and the plan cache read in %.1f ms" % (
                        (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
        self.remembered = work is not None
        if work is None:
            work = coldwork.warm_work(raw)
        else:
            self._trace("planned from the work remembered: %.3f ms (this "
                        "cold forward's %.3f)" % (sum(work.values()) * 1e3,
                                                   sum(raw.values()) * 1e3))
        if self._measured(work, False, self._free_to_wait()):
            self.fill_now = self.first_now = True
            self.estimated = not self.remembered
            try:
                # Each ring size in a planner's process at once (SDXL's
                # 794 units: 718 ms on this thread, one ring after the
                # other, on the H100), this thread waiting.
                planned = None
                if self.planner is not None and planproc.WIDTH > 1:
                    t0 = time.perf_counter()
                    planned = self._plan_from(self._inputs(), work, [work])
                    self._trace("planned in the planner's processes in "
                                "%.1f ms" % ((time.perf_counter() - t0) * 1e3))
                self._apply_safely(work, planned)
            finally:
                self.fill_now = self.estimated = False
        if settled and not self.done:
            # Remembered once it settled: trusted, no forward measured
            # (each measured forward's marks cost a host-bound step: the
            # node's SDXL 1.16-1.23 x on the H100); the watch replans
            # from it when the room moves.
            self.work = work
            self._trace("the remembered work settled: nothing measured")
            self._done(save=False)
            return
        # Later forwards merge with what was measured (and remembered).
        self.work = self._merge(raw, work)[0] if self.remembered else raw

    def _work(self, calls, start, end):
        """unit -> seconds of work, from one forward's marks (CUDA: waits
        for its end event)."""
        if self.cuda:
            end.synchronize()
        work = {}
        cur = None
        for i, (u, _, e) in enumerate(calls):
            if u is None:           # a span's end (_spans_read)
                continue
            nxt = calls[i + 1][1] if i + 1 < len(calls) else end
            if u not in work:
                work[u] = 0.0
                cur = u
            work[cur] += self._seconds(e, nxt)
        # What runs before the first unit follows the last one (cyclic).
        work[cur] += self._seconds(start, calls[0][1])
        self._pool(calls, start, end)
        return work

    def _pool(self, calls, start, end):
        """Marks read, and the GPU is past them all: for marks again (CUDA;
        a span's seconds are not marks). A held unit's call has one event
        for both marks: pooled once (twice, it was recorded twice in a
        later forward, the first time lost, and units read 0 ms: Flux's
        all-resident work fell from 82 to 31 ms over four forwards on the
        H100)."""
        pool = self.events
        if not self.cuda or len(pool) >= MARK_EVENTS * len(calls):
            return
        for _, a, b in calls:
            if isinstance(a, float):
                continue
            pool.append(a)
            if b is not None and b is not a:
                pool.append(b)
        pool.extend(m for m in (start, end) if not isinstance(m, float))

    def _merge(self, raw, least=None):
        """(work, settled): the least of raw and the forwards measured
        before (`least`: self.work), and whether it dropped by less than
        SETTLED (or SETTLED_ABS). raw is kept as measured in works."""
        least = self.work if least is None else least
        if not least:
            return raw, False
        before = sum(least.values())
        work = {u: min(t, least.get(u, t)) for u, t in raw.items()}
        drop = before - sum(work.values())
        return work, drop < SETTLED * before or drop < SETTLED_ABS

    def _free_to_wait(self):
        """Whether a forward measured before settling may skip its plan:
        yes unless a schedule placed may not fit the budget now (torch's
        activations learned, as under ComfyUI)."""
        return self.schedule is None or not self._room_moved()

    def _measured(self, work, settled, free_to_wait, raw=None):
        """Count a measured forward (its least work `work`); True if a
        plan is to be applied for it. Measuring ends after ROUNDS forwards
        once settled, or ROUNDS_MAX."""
        self.rounds += 1
        self.works.append(work if raw is None else raw)
        self._trace_work("measured", work if raw is None else raw)
        self.work = work
        if self.rounds >= ROUNDS_MAX or (self.rounds >= ROUNDS and settled):
            self._done()
            return True
        # Measure on; plan once the work settles, or now if the budget
        # moved: the resident set placed may not fit it.
        return not (self.rounds > 1 and free_to_wait)

    def _apply_safely(self, work, planned=None):
        t0 = time.perf_counter()
        try:
            self.apply(work, planned=planned)
            self._trace("applied on the host in %.1f ms"
                        % ((time.perf_counter() - t0) * 1e3))
        except Exception as e:      # noqa: BLE001 (the forward is done)
            # The forward's output is right whatever happens here, and
            # every later one's: Layout.swap is all or nothing, and a
            # failure after it (ranks, warming) leaves the weights placed
            # anew under the eviction order they had. Not tried again.
            self.done = True
            self.remove()
            warnings.warn("vpager.torch: the copy schedule was not (fully) "
                          "applied (%s: %s); the model runs on with the "
                          "placement it has" % (type(e).__name__, e),
                          RuntimeWarning)

    # ------------------------------------------------------------ planner
    def _measure_link(self):
        """self.link: the host-to-device copy speed (bytes/s), measured
        at the first plan (SIM_LINK on the simulated device)."""
        if self.link is None:
            self.link = (measure_link(self.model.cuda_index,
                                      self.layout.device) if self.cuda
                         else SIM_LINK)

    def share(self, again=False):
        """The share of a ring its slots fill on this device
        (schedule.usable): all of it where the ring wraps (vp_device_info's
        staging_wraps), else first fit's. Read once; again: read anew (a
        plan's budget is read then too: a ring that could not be mapped
        twice after all stops wrapping once)."""
        if self._ring_share is None or again:
            wraps = self.layout.device.info().get("staging_wraps")
            self._ring_share = (schedule.WRAPS if wraps
                                else schedule.FRAGMENTATION)
        return self._ring_share

    def _inputs(self, rings=None):
        """What a plan job reads, taken on the forward's thread (the
        budget, the rings (default _rings()), the sizes, the placement
        kept; the link measured once, here, its copies beside no
        forward's): the job itself reads only these and the marks, and
        does pure arithmetic (schedule.py), never the model (threads
        share it under its lock)."""
        lay = self.layout
        dev = lay.device
        self._measure_link()
        units, _, sizes, flat = self._costs({})
        need = self._need()
        old = self._old()
        self.fills_planned = lay.fill_changes
        return {"units": units, "sizes": sizes, "keep": _keep(flat),
                "between": self._between(),
                "total": dev.info()["budget"],
                "rings": rings or self._rings(dev, need),
                "page": dev.page_size,
                "link": self.link, "align": lay.align,
                "old": None if old is None else list(old.resident),
                "old_ring": self.ring, "estimated": self.estimated,
                "share": self.share(again=True)}

    @staticmethod
    def _plan_from(inputs, work, works):
        """Planned for `work` (unit -> seconds) and the measured forwards'
        `works`, from _inputs(): on the planner's thread."""
        units, gap = inputs["units"], inputs.get("between", 0.0)
        return plan_job(
            _listed(work, units, gap),
            [_listed(wk, units, gap) for wk in works],
            inputs["sizes"], inputs["total"], inputs["rings"],
            inputs["page"], inputs["link"], inputs["align"], inputs["old"],
            inputs["old_ring"], inputs["keep"], remote=True,
            estimated=inputs["estimated"], share=inputs["share"])

    def _submit(self, calls, start, end):
        """Hand a measured forward to the planner (its work read from its
        marks, _inputs()) once the GPU ran it, else keep it for a later
        forward's start (unread). Read here, on the forward's thread: each
        CUDA event read lets go of the GIL, and on the planner's thread
        each took it back only when the forward's thread gave it up
        (SDXL's 794 units, 1600 reads: 1.4 s on the H100, the first plan
        taken at the 8th forward)."""
        if not self._ran(end):
            self.unread = (calls, start, end)
            return
        self.unread = None
        t0 = time.perf_counter()
        raw = self._work(calls, start, end)
        self._trace("marks read in %.1f ms" % (
            (time.perf_counter() - t0) * 1e3))
        inputs = self._inputs()
        least, rounds = self.work, self.rounds + 1
        free_to_wait = self._free_to_wait()
        before = list(self.works)
        # Of the forwards measured before settling only the first is
        # planned for (COLD_PLAN off, a guessed placement in place: the
        # second, even where the room moved: the guess was made for
        # offload()'s budget, before torch's peak was learned, so under
        # CUDA it always has; one forward more on the guess, the pager
        # evicting where it must).
        first = 2 if not self.cold_plan and self.guessed else 1
        free_to_wait = free_to_wait or (rounds == 1 and first == 2)
        # After a plan made at the cold forward's end (its work guessed,
        # coldwork.py) each forward measured is planned for: apply()
        # keeps the placement unless 2% slower, and takes the windows of
        # the work measured (H100, Flux 9.4 GiB at 6 GiB: the cold plan's
        # windows ran forwards 2-4 at 101-107 ms, the same placement 96
        # with the settled windows).
        free_to_wait = free_to_wait and not self.first_now

        def job():
            t0 = time.perf_counter()
            try:
                return measured()
            finally:
                self._trace("a plan job took %.0f ms on the planner"
                            % ((time.perf_counter() - t0) * 1e3))

        def measured():
            work, settled = self._merge(raw, least)
            if rounds >= 2:
                self._remember(work)
            if not (rounds >= ROUNDS_MAX or (rounds >= ROUNDS and settled)) \
                    and rounds != first and free_to_wait:
                return "measured", raw, work, settled, None
            if rounds == 1 and self.cold_work:
                work = coldwork.warm_work(work)
                return "measured", raw, work, settled, self._plan_from(
                    inputs, work, before + [work])
            return "measured", raw, work, settled, self._plan_from(
                inputs, work, before + [raw])
        self.planner.submit(job)

    def _planning(self):
        """Whether the planner has a job whose answer is not taken, or a
        measured forward waits to be read for one."""
        return self.planner is not None and (self.planner.pending or
                                             self.unread is not None)

    def _take(self):
        """At a root forward's start: take what the planner finished, if
        anything, and apply its plan (the forward has not run a unit yet);
        then hand over the forward measured meanwhile (backlog). True if
        a plan was applied (or given up)."""
        got = self.planner.take() if self.planner is not None else None
        if got is None:
            return False
        out, err = got
        if err is not None:
            self._trace("the plan job failed: %r" % (err,))
            self.done = True
            self.remove()
            warnings.warn("vpager.torch: no copy schedule (%s: %s); the "
                          "model runs on with the placement it has"
                          % (type(err).__name__, err), RuntimeWarning)
            return True
        if out[0] == "replan":
            if self.model.may_replace():
                self._replan(out[1], out[2])
            return True
        _, raw, work, settled, planned = out
        # Budget moves since the job was handed over are the watch's.
        applied = self._measured(work, settled, planned is None, raw) and \
            planned is not None and self.model.may_replace()
        if self.rounds == 1:
            self.work = raw     # (its plan's cold work taken out: coldwork)
        self._trace("took a job: work %.3f ms, settled %s, %s" % (
            sum(work.values()) * 1e3, settled,
            "applied" if applied else "a plan not applied"
            if planned is not None else "no plan"))
        if applied:
            self._apply_safely(work, planned)
        marks, self.backlog = self.backlog, None
        if marks is not None and not self.done:
            self._submit(*marks)
        return applied

    # ------------------------------------------------------------ apply
    def _costs(self, work):
        """(units, per-unit work, per-unit sizes, entries in that order):
        each entry under the first unit that holds it. The lists are the
        layout's until its units or entries are replaced (made once: a
        plan applied on the forward's thread asked for them five times,
        ~5 ms each for SDXL's 794 units); read them, never change them."""
        lay = self.layout
        got = self.shape
        if got is None or got[0] is not lay.units or got[1] is not lay.entries:
            got = self.shape = (lay.units, lay.entries) + self._shape()
        units = got[2]
        gap = self._between() if work else 0.0
        return units, _listed(work, units, gap), got[3], got[4]

    def _between(self):
        """Seconds between two forwards to plan for (between.py): none
        read (off by default), no sum over the work."""
        if not self.between.samples:
            return 0.0
        return self.between.gap(sum(self.work.values()) if self.work
                                else 0.0)

    def _shape(self):
        """_costs()'s units, sizes and entries, and _need()'s ring, made
        from the layout."""
        units = list(self.layout.units)
        seen = set()
        sizes, flat = [], []
        for u in units:
            ss = []
            for e in u.entries:
                if id(e) not in seen:
                    seen.add(id(e))
                    ss.append(e.size)
                    flat.append(e)
            sizes.append(ss)
        rest = [e for e in self.layout.entries if id(e) not in seen]
        if rest:        # entries no unit holds: resident, last
            units.append(None)
            sizes.append([e.size for e in rest])
            flat += rest
        return units, sizes, flat, max(
            staging_need(u.entries) for u in self.layout.units)

    def _need(self):
        """The ring the largest unit needs (staging_need), made with
        _costs()'s lists."""
        self._costs({})
        return self.shape[5]

    def _rings(self, dev, need):
        """Ring sizes to try: the current one and, when vpager.torch sized
        it (offload(), or open_device() without staging_size), smaller
        ones the largest unit of every model on the device still fits in
        (under pressure any unit may miss whole). Every plan may go back
        up to the ring there was before the first: the first measured
        forward runs cold (600 ms of work for an 82 ms Flux step in
        ComfyUI), so its ties between rings say nothing."""
        cur = dev.options["staging_size"]
        if not self.resize:
            return [cur]
        if self.ring_top is None:
            self.ring_top = cur
        for h in list(self.ds.users):
            need = max(need, getattr(h, "staging_need", 0))
        rings = schedule.ring_sizes(need, max(cur, self.ring_top),
                                    self.link, dev.page_size, self.share())
        return sorted(set(rings) | {cur}, reverse=True)

    def plan(self, work, sizes, need, rings=None, planned=None, keep=None):
        """(Schedule, ring bytes) among `rings` (default: _rings()), as
        schedule.pick_ring chooses: the fastest predicted, or one as fast
        that copies less. planned: the planner's Planned (its budget and
        candidates), used as they are. keep: _keep()'s."""
        dev = self.layout.device
        if planned is None:
            total = dev.info()["budget"]
            share = self.share(again=True)
            cands = plan_rings(work, sizes, total,
                               rings or self._rings(dev, need),
                               dev.page_size, self.link, self.layout.align,
                               keep, share)
            cands = schedule.plan_rings_between(
                cands, work, sizes, total, dev.page_size, self.link,
                self.layout.align, spare_pages(), PER_COPY, MARGIN, keep,
                self.estimated, share)
        else:
            total, cands = planned.total, planned.cands
        # (A guess's budget, before torch's peak was learned, is no room
        # that shrank.)
        old = self.planned_for
        if old is not None and not self.guessed and total < SHRINK * old:
            self.roomier = max(self.roomier or 0, old)
        elif self.roomier is not None and total >= SHRINK * self.roomier:
            self.roomier = None
        self.planned_for = total
        self.rings = cands
        ring, sch = schedule.pick_ring(self.rings, self.link,
                                       self.estimated)
        return sch, ring

    def _fits(self, sch):
        """True if sch's resident set, where it lies now (placed for it),
        fits the budget planned for now beside the ring it has (as plan()
        counts room; a placement that kept weights in place may take more
        pages than the compact one plan() counts)."""
        page = self.layout.device.page_size
        room = (self.planned_for - ring_pages(self.ring, page)
                - spare_pages() * page)
        flat = self._costs({})[3]
        return len(pages_touched(flat, [e.offset for e in flat],
                                 sch.resident, page)) * page <= room

    def apply(self, work, replan=None, planned=None, rings=None):
        """Plan from the per-unit work (planned: the planner's candidates
        for it, see plan(); rings: the ring sizes to try, default
        _rings()) and apply it. replan: why the watch planned again,
        "room" (another budget: the placement is kept only if the plan
        made for it is the same), "fills" (weights given or rid of a
        fill: kept as for a forward measured again, if it keeps every
        weight with a fill resident) or "refine" (refine(): the plan's
        own resident set placed, not the one nearest the placement)."""
        lay = self.layout
        dev = lay.device
        self._measure_link()
        units, w, sizes, flat = self._costs(work)
        need = self._need()
        if planned is None:
            self.fills_planned = lay.fill_changes
        keep = _keep(flat)
        t0 = time.perf_counter()
        sch, ring = self.plan(w, sizes, need, rings=rings, planned=planned,
                              keep=keep)
        if planned is None:
            self._trace("planned on this thread in %.1f ms"
                        % ((time.perf_counter() - t0) * 1e3))
        old = self._old()
        if old is not None and ring == self.ring and \
                sch.resident != old.resident and replan != "refine":
            sch = self._nearest(old, sch, w, sizes, ring, keep, planned)
        merged = planned.merged(sch) if planned is not None else None
        if replan and old is not None and ring == self.ring and \
                sch.resident == old.resident and self._fits(old):
            return                  # the same plan: nothing to move
        other_ring = ring != self.ring and not self.first_now
        if old is not None and replan not in ("room", "refine") and \
                (not other_ring or (replan is None and not self.guessed)) \
                and self._fits(old) and (keep is None or all(
                    r for r, k in zip(old.resident, keep) if k)):
            # Measured again, or fills changed, the same ring: place anew
            # only for a clear gain (2%), else keep the placement (if it
            # still fits the budget: torch's activations may have taken
            # some since) and take new windows. Measured again, another
            # ring: the same within RING_KEEP (a ring's change places
            # every streamed weight anew: at a pause, not in a forward),
            # unless the placement is the guess made before any forward.
            eff = schedule.usable(self.ring, self.share())
            got = (planned.kept(old.resident, self.ring)
                   if planned is not None else None)
            if got is None:
                t_old = self._predicted(old, w, sizes)
                base = merged = None
            else:
                t_old, base, merged = got
            if t_old <= sch.predicted * (1 + (RING_KEEP if other_ring
                                              else 0.02)):
                self.better = t_old > sch.predicted * (1 + REFINE)
                if base is None:
                    base = schedule.windows(w, sizes, old.resident, self.link,
                                            eff, PER_COPY, MARGIN)
                sch = schedule.Schedule(
                    old.resident, base, t_old, old.streamed,
                    old.resident_bytes, float(sum(w)))
                self.schedule, self.guessed = sch, False
                self._windows(units, sizes, sch, self.ring, merged)
                self._log(sch, self.ring, units, w)
                return
        cur = dev.options["staging_size"]
        if ring != cur:
            t0 = time.perf_counter()
            try:
                dev.set_staging_size(ring)
                self._trace("ring %d -> %d in %.1f ms" % (
                    cur >> 20, ring >> 20,
                    (time.perf_counter() - t0) * 1e3))
            except BusyError:       # a model sharing the ring holds some
                sch, ring = self.plan(w, sizes, need, [cur],
                                      keep=_keep(flat))
                merged = None
        step = self._step(old, sch, w, sizes, ring, keep)
        if step is not sch:
            sch, merged = step, None
        # A refine in the ring in use places only what is predicted
        # faster than the placement in hand: the plan itself by REFINE
        # (else _placed's host time is spent for nothing: 20 ms of a
        # step), then the set _placed comes to (a budget grown by the
        # margin's 38 MB: the plan's set, kept in place to spare 810 MB
        # of fills, streamed 54 MB more than the one in hand; the node's
        # Flux on the H100 ran 3.5% slower after).
        hand = self._predicted(old, w, sizes) if replan == "refine" and \
            old is not None and ring == cur else None
        if hand is not None and sch.predicted * (1 + REFINE) >= hand:
            self._trace("refined: %.3f ms predicted against %.3f in hand; "
                        "kept" % (sch.predicted * 1e3, hand * 1e3))
            return
        try:
            t0 = time.perf_counter()
            kept, placed = self._placed(lay, flat, sch, w, sizes, ring, keep,
                                        replan == "refine")
            self._trace("the placement chosen in %.1f ms"
                        % ((time.perf_counter() - t0) * 1e3))
            if hand is not None and kept.predicted >= hand:
                self._trace("refined: %.3f ms predicted, no faster than "
                            "the placement in hand; kept"
                            % (kept.predicted * 1e3))
                return
            own = sch
            if kept is not sch:
                sch, merged = kept, None
            self._place(lay, dev, flat, units, w, sizes, sch, ring, merged,
                        placed=placed)
            # Kept in place in a forward though the plan's own set is
            # REFINE faster: placed at the client's next pause (refine()),
            # if its forwards pay for the fill there (PAYBACK).
            self.better = replan != "refine" and \
                sch.predicted > own.predicted * (1 + REFINE)
        except _NoRoom:
            if dev.options["staging_size"] != cur:
                dev.set_staging_size(cur)
            self._trace("no room in the VBAR for the plan's placement")
            return                  # no room to place it: keep the layout
        except BaseException:
            # The forwards go on with the ring they had: a new ring the
            # device cannot hold now (torch took room since it was
            # planned) must not fail every later forward.
            if dev.options["staging_size"] != cur:
                dev.set_staging_size(cur)
                self.ring = cur
            raise

    def _predicted(self, old, w, sizes):
        """The placement in hand's predicted forward under the work `w`
        with the ring in use."""
        return schedule.simulate(w, sizes, old.resident, self.link,
                                 schedule.usable(self.ring, self.share()),
                                 PER_COPY)

    def _nearest(self, old, sch, w, sizes, ring, keep, planned=None):
        """sch, or the resident set nearest old's that fits the room
        (schedule.nearest) where that is predicted within NEAR of sch: a
        plan made again (another budget, a LoRA's fills, a later measured
        forward) then moves few weights, and the placement keeps the rest
        where they lie. planned: the planner's, which computed it off this
        thread (Planned.near) when it could."""
        got = planned.near(old.resident, sch, keep) if planned is not None \
            else False
        if got is not False:
            if got is None:
                return sch
            res, t, window, _merged = got
            return self._schedule_for(res, w, sizes, ring, t, window)
        lay = self.layout
        got = schedule.nearest_within(
            w, sizes, old.resident, sch, self.planned_for, ring,
            lay.device.page_size, lay.align, spare_pages(), self.link,
            PER_COPY, NEAR, keep, self.share())
        if got is None:
            return sch
        return self._schedule_for(got[0], w, sizes, ring, got[1])

    def _step(self, old, sch, w, sizes, ring, keep):
        """sch, or a schedule one step toward it (schedule.toward: at most
        STEP of sch's streamed bytes leave the resident set in place, all
        of which the forward that takes it would copy again), sch kept in
        self.heading for the next forwards' steps (_next_step)."""
        self.heading = None
        lay = self.layout
        if old is None or not lay.vbar.loaded_size() or \
                not env.flag(PLACE_STEPS, False):
            return sch              # nothing resident to keep
        page = lay.device.page_size
        room = (self.planned_for - ring_pages(ring, page)
                - spare_pages() * page)
        res = schedule.toward(old.resident, sch.resident, sizes, room, page,
                              lay.align, keep, int(STEP * sch.streamed))
        if res is None or res == sch.resident:
            return sch
        self.heading = (sch, ring)
        return self._schedule_for(res, w, sizes, ring)

    def _schedule_for(self, res, w, sizes, ring, t=None, window=None):
        """A Schedule of resident flags `res` (t: its predicted time,
        simulated if None; window: its windows, computed if None)."""
        lay = self.layout
        eff = schedule.usable(ring, self.share())
        if t is None:
            t = schedule.simulate(w, sizes, res, self.link, eff, PER_COPY)
        if window is None:
            window = schedule.windows(w, sizes, res, self.link, eff,
                                      PER_COPY, MARGIN)
        streamed = sum(s for s, r in zip((s for ss in sizes for s in ss),
                                         res) if not r)
        return schedule.Schedule(
            res, window, t, streamed,
            schedule.resident_pages(sizes, res, lay.device.page_size,
                                    lay.align),
            float(sum(w)))

    def _next_step(self):
        """At a forward's start: the next step toward self.heading placed
        (the last one is the schedule itself); given up if the ring or
        the room changed since (the next plan starts again)."""
        sch, ring = self.heading
        lay = self.layout
        dev = lay.device
        why = ("the ring changed" if ring != self.ring or
               dev.options["staging_size"] != ring else
               "the room moved" if self._room_moved() else
               "the weights may not move now"
               if not self.model.may_replace() else None)
        if why is not None:
            self._given_up(why)
            return
        units, w, sizes, flat = self._costs(self.work or {})
        heading, cur = self.heading, self.schedule
        nxt = self._step(cur, sch, w, sizes, ring, _keep(flat))
        placed = None
        if self.relocate:
            placed = self._apart(lay, flat, nxt.resident, ring,
                                 self._now(lay, flat, nxt.resident))
        placed = placed or self._placement(lay, flat, nxt.resident, ring)
        # Resident before and after, filled again where it moves (those
        # that join were streamed: copied anyway; those relocate.py
        # copies on the device cost no link time).
        copied = placed[3] if len(placed) > 3 else [False] * len(flat)
        moved = 0 if cur is None else sum(
            e.size for e, was, r, k, c in zip(flat, cur.resident,
                                              nxt.resident, placed[2],
                                              copied)
            if was and r and not k and not c)
        if moved > STEP * sch.streamed and \
                cur.predicted <= sch.predicted * (1 + NEAR):
            # The weights kept leave holes the next step's do not fit in:
            # it would fill much of the resident set again (Flux 9.4 GiB
            # at 6 GiB on the H100: 2.4 of 5.0 GB, for 1.9% predicted; the
            # next prompt's steps 1.4-2.2x a steady one) for less than
            # the gain a plan needs to move weights at all.
            self.heading = heading
            self._given_up("the next would fill %d MB again for %.3f ms "
                           "predicted" % (moved >> 20, (cur.predicted -
                                                        sch.predicted) * 1e3))
            return
        try:
            self._place(lay, dev, flat, units, w, sizes, nxt, ring,
                        placed=placed)
        except _NoRoom:
            self._given_up("no room in the VBAR")
        except Exception as e:      # noqa: BLE001 (outputs stay right)
            self.heading = None
            warnings.warn("vpager.torch: a step of the copy schedule's "
                          "placement failed (%s: %s); the model runs on "
                          "with the placement it has"
                          % (type(e).__name__, e), RuntimeWarning)

    def _given_up(self, why):
        """The steps toward self.heading stop (the next plan starts
        again): said under VPAGER_SCHEDULE_LOG, with why."""
        if self.heading is not None and \
                env.flag("VPAGER_SCHEDULE_LOG", False):
            sys.stderr.write("vpager.torch placement: the steps toward a "
                             "schedule predicted %.3f ms stop: %s\n"
                             % (self.heading[0].predicted * 1e3, why))
        self.heading = None

    def _place(self, lay, dev, flat, units, w, sizes, sch, ring,
               merged=None, placed=None):
        """Place the weights for schedule `sch` with a ring of `ring`
        bytes, and fill the resident set (merged: _windows'; placed:
        _placement()'s answer for it, if asked already)."""
        page = dev.page_size
        self.better = False
        placed = placed or self._placement(lay, flat, sch.resident, ring)
        offsets, end, stay = placed[:3]
        moving = placed[3] if len(placed) > 3 else None
        self.relocated_bytes = 0
        kept = sum(e.size for e, k in zip(flat, stay) if k)
        if env.flag("VPAGER_SCHEDULE_LOG", False):
            sys.stderr.write(
                "vpager.torch placement (%d forwards measured): %d of %d "
                "resident bytes kept in place, %d loaded before; planned "
                "for %d, end %d of the VBAR's %d, ring %d%s\n" % (
                    self.rounds, kept, sum(e.size for e, r in zip(
                        flat, sch.resident) if r), lay.vbar.loaded_size(),
                    self.planned_for, end, lay.vbar.size, ring,
                    "; a step" if self.heading is not None else ""))
        if end > lay.vbar.size:
            raise _NoRoom("no room in the VBAR to place the schedule")
        self.ring = ring
        npages = lay.vbar.size // page
        runs = pages_touched(flat, offsets, sch.resident, page)
        if kept or moving is not None:
            # Weights left where they lie keep their bytes: only the pages
            # outside the new resident runs go (ranked last, so evicted
            # first), and only the moved weights are filled again (or
            # copied on the device: relocate.py).
            held = None
            if moving is not None:      # (relocate.py)
                movers = [e for e, m in zip(flat, moving) if m]
                held = relocate.hold(lay, movers, self.model.stream())
            try:
                self.model.swap(flat, offsets, None)     # Layout.move
            except BaseException:
                if held:
                    relocate.release(lay, movers, held, self.model.stream())
                raise
            lay.vbar.set_ranks(scheduled_ranks(flat, offsets, sch.resident,
                                               page, npages))
            if held is not None:
                stay = self._relocate(lay, flat, movers, held, len(runs))
                kept = sum(e.size for e, k in zip(flat, stay) if k)
            flags = lay.vbar.residency()
            extra = sum(1 for p in range(npages)
                        if flags[p] & PAGE_RESIDENT and p not in runs)
            if extra:
                t0 = time.perf_counter()
                lay.vbar.free_memory(extra * page)
                self._trace("%d pages evicted in %.1f ms" % (
                    extra, (time.perf_counter() - t0) * 1e3))
        else:
            self.model.swap(flat, offsets, [e.src for e in flat])
            lay.vbar.set_ranks(scheduled_ranks(flat, offsets, sch.resident,
                                               page, npages))
        self.kept_bytes = kept
        # The streamed weights miss at once (no commit tried, so nothing
        # evicted for them): the watermark just above the resident runs,
        # before the resident set is filled (warm, _fill_ahead).
        lay.watermark = len(runs) * page
        lay.vbar.set_watermark(lay.watermark)
        lay.groups = None
        self.model.scheduled()
        self.schedule, self.guessed = sch, False
        self._windows(units, sizes, sch, ring, merged)
        if self.planner is None or self.fill_now:
            self.warm(flat, sch.resident, ring, max(sch.window or [0]))
        else:
            self._fill_ahead(units, flat, sch.resident, stay)
        self._log(sch, ring, units, w)

    def _placement(self, lay, flat, resident, ring, now=None):
        """(offsets, end, kept: per entry, left in place with its bytes)
        for a schedule's resident set (placement.place_moving_least): the
        resident weights whose pages are all resident now may stay where
        they lie, within the room the plan had (or the compact
        placement's, when that is more: weights kept for their fills).
        now: _now()'s flags for `resident`, if read already."""
        page = lay.device.page_size
        if self.schedule is None and not lay.vbar.loaded_size():
            offsets, end = place_resident_first(flat, lay.align, page,
                                                resident)
            return offsets, end, [False] * len(flat)
        if now is None:
            now = self._now(lay, flat, resident)
        return place_moving_least(flat, resident, now,
                                  [e.offset for e in flat], lay.align, page,
                                  self._room_pages(ring), lay.vbar.size)

    def _now(self, lay, flat, resident):
        """Per entry: in `resident` and its pages all resident now."""
        now = lay.resident_now()
        return [r and now(e) for e, r in zip(flat, resident)]

    def _room_pages(self, ring):
        """Pages the resident set may take beside a ring of `ring` bytes."""
        page = self.layout.device.page_size
        return (self.planned_for - ring_pages(ring, page)
                - spare_pages() * page) // page

    def _placed(self, lay, flat, sch, w, sizes, ring, keep, refine=False):
        """(schedule, _placement()'s answer) to place: sch's own, or, where
        that fills weights resident now again (moved to close the holes
        the kept ones leave), the set that keeps every one where it lies
        and streams a little more (placement.place_streaming_least), if
        that is predicted within NEAR of sch and, for a refine, its
        slower forwards would not pay for the fill within PAYBACK."""
        if self.schedule is None and not lay.vbar.loaded_size():
            return sch, self._placement(lay, flat, sch.resident, ring)
        now = self._now(lay, flat, sch.resident)
        if self.relocate:
            apart = self._apart(lay, flat, sch.resident, ring, now)
            if apart is not None:
                return sch, apart
        if self.heading is not None:    # a step: toward's own room
            return sch, self._placement(lay, flat, sch.resident, ring)
        placed = self._placement(lay, flat, sch.resident, ring, now)
        again = sum(e.size for e, n, k in zip(flat, now, placed[2])
                    if n and not k)
        if not again or self.fill_now:
            # (Filled now, in the cold step: streaming more at every later
            # forward to save that fill saves nothing a user waits for;
            # SDXL's host-bound steps pay for each weight streamed, which
            # the plan, compute-bound, prices at nothing.)
            return sch, placed
        alt = place_streaming_least(flat, sch.resident, now,
                                    [e.offset for e in flat], lay.align,
                                    lay.device.page_size,
                                    self._room_pages(ring), lay.vbar.size,
                                    keep)
        if alt is None:
            return sch, placed
        res, offsets, end, stay = alt      # fills none again
        other = self._schedule_for(res, w, sizes, ring)
        slower = other.predicted - sch.predicted
        if other.predicted > sch.predicted * (1 + NEAR) or (
                refine and self.link and slower * PAYBACK > again / self.link):
            self._trace("keeping every weight in place streams %d MB more"
                        ": %.3f ms predicted against %.3f; %d MB filled "
                        "again instead" % (
                            (other.streamed - sch.streamed) >> 20,
                            other.predicted * 1e3, sch.predicted * 1e3,
                            again >> 20))
            return sch, placed
        self._trace("every weight kept in place, %d MB more streamed "
                    "(%.3f ms predicted against %.3f), not %d MB filled "
                    "again" % ((other.streamed - sch.streamed) >> 20,
                               other.predicted * 1e3, sch.predicted * 1e3,
                               again >> 20))
        return other, (offsets, end, stay)

    def _apart(self, lay, flat, resident, ring, now):
        """(offsets, end, kept: none, moving: per entry, its bytes to be
        copied on the device) of place_apart for `resident`, the weights
        resident now (now: _now()'s flags) and fill-less its moving ones;
        None if it does not fit the VBAR or the room."""
        moving = [n and e.fill is None for e, n in zip(flat, now)]
        page = lay.device.page_size
        got = place_apart(flat, resident, moving, [e.offset for e in flat],
                          lay.align, page, lay.vbar.size)
        if got is None or len(pages_touched(flat, got[0], resident, page)) \
                > self._room_pages(ring):
            return None
        return got[0], got[1], [False] * len(flat), moving

    def _relocate(self, lay, flat, movers, held, nruns):
        """The held movers' bytes copied on the device from their old
        offsets (relocate.copy_in), the watermark first set above the new
        resident runs (`nruns` pages) so their pages commit; returns the
        entries' stay flags: True for those copied."""
        lay.vbar.set_watermark(nruns * lay.device.page_size)
        t0 = time.perf_counter()
        done = relocate.copy_in(lay, movers, held, self.model.stream(),
                                self.target)
        self.relocated_bytes = sum(e.size for e in movers if id(e) in done)
        self._trace("%d of %d moved weights (%d MB) copied on the device "
                    "in %.1f ms" % (len(done), len(movers),
                                    self.relocated_bytes >> 20,
                                    (time.perf_counter() - t0) * 1e3))
        return [id(e) in done for e in flat]

    def _fill_ahead(self, units, flat, resident, stay):
        """The forward after a placement fills its resident set as it runs
        (FILL_UNITS): windows grown by the resident weights it moved (not
        those it left in place, `stay`), no units held; _filled() undoes
        it. Nothing moved: nothing to fill, the plan's windows and held
        units at once."""
        res = {id(e): r and not k for e, r, k in zip(flat, resident, stay)}
        if not self.windows or not any(res.values()):
            return              # the device's lookahead, or all in place
        mine = [0 if u is None else sum(e.size for e in u.entries
                                        if res.get(id(e)))
                for u in units]
        saved = [u.window if u is not None else None for u in units]
        for i, u in enumerate(units):
            if u is not None:
                u.window = (u.window or 0) + sum(mine[i + 1:i + 1 +
                                                      FILL_UNITS])
        self.filling = (saved, self.model.held())
        self.model.hold(())
        self.layout.set_windows(units)

    def _filled(self):
        """At a forward's start after the filling one: the planned windows
        and held units back."""
        if self.filling is None:
            return
        saved, held = self.filling
        self.filling = None
        units = self._costs({})[0]
        for u, w in zip(units, saved):
            if u is not None:
                u.window = w
        self.layout.set_windows(units)
        self.model.hold(held)

    def _windows(self, units, sizes, sch, ring, merged=None):
        """Each unit's window: the largest of those the measured forwards
        ask for (a model may run forwards of several kinds, a prefill and
        then decode steps: a window long enough for each); merged: those
        windows as the planner computed them."""
        if merged is None:
            gap = self._between()
            merged = schedule.merged_windows(
                sch.window, [_listed(work, units, gap)
                             for work in self.works],
                sizes, sch.resident, self.link,
                schedule.usable(ring, self.share()), PER_COPY, MARGIN)
        sch.window = list(merged)
        held = self._hold(units, sch)
        self.model.lend_at(self._last_streamed(units, sch))
        if self.windows:
            for u, win in zip(units, smooth(carried(units, sch.window,
                                                    held))):
                if u is not None:
                    u.window = win
            self.layout.set_windows(units)

    def _last_streamed(self, units, sch):
        """The forward's last unit with a weight the schedule streams (its
        prefetch goes on into a loan of torch's cache: lend.py); made
        again only when the units or the resident set change, as _hold's
        candidates are."""
        resident = tuple(sch.resident)
        got = self.last_streamed
        if got is None or got[0] is not units or got[1] != resident:
            flat = self._costs({})[3]       # the order of sch.resident
            streams = {id(e) for e, r in zip(flat, resident) if not r}
            got = self.last_streamed = (units, resident, next(
                (u for u in reversed(units) if u is not None and any(
                    id(e) in streams for e in u.entries)), None))
        return got[2]

    def _hold(self, units, sch):
        """Units held for the whole forward (HotPath.hold): those whose
        weights are all resident, their own (no other unit lists one) and
        no buffers (written back per call), where it pays (HOLD_SHARE).
        Returns those held."""
        # Which units qualify changes with the units and the resident set
        # only (each plan applied asks: 7 ms of SDXL's host-bound step).
        resident = tuple(sch.resident)
        if self.holdable is None or self.holdable[0] is not units or \
                self.holdable[1] != resident:
            count = {}
            for u in units:
                for e in (u.entries if u is not None else ()):
                    count[id(e)] = count.get(id(e), 0) + 1
            flat = self._costs({})[3]       # the order of sch.resident
            on = {id(e): r for e, r in zip(flat, resident)}
            self.holdable = (units, resident, [
                u for u in units if u is not None and u.entries
                and not u.buffers
                and all(on.get(id(e)) and count[id(e)] == 1
                        for e in u.entries)])
        held = self.holdable[2]
        # A plan from the cold forward's estimate (up to COLD_OVER times
        # the step: SDXL's 115.7 ms for 83) would hold none of SDXL's 360
        # resident units, so its first prompt ran unheld.
        step = sch.predicted / (schedule.COLD_OVER if self.estimated else 1)
        if (not env.flag("VPAGER_HOLD", True)
                or len(held) * UNIT_HOST < HOLD_SHARE * step):
            held = []
        now = self.model.held()
        if len(now) == len(held) and all(a is b for a, b in zip(now, held)):
            return now                  # as held (its batch stays)
        return self.model.hold(held)    # (it keeps Parameters only)

    def _log(self, sch, ring, units, w):
        if env.flag("VPAGER_SCHEDULE_LOG", False):
            sys.stderr.write(
                "vpager.torch schedule (forward %d): %r; ring %d, %s "
                "(tried: %s); link %.2f GB/s; units %d (%d held); work "
                "%.3f ms%s; windows (KiB) %s\n"
                % (self.rounds, sch, ring,
                   "wraps" if self.share() == schedule.WRAPS
                   else "first fit", ", ".join(
                    "%d MiB %.3f ms" % (r >> 20, c.predicted * 1e3)
                    for r, c in self.rings), self.link / 1e9, len(units),
                   len(self.model.held()), sum(w) * 1e3,
                   " (the cold forward's estimate)" if self.estimated else "",
                   " ".join("%d" % (x >> 10) for x in sch.window[:48])))

    def warm(self, entries, resident, ring, window):
        """Fill the resident set now, at the end of the measured forward,
        so that the next forward is already a steady one: acquire and
        release the resident weights in batches the ring could hold (were
        they to miss) on the compute stream; then, with the windows on,
        the last weight, whose prefetch (`window` bytes) wraps to the
        first streamed weights, as the end of every forward does."""
        lay = self.layout
        lay.wait_loaded()       # it copies from the whole host copy
        stream = self.model.stream()
        # (A weight with a fill, patches.set_fill, fills at its forward's
        # acquire: this one would not rewrite its bytes.)
        todo = [lay.weight(e) for e, r in zip(entries, resident)
                if r and e.fill is None]
        chunks, cur, size = [], [], 0
        for w in todo:
            if cur and size + w.size > ring // 2:
                chunks.append(cur)
                cur, size = [], 0
            cur.append(w)
            size += w.size
        if cur:
            chunks.append(cur)
        ahead = None            # the weights' windows
        if self.windows and entries and entries[-1].fill is None:
            ahead = window
            chunks.append([lay.weight(entries[-1])])
        for ws in chunks:
            b = WeightBatch(lay.device, ws, lookahead=ahead)
            b.acquire(stream)
            b.release(stream)
        if self.ds.sync:
            lay.device.synchronize(stream)


def plan_rings(work, sizes, total, rings, page, link, align, keep=None,
               share=schedule.FRAGMENTATION):
    """[(ring, Schedule)]: schedule.plan_rings() with the tuner's
    constants, on this thread."""
    return schedule.plan_rings(work, sizes, total, rings, page, link, align,
                               spare_pages(), PER_COPY, MARGIN, keep, share)


def _keep(flat):
    """Per entry, whether a plan keeps it resident if it can: a weight
    with a fill (a LoRA patch computed on the device) streamed pays its
    patch math on the compute stream at every forward (Flux 9.4 GiB at
    6 GiB on the H200: +28% a step); resident, once. None: no fills."""
    keep = [e.fill is not None for e in flat]
    return keep if any(keep) else None


class Planned:
    """What the planner computed for one measured forward
    (schedule.plan_job): total, the budget planned for; cands, [(ring,
    Schedule)]; merged(sch), the pick's windows merged over the measured
    forwards if sch is the pick; kept(resident, ring), (predicted,
    windows, merged windows) of the placement kept, if it was computed
    for that resident set and ring; near(old, sch), (resident, predicted,
    windows, merged windows) of the set nearest old (Tuner._nearest) if
    it was computed for old, sch the pick and keep, or None; False if it
    was not computed (merged() gives the near set's merged windows too)."""

    def __init__(self, total, out, old_resident, old_ring, keep=None):
        self.total = total
        self.cands = [(r, schedule.Schedule(*f)) for r, f in out["cands"]]
        self._pick, self._merged = out["pick"]
        self._old = out["old"]
        self._near = out.get("near")
        self._old_key = (old_resident, old_ring)
        self._keep = keep

    def merged(self, sch):
        if sch is self.cands[self._pick][1]:
            return self._merged
        if self._near is not None and sch.resident == self._near[0]:
            return self._near[3]
        return None

    def kept(self, resident, ring):
        if self._old is None or self._old_key != (list(resident), ring):
            return None
        return self._old

    def near(self, old, sch, keep):
        if self._old is None or self._old_key[0] != list(old) or \
                sch is not self.cands[self._pick][1] or keep != self._keep:
            return False
        return self._near


def plan_job(work, works, sizes, total, rings, page, link, align,
             old_resident, old_ring, keep=None, remote=False,
             estimated=False, share=schedule.FRAGMENTATION):
    """Planned: schedule.plan_job() with the tuner's constants (estimated:
    pick_ring's; share: schedule.usable()'s). remote: in the planner's processes (planproc.py:
    interpreters of their own, so the plan's pure-Python seconds take no
    GIL from the forward's thread; each ring size in one), computed here
    if they cannot be had."""
    args = (work, works, sizes, total, rings, page, link, align,
            spare_pages(), PER_COPY, MARGIN, old_resident, old_ring, keep,
            NEAR)
    got = None
    if remote:
        # Each ring size in a process of its own, then those between
        # (schedule.rings_between), then the pick's windows.
        cands = _ring_fields(work, sizes, total, rings, page, link, align,
                             keep, share) if len(rings) > 1 else None
        if cands is not None:
            more = schedule.rings_between(
                [(r, schedule.Schedule(*f)) for r, f in cands], link, page,
                estimated)
            extra = _ring_fields(work, sizes, total, more, page, link,
                                 align, keep, share) if more else []
            cands = None if extra is None else \
                sorted(cands + extra, key=lambda c: -c[0])
        got = planproc.call("plan_job", *args, cands, estimated, share)
    out = got[0] if got is not None else \
        schedule.plan_job(*args, estimated=estimated, share=share)
    return Planned(total, out, old_resident, old_ring, keep)


def _ring_fields(work, sizes, total, rings, page, link, align, keep, share):
    """schedule.ring_fields() of each ring in `rings`, each in a planner's
    process of its own; None if they cannot be had."""
    each = planproc.call_each("ring_fields", [
        (work, sizes, total, [r], page, link, align, spare_pages(), PER_COPY,
         MARGIN, keep, share) for r in rings])
    return None if each is None else [c for cs in each for c in cs]


def _listed(work, units, gap=0.0):
    """unit -> seconds as a list in `units`' order, `gap` (the time
    between two forwards, between.py) added to the last: what follows it
    in the cyclic model."""
    out = [work.get(u, 0.0) for u in units]
    if gap and out:
        out[-1] += gap
    return out


def carried(units, window, held):
    """The windows with each run of held units' largest given to the unit
    before the run: held units run bare (no acquire sets a window), so
    the acquire before them sets the window they would have."""
    held = {id(u) for u in held}
    out, carry = list(window), 0
    for i in range(len(out) - 1, -1, -1):
        u = units[i]
        if u is None or id(u) in held:
            carry = max(carry, out[i])
        else:
            out[i] = max(out[i], carry)
            carry = 0
    return out


def smooth(window, slack=SLACK):
    """The window each unit's weights prefetch: the one before it while
    that is at most `slack` times larger than its own (no harm: the ring
    bounds prefetch anyway), so a run of units keeps one window and the
    prefetch tops it up a chunk at a time instead of scanning again for
    each larger one; else its own. The first unit has its own."""
    out, cur = [], None
    for w in window:
        if cur is None or not w <= cur <= w * slack:
            cur = w
        out.append(cur)
    return out
