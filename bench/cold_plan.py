#!/usr/bin/env python3
"""How good a plan made from a model's cold first forward is, replanned
offline from a run's VPAGER_SCHEDULE_LOG: the units (name:bytes), the
first forward's per-unit work (cold) and the last one's (warm), the
budget the plan was made for and the link, as vpager.torch logs them.

For each way of taking the cold work (as measured; coldwork.warm_work,
each unit at most its kind's median and a singleton at most the largest
median) it plans as the tuner does (tuner.plan_rings, schedule.pick_ring)
and prints that plan's time under the warm work against the plan made
from the warm work itself (the settled one): 1.000 is a cold plan the
settled one would not replace (the tuner places anew only for 2%), and
the bytes the two resident sets differ by.

    python3 bench/cold_plan.py [LOG ...]   # default: bench/data/flux6_h100_*.log
    python3 bench/cold_plan.py --rings [LOG ...]
    python3 bench/cold_plan.py --keep N [LOG ...]

--rings: for each ring size, the warm work's plan in the room the ring
leaves against that room's link term (the bytes that cannot be resident
over the link): what a ring costs beside what the plan's overlap does.

--keep N: the host time of the warm work's plan (one 512 MiB ring, the
median of KEEP_RUNS) without and with every other one of the N largest
units kept resident (a LoRA's fills: kept beyond the room, the plan
finds how many fit), and what each plan keeps.

No GPU; torch only for vpager.torch's import (Debian's python3-torch
will do). Each unit is taken as one weight of its bytes (the log gives a
unit's total; its biases are a rounding here)."""

import glob
import os
import statistics
import sys
import time

import benchlib

sys.path.insert(0, os.path.join(benchlib.ROOT, "python"))

from vpager.torch import coldwork, schedule, tuner  # noqa: E402

MiB = 1 << 20
RINGS = [r * MiB for r in (512, 448, 378, 288, 252, 160, 126)]
PAGE, ALIGN = 2 * MiB, 512


class _Entry:
    def __init__(self, size):
        self.size = size
        self.shape = (size,)
        self.dtype = "bytes"


class _Unit:
    """What coldwork.kind() reads of a unit: its name, module, entries."""

    def __init__(self, name, size):
        self.name = name
        self.module = self
        self.entries = [_Entry(size)]


def read_log(path):
    """(units, cold seconds, warm seconds, planned-for bytes, link B/s)."""
    units, works, total, link = benchlib.schedule_trace(path)
    if not units or not works or total is None or link is None:
        raise SystemExit("%s: no units, work, budget or link logged (run "
                         "with VPAGER_SCHEDULE_LOG=1)" % path)
    return ([_Unit(name, size) for name, size in units], works[0],
            works[-1], total, link)


def planned(work, sizes, total, link, estimated=False):
    """(ring, Schedule) the tuner would pick for `work` (estimated: the
    cold forward's, pick_ring's)."""
    return schedule.pick_ring(tuner.plan_rings(work, sizes, total, RINGS,
                                               PAGE, link, ALIGN), link,
                              estimated)


def compare(path):
    """The log's header line and, per way of taking the cold work, (name,
    its work, its plan's time under the warm work, that over the warm
    plan's, its ring, the bytes its resident set differs by)."""
    units, cold, warm, total, link = read_log(path)
    sizes = [[u.entries[0].size] for u in units]
    ring, best = planned(warm, sizes, total, link)

    def under_warm(ring, sch):
        return schedule.simulate(warm, sizes, sch.resident, link,
                                 int(ring * schedule.FRAGMENTATION),
                                 tuner.PER_COPY)
    t_best = under_warm(ring, best)
    head = ("%s: %d units, budget %.2f GiB, link %.2f GB/s; warm work "
            "%.1f ms, its plan %.2f ms (ring %d MiB)" % (
                os.path.basename(path), len(units), total / 2**30,
                link / 1e9, sum(warm) * 1e3, t_best * 1e3, ring >> 20))
    by = dict(zip(units, cold))
    capped = coldwork.warm_work(by)
    kinds = {}
    for u in units:
        kinds.setdefault(coldwork.kind(u), []).append(u)
    medians_only = dict(by)
    for us in kinds.values():
        if len(us) >= coldwork.MIN_KIND:
            mid = statistics.median(by[u] for u in us)
            for u in us:
                medians_only[u] = min(by[u], mid)
    rows = []
    for name, w in (("cold, as measured", cold),
                    ("cold, kinds' medians only",
                     [medians_only[u] for u in units]),
                    ("cold, coldwork.warm_work",
                     [capped[u] for u in units])):
        r, sch = planned(w, sizes, total, link, estimated=True)
        t = under_warm(r, sch)
        diff = sum(s[0] for s, a, b in zip(sizes, sch.resident,
                                           best.resident) if a != b)
        rows.append((name, sum(w), t, t / t_best, r, diff))
    return head, rows


def main(paths):
    for path in paths:
        head, rows = compare(path)
        print(head)
        for name, work, t, ratio, ring, diff in rows:
            print("  %-28s %7.1f ms of work: its plan under the warm work "
                  "%.2f ms = %.3f x the warm plan's (ring %d MiB; resident "
                  "sets differ by %.2f GB)" % (name, work * 1e3, t * 1e3,
                                               ratio, ring >> 20, diff / 1e9))


def ring_rows(path):
    """(log's header, [(ring bytes, the warm work's plan in the room the
    ring leaves (seconds), that room's link term (seconds))])."""
    units, _, warm, total, link = read_log(path)
    sizes = [[u.entries[0].size] for u in units]
    weights = sum(s[0] for s in sizes)
    head = ("%s: %.2f GiB of weights, budget %.2f GiB, link %.2f GB/s, "
            "warm work %.1f ms" % (os.path.basename(path), weights / 2**30,
                                   total / 2**30, link / 1e9,
                                   sum(warm) * 1e3))
    rows = []
    for ring in RINGS:
        sch = tuner.plan_rings(warm, sizes, total, [ring], PAGE, link,
                               ALIGN)[0][1]
        rows.append((ring, sch.predicted,
                     max(sum(warm), (weights - (total - ring)) / link)))
    return head, rows


def rings(path):
    """--rings: per ring, its plan's time over its room's link term."""
    head, rows = ring_rows(path)
    print(head)
    for ring, t, term in rows:
        print("  ring %3d MiB: plan %.2f ms = %.3f x its room's link term "
              "%.2f ms" % (ring >> 20, t * 1e3, t / term, term * 1e3))


KEEP_RUNS = 5


def keep_rows(path, n):
    """(log's header, [(what, host seconds a plan, Schedule)]) for --keep:
    no weight kept, then every other one of the n largest."""
    units, _, warm, total, link = read_log(path)
    sizes = [[u.entries[0].size] for u in units]
    big = sorted(range(len(sizes)), key=lambda i: -sizes[i][0])[:n:2]
    keep = [i in big for i in range(len(sizes))]
    head = ("%s: %d units, budget %.2f GiB, link %.2f GB/s; %d kept "
            "(%.2f GiB)" % (os.path.basename(path), len(units),
                            total / 2**30, link / 1e9, sum(keep),
                            sum(sizes[i][0] for i in big) / 2**30))
    rows = []
    for what, k in (("none kept", None), ("kept", keep)):
        times = []
        for _ in range(KEEP_RUNS):
            t0 = time.perf_counter()
            sch = tuner.plan_rings(warm, sizes, total, [512 * MiB], PAGE,
                                   link, ALIGN, k)[0][1]
            times.append(time.perf_counter() - t0)
        rows.append((what, statistics.median(times), sch))
    return head, rows


def keeps(path, n):
    """--keep N: the plan's host time without and with kept weights."""
    head, rows = keep_rows(path, n)
    print(head)
    for what, t, sch in rows:
        print("  %-9s plan %.1f ms on the host: %s" % (what, t * 1e3, sch))


def logs():
    """The logs kept in bench/data (the H100's Flux 9.4 GiB at 6 GiB)."""
    return sorted(glob.glob(os.path.join(benchlib.ROOT, "bench", "data",
                                         "flux6_h100_*.log")))

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--rings"]:
        for p in args[1:] or logs():
            rings(p)
    elif args[:1] == ["--keep"]:
        if len(args) < 2 or not args[1].isdigit() or int(args[1]) < 1:
            raise SystemExit("cold_plan.py: --keep takes N, how many of "
                             "the largest units to pick every other one "
                             "of (a whole number >= 1), not %r"
                             % (args[1] if len(args) > 1 else None))
        for p in args[2:] or logs():
            keeps(p, int(args[1]))
    else:
        main(args or logs())
