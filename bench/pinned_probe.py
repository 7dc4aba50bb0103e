#!/usr/bin/env python3
"""How fast the GPU reads each piece of a pinned host copy made as
vpager.torch makes one (sources.host_memory: an anonymous mapping with
transparent huge pages asked for, filled by COPY_THREADS threads, then
page-locked with cudaHostRegister), and where its pages lie: the node's
Flux at 6 GiB settled 8-20 ms slower in some processes than in others
with the same plan, and the bytes a plan streams come from that copy.

    python3 bench/pinned_probe.py [--gib 9.4] [--chunk-mib 128] [--reps 3]
        [--dst torch|vbar|both] [--busy] [--pipeline]

Prints the machine (GPU, its NUMA node, the host's nodes, the huge page
settings), the copy's huge pages and NUMA nodes (/proc/self/smaps,
numa_maps), and per chunk its host-to-device GB/s (the median of
--reps copies, timed with CUDA events), then the spread: the slowest
chunks name the bytes a plan would do best not to stream.

--dst vbar copies into a VBAR's committed pages (vpager's device, as the
staging ring and resident weights lie) instead of torch's allocation;
both: each chunk to each, side by side. --busy: a bf16 matmul loop runs
on another stream meanwhile (a forward's kernels beside its copies): the
node's copies ran at 54.4 GB/s inside a Flux step where the link read
55.1. --pipeline: 1 GiB in back-to-back copies of 8-256 MiB, timed
whole, with and without an event recorded after each (as the library
fences a weight's copy): what each copy costs beyond its bytes when
nothing waits between them."""

import argparse
import concurrent.futures
import ctypes
import glob
import os
import re
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from vpager.torch import sources  # noqa: E402

MIB = 1 << 20


def read(path, default="?"):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def machine():
    p = torch.cuda.get_device_properties(0)
    bus = "%04x:%02x:%02x.0" % (getattr(p, "pci_domain_id", 0),
                                getattr(p, "pci_bus_id", 0),
                                getattr(p, "pci_device_id", 0))
    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    print("gpu: %s, pci %s, numa_node %s" % (
        p.name, bus, read("/sys/bus/pci/devices/%s/numa_node" % bus)))
    print("host nodes: %s" % ", ".join(
        "%s cpus %s" % (os.path.basename(n), read(n + "/cpulist"))
        for n in nodes))
    print("thp enabled: %s; defrag: %s" % (
        read("/sys/kernel/mm/transparent_hugepage/enabled"),
        read("/sys/kernel/mm/transparent_hugepage/defrag")))
    print("iommu groups: %d" % len(glob.glob("/sys/kernel/iommu_groups/*")))


def where(addr, size):
    """(huge bytes, {node: pages}) of the mapping holding addr."""
    huge, nodes = 0, {}
    lo = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                a, b = int(m.group(1), 16), int(m.group(2), 16)
                lo = a if a <= addr < b else None
            elif lo is not None and line.startswith("AnonHugePages:"):
                huge += int(line.split()[1]) * 1024
    with open("/proc/self/numa_maps") as f:
        for line in f:
            a = int(line.split()[0], 16)
            if a <= addr < a + size or addr <= a < addr + size:
                for n, c in re.findall(r"\bN(\d+)=(\d+)", line):
                    nodes[int(n)] = nodes.get(int(n), 0) + int(c)
    return huge, nodes


def cudart():
    libs = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__),
                                         "..", "nvidia", "*", "lib",
                                         "libcudart.so*")) +
                  glob.glob(os.path.join(os.path.dirname(torch.__file__),
                                         "lib", "libcudart*.so*")))
    for name in libs + ["libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("pinned_probe: no libcudart found beside torch")


class Busy:
    """bf16 matmuls queued on a side stream, kept ahead of the copies."""

    def __init__(self):
        self.stream = torch.cuda.Stream()
        self.a = torch.randn(8192, 8192, device="cuda",
                             dtype=torch.bfloat16)
        self.ev = None

    def keep_up(self):
        if self.ev is not None and not self.ev.query():
            return
        with torch.cuda.stream(self.stream):
            for _ in range(40):         # ~40 ms of an H100's matmuls
                self.a @ self.a
            self.ev = torch.cuda.Event()
            self.ev.record(self.stream)

    def stop(self):
        self.stream.synchronize()


def pipeline(lib, stream, base, total, dst, room, name):
    """1 GiB (at most the copy) in back-to-back copies of each size up to
    `room`, timed whole (best of 3), with and without an event after
    each copy."""
    span = min(1 << 30, total)
    for mib in (8, 16, 32, 64, 128, 256):
        n = mib * MIB
        if n > room or n > span:
            break
        for fenced in (False, True):
            best = float("inf")
            for _ in range(3):
                e0, e1 = (torch.cuda.Event(enable_timing=True)
                          for _ in "ab")
                e0.record(stream)
                for off in range(0, span - n + 1, n):
                    lib.cudaMemcpyAsync(dst, base + off, n, 1,
                                        stream.cuda_stream)
                    if fenced:
                        torch.cuda.Event().record(stream)
                e1.record(stream)
                e1.synchronize()
                best = min(best, e0.elapsed_time(e1) / 1e3)
            copies = span // n
            print("pipeline to %s: %d copies of %d MiB%s: %.2f GB/s"
                  % (name, copies, mib, ", an event after each"
                     if fenced else "", copies * n / best / 1e9))


def report(what, rates, chunk_mib):
    print("chunks %s: %d of %d MiB; GB/s min %.2f, median %.2f, max %.2f"
          % (what, len(rates), chunk_mib, min(rates),
             statistics.median(rates), max(rates)))
    med = statistics.median(rates)
    slow = [(i, r) for i, r in enumerate(rates) if r < 0.97 * med]
    print("chunks 3%% or more below the median: %d %s" % (
        len(slow), " ".join("%d:%.1f" % s for s in slow[:40])))
    print("rates: " + " ".join("%.1f" % r for r in rates))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=9.4)
    ap.add_argument("--chunk-mib", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dst", choices=("torch", "vbar", "both"),
                    default="torch")
    ap.add_argument("--busy", action="store_true")
    ap.add_argument("--pipeline", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("pinned_probe: needs a CUDA GPU")
    machine()
    total = int(a.gib * (1 << 30)) // (2 * MIB) * (2 * MIB)
    chunk = a.chunk_mib * MIB
    host, buf = sources.host_memory(total)
    base = host.data_ptr()
    # Filled as offload() fills it: COPY_THREADS threads, small pieces.
    piece = 64 * MIB
    with concurrent.futures.ThreadPoolExecutor(sources.COPY_THREADS) as ex:
        list(ex.map(lambda o: host[o:o + piece].fill_(1),
                    range(0, total, piece)))
    rt = torch.cuda.cudart()
    r = rt.cudaHostRegister(base, total, 0)
    if int(r) != 0:
        raise SystemExit("pinned_probe: cudaHostRegister: %s" % r)
    huge, nodes = where(base, total)
    print("copy: %.2f GiB, huge pages %.2f GiB, pages per node %s" % (
        total / (1 << 30), huge / (1 << 30), nodes))
    lib = cudart()
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_size_t, ctypes.c_int,
                                    ctypes.c_void_p]
    dsts = {}
    vdev = vbar = None
    if a.dst in ("torch", "both"):
        dsts["torch"] = torch.empty(chunk, dtype=torch.uint8,
                                    device="cuda").data_ptr()
    if a.dst in ("vbar", "both"):
        from vpager import Device
        vdev = Device("cuda")
        vbar = vdev.create_vbar(chunk)
        vbar.fault(0, chunk, gens=False)
        dsts["vbar"] = vbar.base
    stream = torch.cuda.current_stream()
    if a.pipeline:
        for name, dst in dsts.items():
            pipeline(lib, stream, base, total, dst, chunk, name)
    busy = Busy() if a.busy else None
    for name, dst in dsts.items():
        rates = []
        for off in range(0, total - chunk + 1, chunk):
            ts = []
            for _ in range(a.reps):
                if busy is not None:
                    busy.keep_up()
                e0, e1 = (torch.cuda.Event(enable_timing=True)
                          for _ in "ab")
                e0.record(stream)
                rc = lib.cudaMemcpyAsync(dst, base + off, chunk, 1,
                                         stream.cuda_stream)
                e1.record(stream)
                e1.synchronize()
                if rc:
                    raise SystemExit("pinned_probe: cudaMemcpyAsync: %d"
                                     % rc)
                ts.append(e0.elapsed_time(e1) / 1e3)
            rates.append(chunk / statistics.median(ts) / 1e9)
        report("to %s%s" % (name, ", matmuls beside" if busy else ""),
               rates, a.chunk_mib)
    if busy is not None:
        busy.stop()
    if vbar is not None:
        vbar.unpin(0, chunk)
        vbar.close()
        vdev.close()
    rt.cudaHostUnregister(base)


if __name__ == "__main__":
    main()
