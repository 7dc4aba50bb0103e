#!/usr/bin/env python3
"""Soak test (issue 11): vpager's streaming engine and the comfy_aimdo
drop-in under eviction stress, every byte checked against an all-resident
copy.

    python3 bench/soak.py                   # GPU (torch with CUDA), 300 s
    python3 bench/soak.py --small --seconds 180     # for compute-sanitizer
    python3 bench/soak.py --dry-run --seconds 20    # simulated device, CPU

(After `make`; the script puts python/ and python/compat/ on sys.path.)

For --seconds, at once:

* --threads host threads (4), each with its own stream: a torch.cuda.Stream
  whose .cuda_stream vpager takes (on the simulated device: a vpager stream,
  in worker mode, so each stream is a thread and work runs later). Each
  loops: a run of consecutive weights (random start and length) acquired
  on its stream (a WeightBatch), kernels queued on that stream reading
  every acquired pointer (a tensor over the address from vpager.torch's
  views module: the bytes as int16 words, their sum and a position-weighted
  sum, in int64; sometimes after a sleep kernel, sometimes a full copy),
  released on the stream. After 1-4 such iterations the thread synchronizes
  the stream and compares each checksum with the one computed up front from
  an all-resident copy of the weights (and each copy with the host bytes).
  It also checks the flags and pointers vp_acquire returned.
* A budget thread, every 0.5-8 ms: vp_device_set_limit and the headroom at
  random (never below what one acquire needs: the staging ring plus the
  largest weight), the drop-in's set_simple_vram_headroom, and now and then
  vp_vbar_prioritize/deprioritize, vp_device_free_memory and the lookahead.
* The drop-in thread (python/compat/comfy_aimdo, its own device): a
  ModelVBAR's weights in ComfyUI's per-weight cycle (vbar_fault, compare the
  signature, copy from the host when it changed, use, vbar_unpin on its
  stream), checksums compared as above.
* A process (multiprocessing, spawn) allocating and freeing device memory
  at random (torch.empty on CUDA, 100 MiB-2 GiB, held a few ms, freed,
  empty_cache); on the simulated device a second vpager device sharing the
  memory count (VPAGER_SIM_SHARED: every device here opens that name).

Before and after the soak every weight is acquired and checked once with
no budget; at the end no page may be left pinned. The summary gives the
machine, the inputs, iterations, acquires, evictions and staging from the
device counters, and the errors (target 0); exit status 1 on any error.
$OUT/soak.json gets the figures when OUT is set.
"""

import argparse
import faulthandler
import math
import multiprocessing as mp
import os
import random
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (os.path.join(ROOT, "python", "compat"),
           os.path.join(ROOT, "python")):
    if _p not in sys.path:
        sys.path.insert(1, _p)

import benchlib as bl  # noqa: E402

KiB, MiB, GiB = bl.KiB, bl.MiB, bl.GiB
NO_LIMIT = (1 << 64) - 1
say = bl.say

# Counters of the summary, from vp_device_stats.
STREAM_STATS = ("acquires", "weight_fills", "weight_staged", "fill_bytes",
                "staged_bytes", "copies", "stream_waits", "pages_committed",
                "pages_evicted", "evict_waits", "budget_misses",
                "watermark_misses", "commit_failures", "commit_retries",
                "ring_waits", "prefetch_bytes", "prefetch_used_bytes",
                "prefetch_dropped_bytes", "budget_polls")
COMPAT_STATS = ("faults", "hits", "fills", "misses", "unpins",
                "pages_committed", "pages_evicted", "evict_waits",
                "budget_misses", "watermark_misses", "commit_failures")


# ------------------------------------------------------------------ sizes

class Sizes:
    """What one mode runs: GPU (full), GPU --small, or --dry-run (sim)."""

    def __init__(self, mode, threads):
        self.mode = mode
        if mode == "full":
            self.page = 2 * MiB
            self.nweights = (100, 200)
            # (share, smallest, largest): log-uniform inside a class
            self.classes = ((0.25, 4 * KiB, 256 * KiB),
                            (0.35, 256 * KiB, 8 * MiB),
                            (0.4, 8 * MiB, 96 * MiB))
            self.run_cap = 128 * MiB
            self.hog = (100 * MiB, 2 * GiB)
            self.compat_sizes = (515, 64 * KiB + 3, 1 * MiB + 7, 5 * MiB,
                                 12 * MiB + 1, 30 * MiB, 48 * MiB)
            self.compat_pages = (16, 8)     # two models, 32 MiB pages
            self.compat_budget = (2, 18)    # pages
            self.sleep_cycles = 200000
        elif mode == "small":
            self.page = 2 * MiB
            self.nweights = (60, 100)
            self.classes = ((0.3, 1 * KiB, 64 * KiB),
                            (0.4, 64 * KiB, 1 * MiB),
                            (0.3, 1 * MiB, 6 * MiB))
            self.run_cap = 8 * MiB
            self.hog = (16 * MiB, 256 * MiB)
            self.compat_sizes = (515, 64 * KiB + 3, 1 * MiB + 7, 3 * MiB)
            self.compat_pages = (3, 2)
            self.compat_budget = (1, 4)
            self.sleep_cycles = 20000
        else:                               # dry: the simulated device
            self.page = 256 * KiB
            self.granularity = 64 * KiB
            self.nweights = (80, 140)
            self.classes = ((0.3, 1 * KiB, 32 * KiB),
                            (0.4, 32 * KiB, 512 * KiB),
                            (0.3, 512 * KiB, 3500 * KiB))
            self.run_cap = 4 * MiB
            self.hog = (4 * MiB, 64 * MiB)
            self.compat_sizes = (515, 64 * KiB + 3, 1 * MiB + 7, 5 * MiB,
                                 12 * MiB + 1)
            self.compat_pages = (4, 2)
            self.compat_budget = (1, 5)
            self.sleep_s = 0.002
        self.run_len = 8                    # weights per acquire, at most
        self.depth = 4                      # iterations per stream sync
        self.clone_rate = 0.05              # iterations that copy a weight
        self.sleep_rate = 0.3               # iterations delayed on the stream
        # The ring holds every thread's run at once and one more (slots are
        # first-fit: a refusal for fragmentation, VP_ELIMIT, is counted but
        # is no error), and is a fraction of the model, so its slots cycle.
        self.staging = roundup((threads + 1) * self.run_cap, self.page)


def roundup(x, a):
    return (x + a - 1) // a * a


def log_uniform(rng, lo, hi):
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def fmt_mib(n):
    if n < MiB:
        return "%.1f KiB" % (n / KiB)
    return "%.1f MiB" % (n / MiB) if n < 10 * GiB else "%.2f GiB" % (n / GiB)


def flag_names(f):
    names = [n for bit, n in ((1, "resident"), (2, "staged"), (4, "copied"),
                              (8, "empty")) if f & bit]
    return "+".join(names) or "none"


# ------------------------------------------------------------ the checksum

class Checksum:
    """An exact checksum of a uint8 tensor, on its device: int16 words
    (bytes when the size is odd), their sum and their sum weighted by the
    position ((i mod 32749) + 1), both in int64. Returns a 2-element int64
    tensor; the work is queued on the current stream."""

    def __init__(self, torch, device, sizes):
        self.torch = torch
        n = max(s // 2 if s % 2 == 0 else s for s in sizes)
        self.coef = (torch.arange(n, dtype=torch.int32, device=device)
                     % 32749) + 1

    def __call__(self, t8):
        torch = self.torch
        w = t8.view(torch.int16) if t8.numel() % 2 == 0 else t8
        n = w.numel()
        a = w.sum(dtype=torch.int64)
        b = (w.to(torch.int32) * self.coef[:n]).sum(dtype=torch.int64)
        return torch.stack((a, b))


# -------------------------------------------------------- the other process

def hog_main(conf, stop, results):
    """Allocate and free device memory at random until `stop` is set (or
    the soak process is gone); put a dict of counts on `results`."""
    rng = random.Random(conf["seed"])
    parent = conf["parent"]

    def running():
        return not stop.is_set() and os.getppid() == parent
    lo, hi = conf["range"]
    out = dict(allocs=0, bytes=0, fails=0, max_bytes=0, error=None)
    try:
        if conf["cuda"]:
            import torch
            torch.cuda.set_device(conf["index"])
            torch.empty(1, device="cuda")
            while running():
                n = rng.randint(lo, hi)
                try:
                    x = torch.empty(n, dtype=torch.uint8, device="cuda")
                    x[::1 << 20].fill_(1)       # touch every MiB
                    out["allocs"] += 1
                    out["bytes"] += x.numel()
                    out["max_bytes"] = max(out["max_bytes"], x.numel())
                    time.sleep(rng.uniform(0.001, 0.008))
                    del x
                except RuntimeError:            # out of memory
                    out["fails"] += 1
                torch.cuda.empty_cache()
                time.sleep(rng.uniform(0, 0.004))
        else:
            import vpager
            page = conf["page"]
            dev = vpager.Device(backend="sim", page_size=page,
                                sim_granularity=conf["granularity"],
                                sim_capacity=conf["capacity"],
                                sim_shared=conf["shared"])
            vb = dev.create_vbar(roundup(hi, page))
            while running():
                n = roundup(rng.randint(lo, hi), page)
                vb.prioritize()     # free_memory lowered its watermark
                ok, _ = vb.fault(0, n, gens=False)
                if ok:
                    out["allocs"] += 1
                    out["bytes"] += n
                    out["max_bytes"] = max(out["max_bytes"], n)
                    time.sleep(rng.uniform(0.001, 0.008))
                    vb.unpin(0, n)
                    vb.free_memory(n)
                else:
                    out["fails"] += 1
                time.sleep(rng.uniform(0, 0.004))
            dev.close()
    except Exception as e:  # noqa: BLE001 (reported by the parent)
        out["error"] = "%s: %s" % (type(e).__name__, e)
    results.put(out)


# ------------------------------------------------------------------- soak

class Soak:

    def __init__(self, args):
        import torch
        import vpager
        from vpager.torch.views import view
        self.torch, self.vp, self.view = torch, vpager, view
        self.args = args
        self.cuda = not args.dry_run
        self.mode = ("dry" if args.dry_run else "small" if args.small
                     else "full")
        self.sz = Sizes(self.mode, args.threads)
        self.lookahead = 0 if args.no_prefetch else self.sz.staging // 4
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.errors = []            # messages
        self.notes = []             # warnings that are not errors
        self.threads = []
        self.tstats = []            # per streaming thread
        self.compat = {}
        self.chaos = {}
        self.hog = {}
        self.passes = {}
        # What the summary prints, should setup fail early.
        self.n = self.model_bytes = self.maxw = 0
        self.min_need = self.max_limit = self.compat_bytes = 0
        self.cmodels = []
        self.hog_proc = None
        if self.cuda:
            self.index = torch.cuda.current_device()
            self.tdev = torch.device("cuda", self.index)
        else:
            self.index = 0
            self.tdev = torch.device("cpu")

    # ---------------------------------------------------------- reporting
    def error(self, msg):
        with self.lock:
            self.errors.append(msg)
            n = len(self.errors)
        if n <= 20:
            say("ERROR: " + msg)
        elif n == 21:
            say("ERROR: (more errors: only the count is kept from here)")

    def note(self, msg):
        with self.lock:
            self.notes.append(msg)
        say("note: " + msg)

    # -------------------------------------------------------------- model
    def build_model(self):
        torch, vp, sz = self.torch, self.vp, self.sz
        rng = self.rng
        n = self.args.weights or rng.randint(*sz.nweights)
        shares = [c[0] for c in sz.classes]
        sizes, offsets = [], []
        off = 0
        for _ in range(n):
            _, lo, hi = rng.choices(sz.classes, weights=shares)[0]
            s = max(2, log_uniform(rng, lo, hi) & ~1)        # bf16-ish
            align = rng.choice((512, 512, 512, 512, 4096, sz.page))
            off = roundup(off, align)
            offsets.append(off)
            sizes.append(s)
            off += s
        self.sizes, self.offsets = sizes, offsets
        self.n = n
        self.model_bytes = sum(sizes)
        self.maxw = max(sizes)
        self.vbar_size = roundup(off, sz.page)

        opts = dict(page_size=sz.page, staging_size=sz.staging,
                    lookahead=self.lookahead)
        if self.cuda:
            opts.update(backend="cuda", device_index=self.index)
        else:
            # One simulated device's memory for every device here (this
            # one, the drop-in's, the other process's).
            self.shared = "soak%d" % os.getpid()
            self.capacity = roundup(
                sz.staging + 2 * self.vbar_size + sz.hog[1]
                + sz.compat_budget[1] * (32 * MiB) + 64 * MiB, 32 * MiB)
            os.environ["VPAGER_SIM_SHARED"] = self.shared
            os.environ["VPAGER_SIM_CAPACITY"] = str(self.capacity)
            os.environ["VPAGER_BACKEND"] = "sim"     # the drop-in's device
            opts.update(backend="sim", sim_streams="worker",
                        sim_granularity=sz.granularity,
                        sim_capacity=self.capacity, sim_shared=self.shared)
        self.dev = dev = vp.Device(**opts)
        self.headroom0 = dev.info()["headroom"]
        self.vbar = dev.create_vbar(self.vbar_size)
        self.hb = dev.alloc_hostbuf(self.vbar_size)
        host = self.view(self.hb.ptr, torch.uint8, (self.vbar_size,), "cpu")
        g = torch.Generator().manual_seed(self.args.seed)
        step = 64 * MiB
        for a in range(0, self.vbar_size, step):
            host[a:a + step].random_(0, 256, generator=g)
        self.host = host                        # same offsets as the VBAR
        srcs = [vp.Source.from_host(self.hb.view(o, s))
                for o, s in zip(offsets, sizes)]
        self.weights = self.vbar.create_weights(offsets, sizes, srcs)
        self.check = Checksum(torch, self.tdev, sizes + list(sz.compat_sizes))
        # The reference: every weight's checksum from an all-resident copy.
        t0 = time.perf_counter()
        ref = host.to(self.tdev) if self.cuda else host.clone()
        sums = torch.stack([self.check(ref[o:o + s])
                            for o, s in zip(offsets, sizes)]).cpu()
        self.ref = [tuple(x) for x in sums.tolist()]
        if self.cuda and not torch.equal(ref.cpu(), host):
            self.error("the all-resident reference copy differs from the "
                       "host bytes (torch copy, not vpager)")
        del ref, sums
        if self.cuda:
            torch.cuda.empty_cache()
        self.ref_s = time.perf_counter() - t0

    def build_compat(self):
        """The drop-in's models: ModelVBARs on comfy_aimdo's device, their
        allocations, host bytes and reference checksums."""
        torch, sz = self.torch, self.sz
        from comfy_aimdo import control, model_vbar
        from comfy_aimdo import torch as aimdo_torch
        self.control, self.mv, self.at = control, model_vbar, aimdo_torch
        if not control.init():
            raise RuntimeError("comfy_aimdo: init() failed")
        if not control.init_device(self.index):
            raise RuntimeError("comfy_aimdo: init_device(%d) failed"
                               % self.index)
        self.cdev = control.get_devctx(self.index)
        page = control.PAGE_SIZE
        rng = random.Random(self.args.seed + 7)
        for k, npages in enumerate(sz.compat_pages):
            vb = model_vbar.ModelVBAR(npages * page, self.index)
            allocs = []
            while True:
                try:
                    allocs.append(vb.alloc(rng.choice(sz.compat_sizes)))
                except MemoryError:
                    break
            host = torch.empty(vb.offset, dtype=torch.uint8,
                               pin_memory=self.cuda)
            host.random_(0, 256, generator=torch.Generator().manual_seed(
                self.args.seed + 11 + k))
            offs = [a[1] - vb.base for a in allocs]
            ref = host.to(self.tdev) if self.cuda else host.clone()
            sums = torch.stack([self.check(ref[o:o + a[2]])
                                for o, a in zip(offs, allocs)]).cpu()
            self.cmodels.append(dict(
                name="AB"[k], vb=vb, allocs=allocs, offs=offs,
                hosts=[host[o:o + a[2]] for o, a in zip(offs, allocs)],
                ref=[tuple(x) for x in sums.tolist()],
                views=[None] * len(allocs), last=[None] * len(allocs)))
            del ref, sums
        self.compat_bytes = sum(a[2] for m in self.cmodels
                                for a in m["allocs"])
        if self.cuda:
            torch.cuda.empty_cache()
        self.ctotal = self.cdev.info()["total_memory"]

    def budgets(self):
        """The ranges the budget thread draws from."""
        sz, dev = self.sz, self.dev
        page = sz.page
        self.min_need = sz.staging + roundup(self.maxw, page) + 2 * page
        self.max_limit = sz.staging + roundup(int(self.model_bytes * 1.15),
                                              page)
        info = dev.info()
        self.base = info["free_memory"] + info["committed"]
        cpage = self.control.PAGE_SIZE
        if self.cuda:
            slack = (1 * GiB + self.args.threads * 6 * self.maxw
                     + 6 * max(sz.compat_sizes))
        else:
            slack = 0
        self.reserve = sz.hog[1] + sz.compat_budget[1] * cpage + slack
        room = self.base - self.reserve
        if room < self.max_limit:
            self.note("device room %s after the others' share %s is under "
                      "the largest budget %s: the headroom binds less" % (
                          fmt_mib(self.base), fmt_mib(self.reserve),
                          fmt_mib(self.max_limit)))

    # ------------------------------------------------------------ streams
    def new_stream(self):
        """(torch stream or None, the vpager stream value)."""
        if self.cuda:
            s = self.torch.cuda.Stream(device=self.tdev)
            return s, s.cuda_stream
        return None, self.dev.create_stream()

    def sync(self, ts, vs):
        if self.cuda:
            ts.synchronize()
        else:
            self.dev.synchronize(vs)

    def pick_run(self, rng):
        start = rng.randrange(self.n)
        length = min(rng.randint(1, self.sz.run_len), self.n - start)
        while length > 1 and sum(self.sizes[start:start + length]) > \
                self.sz.run_cap:
            length -= 1
        return start, length

    # ----------------------------------------------- one streamed iteration
    def issue(self, st, batches, start, length, ts, vs, rng):
        """Acquire a run, queue the kernels reading it, release it. Returns
        the record to check after the stream is synchronized, or None."""
        torch, vp, view = self.torch, self.vp, self.view
        key = (start, length)
        b = batches.get(key)
        if b is None:
            b = batches[key] = self.weights.batch(range(start,
                                                        start + length))
        try:
            b.acquire(vs)
        except vp.LimitError as e:
            # The ring is shared by every thread; a refusal must leave
            # nothing acquired on this stream.
            st["ring_refusals"] += 1
            try:
                b.release(vs)
                self.error("weights %d..%d: vp_acquire refused (%s) but a "
                           "release on the same stream then succeeded"
                           % (start, start + length - 1, e))
            except vp.NotPinnedError:
                pass
            return None
        ptrs = list(b.ptrs)
        flags = list(b.flags)
        st["iterations"] += 1
        st["weights"] += length
        base = self.vbar_base
        for k in range(length):
            i, f, p = start + k, flags[k], ptrs[k]
            where = f & (vp.ACQUIRED_RESIDENT | vp.ACQUIRED_STAGED)
            if where == vp.ACQUIRED_RESIDENT:
                st["in_place"] += 1
                if p != base + self.offsets[i]:
                    self.error("weight %d: resident at 0x%x, not its VBAR "
                               "address 0x%x" % (i, p, base + self.offsets[i]))
            elif where == vp.ACQUIRED_STAGED:
                st["staged"] += 1
                if base <= p < base + self.vbar_size:
                    self.error("weight %d: staged at 0x%x, inside the "
                               "model's VBAR" % (i, p))
            else:
                self.error("weight %d: acquire flags %s" % (i, flag_names(f)))
            if f & vp.ACQUIRED_COPIED:
                st["copied"] += 1
        clone_k = rng.randrange(length) if rng.random() < \
            self.sz.clone_rate else None
        delay = rng.random() < self.sz.sleep_rate
        sizes = [self.sizes[start + k] for k in range(length)]
        rec = dict(start=start, ptrs=ptrs, flags=flags, clone_k=clone_k)
        if self.cuda:
            with torch.cuda.stream(ts):
                if delay:
                    torch.cuda._sleep(rng.randint(1, self.sz.sleep_cycles))
                outs = [self.check(view(p, torch.uint8, (s,), self.tdev))
                        for p, s in zip(ptrs, sizes)]
                rec["sums"] = torch.stack(outs)
                if clone_k is not None:
                    rec["clone"] = view(ptrs[clone_k], torch.uint8,
                                        (sizes[clone_k],), self.tdev).clone()
        else:
            pause = rng.uniform(0, self.sz.sleep_s) if delay else 0

            def kernel():           # runs on the stream's worker thread
                try:
                    if pause:
                        time.sleep(pause)
                    rec["sums"] = [tuple(self.check(view(
                        p, torch.uint8, (s,), "cpu")).tolist())
                        for p, s in zip(ptrs, sizes)]
                    if clone_k is not None:
                        rec["clone"] = view(ptrs[clone_k], torch.uint8,
                                            (sizes[clone_k],), "cpu").clone()
                except Exception as e:  # noqa: BLE001
                    rec["kernel_error"] = "%s: %s" % (type(e).__name__, e)
            self.dev.sim_launch(kernel, vs)
        b.release(vs)
        return rec

    def verify(self, st, recs, ts, who):
        """After the stream is synchronized: every checksum and copy of the
        records against the reference."""
        torch = self.torch
        for rec in recs:
            start = rec["start"]
            if "kernel_error" in rec:
                self.error("%s: kernel on weights from %d raised %s"
                           % (who, start, rec["kernel_error"]))
                continue
            sums = rec.get("sums")
            if sums is None:
                self.error("%s: the kernel on weights from %d never ran "
                           "before the stream was synchronized" % (who, start))
                continue
            if self.cuda:
                with torch.cuda.stream(ts):
                    sums = [tuple(x) for x in sums.cpu().tolist()]
            for k, got in enumerate(sums):
                i = start + k
                st["checks"] += 1
                st["bytes_checked"] += self.sizes[i]
                if got != self.ref[i]:
                    self.error(
                        "%s: weight %d (offset %d, %d bytes), acquired %s at "
                        "0x%x: checksum %s, all-resident %s" % (
                            who, i, self.offsets[i], self.sizes[i],
                            flag_names(rec["flags"][k]), rec["ptrs"][k], got,
                            self.ref[i]))
            k = rec["clone_k"]
            if k is not None:
                i = start + k
                o, s = self.offsets[i], self.sizes[i]
                got = rec["clone"].cpu()
                st["clones"] += 1
                if not torch.equal(got, self.host[o:o + s]):
                    bad = (got != self.host[o:o + s]).nonzero()
                    self.error("%s: weight %d (%d bytes), acquired %s: its "
                               "copy differs from the host bytes at %d bytes "
                               "(first at %d)" % (
                                   who, i, s, flag_names(rec["flags"][k]),
                                   bad.numel(), int(bad[0])))

    def new_tstats(self):
        return dict(iterations=0, weights=0, checks=0, clones=0,
                    bytes_checked=0, in_place=0, staged=0, copied=0,
                    ring_refusals=0, syncs=0)

    def stream_thread(self, tid):
        st = self.new_tstats()
        self.tstats.append(st)
        rng = random.Random(self.args.seed * 1000 + tid)
        ts, vs = self.new_stream()
        batches = {}
        who = "stream thread %d" % tid
        try:
            while not self.stop.is_set():
                recs = []
                for _ in range(rng.randint(1, self.sz.depth)):
                    start, length = self.pick_run(rng)
                    rec = self.issue(st, batches, start, length, ts, vs, rng)
                    if rec is not None:
                        recs.append(rec)
                self.sync(ts, vs)
                st["syncs"] += 1
                self.verify(st, recs, ts, who)
        except Exception:  # noqa: BLE001
            self.error("%s died:\n%s" % (who, traceback.format_exc()))
            self.stop.set()
        finally:
            try:
                self.sync(ts, vs)
                if not self.cuda:
                    self.dev.destroy_stream(vs)
            except Exception as e:  # noqa: BLE001
                self.error("%s: closing its stream: %s" % (who, e))

    # -------------------------------------------------------- full passes
    def full_pass(self, name, passes=1):
        """Every weight once, in order, in runs, verified (no budget)."""
        ts, vs = self.new_stream()
        st = self.new_tstats()
        rng = random.Random(self.args.seed + 3)
        batches = {}
        for _ in range(passes):
            i = 0
            while i < self.n:
                length = 1
                while (i + length < self.n and length < self.sz.run_len
                       and sum(self.sizes[i:i + length + 1])
                       <= self.sz.run_cap):
                    length += 1
                rec = self.issue(st, batches, i, length, ts, vs, rng)
                self.sync(ts, vs)
                if rec is not None:
                    self.verify(st, [rec], ts, name)
                i += length
        if not self.cuda:
            self.dev.destroy_stream(vs)
        self.passes[name] = st
        return st

    # ------------------------------------------------------------ drop-in
    def compat_thread(self):
        """ComfyUI's cycle, a model at a time (the models alternate, so
        pressure evicts the other's pages): prioritize, then per allocation
        vbar_fault, compare the signature with the one of the last copy,
        copy from the host when it differs, use (a checksum), vbar_unpin on
        the stream; after the pass, every checksum against the reference."""
        torch, mv = self.torch, self.mv
        c = dict(passes=0, faults=0, reuse=0, copies=0, misses=0, checks=0,
                 bytes_checked=0)
        self.compat = c
        rng = random.Random(self.args.seed + 5)
        if self.cuda:
            cs = torch.cuda.Stream(device=self.tdev)
            vs = cs.cuda_stream
            tdev = "cuda:%d" % self.index
        else:
            cs, vs, tdev = None, 0, "cpu"
        m = self.cmodels[0]
        try:
            while not self.stop.is_set():
                if rng.random() < 0.6:
                    m = self.cmodels[(self.cmodels.index(m) + 1)
                                     % len(self.cmodels)]
                if c["passes"] < 2 or rng.random() < 0.8:
                    m["vb"].prioritize()        # "the model is loaded"
                allocs, views, last = m["allocs"], m["views"], m["last"]
                order = list(range(len(allocs)))
                if rng.random() < 0.3:
                    k = rng.randint(1, len(order))
                    s0 = rng.randrange(len(order) - k + 1)
                    order = order[s0:s0 + k]
                outs = []
                for i in order:
                    a = allocs[i]
                    sig = mv.vbar_fault(a)
                    c["faults"] += 1
                    if sig is None:
                        c["misses"] += 1    # ComfyUI uses the host copy
                        continue
                    t = views[i]
                    if t is None:
                        t = views[i] = self.at.aimdo_to_tensor(a, tdev)
                    same = mv.vbar_signature_compare(sig, last[i])
                    if self.cuda:
                        with torch.cuda.stream(cs):
                            if not same:
                                t.copy_(m["hosts"][i], non_blocking=True)
                            out = self.check(t)
                    else:
                        if not same:
                            t.copy_(m["hosts"][i])
                        out = self.check(t)
                    if same:
                        c["reuse"] += 1
                    else:
                        c["copies"] += 1
                        last[i] = sig
                    mv.vbar_unpin(a, vs)
                    outs.append((i, out, same, sig))
                if self.cuda:
                    cs.synchronize()
                for i, out, same, sig in outs:
                    got = tuple(out.cpu().tolist())
                    c["checks"] += 1
                    c["bytes_checked"] += allocs[i][2]
                    if got != m["ref"][i]:
                        self.error(
                            "drop-in: model %s allocation %d (offset %d, %d "
                            "bytes), %s (signature %s): checksum %s, "
                            "all-resident %s" % (
                                m["name"], i, m["offs"][i], allocs[i][2],
                                "reused: the signature was unchanged" if same
                                else "copied after the fault", list(sig), got,
                                m["ref"][i]))
                        last[i] = None
                c["passes"] += 1
        except Exception:  # noqa: BLE001
            self.error("drop-in thread died:\n%s" % traceback.format_exc())
            self.stop.set()

    # ------------------------------------------------------------- budget
    def chaos_thread(self):
        dev, vb, sz = self.dev, self.vbar, self.sz
        rng = random.Random(self.args.seed + 9)
        cpage = self.control.PAGE_SIZE
        ch = dict(steps=0, limits=0, headrooms=0, compat_budgets=0,
                  prioritize=0, deprioritize=0, free_memory=0,
                  freed_bytes=0, lookahead=0, compat_free=0,
                  compat_freed=0, compat_deprioritize=0, limit_min=None,
                  limit_max=None, room_min=None, room_max=None,
                  compat_min=None, compat_max=None)
        self.chaos = ch

        def span(lo, hi, v):
            ch[lo] = v if ch[lo] is None else min(ch[lo], v)
            ch[hi] = v if ch[hi] is None else max(ch[hi], v)
        next_compat = time.perf_counter() + 1.0
        try:
            while not self.stop.wait(rng.uniform(0.0005, 0.008)):
                ch["steps"] += 1
                r = rng.random()
                if r < 0.40:
                    lim = rng.randint(self.min_need, self.max_limit)
                    dev.set_limit(lim)
                    ch["limits"] += 1
                    span("limit_min", "limit_max", lim)
                elif r < 0.65:
                    room = rng.randint(self.min_need, self.max_limit)
                    h = max(0, self.base - self.reserve - room)
                    dev.set_headroom(h)
                    ch["headrooms"] += 1
                    span("room_min", "room_max", room)
                elif r < 0.80:
                    pages = rng.randint(*sz.compat_budget)
                    self.control.set_simple_vram_headroom(
                        max(self.ctotal - pages * cpage, 0))
                    ch["compat_budgets"] += 1
                    span("compat_min", "compat_max", pages * cpage)
                elif r < 0.84:
                    vb.prioritize()
                    ch["prioritize"] += 1
                elif r < 0.86:
                    vb.deprioritize()
                    ch["deprioritize"] += 1
                elif r < 0.88:
                    ch["freed_bytes"] += dev.free_memory(
                        rng.randint(0, self.max_limit))
                    ch["free_memory"] += 1
                elif not self.args.no_prefetch:
                    dev.set_lookahead(rng.choice(
                        (0, sz.page, sz.staging // 4, sz.staging)))
                    ch["lookahead"] += 1
                # Now and then another model wants the drop-in's memory.
                now = time.perf_counter()
                if now >= next_compat:
                    next_compat = now + rng.uniform(0.1, 2.0)
                    cvb = rng.choice(self.cmodels)["vb"]
                    if rng.random() < 0.7:
                        ch["compat_freed"] += cvb.free_memory(
                            rng.randint(1, cvb.size))
                        ch["compat_free"] += 1
                    else:
                        cvb.deprioritize()
                        ch["compat_deprioritize"] += 1
        except Exception:  # noqa: BLE001
            self.error("budget thread died:\n%s" % traceback.format_exc())
            self.stop.set()

    # ---------------------------------------------------------- the hog
    def start_hog(self):
        sz = self.sz
        conf = dict(seed=self.args.seed + 13, range=sz.hog, cuda=self.cuda,
                    index=self.index, parent=os.getpid())
        if not self.cuda:
            conf.update(page=sz.page, granularity=sz.granularity,
                        capacity=self.capacity, shared=self.shared)
        ctx = mp.get_context("spawn")
        self.hog_stop = ctx.Event()
        self.hog_q = ctx.Queue()
        self.hog_proc = ctx.Process(target=hog_main, args=(
            conf, self.hog_stop, self.hog_q), daemon=True)
        self.hog_proc.start()

    def stop_hog(self):
        if self.hog_proc is None:
            return
        self.hog_stop.set()
        try:
            self.hog = self.hog_q.get(timeout=120)
        except Exception as e:  # noqa: BLE001
            self.hog = dict(error="no result (%s)" % type(e).__name__)
        self.hog_proc.join(30)
        if self.hog_proc.is_alive():
            self.hog_proc.terminate()
            self.hog_proc.join(10)
        self.hog_proc = None
        if self.hog.get("error"):
            self.note("memory process: %s" % self.hog["error"])

    # ---------------------------------------------------------------- run
    def progress(self, t0):
        s = self.dev.stats()
        it = sum(t["iterations"] for t in self.tstats)
        say("  %5.0f s: %d iterations, %d acquires, %d pages evicted, %d "
            "weights staged, drop-in %d passes, %d errors" % (
                time.perf_counter() - t0, it, s["acquires"],
                s["pages_evicted"], s["weight_staged"],
                self.compat.get("passes", 0), len(self.errors)))

    def run(self):
        args, sz = self.args, self.sz
        torch = self.torch
        t_setup = time.perf_counter()
        self.build_model()
        self.vbar_base = self.vbar.base
        self.build_compat()
        self.budgets()
        if self.cuda:
            torch.cuda.synchronize()
        say("inputs: %s; %d weights, %s (%s to %s each), VBAR %s in %s pages"
            % (self.dev.backend, self.n, fmt_mib(self.model_bytes),
               fmt_mib(min(self.sizes)), fmt_mib(self.maxw),
               fmt_mib(self.vbar_size), fmt_mib(sz.page)))
        say("        staging ring %s, lookahead %s; budget (vp_device_set_"
            "limit and headroom room) %s to %s: model %.2fx to %.2fx of "
            "what is left past the ring" % (
                fmt_mib(sz.staging), fmt_mib(self.lookahead),
                fmt_mib(self.min_need), fmt_mib(self.max_limit),
                (self.min_need - sz.staging) / self.model_bytes,
                (self.max_limit - sz.staging) / self.model_bytes))
        say("        %d threads, runs of up to %d weights / %s, 1-%d "
            "iterations per sync; %d s; seed %d" % (
                args.threads, sz.run_len, fmt_mib(sz.run_cap), sz.depth,
                args.seconds, args.seed))
        say("        drop-in: %d allocations, %s in ModelVBARs of %s pages "
            "(32 MiB), budget %d-%d pages; memory process: %s to %s" % (
                sum(len(m["allocs"]) for m in self.cmodels),
                fmt_mib(self.compat_bytes),
                " and ".join(str(p) for p in sz.compat_pages),
                sz.compat_budget[0], sz.compat_budget[1],
                fmt_mib(sz.hog[0]), fmt_mib(sz.hog[1])))
        if not self.cuda:
            say("        (on the simulated device a page vpager evicted is "
                "unmapped: a kernel reading one dies of SIGSEGV, and the "
                "stacks above the crash say which thread read what)")
        first = self.full_pass("first pass")
        say("first pass (no budget): %d weights checked, reference %.1f s, "
            "setup %.1f s" % (first["checks"], self.ref_s,
                              time.perf_counter() - t_setup))

        s0 = self.dev.stats()
        c0 = self.cdev.stats()
        if not args.no_hog:
            self.start_hog()
        workers = [threading.Thread(target=self.stream_thread, args=(i,),
                                    name="stream%d" % i, daemon=True)
                   for i in range(args.threads)]
        workers.append(threading.Thread(target=self.compat_thread,
                                        name="compat", daemon=True))
        workers.append(threading.Thread(target=self.chaos_thread,
                                        name="budget", daemon=True))
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        every = max(5.0, min(30.0, args.seconds / 10))
        deadline = t0 + args.seconds
        while not self.stop.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            if self.stop.wait(min(every, left)):
                break
            self.progress(t0)
        self.stop.set()
        hung = []
        stop_by = time.perf_counter() + 120
        for w in workers:
            w.join(max(0.0, stop_by - time.perf_counter()))
            if w.is_alive():
                hung.append(w.name)
        self.soak_s = time.perf_counter() - t0
        if hung:
            self.error("threads still running 120 s after the stop (a hang):"
                       " %s" % ", ".join(hung))
        if not args.no_hog:
            self.stop_hog()
        s1 = self.dev.stats()
        c1 = self.cdev.stats()
        self.delta = bl.stats_delta(s0, s1)
        self.cdelta = bl.stats_delta(c0, c1)
        if hung:
            return False
        # No budget, the default headroom: everything again.
        self.dev.set_limit(NO_LIMIT)
        self.dev.set_headroom(self.headroom0)
        self.vbar.prioritize()
        self.full_pass("last pass", passes=2)
        self.finish()
        return True

    def finish(self):
        """No pin left behind; close everything."""
        vp = self.vp
        if self.cuda:
            self.torch.cuda.synchronize()
        pinned = [i for i, f in enumerate(self.vbar.residency())
                  if f & vp.PAGE_PINNED]
        if pinned:
            self.error("%d pages of the model's VBAR still pinned after every "
                       "release (first: page %d)" % (len(pinned), pinned[0]))
        for m in self.cmodels:
            cp = [i for i, f in enumerate(m["vb"].get_residency()) if f & 2]
            if cp:
                self.error("%d pages of the drop-in's model %s still pinned "
                           "after every unpin" % (len(cp), m["name"]))
        self.final_stats = self.dev.stats()
        try:
            self.weights.close()
            self.vbar.close()
            self.hb.close()
            self.dev.close()
        except Exception as e:  # noqa: BLE001
            self.error("closing the device: %s: %s" % (type(e).__name__, e))
        try:
            self.control.deinit()
        except Exception as e:  # noqa: BLE001
            self.error("comfy_aimdo deinit: %s: %s" % (type(e).__name__, e))

    # ------------------------------------------------------------ summary
    def summary(self, completed):
        args, sz = self.args, self.sz
        tot = self.new_tstats()
        for t in self.tstats:
            for k in tot:
                tot[k] += t[k]
        d = getattr(self, "delta", {})
        cd = getattr(self, "cdelta", {})
        secs = getattr(self, "soak_s", 0.0)
        say("")
        say("== soak summary ==")
        for ln in bl.machine_lines(self.cuda, extras=["mode %s" % self.mode]):
            say(ln)
        say("inputs: %d weights, %s (largest %s), ring %s, pages %s; budget "
            "%s to %s; %d stream threads + drop-in + budget thread%s; %.0f s"
            % (self.n, fmt_mib(self.model_bytes), fmt_mib(self.maxw),
               fmt_mib(sz.staging), fmt_mib(sz.page), fmt_mib(self.min_need),
               fmt_mib(self.max_limit), args.threads,
               "" if args.no_hog else " + memory process", secs))
        say("streams: %d iterations (%.0f/s), %d weights acquired (%d in "
            "place, %d staged, %d copied), %d checksums over %s, %d full "
            "copies compared, %d ring refusals (VP_ELIMIT)" % (
                tot["iterations"], tot["iterations"] / max(secs, 1e-9),
                tot["weights"], tot["in_place"], tot["staged"],
                tot["copied"], tot["checks"], fmt_mib(tot["bytes_checked"]),
                tot["clones"], tot["ring_refusals"]))
        say("device: %s" % ", ".join("%s %d" % (k, d.get(k, 0))
                                     for k in STREAM_STATS))
        c = self.compat
        say("drop-in: %d passes, %d faults: %d reused, %d copied, %d missed; "
            "%d checksums over %s; device: %s" % (
                c.get("passes", 0), c.get("faults", 0), c.get("reuse", 0),
                c.get("copies", 0), c.get("misses", 0), c.get("checks", 0),
                fmt_mib(c.get("bytes_checked", 0)),
                ", ".join("%s %d" % (k, cd.get(k, 0)) for k in COMPAT_STATS)))
        ch = self.chaos
        if ch:
            say("budget: %d changes: %d limits (%s to %s), %d headrooms (room "
                "%s to %s), %d drop-in budgets, %d prioritize, %d "
                "deprioritize, %d free_memory (%s freed), %d lookahead; "
                "drop-in: %d free_memory (%s freed), %d deprioritize" % (
                    ch["steps"], ch["limits"], fmt_mib(ch["limit_min"] or 0),
                    fmt_mib(ch["limit_max"] or 0), ch["headrooms"],
                    fmt_mib(ch["room_min"] or 0), fmt_mib(ch["room_max"] or 0),
                    ch["compat_budgets"], ch["prioritize"],
                    ch["deprioritize"], ch["free_memory"],
                    fmt_mib(ch["freed_bytes"]), ch["lookahead"],
                    ch["compat_free"], fmt_mib(ch["compat_freed"]),
                    ch["compat_deprioritize"]))
        h = self.hog
        if args.no_hog:
            say("memory process: not run (--no-hog)")
        else:
            say("memory process: %d allocations (%s in all, largest %s), %d "
                "refused%s" % (h.get("allocs", 0), fmt_mib(h.get("bytes", 0)),
                               fmt_mib(h.get("max_bytes", 0)),
                               h.get("fails", 0),
                               ", error: %s" % h["error"] if h.get("error")
                               else ""))
        for name, p in self.passes.items():
            say("%s: %d weights checked (%d in place, %d staged)" % (
                name, p["checks"], p["in_place"], p["staged"]))
        ok = completed and not self.errors
        say("errors: %d%s" % (len(self.errors), "" if completed else
                              " (did not complete)"))
        say("soak: %s (%.0f s in all)" % ("PASS" if ok else "FAIL",
                                          bl.elapsed()))
        results = dict(
            date=bl.utc_now(), mode=self.mode,
            machine=bl.machine_lines(self.cuda),
            inputs=dict(weights=self.n, bytes=self.model_bytes,
                        largest=self.maxw, page=sz.page, staging=sz.staging,
                        budget_min=self.min_need, budget_max=self.max_limit,
                        threads=args.threads, seconds=args.seconds,
                        seed=args.seed, prefetch=not args.no_prefetch,
                        lookahead=self.lookahead, compat_allocs=sum(
                            len(m["allocs"]) for m in self.cmodels),
                        compat_bytes=self.compat_bytes, hog=list(sz.hog),
                        hog_run=not args.no_hog),
            soak_seconds=secs, streams=tot, per_thread=self.tstats,
            device=d, compat=dict(self.compat, device=cd), budget=self.chaos,
            hog=self.hog, passes=self.passes,
            errors=len(self.errors), error_messages=self.errors[:50],
            notes=self.notes, passed=ok)
        path = bl.write_json("soak.json", results)
        if path:
            say("wrote %s" % path)
        return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=int, default=300,
                    help="how long the soak runs (default 300)")
    ap.add_argument("--threads", type=int, default=4,
                    help="host threads, one stream each (default 4)")
    ap.add_argument("--small", action="store_true",
                    help="small sizes on the GPU too (compute-sanitizer)")
    ap.add_argument("--dry-run", action="store_true",
                    help="small sizes on the simulated device, CPU tensors")
    ap.add_argument("--weights", type=int, default=0,
                    help="number of weights (default: random in the mode's "
                    "range)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-hog", action="store_true",
                    help="no process allocating device memory")
    ap.add_argument("--no-prefetch", action="store_true",
                    help="lookahead 0 throughout (no prefetch)")
    args = ap.parse_args()
    faulthandler.enable()       # a crash prints every thread's stack
    if args.threads < 1 or args.seconds < 1:
        ap.error("--threads and --seconds must be at least 1")
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        say("soak: torch has no CUDA here; use --dry-run for the simulated "
            "device")
        return 2
    soak = Soak(args)
    completed = False
    try:
        completed = soak.run()
    except Exception:  # noqa: BLE001
        soak.error("soak setup or teardown failed:\n%s"
                   % traceback.format_exc())
        soak.stop.set()
        try:
            soak.stop_hog()
        except Exception as e:  # noqa: BLE001
            say("stopping the memory process: %s" % e)
    try:
        ok = soak.summary(completed)
    except Exception:  # noqa: BLE001
        say("summary failed:\n%s" % traceback.format_exc())
        ok = False
    if not completed:
        sys.stdout.flush()
        os._exit(1)             # threads may still hold the device
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
