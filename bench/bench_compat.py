#!/usr/bin/env python3
"""The ComfyUI per-weight cycle through comfy_aimdo on vpager (issue 6, GPU
bullet): 96 bf16 8192x8192 layers (128 MiB each, 12 GiB) with a budget of
weights / 1.5 set through set_simple_vram_headroom, forward = x @ W per
layer, at a copy-bound batch (16) and at 4096; ms per forward and a bitwise
check of the output against all weights resident.

Driven as ComfyUI drives comfy_aimdo (python/compat): control.init(), then
init_devices([0]); set_simple_vram_headroom(total - budget); one ModelVBAR
for the stack with one alloc() per layer, prioritize() once (model load);
host copies of the weights in pinned memory (torch pinned tensors). Per
forward, for each layer:

    sig = vbar_fault(alloc)
    if sig is None:                       # miss: the application copies
        buf.copy_(host[i]); W = buf       #   into a reusable device buffer
    else:                                 #   on the compute stream
        W = aimdo_to_tensor(alloc) as (8192, 8192) bf16
        if not vbar_signature_compare(sig, last_sig[i]):
            W.copy_(host[i]); last_sig[i] = sig          # refilled: copy
        ...                                              # else: a hit
    x = x @ W
    vbar_unpin(alloc)                     # (only when the fault pinned)

Baselines in the same run: all weights resident (plain torch tensors), the
link bandwidth (pinned 128 MiB host->device copies, the same tensors the
miss path copies), and streamed bytes / link (the copies' floor). Reports
ms per forward (median of N after warm-up; CUDA events between back-to-back
forwards), hits / copies / misses per forward, vpager's device counters per
forward (pages committed / evicted, faults, misses) and the per-layer
residency after the run; the first (cold) forward apart.

    make -j16 && PYTHONUNBUFFERED=1 PYTHONPATH=python:python/compat \
        python3 bench/bench_compat.py | tee $OUT/bench_compat.log
    PYTHONPATH=python:python/compat /usr/bin/python3 bench/bench_compat.py \
        --dry-run

--dry-run: CPU tensors and vpager's simulated device (VPAGER_BACKEND=sim,
VPAGER_SIM_CAPACITY 1G unless set), 12 layers of 4096x4096 fp32 (64 MiB:
two of comfy_aimdo's 32 MiB pages per layer, as on the GPU each layer is
whole pages), batches 2 and 8 (CPU matmuls are slow); checks the
script, not speed. Every
section catches and prints its own errors. Writes $OUT/bench_compat.json
when OUT is set. Needs torch (2.x with CUDA on the GPU; Debian's 1.13 is
enough for --dry-run) and build/libvpager.so.
"""

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "python", "compat"),
           os.path.join(ROOT, "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import benchlib  # noqa: E402
from benchlib import GB, GiB, MiB, Ctx, elapsed, med, say  # noqa: E402

RESULTS = {}

torch = None          # imported in main() (after the environment is set)


def fail(what):
    traceback.print_exc(file=sys.stdout)
    say("   %s: FAILED" % what)
    RESULTS.setdefault("errors", []).append(
        "%s: %s" % (what, traceback.format_exc().strip().splitlines()[-1]))


# ------------------------------------------------------------- settings

class Cfg:
    def __init__(self, args):
        self.dry = args.dry_run
        if self.dry:
            self.layers, self.dim, self.batches = 12, 4096, [2, 8]
            self.warmup, self.iters = 1, 3
        else:
            self.layers, self.dim, self.batches = 96, 8192, [16, 4096]
            self.warmup, self.iters = 3, 15
        if args.layers:
            self.layers = args.layers
        if args.dim:
            self.dim = args.dim
        if args.batches:
            self.batches = [int(b) for b in args.batches.split(",") if b]
        if args.iters:
            self.iters = max(1, args.iters)
        if args.warmup is not None:
            self.warmup = max(0, args.warmup)
        self.budget_div = args.budget_div
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.esize = torch.empty((), dtype=self.dtype).element_size()
        self.layer_bytes = self.dim * self.dim * self.esize
        self.weight_bytes = self.layers * self.layer_bytes
        self.budget = int(self.weight_bytes / self.budget_div)


# ------------------------------------------------------------- machine

def machine_info(ctx):
    import comfy_aimdo
    for ln in benchlib.machine_lines(
            ctx.cuda, extras=["comfy_aimdo %s from %s" % (
                comfy_aimdo.__version__,
                os.path.dirname(comfy_aimdo.__file__))],
            dirs=benchlib.SOURCE_DIRS + (
                os.path.join("python", "compat", "comfy_aimdo"),)):
        say(ln)


# ------------------------------------------------------------- weights

class Stack:
    """The layers: host copies (pinned on CUDA), and while the resident
    baseline runs, device copies."""

    def __init__(self, ctx, cfg):
        self.host = []
        self.dev = []
        d, L = cfg.dim, cfg.layers
        scale = d ** -0.5          # keeps |x| about constant layer to layer
        t0 = time.perf_counter()
        if ctx.cuda:
            g = torch.Generator(device=ctx.device).manual_seed(1)
            for i in range(L):
                w = torch.randn(d, d, device=ctx.device, dtype=torch.float32,
                                generator=g).mul_(scale).to(cfg.dtype)
                self.dev.append(w)
            ctx.sync()
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            for w in self.dev:
                # one pinned tensor per layer: torch's pinned allocator
                # rounds each allocation up to a power of two (128 MiB is)
                h = torch.empty(d, d, dtype=cfg.dtype, pin_memory=True)
                h.copy_(w, non_blocking=True)
                self.host.append(h)
            ctx.sync()
            t_pin = time.perf_counter() - t0
            pinned = all(h.is_pinned() for h in self.host)
        else:
            g = torch.Generator().manual_seed(1)
            a = (3.0 ** 0.5) * scale        # uniform: same variance, faster
            for i in range(L):
                w = torch.empty(d, d, dtype=torch.float32).uniform_(
                    -a, a, generator=g)
                self.host.append(w.to(cfg.dtype))
                self.dev.append(self.host[-1].clone())
            t_gen, t_pin, pinned = time.perf_counter() - t0, 0.0, False
        say("weights: %d layers of %dx%d %s (%d MiB each), %.3f GiB; built "
            "in %.1f s, host copies %s in %.1f s" % (
                L, d, d, str(cfg.dtype).replace("torch.", ""),
                cfg.layer_bytes // MiB, cfg.weight_bytes / GiB, t_gen,
                "pinned (torch pin_memory, one tensor per layer)" if pinned
                else "pageable (CPU run)" if not ctx.cuda
                else "NOT all pinned", t_pin))

    def drop_device(self, ctx):
        self.dev = []
        ctx.empty_cache()


def measure_link(ctx, cfg, stack):
    """Pinned host->device copies of whole layers (the bytes the miss path
    and the refill path copy): 8 per round into one device buffer, 4 rounds,
    median."""
    k = min(8, cfg.layers)
    buf = torch.empty(cfg.dim, cfg.dim, dtype=cfg.dtype, device=ctx.device)

    def go():
        for i in range(k):
            buf.copy_(stack.host[i], non_blocking=True)
    go()
    ts, _ = ctx.series(go, 4)
    ctx.link = k * cfg.layer_bytes / (med(ts) / 1e3) / GB
    say("link (in-run baseline): %.2f GB/s, %s %d MiB host->device copies "
        "(torch copy_, non_blocking), median of 4 rounds of %d" % (
            ctx.link, "pinned" if ctx.cuda else "CPU memcpy (dry run: no "
            "link),", cfg.layer_bytes // MiB, k))
    RESULTS["link_GBps"] = ctx.link


def make_input(ctx, cfg, batch):
    g = torch.Generator().manual_seed(100 + batch)
    return torch.randn(batch, cfg.dim, generator=g).to(ctx.device, cfg.dtype)


# ------------------------------------------------------------ resident

def run_resident(ctx, cfg, stack, batch, x0):
    ws = stack.dev

    def fwd():
        x = x0
        for w in ws:
            x = x @ w
        return x
    with torch.no_grad():
        t_cold, y = ctx.once(fwd)
        for _ in range(cfg.warmup):
            fwd()
        box = []
        ts, wall = ctx.series(lambda: box.__setitem__(slice(None), [fwd()]),
                              cfg.iters)
    y_last = box[0]
    same = torch.equal(y, y_last)
    r = dict(cold_ms=t_cold, ms=med(ts), min_ms=min(ts), max_ms=max(ts),
             wall_ms=wall, times=ts)
    say("   resident: first forward %.2f ms; forwards %d..%d: %.3f ms median"
        " (min %.3f, max %.3f; wall %.3f a forward); repeat forwards %s; "
        "output %s" % (t_cold, cfg.warmup + 2, cfg.warmup + cfg.iters + 1,
                       r["ms"], r["min_ms"], r["max_ms"], wall,
                       "bitwise equal" if same else "DIFFER (nondeterministic"
                       " GEMM?)", describe(y_last)))
    return r, y_last


def describe(y):
    yf = y.float()
    finite = bool(torch.isfinite(yf).all())
    return "%s, rms %.4g%s" % (tuple(y.shape), yf.pow(2).mean().sqrt().item(),
                               "" if finite else ", NOT FINITE")


def compare(ref, y):
    if ref is None:
        return "no resident reference"
    if torch.equal(ref, y):
        return "bitwise EQUAL to all-resident"
    d = (ref.float() - y.float()).abs()
    return "DIFFER from all-resident (max |diff| %.4g, %d of %d elements)" % (
        d.max().item(), int((d != 0).sum().item()), d.numel())


# ------------------------------------------------------------- vpager

STAT_KEYS = ("faults", "hits", "fills", "misses", "watermark_misses",
             "budget_misses", "pages_committed", "pages_evicted",
             "evict_waits", "unpins")


class Compat:
    """The comfy_aimdo side: devices, the ModelVBAR, one alloc per layer,
    the cycle."""

    def __init__(self, ctx, cfg, stack):
        from comfy_aimdo import control, model_vbar
        from comfy_aimdo import torch as atorch
        self.control, self.mv, self.at = control, model_vbar, atorch
        self.ctx, self.cfg, self.stack = ctx, cfg, stack
        t0 = time.perf_counter()
        ok = control.init()
        say("   control.init() -> %s; init_devices([0]) -> %s (%.0f ms)" % (
            ok, control.init_devices([0]) if ok else "(skipped)",
            (time.perf_counter() - t0) * 1e3))
        if not ok:
            raise RuntimeError("comfy_aimdo.control.init() failed")
        self.dev = control.get_devctx(0)
        info = self.dev.info()
        total = info["total_memory"]
        self.headroom = total - cfg.budget
        tt = ""
        if ctx.cuda:
            tt = " (torch says total %.3f GiB)" % (
                torch.cuda.mem_get_info()[1] / GiB)
        control.set_simple_vram_headroom(self.headroom)
        info = self.dev.info()
        o = self.dev.options
        say("   vpager device: backend %s, page %d MiB, staging %d MiB, "
            "lookahead %d MiB; total %.3f GiB%s; set_simple_vram_headroom("
            "%.3f GiB) = total - budget %.3f GiB; device budget now %.3f "
            "GiB, headroom %.3f GiB, committed %.3f GiB" % (
                self.dev.backend, info["page_size"] // MiB,
                o.get("staging_size", 0) // MiB, o.get("lookahead", 0) // MiB,
                total / GiB, tt, self.headroom / GiB, cfg.budget / GiB,
                info["budget"] / GiB, info["headroom"] / GiB,
                info["committed"] / GiB))
        RESULTS["vpager_device"] = dict(
            backend=self.dev.backend, total=total, headroom_set=self.headroom,
            budget=cfg.budget, device_budget=info["budget"],
            page_size=info["page_size"])
        self.vbar = model_vbar.ModelVBAR(cfg.weight_bytes, 0)
        self.allocs = [self.vbar.alloc(cfg.layer_bytes)
                       for _ in range(cfg.layers)]
        self.vbar.prioritize()                  # the model is "loaded"
        self.page = info["page_size"]
        say("   ModelVBAR(%.3f GiB): %d pages, base 0x%x; %d allocs of %d "
            "MiB; prioritize() once" % (
                cfg.weight_bytes / GiB, self.vbar.get_nr_pages(),
                self.vbar.base, len(self.allocs), cfg.layer_bytes // MiB))
        self.views = [None] * cfg.layers        # made at the first hit
        self.last = [None] * cfg.layers         # signatures at the copy
        self.buf = torch.empty(cfg.dim, cfg.dim, dtype=cfg.dtype,
                               device=ctx.device)   # the miss path's buffer
        self.counts = dict(hit=0, copy=0, miss=0)
        if ctx.cuda:
            s = torch.cuda.current_stream().cuda_stream
            say("   compute stream: torch's current stream, cuda_stream=%#x"
                "%s" % (s, "" if s == 0 else "  WARNING: not the legacy "
                        "default stream: vbar_unpin(alloc) fences stream 0"))

    def view(self, i):
        """The layer's VBAR range as a (dim, dim) tensor. Made while the
        range is pinned (torch inspects the pointer), then reused: the
        address never changes."""
        t = self.views[i]
        if t is None:
            t = self.at.aimdo_to_tensor(self.allocs[i], self.ctx.device)
            t = t.view(self.cfg.dtype).view(self.cfg.dim, self.cfg.dim)
            self.views[i] = t
        return t

    def forward(self, x):
        fault, unpin = self.mv.vbar_fault, self.mv.vbar_unpin
        same = self.mv.vbar_signature_compare
        host, last, allocs, buf = self.stack.host, self.last, self.allocs, \
            self.buf
        c = self.counts
        for i in range(len(allocs)):
            a = allocs[i]
            sig = fault(a)
            if sig is None:
                buf.copy_(host[i], non_blocking=True)
                x = x @ buf
                c["miss"] += 1
                continue
            w = self.views[i]
            if w is None:
                w = self.view(i)
            if same(sig, last[i]):
                c["hit"] += 1
            else:
                w.copy_(host[i], non_blocking=True)
                last[i] = sig
                c["copy"] += 1
            x = x @ w
            unpin(a)
        return x

    def verify(self):
        """Every layer whose VBAR range is resident and unchanged since its
        copy (signature equal): its bytes against the host copy. Returns
        (checked, bad, skipped)."""
        fault, unpin = self.mv.vbar_fault, self.mv.vbar_unpin
        same = self.mv.vbar_signature_compare
        checked, bad, skipped = 0, [], 0
        for i, a in enumerate(self.allocs):
            sig = fault(a)
            if sig is None:
                skipped += 1
                continue
            try:
                if not same(sig, self.last[i]):
                    skipped += 1
                    continue
                w = self.view(i)
                h = self.stack.host[i].to(self.ctx.device)
                if not torch.equal(w.view(torch.uint8), h.view(torch.uint8)):
                    bad.append(i)
                checked += 1
                del h
                self.ctx.sync()
            finally:
                unpin(a)
        return checked, bad, skipped

    def stats(self):
        s = self.dev.stats()
        return {k: s[k] for k in STAT_KEYS}

    def residency(self):
        """Per layer: '#' all pages resident, '+' some, '.' none."""
        flags = self.vbar.get_residency()
        out = []
        for a in self.allocs:
            off = a[1] - self.vbar.base
            ps = range(off // self.page, (off + a[2] - 1) // self.page + 1)
            n = sum(1 for p in ps if flags[p] & 1)
            out.append("#" if n == len(ps) else "+" if n else ".")
        s = "".join(out)
        return " ".join(s[i:i + 32] for i in range(0, len(s), 32))


def run_vpager(ctx, cfg, cp, batch, x0, ref):
    L = cfg.layers
    res = {}
    with torch.no_grad():
        # first forward of this batch (the very first one fills the VBAR)
        c0, s0 = dict(cp.counts), cp.stats()
        t_cold, y_cold = ctx.once(lambda: cp.forward(x0))
        c1, s1 = dict(cp.counts), cp.stats()
        dc = {k: c1[k] - c0[k] for k in c1}
        ds = {k: s1[k] - s0[k] for k in s1}
        say("   vpager: first forward %.2f ms: hits %d, copies %d, misses %d;"
            " pages committed %d, evicted %d; output %s" % (
                t_cold, dc["hit"], dc["copy"], dc["miss"],
                ds["pages_committed"], ds["pages_evicted"],
                compare(ref, y_cold)))
        res["first"] = dict(ms=t_cold, counts=dc, stats=ds,
                            equal=ref is not None and torch.equal(ref, y_cold))
        del y_cold
        for _ in range(cfg.warmup):
            cp.forward(x0)
        ctx.sync()
        c0, s0 = dict(cp.counts), cp.stats()
        box = []
        ts, wall = ctx.series(
            lambda: box.__setitem__(slice(None), [cp.forward(x0)]), cfg.iters)
        c1, s1 = dict(cp.counts), cp.stats()
    n = cfg.iters
    dc = {k: (c1[k] - c0[k]) / n for k in c1}
    ds = {k: (s1[k] - s0[k]) / n for k in s1}
    streamed = (dc["copy"] + dc["miss"]) * cfg.layer_bytes
    link_ms = streamed / (ctx.link * GB) * 1e3 if ctx.link else float("nan")
    y = box[0]
    eq = ref is not None and torch.equal(ref, y)
    res.update(ms=med(ts), min_ms=min(ts), max_ms=max(ts), wall_ms=wall,
               times=ts, counts=dc, stats=ds, streamed_bytes=streamed,
               link_ms=link_ms, equal=eq)
    say("   vpager: forwards %d..%d: %.3f ms median (min %.3f, max %.3f; "
        "wall %.3f a forward)" % (
            cfg.warmup + 2, cfg.warmup + cfg.iters + 1, res["ms"],
            res["min_ms"], res["max_ms"], wall))
    say("   vpager: per forward: hits %.1f, copies %.1f, misses %.1f (of %d"
        " layers); streamed %.3f GiB (%.2f ms at the link's %.1f GB/s)" % (
            dc["hit"], dc["copy"], dc["miss"], L, streamed / GiB, link_ms,
            ctx.link or float("nan")))
    say("   vpager: device counters per forward: %s" % ", ".join(
        "%s %.1f" % (k, v) for k, v in ds.items()))
    say("   vpager: VBAR loaded %.3f GiB (vbars_analyze %.3f GiB), "
        "get_total_vram_usage %.3f GiB, watermark %d of %d pages" % (
            cp.vbar.loaded_size() / GiB, cp.mv.vbars_analyze(0) / GiB,
            cp.control.get_total_vram_usage() / GiB, cp.vbar.get_watermark(),
            cp.vbar.get_nr_pages()))
    say("   vpager: layers resident ('#' all pages, '+' some, '.' none): %s"
        % cp.residency())
    say("   vpager: output of the last forward %s (%s)" % (
        compare(ref, y), describe(y)))
    return res


# ---------------------------------------------------------------- main

def main():
    global torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU and the simulated device, small sizes")
    ap.add_argument("--layers", type=int, help="layers (96; dry 12)")
    ap.add_argument("--dim", type=int, help="layer is dim x dim (8192; "
                    "dry 4096)")
    ap.add_argument("--batches", help="comma-separated (16,4096; dry 2,8)")
    ap.add_argument("--iters", type=int, help="timed forwards (15; dry 3)")
    ap.add_argument("--warmup", type=int, help="untimed forwards after the "
                    "first (3; dry 1)")
    ap.add_argument("--budget-div", type=float, default=1.5,
                    help="budget = weights / this (1.5)")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["VPAGER_BACKEND"] = "sim"
        os.environ.setdefault("VPAGER_SIM_CAPACITY", "1G")
    import torch as _torch
    torch = _torch
    if not args.dry_run and not torch.cuda.is_available():
        say("bench_compat: no CUDA GPU visible to torch; use --dry-run for "
            "the CPU check")
        return 1
    ctx = Ctx(args.dry_run)
    if ctx.cuda:
        torch.cuda.init()
        torch.cuda.set_device(0)
    cfg = Cfg(args)
    try:
        machine_info(ctx)
    except Exception:  # noqa: BLE001
        fail("machine info")
    say("mode: %s" % ("DRY RUN (CPU tensors, simulated device with "
                      "VPAGER_SIM_CAPACITY=%s, small sizes: the figures mean "
                      "nothing)" % os.environ.get("VPAGER_SIM_CAPACITY")
                      if args.dry_run else "GPU"))
    say("setup: %d layers x %d MiB = %.3f GiB of weights, budget = weights / "
        "%.2f = %.3f GiB; batches %s; forward = x @ W per layer; %d warm-up "
        "+ %d timed forwards after the first" % (
            cfg.layers, cfg.layer_bytes // MiB, cfg.weight_bytes / GiB,
            cfg.budget_div, cfg.budget / GiB, cfg.batches, cfg.warmup,
            cfg.iters))
    RESULTS.update(layers=cfg.layers, dim=cfg.dim, dtype=str(cfg.dtype),
                   weight_bytes=cfg.weight_bytes, budget=cfg.budget,
                   batches=cfg.batches, dry_run=cfg.dry)

    # 1. weights (nothing else can run without them)
    try:
        stack = Stack(ctx, cfg)
        say("   %s" % ctx.mem())
    except Exception:  # noqa: BLE001
        fail("building the weights")
        return 1

    # 2. link
    try:
        measure_link(ctx, cfg, stack)
    except Exception:  # noqa: BLE001
        fail("link")

    # 3. all resident
    say("\nall weights resident (plain torch tensors):")
    refs, resident = {}, {}
    for b in cfg.batches:
        try:
            x0 = make_input(ctx, cfg, b)
            say("  batch %d:" % b)
            resident[b], refs[b] = run_resident(ctx, cfg, stack, b, x0)
        except Exception:  # noqa: BLE001
            fail("resident, batch %d" % b)
    try:
        stack.drop_device(ctx)
        say("   device copies of the weights freed; %s" % ctx.mem())
    except Exception:  # noqa: BLE001
        fail("freeing the resident weights")

    # 4. comfy_aimdo on vpager
    say("\ncomfy_aimdo (python/compat) on vpager, the per-weight cycle "
        "(fault, compare signature, copy if it differs, use, unpin; a miss "
        "copies into a reusable device buffer on the compute stream):")
    cp = None
    try:
        cp = Compat(ctx, cfg, stack)
    except Exception:  # noqa: BLE001
        fail("comfy_aimdo setup")
    vp = {}
    if cp is not None:
        for b in cfg.batches:
            try:
                say("  batch %d:" % b)
                x0 = make_input(ctx, cfg, b)
                vp[b] = run_vpager(ctx, cfg, cp, b, x0, refs.get(b))
            except Exception:  # noqa: BLE001
                fail("vpager, batch %d" % b)

    # 5. the VBAR's bytes against the host copies
    if cp is not None:
        try:
            c0 = cp.stats()
            checked, bad, skipped = cp.verify()
            d = {k: v - c0[k] for k, v in cp.stats().items()}
            say("   VBAR contents: %d resident layers (signature unchanged "
                "since their copy) byte-compared with the host copies: %s; "
                "%d layers not resident or refilled, not checked (this check"
                " committed %d pages, evicted %d)" % (
                    checked, "all EQUAL" if not bad else
                    "%d DIFFER: layers %s" % (len(bad), bad[:16]), skipped,
                    d["pages_committed"], d["pages_evicted"]))
            RESULTS["verify"] = dict(checked=checked, bad=bad,
                                     skipped=skipped)
        except Exception:  # noqa: BLE001
            fail("VBAR contents check")

    # 6. summary
    say("\nsummary (ms per forward, median; bound = max(resident, streamed "
        "bytes / link)):")
    say("   %6s %10s %10s %8s %10s %9s %14s  %s" % (
        "batch", "resident", "vpager", "vp/res", "bytes/link", "vp/bound",
        "hit/copy/miss", "output vs resident"))
    for b in cfg.batches:
        try:
            r, v = resident.get(b), vp.get(b)
            rm = r["ms"] if r else float("nan")
            vm = v["ms"] if v else float("nan")
            lm = v["link_ms"] if v else float("nan")
            bound = max(rm, lm) if r and v else float("nan")
            cnt = ("%.0f/%.0f/%.0f" % (v["counts"]["hit"], v["counts"]["copy"],
                                       v["counts"]["miss"]) if v else "-")
            say("   %6d %10.3f %10.3f %8.3f %10.3f %9.3f %14s  %s" % (
                b, rm, vm, vm / rm if r and v else float("nan"), lm,
                vm / bound if r and v else float("nan"), cnt,
                ("EQUAL" if v["equal"] else "DIFFER") +
                (", first forward " + ("EQUAL" if v["first"]["equal"]
                                       else "DIFFER")) if v else "-"))
            out = RESULTS.setdefault("batch", {}).setdefault(str(b), {})
            if r:
                out["resident"] = r
            if v:
                out["vpager"] = v
                out["vp_over_resident"] = vm / rm if r else None
                out["vp_over_bound"] = vm / bound if r else None
        except Exception:  # noqa: BLE001
            fail("summary, batch %d" % b)
    if cp is not None:
        try:
            cp.control.analyze()
        except Exception:  # noqa: BLE001
            fail("analyze")
        try:
            ctx.sync()
            cp.views = []
            cp.vbar.close()
            cp.control.deinit()
        except Exception:  # noqa: BLE001
            fail("deinit")
    say("total run time %.1f s" % elapsed())
    RESULTS["run_s"] = elapsed()
    try:
        benchlib.write_json("bench_compat.json", RESULTS)
    except Exception:  # noqa: BLE001
        fail("writing bench_compat.json")
    ok = all(v.get("equal") for v in vp.values()) and \
        len(vp) == len(cfg.batches) and "errors" not in RESULTS
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
