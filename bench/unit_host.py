#!/usr/bin/env python3
"""What one unit's call costs the host (issue 29: the node's Flux at 6 GiB
is host-bound, the GPU reaching each call about as the host queues it, so
every microsecond of the per-unit path is a microsecond of the step).

A stack of --units small Linear layers (tiny compute, tiny copies: the
host's time is what is timed), each a unit of its own; the host time of
a forward (its call to its return, no synchronize inside: acquires order
the device, they never wait on the host), median of --reps, per unit:

  plain      the layers not offloaded (torch's own call)
  held       offloaded, every weight resident, the units held
  resident   the same, VPAGER_HOLD=0: every unit takes the per-unit path
  streamed   offloaded at a budget that leaves no weight resident: each
             unit's weights staged in the ring at its acquire

and, for the per-unit paths, where the time goes (a forward timed with
HotPath.enter / leave and WeightBatch.acquire / release wrapped, the
wrappers' own cost included).

    python3 bench/unit_host.py [--units 300] [--width 256] [--reps 30]
    /usr/bin/python3 bench/unit_host.py --dry-run

--dry-run: the simulated device (CPU), fewer reps: checks the script."""
import argparse
import os
import statistics
import time

import benchlib

torch = benchlib.torch_or_skip("unit_host")

import vpager.torch as vt  # noqa: E402
from vpager import weights  # noqa: E402
from vpager.torch import hotpath  # noqa: E402

MiB = 1 << 20


def stack(units, width, dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width, dtype=dtype)
                                 for _ in range(units)]).eval()


def host_us(m, x, sync, reps):
    """Median host microseconds of m(x), the device idle at each call."""
    times = []
    with torch.no_grad():
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            m(x)
            times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


class Split:
    """HotPath.enter / leave and WeightBatch.acquire / release timed (their
    classes' attributes wrapped while the split is on)."""
    NAMES = ((hotpath.HotPath, "enter"), (hotpath.HotPath, "leave"),
             (weights.WeightBatch, "acquire"),
             (weights.WeightBatch, "release"))

    def __init__(self):
        self.spent = {n: 0.0 for _, n in self.NAMES}
        self.calls = {n: 0 for _, n in self.NAMES}
        self.saved = []

    def _timed(self, name, fn):
        spent, calls, clock = self.spent, self.calls, time.perf_counter

        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += clock() - t0
                calls[name] += 1
        return timed

    def __enter__(self):
        for cls, n in self.NAMES:
            raw = cls.__dict__[n]
            self.saved.append((cls, n, raw))
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            w = self._timed(n, fn)
            setattr(cls, n, staticmethod(w) if isinstance(raw, staticmethod)
                    else w)
        return self

    def __exit__(self, *exc):
        for cls, n, raw in self.saved:
            setattr(cls, n, raw)


def offloaded(m, dev, budget, ring):
    kw = {} if dev == "cuda" else dict(sim_shared="", sim_streams="sync",
                                       page_size=64 << 10,
                                       sim_granularity=64 << 10)
    return vt.offload(m, device=dev, budget=budget, staging_size=ring, **kw)


def run_case(name, m, x, dev, sync, a, budget, ring, plain):
    """Offload m at `budget`, settle, time; the split after (the units
    wrapped anew: HotPath binds enter/leave when it wraps a unit)."""
    h = offloaded(m, dev, budget, ring)

    def forward():
        with torch.no_grad():
            m(x)
    n = benchlib.settle(h, forward, a.settle)
    misses = h.stats()["model"]["misses"]
    t = host_us(m, x, sync, a.reps)
    st = h.stats()
    held = st["schedule"].get("held_units", 0) if st.get("schedule") else 0
    h.unload()
    print("%-9s %8.1f us a forward = %6.2f us a unit over plain (settled "
          "after %s forwards; %d units held, %.0f misses a "
          "forward)" % (name, t, (t - plain) / a.units, n, held,
                        (st["model"]["misses"] - misses) / a.reps))
    if name == "held":
        return
    with Split() as s:
        h = offloaded(m, dev, budget, ring)
        benchlib.settle(h, forward, a.settle)
        for k in s.spent:
            s.spent[k], s.calls[k] = 0.0, 0
        tw = host_us(m, x, sync, a.reps)
        h.unload()
    per = {k: s.spent[k] / max(1, s.calls[k]) * 1e6 for k in s.spent}
    print("          split (wrapped: %.1f us a forward): enter %.2f us "
          "(acquire %.2f of it), leave %.2f (release %.2f), the rest of "
          "the unit's call %.2f us" % (
              tw, per["enter"], per["acquire"], per["leave"],
              per["release"], (tw - plain) / a.units - per["enter"]
              - per["leave"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=300)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--settle", type=int, default=30)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    if a.dry_run:
        a.units, a.width, a.reps, a.settle = 40, 64, 3, 6
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for line in benchlib.machine_lines(cuda):
        print(line)
    m = stack(a.units, a.width, dtype)
    wb = sum(t.numel() * t.element_size() for t in m.parameters())
    print("model: %d x Linear(%d, %d) %s, %d KiB; VPAGER_HOLD=%s" % (
        a.units, a.width, a.width, str(dtype).split(".")[-1], wb >> 10,
        os.environ.get("VPAGER_HOLD", "(default)")))
    x = torch.zeros(1, a.width, dtype=dtype, device=dev)
    m.to(dev)
    plain = host_us(m, x, sync, a.reps)
    m.to("cpu")
    if cuda:    # the plain run's blocks out of torch's cache: the budget
        torch.cuda.empty_cache()   # counts torch's reserved memory
    print("plain     %8.1f us a forward (%.2f us a unit)"
          % (plain, plain / a.units))
    # The GPU's ring one 32 MiB page: the device's ring is whole pages, and
    # the streamed budget's extra quarter of it (8 MiB) then holds none.
    # Ample: the weights' pages, the ring's, a spare page and torch's
    # blocks (on the H100 in the fifty-third session wb + 64 MiB left the
    # held and resident cases ~196 misses a forward: 32 MiB pages).
    ring = 32 * MiB if cuda else 256 << 10
    ample = wb + (256 * MiB if cuda else 64 * MiB)
    run_case("held", m, x, dev, sync, a, ample, ring, plain)
    hold = os.environ.get("VPAGER_HOLD")
    os.environ["VPAGER_HOLD"] = "0"
    try:
        run_case("resident", m, x, dev, sync, a, ample, ring, plain)
        # No room for a weight: each one stages in the ring.
        run_case("streamed", m, x, dev, sync, a, ring + (ring >> 2), ring,
                 plain)
    finally:
        if hold is None:
            del os.environ["VPAGER_HOLD"]
        else:
            os.environ["VPAGER_HOLD"] = hold
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
