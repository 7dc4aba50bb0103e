#!/usr/bin/env python3
"""Host memory of a model mapped from a safetensors file (issue 28): what
vpager.torch.offload() adds to the process's RSS, and the steady step, for
each place the weights' host bytes may live.

A model of --layers Linear(--width, --width) fp16 layers is written to a
safetensors file once; each kind runs in a fresh child process:
  in_place  its parameters are tensors over a read-only mapping of the
            file (as safetensors' safe_open maps it); the policy is told
            RAM is plentiful: the mapping is the host source, registered
  file      the same mapping; the policy is told RAM is short: FILE
            sources (the C file reader's bounce slots)
  copy      the tensors read into anonymous memory (RSS before offload
            includes them): vpager's pinned copy, which replaces them
  auto      the mapping, the policy told nothing: it reads RAM and the
            cgroup's room itself (with --cgroup-gib: the cap's)
Per kind: RSS and MemAvailable before offload (the mapping's pages already
read in), after offload, after the steps; offload's seconds (in place:
registering the mapping); the steady step (median of steps 2..n);
host_by_kind and the policy's line; vpager's pinned bytes.

    python3 bench/bench_hostmem.py --device cuda --gib 8 --budget-gib 2
    python3 bench/bench_hostmem.py --device sim --gib 0.25 --width 1024 \
        --budget-gib 0.03           # fp32 on the simulated device
    ... --cgroup-gib 2 --kinds auto,copy   # each child in a 2 GiB memory
                                # cgroup (bench/memcap.py): OOM kills said
"""

import argparse
import json
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
sys.path.insert(0, HERE)          # memcap
GiB = 1 << 30


def host_memory():
    out = {}
    for path, key, name in (("/proc/self/status", "VmRSS:", "rss"),
                            ("/proc/meminfo", "MemAvailable:",
                             "mem_available")):
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    out[name] = int(line.split()[1]) * 1024
    return out


def dtype_of(device):
    """(torch dtype, safetensors name, bytes): fp16 on CUDA, fp32 on the
    simulated device (the CPU's matmul)."""
    import torch
    return ((torch.float16, "F16", 2) if device == "cuda"
            else (torch.float32, "F32", 4))


def write_model(path, layers, width, device):
    import torch
    dtype, name, item = dtype_of(device)
    header, off = {}, 0
    n = width * width * item
    for i in range(layers):
        header["%d.weight" % i] = {"dtype": name, "shape": [width, width],
                                   "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    g = torch.Generator().manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _ in range(layers):
            w = (torch.randn(width, width, generator=g) / width ** 0.5).to(
                dtype)
            f.write(w.numpy().tobytes())
    return 8 + len(raw)


def child(a):
    import torch
    from torch import nn
    import vpager.torch as vt
    from vpager.torch import hostpolicy
    start = a.data_start
    dtype, _, item = dtype_of(a.device)
    n = a.width * a.width * item
    m = nn.Sequential(*[nn.Linear(a.width, a.width, bias=False,
                                  device="meta") for _ in range(a.layers)])
    with open(a.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    for i, layer in enumerate(m):
        t = flat[start + i * n:start + (i + 1) * n].view(dtype)
        t = t.view(a.width, a.width)
        if a.kind == "copy":
            t = t.clone()
        layer.weight = nn.Parameter(t, requires_grad=False)
    if a.kind == "copy":
        del flat
        mm.close()
    else:
        # The mapping's pages read in: a byte of each page (a sum of the
        # whole would make an int64 copy, 8x the model, first).
        int(flat[::4096].sum())
    dev = "cuda" if a.device == "cuda" else "cpu"
    x = torch.randn(16, a.width, dtype=dtype, device=dev)
    before = host_memory()
    t0 = time.perf_counter()
    if a.kind == "auto":            # the policy reads RAM and the cgroup
        h = vt.offload(m, device=dev, budget=int(a.budget_gib * GiB))
    else:
        ram = 1 << 50 if a.kind != "file" else 1 << 20
        with hostpolicy.override(ram_available=ram):
            h = vt.offload(m, device=dev, budget=int(a.budget_gib * GiB))
    offload_s = time.perf_counter() - t0
    after_offload = host_memory()
    steps = []
    with torch.no_grad():
        for _ in range(a.steps):
            t1 = time.perf_counter()
            y = x
            for layer in m:
                y = layer(y).clamp(-4, 4)
            if dev == "cuda":
                torch.cuda.synchronize()
            steps.append((time.perf_counter() - t1) * 1e3)
    s = h.stats()
    out = {"kind": a.kind, "offload_s": offload_s,
           "steps_ms": steps, "before": before,
           "after_offload": after_offload, "after_steps": host_memory(),
           "host_by_kind": s["model"]["host_by_kind"],
           "host_policy": s["model"]["host_policy"],
           "host_pinned_bytes": s["device"].get("host_pinned_bytes"),
           "machine_pinned_bytes": s["device"].get("machine_pinned_bytes")}
    print("RESULT " + json.dumps(out), flush=True)
    h.close()


def run_child(cmd, cap_gib):
    """(CompletedProcess, the cgroup's report or None): cmd run, in a
    memory cgroup of cap_gib GiB when given."""
    if cap_gib is None:
        return subprocess.run(cmd, capture_output=True, text=True), None
    import memcap
    try:
        cap = memcap.open_cap(int(cap_gib * GiB), "vp-hostmem")
    except memcap.CapError as e:
        raise SystemExit("--cgroup-gib %g: %s" % (cap_gib, e))
    try:
        out = subprocess.run(cmd, capture_output=True, text=True,
                             preexec_fn=cap.enter)
        return out, cap.report()
    finally:
        cap.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    p.add_argument("--gib", type=float, default=8.0, help="model size")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--budget-gib", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kinds", default="in_place,file,copy")
    p.add_argument("--cgroup-gib", type=float, default=None,
                   help="run each child in a memory cgroup of this many "
                        "GiB (bench/memcap.py)")
    p.add_argument("--dir", default=None, help="where to write the file")
    p.add_argument("--child", dest="kind", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--data-start", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.kind:
        return child(a)
    item = 2 if a.device == "cuda" else 4
    layers = max(1, int(a.gib * GiB) // (a.width * a.width * item))
    size = layers * a.width * a.width * item
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        path = os.path.join(tmp, "model.safetensors")
        start = write_model(path, layers, a.width, a.device)
        print("model: %d x %d^2 = %.2f GiB, budget %.2f GiB, %s"
              % (layers, a.width, size / GiB, a.budget_gib, a.device))
        for kind in a.kinds.split(","):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", kind,
                   "--path", path, "--layers", str(layers), "--data-start",
                   str(start), "--width", str(a.width), "--budget-gib",
                   str(a.budget_gib), "--steps", str(a.steps), "--device",
                   a.device]
            out, capped = run_child(cmd, a.cgroup_gib)
            res = [ln[7:] for ln in out.stdout.splitlines()
                   if ln.startswith("RESULT ")]
            if capped is not None:
                print("%-8s in a %.2f GiB cgroup (v%d): peak %s, OOM kills %d"
                      % (kind, capped["limit"] / GiB, capped["version"],
                         "%.2f GiB" % (capped["peak"] / GiB)
                         if capped["peak"] else "n/a", capped["oom_kills"]))
            if out.returncode or not res:
                print("%s: FAILED (rc %d)\n%s" % (kind, out.returncode,
                                                  out.stderr[-2000:]))
                continue
            r = json.loads(res[0])
            st = sorted(r["steps_ms"][1:]) or r["steps_ms"]
            b, o, e = r["before"], r["after_offload"], r["after_steps"]
            print("%-8s RSS +%.2f GiB after offload, +%.2f after %d steps "
                  "(before %.2f; allowed budget + 10%% = %.2f); "
                  "MemAvailable %.2f -> %.2f GiB; offload %.2f s; steady "
                  "%.1f ms; pinned %.2f GiB (machine %.2f); by kind %s"
                  % (kind, (o["rss"] - b["rss"]) / GiB,
                     (e["rss"] - b["rss"]) / GiB, len(r["steps_ms"]),
                     b["rss"] / GiB,
                     (a.budget_gib * GiB + size / 10) / GiB,
                     b["mem_available"] / GiB, e["mem_available"] / GiB,
                     r["offload_s"], st[len(st) // 2],
                     (r["host_pinned_bytes"] or 0) / GiB,
                     (r["machine_pinned_bytes"] or 0) / GiB,
                     {k: round(v / GiB, 2)
                      for k, v in r["host_by_kind"].items()}))
            print("         %s" % r["host_policy"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
