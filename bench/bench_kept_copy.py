#!/usr/bin/env python3
"""How fast the device copies from a kept fill's buffer, against the
model's host copy (issue 26: fp8 Flux's "B again" prompt ran 1-5% slower
than "removed" in some processes, with the same plan and bytes; what
differs is that 693 MiB of each step's copies come from the kept fills'
buffers).

Both are vpager.torch's own memory (sources.host_memory: an anonymous
mapping with transparent huge pages asked for, page-locked through
vp_hostbuf_register), made as each is made:

  model copy  one mapping of the whole, written, then page-locked
              (sources: the host copy at offload());
  kept fills  a mapping per weight, page-locked before it is written
              (keptfills.KeptFills._make), then written;

and, as the baseline, torch.empty(pin_memory=True) (cudaHostAlloc). Each
is copied to the device in pieces of --piece MiB on one stream, the rate
timed by CUDA events, best of --reps; the share of each way's memory
backed by huge pages (AnonHugePages in /proc/self/smaps) is printed,
since it is the first suspect.

    make -j16 && python3 bench/bench_kept_copy.py [--mib 693] [--piece 63]
    make -j2 && /usr/bin/python3 bench/bench_kept_copy.py --dry-run

--dry-run: vpager's simulated device (no page-locking), 64 MiB, copies to
a CPU tensor: checks the script runs."""
import argparse
import sys
import time

import benchlib
from benchlib import MiB

torch = benchlib.torch_or_skip("bench_kept_copy")

import vpager  # noqa: E402
from vpager.torch.sources import host_memory  # noqa: E402


def huge_share(tensors):
    """Share of these tensors' bytes in huge pages (AnonHugePages of the
    mappings they lie in; a small mapping the kernel merged with its
    neighbour counts the neighbour's too), or None where smaps cannot be
    read."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors]
    total = huge = 0
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    cur = None
    for ln in lines:
        head = ln.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = any(a < hi and b > lo for a, b in spans)
        elif cur and head == "Rss:":
            total += int(ln.split()[1])
        elif cur and head == "AnonHugePages:":
            huge += int(ln.split()[1])
    return huge / total if total else None


# Each way's memory: (host tensors, their HostBufs to close). A tensor
# from host_memory keeps its mapping alive.

def model_copy(dev, n):
    host, buf = host_memory(n)
    host.fill_(1)
    return [host], [dev.register_hostbuf(buf, n)]


def kept_fills(dev, n, piece):
    hosts, hbs = [], []
    for off in range(0, n, piece):
        size = min(piece, n - off)
        host, buf = host_memory(size)
        hbs.append(dev.register_hostbuf(buf, size))
        host.fill_(1)
        hosts.append(host)
    return hosts, hbs


def pinned(n, cuda):
    """torch's page-locked memory (plain memory on a dry run)."""
    return [torch.empty(n, dtype=torch.uint8, pin_memory=cuda).fill_(1)], []


def rate(pieces, dst, reps, cuda):
    """Best GB/s copying every piece to dst (in order, one stream)."""
    best = 0.0
    for _ in range(reps):
        if cuda:
            s = torch.cuda.Stream()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(s):
                a.record(s)
                for p in pieces:
                    dst[:p.numel()].copy_(p, non_blocking=True)
                b.record(s)
            b.synchronize()
            sec = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            for p in pieces:
                dst[:p.numel()].copy_(p)
            sec = time.perf_counter() - t0
        best = max(best, sum(p.numel() for p in pieces) / sec / 1e9)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=693)
    ap.add_argument("--piece", type=int, default=63)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    if a.mib < 1 or a.piece < 1 or a.reps < 1:
        raise SystemExit("bench_kept_copy: --mib, --piece and --reps are "
                         "counts of at least 1 (got %d, %d, %d)"
                         % (a.mib, a.piece, a.reps))
    cuda = not a.dry_run and torch.cuda.is_available()
    if not a.dry_run and not cuda:
        print("bench_kept_copy: no CUDA GPU visible to torch; use --dry-run")
        return 0
    n = (64 if a.dry_run else a.mib) * MiB
    piece = min(a.piece * MiB, n)
    for ln in benchlib.machine_lines(cuda):
        print(ln)
    print("inputs: %d MiB copied host -> %s in %d MiB pieces, best of %d"
          % (n // MiB, "device" if cuda else "host (dry run)",
             piece // MiB, a.reps))
    dst = torch.empty(n, dtype=torch.uint8,
                      device="cuda" if cuda else "cpu")
    dev = vpager.Device("cuda" if cuda else "sim")
    rows = []
    try:
        for name, make in (("model copy", lambda: model_copy(dev, n)),
                           ("kept fills", lambda: kept_fills(dev, n, piece)),
                           ("torch pin_memory", lambda: pinned(n, cuda))):
            hosts, hbs = make()
            pieces = [h[o:o + piece] for h in hosts
                      for o in range(0, h.numel(), piece)]
            rows.append((name, rate(pieces, dst, a.reps, cuda),
                         huge_share(hosts)))
            for hb in hbs:
                hb.close()
            del hosts, pieces
    finally:
        dev.close()
    base = rows[-1][1]
    for name, gbs, hp in rows:
        print("  %-17s %6.2f GB/s = %.3f x torch pin_memory; huge pages %s"
              % (name, gbs, gbs / base,
                 "n/a" if hp is None else "%.0f%%" % (100 * hp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
