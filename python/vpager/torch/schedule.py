"""The copy schedule of an offloaded module, in time rather than bytes.

Pure arithmetic on measured costs, no torch and no vpager calls: the
first forward measures what each unit costs (`work`: seconds of device
time from the start of the unit to the start of the next one, its own
compute and whatever the module computes between the two) and the link
(bytes per second, plus a fixed cost per copy); plan() then returns

* the resident set: the weights to keep in VRAM, chosen so the streamed
  bytes sit where compute hides them. A copy can only overlap the compute
  that runs before its unit, and the copy engine moves `link` bytes per
  second, so the streamed bytes up to each unit should grow with the
  compute done before it: weights that follow long compute are streamed,
  weights that follow little (a modulation linear fed a 1 x 3072 vector,
  after another one) stay resident.
* the window: for each unit, how many bytes of the streamed weights after
  it prefetch should have started by the time it is acquired. It is
  found in predicted time: a weight joins the window of the last unit
  acquired before its copy must start for no unit to wait.
* the predicted forward time (simulate()), to compare choices.

Weights are given per unit in placement (execution) order; a weight used
by several units is listed under the first. Units run one after another
on one compute stream, copies on one copy stream in weight order, into a
ring of `ring` bytes whose slots are free again once their unit is done.
The model is cyclic: the copies for a forward's first weights overlap
the previous forward's last units."""

import itertools

SLOT_ALIGN = 256            # the staging ring's slot alignment (stream.c)
FRAGMENTATION = 0.9         # share of the ring its first-fit slots fill
# ... where a slot that does not fit before the ring's end starts at 0. A
# ring whose slots wrap (its pages mapped twice: vp_device_info's
# staging_wraps) fills all of it: the share is 1. Every function below that
# takes `share` counts the ring at that share.
WRAPS = 1.0


def usable(ring, share=FRAGMENTATION):
    """Bytes of a ring of `ring` bytes its slots fill, at `share`."""
    return int(ring * share)


def _round(x, a):
    return (x + a - 1) // a * a


# A ring that holds less than this much link time cannot absorb the host's
# jitter between acquires, which simulate() does not model: on the H200 a
# 1536 x 2 MiB stack with the 6 MiB ring the prediction liked ran 1.67x a
# hand-written streamer, with a 384 MiB ring 1.10x.
RING_SECONDS = 0.002


def ring_sizes(need, current, link, page=1, share=FRAGMENTATION):
    """Ring sizes worth trying, largest first: `current` (offload()'s) and
    1-3 times `need` (the largest unit's staging), each also with the room
    first-fit slots leave (`share`: 2 x need in a ring of 2 x need
    does not double-buffer at FRAGMENTATION; in 2 x need / 0.9, rounded up
    to `page`, it does; a ring that wraps needs no such room, only the
    pages), none below what the link moves in RING_SECONDS (nor below
    `need`)."""
    floor = max(need, int(RING_SECONDS * (link or 0)))
    out = {current}
    for k in (1, 2, 3):
        room = k * need if share >= 1 else int(k * need / share) + 1
        for r in (k * need, _round(room, page)):
            if floor <= r < current:
                out.add(r)
    if floor < current:
        out.add(floor)
    return sorted(out, reverse=True)


# Plans whose predictions lie this close count as equally fast: the
# prediction runs 1-4% off the measured step on the H200, and candidates
# of one plan differ by less. The bytes copied are certain.
RING_TIE = 0.01

# A plan predicted within this of its all-resident time hides every copy
# under the compute: what it streams costs no time in the prediction.
HIDDEN = 0.001
# ... and its copies keep the link busy for at least this share of the
# compute: then the ring's depth is its only slack against the host's
# jitter (a copy that lands late stalls the unit). Below it the copies
# finish far ahead whatever the ring, and fewer streamed weights mean
# less host work a step (SDXL's steps are the host's).
BUSY = 0.5
# The cold forward's estimated work (coldwork.py) runs up to this many
# times the step it stands for (GGUF Q8_0 Flux on the H100: 204 ms for a
# 113 ms step), so a plan made from it counts as BUSY at this share less.
COLD_OVER = 2.0


def _hides_busy(c, link, estimated=False):
    """True if plan c hides every copy (HIDDEN) under a compute its copies
    keep the link BUSY for (estimated: the compute is the cold forward's
    estimate, COLD_OVER)."""
    busy = BUSY / COLD_OVER if estimated else BUSY
    return (bool(link) and c.predicted <= c.all_resident * (1 + HIDDEN)
            and c.streamed / link >= busy * c.all_resident)


def pick_ring(candidates, link, estimated=False):
    """The (ring, Schedule) to use among `candidates` (ring sizes tried
    with their plans) at `link` bytes/s. Of those predicted within
    RING_TIE of the fastest: if some hide all their copies under a
    compute that keeps the link BUSY, the largest ring of those (fp8 Flux
    at half its bytes with a LoRA on the H100, the link 75-82% busy:
    224 MiB ran 1.082-1.117 x L, 512 MiB 1.027-1.040); else the one that
    copies the fewest bytes a forward (more stays resident), then the
    largest ring (node Flux 4 GiB on the H200, link-bound: 448 MiB
    predicted 0.2% faster than 378 MiB ran 1.120 x L, 378 MiB
    1.049-1.060). estimated: the work is the cold forward's estimate
    (coldwork.py), which overstates the compute, so the link counts as
    busy at COLD_OVER times less (GGUF Q8_0 Flux on the H100: estimated
    204 ms for a 113 ms step, its copies 36% of that, the fewest bytes
    took 160 MiB and ran 1.164 x L, its ring waits pacing the host and
    the work measured after it; 512 MiB ran 1.012)."""
    return _picked(candidates, link, estimated)


def _picked(candidates, link, estimated):
    """pick_ring()'s rule (rings_between asks it too)."""
    fastest = min(c.predicted for _, c in candidates)
    close = [(i, ring, c) for i, (ring, c) in enumerate(candidates)
             if c.predicted <= fastest * (1 + RING_TIE)]
    deep = [(-ring, i) for i, ring, c in close
            if _hides_busy(c, link, estimated)]
    if deep:
        return candidates[min(deep)[1]]
    return candidates[min((c.streamed, -ring, i) for i, ring, c in close)[2]]


# Between two ring sizes the plans change in steps, not smoothly: a ring
# that holds one more run of consecutive streamed weights twice over keeps
# the link from waiting for a slot. Flux 9.4 GiB at 6 GiB, replanned from
# the H100's logs with 32 MiB pages (bench/cold_plan.py --rings): 378 MiB
# 97.7 ms, 288 MiB 100.9, 320 MiB 96.7, none of them tried before. So once
# the rings are planned, up to BETWEEN more sizes between the pick and the
# next smaller ring tried are.
BETWEEN = 3


def rings_between(candidates, link, page, estimated=False):
    """Ring sizes to try after `candidates` ([(ring, Schedule)] planned):
    up to BETWEEN whole pages strictly between pick_ring's pick and the
    next smaller ring tried, evenly spread, none tried already. None when
    one ring was tried (a plan for another room or a LoRA's fills keeps
    the ring in use), the pick is the smallest, or it hides every copy
    under a compute its copies keep busy (pick_ring then wants the
    largest ring, not fewer bytes)."""
    if len(candidates) < 2:
        return []
    ring, sch = _picked(candidates, link, estimated)
    below = [r for r, _ in candidates if r < ring]
    if not below or _hides_busy(sch, link, estimated):
        return []
    tried = {r for r, _ in candidates}
    page = max(page, 1)
    between = [r for r in range(_round(max(below) + 1, page), ring, page)
               if r not in tried]
    if len(between) <= BETWEEN:
        return between[::-1]
    step = len(between) / (BETWEEN + 1)
    return sorted({between[int(round(step * (k + 1)))]
                   for k in range(BETWEEN)}, reverse=True)


class Schedule:
    """plan()'s answer: resident (one bool per weight, in order), window
    (lookahead bytes per unit), predicted (seconds per forward), streamed
    (bytes copied per forward) and resident_bytes (VRAM the resident set
    takes, whole pages)."""

    __slots__ = ("resident", "window", "predicted", "streamed",
                 "resident_bytes", "all_resident")

    def __init__(self, resident, window, predicted, streamed, resident_bytes,
                 all_resident):
        self.resident = resident
        self.window = window
        self.predicted = predicted
        self.streamed = streamed
        self.resident_bytes = resident_bytes
        self.all_resident = all_resident

    def __repr__(self):
        return ("<Schedule %d of %d weights resident (%d bytes), %d bytes "
                "streamed, %.3f ms predicted (%.3f all-resident)>"
                % (sum(self.resident), len(self.resident),
                   self.resident_bytes, self.streamed,
                   self.predicted * 1e3, self.all_resident * 1e3))


def flat(sizes):
    """[(unit index, size)] of per-unit size lists, in order."""
    return [(u, s) for u, ss in enumerate(sizes) for s in ss]


def resident_pages(sizes, resident, page, align=512):
    """VRAM bytes the resident weights take when they lie together, each
    at an `align` boundary (placement.place_resident_first): whole pages
    of their sum."""
    fs = [s for ss in sizes for s in ss]
    return _pages(fs, [_round(s, align) for s in fs], resident, page)


def _pages(fs, rounded, resident, page):
    """resident_pages() of flat sizes `fs`, each rounded up to the
    alignment in `rounded` (_fit asks it ~50 times a plan: SDXL's 1168
    weights, 6 rings, 12 candidates each): every resident weight but
    the last takes its rounded size, the last its own."""
    try:
        last = len(resident) - 1 - resident[::-1].index(True)
    except ValueError:
        return 0
    total = sum(itertools.compress(rounded, resident))
    return _round(total - rounded[last] + fs[last], page)


def copy_seconds(size, link, per_copy):
    return size / link + per_copy


def simulate(work, sizes, resident, link, ring, per_copy=0.0, cycles=3,
             detail=False):
    """Predicted seconds per forward (steady state: `cycles` forwards run
    back to back, the period of the last) with these weights resident.
    Copies run in weight order as soon as the copy engine is free and the
    ring has room (a FIFO of slots: the oldest held slots are freed when
    their unit is done); a unit starts when the unit before it is done and
    its copies are. With detail: (period, unit start times, copy start
    times of the streamed weights, the streamed weights' (unit, size)),
    of the last cycle, relative to its start (copies that started in the
    cycle before are negative)."""
    n = len(work)
    streamed = [(u, s) for (u, s), r in zip(flat(sizes), resident) if not r]
    m = len(streamed)
    if not m:
        t = float(sum(work))
        return (t, _starts(work), [], []) if detail else t
    slots = [_round(s, SLOT_ALIGN) for _, s in streamed]
    cost = [copy_seconds(s, link, per_copy) for _, s in streamed]
    unit_of = [u for u, _ in streamed]
    first_of, last_of = {}, {}  # unit -> its first, last streamed weight
    for k, u in enumerate(unit_of):
        first_of.setdefault(u, k)
        last_of[u] = k
    done = [None] * (cycles * n)    # cycle * n + unit -> when it is done
    cstart, cend = [], []       # per global copy index
    engine, oldest, held = 0.0, 0, 0

    def copy_upto(g_end, now):
        nonlocal engine, oldest, held
        g = len(cend)
        while g < g_end:
            k = g % m
            t_ring = 0.0
            while held + slots[k] > ring and oldest < g:
                o = oldest
                d = done[(o // m) * n + unit_of[o % m]]
                t_ring = max(t_ring, now if d is None else d)
                held -= slots[o % m]
                oldest = o + 1
            t0 = max(engine, t_ring)
            engine = t0 + cost[k]
            cstart.append(t0)
            cend.append(engine)
            held += slots[k]
            g += 1

    starts = []
    prev = 0.0
    for c in range(cycles):
        row = []
        for u in range(n):
            ready = prev
            k = last_of.get(u)
            if k is not None:
                copy_upto(c * m + k + 1, prev)
                for j in range(c * m + first_of[u], c * m + k + 1):
                    if cend[j] > ready:
                        ready = cend[j]
            row.append(ready)
            prev = done[c * n + u] = ready + work[u]
        starts.append(row)
    period = starts[-1][0] - starts[-2][0] if cycles > 1 else prev
    if not detail:
        return period
    base = starts[-1][0]
    copy_upto(cycles * m, prev)
    c0 = (cycles - 1) * m
    return (period, [t - base for t in starts[-1]],
            [t - base for t in cstart[c0:c0 + m]], streamed)


def _starts(work):
    out, t = [], 0.0
    for w in work:
        out.append(t)
        t += w
    return out


def _positions(work, sizes, mix):
    """Per weight: where it lies in the forward, in seconds of compute:
    mix * (compute before its unit) + (1 - mix) * (its share of the bytes
    up to and including it, times the forward's compute)."""
    starts = _starts(work)
    T = float(sum(work))
    W = float(sum(s for ss in sizes for s in ss)) or 1.0
    out, acc = [], 0
    for u, ss in enumerate(sizes):
        for s in ss:
            acc += s
            out.append(mix * starts[u] + (1 - mix) * T * acc / W)
    return out


# Weights under 1/TINY of the largest stay resident: streaming one frees
# next to no budget and still costs a copy, a slot and a wait (Flux's
# norms and biases: bytes to kilobytes beside 126 MiB linears).
TINY = 1024


def _pick(sizes, pos, ring, scale, head, least=0, keep=None):
    """Stream weights of `least` bytes or more, in order, while the bytes
    streamed so far stay within scale * position + head bytes (and each
    unit's streamed weights fit in the ring), none that `keep` flags;
    returns the resident flags."""
    out = []
    streamed = i = 0
    for ss in sizes:
        unit_staged = 0
        for s in ss:
            slot = _round(s, SLOT_ALIGN)
            take = (s >= least and not (keep and keep[i])
                    and streamed + s / 2 <= scale * pos[i] + head
                    and unit_staged + slot <= ring)
            if take:
                streamed += s
                unit_staged += slot
            out.append(not take)
            i += 1
    return out


def _picker(sizes, ring, least, keep=None):
    """_pick(sizes, pos, ring, scale, head, least, keep) as a function of
    (pos, scale, head), with what does not depend on those taken once:
    only the weights it may stream are looked at (Flux's and SDXL's
    norms and biases, half the weights, are not)."""
    cand = []                   # (index, size, slot, unit)
    i = 0
    for u, ss in enumerate(sizes):
        for s in ss:
            if s >= least and not (keep and keep[i]):
                cand.append((i, s, _round(s, SLOT_ALIGN), u))
            i += 1
    n = i

    def pick(pos, scale, head):
        out = [True] * n
        streamed = staged = 0
        unit = -1
        for i, s, slot, u in cand:
            if u != unit:
                unit, staged = u, 0
            if streamed + s / 2 <= scale * pos[i] + head and \
                    staged + slot <= ring:
                streamed += s
                staged += slot
                out[i] = False
        return out
    return pick


def _streamed(sizes, resident):
    return sum(s for (_, s), r in zip(flat(sizes), resident) if not r)


MIXES = (1.0, 0.75, 0.5, 0.0)   # compute-weighted ... byte-weighted


# _fit's streaming rates: from the one that streams the bytes beyond the
# room over the forward, doubled up to this many times.
RATES = 40


def _fit(sizes, pos, room, page, ring, head, align, least, keep=None):
    """The fewest streamed bytes at this head start whose resident pages
    fit in room: bisection on the streaming rate; None if none fits."""
    T = max(pos) if pos else 0.0
    if T <= 0:
        return None
    fs = [s for ss in sizes for s in ss]
    rounded = [_round(s, align) for s in fs]
    total = sum(fs)
    pick = _picker(sizes, ring, least, keep)
    lo, hi = 0.0, None
    scale = max(total - room, 1) / T
    for _ in range(RATES):
        res = pick(pos, scale, head)
        if _pages(fs, rounded, res, page) <= room:
            hi = scale
            break
        lo = scale
        scale *= 2
    if hi is None:
        return None
    for _ in range(30):
        if hi - lo <= hi * 2e-3:
            break
        mid = (lo + hi) / 2
        res = pick(pos, mid, head)
        if _pages(fs, rounded, res, page) <= room:
            hi = mid
        else:
            lo = mid
    return pick(pos, hi, head)


def choose(work, sizes, room, page, link, ring, per_copy=0.0, align=512,
           keep=None, share=FRAGMENTATION):
    """The resident flags (one per weight, in order) whose resident pages
    fit in `room` bytes, chosen to hide the streamed bytes under compute.
    Candidates: streaming that follows the compute before each weight
    (mix 1), the bytes before it (mix 0, as the interleaved order does),
    or a blend, each with a head start of 0 to half the ring (copies for
    the first weights run under the previous forward's last units) and
    the fewest streamed bytes that fit; the one simulate() predicts
    fastest (then: fewest bytes streamed) wins. Tiny weights (TINY) stay
    resident, and so do those `keep` flags (a weight whose fill computes
    a patch on the device pays it at every fill: streamed, every
    forward); if no plan fits with them all resident, as many of them
    as fit, first in order (bisection on how many)."""
    n = len(flat(sizes))
    if resident_pages(sizes, [True] * n, page, align) <= room:
        return [True] * n
    least = max(s for ss in sizes for s in ss) // TINY
    kept = [i for i, k in enumerate(keep or ()) if k]

    def first(k):               # the first k kept
        some = [False] * n
        for i in kept[:k]:
            some[i] = True
        return some
    res = None
    if kept:
        # How many fit: a bisection on _fits_at_most (picks alone), then
        # one plan (a full plan at each of its steps took fp8 Flux's
        # replan at a LoRA change, its kept weights beyond the room, 139
        # ms on the H100's host).
        lo, hi = 0, len(kept) + 1   # hi kept do not fit; lo do (or none)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if _fits_at_most(work, sizes, room, page, ring, align, least,
                             first(mid)):
                lo = mid
            else:
                hi = mid
        if lo:
            res = _best(work, sizes, room, page, link, ring, per_copy,
                        align, least, first(lo), share)
    if res is None:
        res = _best(work, sizes, room, page, link, ring, per_copy, align,
                    least, share=share)
    if res is None:         # nothing fits: stream all the ring allows
        return _pick(sizes, [1.0] * n, ring, float("inf"), 0, least)
    return res


def _fits_at_most(work, sizes, room, page, ring, align, least, keep):
    """True if some candidate of _best keeping `keep` resident fits in
    room at _fit's highest streaming rate (the most it streams): then
    that _fit, and so _best, finds a plan. (Streaming less at a lower
    rate seldom leaves fewer pages resident: where it does, this says
    False and fewer weights are kept.)"""
    fs = [s for ss in sizes for s in ss]
    rounded = [_round(s, align) for s in fs]
    pick = _picker(sizes, ring, least, keep)
    for mix in MIXES:
        pos = _positions(work, sizes, mix)
        T = max(pos) if pos else 0.0
        if T <= 0:
            continue
        scale = max(sum(fs) - room, 1) / T * 2 ** (RATES - 1)
        for head in (0, ring // 4, ring // 2):
            if _pages(fs, rounded, pick(pos, scale, head), page) <= room:
                return True
    return False


def guess(sizes, room, page, ring, align=512):
    """Resident flags before any forward, with no compute measured: the
    streamed bytes spread evenly over the weights' bytes (choose()'s
    candidate of mix 0, no head start), the fewest whose resident pages
    fit in `room`; tiny weights resident. None if none fits."""
    n = len(flat(sizes))
    if resident_pages(sizes, [True] * n, page, align) <= room:
        return [True] * n
    least = max(s for ss in sizes for s in ss) // TINY
    pos = _positions([1.0] * len(sizes), sizes, 0.0)
    return _fit(sizes, pos, room, page, ring, 0, align, least)


def nearest(old, best, sizes, room, page, align=512, keep=None):
    """The resident flags closest to `old` that fit in `room`: old with
    `keep`'s weights resident, then, largest first, the weights `best`
    streams dropped until they fit (and if that is not enough, any not
    kept and not tiny, last first), or, when there is room, those `best`
    keeps added while they fit. A plan made again (another budget, a
    LoRA's fills) that is about as fast this way moves few weights. None
    if nothing fits."""
    sz = [s for _, s in flat(sizes)]
    res = [bool(o) or bool(keep and keep[i]) for i, o in enumerate(old)]
    kept = keep or [False] * len(sz)
    used = sum(_round(s, align) for s, r in zip(sz, res) if r)
    limit = room - page         # resident_pages rounds the sum up
    if used > limit:
        drop = sorted((i for i, r in enumerate(res)
                       if r and not best[i] and not kept[i]),
                      key=lambda i: -sz[i])
        least = max(sz) // TINY     # (tiny weights stay, as choose's)
        drop += [i for i in range(len(sz) - 1, -1, -1)
                 if res[i] and best[i] and not kept[i] and sz[i] >= least]
        for i in drop:
            if used <= limit:
                break
            res[i] = False
            used -= _round(sz[i], align)
    else:
        _add(res, best, sz, used, limit, align)
    return res if resident_pages(sizes, res, page, align) <= room else None


def _add(res, best, sz, used, limit, align):
    """The weights `best` keeps added to res, largest first, while the
    resident bytes (`used` now, each rounded to align) stay within limit."""
    for i in sorted((i for i, b in enumerate(best) if b and not res[i]),
                    key=lambda i: -sz[i]):
        if used + _round(sz[i], align) <= limit:
            res[i] = True
            used += _round(sz[i], align)


def toward(old, best, sizes, room, page, align=512, keep=None, limit=0):
    """The resident flags one step from `old` toward `best` that fit in
    `room`: a forward that takes a placement copies again every weight that
    leaves the resident set (the weights that join it it copied anyway, as
    streamed ones), so a step drops at most `limit` bytes of the weights
    best streams, largest first (more while the flags do not fit; at least
    one), then adds the weights best keeps, largest first, while they fit.
    best itself when what leaves is within limit. None if nothing fits."""
    sz = [s for _, s in flat(sizes)]
    kept = keep or [False] * len(sz)
    res = [bool(o) or bool(kept[i]) for i, o in enumerate(old)]
    gone = sorted((i for i, r in enumerate(res)
                   if r and not best[i] and not kept[i]),
                  key=lambda i: -sz[i])
    if sum(sz[i] for i in gone) <= limit:
        return (list(best) if resident_pages(sizes, best, page, align)
                <= room else None)
    # (resident_pages rounds the sum up: one page; the holes the dropped
    # weights leave, which the added ones fill only in part: another)
    lim = room - 2 * page
    used = sum(_round(s, align) for s, r in zip(sz, res) if r)
    dropped = 0
    for i in gone:
        if used <= lim and dropped and dropped + sz[i] > limit:
            continue
        res[i] = False
        used -= _round(sz[i], align)
        dropped += sz[i]
    _add(res, best, sz, used, lim, align)
    return res if resident_pages(sizes, res, page, align) <= room else None


def _best(work, sizes, room, page, link, ring, per_copy, align, least,
          keep=None, share=FRAGMENTATION):
    """choose()'s fastest candidate, None if none fits."""
    best = None
    for mix in MIXES:
        pos = _positions(work, sizes, mix)
        for head in (0, ring // 4, ring // 2):
            res = _fit(sizes, pos, room, page, ring, head, align, least,
                       keep)
            if res is None:
                continue
            t = simulate(work, sizes, res, link, usable(ring, share),
                         per_copy)
            key = (round(t, 7), _streamed(sizes, res), -mix, head)
            if best is None or key < best[0]:
                best = (key, res)
    return None if best is None else best[1]


def windows(work, sizes, resident, link, ring, per_copy=0.0, margin=0.0):
    """Lookahead bytes per unit: at unit i's acquire, prefetch should have
    started every streamed weight whose predicted copy start comes before
    unit i + 2 starts (the acquire of unit i + 1 may come late), plus
    `margin` seconds; at least the weights of the next unit that streams
    any. From the unit of the forward's last streamed weight on, the
    next forward's first weights as far as the ring holds them. The bytes
    count the streamed weights after unit i, in order and wrapping, as
    vp_acquire's prefetch counts them."""
    n = len(work)
    period, starts, cstarts, streamed = simulate(
        work, sizes, resident, link, ring, per_copy, detail=True)
    m = len(streamed)
    if not m:
        return [0] * n
    # streamed weights in cyclic order with absolute times: this cycle's
    # and the next one's (shifted by a period)
    first_after = []            # per unit: index of its first streamed
    # weight after the unit (weights of later units)
    k = 0
    for u in range(n):
        while k < m and streamed[k][0] <= u:
            k += 1
        first_after.append(k)
    # From the last streamed weight's unit on, an acquire's prefetch can
    # only reach the next forward's weights, and the next acquire that
    # would queue more is that forward's first: after the sampler, the
    # client's callback and the host's way back into the model (Flux
    # under the node, H100: 5.4 ms of each step, the copy engine idle
    # with the ring a third empty). Those acquires take what the ring holds.
    wrap, used = 0, 0
    for _, size in streamed:
        used += _round(size, SLOT_ALIGN)
        if used > ring:
            break
        wrap += size
    last = streamed[-1][0]
    out = []
    for i in range(n):
        j = i + 2
        deadline = (starts[j] if j < n else period + starts[j - n]) + margin
        k0 = first_after[i]
        total = 0
        first_unit = streamed[k0 % m][0]
        for step in range(m):
            g = k0 + step
            c, k = divmod(g, m)
            t = cstarts[k] + c * period
            if t > deadline and (streamed[k][0] != first_unit or step >= m):
                break
            total += streamed[k][1]
        out.append(max(total, wrap) if i >= last else total)
    return out


def plan(work, sizes, room, page, link, ring, per_copy=0.0, align=512,
         margin=5e-4, keep=None, share=FRAGMENTATION):
    """The Schedule for measured costs: work (seconds per unit, in
    execution order), sizes (bytes of each unit's weights, placement
    order, a shared weight under its first unit), room (VRAM bytes for
    resident weights), page (page size), link (bytes per second),
    per_copy (seconds each copy costs beyond its bytes), ring (staging
    ring bytes), keep (per weight: kept resident if a plan fits so;
    choose()), share (usable())."""
    res = choose(work, sizes, room, page, link, ring, per_copy, align, keep,
                 share)
    eff = usable(ring, share)
    win = windows(work, sizes, res, link, eff, per_copy, margin)
    t = simulate(work, sizes, res, link, eff, per_copy)
    return Schedule(res, win, t, _streamed(sizes, res),
                    resident_pages(sizes, res, page, align),
                    float(sum(work)))


def plan_rings(work, sizes, total, rings, page, link, align, spare_pages,
               per_copy=0.0, margin=5e-4, keep=None, share=FRAGMENTATION):
    """[(ring, Schedule)]: plan() for each ring size in `rings`, in the
    room a device budget of `total` bytes leaves beside the ring (whole
    pages) and `spare_pages` pages."""
    out = []
    for ring in rings:
        room = total - _round(max(ring, page), page) - spare_pages * page
        out.append((ring, plan(work, sizes, room, page, link, ring,
                               per_copy, align, margin, keep, share)))
    return out


def merged_windows(window, works, sizes, resident, link, ring,
                   per_copy=0.0, margin=0.0):
    """`window` raised, unit by unit, to what each of `works` (per-unit
    work lists: several measured forwards, of several kinds) asks for
    with this resident set: a window long enough for each."""
    out = list(window)
    for w in works:
        other = windows(w, sizes, resident, link, ring, per_copy, margin)
        out = [max(a, b) for a, b in zip(out, other)]
    return out


def nearest_within(work, sizes, old, sch, total, ring, page, align,
                   spare_pages, link, per_copy, within, keep=None,
                   share=FRAGMENTATION):
    """(resident flags, predicted seconds) of the set nearest `old` that
    fits the room a ring of `ring` bytes leaves of `total` (nearest), if
    it is not sch's own and is predicted within `within` of sch (a plan
    made again then moves few weights); else None."""
    room = total - _round(max(ring, page), page) - spare_pages * page
    res = nearest(old, sch.resident, sizes, room, page, align, keep)
    if res is None or res == list(sch.resident):
        return None
    t = simulate(work, sizes, res, link, usable(ring, share), per_copy)
    return (res, t) if t <= sch.predicted * (1 + within) else None


def plan_rings_between(candidates, work, sizes, total, page, link, align,
                       spare_pages, per_copy=0.0, margin=5e-4, keep=None,
                       estimated=False, share=FRAGMENTATION):
    """`candidates` ([(ring, Schedule)], plan_rings') with the plans of
    rings_between() added, largest ring first."""
    more = rings_between(candidates, link, page, estimated)
    out = list(candidates) + plan_rings(work, sizes, total, more, page,
                                        link, align, spare_pages, per_copy,
                                        margin, keep, share)
    return sorted(out, key=lambda c: -c[0])


def ring_fields(work, sizes, total, rings, page, link, align, spare_pages,
                per_copy=0.0, margin=5e-4, keep=None, share=FRAGMENTATION):
    """plan_rings() as plain data, plan_job's "cands" (the planner's
    processes plan one ring each)."""
    return [(r, [getattr(c, f) for f in Schedule.__slots__])
            for r, c in plan_rings(work, sizes, total, rings, page, link,
                                   align, spare_pages, per_copy, margin,
                                   keep, share)]


def plan_job(work, works, sizes, total, rings, page, link, align,
             spare_pages, per_copy, margin, old_resident, old_ring,
             keep=None, near_within=None, cands=None, estimated=False,
             share=FRAGMENTATION):
    """All the arithmetic of a plan's application, as plain data (the
    planner's process returns it): "cands", plan_rings' [(ring, Schedule
    fields)]; "pick", the index pick_ring chooses and its windows merged
    over `works` (merged_windows); "old", when old_resident is given and
    the pick keeps old_ring: (predicted seconds, windows, merged windows)
    of the old resident set under `work`; "near", then too, when the pick
    keeps another resident set and near_within is given: (resident flags,
    predicted seconds, windows, merged windows) of the set nearest the old
    one (nearest) if it is predicted within near_within of the pick, else
    None. keep: plan()'s. cands: ring_fields() for `rings` and those of
    rings_between(), if made already (else both are planned here).
    estimated: pick_ring's. share: usable()'s."""
    if cands is None:
        cands = plan_rings_between(
            plan_rings(work, sizes, total, rings, page, link, align,
                       spare_pages, per_copy, margin, keep, share),
            work, sizes, total, page, link, align, spare_pages, per_copy,
            margin, keep, estimated, share)
    else:
        cands = [(r, Schedule(*f)) for r, f in cands]
    ring, sch = pick_ring(cands, link, estimated)
    i = [c for _, c in cands].index(sch)
    win = merged_windows(sch.window, works, sizes, sch.resident, link,
                         usable(ring, share), per_copy, margin)
    old = None
    if old_resident is not None and ring == old_ring:
        eff = usable(old_ring, share)
        t = simulate(work, sizes, old_resident, link, eff, per_copy)
        base = windows(work, sizes, old_resident, link, eff, per_copy,
                       margin)
        old = (t, base, merged_windows(base, works, sizes, old_resident,
                                       link, eff, per_copy, margin))
    near = None
    if old is not None and near_within is not None and \
            list(sch.resident) != list(old_resident):
        got = nearest_within(work, sizes, old_resident, sch, total, ring,
                             page, align, spare_pages, link, per_copy,
                             near_within, keep, share)
        if got is not None:
            res, t = got
            eff = usable(ring, share)
            base = windows(work, sizes, res, link, eff, per_copy, margin)
            near = (res, t, base, merged_windows(
                base, works, sizes, res, link, eff, per_copy, margin))
    return {"cands": [(r, [getattr(c, f) for f in Schedule.__slots__])
                      for r, c in cands],
            "pick": (i, win), "old": old, "near": near}
