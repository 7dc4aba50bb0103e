#!/usr/bin/env python3
"""The ComfyUI per-weight cycle through comfy_aimdo on vpager (issues 6 and
12): the fault+unpin round trip, then the steady state of two weight
shapes laid out as ComfyUI lays out a model, each against all weights
resident and a hand-written streamer in the same run.

1. fault+unpin round trip through the Python API (issue 12, per fault):
   vbar_fault + vbar_unpin of a resident 1 MiB allocation and of a block
   span (a synthetic (vbar, first address, span) over 6 adjacent
   allocations, ComfyUI's _v_block), µs per pair, median of 5 rounds; the
   same through ModelVBAR.fault / unpin (the binding's vp_fault /
   vp_unpin, the old per-call route) and the bare C calls as baselines.
   Targets: <= 2 µs a pair on the H200, span <= 1.1x the allocation.
2. steady state (issue 12), two shapes:
     uniform: 96 bf16 8192x8192 layers (128 MiB, 12 GiB), x @ W per layer,
              batches 256 and 8192; targets <= 88 and <= 238 ms a forward
              (the peer's figures);
     small:   1536 bf16 1024x1024 weights (2 MiB, 3 GiB), tanh(x @ W) per
              weight, batch 256; target <= 77 ms a forward (the peer's).
   Budget weights / 1.5 (8 GiB, 2 GiB), set through
   set_simple_vram_headroom(total - budget). The model is laid out in
   its ModelVBAR by ComfyUI's rule: tiny modules first (one bias vector
   per block of 4 or 8 layers, added after the block), then the weights
   largest first (all equal here, so in order), 512-byte aligned; each
   block has a _v_block span (vbar, first weight's address, extent of
   its weights). Per forward, per block, as ComfyUI >= 0.35 drives it
   (model_prefetch: the block's span is faulted to check a captured
   graph's signature, then the layers run the per-weight cycle, then the
   span is unpinned), and per weight:

       sig = vbar_fault(alloc)
       if sig is None:                       # miss: the application copies
           buf.copy_(host[i]); W = buf       #   into a reusable device buffer
       else:                                 #   on the compute stream
           W = aimdo_to_tensor(alloc) viewed (d, d)
           if not vbar_signature_compare(sig, last_sig[i]):
               W.copy_(host[i]); last_sig[i] = sig        # refilled: copy
       x = f(x @ W)
       vbar_unpin(alloc)                     # (only when the fault pinned)

   Baselines in the same run: all weights resident (plain torch tensors);
   a hand-written streamer at the same budget (the weights that fit stay
   on the device, the rest are copied from the same pinned host copies
   into two device buffers on a copy stream, events both ways); the link
   (pinned host->device copies of whole layers) and the bound max(all
   resident, streamed bytes / link). Outputs are compared bitwise with
   the all-resident forward.

    make -j16 && PYTHONUNBUFFERED=1 PYTHONPATH=python:python/compat \\
        python3 bench/bench_compat.py | tee $OUT/bench_compat.log
    PYTHONPATH=python:python/compat /usr/bin/python3 bench/bench_compat.py \\
        --dry-run

--only fault,uniform,small picks sections. --dry-run: CPU tensors and
vpager's simulated device (VPAGER_BACKEND=sim, VPAGER_SIM_CAPACITY 1G
unless set), small sizes (uniform 12 layers of 2048x2048 fp32, 16 MiB;
small 96 weights of 512x512 fp32, 1 MiB), 20000 pairs in section 1;
checks the script, not speed. Every section catches and prints its own
errors. Writes $OUT/bench_compat.json when OUT is set. Needs torch (2.x
with CUDA on the GPU; Debian's 1.13 is enough for --dry-run) and
libvpager.so. Section 1 runs against another tree's comfy_aimdo as well
(PYTHONPATH and VPAGER_LIBRARY of that tree; it uses only the public
API), which is how before/after figures are taken in one run.
"""

import argparse
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "PYTHONPATH" not in os.environ:
    for _p in (os.path.join(ROOT, "python", "compat"),
               os.path.join(ROOT, "python")):
        if _p not in sys.path:
            sys.path.insert(0, _p)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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

class Shape:
    """One steady-state model: `layers` weights of dim x dim, `block`
    layers a block, forward x = act(x @ W), batches, peer targets."""

    def __init__(self, name, layers, dim, block, batches, act, targets,
                 dtype, budget_div):
        self.name, self.layers, self.dim, self.block = name, layers, dim, \
            block
        self.batches, self.act, self.targets = batches, act, targets
        self.dtype = dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.layer_bytes = dim * dim * self.esize
        self.nblocks = (layers + block - 1) // block
        self.weight_bytes = layers * self.layer_bytes
        self.budget = int(self.weight_bytes / budget_div)
        self.budget_div = budget_div

    def describe(self):
        return ("%s: %d weights of %dx%d %s (%s each, %.3f GiB), %s per "
                "weight, %d blocks of %d with a %d-element bias each; budget "
                "weights / %.2f = %.3f GiB; batches %s" % (
                    self.name, self.layers, self.dim, self.dim,
                    str(self.dtype).replace("torch.", ""),
                    _size(self.layer_bytes), self.weight_bytes / GiB,
                    "tanh(x @ W)" if self.act else "x @ W", self.nblocks,
                    self.block, self.dim, self.budget_div,
                    self.budget / GiB, self.batches))


def _size(n):
    return "%d MiB" % (n // MiB) if n >= MiB else "%d KiB" % (n >> 10)


class Cfg:
    def __init__(self, args):
        self.dry = args.dry_run
        bf16 = torch.float32 if self.dry else torch.bfloat16
        if self.dry:
            self.shapes = [
                Shape("uniform", 12, 2048, 4, [2, 8], False, {}, bf16, 1.5),
                Shape("small", 96, 512, 8, [4], True, {}, bf16, 1.5)]
            self.warmup, self.iters, self.pairs = 1, 3, 20000
        else:
            self.shapes = [
                Shape("uniform", 96, 8192, 4, [256, 8192], False,
                      {256: 88.0, 8192: 238.0}, bf16, 1.5),
                Shape("small", 1536, 1024, 8, [256], True, {256: 77.0},
                      bf16, 1.5)]
            self.warmup, self.iters, self.pairs = 3, 10, 200000
        if args.iters:
            self.iters = max(1, args.iters)
        if args.warmup is not None:
            self.warmup = max(0, args.warmup)
        if args.pairs:
            self.pairs = args.pairs
        self.only = set((args.only or "fault,uniform,small").split(","))


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


class Aimdo:
    """comfy_aimdo's device, opened once (control.init, init_devices)."""

    def __init__(self, ctx):
        from comfy_aimdo import control, model_vbar
        from comfy_aimdo import torch as atorch
        self.control, self.mv, self.at = control, model_vbar, atorch
        t0 = time.perf_counter()
        ok = control.init()
        say("   control.init() -> %s; init_devices([0]) -> %s (%.0f ms)" % (
            ok, control.init_devices([0]) if ok else "(skipped)",
            (time.perf_counter() - t0) * 1e3))
        if not ok:
            raise RuntimeError("comfy_aimdo.control.init() failed")
        self.dev = control.get_devctx(0)
        if ctx.cuda:
            s = torch.cuda.current_stream().cuda_stream
            say("   compute stream: torch's current stream, cuda_stream=%#x"
                "%s" % (s, "" if s == 0 else "  WARNING: not the legacy "
                        "default stream: vbar_unpin(alloc) fences stream 0"))

    def set_budget(self, budget):
        info = self.dev.info()
        total = info["total_memory"]
        self.control.set_simple_vram_headroom(total - budget)
        info = self.dev.info()
        o = self.dev.options
        say("   vpager device: backend %s, page %d MiB, staging %d MiB, "
            "lookahead %d MiB; total %.3f GiB; set_simple_vram_headroom("
            "%.3f GiB) = total - budget %.3f GiB; device budget now %.3f "
            "GiB, committed %.3f GiB" % (
                self.dev.backend, info["page_size"] // MiB,
                o.get("staging_size", 0) // MiB, o.get("lookahead", 0) // MiB,
                total / GiB, (total - budget) / GiB, budget / GiB,
                info["budget"] / GiB, info["committed"] / GiB))
        return info

    def stats(self):
        s = self.dev.stats()
        return {k: s[k] for k in STAT_KEYS}


# ------------------------------------------------------ 1. round trip

def bench_fault(ctx, cfg, aimdo):
    """µs per vbar_fault + vbar_unpin pair, resident."""
    mv = aimdo.mv
    aimdo.set_budget(256 * MiB)
    vb = mv.ModelVBAR(128 * MiB, 0)
    a = vb.alloc(1 * MiB)
    members = [vb.alloc(n) for n in (3 * MiB, 1 * MiB + 4096, 2 * MiB, 512,
                                     5 * MiB, 3 * MiB)]
    span = (vb, members[0][1], members[-1][1] + members[-1][2] -
            members[0][1])
    fault, unpin = mv.vbar_fault, mv.vbar_unpin
    for r in (a, span):
        if fault(r) is None:
            raise RuntimeError("the range did not become resident")
        unpin(r)
    n = cfg.pairs
    out = {}

    def rounds(fn, arg):
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(arg, n)
            ts.append((time.perf_counter() - t0) / n * 1e6)
        return med(ts), min(ts)

    def pairs(r, k):
        for _ in range(k):
            fault(r)
            unpin(r)

    def methods(r, k):
        _, addr, size = r
        f, u = vb.fault, vb.unpin
        for _ in range(k):
            f(addr, size)
            u(addr, size)
    s0 = aimdo.stats()
    for name, fn, r in (("vbar_fault+vbar_unpin, 1 MiB allocation", pairs,
                         a),
                        ("vbar_fault+vbar_unpin, block span of %d "
                         "allocations (%.1f MiB)" % (len(members),
                                                    span[2] / MiB),
                         pairs, span),
                        ("baseline ModelVBAR.fault+unpin (the binding's "
                         "vp_fault / vp_unpin), 1 MiB", methods, a)):
        m, b = rounds(fn, r)
        out[name] = dict(med_us=m, best_us=b)
        say("   %-72s %6.3f us a pair (best %.3f)" % (name, m, b))
    s1 = aimdo.stats()
    hits = s1["hits"] - s0["hits"]
    say("   %d pairs a round, 5 rounds, median; device counters over all "
        "of them: faults %d (hits %d), pages committed %d" % (
            n, s1["faults"] - s0["faults"], hits,
            s1["pages_committed"] - s0["pages_committed"]))
    # The bare C calls (what is left to Python), when this tree has them.
    try:
        from vpager.vbar import STREAM0, prepared_calls
        F, U = prepared_calls()
        pr = vb._vbar.prepare_range(a[1] - vb.base, a[2], 2)
        br, gens, nn = pr.ref, pr.gens_ptr, pr.nsig

        def bare(_, k):
            for _ in range(k):
                F(br, gens, nn)
                U(br, STREAM0)
        m, b = rounds(bare, None)
        out["bare vp_fault_range+vp_unpin_range via ctypes"] = dict(
            med_us=m, best_us=b)
        say("   %-72s %6.3f us a pair (best %.3f)" % (
            "baseline bare vp_fault_range+vp_unpin_range (ctypes, prebuilt)",
            m, b))
    except (AttributeError, ImportError):
        say("   (this comfy_aimdo has no hit path of its own: no bare-call "
            "baseline)")
    one = out["vbar_fault+vbar_unpin, 1 MiB allocation"]["med_us"]
    sp = [v for k, v in out.items() if "block span" in k][0]["med_us"]
    base = [v for k, v in out.items() if k.startswith("baseline Model")][0]
    say("   ratios: span / allocation %.3f; allocation / ModelVBAR methods "
        "%.3f" % (sp / one, one / base["med_us"]))
    if ctx.cuda:
        say("   " + benchlib.target("fault+unpin round trip, us", one, "<=",
                                    2.0))
        say("   " + benchlib.target("block span / allocation", sp / one,
                                    "<=", 1.1))
    RESULTS["fault"] = out
    vb.close()


# ------------------------------------------------------------- weights

class Stack:
    """The weights: host copies (pinned on CUDA), device copies for the
    all-resident baseline and the hand streamer, one bias per block."""

    def __init__(self, ctx, sh):
        self.host, self.dev = [], []
        d, L = sh.dim, sh.layers
        t0 = time.perf_counter()
        scale = d ** -0.5 if not sh.act else (3.0 / d) ** 0.5
        g = torch.Generator(device=ctx.device).manual_seed(1)
        for i in range(L):
            w = torch.randn(d, d, device=ctx.device, dtype=torch.float32,
                            generator=g).mul_(scale).to(sh.dtype)
            self.dev.append(w)
        self.bias_dev = [torch.randn(d, device=ctx.device,
                                     dtype=torch.float32,
                                     generator=g).mul_(0.01).to(sh.dtype)
                         for _ in range(sh.nblocks)]
        ctx.sync()
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        pin = ctx.cuda
        # pinned pools of up to 1 GiB of whole weights (torch's pinned
        # allocator rounds each allocation up to a power of two: 1 GiB of
        # 2 MiB or 128 MiB weights wastes nothing), views per weight
        per = max(1, GiB // sh.layer_bytes)
        self.pools = []
        for c0 in range(0, L, per):
            k = min(per, L - c0)
            pool = torch.empty(k * sh.layer_bytes, dtype=torch.uint8,
                               pin_memory=pin)
            self.pools.append(pool)
            for j in range(k):
                h = pool[j * sh.layer_bytes:(j + 1) * sh.layer_bytes].view(
                    sh.dtype).view(d, d)
                h.copy_(self.dev[c0 + j])
                self.host.append(h)
        self.bias_host = [b.cpu().pin_memory() if pin else b.clone()
                          for b in self.bias_dev]
        ctx.sync()
        say("   weights built in %.1f s, host copies %s in %.1f s" % (
            t_gen, "pinned (%d torch pin_memory pools)" % len(self.pools)
            if pin and all(p.is_pinned() for p in self.pools) else
            "pageable (CPU run)", time.perf_counter() - t0))

    def drop_device(self, ctx):
        self.dev = []
        ctx.empty_cache()


def measure_link(ctx, sh, stack):
    k = min(8, sh.layers)
    buf = torch.empty(sh.dim, sh.dim, dtype=sh.dtype, device=ctx.device)

    def go():
        for i in range(k):
            buf.copy_(stack.host[i], non_blocking=True)
    go()
    ts, _ = ctx.series(go, 4)
    link = k * sh.layer_bytes / (med(ts) / 1e3) / GB
    say("   link (in-run baseline): %.2f GB/s, %s %s host->device copies "
        "(torch copy_, non_blocking), median of 4 rounds of %d" % (
            link, "pinned" if ctx.cuda else "CPU memcpy (dry run: no "
            "link),", _size(sh.layer_bytes), k))
    return link


def make_input(ctx, sh, batch):
    g = torch.Generator().manual_seed(100 + batch)
    return torch.randn(batch, sh.dim, generator=g).to(ctx.device, sh.dtype)


def step(x, w, act):
    x = x @ w
    return torch.tanh(x) if act else x


# ------------------------------------------------------------ resident

def run_resident(ctx, cfg, sh, stack, x0):
    ws, bs, G, act = stack.dev, stack.bias_dev, sh.block, sh.act

    def fwd():
        x = x0
        for i, w in enumerate(ws):
            x = step(x, w, act)
            if i % G == G - 1 or i == len(ws) - 1:
                x = x + bs[i // G]
        return x
    with torch.no_grad():
        t_cold, y = ctx.once(fwd)
        box = []
        ts, wall = ctx.series(lambda: box.__setitem__(slice(None), [fwd()]),
                              cfg.iters, warmup=cfg.warmup)
    same = torch.equal(y, box[0])
    say("     resident: %.3f ms median (min %.3f, max %.3f; wall %.3f a "
        "forward; first %.1f); repeat forwards %s; output %s" % (
            med(ts), min(ts), max(ts), wall, t_cold,
            "bitwise equal" if same else "DIFFER", describe(box[0])))
    return dict(ms=med(ts), min_ms=min(ts), wall_ms=wall, times=ts), box[0]


class HandStreamer:
    """The weights that fit the budget (less two streaming buffers) stay
    on the device, in order; the rest are copied from the pinned host
    copies into two device buffers on a copy stream, double-buffered
    (the copy of weight k+1 runs while weight k computes), events both
    ways. The same pinned host tensors the comfy_aimdo cycle copies."""

    def __init__(self, ctx, sh, stack):
        self.ctx, self.sh, self.stack = ctx, sh, stack
        room = sh.budget - 2 * sh.layer_bytes
        self.keep = max(0, min(sh.layers, room // sh.layer_bytes))
        self.bufs = [torch.empty(sh.dim, sh.dim, dtype=sh.dtype,
                                 device=ctx.device) for _ in range(2)]
        self.copy = torch.cuda.Stream() if ctx.cuda else None

    def forward(self, x0):
        sh, st, ctx = self.sh, self.stack, self.ctx
        ws, host, bs, G, act = st.dev, st.host, st.bias_dev, sh.block, sh.act
        streamed = list(range(self.keep, sh.layers))
        x = x0
        if not ctx.cuda:
            for i in range(sh.layers):
                w = ws[i] if i < self.keep else \
                    self.bufs[i % 2].copy_(host[i])
                x = step(x, w, act)
                if i % G == G - 1 or i == sh.layers - 1:
                    x = x + bs[i // G]
            return x
        cur = torch.cuda.current_stream()
        ready = [torch.cuda.Event(), torch.cuda.Event()]
        free = [torch.cuda.Event(), torch.cuda.Event()]

        def issue(j):                       # the copy of streamed[j]
            i = streamed[j]
            b = j % 2
            with torch.cuda.stream(self.copy):
                if j >= 2:
                    self.copy.wait_event(free[b])
                self.bufs[b].copy_(host[i], non_blocking=True)
                ready[b].record(self.copy)
        if streamed:
            self.copy.wait_stream(cur)
            issue(0)
            if len(streamed) > 1:
                issue(1)
        for i in range(sh.layers):
            if i < self.keep:
                w = ws[i]
            else:
                j = i - self.keep
                b = j % 2
                cur.wait_event(ready[b])
                w = self.bufs[b]
            x = step(x, w, act)
            if i >= self.keep:
                free[b].record(cur)
                if j + 2 < len(streamed):
                    issue(j + 2)
            if i % G == G - 1 or i == sh.layers - 1:
                x = x + bs[i // G]
        return x


def run_hand(ctx, cfg, sh, hs, x0, ref):
    with torch.no_grad():
        hs.forward(x0)
        box = []
        ts, wall = ctx.series(
            lambda: box.__setitem__(slice(None), [hs.forward(x0)]),
            cfg.iters, warmup=cfg.warmup)
    eq = ref is not None and torch.equal(ref, box[0])
    say("     hand streamer: %.3f ms median (min %.3f, max %.3f; wall %.3f);"
        " %d weights resident, %d streamed a forward; output %s" % (
            med(ts), min(ts), max(ts), wall, hs.keep, sh.layers - hs.keep,
            compare(ref, box[0])))
    return dict(ms=med(ts), min_ms=min(ts), wall_ms=wall, times=ts,
                streamed=sh.layers - hs.keep, equal=eq)


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


class Model:
    """The comfy_aimdo side of one shape: its ModelVBAR laid out by
    ComfyUI's rule, the block spans, the cycle."""

    def __init__(self, ctx, aimdo, sh, stack):
        self.ctx, self.aimdo, self.sh, self.stack = ctx, aimdo, sh, stack
        mv = aimdo.mv
        info = aimdo.set_budget(sh.budget)
        self.page = info["page_size"]
        tiny = sh.dim * sh.esize
        total = sh.nblocks * ((tiny + 511) // 512 * 512) + \
            sh.layers * sh.layer_bytes + 512
        self.vbar = mv.ModelVBAR(total, 0)
        # ComfyUI's rule: tiny modules first, then the rest largest first
        # (a stable sort: equal sizes keep their order), 512-byte aligned.
        tensors = [("bias", b, tiny) for b in range(sh.nblocks)] + \
            [("weight", i, sh.layer_bytes) for i in range(sh.layers)]
        small = [t for t in tensors if t[2] < 1 * MiB]
        large = sorted((t for t in tensors if t[2] >= 1 * MiB),
                       key=lambda t: -t[2])
        self.w_alloc = [None] * sh.layers
        self.b_alloc = [None] * sh.nblocks
        for kind, i, n in small + large:
            a = self.vbar.alloc(n)
            (self.w_alloc if kind == "weight" else self.b_alloc)[i] = a
        self.spans = []
        for b in range(sh.nblocks):
            ws = self.w_alloc[b * sh.block:(b + 1) * sh.block]
            v = ws[0]
            for a in ws[1:]:                    # ComfyUI's _v_block rule
                v = (v[0], v[1], max(v[2], a[1] + a[2] - v[1]))
            self.spans.append(v)
        self.vbar.prioritize()                  # the model is "loaded"
        say("   ModelVBAR(%.3f GiB): %d pages; %d tiny allocations (%d B) "
            "first at offset 0, then %d weights of %s from offset %d; %d "
            "block spans of %s; prioritize() once" % (
                total / GiB, self.vbar.get_nr_pages(), sh.nblocks, tiny,
                sh.layers, _size(sh.layer_bytes),
                self.w_alloc[0][1] - self.vbar.base, sh.nblocks,
                _size(self.spans[0][2])))
        self.views = [None] * sh.layers
        self.bviews = [None] * sh.nblocks
        self.last = [None] * sh.layers
        self.blast = [None] * sh.nblocks
        self.buf = torch.empty(sh.dim, sh.dim, dtype=sh.dtype,
                               device=ctx.device)
        self.bbuf = torch.empty(sh.dim, dtype=sh.dtype, device=ctx.device)
        self.counts = dict(hit=0, copy=0, miss=0, span_hit=0, span_miss=0)

    def view(self, i):
        t = self.views[i]
        if t is None:
            t = self.aimdo.at.aimdo_to_tensor(self.w_alloc[i],
                                              self.ctx.device)
            t = t.view(self.sh.dtype).view(self.sh.dim, self.sh.dim)
            self.views[i] = t
        return t

    def bview(self, b):
        t = self.bviews[b]
        if t is None:
            t = self.aimdo.at.aimdo_to_tensor(self.b_alloc[b],
                                              self.ctx.device)
            t = t.view(self.sh.dtype)[:self.sh.dim]
            self.bviews[b] = t
        return t

    def forward(self, x):
        mv = self.aimdo.mv
        fault, unpin = mv.vbar_fault, mv.vbar_unpin
        same = mv.vbar_signature_compare
        sh, host, last, allocs, buf = self.sh, self.stack.host, self.last, \
            self.w_alloc, self.buf
        c, G, act, L = self.counts, sh.block, sh.act, sh.layers
        for b in range(sh.nblocks):
            span = self.spans[b]
            ssig = fault(span)                  # model_prefetch's check
            if ssig is None:
                c["span_miss"] += 1
            else:
                c["span_hit"] += 1
            for i in range(b * G, min(L, (b + 1) * G)):
                a = allocs[i]
                sig = fault(a)
                if sig is None:
                    buf.copy_(host[i], non_blocking=True)
                    x = step(x, buf, act)
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
                x = step(x, w, act)
                unpin(a)
            ba = self.b_alloc[b]
            sig = fault(ba)
            if sig is None:
                x = x + self.bbuf.copy_(self.stack.bias_host[b],
                                        non_blocking=True)
            else:
                bv = self.bviews[b]
                if bv is None:
                    bv = self.bview(b)
                if not same(sig, self.blast[b]):
                    bv.copy_(self.stack.bias_host[b], non_blocking=True)
                    self.blast[b] = sig
                x = x + bv
                unpin(ba)
            if ssig is not None:
                unpin(span)
        return x

    def verify(self):
        """Resident weights unchanged since their copy: bytes against the
        host copies. (checked, bad, skipped)."""
        mv = self.aimdo.mv
        checked, bad, skipped = 0, [], 0
        for i, a in enumerate(self.w_alloc):
            sig = mv.vbar_fault(a)
            if sig is None:
                skipped += 1
                continue
            try:
                if not mv.vbar_signature_compare(sig, self.last[i]):
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
                mv.vbar_unpin(a)
        return checked, bad, skipped

    def residency(self):
        flags = self.vbar.get_residency()
        out = []
        for a in self.w_alloc:
            off = a[1] - self.vbar.base
            ps = range(off // self.page, (off + a[2] - 1) // self.page + 1)
            n = sum(1 for p in ps if flags[p] & 1)
            out.append("#" if n == len(ps) else "+" if n else ".")
        s = "".join(out)
        if len(s) > 96:         # one mark per 16 weights
            s = "".join("#" if set(s[i:i + 16]) == {"#"} else
                        "." if set(s[i:i + 16]) == {"."} else "+"
                        for i in range(0, len(s), 16))
        return " ".join(s[i:i + 32] for i in range(0, len(s), 32))

    def close(self):
        self.views = []
        self.bviews = []
        self.ctx.sync()
        self.vbar.close()


def run_vpager(ctx, cfg, m, x0, ref, link):
    sh = m.sh
    res = {}
    with torch.no_grad():
        c0, s0 = dict(m.counts), m.aimdo.stats()
        t_cold, y_cold = ctx.once(lambda: m.forward(x0))
        c1, s1 = dict(m.counts), m.aimdo.stats()
        dc = {k: c1[k] - c0[k] for k in c1}
        ds = {k: s1[k] - s0[k] for k in s1}
        say("     vpager: first forward %.2f ms: hits %d, copies %d, misses "
            "%d; pages committed %d, evicted %d; output %s" % (
                t_cold, dc["hit"], dc["copy"], dc["miss"],
                ds["pages_committed"], ds["pages_evicted"],
                compare(ref, y_cold)))
        res["first"] = dict(ms=t_cold, counts=dc, stats=ds,
                            equal=ref is not None and torch.equal(ref, y_cold))
        del y_cold
        for _ in range(cfg.warmup):
            m.forward(x0)
        ctx.sync()
        c0, s0 = dict(m.counts), m.aimdo.stats()
        box = []
        ts, wall = ctx.series(
            lambda: box.__setitem__(slice(None), [m.forward(x0)]), cfg.iters)
        c1, s1 = dict(m.counts), m.aimdo.stats()
    n = cfg.iters
    dc = {k: (c1[k] - c0[k]) / n for k in c1}
    ds = {k: (s1[k] - s0[k]) / n for k in s1}
    streamed = (dc["copy"] + dc["miss"]) * sh.layer_bytes
    link_ms = streamed / (link * GB) * 1e3 if link else float("nan")
    y = box[0]
    eq = ref is not None and torch.equal(ref, y)
    res.update(ms=med(ts), min_ms=min(ts), max_ms=max(ts), wall_ms=wall,
               times=ts, counts=dc, stats=ds, streamed_bytes=streamed,
               link_ms=link_ms, equal=eq)
    say("     vpager: %.3f ms median (min %.3f, max %.3f; wall %.3f a "
        "forward); per forward: hits %.1f, copies %.1f, misses %.1f of %d "
        "weights, block spans resident %.1f of %d; streamed %.3f GiB "
        "(%.2f ms at the link)" % (
            res["ms"], res["min_ms"], res["max_ms"], wall, dc["hit"],
            dc["copy"], dc["miss"], sh.layers, dc["span_hit"], sh.nblocks,
            streamed / GiB, link_ms))
    say("     vpager: device counters per forward: %s" % ", ".join(
        "%s %.1f" % (k, v) for k, v in ds.items()))
    say("     vpager: VBAR loaded %.3f GiB, watermark %d of %d pages; "
        "weights resident ('#' all pages, '+' some, '.' none%s): %s" % (
            m.vbar.loaded_size() / GiB, m.vbar.get_watermark(),
            m.vbar.get_nr_pages(), "; one mark per 16" if sh.layers > 96
            else "", m.residency()))
    say("     vpager: output %s (%s)" % (compare(ref, y), describe(y)))
    return res


def bench_shape(ctx, cfg, aimdo, sh):
    say("\n%s" % sh.describe())
    out = RESULTS.setdefault("shapes", {}).setdefault(sh.name, {})
    out.update(layers=sh.layers, dim=sh.dim, block=sh.block,
               weight_bytes=sh.weight_bytes, budget=sh.budget,
               batches=sh.batches, act="tanh" if sh.act else "none")
    stack = Stack(ctx, sh)
    link = None
    try:
        link = measure_link(ctx, sh, stack)
        out["link_GBps"] = link
    except Exception:  # noqa: BLE001
        fail("%s: link" % sh.name)
    refs, resident, hand = {}, {}, {}
    try:
        hs = HandStreamer(ctx, sh, stack)
    except Exception:  # noqa: BLE001
        hs = None
        fail("%s: hand streamer setup" % sh.name)
    for b in sh.batches:
        x0 = make_input(ctx, sh, b)
        say("   batch %d:" % b)
        try:
            resident[b], refs[b] = run_resident(ctx, cfg, sh, stack, x0)
        except Exception:  # noqa: BLE001
            fail("%s: resident, batch %d" % (sh.name, b))
        if hs is not None:
            try:
                hand[b] = run_hand(ctx, cfg, sh, hs, x0, refs.get(b))
            except Exception:  # noqa: BLE001
                fail("%s: hand streamer, batch %d" % (sh.name, b))
    del hs
    stack.drop_device(ctx)
    say("   device copies freed; %s" % ctx.mem())
    m = None
    vp = {}
    try:
        m = Model(ctx, aimdo, sh, stack)
    except Exception:  # noqa: BLE001
        fail("%s: comfy_aimdo model" % sh.name)
    if m is not None:
        for b in sh.batches:
            try:
                say("   batch %d, comfy_aimdo on vpager:" % b)
                vp[b] = run_vpager(ctx, cfg, m, make_input(ctx, sh, b),
                                   refs.get(b), link)
            except Exception:  # noqa: BLE001
                fail("%s: vpager, batch %d" % (sh.name, b))
        try:
            checked, bad, skipped = m.verify()
            say("   VBAR contents: %d resident weights (signature unchanged "
                "since their copy) byte-compared with the host copies: %s; "
                "%d not resident or refilled, not checked" % (
                    checked, "all EQUAL" if not bad else "%d DIFFER: %s" % (
                        len(bad), bad[:16]), skipped))
            out["verify"] = dict(checked=checked, bad=bad, skipped=skipped)
        except Exception:  # noqa: BLE001
            fail("%s: VBAR contents check" % sh.name)
    say("   summary %s (ms a forward, median; bound = max(resident, "
        "streamed / link)):" % sh.name)
    say("   %6s %9s %9s %9s %8s %8s %8s %9s  %s" % (
        "batch", "resident", "hand", "vpager", "vp/res", "vp/hand",
        "vp/bound", "peer", "output"))
    for b in sh.batches:
        try:
            r, h, v = resident.get(b), hand.get(b), vp.get(b)
            nan = float("nan")
            rm = r["ms"] if r else nan
            hm = h["ms"] if h else nan
            vm = v["ms"] if v else nan
            bound = max(rm, v["link_ms"]) if v and r else nan
            peer = sh.targets.get(b)
            say("   %6d %9.3f %9.3f %9.3f %8.3f %8.3f %8.3f %9s  %s" % (
                b, rm, hm, vm, vm / rm, vm / hm, vm / bound,
                "%.1f" % peer if peer else "-",
                ("EQUAL" if v and v["equal"] else "DIFFER") +
                (", hand " + ("EQUAL" if h and h["equal"] else "DIFFER"))))
            row = out.setdefault("batch", {}).setdefault(str(b), {})
            row.update(resident=r, hand=h, vpager=v, vp_over_resident=vm / rm,
                       vp_over_hand=vm / hm, vp_over_bound=vm / bound,
                       peer_ms=peer)
            if peer and ctx.cuda:
                say("   " + benchlib.target(
                    "%s batch %d: ms a forward (peer %.0f)" % (sh.name, b,
                                                               peer),
                    vm, "<=", peer))
        except Exception:  # noqa: BLE001
            fail("%s: summary, batch %d" % (sh.name, b))
    if m is not None:
        try:
            m.close()
        except Exception:  # noqa: BLE001
            fail("%s: closing the VBAR" % sh.name)
    del stack
    ctx.empty_cache()
    return all(v.get("equal") for v in vp.values()) and \
        len(vp) == len(sh.batches)


# ---------------------------------------------------------------- main

def main():
    global torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU and the simulated device, small sizes")
    ap.add_argument("--only", help="sections: fault,uniform,small (all)")
    ap.add_argument("--iters", type=int, help="timed forwards (10; dry 3)")
    ap.add_argument("--warmup", type=int, help="untimed forwards after the "
                    "first (3; dry 1)")
    ap.add_argument("--pairs", type=int, help="fault+unpin pairs a round "
                    "in section 1 (200000; dry 20000)")
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
    say("inputs: sections %s; %d warm-up + %d timed forwards a variant; %d "
        "fault+unpin pairs a round" % (",".join(sorted(cfg.only)),
                                       cfg.warmup, cfg.iters, cfg.pairs))
    RESULTS.update(dry_run=cfg.dry, sections=sorted(cfg.only))
    ok = True
    try:
        aimdo = Aimdo(ctx)
    except Exception:  # noqa: BLE001
        fail("comfy_aimdo setup")
        return 1
    if "fault" in cfg.only:
        say("\n1. fault+unpin round trip through the Python API (resident):")
        try:
            bench_fault(ctx, cfg, aimdo)
        except Exception:  # noqa: BLE001
            fail("fault round trip")
            ok = False
    for sh in cfg.shapes:
        if sh.name in cfg.only:
            try:
                ok = bench_shape(ctx, cfg, aimdo, sh) and ok
            except Exception:  # noqa: BLE001
                fail("shape %s" % sh.name)
                ok = False
    try:
        aimdo.control.deinit()
    except Exception:  # noqa: BLE001
        fail("deinit")
    for ln in benchlib.target_lines("   %s: %.3f %s %.2f %s"):
        say(ln)
    RESULTS["targets"] = benchlib.targets_json()
    say("total run time %.1f s" % elapsed())
    RESULTS["run_s"] = elapsed()
    try:
        benchlib.write_json("bench_compat.json", RESULTS)
    except Exception:  # noqa: BLE001
        fail("writing bench_compat.json")
    return 0 if ok and "errors" not in RESULTS else 1


if __name__ == "__main__":
    sys.exit(main())
