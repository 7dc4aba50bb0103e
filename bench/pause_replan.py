"""What the pause between two forwards costs a settled plan, offline.

Reads a forward's units and measured work from a schedule trace
(VPAGER_SCHEDULE_LOG=1: its "units (name:bytes):" and "measured work
(ms):" lines), plans it as the tuner does (schedule.plan_rings, one spare
page) for each ring, and simulates the plan with a pause of G ms after
the forward's last unit (the sampler and the host's way back into the
model: the copy engine runs on, the compute waits), modelled as a unit
of its own with no weights. Per pause it prints the step with the ring
filled to its first-fit share (FRAGMENTATION, as the plans and windows
count it) and to its whole size, how much of the next forward's first
streamed weights is staged before it starts, and what a plan made with
the pause in its work predicts. Needs no torch and no GPU.

    python3 bench/pause_replan.py bench/data/flux6_diag_node6_h100_s42c10.log \\
        --room 5482940923 --link 55.2 --ring 320 --gaps 0 3 5.4
"""
import argparse
import importlib.util
import os
import sys

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULE = os.path.join(HERE, "..", "python", "vpager", "torch",
                        "schedule.py")


def load_schedule():
    """vpager/torch/schedule.py alone (the package would import torch)."""
    spec = importlib.util.spec_from_file_location("schedule", SCHEDULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def trace_arguments(doc, rings, gaps):
    """The options of a replay of a trace (this script's, ring_wrap.py's):
    the trace, --room, --link, --page, --ring (default `rings`, MiB),
    --gaps (default `gaps`, ms)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--room", type=int,
                    help="bytes the plan may use (default: the first "
                    "budget the trace planned for)")
    ap.add_argument("--link", type=float,
                    help="host-to-device GB/s (default: the trace's first)")
    ap.add_argument("--ring", type=int, nargs="+", default=rings,
                    help="ring sizes, MiB (default %s)"
                    % " ".join(map(str, rings)))
    ap.add_argument("--gaps", type=float, nargs="+", default=gaps,
                    help="pauses between forwards, ms")
    ap.add_argument("--page", type=int, default=32, help="page MiB")
    return ap


def read_trace(a):
    """(units, the last measured forward's work in seconds, sizes, room,
    link B/s) of the trace trace_arguments() named, --room and --link
    applied."""
    units, works, room, link = benchlib.schedule_trace(a.trace)
    room = a.room or room
    link = a.link * 1e9 if a.link else link
    if not units or not works or not room or not link:
        raise SystemExit("%s: no units, work, budget or link logged (run "
                         "with VPAGER_SCHEDULE_LOG=1)" % a.trace)
    work = works[-1]            # the last forward measured (warm)
    if len(work) != len(units):
        raise SystemExit("%s: %d units but %d works in its last line"
                         % (a.trace, len(units), len(work)))
    return units, work, [[b] for _, b in units], room, link


def main(argv=None):
    a = trace_arguments(__doc__, [320], [0.0, 3.0, 5.4]).parse_args(argv)
    S = load_schedule()
    units, work, sizes, room, link = read_trace(a)
    page = a.page << 20
    print("trace %s: %d units, %.2f ms of work; room %.3f GB, link %.1f GB/s"
          % (a.trace, len(units), sum(work) * 1e3, room / 1e9, link / 1e9))
    for mib in a.ring:
        ring = mib << 20
        [(_, plan)] = S.plan_rings(work, sizes, room, [ring], page, link,
                                   512, 1, 4e-6)
        res = list(plan.resident)
        print("ring %d MiB: plan %.2f ms, %.3f GB streamed a step"
              % (mib, plan.predicted * 1e3, plan.streamed / 1e9))
        for g in a.gaps:
            w, s = list(work) + [g / 1e3], sizes + [[]]
            out = []
            for name, r in (("first-fit share", int(ring * S.FRAGMENTATION)),
                            ("whole ring", ring)):
                period, _, cst, streamed = S.simulate(
                    w, s, res, link, r, 4e-6, detail=True)
                ahead = sum(sz for (_, sz), c in zip(streamed, cst) if c < 0)
                out.append("%s %.2f ms (%d MiB staged before it)"
                           % (name, period * 1e3, ahead >> 20))
            # The plan made knowing the pause (its resident set may
            # differ), at the ring's first-fit share as the planner counts.
            [(_, knew)] = S.plan_rings(w, s, room, [ring], page, link, 512,
                                       1, 4e-6)
            out.append("planned with the pause %.2f ms"
                       % (knew.predicted * 1e3))
            print("  pause %.1f ms: %s" % (g, "; ".join(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
