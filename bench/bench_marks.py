#!/usr/bin/env python3
"""What a measured forward's marks cost the host (issue 29: the first
prompt's steps measured by the tuner ran 100-107 ms on the node's SDXL,
against 83-90 once measuring ended; SDXL's steps are the host's).

The tuner marks each unit call twice (tuner.Tuner.before/after: a CUDA
timing event before the unit's acquire and one after it). This times
--units unit calls of one tiny kernel each, on the current stream, as:

  none       the kernels alone;
  tuner      Tuner.before/after around each, the tuner's own code;
  event      a pooled torch.cuda.Event recorded before and after each;
  driver     cuEventRecord through ctypes (what a mark taken by the C
             library would cost, plus ctypes' own call).

Each way's host time per forward (the loop's clock, the GPU far behind
is not waited for inside it) and the GPU's time for the same forward,
best of --reps; the difference from `none` per mark is the cost. (On
the H100: 2.33, 1.74 and 1.90 us a mark, ~3.7 ms for SDXL's 1588: the
rest of a measured forward's cost was its resident units taken off
their held path; bench/RESULTS.md, thirty-seventh session.)

    python3 bench/bench_marks.py [--units 794] [--reps 5]
    /usr/bin/python3 bench/bench_marks.py --dry-run

--dry-run: the CPU (marks are the host clock, no driver): checks the
script runs."""
import argparse
import ctypes
import sys
import time
import types

import benchlib

torch = benchlib.torch_or_skip("bench_marks")

from vpager.torch import tuner as tuner_mod  # noqa: E402


def fake_tuner(cuda, units, target):
    """The state Tuner.before/after (and what they call) read, without a
    model."""
    t = types.SimpleNamespace(cuda=cuda, events=[], streams={},
                              target=target, calls=[], on=True,
                              ncall=0, span=None, marking=False,
                              layout=types.SimpleNamespace(units=units))
    for name in ("before", "after", "_mark", "_lost", "_marks"):
        setattr(t, name, types.MethodType(
            getattr(tuner_mod.Tuner, name), t))
    return t


def driver_record():
    """A function(raw stream) recording a pooled driver event on it
    through ctypes, or None without libcuda."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    pool = []
    for _ in range(4096):
        ev = ctypes.c_void_p()
        if cu.cuEventCreate(ctypes.byref(ev), 0) != 0:   # timing events
            return None
        pool.append(ev)
    rec = cu.cuEventRecord
    rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    state = {"i": 0}

    def record(raw):
        i = state["i"]
        state["i"] = (i + 1) % len(pool)
        rec(pool[i], raw)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--units", type=int, default=794,
                   help="unit calls a forward (794: the node's SDXL)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = torch.device("cuda" if cuda else "cpu")
    x = torch.zeros(1 << 12, device=dev)
    stream = torch.cuda.current_stream() if cuda else None
    raw = stream.cuda_stream if cuda else 0
    units = list(range(a.units))
    ways = {}

    def none():
        for _u in units:
            x.add_(1)
    ways["none"] = none

    tn = fake_tuner(cuda, units, 0)

    def tuner():
        tn.calls.clear()
        tn.ncall = 0
        for u in units:
            tn.before(u, raw)
            x.add_(1)
            tn.after(raw)
        if cuda:        # the marks back to the pool, as _work does
            tn.events.extend(m for c in tn.calls for m in c[1:])
    ways["tuner"] = tuner

    if cuda:
        pool = [torch.cuda.Event(enable_timing=True)
                for _ in range(2 * a.units)]

        def event():
            for i in range(a.units):
                pool[2 * i].record(stream)
                x.add_(1)
                pool[2 * i + 1].record(stream)
        ways["event"] = event
        rec = driver_record()
        if rec is not None:
            def driver():
                for _u in units:
                    rec(raw)
                    x.add_(1)
                    rec(raw)
            ways["driver"] = driver

    benchlib.say("bench_marks: %d unit calls a forward, best of %d; %s" % (
        a.units, a.reps, "CUDA" if cuda else "CPU (dry run)"))
    ctx = benchlib.Ctx(dry=not cuda)
    rows = {}
    for name, fn in ways.items():
        fn()                                    # warm
        best_host = best_gpu = float("inf")
        for _ in range(a.reps):
            ctx.sync()
            m0 = ctx.mark()
            t0 = time.perf_counter()
            fn()
            host = time.perf_counter() - t0
            m1 = ctx.mark()
            ctx.sync()
            best_host = min(best_host, host * 1e3)
            best_gpu = min(best_gpu, ctx.ms(m0, m1))
        rows[name] = (best_host, best_gpu)
    base = rows["none"][0]
    for name, (host, gpu) in rows.items():
        per = (host - base) * 1e3 / (2 * a.units) if name != "none" else 0.0
        benchlib.say("  %-7s host %7.2f ms a forward, GPU %7.2f ms; %5.2f us "
                     "a mark over none" % (name, host, gpu, per))
    return 0


if __name__ == "__main__":
    sys.exit(main())
