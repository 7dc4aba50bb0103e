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
     the first step (device pages_committed + pages_evicted; target 0).

    make -j16 && PYTHONUNBUFFERED=1 PYTHONPATH=python \
        python3 bench/bench_torch.py | tee $OUT/bench_torch.log
    PYTHONPATH=python /usr/bin/python3 bench/bench_torch.py --dry-run

--dry-run runs everything on the CPU with the simulated device and tiny
sizes (what CI and a laptop can check; no figure means anything there).
--only 1,3 runs some sections. Each section catches its own errors (the
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
    """Bytes vpager copied host->device between two stats() dicts."""
    return copied_bytes(stats_delta(a, b))


# ------------------------------------------------------------- settings

class Cfg:
    """Sizes. FULL for the GPU; DRY for --dry-run (CPU, simulated device)."""

    def __init__(self, dry):
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
                st0 = hd.stats()

                def call_off(iters):
                    for _ in range(iters):
                        offm(x)

                def call_plain(iters):
                    for _ in range(iters):
                        plain(x)
                ob, om = _best_med(call_off, ctx, cfg)
                pb, pm = _best_med(call_plain, ctx, cfg)
                st1 = hd.stats()
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


def run_decoder(ctx, cfg, model, ids, label, stats=None):
    """Warm-up (prefill + a few tokens), then timed prefills and a timed
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
        ctx.sync()
        say("   %s: cold prefill %.1f ms, warm-up decode %s ms" % (
            label, t_cold, " ".join("%.1f" % t for t in warm_ts)))
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
        with sdpa_ctx():
            dts, dwall = ctx.series(lambda: step(st), n_dec)
        s2 = stats() if stats else None
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
            if k in ("copies", "ring_waits", "stream_waits"):
                a, b = a["device"], b["device"]
            return b[k] - a[k]
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
        s = h.stats()
        say("   (b) vpager.torch.offload(model, device=%s, budget=%.3f GB) in "
            "%.1f s: %d weights in %d units, VBAR %.3f GB; page %s, "
            "staging %s, lookahead %s, order %s" % (
                ctx.device, budget / GB, t_off, s["weights"], s["units"],
                s["vbar_bytes"] / GB, size_str(o["page_size"]),
                size_str(o["staging_size"]), size_str(o["lookahead"]),
                h.order))
        try:
            runs["vpager"] = run_decoder(ctx, cfg, model, ids, "vpager",
                                         stats=h.stats)
            s = h.stats()
            say("   vpager: resident %.3f GB of %.3f (budget %.3f); device "
                "committed %.3f GB; %s" % (
                    s["resident_bytes"] / GB, s["weight_bytes"] / GB,
                    budget / GB, s["device"]["committed_bytes"] / GB,
                    ctx.mem()))
            runs["vpager"]["resident_bytes"] = s["resident_bytes"]
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
        s = h.stats()
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
                    s2["resident_bytes"] / GB, s2["weight_bytes"] / GB))
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


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU and the simulated device, tiny sizes")
    ap.add_argument("--only", default="",
                    help="comma-separated sections to run (1,2,3)")
    ap.add_argument("--llama-layers", type=int, help="decoder layers (16)")
    ap.add_argument("--decode", type=int, help="decode tokens timed (32)")
    ap.add_argument("--dit-layers", type=int, help="DiT blocks (57)")
    ap.add_argument("--steps", type=int, help="DiT steps (20)")
    args = ap.parse_args()
    only = {int(x) for x in args.only.split(",") if x.strip()}
    if not args.dry_run and not torch.cuda.is_available():
        say("bench_torch: no CUDA GPU visible to torch; use --dry-run for "
            "the CPU check")
        return 0
    cfg = Cfg(args.dry_run)
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
    for k, fn in ((1, bench_hotpath), (2, bench_llama), (3, bench_dit)):
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
