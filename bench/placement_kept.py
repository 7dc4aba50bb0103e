#!/usr/bin/env python3
"""How many resident bytes a placement made again keeps where they lie
(vpager.torch.placement.place_moving_least), for the weights of a
Flux-class DiT (8 double + 16 single blocks, hidden 3072, bf16: 9.4 GiB,
weights and biases in module order) at 2 and 32 MiB pages. No GPU and no
torch needed: placement looks only at sizes.

Each case starts from a compact placement of a resident set (about half
the weights, chosen at random, seed per case) and asks for another:
"swap N" (N weights change sides, the room the new set's compact
placement takes: the tightest a plan asks for), "swap N +8" (8 pages
more room), "shrink" (every tenth resident weight leaves, a plan for a
smaller budget). Prints the bytes kept in place against those that could
be (resident before and after), the bytes the forward taking it copies
again (the new resident set less what stayed), beside the compact
placement's (the whole new set copied: the baseline, measured in the same
run), the host time of the placement, and what the other way
(place_streaming_least: every weight resident now kept where it lies,
some of the set streamed instead) streams more a forward, copying none
again.

    python3 bench/placement_kept.py [--seeds 3]
"""

import argparse
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

from vpager.torch.placement import (pages_touched,  # noqa: E402
                                    place_moving_least,
                                    place_resident_first,
                                    place_streaming_least)

MiB = 1 << 20


class Entry:
    def __init__(self, size):
        self.size = size


def flux_sizes(double=8, single=16, h=3072, b=2):
    """Weight and bias sizes of a Flux-class DiT, in module order."""
    def linear(i, o):
        return [i * o * b, o * b]
    out = linear(64, h) + linear(256, h) + linear(h, h) * 2 + linear(768, h)
    for _ in range(double):
        for _side in range(2):      # img and txt streams
            out += linear(h, 6 * h) + linear(h, 3 * h) + linear(h, h)
            out += linear(h, 4 * h) + linear(4 * h, h) + [128 * b] * 2
    for _ in range(single):
        out += linear(h, 3 * h) + linear(h, 7 * h) + linear(5 * h, h)
        out += [128 * b] * 2
    return out + linear(h, 2 * h) + linear(h, 64)


def case(entries, page, rng, swap, extra, shrink):
    n = len(entries)
    old = [rng.random() < 0.5 for _ in range(n)]
    offsets, _ = place_resident_first(entries, 512, page, old)
    new = list(old)
    if shrink:
        for i in [j for j in range(n) if new[j]][::10]:
            new[i] = False
    for i in rng.sample(range(n), swap):
        new[i] = not new[i]
    now = [a and b for a, b in zip(old, new)]
    compact = place_resident_first(entries, 512, page, new)
    room = len(pages_touched(entries, compact[0], new, page)) + extra
    t = time.perf_counter()
    _offs, _end, kept = place_moving_least(entries, new, now, offsets, 512,
                                           page, room, 1 << 46)
    ms = (time.perf_counter() - t) * 1e3
    alt = place_streaming_least(entries, new, now, offsets, 512, page, room,
                                1 << 46)

    def total(flags):
        return sum(e.size for e, f in zip(entries, flags) if f)
    more = total(new) - total(alt[0]) if alt is not None else None
    return total(kept), total(now), total(new), ms, more


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    entries = [Entry(s) for s in flux_sizes()]
    print("inputs: Flux-class DiT, %d weights, %.2f GiB; resident set ~half,"
          " %d seeds a case; host: %s" % (
              len(entries), sum(e.size for e in entries) / 2**30, a.seeds,
              os.uname().machine))
    print("%-6s %-12s %22s %26s %10s %14s" % (
        "page", "case", "kept / could keep", "copied again / compact's",
        "ms", "or streams"))
    for page in (2 * MiB, 32 * MiB):
        for name, swap, extra, shrink in (("swap 4", 4, 0, False),
                                          ("swap 16", 16, 0, False),
                                          ("swap 16 +8", 16, 8, False),
                                          ("shrink", 0, 0, True)):
            for seed in range(a.seeds):
                kept, could, new, ms, more = case(entries, page,
                                                  random.Random(seed), swap,
                                                  extra, shrink)
                print("%-6s %-12s %9.2f / %5.2f GiB %7.2f / %5.2f GiB = %5.3f"
                      " %8.1f %10s" % (
                          "%dM" % (page // MiB), name, kept / 2**30,
                          could / 2**30, (new - kept) / 2**30, new / 2**30,
                          (new - kept) / max(new, 1), ms,
                          "none" if more is None else
                          "%.0f MiB" % (more / MiB)))


if __name__ == "__main__":
    main()
