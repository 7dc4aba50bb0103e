#!/usr/bin/env python3
"""PyTorch benchmarks of vpager on a GPU (issue 5, "Benchmarks on the H200"),
each against baselines measured in the same run:

  1. hot path: acquire+release of a layer's weights through Python, all
     resident, on the current stream; ns per weight for layers of 1, 16 and
     64 weights: WeightBatch (the fast path vpager.torch uses), the same
     vp_acquire/vp_release called straight through ctypes with prepared
     arrays (the bare C figure as near as Python gets; a no-argument ctypes
     call is printed as the floor of what ctypes itself costs), and the
     whole vpager.torch unit wrapper (an offloaded module whose forward does
     nothing, minus the same module not offloaded); target: WeightBatch
     <= 1 us per weight;
  2. a Llama-shaped decoder (transformers LlamaConfig, random weights, no
     download: hidden 4096, FFN 14336, 16 layers, GQA 32/8 heads, vocab
     32000, bf16, ~7.5 GB) with a budget of two thirds of its weights:
     prefill (1 x 2048) and decode ms/token (32 tokens on a KV cache) for
     (a) all weights resident, (b) vpager.torch.offload of the CPU model
     onto the GPU, (c) accelerate infer_auto_device_map + dispatch_model
     with the same max_memory for GPU 0 and the rest on the CPU
     (device_map="auto" behaviour); attention on the flash/efficient SDPA
     backends only (FACTS: cuDNN's costs ~2 ms of host time per call when
     the KV length changes); targets: vpager >= 5x faster than accelerate,
     and <= 1.1x max(all-resident, streamed bytes / link bandwidth);
  3. a compute-bound DiT-like stack (hidden 3072, 4x MLP, attention, 4096
     tokens x batch 2, ~13 GB of weights) in an 8.6 GB budget, 20 steps:
     ms per step against all-resident (target <= 1.05x) and VMM calls after
     the first step (device pages_committed + pages_evicted; target 0);
  4-6. issue 13, models that look like real ones, each at budgets of 1/3,
     1/2 and 2/3 of its weights (--budgets): ms per forward of
     vpager.torch.offload(model, device, budget) against all-resident and
     against L = max(all-resident, (W - B + 2 w_max) / link) (W weights,
     B budget, w_max the largest weight, link measured above), bitwise
     equality, bytes copied per forward (vpager stats) and how long the
     compute stream waited in acquires (CUDA events around each unit's
     vp_acquire, on one forward of its own: benchlib.WaitProbe);
     4. a Flux-class DiT in plain torch (8 double-stream blocks with
        separate img/txt modulation, qkv/proj and MLP linears, 16
        single-stream blocks with fused linear1/linear2, modulation
        linears on the pooled 1 x 3072 vector; hidden 3072, bf16, ~9.4 GiB;
        4096 image + 256 text tokens); targets <= 1.10x L at 1/2 and 2/3,
        <= 1.15x at 1/3;
     5. 1536 x 2 MiB bf16 weights, tanh(x @ W) per layer, batch 256,
        against a hand-written double-buffered streamer (pinned host
        copies, two device buffers, a copy stream, events) at the same
        budget; target vpager <= 1.15x the streamer (which computes
        tanh(x @ W) itself; the same streamer calling a module per layer,
        as vpager runs the model's, is timed against it, for what the
        module calls alone add);
     6. the decoder of section 2, prefill and decode; target <= 1.10x L.

    make -j16 && PYTHONUNBUFFERED=1 PYTHONPATH=python \
        python3 bench/bench_torch.py | tee $OUT/bench_torch.log
    PYTHONPATH=python /usr/bin/python3 bench/bench_torch.py --dry-run

--dry-run runs everything on the CPU with the simulated device and tiny
sizes (what CI and a laptop can check, tests/python/test_bench_torch.py;
no figure means anything there); --small runs sections 4-6 at those sizes
on the GPU. --only 1,3 runs some sections; --iters N timed forwards per
variant in 4-6 (3). Each section catches its own errors (the
traceback is printed and the run goes on). Writes a JSON of the figures to
$OUT/bench_torch.json when OUT is set.

Needs torch (2.x with CUDA on the GPU; Debian's 1.13 is enough for
--dry-run) and build/libvpager.so; transformers and accelerate for the
decoder's baselines (without transformers a stand-in decoder of the same
shape is used and says so; without accelerate that baseline is skipped).
"""

import argparse
import contextlib
import os
import sys
import time
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# No network on the GPU machine: never let transformers try the hub.
for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
           "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_k, "1")
if os.path.join(ROOT, "python") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import vpager  # noqa: E402
import vpager.torch as vt  # noqa: E402
from vpager import _lib  # noqa: E402
from vpager.weights import Source, WeightBatch  # noqa: E402

import benchlib  # noqa: E402
from benchlib import (GB, KiB, MiB, copied_bytes, elapsed,  # noqa: E402
                      host_ram, med, say, stats_delta, target)

RESULTS = {}


def size_str(n):
    return "%d MiB" % (n // MiB) if n >= MiB else "%d KiB" % (n // KiB)


def copied(a, b):
    """Bytes vpager copied host->device between two stats() dicts (a
    handle's: its "model" counters)."""
    if "model" in a:
        a, b = a["model"], b["model"]
    return copied_bytes(stats_delta(a, b))


# ------------------------------------------------------------- settings

class Cfg:
    """Sizes. FULL for the GPU; DRY for --dry-run (CPU, simulated device)."""

    def __init__(self, dry, small=False):
        self.dry = dry
        # 1. hot path
        self.hot_ns = (1, 16, 64)
        self.hot_wsize = 4 * KiB if dry else 2 * MiB
        self.hot_rep_s = 0.02 if dry else 0.1     # seconds per repetition
        self.hot_reps = 3 if dry else 5
        # 2. Llama-shaped decoder
        if dry:
            self.llama = dict(hidden=256, inter=688, layers=4, heads=8,
                              kv_heads=2, vocab=1024)
            self.prefill, self.decode, self.warm_decode = 64, 8, 2
        else:
            self.llama = dict(hidden=4096, inter=14336, layers=16, heads=32,
                              kv_heads=8, vocab=32000)
            self.prefill, self.decode, self.warm_decode = 2048, 32, 3
        self.prefill_reps = 2 if dry else 3
        self.budget_frac = 2.0 / 3.0
        self.decode_cap_s = 25.0   # fewer tokens if a variant is that slow
        # 3. DiT-like stack: 57 blocks of 3072 hidden ~ 12.9 GB of bf16
        if dry:
            self.dit = dict(hidden=128, heads=4, mlp=4, tokens=64, batch=2,
                            layers=6)
            self.dit_budget = None          # two thirds of the weights
            self.dit_steps = 5
        else:
            self.dit = dict(hidden=3072, heads=24, mlp=4, tokens=4096,
                            batch=2, layers=57)
            self.dit_budget = int(8.6 * GB)
            self.dit_steps = 20
        self.dit_cap_s = 30.0      # fewer steps if a variant is that slow
        self.soft_limit_s = 150.0  # section 3 shortened if started later
        self.dtype = torch.bfloat16
        # 4-6. issue 13 (small: the same models scaled down, any device)
        tiny = dry or small
        self.i13_fracs = (1 / 3, 1 / 2, 2 / 3)
        self.i13_iters = 3
        self.i13_decode = 4 if tiny else 8
        if tiny:
            self.flux = dict(hidden=128, heads=4, mlp=4, double=2, single=4,
                             img=64, txt=16, in_ch=16, ctx_in=64, vec_in=32)
            self.small = dict(layers=96, d=64, batch=16)
        else:
            self.flux = dict(hidden=3072, heads=24, mlp=4, double=8,
                             single=16, img=4096, txt=256, in_ch=64,
                             ctx_in=4096, vec_in=768)
            self.small = dict(layers=1536, d=1024, batch=256)
        if small and not dry:
            self.llama = dict(hidden=1024, inter=2816, layers=4, heads=8,
                              kv_heads=2, vocab=4096)
            self.prefill = 256


class Ctx(benchlib.Ctx):
    """Where things run: a CUDA GPU, or (dry run) the CPU and the simulated
    device; timing from benchlib.Ctx."""

    def __init__(self, dry):
        super().__init__(dry)
        # vpager options for devices this script opens (the GPU run takes
        # vpager's defaults: 32 MiB pages, 512 MiB staging, 256 MiB
        # lookahead; the dry run a small simulated device)
        self.vp_opts = {} if self.cuda else dict(
            page_size=64 * KiB, sim_granularity=64 * KiB, sim_shared="",
            sim_streams="sync")


# ------------------------------------------------------- SDPA backends

_SDPA = {"backends": None, "names": "torch default (not restricted)"}


def sdpa_init(ctx):
    """Flash and memory-efficient SDPA kernels only, on CUDA."""
    if not ctx.cuda:
        _SDPA["names"] = "torch default (dry run on the CPU)"
        return
    try:
        from torch.nn.attention import SDPBackend
    except ImportError as e:
        _SDPA["names"] = "torch default (torch.nn.attention missing: %s)" % e
        return
    _SDPA["backends"] = [SDPBackend.FLASH_ATTENTION,
                         SDPBackend.EFFICIENT_ATTENTION]
    _SDPA["names"] = "FLASH_ATTENTION, EFFICIENT_ATTENTION"


def sdpa_ctx():
    if _SDPA["backends"] is None:
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(_SDPA["backends"])


def sdpa_call(fn):
    """fn() under the restricted backends; if torch finds no kernel among
    them for this shape, say so and allow MATH as well (never cuDNN)."""
    try:
        with sdpa_ctx():
            return fn()
    except RuntimeError as e:
        if _SDPA["backends"] is None or "kernel" not in str(e).lower():
            raise
        from torch.nn.attention import SDPBackend
        if SDPBackend.MATH in _SDPA["backends"]:
            raise
        say("   WARNING: no flash/efficient SDPA kernel for this call (%s); "
            "MATH allowed from now on" % str(e).splitlines()[0][:200])
        _SDPA["backends"] = _SDPA["backends"] + [SDPBackend.MATH]
        _SDPA["names"] += ", MATH (fallback)"
        with sdpa_ctx():
            return fn()


def attention(q, k, v, causal):
    """SDPA where torch has it (2.x), else the plain formula (torch 1.13)."""
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if sdpa is not None:
        return sdpa(q, k, v, is_causal=causal)
    s = (q @ k.transpose(-1, -2)).float() * (q.shape[-1] ** -0.5)
    if causal:
        t, u = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(t, u, dtype=torch.bool,
                                     device=s.device).triu(u - t + 1),
                          float("-inf"))
    return s.softmax(-1).to(q.dtype) @ v


# ------------------------------------------------------------ building

@contextlib.contextmanager
def building(device, dtype):
    """Parameters made directly on `device` (torch >= 2.0's device context)
    in `dtype` (the default dtype, for the duration)."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
    except (TypeError, RuntimeError):
        pass
    dctx = device if (device.type != "cpu" and
                      hasattr(torch.device, "__enter__")) else None
    try:
        if dctx is not None:
            with dctx:
                yield
        else:
            yield
    finally:
        torch.set_default_dtype(old)


def finish(model, device, dtype):
    """Whatever building() could not do, done by copies; eval, frozen."""
    ps = list(model.parameters())
    if any(p.device != device for p in ps):
        model = model.to(device)
    if any(p.dtype != dtype for p in ps if p.is_floating_point()):
        model = model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def randomize(model, seed=0):
    """Weights drawn again on their device, whatever the constructor did:
    matrices N(0, 0.02), vectors (norms) 1. Same bytes in every variant,
    and no NaN from memory a constructor left uninitialised."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.fill_(1.0)
    return model


def weight_bytes(model):
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


# ------------------------------------------------------------- machine

def machine_info(ctx):
    return benchlib.machine_lines(
        ctx.cuda, extras=benchlib.module_versions(("transformers",
                                                   "accelerate")))


def measure_link(ctx):
    """Pinned host->device copies of 128 MiB (8 per round from a 1 GiB
    pinned buffer, 4 rounds; median), torch copy_(non_blocking=True)."""
    if not ctx.cuda:
        n = 4 * MiB
        src = torch.empty(8 * n, dtype=torch.uint8)
        dst = torch.empty(n, dtype=torch.uint8)

        def go():
            for i in range(8):
                dst.copy_(src[i * n:(i + 1) * n])
        go()
        ts, _ = ctx.series(go, 4)
        ctx.link = 8 * n / (med(ts) / 1e3) / GB
        ctx.link_what = "host memcpy (dry run: no link)"
    else:
        n = 128 * MiB
        t0 = time.perf_counter()
        src = torch.empty(8 * n, dtype=torch.uint8, pin_memory=True)
        t_pin = time.perf_counter() - t0
        dst = torch.empty(n, dtype=torch.uint8, device=ctx.device)

        def go():
            for i in range(8):
                dst.copy_(src[i * n:(i + 1) * n], non_blocking=True)
        go()
        ts, _ = ctx.series(go, 4)
        ctx.link = 8 * n / (med(ts) / 1e3) / GB
        ctx.link_what = ("pinned host->device, 128 MiB copies (1 GiB pinned "
                         "in %.2f s)" % t_pin)
        del src, dst
        ctx.empty_cache()
    say("link (in-run baseline): %.2f GB/s, %s, median of 4 rounds of "
        "8 copies" % (ctx.link, ctx.link_what))
    RESULTS["link_GBps"] = ctx.link


# ------------------------------------------------------- 1. hot path

class _Holder(nn.Module):
    """A layer of n weights whose forward reads none of them: calling it
    offloaded costs exactly vpager.torch's unit wrapper."""

    def __init__(self, n, shape, dtype):
        super().__init__()
        for i in range(n):
            self.register_parameter("w%02d" % i, nn.Parameter(
                torch.zeros(shape, dtype=dtype), requires_grad=False))

    def forward(self, x):
        return x


def _best_med(fn, ctx, cfg):
    """fn(iters) timed over cfg.hot_reps repetitions of ~hot_rep_s each:
    (best, median) seconds per iteration."""
    return ctx.best_med(fn, cfg.hot_reps, cfg.hot_rep_s)


def bench_hotpath(ctx, cfg):
    W = cfg.hot_wsize
    nmax = max(cfg.hot_ns)
    say("\n1. hot path: vp_acquire + vp_release of a layer's weights, all "
        "resident (filled once first), stream = torch's current stream "
        "(%s); %d weights of %d KiB in one VBAR, sources in one HostBuf; "
        "per weight = per call / n; best and median of %d repetitions of "
        "~%.0f ms" % ("cuda %#x" % ctx.stream() if ctx.cuda else "0, sim",
                      nmax, W // KiB, cfg.hot_reps, cfg.hot_rep_s * 1e3))
    if ctx.cuda:
        dev = vpager.Device(backend="cuda", device_index=0)
    else:
        dev = vpager.Device(backend="sim", sim_capacity=64 * MiB,
                            staging_size=4 * MiB, **ctx.vp_opts)
    o = dev.options
    say("   vpager device: backend %s, page %s, staging %s, lookahead %s"
        % (dev.backend, size_str(o["page_size"]),
           size_str(o["staging_size"]), size_str(o["lookahead"])))
    C = _lib.C
    s = ctx.stream()
    out = RESULTS.setdefault("hotpath", {})
    try:
        hb = dev.alloc_hostbuf(nmax * W)
        vb = dev.create_vbar(nmax * W)
        ws = vb.create_weights([i * W for i in range(nmax)], [W] * nmax,
                               [Source.from_host(hb.ptr + i * W)
                                for i in range(nmax)])
        whole = WeightBatch(dev, ws)
        whole.acquire(s)
        whole.release(s)
        if not ctx.cuda:
            dev.synchronize(s)
        ctx.sync()
        whole.acquire(s)
        flags = list(whole.flags)
        whole.release(s)
        ctx.sync()
        bad = [i for i, f in enumerate(flags)
               if f != _lib.VP_ACQUIRED_RESIDENT]
        if bad:
            say("   WARNING: %d weights not plainly resident after the first "
                "fill (flags %s)" % (len(bad), flags[:8]))

        floor_c = C.vp_get_log_level

        def floor(iters):
            for _ in range(iters):
                floor_c()
        fb, fm = _best_med(floor, ctx, cfg)
        say("   ctypes' own cost, a call with no arguments "
            "(vp_get_log_level): %.0f ns (best %.0f)" % (fm * 1e9, fb * 1e9))
        out["ctypes_noarg_ns"] = fm * 1e9
        h = dev._handle()
        for n in cfg.hot_ns:
            batch = WeightBatch(dev, ws[:n])
            acq, rel = batch.acquire, batch.release

            def via_batch(iters):
                for _ in range(iters):
                    acq(s)
                    rel(s)
            fa, fr = C.vp_acquire, C.vp_release
            hs, ptrs, fl = batch.handles, batch.ptrs, batch.flags

            def direct(iters):
                for _ in range(iters):
                    if fa(h, hs, n, s, ptrs, fl) or fr(h, hs, n, s):
                        raise RuntimeError("vp_acquire/vp_release failed: %s"
                                           % vpager.last_error())
            bb, bm = _best_med(via_batch, ctx, cfg)
            db, dm = _best_med(direct, ctx, cfg)
            say("   n=%2d: WeightBatch %6.0f ns/weight (best %.0f; %.2f us a "
                "call) | direct ctypes %6.0f ns/weight (best %.0f; %.2f us a "
                "call) | WeightBatch/direct %.2f | %s" % (
                    n, bm / n * 1e9, bb / n * 1e9, bm * 1e6, dm / n * 1e9,
                    db / n * 1e9, dm * 1e6, bm / dm,
                    target("1. WeightBatch ns/weight, layer of %d" % n,
                           bm / n * 1e9, "<=", 1000.0) if n >= 16 else
                    "(one weight a call: the fixed cost, no target)"))
            out["n%d" % n] = {"weightbatch_ns_per_weight": bm / n * 1e9,
                              "direct_ns_per_weight": dm / n * 1e9,
                              "weightbatch_us_per_call": bm * 1e6,
                              "direct_us_per_call": dm * 1e6}
        st = dev.stats()
        say("   device counters: acquires %d, hits %d, fills %d, misses %d, "
            "weight_fills %d, weight_staged %d, copies %d" % (
                st["acquires"], st["hits"], st["fills"], st["misses"],
                st["weight_fills"], st["weight_staged"], st["copies"]))
        ctx.sync()
        ws.close()
        vb.close()
        hb.close()
    finally:
        ctx.sync()
        dev.close()
    # The whole unit wrapper: an offloaded module whose forward does nothing.
    shape = (W // 2 // 256, 256)
    x = torch.zeros(4, device=ctx.device)
    for n in cfg.hot_ns:
        plain = _Holder(n, shape, torch.bfloat16)
        offm = _Holder(n, shape, torch.bfloat16)
        hd = vt.offload(offm, device=ctx.device,
                        budget=max(256 * MiB, 8 * n * W), **ctx.vp_opts)
        try:
            with torch.no_grad():
                offm(x)
                ctx.sync()
                st0 = hd.stats()["model"]

                def call_off(iters):
                    for _ in range(iters):
                        offm(x)

                def call_plain(iters):
                    for _ in range(iters):
                        plain(x)
                ob, om = _best_med(call_off, ctx, cfg)
                pb, pm = _best_med(call_plain, ctx, cfg)
                st1 = hd.stats()["model"]
            per = (om - pm) / n
            say("   n=%2d: vpager.torch unit wrapper %6.0f ns/weight "
                "(offloaded forward %.2f us - plain forward %.2f us, / n); "
                "staged "
                "%d, filled %d during the timing (expected 0)" % (
                    n, per * 1e9, om * 1e6, pm * 1e6,
                    st1["weight_staged"] - st0["weight_staged"],
                    st1["weight_fills"] - st0["weight_fills"]))
            out["n%d" % n]["torch_unit_ns_per_weight"] = per * 1e9
        finally:
            hd.close()


# ------------------------------------------------- 2. Llama-shaped decoder

class _RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _Attn(nn.Module):
    def __init__(self, d, heads, kv_heads):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, d, bias=False)

    def forward(self, x, cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        if cache.k is not None:
            k = torch.cat([cache.k, k], 2)
            v = torch.cat([cache.v, v], 2)
        cache.k, cache.v = k, v
        r = self.h // self.kvh
        a = attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                      causal=t > 1)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class _KV:
    """One layer's KV cache. Not a list: accelerate's hooks copy lists
    (send_to_device), which would lose the update."""

    __slots__ = ("k", "v")

    def __init__(self):
        self.k = self.v = None


class _MLP(nn.Module):
    def __init__(self, d, inter):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class StandInLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = _RMSNorm(c["hidden"])
        self.self_attn = _Attn(c["hidden"], c["heads"], c["kv_heads"])
        self.post_attention_layernorm = _RMSNorm(c["hidden"])
        self.mlp = _MLP(c["hidden"], c["inter"])

    def forward(self, x, cache):
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(StandInLayer(c)
                                    for _ in range(c["layers"]))
        self.norm = _RMSNorm(c["hidden"])


class StandInLM(nn.Module):
    """A Llama-shaped decoder (no RoPE) with the call interface of a
    transformers causal LM, for when transformers is not importable."""

    _no_split_modules = ["StandInLayer"]

    def __init__(self, c):
        super().__init__()
        self.model = _Body(c)
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=True,
                logits_to_keep=0):
        m = self.model
        cache = past_key_values
        if cache is None:
            cache = [_KV() for _ in m.layers]
        x = m.embed_tokens(input_ids)
        for layer, c in zip(m.layers, cache):
            x = layer(x, c)
        x = m.norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return types.SimpleNamespace(logits=self.lm_head(x),
                                     past_key_values=cache)


def build_decoder(ctx, cfg):
    """(model on ctx.device in bf16, description). transformers'
    LlamaForCausalLM when importable, else the stand-in."""
    c = cfg.llama
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # noqa: BLE001
        why = "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:160]
                          if str(e) else "")
        with building(ctx.device, cfg.dtype):
            model = StandInLM(c)
        model = randomize(finish(model, ctx.device, cfg.dtype))
        return model, ("STAND-IN decoder of the same shapes (transformers "
                       "not importable: %s); no RoPE" % why)
    kw = dict(hidden_size=c["hidden"], intermediate_size=c["inter"],
              num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
              num_key_value_heads=c["kv_heads"], vocab_size=c["vocab"],
              max_position_embeddings=4096, tie_word_embeddings=False,
              use_cache=True, attn_implementation="sdpa")
    dropped = []
    for _ in range(len(kw) + 1):
        try:
            conf = LlamaConfig(**kw)
            break
        except TypeError as e:
            # A config class that refuses a keyword: drop the one it names
            # (the required shapes are accepted by every version).
            bad = [k for k in kw if repr(k) in str(e) or k in str(e)]
            if not bad:
                raise
            dropped.append(bad[0])
            del kw[bad[0]]
    if dropped:
        say("   LlamaConfig refused %s; left out" % dropped)
    with building(ctx.device, cfg.dtype):
        model = LlamaForCausalLM(conf)
    model = randomize(finish(model, ctx.device, cfg.dtype))
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        try:
            model.set_attn_implementation("sdpa")
        except Exception as e:  # noqa: BLE001
            say("   WARNING: attention implementation is %r and could not "
                "be set to sdpa (%s)" % (impl, e))
        impl = getattr(model.config, "_attn_implementation", None)
    return model, "transformers LlamaForCausalLM (attn_implementation %s)" \
        % impl


def _accepts(model, name):
    import inspect
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def run_decoder(ctx, cfg, model, ids, label, stats=None, handle=None):
    """Warm-up (prefill + a few tokens; with `handle`, vpager.torch's,
    prefills until its schedule settled), then timed prefills and a timed
    greedy decode on the last prefill's KV cache. stats(): counters to take
    deltas of (vpager), or None. Prints and returns a dict."""
    kw = {"use_cache": True}
    pkw = dict(kw)
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if _accepts(model, name):
            pkw[name] = 1
            break
    res = {}

    def prefill():
        return model(input_ids=ids, **pkw)

    def step(state):
        out = model(input_ids=state["tok"],
                    past_key_values=state["pkv"], **kw)
        state["pkv"] = out.past_key_values
        state["tok"] = out.logits[:, -1:, :].argmax(-1)
        state["toks"].append(state["tok"])

    with torch.no_grad():
        # Warm-up: the first forward pays for page commits, kernel choice,
        # accelerate's first moves; reported apart.
        t_cold, out = ctx.once(lambda: sdpa_call(prefill))
        st = {"pkv": out.past_key_values,
              "tok": out.logits[:, -1:, :].argmax(-1), "toks": []}
        del out
        warm_ts = []
        with sdpa_ctx():
            for _ in range(cfg.warm_decode):
                t, _ = ctx.once(lambda: step(st))
                warm_ts.append(t)
        st = None
        if handle is not None:
            res["settled_after"] = benchlib.settle(
                handle, lambda: ctx.once(lambda: sdpa_call(prefill)),
                SETTLE_LIMIT)
        ctx.sync()
        say("   %s: cold prefill %.1f ms, warm-up decode %s ms%s" % (
            label, t_cold, " ".join("%.1f" % t for t in warm_ts),
            "" if handle is None else "; the schedule settled " +
            _settled_str(res["settled_after"]).replace("forward", "prefill")))
        res["cold_prefill_ms"] = t_cold
        n_dec = cfg.decode
        per = min(warm_ts) if warm_ts else 0.0
        if per > 0 and per * n_dec > cfg.decode_cap_s * 1e3:
            n_dec = max(4, int(cfg.decode_cap_s * 1e3 / per))
            say("   %s: %.0f ms a token in the warm-up: timing %d tokens, "
                "not %d" % (label, per, n_dec, cfg.decode))
        s0 = stats() if stats else None
        outs = []
        with sdpa_ctx():
            pts, pwall = ctx.series(lambda: outs.append(prefill()),
                                    cfg.prefill_reps)
        s1 = stats() if stats else None
        out = outs[-1]
        del outs[:-1]
        logits = out.logits[:, -1, :].float().cpu()
        st = {"pkv": out.past_key_values,
              "tok": out.logits[:, -1:, :].argmax(-1), "toks": []}
        out = outs = None
        before = handle.schedule() if handle is not None else None
        with sdpa_ctx():
            dts, dwall = ctx.series(lambda: step(st), n_dec)
        s2 = stats() if stats else None
        if before is not None:
            _say_decode_schedule(label, before, handle.schedule())
        toks = [int(t.item()) for t in st["toks"]]
        st = None
    res.update(prefill_ms=med(pts), prefill_all=pts, prefill_wall=pwall,
               decode_ms=sum(dts) / len(dts), decode_med=med(dts),
               decode_wall=dwall, tokens=n_dec, token_ids=toks,
               logits=logits)
    say("   %s: prefill 1x%d %.2f ms (median of %s; wall %.2f) | decode "
        "%.2f ms/token (mean of %d; median %.2f, wall %.2f)" % (
            label, ids.shape[1], res["prefill_ms"],
            " ".join("%.2f" % t for t in pts), pwall, res["decode_ms"],
            n_dec, res["decode_med"], dwall))
    if stats:
        def d(a, b, k):
            # copies, ring_waits, stream_waits are counted per device only
            sec = ("device" if k in ("copies", "ring_waits", "stream_waits")
                   else "model")
            return b[sec][k] - a[sec][k]
        pf = copied(s0, s1) / cfg.prefill_reps
        dc = copied(s1, s2) / n_dec
        res["prefill_bytes"], res["decode_bytes"] = pf, dc
        say("   %s: copied a prefill %.3f GB, a token %.3f GB (staged + "
            "filled + prefetched); over the decode: weights staged %d, "
            "filled %d, copies %d, ring waits %d, stream waits %d, "
            "prefetch %.2f GB (used %.2f, dropped %.2f), "
            "pages committed %d, evicted %d" % (
                label, pf / GB, dc / GB, d(s1, s2, "weight_staged"),
                d(s1, s2, "weight_fills"), d(s1, s2, "copies"),
                d(s1, s2, "ring_waits"), d(s1, s2, "stream_waits"),
                d(s1, s2, "prefetch_bytes") / GB,
                d(s1, s2, "prefetch_used_bytes") / GB,
                d(s1, s2, "prefetch_dropped_bytes") / GB,
                d(s1, s2, "pages_committed"), d(s1, s2, "pages_evicted")))
    return res


def _say_decode_schedule(label, before, after):
    """The schedule the decode ran on (planned from the prefills): its
    ring, resident bytes, predicted forward and the plans made again
    during the decode (the room watched: a KV cache that grows)."""
    if not before or not after:
        say("   %s: no measured schedule at the decode" % label)
        return
    say("   %s: the decode ran on the prefills' schedule: ring %d MiB, "
        "resident %.3f GB in %d weights, predicted %.2f ms a prefill; "
        "made again %d times during the decode" % (
            label, after["staging"] >> 20, after["resident_bytes"] / GB,
            after["resident_weights"], after["predicted_ms"],
            after["replans"] - before["replans"]))


def _same(ref, res):
    if ref is None or res is None:
        return "n/a"
    eq = torch.equal(ref["logits"], res["logits"])
    diff = (ref["logits"] - res["logits"]).abs().max().item()
    n = min(len(ref["token_ids"]), len(res["token_ids"]))
    same_toks = ref["token_ids"][:n] == res["token_ids"][:n]
    return "prefill logits %s (max |diff| %.3g), %d greedy tokens %s" % (
        "bitwise equal" if eq else "DIFFER", diff, n,
        "equal" if same_toks else "DIFFER")


def bench_llama(ctx, cfg):
    c = cfg.llama
    say("\n2. Llama-shaped decoder: hidden %d, FFN %d, %d layers, %d heads / "
        "%d kv heads, vocab %d, bf16, random weights; prefill 1x%d, then "
        "greedy decode of %d tokens on its KV cache (after %d warm-up "
        "tokens); SDPA backends: %s" % (
            c["hidden"], c["inter"], c["layers"], c["heads"], c["kv_heads"],
            c["vocab"], cfg.prefill, cfg.decode, cfg.warm_decode,
            _SDPA["names"]))
    t0 = time.perf_counter()
    model, what = build_decoder(ctx, cfg)
    ctx.sync()
    wbytes = weight_bytes(model)
    budget = int(wbytes * cfg.budget_frac)
    say("   model: %s; %.3f GB of weights (%d tensors), built on %s in "
        "%.1f s; budget %.3f GB (two thirds)" % (
            what, wbytes / GB, len(list(model.parameters())), ctx.device,
            time.perf_counter() - t0, budget / GB))
    out = RESULTS.setdefault("llama", {"model": what,
                                        "weight_bytes": wbytes,
                                        "budget": budget})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (1, cfg.prefill), generator=g).to(
        ctx.device)
    runs = {}
    # (a) all resident
    try:
        say("   (a) all weights resident on %s; %s" % (ctx.device, ctx.mem()))
        runs["resident"] = run_decoder(ctx, cfg, model, ids, "resident")
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        say("   (a) FAILED")
    # The offloaded variants start from the model on the CPU.
    t0 = time.perf_counter()
    model = model.to("cpu")
    ctx.empty_cache()
    say("   model moved to the CPU in %.1f s; %s" % (
        time.perf_counter() - t0, ctx.mem()))
    # (b) vpager
    usable = True
    try:
        t0 = time.perf_counter()
        h = vt.offload(model, device=ctx.device, budget=budget,
                       **ctx.vp_opts)
        t_off = time.perf_counter() - t0
        o = h.device.options
        s = h.stats()["model"]
        say("   (b) vpager.torch.offload(model, device=%s, budget=%.3f GB) in "
            "%.1f s: %d weights in %d units, VBAR %.3f GB; page %s, "
            "staging %s, lookahead %s, order %s" % (
                ctx.device, budget / GB, t_off, s["weights"], s["units"],
                s["vbar_bytes"] / GB, size_str(o["page_size"]),
                size_str(o["staging_size"]), size_str(o["lookahead"]),
                h.order))
        try:
            runs["vpager"] = run_decoder(ctx, cfg, model, ids, "vpager",
                                         stats=h.stats, handle=h)
            s = h.stats()
            say("   vpager: resident %.3f GB of %.3f (budget %.3f); device "
                "committed %.3f GB; %s" % (
                    s["model"]["resident_bytes"] / GB,
                    s["model"]["weight_bytes"] / GB,
                    budget / GB, s["device"]["committed_bytes"] / GB,
                    ctx.mem()))
            runs["vpager"]["resident_bytes"] = s["model"]["resident_bytes"]
        finally:
            t0 = time.perf_counter()
            try:
                h.unload()
                say("   vpager: unload() in %.1f s" % (
                    time.perf_counter() - t0))
            except Exception:  # noqa: BLE001
                usable = False
                traceback.print_exc(file=sys.stdout)
                try:
                    h.close()
                except Exception:  # noqa: BLE001
                    pass
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        say("   (b) FAILED")
    ctx.empty_cache()
    # (c) accelerate
    try:
        runs["accelerate"] = _accelerate(ctx, cfg, model if usable else None,
                                         ids, budget)
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        say("   (c) FAILED")
    del model
    ctx.empty_cache()
    # Ratios and targets
    ref, vp, acc = (runs.get(k) for k in ("resident", "vpager", "accelerate"))
    for k, r in runs.items():
        if r:
            out[k] = {kk: v for kk, v in r.items() if kk != "logits"}
    if vp and ref:
        say("   outputs, vpager vs resident: %s" % _same(ref, vp))
    if acc and ref:
        say("   outputs, accelerate vs resident: %s" % _same(ref, acc))
    for phase, key, bkey in (("prefill", "prefill_ms", "prefill_bytes"),
                             ("decode", "decode_ms", "decode_bytes")):
        unit = "ms" if phase == "prefill" else "ms/token"
        line = []
        if vp and acc:
            x = acc[key] / vp[key]
            line.append("accelerate/vpager %.2fx (%.2f vs %.2f %s), %s" % (
                x, acc[key], vp[key], unit,
                target("2. %s: vpager speed-up over accelerate" % phase, x,
                       ">=", 5.0)))
        if vp and ref:
            link_ms = vp[bkey] / (ctx.link * GB) * 1e3
            bound = max(ref[key], link_ms)
            x = vp[key] / bound
            floor_ms = max(0, wbytes - budget) / (ctx.link * GB) * 1e3
            line.append("vpager / max(resident %.2f, copied %.3f GB / %.1f "
                        "GB/s = %.2f) = %.3f, %s (for scale: weights - budget"
                        " = %.3f GB = %.2f ms at the link)" % (
                            ref[key], vp[bkey] / GB, ctx.link, link_ms, x,
                            target("2. %s: vpager / max(resident, bytes/link)"
                                   % phase, x, "<=", 1.1),
                            max(0, wbytes - budget) / GB, floor_ms))
            out.setdefault("ratios", {})[phase] = {"vp_over_bound": x,
                                                   "bound_ms": bound}
        if vp and acc:
            out.setdefault("ratios", {}).setdefault(phase, {})[
                "acc_over_vp"] = acc[key] / vp[key]
        if line:
            say("   %s: %s" % (phase, "; ".join(line)))


def _accelerate(ctx, cfg, model, ids, budget):
    try:
        import accelerate
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.hooks import remove_hook_from_submodules
    except Exception as e:  # noqa: BLE001
        say("   (c) accelerate: SKIPPED, not importable (%s: %s)" % (
            type(e).__name__, str(e).splitlines()[0][:160] if str(e) else ""))
        return None
    if not ctx.cuda:
        say("   (c) accelerate: SKIPPED in the dry run (needs a GPU)")
        return None
    if model is None:
        say("   (c) accelerate: the model was not restored by unload(); "
            "building a new one")
        model, _ = build_decoder(ctx, cfg)
        model = model.to("cpu")
        ctx.empty_cache()
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    gpu = ctx.device.index or 0
    max_memory = {gpu: budget, "cpu": int(host_ram() * 0.9)}
    t0 = time.perf_counter()
    dmap = infer_auto_device_map(model, max_memory=max_memory,
                                 no_split_module_classes=no_split,
                                 dtype=cfg.dtype)
    model = dispatch_model(model, device_map=dmap)
    ctx.sync()
    t_disp = time.perf_counter() - t0
    on_gpu = sum(p.numel() * p.element_size() for p in model.parameters()
                 if p.device.type == "cuda")
    where = {}
    for k, v in dmap.items():
        where.setdefault(str(v), []).append(k)
    say("   (c) accelerate %s: infer_auto_device_map(max_memory={%d: %.3f GB,"
        " 'cpu': %.0f GB}, no_split_module_classes=%s) + dispatch_model in "
        "%.1f s: %s; parameters on the GPU %.3f GB of the %.3f GB budget" % (
            accelerate.__version__, gpu, budget / GB,
            max_memory["cpu"] / GB, no_split, t_disp,
            "; ".join("%s: %d entries (%s ... %s)" % (
                d, len(ks), ks[0], ks[-1]) for d, ks in where.items()),
            on_gpu / GB, budget / GB))
    try:
        res = run_decoder(ctx, cfg, model, ids, "accelerate")
        res["gpu_bytes"] = on_gpu
        return res
    finally:
        try:
            remove_hook_from_submodules(model)
        except Exception:  # noqa: BLE001
            pass
        del model
        ctx.empty_cache()


# ------------------------------------------------------- 3. DiT-like stack

class DiTBlock(nn.Module):
    """Pre-norm attention + 4x GELU MLP (DiT's block without the adaLN
    modulation): its weights are read by its children's forwards."""

    def __init__(self, d, heads, mlp):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp * d)
        self.fc2 = nn.Linear(mlp * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(
            b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = attention(q, k, v, causal=False)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)),
                                   approximate="tanh"))


def bench_dit(ctx, cfg):
    c = cfg.dit
    if not cfg.dry and elapsed() > cfg.soft_limit_s and cfg.dit_steps > 8:
        say("\n   (%.0f s already spent, past the %.0f s plan: DiT steps cut "
            "from %d to 8)" % (elapsed(), cfg.soft_limit_s, cfg.dit_steps))
        cfg.dit_steps = 8
    t0 = time.perf_counter()
    with building(ctx.device, cfg.dtype):
        model = nn.Sequential(*[DiTBlock(c["hidden"], c["heads"], c["mlp"])
                                for _ in range(c["layers"])])
    model = finish(model, ctx.device, cfg.dtype)
    ctx.sync()
    wbytes = weight_bytes(model)
    budget = cfg.dit_budget or int(wbytes * cfg.budget_frac)
    say("\n3. DiT-like stack: %d blocks of hidden %d (%d heads, %dx GELU MLP,"
        " LayerNorms, biases; no adaLN), bf16, %.3f GB of weights (built in "
        "%.1f s); input %d x %d tokens; vpager budget %.3f GB; %d steps, the "
        "first (cold) apart; SDPA backends: %s" % (
            c["layers"], c["hidden"], c["heads"], c["mlp"], wbytes / GB,
            time.perf_counter() - t0, c["batch"], c["tokens"], budget / GB,
            cfg.dit_steps, _SDPA["names"]))
    out = RESULTS.setdefault("dit", {"weight_bytes": wbytes,
                                      "budget": budget,
                                      "layers": c["layers"]})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(c["batch"], c["tokens"], c["hidden"], generator=g).to(
        ctx.device, cfg.dtype)
    ys = {}

    def steps(label, stats=None):
        box = []
        with torch.no_grad():
            t_cold, y = ctx.once(lambda: sdpa_call(lambda: model(x)))
            s1 = stats() if stats else None
            n = cfg.dit_steps - 1
            if t_cold * n > cfg.dit_cap_s * 1e3 * 2:
                n = max(3, int(cfg.dit_cap_s * 1e3 / t_cold))
                say("   %s: cold step %.0f ms: timing %d steps" % (
                    label, t_cold, n))
            with sdpa_ctx():
                ts, wall = ctx.series(lambda: box.__setitem__(
                    slice(None), [model(x)]), n)
            s2 = stats() if stats else None
        ys[label] = box[0].float().cpu()
        box[:] = []
        r = {"cold_ms": t_cold, "step_ms": med(ts), "steps": ts,
             "wall_ms": wall}
        say("   %s: step 1 (cold) %.1f ms | steps 2-%d: %.2f ms median "
            "(min %.2f, max %.2f; wall %.2f a step)" % (
                label, t_cold, n + 1, r["step_ms"], min(ts), max(ts), wall))
        return r, s1, s2

    runs = {}
    try:
        runs["resident"], _, _ = steps("resident")
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        say("   resident: FAILED")
    t0 = time.perf_counter()
    model = model.to("cpu")
    ctx.empty_cache()
    say("   model moved to the CPU in %.1f s; %s" % (
        time.perf_counter() - t0, ctx.mem()))
    try:
        t0 = time.perf_counter()
        h = vt.offload(model, device=ctx.device, budget=budget,
                       **ctx.vp_opts)
        o = h.device.options
        s = h.stats()["model"]
        say("   vpager.torch.offload(device=%s, budget=%.3f GB) in %.1f s: "
            "%d weights in %d units; page %s, staging %s, lookahead %s, "
            "order %s" % (
                ctx.device, budget / GB, time.perf_counter() - t0,
                s["weights"], s["units"], size_str(o["page_size"]),
                size_str(o["staging_size"]), size_str(o["lookahead"]),
                h.order))
        try:
            r, s1, s2 = steps("vpager", stats=lambda: h.stats())
            d1, d2 = s1["device"], s2["device"]
            vmm = (d2["pages_committed"] - d1["pages_committed"] +
                   d2["pages_evicted"] - d1["pages_evicted"])
            n = len(r["steps"])
            streamed = copied(s1, s2) / n
            r["vmm_after_first"] = vmm
            r["streamed_bytes"] = streamed
            say("   vpager: after step 1: %d pages committed, %d evicted; "
                "steps 2-%d: %d committed, %d evicted; copied %.3f GB a step "
                "(%.1f ms at the link's %.1f GB/s); resident %.3f GB of "
                "%.3f" % (
                    d1["pages_committed"], d1["pages_evicted"], n + 1,
                    d2["pages_committed"] - d1["pages_committed"],
                    d2["pages_evicted"] - d1["pages_evicted"], streamed / GB,
                    streamed / (ctx.link * GB) * 1e3, ctx.link,
                    s2["model"]["resident_bytes"] / GB, s2["model"]["weight_bytes"] / GB))
            say("   vpager: VMM calls (pages committed + evicted) after the "
                "first step: %d, %s" % (vmm, target(
                    "3. DiT VMM calls after step 1", vmm, "<=", 0)))
            runs["vpager"] = r
        finally:
            ctx.sync()
            h.close()
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        say("   vpager: FAILED")
    model = None
    ctx.empty_cache()
    ref, vp = runs.get("resident"), runs.get("vpager")
    for k, r in runs.items():
        out[k] = r
    if ref and vp:
        x_ = vp["step_ms"] / ref["step_ms"]
        link_ms = vp.get("streamed_bytes", 0) / (ctx.link * GB) * 1e3
        say("   vpager/resident per step %.3f (%.2f vs %.2f ms; copies alone "
            "at the link %.2f ms), %s; outputs %s" % (
                x_, vp["step_ms"], ref["step_ms"], link_ms,
                    target("3. DiT step vpager/resident", x_, "<=", 1.05),
                    "bitwise equal" if torch.equal(ys["resident"],
                                                   ys["vpager"])
                    else "DIFFER (max |diff| %.3g)" % (
                        ys["resident"] - ys["vpager"]).abs().max().item()))
        out["ratio"] = x_


# ------------------------------------- 4-6. issue 13: real model shapes
#
# Each model at budgets of 1/3, 1/2 and 2/3 of its weights: ms per forward
# of vpager.torch.offload(model, device, budget) against all-resident and
# against the limit L = max(all-resident, (W - B + 2 w_max) / link)
# (benchlib.stream_limit_ms), bitwise equality with all-resident, bytes
# copied per forward (vpager stats) and how long the compute stream stood
# still in acquires (benchlib.WaitProbe, on one forward of its own).

def bitwise_equal(a, b):
    """Same bits (NaN included), compared as float32 on the CPU (exact for
    bf16)."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32),
                                                   b.view(torch.int32)))


def _finite_note(y):
    y = y.detach().float()
    return "max |out| %.3g%s" % (y.abs().max().item(), "" if bool(
        torch.isfinite(y).all()) else ", NOT all finite")


def largest_weight(model):
    return max(t.numel() * t.element_size() for t in model.parameters())


def _frac_name(f):
    return {1 / 3: "1/3", 1 / 2: "1/2", 2 / 3: "2/3"}.get(f, "%.3f" % f)


class _RMS(nn.Module):
    """Flux's QK norm: RMSNorm with a learned scale over the head dim."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return xf.to(x.dtype) * self.scale


class _QKNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.query_norm = _RMS(d)
        self.key_norm = _RMS(d)


class _Mod(nn.Module):
    """Flux's Modulation: one big Linear(d, n d) on silu(vec), vec a pooled
    1 x d vector: megabytes of weights for almost no compute."""

    def __init__(self, d, n):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(d, n * d)

    def forward(self, vec):
        return self.lin(F.silu(vec))[:, None, :].chunk(self.n, dim=-1)


class _MLPEmbed(nn.Module):
    def __init__(self, i, d):
        super().__init__()
        self.in_layer = nn.Linear(i, d)
        self.out_layer = nn.Linear(d, d)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class _SelfAttn(nn.Module):
    def __init__(self, d, head_dim):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = _QKNorm(head_dim)
        self.proj = nn.Linear(d, d)


class _FluxMLP(nn.Module):
    def __init__(self, d, mlp):
        super().__init__()
        self.fc1 = nn.Linear(d, mlp * d)
        self.fc2 = nn.Linear(mlp * d, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def _rope(x, pe):
    """Rotary embedding: pe = (cos, sin) of (L, D/2), float32."""
    cos, sin = pe
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos),
                       -1).flatten(-2).to(x.dtype)


def _split_heads(qkv, heads):
    b, t, d3 = qkv.shape
    return qkv.view(b, t, 3, heads, d3 // 3 // heads).permute(2, 0, 3, 1, 4)


def _flux_attn(q, k, v, pe):
    q, k = _rope(q, pe), _rope(k, pe)
    a = attention(q, k, v, causal=False)
    b, h, t, dh = a.shape
    return a.transpose(1, 2).reshape(b, t, h * dh)


class _Double(nn.Module):
    """Flux's double-stream block: image and text streams with their own
    modulation, attention qkv/proj and MLP linears, one joint attention."""

    def __init__(self, d, heads, mlp):
        super().__init__()
        self.heads = heads
        hd = d // heads
        for s in ("img", "txt"):
            setattr(self, s + "_mod", _Mod(d, 6))
            setattr(self, s + "_norm1", nn.LayerNorm(
                d, elementwise_affine=False, eps=1e-6))
            setattr(self, s + "_attn", _SelfAttn(d, hd))
            setattr(self, s + "_norm2", nn.LayerNorm(
                d, elementwise_affine=False, eps=1e-6))
            setattr(self, s + "_mlp", _FluxMLP(d, mlp))

    def _qkv(self, s, x, m):
        attn = getattr(self, s + "_attn")
        x = (1 + m[1]) * getattr(self, s + "_norm1")(x) + m[0]
        q, k, v = _split_heads(attn.qkv(x), self.heads)
        return attn.norm.query_norm(q), attn.norm.key_norm(k), v

    def _out(self, s, x, a, m):
        x = x + m[2] * getattr(self, s + "_attn").proj(a)
        h = (1 + m[4]) * getattr(self, s + "_norm2")(x) + m[3]
        return x + m[5] * getattr(self, s + "_mlp")(h)

    def forward(self, img, txt, vec, pe):
        mi, mt = self.img_mod(vec), self.txt_mod(vec)
        iq, ik, iv = self._qkv("img", img, mi)
        tq, tk, tv = self._qkv("txt", txt, mt)
        a = _flux_attn(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2),
                       torch.cat((tv, iv), 2), pe)
        nt = txt.shape[1]
        return (self._out("img", img, a[:, nt:], mi),
                self._out("txt", txt, a[:, :nt], mt))


class _Single(nn.Module):
    """Flux's single-stream block: one fused linear1 (qkv + MLP in) and
    linear2 (attention out + MLP out) over the joint sequence."""

    def __init__(self, d, heads, mlp):
        super().__init__()
        self.heads, self.d, self.mlp_d = heads, d, mlp * d
        self.linear1 = nn.Linear(d, 3 * d + self.mlp_d)
        self.linear2 = nn.Linear(d + self.mlp_d, d)
        self.norm = _QKNorm(d // heads)
        self.pre_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.modulation = _Mod(d, 3)

    def forward(self, x, vec, pe):
        shift, scale, gate = self.modulation(vec)
        h = (1 + scale) * self.pre_norm(x) + shift
        qkv, m = torch.split(self.linear1(h), [3 * self.d, self.mlp_d], -1)
        q, k, v = _split_heads(qkv.contiguous(), self.heads)
        a = _flux_attn(self.norm.query_norm(q), self.norm.key_norm(k), v, pe)
        return x + gate * self.linear2(
            torch.cat((a, F.gelu(m, approximate="tanh")), 2))


class _Final(nn.Module):
    def __init__(self, d, out):
        super().__init__()
        self.norm_final = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(d, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, -1)
        return self.linear((1 + scale) * self.norm_final(x) + shift)


def _t_embed(t, dim, dtype):
    half = dim // 2
    f = torch.exp(-torch.log(torch.tensor(10000.0)) *
                  torch.arange(half, dtype=torch.float32) / half).to(t.device)
    a = t.float()[:, None] * 1000.0 * f[None]
    return torch.cat((torch.cos(a), torch.sin(a)), -1).to(dtype)


class FluxDiT(nn.Module):
    """A Flux-class DiT in plain torch (the shapes of black-forest-labs'
    Flux: hidden 3072, 24 heads, MLP 4x, in 64 channels, T5 context 4096,
    pooled CLIP vector 768), with fewer blocks: bf16 weights, random."""

    def __init__(self, c):
        super().__init__()
        d, h, m = c["hidden"], c["heads"], c["mlp"]
        self.img_in = nn.Linear(c["in_ch"], d)
        self.time_in = _MLPEmbed(256, d)
        self.vector_in = _MLPEmbed(c["vec_in"], d)
        self.guidance_in = _MLPEmbed(256, d)
        self.txt_in = nn.Linear(c["ctx_in"], d)
        self.double_blocks = nn.ModuleList(_Double(d, h, m)
                                           for _ in range(c["double"]))
        self.single_blocks = nn.ModuleList(_Single(d, h, m)
                                           for _ in range(c["single"]))
        self.final_layer = _Final(d, c["in_ch"])
        self.head_dim = d // h

    def forward(self, img, txt, t, y, guidance):
        dt = img.dtype
        img = self.img_in(img)
        vec = (self.time_in(_t_embed(t, 256, dt)) +
               self.guidance_in(_t_embed(guidance, 256, dt)) +
               self.vector_in(y))
        txt = self.txt_in(txt)
        n = txt.shape[1] + img.shape[1]
        half = self.head_dim // 2
        inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32,
                                            device=img.device) / half))
        ang = torch.arange(n, dtype=torch.float32, device=img.device)[:, None] \
            * inv[None]
        pe = (torch.cos(ang), torch.sin(ang))
        for b in self.double_blocks:
            img, txt = b(img, txt, vec, pe)
        x = torch.cat((txt, img), 1)
        for b in self.single_blocks:
            x = b(x, vec, pe)
        return self.final_layer(x[:, txt.shape[1]:], vec)


class _TanhMM(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d, d))

    @classmethod
    def over(cls, w):
        """One whose weight is the tensor w (its memory, not a copy)."""
        m = cls(0)
        m.weight = nn.Parameter(w, requires_grad=False)
        return m

    def forward(self, x):
        return torch.tanh(x @ self.weight)


class SmallStack(nn.Module):
    """n layers of tanh(x @ W), W a d x d bf16 matrix (2 MiB at d = 1024)."""

    def __init__(self, n, d):
        super().__init__()
        self.layers = nn.ModuleList(_TanhMM(d) for _ in range(n))

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


def spread(n, k):
    """k of range(n) spread evenly (the streamed layers of a hand-written
    streamer that keeps n - k resident)."""
    return [i for i in range(n) if (i + 1) * k // n > i * k // n]


class HandStreamer:
    """A hand-written double-buffered streamer of SmallStack: the layers
    that fit in the budget beside two buffers stay resident (their device
    tensors), the rest (spread evenly) are copied from pinned host copies
    into two device buffers on a copy stream, each copy issued as soon as
    its buffer's last reader is queued, with events both ways. On the CPU
    (dry run) the copies are plain copy_() calls. modules: each layer is
    called as a _TanhMM module over its weight (the resident one or its
    buffer) rather than as tanh(x @ W): what running the model's modules
    adds, which no streamer that runs them can save."""

    def __init__(self, ctx, dev_ws, host_ws, budget, modules=False):
        w = dev_ws[0].numel() * dev_ws[0].element_size()
        n = len(dev_ws)
        keep = max(0, min(n, (budget - 2 * w) // w))
        self.streamed = spread(n, n - keep)
        s = set(self.streamed)
        self.ctx = ctx
        self.res = [None if i in s else dev_ws[i] for i in range(n)]
        self.host = [host_ws[i] if i in s else None for i in range(n)]
        self.bufs = [torch.empty_like(dev_ws[0]) for _ in range(2)]
        self.keep, self.w = keep, w
        if ctx.cuda:
            self.cs = torch.cuda.Stream()
            E = torch.cuda.Event
            self.ready = [E(), E()]
            self.free = [E(), E()]
        self.used = [False, False]
        self.wait_pairs = None      # [(event, event)] when probing
        self.mods = None
        if modules:
            ws = list(self.res)
            for k, i in enumerate(self.streamed):
                ws[i] = self.bufs[k % 2]
            self.mods = [_TanhMM.over(W) for W in ws]

    def _issue(self, k):
        j = k % 2
        src = self.host[self.streamed[k]]
        if not self.ctx.cuda:
            self.bufs[j].copy_(src)
            return
        with torch.cuda.stream(self.cs):
            if self.used[j]:
                self.cs.wait_event(self.free[j])
            self.bufs[j].copy_(src, non_blocking=True)
            self.ready[j].record(self.cs)

    def __call__(self, x):
        st = self.streamed
        for k in range(min(2, len(st))):
            self._issue(k)
        k = 0
        cuda = self.ctx.cuda
        main = torch.cuda.current_stream() if cuda else None
        for i, W in enumerate(self.res):
            if W is None:
                j = k % 2
                if cuda:
                    if self.wait_pairs is not None:
                        a = self.ctx.mark()
                    main.wait_event(self.ready[j])
                    if self.wait_pairs is not None:
                        self.wait_pairs.append((a, self.ctx.mark()))
                W = self.bufs[j]
            if self.mods is None:
                x = torch.tanh(x @ W)
            else:
                x = self.mods[i](x)
            if self.res[i] is None:
                if cuda:
                    self.free[j].record(main)
                self.used[j] = True
                if k + 2 < len(st):
                    self._issue(k + 2)
                k += 1
        return x


# Section 5's paired timing: blocks of PAIR_ITERS forwards of vpager and of
# the hand streamer, alternated PAIR_BLOCKS times, so that both see the
# same host (on the H200's VM one variant's forwards spread 54-88 ms
# between series minutes apart).
PAIR_BLOCKS, PAIR_ITERS = 4, 5
# Forwards run at most until the schedule settles before the timed ones.
SETTLE_LIMIT = 60


def _offload_runs(ctx, cfg, model, fwd, label, fracs, wbytes, w_max,
                  resident_ms, ref_out, out, extra_opts=None, beside=None):
    """For each budget fraction: offload the CPU model, a cold forward,
    timed forwards, one probed forward (compute-stream waits), stats,
    unload. fwd() -> output tensor. Fills out[frac name]. beside: {frac
    name: another forward} timed in alternation with vpager's (r["paired"]:
    the medians of each, all blocks)."""
    rows = []
    for f in fracs:
        budget = int(wbytes * f)
        fn = _frac_name(f)
        r = {"budget": budget}
        out[fn] = r
        try:
            t0 = time.perf_counter()
            opts = dict(ctx.vp_opts)
            opts.update(extra_opts or {})
            h = vt.offload(model, device=ctx.device, budget=budget, **opts)
            r["offload_s"] = time.perf_counter() - t0
            r["load_seconds"] = h.stats()["model"]["load_seconds"]
            o = h.device.options
            try:
                with torch.no_grad():
                    r["cold_ms"], _ = ctx.once(lambda: sdpa_call(fwd))
                    # The first forward is measured and the weights placed
                    # anew after it (vpager.torch's scheduler): one more
                    # untimed forward settles them.
                    r["warm_ms"], _ = ctx.once(lambda: sdpa_call(fwd))
                    # The planner's thread plans while forwards run on:
                    # time the forwards of the schedule it settles on.
                    r["settled_after"] = benchlib.settle(
                        h, lambda: ctx.once(lambda: sdpa_call(fwd)),
                        SETTLE_LIMIT)
                    s1 = h.stats()
                    box = []
                    with sdpa_ctx():
                        ts, wall = ctx.series(
                            lambda: box.__setitem__(slice(None), [fwd()]),
                            cfg.i13_iters)
                    s2 = h.stats()
                    sch = h.schedule() or {}
                    y = box[0]
                    box[:] = []
                    probe = benchlib.WaitProbe(ctx, h.vbar_layout.units, h.hot_path)
                    with sdpa_ctx(), probe:
                        fwd()
                    ctx.sync()
                    wait_ms = probe.total_ms()
                    wait_host_ms = probe.host_ms()
                    other = (beside or {}).get(fn)
                    if other is not None:
                        r["paired"] = _paired(ctx, fwd, other)
                    if h.hot_path.held_units:
                        r["held_pair"] = _held_pair(ctx, fwd, h)
                n = len(ts)
                d = stats_delta(s1["model"], s2["model"])
                dd = stats_delta(s1["device"], s2["device"])
                r.update(ms=med(ts), all_ms=ts, wall_ms=wall,
                         copied_bytes=copied_bytes(d) / n,
                         copies=dd["copies"] / n,
                         stream_waits=dd["stream_waits"] / n,
                         ring_waits=dd["ring_waits"] / n,
                         vmm=(dd["pages_committed"] + dd["pages_evicted"]),
                         wait_ms=wait_ms, waits_probed=probe.count(),
                         wait_host_ms=wait_host_ms,
                         held=len(h.hot_path.held_units),
                         resident_bytes=s2["model"]["resident_bytes"],
                         staging=o["staging_size"], lookahead=o["lookahead"],
                         page=o["page_size"], units=s2["model"]["units"],
                         predicted_ms=sch.get("predicted_ms"),
                         replans=sch.get("replans"), rings=sch.get("rings"),
                         equal=bitwise_equal(y, ref_out))
            finally:
                t0 = time.perf_counter()
                h.unload()
                r["unload_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
            say("   %s budget %s: FAILED (%s: %s)" % (label, fn,
                                                    type(e).__name__, e))
            r["error"] = "%s: %s" % (type(e).__name__, e)
            ctx.empty_cache()
            continue
        lim, link_ms = benchlib.stream_limit_ms(resident_ms, wbytes, budget,
                                                w_max, ctx.link)
        r.update(limit_ms=lim, link_term_ms=link_ms,
                 vs_resident=r["ms"] / resident_ms, vs_limit=r["ms"] / lim)
        say("   %s budget %s (%.3f GB; staging %s, lookahead %s, %d units, "
            "%d held; "
            "offload %.1f s%s): %.2f ms (cold %.1f, warm-up %.1f, settled %s; %s) = %.3fx resident, "
            "%.3fx L (L = max(%.2f, %.2f)); copied %.3f GB/fwd in %.0f "
            "copies, resident %.3f GB; schedule predicted %s, re-made %s; "
            "compute stream waited %.2f ms in %d "
            "acquires (probed fwd; their host time %.2f ms); VMM after "
            "cold %d; outputs %s" % (
                label, fn, budget / GB, size_str(r["staging"]),
                size_str(r["lookahead"]), r["units"], r["held"],
                r["offload_s"],
                "".join(", %s %.2f" % (k[:-2].replace("_", " "), v)
                        for k, v in sorted(r["load_seconds"].items())),
                r["ms"], r["cold_ms"], r["warm_ms"],
                _settled_str(r.get("settled_after")),
                " ".join("%.2f" % t for t in ts),
                r["vs_resident"], r["vs_limit"], resident_ms, link_ms,
                r["copied_bytes"] / GB, r["copies"], r["resident_bytes"] / GB,
                "n/a" if r["predicted_ms"] is None
                else "%.2f ms" % r["predicted_ms"], r["replans"], wait_ms,
                probe.count(), wait_host_ms, r["vmm"],
                "bitwise equal" if r["equal"] else "DIFFER"))
        rows.append((fn, r))
        ctx.empty_cache()
    return rows


def _settled_str(n):
    """settle()'s count as printed: after how many more forwards the
    schedule settled."""
    if n is None:
        return "not within %d forwards" % SETTLE_LIMIT
    return "after %d forward%s" % (n, "" if n == 1 else "s")


def _paired(ctx, fwd, other):
    """Medians (ms) of fwd() and other() timed in alternating blocks."""
    a, b = [], []
    for _ in range(PAIR_BLOCKS):
        b += ctx.series(other, PAIR_ITERS)[0]
        a += ctx.series(fwd, PAIR_ITERS)[0]
    return {"ms": med(a), "other_ms": med(b), "all_ms": a, "other_all_ms": b}


def _held_pair(ctx, fwd, h):
    """Medians (ms) of fwd() with the schedule's held units held and with
    every unit on the per-unit path (HotPath.set_held(()), as
    VPAGER_HOLD=0), in alternating blocks: the in-run baseline of
    holding."""
    hot = h.hot_path
    held = hot.held_units
    a, b = [], []
    try:
        for _ in range(PAIR_BLOCKS):
            hot.set_held(())
            b += ctx.series(fwd, PAIR_ITERS)[0]
            hot.set_held(held)
            a += ctx.series(fwd, PAIR_ITERS)[0]
    finally:
        hot.set_held(held)
    return {"ms": med(a), "per_unit_ms": med(b), "ratio": med(a) / med(b),
            "held": len(held)}


def _held_line(fn, r):
    p = r.get("held_pair")
    if p:
        say("   budget %s: %d units held: %.2f ms, per-unit path %.2f ms "
            "(held / per-unit %.3f, %d alternating blocks of %d)" % (
                fn, p["held"], p["ms"], p["per_unit_ms"], p["ratio"],
                PAIR_BLOCKS, PAIR_ITERS))


def _i13_targets(name, rows, goals):
    for fn, r in rows:
        g = goals.get(fn)
        if g is not None:
            target("%s at %s: vpager / L" % (name, fn), r["vs_limit"], "<=",
                   g)
        target("%s at %s: outputs bitwise equal" % (name, fn),
               1.0 if r["equal"] else 0.0, ">=", 1.0)


def bench_flux(ctx, cfg):
    c = cfg.flux
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with building(ctx.device, cfg.dtype):
        model = FluxDiT(c)
    model = randomize(finish(model, ctx.device, cfg.dtype))
    ctx.sync()
    wbytes, w_max = weight_bytes(model), largest_weight(model)
    say("\n4. Flux-class DiT (issue 13): %d double-stream + %d single-stream "
        "blocks, hidden %d, %d heads, MLP %dx, bf16, %.3f GB of weights "
        "(%d tensors, largest %.1f MiB; built in %.1f s); input %d image + "
        "%d text tokens, pooled vector 1 x %d; %d timed forwards per "
        "variant after a cold one; SDPA: %s" % (
            c["double"], c["single"], c["hidden"], c["heads"], c["mlp"],
            wbytes / GB, len(list(model.parameters())), w_max / MiB,
            time.perf_counter() - t0, c["img"], c["txt"], c["vec_in"],
            cfg.i13_iters, _SDPA["names"]))
    out = RESULTS.setdefault("flux", {"weight_bytes": wbytes,
                                      "w_max": w_max, "config": dict(c)})
    g = torch.Generator().manual_seed(2)

    def inp(*shape):
        return torch.randn(*shape, generator=g).to(ctx.device, cfg.dtype)
    img, txt = inp(1, c["img"], c["in_ch"]), inp(1, c["txt"], c["ctx_in"])
    y = inp(1, c["vec_in"])
    tt = torch.full((1,), 0.5, device=ctx.device)
    gd = torch.full((1,), 3.5, device=ctx.device)

    def fwd():
        return model(img, txt, tt, y, gd)
    with torch.no_grad():
        ctx.once(lambda: sdpa_call(fwd))
        box = []
        with sdpa_ctx():
            ts, _ = ctx.series(lambda: box.__setitem__(slice(None), [fwd()]),
                               cfg.i13_iters + 1)
    ref = box[0].float().cpu()
    res_ms = med(ts)
    out["resident_ms"] = res_ms
    say("   all-resident: %.2f ms (%s); %s" % (res_ms, " ".join(
        "%.2f" % t for t in ts), _finite_note(ref)))
    model = model.to("cpu")
    ctx.empty_cache()
    rows = _offload_runs(ctx, cfg, model, fwd, "vpager", cfg.i13_fracs,
                         wbytes, w_max, res_ms, ref, out)
    _i13_targets("4. Flux", rows, {"1/3": 1.15, "1/2": 1.10, "2/3": 1.10})


def bench_small(ctx, cfg):
    n, d, b = cfg.small["layers"], cfg.small["d"], cfg.small["batch"]
    torch.manual_seed(0)
    with building(ctx.device, cfg.dtype):
        model = SmallStack(n, d)
    model = randomize(finish(model, ctx.device, cfg.dtype))
    # tanh(x @ W) stays in range with W ~ N(0, 1/d)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_((1.0 / d) ** 0.5 / 0.02)
    ctx.sync()
    wbytes, w_max = weight_bytes(model), largest_weight(model)
    say("\n5. small weights (issue 13): %d x tanh(x @ W), W %d x %d bf16 "
        "(%s each), %.3f GB; batch %d; %d timed forwards per variant; "
        "hand-written double-buffered streamer in the same run" % (
            n, d, d, size_str(w_max), wbytes / GB, b, cfg.i13_iters))
    out = RESULTS.setdefault("small", {"weight_bytes": wbytes,
                                       "w_max": w_max, "layers": n, "d": d,
                                       "batch": b})
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, d, generator=g).to(ctx.device, cfg.dtype)
    with torch.no_grad():
        ctx.once(lambda: model(x))
        box = []
        ts, _ = ctx.series(lambda: box.__setitem__(slice(None), [model(x)]),
                           cfg.i13_iters + 1)
    ref = box[0].float().cpu()
    res_ms = med(ts)
    out["resident_ms"] = res_ms
    say("   all-resident: %.2f ms (%s); %s" % (res_ms, " ".join(
        "%.2f" % t for t in ts), _finite_note(ref)))
    # The hand streamer: resident layers are the model's device tensors,
    # streamed ones come from pinned host copies.
    dev_ws = [m.weight.data for m in model.layers]
    t0 = time.perf_counter()
    wsz = dev_ws[0].numel() * dev_ws[0].element_size()
    pool = torch.empty(len(dev_ws) * wsz, dtype=torch.uint8,
                       pin_memory=ctx.cuda)     # one pinned allocation
    host_ws = [pool[i * wsz:(i + 1) * wsz].view(w.dtype).view(w.shape)
               for i, w in enumerate(dev_ws)]
    for h_, w in zip(host_ws, dev_ws):
        h_.copy_(w)
    say("   host copies for the hand streamer in %.1f s" % (
        time.perf_counter() - t0))
    hand, streamers = {}, {}
    for f in cfg.i13_fracs:
        fn = _frac_name(f)
        budget = int(wbytes * f)
        hs = HandStreamer(ctx, dev_ws, host_ws, budget)
        with torch.no_grad():
            ctx.once(lambda: hs(x))
            box = []
            ts, _ = ctx.series(lambda: box.__setitem__(slice(None), [hs(x)]),
                               cfg.i13_iters)
            eq = bitwise_equal(box[0], ref)
            box[:] = []
            wait = float("nan")
            if ctx.cuda:
                hs.wait_pairs = []
                hs(x)
                ctx.sync()
                wait = sum(ctx.ms(a, c) for a, c in hs.wait_pairs)
                hs.wait_pairs = None
        lim, link_ms = benchlib.stream_limit_ms(res_ms, wbytes, budget,
                                                w_max, ctx.link)
        hand[fn] = {"ms": med(ts), "all_ms": ts, "equal": eq,
                    "streamed": len(hs.streamed), "wait_ms": wait,
                    "copied_bytes": len(hs.streamed) * hs.w,
                    "limit_ms": lim, "vs_limit": med(ts) / lim}
        say("   hand streamer budget %s (%.3f GB): %.2f ms (%s) = %.3fx "
            "resident, %.3fx L (L = max(%.2f, %.2f)); %d of %d layers "
            "streamed (%.3f GB/fwd), compute stream waited %s "
            "(probed fwd); outputs %s" % (
                fn, budget / GB, med(ts), " ".join("%.2f" % t for t in ts),
                med(ts) / res_ms, med(ts) / lim, res_ms, link_ms,
                len(hs.streamed), n, len(hs.streamed) * hs.w / GB,
                "%.2f ms" % wait if ctx.cuda else "n/a (CPU copies)",
                "bitwise equal" if eq else "DIFFER"))
        # The same streamer calling a module per layer, against it in
        # alternating blocks: vpager runs the model's modules, and the
        # hand streamer above does not.
        hm = HandStreamer(ctx, dev_ws, host_ws, budget, modules=True)
        with torch.no_grad():
            ctx.once(lambda: hm(x))
            eq_m = bitwise_equal(hm(x), ref)
            p = _paired(ctx, lambda: hm(x), lambda: hs(x))
        del hm
        hand[fn]["modules"] = {"vs_hand": p["ms"] / p["other_ms"],
                               "ms": p["ms"], "hand_ms": p["other_ms"],
                               "equal": eq_m}
        say("   hand streamer budget %s calling a module per layer: %.3fx "
            "the hand streamer in %d alternating blocks of %d (%.2f vs "
            "%.2f ms); outputs %s" % (
                fn, p["ms"] / p["other_ms"], PAIR_BLOCKS, PAIR_ITERS,
                p["ms"], p["other_ms"],
                "bitwise equal" if eq_m else "DIFFER"))
        streamers[fn] = hs
    out["hand"] = hand
    # The hand streamers keep their device weights (the model's, left on
    # the device when it moves to the CPU) to run beside vpager's.
    model = model.to("cpu")
    ctx.empty_cache()

    def fwd():
        return model(x)

    def beside(hs):
        return lambda: hs(x)
    rows = _offload_runs(ctx, cfg, model, fwd, "vpager", cfg.i13_fracs,
                         wbytes, w_max, res_ms, ref, out, beside={
                             fn: beside(hs) for fn, hs in streamers.items()})
    streamers.clear()
    del host_ws, dev_ws, pool
    ctx.empty_cache()
    for fn, r in rows:
        _held_line(fn, r)
        hr = hand.get(fn)
        if hr and "paired" in r:
            r["vs_hand_apart"] = r["ms"] / hr["ms"]
            p = r["paired"]
            r["vs_hand"] = p["ms"] / p["other_ms"]
            say("   budget %s: vpager / hand streamer %.3f in %d alternating "
                "blocks of %d forwards (%.2f vs %.2f ms; %s | %s); timed "
                "apart %.3f, %s" % (
                    fn, r["vs_hand"], PAIR_BLOCKS, PAIR_ITERS, p["ms"],
                    p["other_ms"], " ".join("%.1f" % t for t in p["all_ms"]),
                    " ".join("%.1f" % t for t in p["other_all_ms"]),
                    r["vs_hand_apart"], target(
                        "5. small weights at %s: vpager / hand streamer" % fn,
                        r["vs_hand"], "<=", 1.15)))
            hm = hr.get("modules")
            if hm:
                r["vs_hand_modules"] = r["vs_hand"] / hm["vs_hand"]
                say("   budget %s: vpager / the hand streamer calling a "
                    "module per layer ~%.3f (%.3f / %.3f, two pairings)" % (
                        fn, r["vs_hand_modules"], r["vs_hand"],
                        hm["vs_hand"]))
    _i13_targets("5. small", rows, {})


def bench_llama3(ctx, cfg):
    """The Llama decoder of section 2 at three budgets: prefill and decode
    against all-resident and L (no accelerate: section 2 has it)."""
    c = cfg.llama
    sub = types.SimpleNamespace(**vars(cfg))
    sub.prefill_reps = cfg.i13_iters
    sub.decode = cfg.i13_decode
    sub.warm_decode = 2
    t0 = time.perf_counter()
    model, what = build_decoder(ctx, cfg)
    ctx.sync()
    wbytes, w_max = weight_bytes(model), largest_weight(model)
    say("\n6. Llama-shaped decoder at three budgets (issue 13): %s; %d "
        "layers, %.3f GB of weights (largest %.1f MiB), built in %.1f s; "
        "prefill 1x%d (%d timed), decode %d tokens" % (
            what, c["layers"], wbytes / GB, w_max / MiB,
            time.perf_counter() - t0, cfg.prefill, sub.prefill_reps,
            sub.decode))
    out = RESULTS.setdefault("llama3", {"weight_bytes": wbytes,
                                        "w_max": w_max, "model": what})
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c["vocab"], (1, cfg.prefill), generator=g).to(
        ctx.device)
    ref = run_decoder(ctx, sub, model, ids, "resident")
    out["resident"] = {k: v for k, v in ref.items() if k != "logits"}
    model = model.to("cpu")
    ctx.empty_cache()
    for f in cfg.i13_fracs:
        fn = _frac_name(f)
        budget = int(wbytes * f)
        r = {"budget": budget}
        out[fn] = r
        try:
            h = vt.offload(model, device=ctx.device, budget=budget,
                           **ctx.vp_opts)
            try:
                vp = run_decoder(ctx, sub, model, ids, "vpager " + fn,
                                 stats=h.stats, handle=h)
                # One probed prefill and one probed token.
                probe = benchlib.WaitProbe(ctx, h.vbar_layout.units, h.hot_path)
                pkw = {"use_cache": True}
                with torch.no_grad(), sdpa_ctx():
                    with probe:
                        o = model(input_ids=ids, **pkw)
                    ctx.sync()
                    wp = probe.total_ms()
                    tok = o.logits[:, -1:, :].argmax(-1)
                    with probe:
                        model(input_ids=tok, past_key_values=o.past_key_values,
                              **pkw)
                    ctx.sync()
                    wd = probe.total_ms()
                    o = None
            finally:
                h.unload()
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
            r["error"] = "%s: %s" % (type(e).__name__, e)
            ctx.empty_cache()
            continue
        r.update({k: v for k, v in vp.items() if k != "logits"})
        r["same"] = _same(ref, vp)
        r["equal"] = bool(torch.equal(ref["logits"], vp["logits"]) and
                          ref["token_ids"] == vp["token_ids"][
                              :len(ref["token_ids"])])
        r["prefill_wait_ms"], r["decode_wait_ms"] = wp, wd
        for ph in ("prefill", "decode"):
            lim, link_ms = benchlib.stream_limit_ms(
                ref[ph + "_ms"], wbytes, budget, w_max, ctx.link)
            x_ = vp[ph + "_ms"] / lim
            r[ph + "_limit_ms"], r[ph + "_vs_limit"] = lim, x_
            say("   vpager %s %s: %.2f ms = %.3fx resident (%.2f), %.3fx L "
                "(L = max(%.2f, %.2f)); copied %.3f GB, compute stream "
                "waited %.2f ms (probed), %s" % (
                    fn, ph, vp[ph + "_ms"], vp[ph + "_ms"] / ref[ph + "_ms"],
                    ref[ph + "_ms"], x_, ref[ph + "_ms"], link_ms,
                    vp[ph + "_bytes"] / GB, wp if ph == "prefill" else wd,
                    target("6. Llama %s at %s: vpager / L" % (ph, fn), x_,
                           "<=", 1.10)))
        say("   vpager %s: outputs %s" % (fn, r["same"]))
        target("6. Llama at %s: outputs bitwise equal" % fn,
               1.0 if r["equal"] else 0.0, ">=", 1.0)
        ctx.empty_cache()
    del model
    ctx.empty_cache()


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU and the simulated device, tiny sizes")
    ap.add_argument("--only", default="",
                    help="comma-separated sections to run (1-6)")
    ap.add_argument("--llama-layers", type=int, help="decoder layers (16)")
    ap.add_argument("--decode", type=int, help="decode tokens timed (32)")
    ap.add_argument("--dit-layers", type=int, help="DiT blocks (57)")
    ap.add_argument("--steps", type=int, help="DiT steps (20)")
    ap.add_argument("--small", action="store_true",
                    help="sections 4-6 (issue 13) at tiny sizes on any "
                    "device (as --dry-run sizes them)")
    ap.add_argument("--small-layers", type=int,
                    help="section 5: layers (1536; 96 with --dry-run)")
    ap.add_argument("--iters", type=int,
                    help="sections 4-6: timed forwards per variant (3)")
    ap.add_argument("--budgets", default="",
                    help="sections 4-6: budget fractions of the weights, "
                    "e.g. 0.5,0.667 (default 1/3,1/2,2/3)")
    args = ap.parse_args()
    only = {int(x) for x in args.only.split(",") if x.strip()}
    if not args.dry_run and not torch.cuda.is_available():
        say("bench_torch: no CUDA GPU visible to torch; use --dry-run for "
            "the CPU check")
        return 0
    cfg = Cfg(args.dry_run, args.small)
    if args.iters:
        cfg.i13_iters = max(1, args.iters)
    if args.budgets.strip():
        cfg.i13_fracs = tuple(float(x) for x in args.budgets.split(",")
                              if x.strip())
    if args.small_layers:
        cfg.small["layers"] = max(1, args.small_layers)
    if args.llama_layers:
        cfg.llama["layers"] = args.llama_layers
    if args.decode:
        cfg.decode = args.decode
    if args.dit_layers:
        cfg.dit["layers"] = args.dit_layers
    if args.steps:
        cfg.dit_steps = max(2, args.steps)
    ctx = Ctx(args.dry_run)
    if ctx.cuda:
        torch.cuda.init()
        torch.cuda.set_device(0)
    torch.manual_seed(0)
    for ln in machine_info(ctx):
        say(ln)
    say("mode: %s" % ("DRY RUN (CPU tensors, simulated device, tiny sizes: "
                      "the figures mean nothing)" if args.dry_run else
                      "GPU"))
    sdpa_init(ctx)
    try:
        measure_link(ctx)
    except Exception:  # noqa: BLE001
        traceback.print_exc(file=sys.stdout)
        ctx.link = 55.0
        say("link: FAILED to measure; using 55 GB/s (FACTS.md) for the "
            "bounds")
    for k, fn in ((1, bench_hotpath), (2, bench_llama), (3, bench_dit),
                  (4, bench_flux), (5, bench_small), (6, bench_llama3)):
        if only and k not in only:
            continue
        t0 = time.perf_counter()
        try:
            fn(ctx, cfg)
        except Exception as e:  # noqa: BLE001 - report, run the rest
            traceback.print_exc(file=sys.stdout)
            say("   FAILED: %s: %s" % (type(e).__name__, e))
            RESULTS.setdefault("errors", []).append(
                "section %d: %s: %s" % (k, type(e).__name__, e))
        try:
            ctx.empty_cache()
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=sys.stdout)
        dt = time.perf_counter() - t0
        RESULTS.setdefault("section_s", {})[str(k)] = dt
        say("   (section %d took %.1f s; %.1f s since the start)" % (
            k, dt, elapsed()))
    say("\ntargets:")
    for ln in benchlib.target_lines("   %-58s %10.3f %s %-7.2f %s"):
        say(ln)
    say("total run time %.1f s" % elapsed())
    RESULTS["targets"] = benchlib.targets_json()
    RESULTS["dry_run"] = args.dry_run
    benchlib.write_json("bench_torch.json", RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
