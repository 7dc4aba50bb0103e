#!/usr/bin/env python3
"""What a step's start costs the host before its first kernel (issue 29:
the node's Flux at 6 GiB queued its first module call 5.4 ms into each
step where ComfyUI's resident run queued it at 2.2, with the GPU idle
and the copy engine stalled in between; bench/RESULTS.md, forty-second
session). A sampler that synchronizes each step (ComfyUI's callback
does) pays every microsecond of it.

Times, on the current CUDA device (median of --reps calls each):

  mem_get_info   torch.cuda.mem_get_info, the driver's free memory
                 (ComfyUI's get_free_memory asks it once a step);
  memory_stats   torch.cuda.memory_stats (ComfyUI's, the same call);
  nested_stats   torch._C._cuda_memoryStats (vpager.torch's learn and
                 the ledger read torch's reservation from it);

first with nothing of vpager's open, then once offload() placed a
--gib model at --budget-gib (thousands of physical pages mapped): a
driver whose query grows with the mappings shows here. Then a root
forward's host time from its call to its first unit's call (where the
step's first kernel is queued), the model resident (plain torch)
against the same model paged, settled (--settle forwards first).

    python3 bench/bench_forward_start.py [--gib 9.4] [--budget-gib 6]
    /usr/bin/python3 bench/bench_forward_start.py --dry-run

--dry-run: the simulated device, a small model, no driver calls:
checks the script runs. --profile N: the paged model's root call to
first unit call under cProfile, the N functions with the most own time
(the profiler's cost included: which of vpager's calls the step's start
waits for, not their exact cost)."""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import benchlib

torch = benchlib.torch_or_skip("bench_forward_start")

import vpager.torch as vt  # noqa: E402

GiB = 1 << 30


def median_us(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def queries(cuda, reps):
    """{name: median us} of the memory queries a step's start makes."""
    if not cuda:
        return {}
    nested = getattr(torch._C, "_cuda_memoryStats", None)
    out = {"mem_get_info": median_us(torch.cuda.mem_get_info, reps),
           "memory_stats": median_us(torch.cuda.memory_stats, reps)}
    if nested is not None:
        out["nested_stats"] = median_us(lambda: nested(0), reps)
    return out


def model(gib, width, dtype):
    """Linear layers of width x width, `gib` GiB in all, uninitialized
    (their values do not change what is timed) then zeroed."""
    per = width * width * torch.tensor([], dtype=dtype).element_size()
    n = max(2, int(gib * GiB // per))
    layers = [torch.nn.utils.skip_init(torch.nn.Linear, width, width,
                                       bias=False, dtype=dtype)
              for _ in range(n)]
    for m in layers:
        m.weight.data.zero_()
    return torch.nn.Sequential(*layers).eval()


def start_ms(m, x, sync, reps, prof=None):
    """Median ms from m(x)'s call to its first layer's call (the host);
    prof: a cProfile.Profile that runs over that stretch of each call."""
    at = []

    def first(_m, _a):
        if prof is not None:
            prof.disable()
        at.append(time.perf_counter())
    h = m[0].register_forward_pre_hook(first)
    times = []
    try:
        with torch.no_grad():
            for _ in range(reps):
                sync()
                at.clear()
                t0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                m(x)
                times.append((at[0] - t0) * 1e3)
    finally:
        h.remove()
    return statistics.median(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=9.4)
    p.add_argument("--budget-gib", type=float, default=6.0)
    p.add_argument("--width", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--settle", type=int, default=30)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="N")
    a = p.parse_args(argv)
    if a.dry_run:
        a.gib, a.budget_gib, a.width, a.tokens = 0.004, 0.003, 64, 8
        a.reps, a.settle = 3, 3
    cuda = torch.cuda.is_available() and not a.dry_run
    dtype = torch.float16 if cuda else torch.float32
    dev = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for line in benchlib.machine_lines(cuda):
        print(line)
    print("model: %.2f GiB of %dx%d %s linears, budget %.2f GiB, %d tokens"
          % (a.gib, a.width, a.width, str(dtype).split(".")[-1],
             a.budget_gib, a.tokens))
    before = queries(cuda, a.reps)

    m = model(a.gib, a.width, dtype)
    x = torch.zeros(a.tokens, a.width, dtype=dtype, device=dev)
    # Resident: plain torch on the device (the dry run: the CPU).
    m.to(dev)
    for _ in range(3):
        with torch.no_grad():
            m(x)
    resident = start_ms(m, x, sync, a.reps)
    m.to("cpu")
    if cuda:
        torch.cuda.empty_cache()
    h = vt.offload(m, device=dev, budget=int(a.budget_gib * GiB))

    def forward():
        with torch.no_grad():
            m(x)
    n = benchlib.settle(h, forward, a.settle)
    sync()
    after = queries(cuda, a.reps)
    paged = start_ms(m, x, sync, a.reps)
    print("settled after %s forwards; %d of %d bytes resident" % (
        n, h.stats()["model"].get("resident_bytes", -1),
        sum(t.numel() * t.element_size() for t in m.parameters())))
    for k in before:
        print("%-13s %8.1f us before vpager, %8.1f us with its pages mapped"
              " (x %.2f)" % (k, before[k], after[k], after[k] / before[k]))
    print("root call -> first unit call: resident %.3f ms, paged %.3f ms "
          "(+%.3f ms)" % (resident, paged, paged - resident))
    if a.profile:
        prof = cProfile.Profile()
        start_ms(m, x, sync, a.reps, prof)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(
            a.profile)
        print("paged root call -> first unit call under cProfile, %d calls:"
              % a.reps)
        print("\n".join(line for line in out.getvalue().splitlines()
                        if line.strip()))
    h.unload()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
