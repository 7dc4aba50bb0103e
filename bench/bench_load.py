#!/usr/bin/env python3
"""What a model's host copy costs at load (issue 15, the node's first step):
pinned host memory of N GiB (default 8) made three ways, each timed from
nothing to memory a copy engine can read at full speed:

  vpager     vp_hostbuf_alloc (Device.alloc_hostbuf): a reservation on a
             huge-page boundary with transparent huge pages asked for,
             faulted in over a few threads, page-locked;
  torch      torch.empty(pin_memory=True) (the CUDA caching host allocator,
             cudaHostAlloc): the baseline;
  register   plain memory (torch.empty), written once, then
             cudaHostRegister'd: what page-locking costs once faulted in;
  vpager.torch  its host copy (sources.host_memory): plain huge-page
             memory filled from the source, then vp_hostbuf_register'd.

Each is also timed filling it (a copy of N GiB from plain memory), and the
kernel's transparent-huge-page settings are printed, since they decide the
first. Prints ms per GiB and each against the baseline.

Then how vpager.torch fills its host copy, into one vpager buffer: from
plain memory (64 MiB tensors, as a model's weights) by
vpager.torch.sources.copy_all against one torch copy_ of the whole; and
from a file's mapping (ComfyUI's safetensors loader maps the checkpoint:
every source page faults in on first touch) by copy_all.

    make -j16 && python3 bench/bench_load.py [--gib 8]
    make -j2 && /usr/bin/python3 bench/bench_load.py --dry-run

--dry-run: vpager's simulated device (no page-locking), 256 MiB, vpager's
row only: checks the script runs."""
import argparse
import os
import sys
import time

import benchlib
from benchlib import GiB, MiB

torch = benchlib.torch_or_skip("bench_load")

import vpager  # noqa: E402


def thp_lines():
    out = []
    for name in ("enabled", "defrag"):
        path = "/sys/kernel/mm/transparent_hugepage/" + name
        try:
            with open(path) as f:
                out.append("thp %s: %s" % (name, f.read().strip()))
        except OSError:
            out.append("thp %s: (no %s)" % (name, path))
    return out


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def fill(ptr_tensor, src):
    """Copy src into the pinned bytes; seconds."""
    _, t = timed(lambda: ptr_tensor.copy_(src))
    return t


def run_vpager(dev, n, src):
    hb, t_alloc = timed(lambda: dev.alloc_hostbuf(n))
    try:
        view = torch.frombuffer(hb.view(), dtype=torch.uint8)
        t_fill = fill(view, src)
        pinned = hb.info()["pinned_bytes"]
    finally:
        _, t_free = timed(hb.close)
    return t_alloc, t_fill, t_free, pinned


def run_torch(n, src):
    buf, t_alloc = timed(lambda: torch.empty(n, dtype=torch.uint8,
                                             pin_memory=True))
    t_fill = fill(buf, src)
    del buf
    return t_alloc, t_fill


def run_vpager_torch(dev, n, src):
    """vpager.torch's way: fill plain memory, page-lock it after; (alloc +
    pin seconds with the fill in them, fill seconds)."""
    from vpager.torch.sources import host_memory
    t0 = time.perf_counter()
    host, buf = host_memory(n)
    host.copy_(src)
    t1 = time.perf_counter()
    hb = dev.register_hostbuf(buf, n)
    t2 = time.perf_counter()
    hb.close()
    return t2 - t0, t1 - t0


def run_register(n, src):
    cudart = torch.cuda.cudart()
    buf = torch.empty(n, dtype=torch.uint8)
    _, t_touch = timed(lambda: buf.fill_(0))
    rc, t_reg = timed(lambda: cudart.cudaHostRegister(buf.data_ptr(), n, 0))
    if int(rc) != 0:
        return None
    t_fill = fill(buf, src)
    cudart.cudaHostUnregister(buf.data_ptr())
    return t_touch, t_reg, t_fill


def fill_rows(dev, n, cuda):
    """(name, seconds) of the fill strategies, into one vpager buffer."""
    from vpager.torch.sources import copy_all
    hb = dev.alloc_hostbuf(n)
    rows = []
    try:
        dst = torch.frombuffer(hb.view(), dtype=torch.uint8)
        piece = 64 * MiB
        srcs = [torch.ones(piece, dtype=torch.uint8)
                for _ in range(n // piece)]
        pairs = [(dst[i * piece:(i + 1) * piece], x)
                 for i, x in enumerate(srcs)]
        _, t = timed(lambda: copy_all(pairs))
        rows.append(("plain memory, copy_all", t))
        whole = torch.cat(srcs)
        del srcs, pairs
        _, t = timed(lambda: dst[:whole.numel()].copy_(whole))
        rows.append(("plain memory, one copy_", t))
        del whole
        import tempfile
        with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR")) as f:
            block = bytes(range(256)) * (4 * MiB // 256)
            for _ in range(n // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            m = n // len(block) * len(block)
            mapped = torch.from_file(f.name, shared=False, size=m,
                                     dtype=torch.uint8)
            pairs = [(dst[o:o + piece], mapped[o:o + piece])
                     for o in range(0, m, piece)]
            _, t = timed(lambda: copy_all(pairs))
            rows.append(("file mapping, copy_all", t))
            del pairs, mapped
    finally:
        hb.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    cuda = not a.dry_run and torch.cuda.is_available()
    if not a.dry_run and not cuda:
        print("bench_load: no CUDA GPU visible to torch; use --dry-run")
        return 0
    n = int(256 * MiB if a.dry_run else a.gib * GiB)
    for ln in benchlib.machine_lines(cuda) + thp_lines():
        print(ln)
    print("inputs: %.2f GiB of pinned host memory, one buffer each way"
          % (n / GiB))
    if cuda:
        torch.cuda.init()
    src = torch.ones(n, dtype=torch.uint8)      # faulted in: the source
    dev = vpager.Device("cuda" if cuda else "sim")
    per = lambda t: t * 1e3 / (n / GiB)         # noqa: E731
    try:
        va, vf, vfree, pinned = run_vpager(dev, n, src)
        rows = [("vpager", va, vf)]
        pa, pf = run_vpager_torch(dev, n, src)
    finally:
        dev.close()
    if cuda:
        ta, tf = run_torch(n, src)
        rows.append(("torch pin_memory", ta, tf))
        reg = run_register(n, src)
        if reg is not None:
            rows.append(("write + register", reg[0] + reg[1], reg[2]))
            print("register: writing %.0f ms/GiB, cudaHostRegister %.0f "
                  "ms/GiB" % (per(reg[0]), per(reg[1])))
    # its fill is in its alloc+pin: the memory is new when it is filled
    rows.append(("vpager.torch copy", pa, pf))
    base = dict((r[0], r[1]) for r in rows).get("torch pin_memory")
    for name, t_alloc, t_fill in rows:
        print("%-18s alloc+pin %7.1f ms/GiB  fill %6.1f ms/GiB%s" % (
            name, per(t_alloc), per(t_fill),
            "  = %.2fx torch's alloc" % (t_alloc / base) if base else ""))
    print("vpager: free %.1f ms/GiB; pinned bytes %s" % (per(vfree), pinned))
    dev = vpager.Device("cuda" if cuda else "sim")
    try:
        fills = fill_rows(dev, n, cuda)
    finally:
        dev.close()
    base = fills[1][1]
    for name, t in fills:
        print("fill from %-26s %6.1f ms/GiB = %.2fx one copy_" % (
            name, per(t), t / base))
    if a.dry_run:
        print("(dry run: the simulated device; the figures mean nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
