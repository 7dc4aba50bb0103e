"""What the pause between two forwards costs a settled plan, offline.

Reads a forward's units and measured work from a schedule trace
(VPAGER_SCHEDULE_LOG=1: its "units (name:bytes):" and "measured work
(ms):" lines), plans it as the tuner does (schedule.plan_rings, one spare
page) for each ring, and simulates the plan with a pause of G ms after
the forward's last unit (the sampler and the host's way back into the
model: the copy engine runs on, the compute waits), modelled as a unit
of its own with no weights. Per pause it prints the step with the ring
filled to its first-fit share (FRAGMENTATION, as the plans and windows
count it) and to its whole size, and how much of the next forward's
first streamed weights is staged before it starts. Needs no torch and no
GPU.

    python3 bench/pause_replan.py \\
        bench/data/flux6_diag_node6_h100_s42c10.log --ring 320 --gaps 0 3 5.4
"""
import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEDULE = os.path.join(HERE, "..", "python", "vpager", "torch",
                        "schedule.py")


def load_schedule():
    """vpager/torch/schedule.py alone (the package would import torch)."""
    spec = importlib.util.spec_from_file_location("schedule", SCHEDULE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def read_trace(path, which=-1):
    """(units [(name, bytes)], work [s]) of a schedule trace: its first
    units line and its `which` measured work line."""
    units, works = None, []
    with open(path) as f:
        for line in f:
            if units is None and "units (name:bytes):" in line:
                units = [(t.rsplit(":", 1)[0], int(t.rsplit(":", 1)[1]))
                         for t in line.split("units (name:bytes):")[1].split()]
            if "measured work (ms):" in line:
                works.append([float(x) / 1e3 for x in
                              line.split("measured work (ms):")[1].split()])
    if units is None or not works:
        raise SystemExit("%s: no units line or no measured work "
                         "(run with VPAGER_SCHEDULE_LOG=1)" % path)
    work = works[which]
    if len(work) != len(units):
        raise SystemExit("%s: %d units but %d measured works"
                         % (path, len(units), len(work)))
    return units, work


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--room", type=int, default=5482940923,
                    help="bytes the plan may use (the trace's planned_for; "
                    "default: Flux 9.4 GiB at 6 GiB on the H100)")
    ap.add_argument("--link", type=float, default=55.2,
                    help="host-to-device GB/s (default 55.2)")
    ap.add_argument("--ring", type=int, nargs="+", default=[320],
                    help="ring sizes, MiB (default 320)")
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.0, 3.0, 5.4],
                    help="pauses between forwards, ms")
    ap.add_argument("--page", type=int, default=32, help="page MiB")
    a = ap.parse_args(argv)
    S = load_schedule()
    units, work = read_trace(a.trace)
    sizes = [[b] for _, b in units]
    link, page = a.link * 1e9, a.page << 20
    print("trace %s: %d units, %.2f ms of work; room %.3f GB, link %.1f GB/s"
          % (a.trace, len(units), sum(work) * 1e3, a.room / 1e9, a.link))
    for mib in a.ring:
        ring = mib << 20
        [(_, plan)] = S.plan_rings(work, sizes, a.room, [ring], page, link,
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
            print("  pause %.1f ms: %s" % (g, "; ".join(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
