#!/usr/bin/env python3
"""Streaming benchmarks of vpager on a GPU, each against baselines measured
in the same run (issue 4, "Benchmarks on the H200"):

  1. streaming throughput: weights that all miss (VBAR watermark 0) streamed
     through the staging ring, bytes/s against plain pinned copies of the
     same bytes (torch .copy_(non_blocking=True)); target >= 0.95;
  2. overlap: 96 bf16 8192x8192 layers (12 GiB) at a budget of weights/1.5,
     forward = x @ W per layer, at a copy-bound batch (16), at 4096 and at
     the batch where one layer's GEMM takes as long as its copy; against all
     weights resident, a naive per-layer copy on the compute stream and a
     hand-written double-buffered streamer over exactly the layers vpager
     streams; both eviction orders (tail-first, interleaved; also
     interleaved on a second device handle with 128 MiB pages, one page per
     layer; at batch 4096 each also with prefetch off, as a diagnostic);
     targets: copy-bound <= 1.02x (streamed bytes / link bandwidth), compute-bound
     <= 1.05x the hand-written streamer; the first (cold) forward apart;
  3. many small weights: 1536 x 2 MiB (3 GiB) at a 2 GiB budget, a small
     matmul per weight, 8 weights per acquire; against the hand-written
     streamer over the same non-resident set; target <= 1.15x;
  4. file -> VRAM: a 4 GiB safetensors file on local disk loaded with
     vp_st_open + vp_st_load; against min(the file's cold read speed
     measured in the run, the link); target >= 0.85.

    make -j16 && PYTHONUNBUFFERED=1 python3 bench/bench_stream.py
    make -j2 && /usr/bin/python3 bench/bench_stream.py --dry-run

Drives libvpager through the vpager Python package (python/vpager, put on
sys.path by this script; build/libvpager.so from `make`): Device, Vbar,
Weights and WeightBatch (vp_acquire/vp_release), HostBuf, SafeTensors.
Needs torch with CUDA on the GPU.

--dry-run runs all four benchmarks on the CPU and vpager's simulated device
(torch CPU tensors: Debian's torch 1.13 is enough) with every byte count
divided by 1024 and the counts kept (96 layers of 128 KiB, 1536 weights of
2 KiB, ...; it prints KiB where the GPU run prints MiB, and MiB for GiB)
and smaller batches; the residency it prints is the GPU run's in small, the
times mean nothing. `--only 1,3` runs some benchmarks. Writes a JSON of the
figures to $OUT/bench_stream.json when OUT is set.
"""
import argparse
import contextlib
import ctypes
import json
import mmap
import os
import sys
import time

import benchlib
from benchlib import GiB, KiB, MiB, copied_bytes, gbps, med, stats_delta, \
    target

ROOT = benchlib.ROOT
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import vpager  # noqa: E402

ORDER_NAME = {vpager.ORDER_TAIL_FIRST: "tail-first",
              vpager.ORDER_INTERLEAVED: "interleaved"}

torch = None        # imported in main()
CTX = None          # benchlib.Ctx: CUDA events, or perf_counter (dry run)
CFG = None          # Cfg
DEV = None          # torch.device the benchmark computes on
RESULTS = {}
# Units of the printed sizes: MiB and GiB on the GPU; the dry run divides
# every byte count by 1024, so it prints KiB and MiB with the same numbers.
UM, UG, NM, NG = MiB, GiB, "MiB", "GiB"


class Cfg:
    """Sizes: the GPU's, or (dry run) the same counts with every byte count
    / 1024 and batches the CPU computes quickly."""

    def __init__(self, dry):
        self.dry = dry
        div = 1024 if dry else 1
        self.L = 96                          # layers (benchmark 2)
        self.D = 256 if dry else 8192        # a layer: D x D bf16
        self.SD = 32 if dry else 1024        # a small weight: SD x SD bf16
        self.small_n, self.small_group = 1536, 8
        self.small_budget = 2 * GiB // div
        self.through = 4 * GiB // div        # benchmark 1's bytes a round
        self.file_tensors = 32
        self.file_budget_extra = 4 * GiB // div
        self.file_need = 6 * GiB // div      # disk space benchmark 4 wants
        # Benchmark 2's batches: 16, mid, and the balanced one (a multiple
        # of step, between beq_min and cap; on the CPU, where a GEMM always
        # outlasts its copy, beq_min keeps it apart from mid).
        self.mid, self.step, self.beq_min, self.cap = \
            (256, 32, 512, 2048) if dry else (4096, 512, 4096, 32768)
        # vpager options beyond vp_options_init's (defaults, then VPAGER_*):
        # on the GPU none but the backend; the dry run scales the defaults
        # (32 MiB pages, 512 MiB ring, 256 MiB lookahead, 64 MiB file
        # slots) by 1/1024 on a simulated device that copies at once.
        self.vp_opts = dict(backend="cuda") if not dry else dict(
            backend="sim", page_size=32 * KiB, sim_granularity=32 * KiB,
            sim_capacity=160 * MiB, staging_size=512 * KiB,
            lookahead=256 * KiB, file_slot_size=64 * KiB,
            sim_streams="sync", sim_shared="")


def configure(dry):
    global CTX, CFG, DEV, UM, UG, NM, NG
    CTX = benchlib.Ctx(dry)
    CFG = Cfg(dry)
    DEV = CTX.device
    if dry:
        UM, UG, NM, NG = KiB, MiB, "KiB", "MiB"


# ------------------------------------------------------------ vpager


def device_info(dev, fresh=True):
    if fresh:  # the budget is re-polled once the poll interval has passed
        time.sleep(0.02)
    return dev.info()


def set_budget(dev, budget):
    """Let vpager commit about `budget` bytes, whatever else uses the device
    (as demo/demo.c): headroom = free + committed - budget."""
    info = device_info(dev)
    headroom = max(0, info["free_memory"] + info["committed"] - budget)
    dev.set_headroom(headroom)
    return device_info(dev)


class Model:
    """One VBAR of n weights (weights[i] = [offsets[i], +sizes[i])) whose
    host sources lie in the HostBuf at offsets[i] (one hostbuf in VBAR
    order, so vpager can merge adjacent copies), acquired `group` weights
    per call: batches[k] is the WeightBatch of weights k*group ..."""

    def __init__(self, dev, size, offsets, sizes, hostbuf, order=None,
                 group=1):
        self.dev, self.n, self.group = dev, len(offsets), group
        self.vbar = dev.create_vbar(size)
        if order is not None:
            self.vbar.set_order(order)
        self.order = order
        self.offsets, self.sizes = list(offsets), list(sizes)
        hptr = hostbuf.ptr          # the caller keeps the hostbuf open
        self.weights = self.vbar.create_weights(
            self.offsets, self.sizes,
            [vpager.Source.from_host(hptr + o) for o in self.offsets])
        self.batches = [self.weights.batch(range(i, min(i + group, self.n)))
                        for i in range(0, self.n, group)]
        self.base = self.vbar.base

    def flags(self):
        """The VP_ACQUIRED_* flags of each weight's last acquire."""
        return [f for b in self.batches for f in b.flags]

    def staged(self):
        return [i for i, f in enumerate(self.flags())
                if f & vpager.ACQUIRED_STAGED]

    def flag_map(self):
        return "".join("s" if f & vpager.ACQUIRED_STAGED else "#"
                       for f in self.flags())

    def page_map(self):
        return "".join("P" if f & vpager.PAGE_PINNED else
                       "#" if f & vpager.PAGE_RESIDENT else "."
                       for f in self.vbar.residency())

    def loaded(self):
        return self.vbar.loaded_size()

    def destroy(self):
        self.batches = []
        self.vbar.close()           # vp_vbar_destroy: its weights too


def run_groups(model, stream):
    """One pass: acquire each group, release it."""
    for b in model.batches:
        b.acquire(stream)
        b.release(stream)


# ------------------------------------------------------------ torch


class _NullStream:
    """The dry run's stream: CPU work and the simulated device's copies
    (sim_streams sync) are done when queued; vpager's stream 0."""
    cuda_stream = 0

    def wait_event(self, event):
        pass


class _NullEvent:
    def record(self, stream=None):
        pass


def new_stream():
    return torch.cuda.Stream() if CTX.cuda else _NullStream()


def new_event():
    return torch.cuda.Event() if CTX.cuda else _NullEvent()


def on(stream):
    """torch.cuda.stream(stream); nothing on the dry run."""
    return torch.cuda.stream(stream) if CTX.cuda else \
        contextlib.nullcontext()


class CAI:
    """A device pointer as a __cuda_array_interface__ object (int16 words)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 2,), "typestr": "<i2", "data": (ptr, False),
            "strides": None, "version": 3}


def dev_tensor(ptr, shape):
    """A bf16 tensor over device memory at ptr (not a copy): CUDA memory,
    or on the dry run the simulated device's, which is host memory."""
    n = 1
    for s in shape:
        n *= s
    if CTX.cuda:
        t = torch.as_tensor(CAI(ptr, 2 * n), device="cuda")
    else:
        t = torch.frombuffer((ctypes.c_int16 * n).from_address(ptr),
                             dtype=torch.int16)
    return t.view(torch.bfloat16).view(*shape)


class TensorCache:
    """Device views by address: resident weights and ring slots reuse the
    same addresses, so each view is made once (zero copy)."""

    def __init__(self, shape):
        self.shape, self.d = shape, {}

    def get(self, ptr):
        t = self.d.get(ptr)
        if t is None:
            t = self.d[ptr] = dev_tensor(ptr, self.shape)
        return t


# ------------------------------------------------------------ timing


def time_forwards(fwd, n, stream):
    """Median and all of n back-to-back forwards' times on `stream` (CUDA
    events, ms; perf_counter on the dry run), and wall time per forward
    (perf_counter around all n)."""
    ts, wall = CTX.series(fwd, n, stream=stream)
    return med(ts), wall, ts


def time_once(fn):
    return CTX.once(fn)[0]


def size_str(n):
    return "%d MiB" % (n // MiB) if n >= MiB else "%d KiB" % (n // KiB)


# =================================================================== GPU


def sync():
    CTX.sync()


class HandStreamer:
    """Hand-written double-buffered streamer over a fixed non-resident set.

    groups: list of lists of weight indices, in execution order; res[i]: a
    resident device tensor of weight i (used in place when i is not
    streamed); host_flat: an int16 CPU tensor over the pinned host buffer;
    host_off[i], nbytes[i], shape[i]: weight i's bytes there. Streamed
    weights of a group are copied (adjacent ones merged into one copy) into
    one of `nbuf` device buffers on a side stream; the compute stream waits
    for that copy's event, and the copy that reuses a buffer waits for the
    compute event of its last reader. The pipeline runs on across forwards:
    the next forward's first streamed groups are copied while this one
    ends (as vpager's prefetch wraps)."""

    def __init__(self, groups, streamed, res, host_flat, host_off, nbytes,
                 shape, compute, nbuf=2, inline=False):
        self.groups, self.res, self.compute = groups, res, compute
        self.streamed = set(streamed)
        self.inline = inline  # naive: copies on the compute stream, 1 buffer
        self.nbuf = 1 if inline else nbuf
        self.copy = compute if inline else new_stream()
        sg = []  # per streamed group: (group index, copies, views per buf)
        maxb = 0
        for gi, g in enumerate(groups):
            mem = [i for i in g if i in self.streamed]
            if not mem:
                continue
            runs, boff, place = [], 0, {}
            for i in mem:
                place[i] = boff
                if runs and runs[-1][0] + runs[-1][1] == host_off[i]:
                    runs[-1][1] += nbytes[i]
                else:
                    runs.append([host_off[i], nbytes[i], boff])
                boff += nbytes[i]
            maxb = max(maxb, boff)
            sg.append((gi, runs, place))
        self.bufs = [torch.empty(max(maxb, 2) // 2, dtype=torch.int16,
                                 device=DEV) for _ in range(self.nbuf)]
        self.plan = []  # per streamed group, per buffer: copies and views
        for gi, runs, place in sg:
            per = []
            for b in range(self.nbuf):
                buf = self.bufs[b]
                cps = [(buf[bo // 2:(bo + n) // 2],
                        host_flat[ho // 2:(ho + n) // 2]) for ho, n, bo in runs]
                views = {i: buf[o // 2:(o + nbytes[i]) // 2]
                         .view(torch.bfloat16).view(*shape[i])
                         for i, o in place.items()}
                per.append((cps, views))
            self.plan.append(per)
        self.gpos = {gi: k for k, (gi, _, _) in enumerate(sg)}
        self.nsg = len(sg)
        self.copy_done = [new_event() for _ in range(self.nbuf)]
        self.comp_done = [new_event() for _ in range(self.nbuf)]
        self.issued = self.used = 0
        self.bytes_per_forward = sum(nbytes[i] for i in self.streamed)
        if not inline:
            for _ in range(min(self.nbuf, self.nsg)):
                self._issue()

    def _issue(self):
        j = self.issued
        b, k = j % self.nbuf, j % self.nsg
        cps, _ = self.plan[k][b]
        with on(self.copy):
            if j >= self.nbuf:
                self.copy.wait_event(self.comp_done[b])
            for dst, src in cps:
                dst.copy_(src, non_blocking=True)
            self.copy_done[b].record(self.copy)
        self.issued += 1

    def forward(self, kernel):
        res = self.res
        for gi, g in enumerate(self.groups):
            k = self.gpos.get(gi)
            if k is None:
                for i in g:
                    kernel(i, res[i])
                continue
            if self.inline:
                cps, views = self.plan[k][0]
                for dst, src in cps:
                    dst.copy_(src, non_blocking=True)
            else:
                j = self.used
                b = j % self.nbuf
                assert j % self.nsg == k
                cps, views = self.plan[k][b]
                self.compute.wait_event(self.copy_done[b])
            for i in g:
                kernel(i, views[i] if i in views else res[i])
            if not self.inline:
                self.comp_done[b].record(self.compute)
                self.used += 1
                self._issue()


class Bench:
    def __init__(self, args):
        self.only = args.get("only")
        if CTX.cuda:
            torch.cuda.init()
            torch.cuda.set_device(0)
        for ln in benchlib.machine_lines(CTX.cuda):
            print(ln)
        print("mode: %s" % ("DRY RUN (CPU tensors, simulated device, byte "
                            "counts / 1024: the times mean nothing)"
                            if CFG.dry else "GPU"))
        self.dev = vpager.Device(**CFG.vp_opts)
        o = self.opts = self.dev.options
        print("vpager options: backend %s, page %d %s, staging ring %d %s, "
              "lookahead %d %s, default order %s, poll %d us, file slots "
              "%d x %d %s" % (self.dev.backend, o["page_size"] // UM, NM,
                              o["staging_size"] // UM, NM,
                              o["lookahead"] // UM, NM,
                              ORDER_NAME[o["evict_order"]],
                              o["poll_interval_us"], o["file_slots"],
                              o["file_slot_size"] // UM, NM))
        self.compute = new_stream()
        self.s = self.compute.cuda_stream
        # The host copy of the 96-layer model, one hostbuf in VBAR order;
        # benchmarks 1, 3 and 4 use parts of it.
        self.L, self.D = CFG.L, CFG.D
        self.LB = self.D * self.D * 2
        size = self.L * self.LB
        t0 = time.perf_counter()
        self.hb = self.dev.alloc_hostbuf(size, size)
        hi = self.hb.info()
        t_alloc = time.perf_counter() - t0
        self.hptr = hi["ptr"]
        self.host_flat = torch.frombuffer(self.hb.view(), dtype=torch.int16)
        self.host = self.host_flat.view(torch.bfloat16).view(self.L, self.D,
                                                             self.D)
        pinned = self.host_flat.is_pinned() if CTX.cuda else False
        # Resident copies (baseline) and the host bytes: random bf16.
        t0 = time.perf_counter()
        g = torch.Generator(device=DEV).manual_seed(1)
        self.res = []
        for i in range(self.L):
            w = torch.randn(self.D, self.D, device=DEV, dtype=torch.bfloat16,
                            generator=g) * 0.02
            self.host[i].copy_(w)
            self.res.append(w)
        sync()
        print("host model: one hostbuf of %d %s (vp_hostbuf_alloc %.2f s, "
              "%d %s page-locked, torch sees pinned=%s); filled with random "
              "bf16 from the GPU in %.2f s" % (size // UG, NG, t_alloc,
                                              hi["pinned_bytes"] // UG, NG,
                                              pinned,
                                              time.perf_counter() - t0))
        if CTX.cuda and (not pinned or hi["pinned_bytes"] < size):
            print("WARNING: the host buffer is not (all) page-locked: copies "
                  "will be slow and the baselines too")
        self.link = None

    def want(self, k):
        return not self.only or k in self.only

    # ------------------------------------------------------------- link
    def measure_link(self):
        """Plain pinned host->device copies of 128 MiB (32 of them, 4 GiB)
        and of 2 MiB (2048), torch .copy_(non_blocking=True) on one stream,
        from the same host buffer."""
        dst = torch.empty(self.LB // 2, dtype=torch.int16, device=DEV)
        src128 = [self.host_flat[i * self.LB // 2:(i + 1) * self.LB // 2]
                  for i in range(32)]
        n2 = self.LB // 64 // 2
        src2 = [self.host_flat[i * n2:(i + 1) * n2] for i in range(2048)]
        dst2 = dst[:n2]
        out = {}
        for name, srcs, d in (("128MiB", src128, dst), ("2MiB", src2, dst2)):
            nb = sum(s.numel() * 2 for s in srcs)

            def go(srcs=srcs, d=d):
                with on(self.compute):
                    for s in srcs:
                        d.copy_(s, non_blocking=True)
            go()
            m, wall, _ = time_forwards(go, 5, self.compute)
            out[name] = gbps(nb, m / 1e3)
        self.link = out["128MiB"]
        self.link2 = out["2MiB"]
        print("link (in-run baseline): pinned host->device %.2f GB/s in %d "
              "%s copies, %.2f GB/s in %d %s copies (median of 5 x %d %s)"
              % (self.link, self.LB // UM, NM, self.link2,
                 self.LB // 64 // UM, NM, 32 * self.LB // UG, NG))
        RESULTS["link_GBps"] = out
        del dst

    # ------------------------------------------------------- benchmark 1
    def bench_throughput(self):
        dev = self.dev
        total = CFG.through
        print("\n1. streaming throughput: weights that all miss (VBAR "
              "watermark 0) acquired and released in order on one stream, no "
              "kernels; %d %s a round, 6 rounds back to back, median of rounds "
              "2-6 (CUDA events on the stream); baseline: plain pinned copies "
              "of the same host bytes in the same chunks (torch copy_)"
              % (total // UG, NG))
        for wsize, base, key in ((self.LB, self.link, "128MiB"),
                                 (self.LB // 64, self.link2, "2MiB")):
            n = total // wsize
            m = Model(dev, total, [i * wsize for i in range(n)],
                      [wsize] * n, self.hb)
            m.vbar.set_watermark(0)
            s = self.s
            run_groups(m, s)  # opens the staging ring
            sync()
            s0 = dev.stats()
            med_ms, wall, ts = time_forwards(lambda: run_groups(m, s), 6,
                                             self.compute)
            d = stats_delta(s0, dev.stats())
            med_ms = med(ts[1:])
            r = gbps(total, med_ms / 1e3)
            cpu_us = self._cpu_cost(lambda: run_groups(m, s), n)
            staged = len(m.staged())
            print("   %3d %s weights x %4d: vpager %.2f GB/s (%.1f ms/round, "
                  "wall %.1f) | baseline %.2f GB/s | ratio %.3f, %s" % (
                      wsize // UM, NM, n, r, med_ms, wall, base, r / base,
                      target("1. throughput %d %s weights" % (
                          wsize // UM, NM), r / base, ">=", 0.95)))
            print("       per round: staged %d of %d weights, %.0f %s copied, "
                  "%d copies after merging, %d ring waits, prefetch %.0f %s "
                  "(used %.0f, dropped %.0f); host cost %.1f us per "
                  "acquire+release" % (
                      staged, n, copied_bytes(d) / 6 / UM, NM,
                      d["copies"] / 6, d["ring_waits"] / 6,
                      d["prefetch_bytes"] / 6 / UM, NM,
                      d["prefetch_used_bytes"] / 6 / UM,
                      d["prefetch_dropped_bytes"] / 6 / UM, cpu_us))
            RESULTS["throughput_%s" % key] = {
                "GBps": r, "baseline_GBps": base, "ratio": r / base}
            sync()
            m.destroy()
        if self.link2 < self.link:
            print("   (%d %s weights against one %d %s-chunk copy: ratio "
                  "%.3f)" % (self.LB // 64 // UM, NM, self.LB // UM, NM,
                             RESULTS["throughput_2MiB"]["GBps"] / self.link))

    def _cpu_cost(self, fn, calls):
        """Host us per call of fn() (synchronized before and after)."""
        return CTX.host_ms(fn) / calls * 1e3

    # ------------------------------------------------------- benchmark 2
    def bench_overlap(self):
        dev = self.dev
        L, D, LB = self.L, self.D, self.LB
        cs = self.compute
        s = self.s
        weights = L * LB
        budget = int(weights / 1.5)
        print("\n2. overlap: %d bf16 %dx%d layers (%d %s each, %d %s), "
              "vpager budget %.2f %s (weights/1.5, staging ring included), "
              "forward = x @ W_i for every layer on one stream" % (
                  L, D, D, LB // UM, NM, weights // UG, NG, budget / UG, NG))
        # Per-layer copy and GEMM times, to pick the balanced batch.
        dst = torch.empty(D, D, dtype=torch.bfloat16, device=DEV)
        xs = {}

        def gemm_ms(b):
            x = torch.randn(b, D, device=DEV, dtype=torch.bfloat16)
            o = torch.empty(b, D, device=DEV, dtype=torch.bfloat16)

            def f():
                with on(cs):
                    for i in range(L):
                        torch.mm(x, self.res[i], out=o)
            f()
            m, _, _ = time_forwards(f, 3, cs)
            return m / L
        mid, step = CFG.mid, CFG.step
        t_copy = LB / (self.link * 1e9) * 1e3
        gmid = gemm_ms(mid)
        beq = int(round(mid * t_copy / gmid / step)) * step
        beq = max(CFG.beq_min, min(beq, CFG.cap))
        geq = gemm_ms(beq)
        batches = [16, mid, beq]
        print("   per layer: copy %.3f ms at %.2f GB/s; GEMM %.3f ms at %d "
              "tokens (%.0f TFLOP/s), %.3f ms at %d (balanced: GEMM ~ copy); "
              "batches %s" % (t_copy, self.link, gmid, mid,
                              2 * mid * D * D / gmid / 1e9, geq, beq,
                              batches))
        for b in batches:
            xs[b] = (torch.randn(b, D, device=DEV, dtype=torch.bfloat16),
                     [torch.empty(b, D, device=DEV, dtype=torch.bfloat16)
                      for _ in range(2)])
        with on(cs):  # torch's pools are per stream
            assert torch.equal(self.res[0], self.res[0])
        del dst
        sync()
        cache = TensorCache((D, D))
        NT = 5
        out = RESULTS.setdefault("overlap", {})

        def kern_for(b):
            x, outs = xs[b]

            def k(i, w):
                torch.mm(x, w, out=outs[i & 1])
            return k

        def resident_fwd(b):
            k = kern_for(b)

            def f():
                with on(cs):
                    for i in range(L):
                        k(i, self.res[i])
            return f

        def vp_fwd(m, b, verify=None):
            k = kern_for(b)
            batches_ = m.batches        # one weight each

            def f():
                with on(cs):
                    for i in range(L):
                        wb = batches_[i]
                        w = cache.get(wb.acquire(s)[0])
                        if verify is not None:
                            if not torch.equal(w, self.res[i]):
                                verify.append(i)
                        k(i, w)
                        wb.release(s)
            return f

        # Prime torch's cache with the streamers' buffers, so that making
        # them later does not move the device's free memory (vpager's
        # budget follows it).
        tmp = [torch.empty(LB // 2, dtype=torch.int16, device=DEV)
               for _ in range(3)]
        del tmp
        sync()
        # A second device handle with 128 MiB pages (one page per layer) for
        # the interleaved order at the weights' own granularity.
        dev2 = vpager.Device(**dict(self.opts, page_size=LB,
                                    evict_order=vpager.ORDER_INTERLEAVED))
        variants = (
            ("tail-first", dev, vpager.ORDER_TAIL_FIRST, "%d %s pages" % (
                self.opts["page_size"] // UM, NM)),
            ("interleaved", dev, vpager.ORDER_INTERLEAVED, "%d %s pages" % (
                self.opts["page_size"] // UM, NM)),
            ("interleaved-128MiB-pages", dev2, None,
             "a second device handle opened with page_size %d %s and "
             "evict_order interleaved" % (LB // UM, NM)))
        base = {}
        for oname, vdev, order, how in variants:
            info = set_budget(vdev, budget)
            m = Model(vdev, weights, [i * LB for i in range(L)],
                      [LB] * L, self.hb, order=order)
            s0 = vdev.stats()
            cold = time_once(vp_fwd(m, batches[0]))
            d = stats_delta(s0, vdev.stats())
            cold_bytes = copied_bytes(d)
            print("\n   vpager, %s eviction order (%s): budget %.2f %s "
                  "(headroom %.1f %s, device free %.1f %s)" % (
                      oname, how, info["budget"] / UG, NG,
                      info["headroom"] / UG, NG, info["free_memory"] / UG,
                      NG))
            print("   cold forward (the first, batch %d): %.1f ms, %.2f %s "
                  "copied (%d pages committed, %d evicted) = %.2f GB/s; "
                  "baseline: the same bytes at the link's %.2f GB/s %.1f ms, "
                  "ratio %.2f" % (batches[0], cold, cold_bytes / UG, NG,
                                  d["pages_committed"], d["pages_evicted"],
                                  gbps(cold_bytes, cold / 1e3), self.link,
                                  cold_bytes / self.link / 1e6,
                                  cold / (cold_bytes / self.link / 1e6)))
            out.setdefault(oname, {})["cold_ms"] = cold
            for b in batches:
                bad = []
                f = vp_fwd(m, b)
                f()
                f()
                vp_fwd(m, b, verify=bad)()  # a third warm-up, checked
                s0 = vdev.stats()
                t_vp, wall_vp, ts = time_forwards(f, NT, cs)
                d = stats_delta(s0, vdev.stats())
                streamed = m.staged()
                sbytes = len(streamed) * LB
                cbytes = copied_bytes(d) / NT
                ideal = sbytes / (self.link * 1e9) * 1e3
                # The hand-written streamer over exactly this set.
                hs = HandStreamer([[i] for i in range(L)], streamed, self.res,
                                  self.host_flat, [i * LB for i in range(L)],
                                  [LB] * L, [(D, D)] * L, cs)
                k = kern_for(b)

                def hf(hs=hs, k=k):
                    with on(cs):
                        hs.forward(k)
                hf()
                hf()
                t_hand, wall_hand, _ = time_forwards(hf, NT, cs)
                if b not in base:
                    t_res, _, _ = time_forwards(resident_fwd(b), NT, cs)
                    base[b] = {"resident": t_res}
                if "naive" not in base[b]:
                    nv = HandStreamer([[i] for i in range(L)], streamed,
                                      self.res, self.host_flat,
                                      [i * LB for i in range(L)], [LB] * L,
                                      [(D, D)] * L, cs, inline=True)

                    def nf(nv=nv, k=k):
                        with on(cs):
                            nv.forward(k)
                    nf()
                    base[b]["naive"], _, _ = time_forwards(nf, NT, cs)
                    base[b]["naive_set"] = oname
                    del nv
                t_res = base[b]["resident"]
                print("   batch %5d: vpager %.2f ms (wall %.2f; forwards %s) | "
                      "hand-written streamer %.2f ms | resident %.2f ms | "
                      "naive (%s set) %.2f ms" % (
                          b, t_vp, wall_vp, " ".join("%.1f" % t for t in ts),
                          t_hand, t_res, base[b]["naive_set"],
                          base[b]["naive"]))
                print("      streamed %d of %d layers, %.2f %s a forward "
                      "(vpager copied %.2f %s in %d copies; %d ring waits, "
                      "%d evictions); copy-bound ideal %.2f ms; vpager/ideal "
                      "%.3f, hand/ideal %.3f, vpager/hand %.3f, "
                      "vpager/resident %.2f%s" % (
                          len(streamed), L, sbytes / UG, NG, cbytes / UG, NG,
                          d["copies"] / NT, d["ring_waits"] / NT,
                          d["pages_evicted"] / NT, ideal, t_vp / ideal,
                          t_hand / ideal, t_vp / t_hand, t_vp / t_res,
                          "; DATA MISMATCH in layers %s" % bad if bad else
                          "; data verified"))
                if b == mid:
                    # Diagnostic: the same without prefetch. An acquire's
                    # stream then waits only for copies issued up to and
                    # including its own weights (no prefetched later ones).
                    vdev.set_lookahead(0)
                    f()
                    f()
                    t_nola, _, _ = time_forwards(f, NT, cs)
                    vdev.set_lookahead(self.opts["lookahead"])
                    f()
                    print("      diagnostic, lookahead 0 (no prefetch): vpager "
                          "%.2f ms, vpager/hand %.3f" % (t_nola,
                                                         t_nola / t_hand))
                if b == batches[0]:
                    print("      layers ('#' in place, 's' staged): %s" %
                          m.flag_map())
                    print("      pages  ('#' resident, '.' not):    %s" %
                          m.page_map())
                rec = {"vpager_ms": t_vp, "hand_ms": t_hand,
                       "resident_ms": t_res, "naive_ms": base[b]["naive"],
                       "streamed_layers": len(streamed),
                       "streamed_GiB": sbytes / UG,
                       "copied_GiB": cbytes / UG, "ideal_ms": ideal,
                       "forwards_ms": ts, "verified": not bad}
                out[oname]["batch_%d" % b] = rec
                if b == batches[0]:
                    print("      " + target("2. copy-bound b%d %s vp/ideal" % (
                        b, oname), t_vp / ideal, "<=", 1.02))
                if b == beq:
                    print("      " + target("2. compute-bound b%d %s vp/hand"
                                            % (b, oname), t_vp / t_hand,
                                            "<=", 1.05))
                del hs
            sync()
            m.destroy()
        dev2.close()
        print("   cache of device views: %d addresses" % len(cache.d))

    # ------------------------------------------------------- benchmark 3
    def bench_small(self):
        dev, cs, s = self.dev, self.compute, self.s
        N, G, SD = CFG.small_n, CFG.small_group, CFG.SD
        WS = SD * SD * 2
        budget = CFG.small_budget
        per_layer = self.LB // WS
        print("\n3. many small weights: %d weights of %d %s (%d %s), "
              "budget %d %s (staging ring included), %d weights per "
              "acquire, kernel per weight: x[16,%d] @ W[%d,%d]" % (
                  N, WS // UM, NM, N * WS // UG, NG, budget // UG, NG, G,
                  SD, SD, SD))
        res = [self.res[i // per_layer].view(-1)[
            (i % per_layer) * (WS // 2):(i % per_layer + 1) * (WS // 2)]
            .view(SD, SD) for i in range(N)]
        x = torch.randn(16, SD, device=DEV, dtype=torch.bfloat16)
        outs = [torch.empty(16, SD, device=DEV, dtype=torch.bfloat16)
                for _ in range(2)]

        def k(i, w):
            torch.mm(x, w, out=outs[i & 1])
        groups = [list(range(i, min(i + G, N))) for i in range(0, N, G)]
        cache = TensorCache((SD, SD))
        sync()
        info = set_budget(dev, budget)
        m = Model(dev, N * WS, [i * WS for i in range(N)], [WS] * N,
                  self.hb, group=G)

        def vf(verify=None):
            def f():
                with on(cs):
                    for gi, wb in enumerate(m.batches):
                        ptrs = wb.acquire(s)
                        g0 = gi * G
                        for j in range(g0, g0 + wb.n):
                            w = cache.get(ptrs[j - g0])
                            if verify is not None and not torch.equal(
                                    w, res[j]):
                                verify.append(j)
                            k(j, w)
                        wb.release(s)
            return f
        cold = time_once(vf())
        bad = []
        vf()()
        vf(bad)()
        s0 = dev.stats()
        NT = 7
        t_vp, wall_vp, ts = time_forwards(vf(), NT, cs)
        d = stats_delta(s0, dev.stats())
        streamed = m.staged()
        sbytes = len(streamed) * WS
        cbytes = copied_bytes(d) / NT
        hs = HandStreamer(groups, streamed, res, self.host_flat,
                          [i * WS for i in range(N)], [WS] * N,
                          [(SD, SD)] * N, cs)

        def hf():
            with on(cs):
                hs.forward(k)
        hf()
        hf()
        t_hand, wall_hand, _ = time_forwards(hf, NT, cs)

        def rf():
            with on(cs):
                for i in range(N):
                    k(i, res[i])
        rf()
        t_res, wall_res, _ = time_forwards(rf, NT, cs)
        cpu = self._cpu_cost(vf(), N)
        ideal = sbytes / (self.link * 1e9) * 1e3
        print("   budget %.2f %s; cold forward %.1f ms" % (info["budget"] / UG,
                                                         NG, cold))
        print("   vpager %.2f ms (wall %.2f) | hand-written streamer %.2f ms "
              "(wall %.2f) | resident %.2f ms (wall %.2f) | copy ideal %.2f "
              "ms at %.2f GB/s" % (t_vp, wall_vp, t_hand, wall_hand, t_res,
                                    wall_res, ideal, self.link))
        print("   streamed %d of %d weights, %.2f %s a forward (vpager copied "
              "%.2f %s), %d copies a forward after merging, %d ring waits, "
              "prefetch used %.0f %s dropped %.0f %s; host cost %.1f us a "
              "weight (acquire/release of %d + kernel launches)%s" % (
                  len(streamed), N, sbytes / UG, NG, cbytes / UG, NG,
                  d["copies"] / NT,
                  d["ring_waits"] / NT, d["prefetch_used_bytes"] / NT / UM,
                  NM, d["prefetch_dropped_bytes"] / NT / UM, NM, cpu, G,
                  "; DATA MISMATCH at %s" % bad[:10] if bad else
                  "; data verified"))
        print("   vpager/hand %.3f, %s; vpager/ideal %.3f, hand/ideal %.3f"
              % (t_vp / t_hand, target("3. many small weights vpager/hand",
                                       t_vp / t_hand, "<=", 1.15),
                 t_vp / ideal, t_hand / ideal))
        RESULTS["small"] = {"vpager_ms": t_vp, "hand_ms": t_hand,
                            "resident_ms": t_res, "ideal_ms": ideal,
                            "cold_ms": cold, "streamed": len(streamed),
                            "verified": not bad}
        sync()
        m.destroy()

    # ------------------------------------------------------- benchmark 4
    def bench_file(self):
        dev = self.dev
        print("\n4. file -> VRAM: safetensors file on local disk, vp_st_open + "
              "vp_st_load of every tensor into a VBAR")
        d_, why = pick_disk_dir(CFG.file_need)
        if d_ is None:
            print("   SKIPPED: %s" % why)
            return
        path = os.path.join(d_, "vpager_bench_stream.safetensors")
        NT, TB = CFG.file_tensors, self.LB
        total = NT * TB
        hdr = {"__metadata__": {"format": "pt", "by": "bench_stream.py"}}
        for i in range(NT):
            hdr["layers.%02d.weight" % i] = {
                "dtype": "BF16", "shape": [self.D, self.D],
                "data_offsets": [i * TB, (i + 1) * TB]}
        hj = json.dumps(hdr, separators=(",", ":")).encode()
        pad = (-(8 + len(hj))) % 4096
        hj += b" " * pad
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, len(hj).to_bytes(8, "little") + hj)
            for i in range(NT):
                mv = memoryview(self.hb.view(i * TB, TB)).cast("B")
                done = 0
                while done < TB:
                    done += os.write(fd, mv[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        t_write = time.perf_counter() - t0
        fsize = os.path.getsize(path)
        print("   file: %s on %s, %d tensors BF16 [%d, %d], %.2f %s, header "
              "%d bytes (data aligned to 4096); written and fsynced in %.1f s "
              "(%.2f GB/s)" % (path, why, NT, self.D, self.D, fsize / UG, NG,
                               8 + len(hj), t_write, gbps(fsize, t_write)))
        buf = mmap.mmap(-1, 64 * MiB)

        def read_all(direct):
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
            fd = os.open(path, flags)
            try:
                if not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                off = 0
                while off < fsize:
                    n = os.preadv(fd, [buf], off)
                    if n <= 0:
                        raise OSError("short read at %d" % off)
                    off += n
                return time.perf_counter() - t0
            finally:
                os.close(fd)

        def read_hot():
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                t0 = time.perf_counter()
                while off < fsize:
                    off += os.preadv(fd, [buf], off)
                return time.perf_counter() - t0
            finally:
                os.close(fd)
        st = dev.open_safetensors(path)
        n = len(st)
        tens = [(t.name, t.offset, t.size) for t in st]
        idx = list(range(n))
        offs = [i * TB for i in range(n)]
        info = set_budget(dev, total + CFG.file_budget_extra)
        s = self.s

        def vp_load():
            vb = dev.create_vbar(total)
            st.drop_pages()
            sync()
            t0 = time.perf_counter()
            if not st.load(idx, vb, offs, s):
                raise RuntimeError("vp_st_load returned VP_MISS: the VBAR "
                                   "could not be made resident")
            sync()
            return time.perf_counter() - t0, vb
        rounds = 3
        r_direct, r_cold, r_vp = [], [], []
        bad = None
        hot = None
        for r in range(rounds):
            try:
                r_direct.append(read_all(True))
            except OSError as e:
                if r == 0:
                    print("   O_DIRECT read failed (%s); using buffered reads "
                          "after POSIX_FADV_DONTNEED only" % e)
            r_cold.append(read_all(False))
            t, vb = vp_load()
            r_vp.append(t)
            if bad is None:  # check the bytes once: tensors 0 and n-1
                bad = []
                for i in (0, n - 1):
                    ok, _ = vb.fault(i * TB, TB, gens=False)
                    if not ok:
                        raise RuntimeError("vp_fault returned VP_MISS on "
                                           "tensor %d" % i)
                    w = dev_tensor(vb.base + i * TB, (self.D, self.D))
                    with on(self.compute):
                        ok = torch.equal(w, self.res[i])
                    vb.unpin(i * TB, TB, s)
                    if not ok:
                        bad.append(tens[i][0])
                sync()
            vb.close()
            if r == 0 and r_cold[0] > 8:
                rounds = 2
            if r + 1 >= rounds:
                break
        hot = read_hot()
        sd = dev.stats()
        st.close()
        gb_direct = gbps(fsize, med(r_direct)) if r_direct else 0.0
        gb_cold = gbps(fsize, med(r_cold))
        gb_vp = gbps(total, med(r_vp))
        read = max(gb_direct, gb_cold)
        ceiling = min(read, self.link)
        print("   file read speed (single thread, 64 MiB preadv): O_DIRECT "
              "%s | buffered after POSIX_FADV_DONTNEED %.2f GB/s | page cache "
              "hot %.2f GB/s (shows whether the drop worked)" % (
                  "%.2f GB/s" % gb_direct if r_direct else "n/a", gb_cold,
                  gbps(fsize, hot)))
        print("   vpager vp_st_load (vp_st_drop_pages first, VBAR created "
              "fresh, commit included): %.2f GB/s (%s s) | baseline min(read "
              "%.2f [the faster of O_DIRECT and cold buffered], link %.2f) = "
              "%.2f GB/s | ratio %.3f, %s; %s" % (
                  gb_vp, " ".join("%.2f" % t for t in r_vp), read, self.link,
                  ceiling, gb_vp / ceiling,
                  target("4. file -> VRAM / min(read, link)", gb_vp / ceiling,
                         ">=", 0.85),
                  "data verified (tensors 0 and %d)" % (n - 1) if not bad else
                  "DATA MISMATCH in %s" % bad))
        print("   file_bytes_read so far %.2f %s; budget was %.1f %s" % (
            sd["file_bytes_read"] / UG, NG, info["budget"] / UG, NG))
        RESULTS["file"] = {"vpager_GBps": gb_vp, "odirect_GBps": gb_direct,
                           "cold_buffered_GBps": gb_cold,
                           "hot_GBps": gbps(fsize, hot), "link_GBps": self.link,
                           "ratio": gb_vp / ceiling}
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self):
        sync()
        sd = self.dev.stats()
        print("\ndevice totals: %s" % ", ".join(
            "%s %d" % (k, sd[k]) for k in (
                "acquires", "weight_staged", "weight_fills", "copies",
                "stream_waits", "ring_waits", "pages_committed",
                "pages_evicted", "budget_misses", "watermark_misses",
                "pin_fallback_bytes")))
        self.hb.close()
        self.dev.close()


def pick_disk_dir(need):
    """A directory on a real disk (not tmpfs) with `need` bytes free."""
    mounts = []
    try:
        with open("/proc/mounts") as f:
            for ln in f:
                p = ln.split()
                if len(p) >= 3:
                    mounts.append((p[1], p[2], p[0]))
    except OSError:
        pass

    def fstype(d):
        best = ("", "?", "?")
        real = os.path.realpath(d)
        for mp, t, src in mounts:
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and \
                    len(mp) >= len(best[0]):
                best = (mp, t, src)
        return best
    tried = []
    for d in ("/tmp", "/var/tmp", ROOT, os.path.expanduser("~")):
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            continue
        mp, t, src = fstype(d)
        sv = os.statvfs(d)
        free = sv.f_bavail * sv.f_frsize
        tried.append("%s: %s %s, %.0f GiB free" % (d, t, src, free / GiB))
        if t in ("tmpfs", "ramfs"):
            continue
        if free >= need:
            return d, "%s (%s %s, mounted at %s)" % (d, t, src, mp)
    return None, "no directory on a disk with %s free: %s" % (
        size_str(need) if need < GiB else "%d GiB" % (need >> 30),
        "; ".join(tried))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", "--sim-dry-run", action="store_true",
                    help="the CPU and the simulated device, byte counts / "
                    "1024")
    ap.add_argument("--only", default="",
                    help="comma-separated benchmarks to run (1,2,3,4)")
    a = ap.parse_args()
    args = {}
    only = {int(x) for x in a.only.split(",") if x.strip()}
    if only:
        args["only"] = only
    global torch
    import torch as _torch
    torch = _torch
    if not a.dry_run and not torch.cuda.is_available():
        print("bench_stream: no CUDA GPU visible to torch; nothing to do "
              "(--dry-run checks the script on the CPU)")
        return 0
    configure(a.dry_run)
    t_start = time.perf_counter()
    b = Bench(args)
    b.measure_link()
    steps = ((1, b.bench_throughput), (2, b.bench_overlap),
             (3, b.bench_small), (4, b.bench_file))
    for k, fn in steps:
        if b.want(k):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, run the rest
                import traceback
                traceback.print_exc(file=sys.stdout)
                print("   FAILED: %s: %s" % (type(e).__name__, e))
                RESULTS.setdefault("errors", []).append(str(e))
                sync()
            print("   (benchmark %d took %.1f s)" % (k, time.perf_counter() - t0))
    b.close()
    print("\ntargets:")
    for ln in benchlib.target_lines("   %-52s %.3f %s %.2f  %s"):
        print(ln)
    print("total run time %.1f s" % (time.perf_counter() - t_start))
    RESULTS["targets"] = benchlib.targets_json()
    RESULTS["dry_run"] = a.dry_run
    benchlib.write_json("bench_stream.json", RESULTS)
    return 1 if RESULTS.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
