"""Where an offloaded module's weights lie in its VBAR: in order, aligned,
and for the interleaved eviction order in page-aligned groups, so that
evicting one group leaves its neighbours whole. Pure arithmetic on
entries (objects with a .size); layout.py applies it."""

import bisect

from .. import ORDER_INTERLEAVED
from ..vbar import _order

ALIGN = 512             # bytes; each weight starts at such a boundary
SLOT_ALIGN = 256        # the staging ring's slot alignment (src/stream.c)
GROUPS = 32             # a group holds at least 1/GROUPS of the weights


def round_up(x, a):
    return (x + a - 1) // a * a


def vbar_bytes(entries, align):
    """VBAR bytes that hold the entries in any order (re-placement keeps
    the VBAR), before group_room()."""
    return sum(round_up(e.size, align) for e in entries)


def staging_need(entries):
    """Bytes of staging ring a unit with these entries needs at once: all
    its weights missed, each in a slot of its own."""
    return sum(round_up(e.size, SLOT_ALIGN) for e in entries)


def place(entries, align, grouping=None):
    """Offsets of entries laid out in this order, each at an `align`
    boundary; returns (offsets, end). grouping: (page, size) for the
    interleaved order, whose eviction takes whole groups of pages joined
    by weights: each group holds at least `size` bytes and ends at the
    entry boundary, among those up to 2 * size, that wastes the fewest
    bytes before the next page boundary, where the next group starts. So
    little VRAM is padding and evicting one group leaves its neighbours
    whole."""
    offsets = []
    off = 0
    if grouping is None:
        for e in entries:
            off = round_up(off, align)
            offsets.append(off)
            off += e.size
        return offsets, off
    page, size = grouping
    i, n = 0, len(entries)
    while i < n:                # a group starts at entries[i], at `off`
        start, end, j = off, off, i
        best = None             # (padding, entry index, its offset)
        while j < n:
            at = round_up(end, align)
            if j > i and at - start >= size:
                pad = round_up(at, page) - at
                if best is None or pad < best[0]:
                    best = (pad, j, at)
                if at - start >= 2 * size or pad == 0:
                    break
            end = at + entries[j].size
            j += 1
        stop = best[1] if best is not None else n
        for e in entries[i:stop]:
            off = round_up(off, align)
            offsets.append(off)
            off += e.size
        if best is not None:
            off = round_up(best[2], page)
        i = stop
    return offsets, off


def groups(dev, order, entries):
    """place()'s grouping for the VBAR's order (None: tail-first)."""
    if order is None:
        order = dev.options["evict_order"]
    if _order(order) != ORDER_INTERLEAVED:
        return None
    page = dev.page_size
    total = sum(e.size for e in entries)
    # At most half the staging ring: the ring then holds the next streamed
    # group while the current one computes (H200, 32-layer decoder, 0.5 GB
    # groups in a 0.5 GB ring: prefill 114 ms; 0.27 GB groups: 106 ms).
    ring = dev.options["staging_size"]
    return page, max(4 * page, min(total // GROUPS, ring // 2))


def group_room(grouping, vbar_size):
    """VBAR bytes the group boundaries may add: under a page each, and
    groups start at least `size` (>= 4 pages) apart, so n groups over
    vbar_size + n pages: n <= (vbar_size / size + 1) * 4 / 3."""
    if grouping is None:
        return 0
    page, size = grouping
    return ((vbar_size // size + 1) * 4 // 3 + 1) * page


def first_placement(entries, align, grouping, page, scheduled):
    """(offsets, VBAR bytes) of offload()'s placement: the entries in
    module order (grouped for the interleaved order), and a VBAR with room
    for any order of them (re-placement keeps the VBAR), for a schedule
    also for its page boundary after the resident ones and for all the
    weights streamed after resident ones left where they lie (place_kept:
    address space only, no VRAM)."""
    offsets, _ = place(entries, align, grouping)
    size = vbar_bytes(entries, align)
    room = group_room(grouping, size)
    if scheduled:
        room = max(room, 2 * page) + size
    return offsets, size + room


def place_resident_first(entries, align, page, resident):
    """Offsets for a scheduled layout (schedule.py): the resident entries
    (resident[i] True) first, in this order, each at an `align` boundary,
    then from the next page boundary the streamed ones, in this order. So
    the resident weights share pages only with each other and take at
    most one partly used page whatever the page size (the order they run
    in is the weights' order, not their addresses); returns (offsets,
    end)."""
    offsets = [0] * len(entries)
    off = 0
    for i, (e, r) in enumerate(zip(entries, resident)):
        if r:
            off = round_up(off, align)
            offsets[i] = off
            off += e.size
    off = round_up(off, page)
    for i, (e, r) in enumerate(zip(entries, resident)):
        if not r:
            off = round_up(off, align)
            offsets[i] = off
            off += e.size
    return offsets, off


def place_apart(entries, resident, now, offsets, align, page, size):
    """(offsets, end) of a scheduled layout placed apart from the pages
    of the entries with now[i] (resident at offsets[i], their bytes to be
    copied to their new places on the device: relocate.py): the resident
    entries as place_resident_first lays them, from page 0 if they end
    below the first of those pages, else from the page after the last;
    the streamed ones after both, so no new weight touches those pages.
    None if that ends past `size` (the VBAR)."""
    spans = [(offsets[i], offsets[i] + e.size)
             for i, e in enumerate(entries) if now[i] and e.size]
    offs, end = place_resident_first(entries, align, page, resident)
    if not spans:
        return offs, end
    lo = min(a for a, _ in spans) // page * page
    hi = round_up(max(b for _, b in spans), page)
    top = round_up(max((offs[i] + e.size for i, e in enumerate(entries)
                        if resident[i]), default=0), page)
    base = 0 if top <= lo else hi
    out, off = [0] * len(entries), max(base + top, hi)
    for i, e in enumerate(entries):
        if resident[i]:
            out[i] = offs[i] + base
        else:
            off = round_up(off, align)
            out[i] = off
            off += e.size
    return (out, off) if off <= size else None


def place_kept(entries, resident, kept, offsets, align, page):
    """Offsets for a scheduled layout placed anew with the least copying:
    the entries with kept[i] (resident now, resident in the schedule) stay
    at offsets[i], so their bytes need no copy; the other resident ones
    go, largest first, into a gap before or between those (_fit: at its
    start or its end, where it touches the fewest pages no weight touches
    yet, then the least room left over), or after them in this order; the
    streamed ones from the next page boundary after all of those, in this
    order (so no page holds a resident and a streamed weight). Returns
    (offsets, end)."""
    out = [0] * len(entries)
    spans = sorted((offsets[i], offsets[i] + e.size)
                   for i, e in enumerate(entries) if kept[i])
    gaps, top = [], 0               # (room, start): bisect finds fits
    touched = set()                 # pages a resident weight touches
    for a, b in spans:
        if a > top:
            gaps.append((a - top, top))
        top = max(top, b)
        touched.update(_pages(a, b, page))
    gaps.sort()
    joining = sorted((i for i, e in enumerate(entries)
                      if resident[i] and not kept[i]),
                     key=lambda i: -entries[i].size)
    for i, e in enumerate(entries):
        if kept[i]:
            out[i] = offsets[i]
    after = []
    for i in joining:
        size = entries[i].size
        got = _fit(gaps, size, align, page, touched)
        if got is None:
            after.append(i)
            continue
        g, at = got
        room, a = gaps.pop(g)
        for lo, hi in ((a, at), (at + size, a + room)):
            if hi > lo:
                bisect.insort(gaps, (hi - lo, lo))
        touched.update(_pages(at, at + size, page))
        out[i] = at
    for i in sorted(after):         # in this order, as when none is kept
        out[i] = round_up(top, align)
        top = out[i] + entries[i].size
    off = round_up(top, page)
    for i, e in enumerate(entries):
        if not resident[i]:
            off = round_up(off, align)
            out[i] = off
            off += e.size
    return out, off


FIT_LOOK = 8       # gaps _fit weighs past the smallest that holds a weight


def _pages(lo, hi, page):
    """The pages bytes [lo, hi) touch (none if empty)."""
    return range(lo // page, (hi - 1) // page + 1) if hi > lo else range(0)


def _fit(gaps, size, align, page, touched):
    """(index in gaps, offset) of the place for `size` bytes: of the gaps
    that hold it (the FIT_LOOK smallest), at a gap's start or its end,
    the place touching the fewest pages none touches yet (a weight
    beside a kept one shares its page), then the least room left over;
    None if no gap holds it."""
    best, g0 = None, bisect.bisect_left(gaps, (size, -1))
    for g in range(g0, min(len(gaps), g0 + FIT_LOOK)):
        room, a = gaps[g]
        for at in (round_up(a, align), (a + room - size) // align * align):
            if at < a or at + size > a + room:
                continue
            # (only its end pages may be touched: the rest are its own)
            span = _pages(at, at + size, page)
            new = len(span) - sum(1 for q in {span[0], span[-1]}
                                  if q in touched) if span else 0
            key = (new, room - size)
            if best is None or key < best[0]:
                best = (key, g, at)
        if best is not None and best[0][0] == 0:
            break
    return None if best is None else best[1:]


def place_moving_least(entries, resident, now, offsets, align, page,
                       room, size):
    """(offsets, end, kept) of a scheduled layout placed anew: the
    resident entries with now[i] (their bytes resident at offsets[i])
    stay there (kept[i]) if the pages the resident set then takes are
    at most `room` (or the compact placement's, when that is more) and
    it ends within `size` bytes (the VBAR: weights moved past the kept
    ones at each re-plan must not creep out of it); else the fewest of
    them move too, in whichever of two orders keeps more bytes: run by
    run, the smallest runs first (runs_smallest_first: holes between
    runs), or from the top address down (highest_first: a resident set
    that lies in one run, whose holes only a lower top can make up for);
    down to none (place_resident_first: every resident entry filled
    anew)."""
    compact = place_resident_first(entries, align, page, resident)
    none = [False] * len(entries)
    if not any(now):
        return compact + (none,)
    room = max(room, len(pages_touched(entries, compact[0], resident,
                                       page)))

    def layout(order, k):   # the first k of `order` move too
        kept = list(now)
        for i in order[:k]:
            kept[i] = False
        offs, end = place_kept(entries, resident, kept, offsets, align, page)
        fits = end <= size and \
            len(pages_touched(entries, offs, resident, page)) <= room
        return fits, offs, end, kept

    def fewest(order):      # the fitting layout moving fewest of `order`
        got = layout(order, 0)
        if got[0]:
            return got
        lo, hi = 0, len(order)      # layout(order, hi) is the compact one
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if layout(order, mid)[0]:
                hi = mid
            else:
                lo = mid
        return layout(order, hi)

    best = None
    for order in (runs_smallest_first(entries, offsets, now, page),
                  highest_first(offsets, now)):
        got = fewest(order)
        if got[0] and (best is None or _bytes(entries, got[3]) >
                       _bytes(entries, best[3])):
            best = got
        if best is not None and best[3] == list(now):
            break                   # nothing moves: no order keeps more
    if best is None:
        return compact + (none,)
    return best[1:]


def place_streaming_least(entries, resident, now, offsets, align, page,
                          room, size, keep=None):
    """(resident flags, offsets, end, kept) of the other way to place a
    scheduled layout anew: every entry with now[i] stays where it lies
    (place_kept puts the rest of the resident set into the gaps), and
    while the resident set then takes more than `room` pages some of it
    streams instead: first the entries that join it and went above the
    kept ones, then those that join it in a gap, then kept ones; of
    each, the smallest that frees the pages over (else the largest),
    never one `keep` flags. Kept weights leave holes that the compact
    room has no page for (Flux 9.4 GiB, bench/placement_kept.py: the
    fewest moved still copied 0.5-3.4 of 4-5 GiB again); streaming tens
    of MiB more instead copies almost none. None if no such set fits
    (or it ends past `size`)."""
    res = [bool(r) for r in resident]
    stay = [bool(r) and bool(k) for r, k in zip(res, now)]
    top = max((offsets[i] + e.size for i, e in enumerate(entries)
               if stay[i]), default=0)
    while True:
        offs, end = place_kept(entries, res, stay, offsets, align, page)
        over = len(pages_touched(entries, offs, res, page)) - room
        if over <= 0:
            return (res, offs, end, stay) if end <= size else None
        pick = None
        for group in ([i for i, r in enumerate(res) if r and not stay[i]
                       and offs[i] >= top],
                      [i for i, r in enumerate(res) if r and not stay[i]],
                      [i for i, r in enumerate(res) if r]):
            group = [i for i in group if entries[i].size and
                     not (keep and keep[i])]
            if group:
                big = [i for i in group if entries[i].size >= over * page]
                pick = (min(big, key=lambda i: entries[i].size) if big
                        else max(group, key=lambda i: entries[i].size))
                break
        if pick is None:
            return None
        res[pick] = stay[pick] = False


def _bytes(entries, chosen):
    return sum(e.size for e, c in zip(entries, chosen) if c)


def highest_first(offsets, chosen):
    """Indices of the chosen entries, the highest offset first: giving up
    kept weights from the top lowers where the resident weights that
    found no hole go (place_kept), the order for a resident set that lies
    in one run (runs_smallest_first has one run to give up: all)."""
    return sorted((i for i, c in enumerate(chosen) if c),
                  key=lambda i: -offsets[i])


def runs_smallest_first(entries, offsets, chosen, page):
    """Indices of the chosen entries, run by run, the smallest runs first:
    a run is chosen entries that lie together (no whole page between two
    of them). Moving a small run frees its gap's edge pages for a few
    bytes copied: the order to give up kept weights in (place_kept)."""
    idx = sorted((i for i, c in enumerate(chosen) if c),
                 key=lambda i: offsets[i])
    runs, end = [], None
    for i in idx:
        if end is None or offsets[i] - end >= page:
            runs.append([])
        runs[-1].append(i)
        end = offsets[i] + entries[i].size
    runs.sort(key=lambda r: sum(entries[i].size for i in r))
    return [i for r in runs for i in r]


def pages_touched(entries, offsets, chosen, page):
    """The set of pages the chosen entries (chosen[i] True) touch."""
    pages = set()
    for e, off, c in zip(entries, offsets, chosen):
        if c and e.size:
            pages.update(range(off // page, (off + e.size - 1) // page + 1))
    return pages


def _bitrev_order(n):
    bits = 0
    while (1 << bits) < n:
        bits += 1
    out = []
    for i in range(1 << bits):
        g = int(format(i, "0%db" % bits)[::-1], 2) if bits else 0
        if g < n:
            out.append(g)
    return out


def scheduled_ranks(entries, offsets, resident, page, npages):
    """vp_vbar_set_ranks' pages for a scheduled layout: the pages of the
    resident runs (consecutive resident entries, in order) first, whole
    runs, the runs in bit-reversed order so that a budget that shrinks
    takes resident weights evenly from the whole model; then the streamed
    weights' pages in order, then the pages no weight touches. A page
    shared by two runs goes with the one ranked first. A run's entries
    need not lie together (place_kept): each one's own pages count."""
    runs, cur = [], None
    for e, off, r in zip(entries, offsets, resident):
        if r:
            if cur is None:
                cur = []
                runs.append(cur)
            cur.append((off // page, (off + e.size - 1) // page))
        else:
            cur = None
    order, seen = [], bytearray(npages)

    def take(p0, p1):
        for p in range(p0, p1 + 1):
            if not seen[p]:
                seen[p] = 1
                order.append(p)
    for i in _bitrev_order(len(runs)):
        for p0, p1 in runs[i]:
            take(p0, p1)
    for e, off, r in zip(entries, offsets, resident):
        if not r:
            take(off // page, (off + e.size - 1) // page)
    order += [p for p in range(npages) if not seen[p]]
    return order
