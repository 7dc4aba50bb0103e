#!/usr/bin/env python3
"""ComfyUI 0.33 sampling on the comfy_aimdo drop-in (issue 12 section 3):
the real client, unmodified, in library mode.

A random-weight Flux-class checkpoint (ComfyUI's own model classes; by
default 8 double + 16 single blocks, hidden 3072: 9.4 GiB bf16) is made
and saved as .safetensors in a temporary folder (--workdir), then sampled
at 1024x1024, euler, "simple", 6 steps, cfg 1 (one forward a step), in
one process per run:

  resident  the drop-in, no --reserve-vram: every weight stays resident
  6, 4      the drop-in under a budget of 6 and 4 GiB: --reserve-vram is
            (device total - budget) GiB, so vpager pages the weights
  legacy    (only if asked: --runs resident,legacy,...) ComfyUI's legacy
            ModelPatcher, --disable-dynamic-vram --gpu-only

Each run reproduces main.py's two init blocks (comfy.options.
enable_args_parsing() first, or --reserve-vram is ignored; comfy_aimdo.
control.init before torch, in its three call shapes; init_devices with a
generator; the log level; the CoreModelPatcher / aimdo_enabled switch),
loads the file with comfy.sd.load_diffusion_model (with UNETLoader's
model options for --weight-dtype, e.g. fp8_e4m3fn) and samples --reps
times (comfy.sample.sample), each as one node: afterwards what execution.
py does after every node (reset_cast_buffers, cleanup_prefetch_queues,
vbars_reset_watermark_limits). Reported per run and repetition: every
step's time (a callback that synchronizes the compute stream, or every
stream with VPAGER_BENCH_SYNC=device; the first step counts from the
call of sample(), so it holds the loading and every first fault), the
VBAR's resident bytes (ModelVBAR.loaded_size), control.
get_total_vram_usage, torch's reserved bytes and mem_get_info; and the
ratios that need no peer: first step / steady step (median of steps 2..n)
and steady step / the all-resident run's. Every repetition's latents are
compared bitwise with the all-resident run's same repetition (ComfyUI's
own outputs may differ between repetitions of one process; said where
they do). Exit 0; 1 when a run failed; 2 when latents differ.

    # ComfyUI 0.33.0 in build-clients/ComfyUI, comfy_kitchen, torchsde
    # and a trampoline module in build-clients/pydeps, laid out by
    # bench/clients/prepare.py (bench/clients/README.md; see --check):
    make -j16 && PYTHONUNBUFFERED=1 python3 bench/comfyui_run.py \\
        --comfyui build-clients/ComfyUI --out $OUT/comfyui
    python3 bench/comfyui_run.py --comfyui build-clients/ComfyUI --dry-run
    python3 bench/comfyui_run.py --check [--comfyui PATH]

--dry-run: a tiny model (1 + 1 blocks, hidden 256), 256x256, 3 steps,
runs resident and a 1 GiB budget: it checks the whole path in a minute
(not yet run on a GPU as such; the same path at --double 1 --single 2,
hidden 3072, 512x512 ran on the H200 on 2026-12-01).
It still needs CUDA and torch >= 2.8 (ComfyUI's dynamic VRAM has no CPU
path, and ComfyUI 0.33 does not import under older torch: the torch 1.13
of the CPU CI machines cannot run it, so CI runs only --check).
--check: says what is needed and what is missing (no import of ComfyUI,
torch or vpager); exit 0, or 3 with --strict when something is missing.

Needs: vpager built (VPAGER_LIBRARY, else build/libvpager.so), the
drop-in python/compat on the path (this script sets PYTHONPATH for its
children: python, python/compat, --deps, --comfyui), ComfyUI's Python
dependencies for library mode: numpy, einops, safetensors, transformers,
tokenizers, sentencepiece, scipy, tqdm, psutil, PIL, yaml, packaging,
torchvision (not av, aiohttp or the frontend: nothing of comfy/ imports
them). Never patches ComfyUI; writes nothing into the ComfyUI tree.
"""

import argparse
import copy
import cProfile
import ctypes
import faulthandler
import hashlib
import importlib.util
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# bench_node.py loads this file by path: its folder is not on sys.path.
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import copy_trace  # noqa: E402
import idle_cache  # noqa: E402
import step_timeline  # noqa: E402

ROOT = os.path.dirname(HERE)
GiB, MiB = 1 << 30, 1 << 20
TAG = "COMFYUI_RUN "          # children print their result as TAG + JSON


def _step_env(name):
    v = os.environ.get(name, "").strip()
    if v in ("", "0"):
        return 0
    if not v.isdigit():
        raise SystemExit("%s=%r: give a step number (1 is the first) or 0"
                         % (name, v))
    return int(v)


# VPAGER_BENCH_STEP_STATS=1: a vpager child prints, per step, what its
# pager's counters moved by (to find what differs between steps).
STEP_STATS = os.environ.get("VPAGER_BENCH_STEP_STATS") == "1"
STEP_KEYS = ("misses", "hits", "weight_staged", "staged_bytes",
             "prefetch_bytes", "prefetch_dropped_bytes", "ring_waits",
             "stream_waits", "evict_waits", "pages_evicted", "weight_fills")
# VPAGER_BENCH_TIMELINE=N: step N of each prompt timed module by module
# (bench/step_timeline.py, which also compares two runs' logs).
TIMELINE = _step_env("VPAGER_BENCH_TIMELINE")
# VPAGER_BENCH_START_PROFILE=1: with the timeline, the host's work from
# that step's start to its first module call under cProfile (what the GPU
# waited for before the step's first kernel).
START_PROFILE = os.environ.get("VPAGER_BENCH_START_PROFILE") == "1"
# VPAGER_BENCH_KINETO=N: step N of each prompt under torch.profiler's CUDA
# activity, its copies and kernels summed up (bench/copy_trace.py): whether
# the link ran slow or stood idle.
KINETO = _step_env("VPAGER_BENCH_KINETO")
# VPAGER_BENCH_KINETO_KEEP=DIR: each such trace also saved there, gzipped
# (the runtime's calls with them: when each copy was asked for and ran).
KINETO_KEEP = os.environ.get("VPAGER_BENCH_KINETO_KEEP", "")
# VPAGER_BENCH_IDLE_CACHE=N: torch's allocation history over steps N and
# N+1 of each prompt: how much of its cache no block touches across the
# pause between them (bench/idle_cache.py; Flux only).
IDLE_CACHE = _step_env("VPAGER_BENCH_IDLE_CACHE")
# VPAGER_BENCH_PROFILE=N: step N of each prompt under cProfile, its host
# functions by own time printed (PROFILE_TOP of them): where a host-bound
# step's time goes (the step_timeline's leads tell that it is one).
PROFILE = _step_env("VPAGER_BENCH_PROFILE")
PROFILE_TOP = 30
# VPAGER_BENCH_GOVERNOR=1: each change the device's Governor makes (limit,
# headroom, OOM margin), each read of torch's reserved and peak bytes it
# is given and each peak it masks (a fill's), printed with its time:
# where a replan's room came from.
GOVERNOR_LOG = os.environ.get("VPAGER_BENCH_GOVERNOR") == "1"
# VPAGER_BENCH_LEND_TRACE=1 (with VPAGER_LEND=1): torch's allocations
# recorded; when a loan of torch's cache shrinks (torch reserved more while
# it was out), the segments torch added since the loan was borrowed are
# printed with the Python frames that asked for them.
LEND_TRACE = os.environ.get("VPAGER_BENCH_LEND_TRACE") == "1"
# VPAGER_BENCH_LEND_ALTERNATE=1 (with VPAGER_LEND=1): after the first
# prompt, the device's loans are off and on in turn, off-on-on-off (a
# drift in the host's speed over the run falls on both alike): an A/B of
# lending in one process, under one plan (each prompt's result says which:
# "lending"; bench_node's prompts row compares them).
LEND_ALTERNATE = os.environ.get("VPAGER_BENCH_LEND_ALTERNATE") == "1"
# VPAGER_BENCH_CONDS_ON_DEVICE=1: the prompt's conditioning moved to the
# GPU once (ComfyUI's conds hand a device copy from their first step on),
# so a step makes none of its pageable host-to-device copies (Flux: the
# 4 MB context, 3 KB pooled, 4 B guidance, ~2 ms into each step): what
# a fill of the pause would gain if it never held up a client's copy (an
# experiment, not a user's setting).
CONDS_ON_DEVICE = os.environ.get("VPAGER_BENCH_CONDS_ON_DEVICE") == "1"
# VPAGER_BENCH_UNIT_SPIN=US: each unit's per-unit path (HotPath.enter)
# made US microseconds longer on the host: a step that grows by units x US
# is the host's (an experiment, not a user's setting).
def _spin_env(name="VPAGER_BENCH_UNIT_SPIN"):
    v = os.environ.get(name, "") or "0"
    try:
        us = float(v)
    except ValueError:
        us = -1.0
    if not 0 <= us < 1e6:
        raise SystemExit("%s=%r: give microseconds (0: none)" % (name, v))
    return us


UNIT_SPIN = _spin_env()
# How each step's end is taken. "stream" (default): the compute stream is
# synchronized, as ComfyUI's own per-step work (a preview's copy to the
# host) does; copies a pager has queued for the next step keep running, so
# the steps still add up to the sampling's wall time. "device": every
# stream (the figures before 2026-12-02), which makes a pager's prefetch
# for the next step finish before the step counts as done.
STEP_SYNC = os.environ.get("VPAGER_BENCH_SYNC", "stream")
if STEP_SYNC not in ("stream", "device"):
    raise SystemExit("VPAGER_BENCH_SYNC=%r: give stream or device"
                     % STEP_SYNC)

# ComfyUI's library-mode needs (import name, what provides it).
NEEDS = [
    ("torch", "PyTorch >= 2.8 with CUDA"), ("numpy", "numpy"),
    ("einops", "einops"), ("safetensors", "safetensors"),
    ("transformers", "transformers (>= 4.50)"), ("tokenizers", "tokenizers"),
    ("sentencepiece", "sentencepiece"), ("scipy", "scipy"),
    ("tqdm", "tqdm"), ("psutil", "psutil"), ("PIL", "Pillow"),
    ("yaml", "PyYAML"), ("packaging", "packaging"),
    ("torchvision", "torchvision"),
    ("comfy_kitchen", "comfy-kitchen 0.2.31 source (pure Python: its eager "
     "and triton backends)"),
    ("torchsde", "torchsde source (pure Python)"),
    ("trampoline", "a trampoline module (a few lines; torchsde imports it)"),
]


def say(*a):
    print(*a, flush=True)


# UNETLoader's weight_dtype choices (nodes.py), as model_options.
WEIGHT_DTYPES = ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


def unet_options(weight_dtype, torch):
    """The model_options UNETLoader hands comfy.sd.load_diffusion_model for
    its weight_dtype choice."""
    if weight_dtype == "fp8_e4m3fn":
        return {"dtype": torch.float8_e4m3fn}
    if weight_dtype == "fp8_e4m3fn_fast":
        return {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    if weight_dtype == "fp8_e5m2":
        return {"dtype": torch.float8_e5m2}
    return {}


# Checkpoints with quantized weights (--quant), written the way ComfyUI's
# converters write them, loaded by its normal loader (comfy.sd's
# convert_old_quants -> quant_config -> mixed_precision_ops):
# "scaled_fp8", the old layout (each quantized Linear's weight as
# float8_e4m3fn, its per-tensor float32 scale as <layer>.scale_weight, and
# the "scaled_fp8" marker tensor that convert_old_quants reads), and 0.33's
# own per-layer layout for the QUANT_ALGOS formats (<layer>.weight and its
# scales as the QuantizedTensor's state_dict writes them, and
# <layer>.comfy_quant, the JSON {"format": ...}): ComfyUI quantizes them.
QUANTS = ["none", "scaled_fp8", "float8_e4m3fn", "float8_e5m2",
          "int8_tensorwise", "nvfp4", "mxfp8"]


def quant_keys(sd):
    """The tensors a converter quantizes: the 2-D weights of the blocks'
    Linear layers (norms, embedders and the final layer stay as they
    are)."""
    return sorted(k for k, t in sd.items()
                  if k.endswith(".weight") and t.dim() == 2
                  and "blocks." in k)


def quantize_state(sd, quant, torch):
    """(a new state dict with quant_keys(sd) quantized as --quant says, its
    description). On the GPU; ComfyUI importable for the QUANT_ALGOS
    formats."""
    keys = quant_keys(sd)
    out = dict(sd)
    if quant == "scaled_fp8":
        fp8 = torch.float8_e4m3fn
        fmax = torch.finfo(fp8).max
        for k in keys:
            w = sd[k].to("cuda", torch.float32)
            scale = (w.abs().amax() / fmax).clamp(min=1e-12)
            out[k] = (w / scale).clamp(-fmax, fmax).to(fp8).cpu()
            out[k[:-len("weight")] + "scale_weight"] = scale.reshape(()).cpu()
        # Empty: per-layer fp8 matmul (2 elements would ask ComfyUI for
        # full-precision matmul).
        out["scaled_fp8"] = torch.empty(0, dtype=fp8)
    else:
        from comfy.quant_ops import QUANT_ALGOS, QuantizedTensor
        layout = QUANT_ALGOS[quant]["comfy_tensor_layout"]
        conf = torch.tensor(list(json.dumps({"format": quant}).encode()),
                            dtype=torch.uint8)
        for k in keys:
            # (the scale from the weight's absmax, as the converters
            # and ComfyUI's own requantizing compute it)
            qt = QuantizedTensor.from_float(sd[k].to("cuda"), layout,
                                            scale="recalculate")
            del out[k]
            for kk, v in qt.state_dict(k).items():
                out[kk] = v.cpu()
            out[k[:-len(".weight")] + ".comfy_quant"] = conf.clone()
    return out, {"format": quant, "layers": len(keys),
                 "tensors_in": len(sd), "tensors_out": len(out)}


def held(gen, weight_dtype="default"):
    """(W, w_max): the diffusion model's weight bytes as held on the GPU
    with this weight_dtype (fp8: one byte a value for the tensors in the
    model's dtype; the classes' float32 tensors stay float32), and its
    largest weight's."""
    h = gen.get("held", {}).get("fp8" if weight_dtype.startswith("fp8")
                                else "default")
    if h is None:
        return gen["bytes"], gen.get("w_max", 0)
    return h["bytes"], h["w_max"]


# ------------------------------------------------------------ arguments

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--comfyui", help="ComfyUI 0.33 source tree (its root)")
    p.add_argument("--deps", action="append", default=None,
                   help="a folder with comfy_kitchen, torchsde, trampoline "
                        "(repeatable; default: pydeps next to --comfyui)")
    p.add_argument("--out", default=None,
                   help="logs, latents' hashes, comfyui_run.json "
                        "(default: $OUT/comfyui or ./comfyui-run)")
    p.add_argument("--workdir", default=None,
                   help="where the checkpoint goes (default: a new "
                        "temporary folder, removed at the end)")
    p.add_argument("--runs", default=None,
                   help="comma list of resident, legacy and budgets in GiB "
                        "(default: resident,6,4; dry run: resident,1)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--size", type=int, default=None, help="image side, px")
    p.add_argument("--double", type=int, default=None)
    p.add_argument("--single", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--model", choices=["flux", "sdxl", "video"],
                   default="flux",
                   help="flux: the Flux-class DiT (--double, --single, "
                        "--hidden); sdxl: ComfyUI's SDXL UNet config "
                        "(dry run: Segmind Vega's, smaller); video: a Wan "
                        "2.1 T2V DiT (--layers blocks of --hidden, "
                        "--frames frames of --size x --size)")
    p.add_argument("--layers", type=int, default=None,
                   help="video: Wan blocks (default 8; dry run 1)")
    p.add_argument("--frames", type=int, default=None,
                   help="video: frames (default 21: 6 latent frames; "
                        "dry run 5)")
    p.add_argument("--lora", action="store_true",
                   help="flux: prompts base, LoRA A, A at strength 0.5, "
                        "LoRA B, B again, LoRA removed (random LoRAs in "
                        "ComfyUI's key conventions, loaded through "
                        "comfy.sd.load_lora_for_models); --reps ignored")
    p.add_argument("--vae", action="store_true",
                   help="flux: a VAE decode (ComfyUI's VAE class, Flux's "
                        "16-channel AutoencoderKL config, random weights) "
                        "after every prompt")
    p.add_argument("--weight-dtype", default="default", choices=WEIGHT_DTYPES,
                   help="UNETLoader's weight_dtype: the diffusion model is "
                        "loaded with ComfyUI's model options for it (the "
                        "file stays in its own dtype; default: as stored)")
    p.add_argument("--quant", default="none", choices=QUANTS,
                   help="the checkpoint's blocks' Linear weights quantized "
                        "as ComfyUI's converters write them: scaled_fp8 "
                        "(the scaled_fp8 marker + scale_weight), or a "
                        "comfy_quant format; loaded by ComfyUI's normal "
                        "loader (mixed-precision ops, QuantizedTensor)")
    p.add_argument("--switch", default=None, metavar="DxS",
                   help="flux: a second Flux-class model of D double + S "
                        "single blocks (same hidden), loaded beside the "
                        "first; prompts alternate first, second, first, "
                        "... (--reps of each): the model switch")
    p.add_argument("--cgroup-gib", type=float, default=None,
                   help="run each sampling child in a memory cgroup of "
                        "this many GiB (bench/memcap.py: cgroup v2 "
                        "memory.max, else v1); its peak and OOM kills "
                        "are reported (bench_node.py: but the reference "
                        "runs, resident and legacy, which run outside "
                        "it)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="say what is needed / missing, run nothing")
    p.add_argument("--strict", action="store_true",
                   help="with --check: exit 3 when something is missing")
    p.add_argument("--timeout", type=int, default=300,
                   help="seconds per child process")
    p.add_argument("--child", choices=["gen", "sample"], help=argparse.SUPPRESS)
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--tag", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--ckpt2", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    d = a.dry_run
    full = {"steps": 6, "size": 1024, "double": 8, "single": 16,
            "hidden": 3072, "layers": 8, "frames": 21}
    dry = {"steps": 3, "size": 256, "double": 1, "single": 1,
           "hidden": 256, "layers": 1, "frames": 5}
    if a.model == "video":
        full.update(size=640, hidden=5120)
        dry.update(size=128)
    for k in full:
        if getattr(a, k) is None:
            setattr(a, k, dry[k] if d else full[k])
    if a.runs is None:
        a.runs = "resident,1" if d else "resident,6,4"
    if a.hidden % 128:
        p.error("--hidden must be a multiple of 128 (Flux's rope axes, "
                "Wan's heads)")
    if a.size % 16:
        p.error("--size must be a multiple of 16")
    if a.frames % 4 != 1:
        p.error("--frames must be 4k + 1 (Wan's temporal compression)")
    if (a.lora or a.vae or a.switch) and a.model != "flux":
        p.error("--lora, --vae and --switch are for --model flux")
    a.switch_shape = None
    if a.switch is not None:
        d, x, sgl = a.switch.partition("x")
        if not (x and d.isdigit() and sgl.isdigit()) or int(d) + int(sgl) < 1:
            p.error("--switch %r: give D x S blocks of the second model, "
                    "e.g. 19x38" % a.switch)
        a.switch_shape = (int(d), int(sgl))
        if a.switch_shape == (a.double, a.single):
            p.error("--switch %s: the second model must differ from the "
                    "first (%dx%d)" % (a.switch, a.double, a.single))
        if a.lora:
            p.error("--switch with --lora: one workflow at a time")
    if a.cgroup_gib is not None and a.cgroup_gib <= 0:
        p.error("--cgroup-gib %r: give a positive number of GiB"
                % a.cgroup_gib)
    if a.quant != "none" and a.weight_dtype != "default":
        p.error("--quant and --weight-dtype: one or the other")
    if a.comfyui and a.deps is None:
        a.deps = [os.path.join(os.path.dirname(os.path.abspath(a.comfyui)),
                               "pydeps")]
    a.deps = [os.path.abspath(x) for x in (a.deps or []) if os.path.isdir(x)]
    return a


def child_path(a):
    """sys.path entries of a child: vpager, the drop-in, deps, ComfyUI."""
    return [os.path.join(ROOT, "python"), os.path.join(ROOT, "python",
            "compat")] + a.deps + [os.path.abspath(a.comfyui)]


# ---------------------------------------------------------------- check

def check(a):
    """What the run needs, what is there; nothing imported."""
    missing = []
    old = list(sys.path)
    sys.path[:0] = child_path(a) if a.comfyui else [
        os.path.join(ROOT, "python"), os.path.join(ROOT, "python", "compat")]
    try:
        for mod, what in NEEDS:
            try:
                ok = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):
                ok = False
            note = ""
            if ok and mod == "torch":
                v = _torch_version()
                note = " (found %s)" % v
                try:
                    too_old = tuple(int(x) for x in v.split(".")[:2]) < (2, 8)
                except ValueError:
                    too_old = False
                if too_old:
                    ok = False
                    note += ": too old"
            say("  %-14s %-8s %s%s" % (mod, "ok" if ok else "MISSING", what,
                                       note))
            if not ok:
                missing.append(mod)
        drop = importlib.util.find_spec("comfy_aimdo")
        where = os.path.dirname(drop.origin) if drop and drop.origin else None
        ours = where == os.path.join(ROOT, "python", "compat", "comfy_aimdo")
        say("  %-14s %-8s %s" % ("comfy_aimdo", "ok" if ours else "MISSING",
                                 "the drop-in (python/compat), found: %s"
                                 % where))
        if not ours:
            missing.append("comfy_aimdo (drop-in)")
    finally:
        sys.path[:] = old
    lib = os.environ.get("VPAGER_LIBRARY") or os.path.join(
        ROOT, "build", "libvpager.so")
    ok = os.path.exists(lib)
    say("  %-14s %-8s %s" % ("libvpager", "ok" if ok else "MISSING", lib))
    if not ok:
        missing.append("libvpager.so (make; or VPAGER_LIBRARY)")
    ver = None
    if a.comfyui:
        try:
            with open(os.path.join(a.comfyui, "comfyui_version.py")) as f:
                ver = f.read().split('__version__ = "')[1].split('"')[0]
        except (OSError, IndexError):
            pass
    say("  %-14s %-8s %s" % ("ComfyUI", "ok" if ver else "MISSING",
                             "%s at %s" % (ver, a.comfyui) if ver else
                             "--comfyui PATH (0.33.0 tree)"))
    if not ver:
        missing.append("ComfyUI tree (--comfyui)")
    say("also needed: a CUDA GPU (dynamic VRAM has no CPU path)")
    if missing:
        say("NOT READY, missing: %s" % ", ".join(missing))
    else:
        say("READY")
    return 3 if (missing and a.strict) else 0


def _torch_version():
    """torch's version read off disk (torch/version.py), not imported."""
    try:
        spec = importlib.util.find_spec("torch")
        with open(os.path.join(os.path.dirname(spec.origin),
                               "version.py")) as f:
            for ln in f:
                if ln.startswith("__version__"):
                    return ln.split("=", 1)[1].strip().strip("'\"")
    except (OSError, AttributeError, ImportError):
        pass
    return "?"


# --------------------------------------------------------- child helpers

def device_total_bytes(index=0):
    """Device memory total through the CUDA driver (no context is made, so
    nothing is taken from the budget), or None."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        if cu.cuInit(0) != 0:
            return None
        dev = ctypes.c_int()
        if cu.cuDeviceGet(ctypes.byref(dev), index) != 0:
            return None
        tot = ctypes.c_size_t()
        if cu.cuDeviceTotalMem_v2(ctypes.byref(tot), dev) != 0:
            return None
        return tot.value
    except OSError:
        return None


def comfy_argv(a):
    """ComfyUI's command line for this run."""
    if a.run == "legacy":
        return ["--disable-dynamic-vram", "--gpu-only"], None
    if a.run == "resident":
        return [], None
    budget = float(a.run) * GiB
    total = device_total_bytes()
    if total is None:
        raise SystemExit("cannot read the device's total memory (libcuda)")
    return ["--reserve-vram", "%.6f" % ((total - budget) / GiB)], total


def comfy_init(extra_argv):
    """main.py's block A, in library mode (before torch)."""
    sys.argv = [sys.argv[0]] + list(extra_argv)
    import comfy.options
    comfy.options.enable_args_parsing()
    from comfy.cli_args import args, enables_dynamic_vram
    torch_before = "torch" in sys.modules
    import comfy_aimdo.control
    shape = None
    if enables_dynamic_vram():
        h = None if args.reserve_vram is None else int(
            args.reserve_vram * 1024 ** 3)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=h,
                                     nvml_pressure=not args.disable_nvml_pressure)
            shape = "init(simple_vram_headroom, nvml_pressure)"
        except TypeError:
            try:
                comfy_aimdo.control.init(simple_vram_headroom=h)
                shape = "init(simple_vram_headroom)"
            except TypeError:
                comfy_aimdo.control.init()
                shape = "init()"
    return args, shape, torch_before


def comfy_init_devices(args):
    """main.py's block B: init_devices, the log level, the patcher switch."""
    import logging
    import comfy_aimdo.control
    import comfy.utils  # noqa: F401  (main.py imports these first)
    import comfy.model_management as mm
    import comfy.memory_management
    import comfy.model_patcher
    from comfy.cli_args import enables_dynamic_vram, get_console_log_level

    def supported():
        if mm.is_nvidia():
            return True
        return mm.is_amd() and getattr(mm, "rocm_version", (0, 0)) >= (7, 14)

    state = "legacy"
    if args.enable_dynamic_vram or (enables_dynamic_vram() and supported()):
        if (not args.enable_dynamic_vram) and mm.torch_version_numeric < (2, 8):
            state = "legacy (torch < 2.8)"
        else:
            try:
                ok = comfy_aimdo.control.init_devices(
                    (d.index, int(args.vram_headroom * 1024 ** 3))
                    for d in mm.get_all_torch_devices())
            except TypeError:
                ok = comfy_aimdo.control.init_devices(
                    d.index for d in mm.get_all_torch_devices())
            if ok:
                level = get_console_log_level(args.verbose)
                c = comfy_aimdo.control
                if level == "DEBUG":
                    c.set_log_debug()
                elif level == "DETAIL":
                    try:
                        c.set_log_detail()
                    except AttributeError:
                        c.set_log_info()
                elif level == "CRITICAL":
                    c.set_log_critical()
                elif level == "ERROR":
                    c.set_log_error()
                elif level == "WARNING":
                    c.set_log_warning()
                else:
                    c.set_log_info()
                comfy.model_patcher.CoreModelPatcher = \
                    comfy.model_patcher.ModelPatcherDynamic
                comfy.memory_management.aimdo_enabled = True
                state = "dynamic"
                logging.info("DynamicVRAM support detected and enabled")
            else:
                state = "legacy (init_devices failed)"
    return state


def flux_keys(a):
    """The keys (meta tensors) that make ComfyUI detect a Flux (dev) model
    of this size."""
    import torch
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa
    h = a.hidden
    ctx = 4096 if not a.dry_run else 256
    sd = {"img_in.weight": m(h, 64), "txt_in.weight": m(h, ctx),
          "vector_in.in_layer.weight": m(h, 768),
          "guidance_in.in_layer.weight": m(h, 256)}
    for i in range(a.double):
        sd["double_blocks.%d.img_attn.norm.key_norm.scale" % i] = m(128)
    for i in range(a.single):
        sd["single_blocks.%d.norm.key_norm.scale" % i] = m(128)
    return sd, ctx


def wan_keys(a):
    """The keys (meta tensors) that make ComfyUI detect a Wan 2.1 T2V DiT of
    --layers blocks of width --hidden (Wan 14B: 5120, ffn 13824, 40
    blocks)."""
    import torch
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.float16)  # noqa
    h = a.hidden
    ffn = max(128, int(round(h * 2.7 / 128)) * 128)
    sd = {"head.modulation": m(1, 2, h), "head.head.weight": m(64, h),
          "patch_embedding.weight": m(h, 16, 1, 2, 2)}
    for i in range(a.layers):
        sd["blocks.%d.ffn.0.weight" % i] = m(ffn, h)
    return sd


def sdxl_config(a):
    """ComfyUI's SDXL UNet config, as its model detection reads it off an
    SDXL checkpoint; dry run: Segmind Vega's (an SDXL class, transformer
    depth 1/2 instead of 2/10)."""
    import torch
    if a.dry_run:
        depth, out, mid = [0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 2, 2, 2], 0
    else:
        depth, out, mid = [0, 0, 2, 2, 10, 10], \
            [0, 0, 0, 2, 2, 2, 10, 10, 10], 10
    return {"use_checkpoint": False, "image_size": 32, "out_channels": 4,
            "use_spatial_transformer": True, "legacy": False,
            "num_classes": "sequential", "adm_in_channels": 2816,
            "dtype": torch.float16, "in_channels": 4, "model_channels": 320,
            "num_res_blocks": [2, 2, 2], "transformer_depth": depth,
            "channel_mult": [1, 2, 4], "transformer_depth_middle": mid,
            "use_linear_in_transformer": True, "context_dim": 2048,
            "num_head_channels": 64, "transformer_depth_output": out,
            "use_temporal_attention": False, "use_temporal_resblock": False}


def model_keys(a):
    """(keys for ComfyUI's detection, unet config or None: detect it)."""
    if a.model == "flux":
        return flux_keys(a)[0], None
    if a.model == "video":
        return wan_keys(a), None
    return {}, sdxl_config(a)


def random_state(module, g, torch, dtype, keep_fp32=False):
    """ComfyUI-class module's state dict with random values: norms' 1-D
    weights (and Flux's .scale) 1, other 1-D tensors N(0, 0.02), the rest
    N(0, 1/fan_in); (state dict on the CPU in dtype, bytes). keep_fp32:
    tensors the module holds in float32 (ops ComfyUI's class makes in
    float32 whatever the model's dtype, such as Wan's patch_embedding)
    stay float32."""
    sd, nbytes = {}, 0
    for name, t in sorted(module.state_dict().items()):
        if t.dim() == 1 and ("norm" in name or name.endswith(".scale")
                             or not name.endswith(".bias")):
            v = torch.ones(t.shape, device="cuda", dtype=torch.float32)
        elif t.dim() <= 1:
            v = torch.randn(t.shape, generator=g, device="cuda") * 0.02
        else:
            fan_in = t[0].numel()
            v = torch.randn(t.shape, generator=g, device="cuda") \
                * (1.0 / fan_in ** 0.5)
        to = torch.float32 if keep_fp32 and t.dtype == torch.float32 \
            else dtype
        sd[name] = v.to(to).cpu()
        nbytes += sd[name].numel() * sd[name].element_size()
    return sd, nbytes


def link_gbps(torch):
    """Pinned host->device copies of 128 MiB (8 a round from 1 GiB
    pinned, 7 rounds after a warm-up): (the fastest round's GB/s, the
    median's). L takes the fastest: a limit is what the link can do (the
    median read 53.9-55.5 GB/s across processes of one H100 host)."""
    n = 128 * MiB
    src = torch.empty(8 * n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    ts = []
    for r in range(8):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(8):
            dst.copy_(src[i * n:(i + 1) * n], non_blocking=True)
        torch.cuda.synchronize()
        if r:                       # the first round warms up
            ts.append(time.perf_counter() - t0)
    del src, dst
    return 8 * n / min(ts) / 1e9, 8 * n / statistics.median(ts) / 1e9


def lora_files(a, dm, torch, g):
    """Two random LoRAs for the Flux model dm, in ComfyUI's conventions:
    A kohya-style (lora_unet_<key>.lora_up/.lora_down/.alpha) on each
    double block's img_attn.qkv and img_mlp.0 and each single block's
    linear2; B diffusers-style (transformer.<diffusers key>.lora_B/.lora_A:
    comfy.utils.flux_to_diffusers, to_k a slice of img_attn.qkv) on each
    double block's to_k and ff.net.2 and each single block's to_q (a
    slice of linear1). Paths and the patched keys of each."""
    from safetensors.torch import save_file
    r = 16
    sdm = dict(dm.named_parameters())

    def pair(out_dim, in_dim, scale):
        up = torch.randn(out_dim, r, generator=g, device="cuda") * scale
        down = torch.randn(r, in_dim, generator=g, device="cuda") \
            * (1.0 / in_dim ** 0.5)
        return up.to(torch.bfloat16).cpu(), down.to(torch.bfloat16).cpu()

    A, akeys = {}, []
    for i in range(a.double):
        for k in ("double_blocks.%d.img_attn.qkv" % i,
                  "double_blocks.%d.img_mlp.0" % i):
            akeys.append(k)
    for i in range(a.single):
        akeys.append("single_blocks.%d.linear2" % i)
    for k in akeys:
        w = sdm[k + ".weight"]
        up, down = pair(w.shape[0], w.shape[1], 0.05)
        name = "lora_unet_" + k.replace(".", "_")
        A[name + ".lora_up.weight"] = up
        A[name + ".lora_down.weight"] = down
        A[name + ".alpha"] = torch.tensor(float(r))
    B, bkeys = {}, []
    h = a.hidden
    for i in range(a.double):
        up, down = pair(h, h, 0.05)
        B["transformer.transformer_blocks.%d.attn.to_k.lora_B.weight" % i] = up
        B["transformer.transformer_blocks.%d.attn.to_k.lora_A.weight" % i] \
            = down
        bkeys.append("double_blocks.%d.img_attn.qkv" % i)
        w = sdm["double_blocks.%d.img_mlp.2.weight" % i]
        up, down = pair(w.shape[0], w.shape[1], 0.05)
        B["transformer.transformer_blocks.%d.ff.net.2.lora_B.weight" % i] = up
        B["transformer.transformer_blocks.%d.ff.net.2.lora_A.weight" % i] \
            = down
        bkeys.append("double_blocks.%d.img_mlp.2" % i)
    for i in range(a.single):
        up, down = pair(h, h, 0.05)
        B["transformer.single_transformer_blocks.%d.attn.to_q.lora_B.weight"
          % i] = up
        B["transformer.single_transformer_blocks.%d.attn.to_q.lora_A.weight"
          % i] = down
        bkeys.append("single_blocks.%d.linear1" % i)
    out = {}
    for tag, sd, keys in (("a", A, akeys), ("b", B, bkeys)):
        path = os.path.join(a.workdir, "lora_%s.safetensors" % tag)
        save_file(sd, path)
        out[tag] = {"path": path, "tensors": len(sd),
                    "bytes": os.path.getsize(path),
                    "weights": ["diffusion_model.%s.weight" % k
                                for k in keys]}
    return out


def vae_file(a, torch, g):
    """Flux's VAE (comfy.sd.VAE's default branch with 16 latent channels:
    ComfyUI's AutoencodingEngine, Encoder/Decoder) with random weights."""
    from safetensors.torch import save_file
    from comfy.ldm.models.autoencoder import AutoencodingEngine
    dd = {"double_z": True, "z_channels": 16, "resolution": 256,
          "in_channels": 3, "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4],
          "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    mod = "comfy.ldm.modules.diffusionmodules.model."
    vae = AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder."
                                      "DiagonalGaussianRegularizer"},
        encoder_config={"target": mod + "Encoder", "params": dd},
        decoder_config={"target": mod + "Decoder", "params": dd})
    sd, nbytes = random_state(vae, g, torch, torch.bfloat16)
    path = os.path.join(a.workdir, "flux_vae_random.safetensors")
    save_file(sd, path)
    return {"path": path, "bytes": nbytes, "tensors": len(sd),
            "file_bytes": os.path.getsize(path)}


def child_gen(a):
    """Make the random-weight checkpoint with ComfyUI's own classes (and,
    as asked, the LoRAs and the VAE); measure the link."""
    import logging
    logging.basicConfig(level=logging.WARNING)
    sys.argv = [sys.argv[0]]
    import torch
    import comfy.model_detection as md
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    keys, cfg = model_keys(a)
    if cfg is None:
        cfg = md.detect_unet_config(keys, "")
    mc = md.model_config_from_unet_config(cfg, keys)
    if mc is None:
        raise SystemExit("ComfyUI did not detect a model from %s" % cfg)
    # Flux: bf16 (ComfyUI's first choice for it); SDXL and Wan: fp16, what
    # ComfyUI 0.33 computes them in on an H200 (unet_dtype: fp16 first).
    dtype = torch.bfloat16 if a.model == "flux" else torch.float16
    mc.set_inference_dtype(dtype, None)
    model = mc.get_model(keys, "", device=torch.device("cuda"))
    dm = model.diffusion_model
    if a.model == "flux":
        res = {"warmup": warm(a, dm, flux_keys(a)[1], torch)}
    else:
        res = {"warmup": "skipped (%s)" % a.model}
    g = torch.Generator(device="cuda").manual_seed(a.seed)
    sd, nbytes = random_state(dm, g, torch, dtype, keep_fp32=True)
    if a.lora:
        res["lora"] = lora_files(a, dm, torch, g)
    del dm, model
    if a.quant != "none":
        sd, res["quant"] = quantize_state(sd, a.quant, torch)
        # The weights as the loaded model holds them: the stored bytes
        # (ComfyUI's QuantizedTensor keeps payload and scales; its other
        # layers stay in the file's dtype); the marker is read, not held.
        nbytes = sum(t.numel() * t.element_size() for k, t in sd.items()
                     if k != "scaled_fp8" and not k.endswith(".comfy_quant"))
    t1 = time.perf_counter()
    if a.model == "flux":
        name = "flux_random_%dd%ds_%d" % (a.double, a.single, a.hidden)
    elif a.model == "video":
        name = "wan_random_%dl_%d" % (a.layers, a.hidden)
    else:
        name = "sdxl_random%s" % ("_vega" if a.dry_run else "")
    if a.quant != "none":
        name += "_" + a.quant
    path = os.path.join(a.workdir, name + ".safetensors")
    save_file(sd, path)
    t2 = time.perf_counter()
    if a.vae:
        res["vae"] = vae_file(a, torch, g)
    torch.cuda.empty_cache()
    link = link_gbps(torch)
    res.update({"path": path, "bytes": nbytes,
                "file_bytes": os.path.getsize(path),
                "tensors": len(sd), "model": a.model,
                "w_max": max(t.numel() * t.element_size()
                             for t in sd.values()),
                "held": {"default": {"bytes": nbytes, "w_max": max(
                    t.numel() * t.element_size() for t in sd.values())},
                         "fp8": {"bytes": sum(fp8_size(t) for t in
                                              sd.values()),
                                 "w_max": max(fp8_size(t)
                                              for t in sd.values())}},
                "dtype": str(dtype).replace("torch.", ""),
                "fp32_tensors": sorted(k for k, t in sd.items()
                                       if t.dtype == torch.float32),
                "unet_config": {k: str(v) for k, v in cfg.items()},
                "model_config": type(mc).__name__,
                "context_dim": flux_keys(a)[1] if a.model == "flux" else None,
                "make_s": t1 - t0, "save_s": t2 - t1,
                "link_GBps": link[0], "link_GBps_median": link[1]})
    say(TAG + json.dumps(res))


def fp8_size(t):
    """Bytes of a checkpoint tensor held as fp8 (weight_dtype fp8: every
    tensor in the model's dtype; float32 ones stay)."""
    import torch
    if t.dtype == torch.float32:
        return t.numel() * 4
    return t.numel()


def warm(a, dm, ctx, torch):
    """One forward at the sampled shapes before the weights are filled:
    it checks that the model runs, and fills whatever compile cache on
    disk the GPU path has (comfy_kitchen's triton backend, when enabled)
    before any timed run."""
    try:
        s = a.size // 8
        t0 = time.perf_counter()
        with torch.no_grad():
            dm(torch.randn(1, 16, s, s, device="cuda", dtype=torch.bfloat16),
               torch.tensor([0.5], device="cuda"),
               torch.randn(1, 256, ctx, device="cuda", dtype=torch.bfloat16),
               y=torch.randn(1, 768, device="cuda", dtype=torch.bfloat16),
               guidance=torch.tensor([3.5], device="cuda"))
        torch.cuda.synchronize()
        return "one forward, %.2f s" % (time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001
        return "failed: %s: %s" % (type(e).__name__, str(e)[:300])


def sample_inputs(a, patcher, torch, comfy):
    """(positive, negative, latent) of a prompt for --model, as the text
    encoders would hand them (random, seeded)."""
    g = torch.Generator().manual_seed(a.seed + 1)
    s = a.size // 8
    if a.model == "flux":
        _, ctx = flux_keys(a)
        cond = torch.randn(1, 256, ctx, generator=g)
        pooled = torch.randn(1, 768, generator=g)
        extra = {"pooled_output": pooled, "guidance": 3.5}
        zero = {"pooled_output": torch.zeros_like(pooled), "guidance": 3.5}
        latent = torch.zeros(1, 16, s, s)
    elif a.model == "sdxl":
        cond = torch.randn(1, 77, 2048, generator=g)
        pooled = torch.randn(1, 1280, generator=g)
        extra = {"pooled_output": pooled, "width": a.size, "height": a.size}
        zero = dict(extra, pooled_output=torch.zeros_like(pooled))
        latent = torch.zeros(1, 4, s, s)
    else:
        cond = torch.randn(1, 512, 4096, generator=g)
        extra, zero = {}, {}
        latent = torch.zeros(1, 16, (a.frames - 1) // 4 + 1, s, s)
    pos = [[cond, extra]]
    neg = [[torch.zeros_like(cond), zero]]
    latent = comfy.sample.fix_empty_latent_channels(patcher, latent)
    return pos, neg, latent


def prompts(a, patcher, comfy, res, second=None):
    """[(label, patcher)]: the prompts of this run. --switch (second: the
    second model's patcher): the two models in turn, --reps of each,
    labelled first0, second0, first1, ... --lora: the base
    model, then ComfyUI's LoraLoader path (comfy.utils.load_torch_file,
    comfy.sd.load_lora_for_models) for LoRA A at 1.0, A at 0.5, B at 1.0,
    B's same patcher again (nothing to refill), then the base model again
    (the LoRA removed)."""
    if second is not None:          # --switch: first, second, first, ...
        return [x for i in range(a.reps) for x in
                (("first%d" % i, patcher), ("second%d" % i, second))]
    if not a.lora:
        return [("rep%d" % i, patcher) for i in range(a.reps)]
    import comfy.utils
    lo = {}
    for tag in ("a", "b"):
        path = os.path.join(a.workdir, "lora_%s.safetensors" % tag)
        lo[tag] = comfy.utils.load_torch_file(path, safe_load=True)
    pa = comfy.sd.load_lora_for_models(patcher, None, lo["a"], 1.0, 0)[0]
    pa5 = comfy.sd.load_lora_for_models(patcher, None, lo["a"], 0.5, 0)[0]
    pb = comfy.sd.load_lora_for_models(patcher, None, lo["b"], 1.0, 0)[0]
    res["lora_patched"] = {"a": len(pa.patches), "b": len(pb.patches)}
    return [("base", patcher), ("lora_a", pa), ("lora_a@0.5", pa5),
            ("lora_b", pb), ("lora_b_again", pb), ("removed", patcher)]


def _same_patches(x, y):
    """ComfyUI patch lists that give the same weight: item by item the
    same patch objects and equal strengths, offsets and functions."""
    x, y = list(x or ()), list(y or ())
    if len(x) != len(y):
        return False
    for p, q in zip(x, y):
        if len(p) != len(q):
            return False
        for u, v in zip(p, q):
            if u is v:
                continue
            if hasattr(u, "shape") or hasattr(v, "shape") or \
                    type(u).__module__.startswith("comfy"):
                return False
            try:
                if u != v:
                    return False
            except Exception:   # noqa: BLE001
                return False
    return True


def patch_change(prev, cur):
    """Weights whose patch set differs between two patchers (what must be
    refilled from new bytes): (count, bytes, keys patched now, how many
    of the count their op patches at each use: a quantized ComfyUI-GGUF
    weight through the node, whose bytes never change)."""
    pp = prev.patches if prev is not None else {}
    cp = cur.patches
    params = dict(cur.model.named_parameters())
    at_use = getattr(cur, "_ggml", None)
    n = b = u = 0
    for k in set(pp) | set(cp):
        if _same_patches(pp.get(k), cp.get(k)):
            continue
        n += 1
        t = params.get(k)
        if t is not None:
            b += t.numel() * t.element_size()
            u += at_use is not None and bool(at_use(t))
    return n, b, len(cp), u


def _delta(after, before):
    """after - before of the numeric counters in two 'vpager' dicts."""
    if not after:
        return None
    before = before or {}
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def child_sample(a):
    # A child that hangs leaves every thread's stack in its log before the
    # parent kills it at --timeout.
    faulthandler.dump_traceback_later(max(5, a.timeout - 10), exit=False)
    if GOVERNOR_LOG:
        log_governor()
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(message)s")
    extra, total = comfy_argv(a)
    args, shape, torch_before = comfy_init(extra)
    state = comfy_init_devices(args)
    import torch
    if LEND_TRACE:
        trace_lend()
    import comfy.sd
    import comfy.sample
    import comfy.utils
    import comfy.model_management as mm
    import comfy.memory_management
    import comfy.model_prefetch
    import comfy_aimdo.control
    import comfy_aimdo.model_vbar
    if CONDS_ON_DEVICE:
        import comfy.conds
        conds_on_device(comfy.conds, mm.get_torch_device())
    spun = spin_units(UNIT_SPIN) if UNIT_SPIN else None
    res = {"run": a.run, "comfy_argv": extra, "device_total": total,
           "init_shape": shape, "torch_imported_before_control": torch_before,
           "patcher_state": state,
           "aimdo_enabled": bool(comfy.memory_management.aimdo_enabled),
           "comfy_aimdo": os.path.dirname(comfy_aimdo.control.__file__)}
    res["host_before_load"] = host_memory()
    t0 = time.perf_counter()
    opts = unet_options(a.weight_dtype, torch)
    res["weight_dtype"] = a.weight_dtype
    patcher = comfy.sd.load_diffusion_model(a.ckpt, model_options=opts)
    res["load_s"] = time.perf_counter() - t0
    res["patcher"] = type(patcher).__name__
    res["model_size"] = patcher.model_size()
    res["model_class"] = type(patcher.model).__name__
    try:
        res["unet_dtype"] = str(patcher.model.get_dtype())
    except Exception:   # noqa: BLE001
        pass
    second = None
    if a.ckpt2:
        t0 = time.perf_counter()
        second = comfy.sd.load_diffusion_model(a.ckpt2, model_options=opts)
        res["load2_s"] = time.perf_counter() - t0
        res["model2_size"] = second.model_size()
    vae = None
    if a.vae:
        vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(os.path.join(
            a.workdir, "flux_vae_random.safetensors"), safe_load=True))
        res["vae_patcher"] = type(vae.patcher).__name__
        res["vae_dtype"] = str(vae.vae_dtype)
    pos, neg, latent = sample_inputs(a, patcher, torch, comfy)
    noise = comfy.sample.prepare_noise(latent, a.seed)
    tag = a.tag or a.run

    def node_end():                         # what execution.py does
        if comfy.memory_management.aimdo_enabled:
            mm.reset_cast_buffers()
            comfy.model_prefetch.cleanup_prefetch_queues()
            comfy_aimdo.model_vbar.vbars_reset_watermark_limits()

    reps = []
    prev = None
    before = memory(patcher, torch)
    # The first forward's start of each prompt: its first step less what
    # sample() does before it (conditioning, noise, loading the models).
    starts = []

    def first_forward(_module, _args):
        if not starts:
            torch.cuda.synchronize()
            starts.append(time.perf_counter())
    hooks = [x.model.diffusion_model.register_forward_pre_hook(
        first_forward) for x in (patcher, second) if x is not None]
    for rep, (label, p) in enumerate(prompts(a, patcher, comfy, res,
                                             second)):
        marks = []
        starts.clear()
        lending = lend_switch(rep) if LEND_ALTERNATE else None

        vstats = getattr(p, "vpager_stats", None) if STEP_STATS else None
        snaps = [vstats()] if vstats is not None else []
        tl = step_timeline.StepTimeline(
            p.model.diffusion_model, TIMELINE,
            profile_start=START_PROFILE) if TIMELINE else None
        ct = copy_trace.CopyTrace(KINETO, keep=os.path.join(
            KINETO_KEEP, "trace_%d_%s.json.gz" % (os.getpid(), label))
            if KINETO_KEEP else None) if KINETO else None
        ic = idle_cache.IdleCache(p.model.diffusion_model, IDLE_CACHE) \
            if IDLE_CACHE else None
        prof = cProfile.Profile() if PROFILE else None

        def cb(step, x0, x, total_steps):
            if STEP_SYNC == "device":
                torch.cuda.synchronize()
            else:
                torch.cuda.current_stream().synchronize()
            marks.append(time.perf_counter())
            if vstats is not None:
                snaps.append(vstats())
            if tl is not None:
                tl.step_done(step)
            if ct is not None:
                ct.step_done(step)
            if ic is not None:
                ic.step_done(step)
            if prof is not None and step + 1 == PROFILE:
                prof.disable()
                say_profile("%s, rep %d, step %d" % (label, rep, PROFILE),
                            prof)
            elif prof is not None and step + 2 == PROFILE:
                prof.enable()

        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        spun0 = spun[0] if spun is not None else 0
        if prof is not None and PROFILE == 1:
            prof.enable()
        t0 = time.perf_counter()
        out = comfy.sample.sample(p, noise, a.steps, 1.0, "euler",
                                  "simple", pos, neg, latent, callback=cb,
                                  disable_pbar=True, seed=a.seed)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        pts = [t0] + marks
        r = {"label": label,
             "steps_ms": [(pts[i + 1] - pts[i]) * 1e3
                          for i in range(len(pts) - 1)],
             "sample_s": t1 - t0,
             "first_forward_ms": ((marks[0] - starts[0]) * 1e3
                                  if marks and starts else None),
             "torch_peak_reserved": torch.cuda.max_memory_reserved()}
        r.update(memory(p, torch))
        if lending is not None:
            r["lending"] = lending
        if spun is not None:
            r["spun_calls"] = n = spun[0] - spun0
            say("COMFYUI_SPIN %s, rep %d: %d per-unit calls in %d steps, "
                "%.1f a step: a host-paced step grows %.2f ms"
                % (label, rep, n, a.steps, n / a.steps,
                   n / a.steps * UNIT_SPIN / 1e3))
        if len(snaps) > 1:
            say_step_stats(label, r["steps_ms"], snaps)
        if ct is not None:
            ct.remove()
            if ct.summary is not None:
                say(copy_trace.TAG + json.dumps(
                    dict(ct.summary, label="%s, rep %d, step %d"
                         % (label, rep, KINETO))))
        if ic is not None:
            ic.remove()
            if ic.summary is not None:
                say(idle_cache.TAG + json.dumps(
                    dict(ic.summary, label="%s, rep %d, steps %d-%d"
                         % (label, rep, IDLE_CACHE, IDLE_CACHE + 1))))
        if tl is not None:
            tl.remove()
            if tl.start_profile is not None:
                say_profile("%s, rep %d, step %d's start" % (
                    label, rep, TIMELINE), tl.start_profile)
                say("COMFYUI_START_GC %s, rep %d, step %d: %s (generation, "
                    "ms)" % (label, rep, TIMELINE, tl.start_gc))
            if tl.rows:
                say(step_timeline.TAG + json.dumps(
                    {"label": "%s, rep %d, step %d" % (label, rep, TIMELINE),
                     "rows": tl.rows}))
        if a.lora:
            n, b, k, u = patch_change(prev, p)
            r["patch_changed"] = {"weights": n, "bytes": b, "patched": k,
                                  "at_use": u}
            r["vpager_delta"] = _delta(r.get("vpager"), before.get("vpager"))
            r["node_refilled"] = getattr(p, "_vp_refilled", None)
        prev = p
        lat = out.detach().float().contiguous().cpu()
        raw = lat.numpy().tobytes()
        r["latent_sha256"] = hashlib.sha256(raw).hexdigest()
        r["latent_finite"] = bool(torch.isfinite(lat).all())
        r["latent_std"] = float(lat.std())
        with open(os.path.join(a.workdir, "latent_%s_%d.bin"
                               % (tag, rep)), "wb") as f:
            f.write(raw)
        node_end()
        if vae is not None:
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            img = vae.decode(out)
            torch.cuda.synchronize()
            r["decode_ms"] = (time.perf_counter() - t2) * 1e3
            im = img.detach().float().contiguous().cpu()
            r["image_sha256"] = hashlib.sha256(
                im.numpy().tobytes()).hexdigest()
            r["image_shape"] = list(im.shape)
            r["after_decode"] = memory(p, torch)
            node_end()
            del img
        r["after_node"] = memory(p, torch)
        before = r["after_node"]
        reps.append(r)
        del out
    for h in hooks:
        h.remove()
    res["reps"] = reps
    # The link again, in this process after its prompts: the host's
    # memory is shared with other tenants and its speed drifts over a
    # phase (42-55 GB/s in one H100 host's steps); L's is read once, by
    # the checkpoint's maker, before the runs.
    torch.cuda.empty_cache()
    res["link_after"] = link_gbps(torch)
    say(TAG + json.dumps(res))


_PARKED = {}    # id(devstate) -> the Lender's cache while lending is off


def spin_units(us):
    """UNIT_SPIN: vpager's HotPath.enter busy-waits `us` microseconds
    more (patched before the node wraps any unit: wrap() binds enter);
    returns a list whose one item counts the calls spun (what a step
    grows by, if the host sets its pace: calls a step x us)."""
    from vpager.torch import hotpath
    enter, clock, extra = hotpath.HotPath.enter, time.perf_counter, us / 1e6
    calls = [0]

    def spun(self, unit):
        calls[0] += 1
        t = clock() + extra
        while clock() < t:
            pass
        return enter(self, unit)
    hotpath.HotPath.enter = spun
    return calls


def conds_on_device(conds, device):
    """CONDS_ON_DEVICE: each of ComfyUI's cond classes (comfy.conds) that
    processes its tensor hands a copy of it on `device`, made once per
    tensor and shape, in place of the host tensor."""
    seen, todo = set(), [conds.CONDRegular]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        own = cls.__dict__.get("process_cond")
        if own is None or getattr(own, "_on_device", False):
            continue

        def process_cond(self, *args, _own=own, **kwargs):
            out = _own(self, *args, **kwargs)
            t = getattr(out, "cond", None)
            if t is None or not hasattr(t, "device") or \
                    t.device.type != "cpu":
                return out
            cache = self.__dict__.setdefault("_bench_on_device", {})
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key not in cache:
                cache[key] = (t, t.to(device))  # t kept: its address
            return out._copy_with(cache[key][1])
        process_cond._on_device = True
        cls.process_cond = process_cond


def lend_switch(rep, devstates=None):
    """LEND_ALTERNATE: before prompt `rep`, the Lender of each device
    (devstates: vpager.torch's, by default) on or off (none for the first
    prompt; then off, on, on, off, ...): "on", "off", or None before the
    first."""
    if rep == 0:
        return None
    on = (rep - 1) % 4 in (1, 2)
    if devstates is None:
        from vpager.torch import devices
        devstates = devices.DEVSTATES
    for ds in list(devstates.values()):
        lender = getattr(ds, "lender", None)
        if lender is None:
            continue
        if on and lender.cache is None and id(ds) in _PARKED:
            lender.cache = _PARKED.pop(id(ds))
        elif not on and lender.cache is not None:
            lender.take_back()
            _PARKED[id(ds)] = lender.cache
            lender.cache = None
    return "on" if on else "off"


def memory(patcher, torch):
    import comfy_aimdo.control
    m = {}
    vbar = patcher._vbar_get() if hasattr(patcher, "_vbar_get") else None
    m["vbar_resident"] = vbar.loaded_size() if vbar is not None else None
    m["patcher_loaded"] = patcher.loaded_size()
    m["total_vram_usage"] = comfy_aimdo.control.get_total_vram_usage()
    m["torch_reserved"] = torch.cuda.memory_reserved()
    m["torch_allocated"] = torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    m["device_used"] = total - free
    m.update(host_memory())
    return m


def host_memory():
    """The process's RSS, its peak (VmHWM), its parts (anonymous, mapped
    files: model files and libraries' code, shared memory; the anonymous
    bytes in transparent huge pages) and the machine's MemAvailable,
    bytes (issue 28: one copy of a model in RAM; the parts say where RSS
    grew; a pinned copy in 4 KiB pages is DMA'd page by page)."""
    out = {}
    for path, key, name in (("/proc/self/status", "VmRSS:", "rss"),
                            ("/proc/self/status", "VmHWM:", "rss_peak"),
                            ("/proc/self/status", "RssAnon:", "rss_anon"),
                            ("/proc/self/status", "RssFile:", "rss_file"),
                            ("/proc/self/status", "RssShmem:", "rss_shmem"),
                            ("/proc/self/smaps_rollup", "AnonHugePages:",
                             "rss_anon_huge"),
                            ("/proc/meminfo", "MemAvailable:",
                             "mem_available")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        out[name] = int(line.split()[1]) * 1024
        except OSError:
            pass
    return out


# ----------------------------------------------------------- orchestrator

def step_counter(s, k):
    """Counter k of a pager's stats() (vpager.torch's shape: the device
    alone counts the ring's and the streams' waits)."""
    sec = s["device"] if k in ("ring_waits", "stream_waits") else s["model"]
    return sec.get(k)


def say_step_stats(label, steps_ms, snaps):
    for i in range(1, len(snaps)):
        a, b = snaps[i - 1], snaps[i]
        if a is None or b is None:  # the pager is made in the first step
            continue
        say("    step %d (%s): %.1f ms; %s" % (
            i, label, steps_ms[i - 1], " ".join(
                "%s %d" % (k, step_counter(b, k) - step_counter(a, k))
                for k in STEP_KEYS if step_counter(a, k) is not None
                and step_counter(b, k) is not None)))


def say_profile(label, prof):
    """A profiled step's host functions, the most own time first, then
    the most time with what they call."""
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("tottime").print_stats(PROFILE_TOP)
    st.sort_stats("cumulative").print_stats(PROFILE_TOP)
    say("COMFYUI_PROFILE %s (host seconds; the profiler's own cost "
        "included)" % label)
    for line in out.getvalue().splitlines():
        if line.strip():
            say("  " + line)


def child_env(a, more_path=()):
    """The environment of a child run: ComfyUI and its deps (and
    more_path) first on PYTHONPATH, the in-tree library if none is set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        child_path(a) + list(more_path)
        + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Each run is a model's first (no plan remembered: plancache.py) unless
    # its own variables name a folder (bench_node's "cache" runs).
    env.setdefault("VPAGER_PLAN_CACHE", "off")
    if "VPAGER_LIBRARY" not in env:
        lib = os.path.join(ROOT, "build", "libvpager.so")
        if os.path.exists(lib):
            env["VPAGER_LIBRARY"] = lib
    return env


def spawn(cmd, env, log_path, timeout, label, cap_gib=None):
    """Run one child (stderr to log_path, stdout kept too); its TAG line's
    JSON with wall_s added, or None after saying why, with the log's tail.
    cap_gib: the child runs in a memory cgroup of that many GiB
    (bench/memcap.py); what the kernel saw there is the JSON's "memcap"
    (and said with the failure)."""
    cap = None
    if cap_gib is not None:
        import memcap
        try:
            cap = memcap.open_cap(int(cap_gib * GiB), "vp-bench")
        except memcap.CapError as e:
            say("  %s NOT RUN: --cgroup-gib %g: %s" % (label, cap_gib, e))
            return None
        say("  %s: in %s" % (label, cap.describe()))
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            try:
                p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE,
                                   stderr=log, text=True, timeout=timeout,
                                   preexec_fn=cap.enter if cap else None)
                out, rc = p.stdout, p.returncode
            except subprocess.TimeoutExpired as e:
                out = e.stdout or ""
                if isinstance(out, bytes):
                    out = out.decode(errors="replace")
                rc = "timeout"
            log.write("\n--- stdout ---\n" + out)
        capped = cap.report() if cap is not None else None
    finally:
        if cap is not None:
            cap.close()
    wall = time.perf_counter() - t0
    res = None
    for ln in out.splitlines():
        if ln.startswith(TAG):
            res = json.loads(ln[len(TAG):])
    if res is None:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        say("  %s FAILED (rc %s, %.0f s%s); log %s:\n%s"
            % (label, rc, wall, "; cgroup: %s" % capped if capped else "",
               log_path, tail))
    else:
        res["wall_s"] = wall
        if capped is not None:
            res["memcap"] = capped
    return res


def common_args(a):
    """The options every child gets (the model, the prompts, the deps)."""
    return ["--comfyui", a.comfyui, "--workdir", a.workdir,
            "--steps", str(a.steps), "--size", str(a.size),
            "--double", str(a.double), "--single", str(a.single),
            "--hidden", str(a.hidden), "--reps", str(a.reps),
            "--seed", str(a.seed), "--model", a.model,
            "--weight-dtype", a.weight_dtype, "--quant", a.quant,
            "--timeout", str(a.timeout),
            "--layers", str(a.layers), "--frames", str(a.frames)] \
        + (["--dry-run"] if a.dry_run else []) \
        + (["--lora"] if a.lora else []) + (["--vae"] if a.vae else []) \
        + (["--ckpt2", a.ckpt2] if getattr(a, "ckpt2", None) else []) \
        + [x for d in a.deps for x in ("--deps", d)]


def gen_second(a, out):
    """--switch: the second model's checkpoint (gen child, its own seed,
    no LoRA or VAE); a.ckpt2 set to it. Its gen JSON, or None."""
    if a.switch_shape is None:
        return None
    b = copy.copy(a)
    b.double, b.single = a.switch_shape
    b.lora = b.vae = False
    b.ckpt2 = None
    b.seed = a.seed + 1000
    gen2 = run_child(b, "gen", [], os.path.join(out, "gen_second.log"))
    if gen2 is not None:
        a.ckpt2 = gen2["path"]
        say("second model (--switch %s): %.2f GiB, %d tensors, made %.1f s"
            % (a.switch, gen2["bytes"] / GiB, gen2["tensors"],
               gen2["make_s"]))
    return gen2


def switch_costs(a, r):
    """--switch: per prompt after one of the other model, [{prompt, after,
    first_ms, extra_s}]: extra_s is its sample() time less its steps at
    its own steady step (what the switch added: loading, evicting, the
    first faults)."""
    out = []
    reps = r.get("reps", [])
    for prev, cur in zip(reps, reps[1:]):
        if prev["label"].rstrip("0123456789") == \
                cur["label"].rstrip("0123456789"):
            continue
        ms = cur["steps_ms"]
        out.append({"prompt": cur["label"], "after": prev["label"],
                    "first_ms": ms[0], "extra_s": cur["sample_s"]
                    - len(ms) * steady(ms) / 1e3})
    return out


def say_switch(a, run, r):
    """One line: the run's model switches (switch_costs)."""
    cs = switch_costs(a, r)
    if cs:
        say("%s: model switch (a prompt's sample() less its steps at its "
            "steady step): %s" % (run, "; ".join(
                "%s after %s +%.2f s (first step %.0f ms)"
                % (c["prompt"], c["after"], c["extra_s"], c["first_ms"])
                for c in cs)))
    return cs


def run_child(a, kind, extra, log_path):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind] \
        + common_args(a) + extra
    return spawn(cmd, child_env(a), log_path, a.timeout,
                 "%s %s" % (kind, extra),
                 a.cgroup_gib if kind == "sample" else None)


def budget_arg(run, gen, a=None):
    """A run's budget as the child takes it: "half" is half the
    checkpoint's weights as held with --weight-dtype, in GiB."""
    if run == "half":
        w, _ = held(gen, a.weight_dtype if a is not None else "default")
        return "%.3f" % (w / 2 / GiB)
    return run


def steady(ms):
    return statistics.median(ms[1:]) if len(ms) > 1 else float("nan")


def machine(a):
    sys.path[:0] = [HERE]
    import benchlib as bl
    lines = [bl.host_line()]
    try:
        lines.insert(0, "gpu: " + subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True,
            timeout=20).stdout.strip())
    except Exception as e:  # noqa: BLE001
        lines.insert(0, "gpu: nvidia-smi failed: %s" % e)
    ver = "?"
    try:
        with open(os.path.join(a.comfyui, "comfyui_version.py")) as f:
            ver = f.read().split('__version__ = "')[1].split('"')[0]
    except (OSError, IndexError):
        pass
    lines.append("software: python %s; ComfyUI %s (%s); vpager %s; %s UTC"
                 % (platform.python_version(), ver,
                    os.path.abspath(a.comfyui), bl.source_rev(),
                    bl.utc_now()))
    lines.append("steps end on: %s synchronize (VPAGER_BENCH_SYNC)"
                 % ("the compute stream's" if STEP_SYNC == "stream"
                    else "the device's"))
    return lines


def _frames(ev, n=4):
    """The innermost n Python frames of a trace event outside torch."""
    out = []
    for f in ev.get("frames") or ():
        fn = f.get("filename", "")
        if "/torch/" in fn or not fn.endswith(".py"):
            continue
        out.append("%s:%s %s" % (os.path.basename(fn), f.get("line"),
                                 f.get("name")))
        if len(out) == n:
            break
    return " < ".join(out)


def _lend_growth(snap, why):
    """What torch allocated from the last loan's borrow on (LEND_TRACE)."""
    for dev, trace in enumerate(snap.get("device_traces") or ()):
        borrow = [i for i, ev in enumerate(trace) if ev.get("action") ==
                  "alloc" and any(f.get("name") == "borrow"
                                  for f in ev.get("frames") or ())]
        if not borrow:
            continue
        loan = [borrow[-1]]     # the last run of borrows in a row
        for i in reversed(borrow[:-1]):
            if i != loan[0] - 1:
                break
            loan.insert(0, i)
        sys.stderr.write("lend trace (device %d): %s; the loan: %s MB\n" % (
            dev, why, " ".join("%.1f" % (trace[i]["size"] / 1e6)
                               for i in loan)))
        live, peak, grown = 0, 0, 0
        for ev in trace[borrow[-1] + 1:]:
            a = ev.get("action")
            if a == "alloc":
                live += ev["size"]
                peak = max(peak, live)
            elif a == "free_requested":
                live -= ev["size"]
            elif a == "segment_alloc":
                grown += ev["size"]
                sys.stderr.write("lend trace:   segment +%.1f MB (stream %s, "
                                 "%.1f MB allocated since the loan): %s\n"
                                 % (ev["size"] / 1e6, ev.get("stream"),
                                    live / 1e6, _frames(ev)))
        sys.stderr.write("lend trace:   since the loan: segments +%.1f MB, "
                         "allocations' peak +%.1f MB\n"
                         % (grown / 1e6, peak / 1e6))


def trace_lend():
    """LEND_TRACE: the allocation history on, the Lender's shrink hooked."""
    import torch
    from vpager.torch import lend
    torch.cuda.memory._record_memory_history(max_entries=200000,
                                             stacks="python")
    shrink = lend.Lender._shrink

    def on_shrink(self, why):
        try:
            _lend_growth(torch.cuda.memory._snapshot(), why)
        except Exception as e:      # a diagnostic must not end the run
            sys.stderr.write("lend trace failed: %r\n" % (e,))
        return shrink(self, why)
    lend.Lender._shrink = on_shrink


def log_governor():
    """VPAGER_BENCH_GOVERNOR: the Governor's changes on stderr, timed
    (its own debug log is not used: ComfyUI's logging setup disables the
    loggers made before it)."""
    from vpager import governor as gm
    changed, oom = gm.Governor._changed, gm.Governor.raise_oom_margin

    def said(what, old, new, why):
        sys.stderr.write("%.3f governor: %s %d -> %d (%s)\n"
                         % (time.monotonic(), what, old, new, why))

    def on_change(self, what, old, new, why):
        said(what, old, new, why)
        return changed(self, what, old, new, why)

    def on_oom(self):
        old = self.oom_margin
        oom(self)
        said("oom margin", old, self.oom_margin, "an out-of-memory retry")
    mask, declare = gm.Governor.mask_torch_peak, gm.Governor.declare_torch

    def on_mask(self, counter, before):
        said("torch peak masked", counter, before, "fills")
        return mask(self, counter, before)

    def on_declare(self, reserved, peak):
        said("torch read", reserved, peak, "reserved, peak")
        return declare(self, reserved, peak)
    gm.Governor._changed = on_change
    gm.Governor.raise_oom_margin = on_oom
    gm.Governor.mask_torch_peak = on_mask
    gm.Governor.declare_torch = on_declare


def main(argv=None):
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.child:
        if not a.comfyui or not a.workdir:
            raise SystemExit("--child needs --comfyui and --workdir")
        if a.child == "gen":
            return child_gen(a)
        return child_sample(a)
    if a.check:
        return check(a)
    if not a.comfyui:
        raise SystemExit("--comfyui PATH is needed (or --check)")
    out = a.out or (os.path.join(os.environ["OUT"], "comfyui")
                     if os.environ.get("OUT") else "comfyui-run")
    os.makedirs(out, exist_ok=True)
    made = a.workdir is None
    if made:
        a.workdir = tempfile.mkdtemp(prefix="vp-comfyui-")
    os.makedirs(a.workdir, exist_ok=True)
    runs = [x.strip() for x in a.runs.split(",") if x.strip()]
    lines = machine(a)
    for ln in lines:
        say(ln)
    say("inputs: %s; runs %s; checkpoint in %s" % (inputs_line(a), runs,
                                                     a.workdir))
    summary = {"machine": lines, "args": vars(a), "runs": {}}
    try:
        gen = run_child(a, "gen", [], os.path.join(out, "gen.log"))
        if gen is None:
            return 1
        say("checkpoint: %.2f GiB, %d tensors (%s), made in %.1f s, saved in "
            "%.1f s; warm-up: %s" % (gen["bytes"] / GiB, gen["tensors"],
                                     gen["model_config"], gen["make_s"],
                                     gen["save_s"], gen["warmup"]))
        summary["checkpoint"] = gen
        if a.switch_shape is not None:
            summary["checkpoint2"] = gen2 = gen_second(a, out)
            if gen2 is None:
                return 1
        for run in runs:
            say("run %s ..." % run)
            r = run_child(a, "sample", ["--run", budget_arg(run, gen, a),
                                        "--tag", run, "--ckpt", gen["path"]],
                          os.path.join(out, "run_%s.log" % run))
            summary["runs"][run] = r
            if r is not None:
                report_run(r)
                say_switch(a, run, r)
        rc = compare(a, summary)
    finally:
        if made:
            shutil.rmtree(a.workdir, ignore_errors=True)
    with open(os.path.join(out, "comfyui_run.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rc


def inputs_line(a):
    """What is sampled, in words."""
    if a.model == "flux":
        m = ("Flux-class random weights, %d double + %d single blocks, "
             "hidden %d, bf16" % (a.double, a.single, a.hidden))
    elif a.model == "sdxl":
        m = ("SDXL-class UNet (ComfyUI's %s config), random fp16 weights"
             % ("Segmind Vega" if a.dry_run else "SDXL"))
    else:
        m = ("Wan 2.1 T2V-class DiT, %d blocks of %d, random fp16 weights; "
             "%d frames (%d latent)" % (a.layers, a.hidden, a.frames,
                                        (a.frames - 1) // 4 + 1))
    what = ("prompts base, LoRA A, A@0.5, LoRA B, B again, removed"
            if a.lora else "%d repetitions a run" % a.reps)
    if a.switch_shape is not None:
        what = ("two models in turn, %d prompts of each: this one, then a "
                "second of %d double + %d single blocks (--switch)"
                % ((a.reps,) + a.switch_shape))
    if a.cgroup_gib is not None:
        what += "; each run in a %g GiB memory cgroup" % a.cgroup_gib
    if a.weight_dtype != "default":
        m += ", loaded with weight_dtype %s" % a.weight_dtype
    if a.quant != "none":
        m += ", blocks' Linear weights quantized: %s" % a.quant
    return ("%s (seed %d); %dx%d, euler/simple, %d steps, cfg 1; %s%s%s"
            % (m, a.seed, a.size, a.size, a.steps, what,
               "; a VAE decode after each prompt" if a.vae else "",
               "; DRY RUN" if a.dry_run else ""))


def report_run(r):
    say("  %s: patcher %s (%s), init %s, %s; model %.2f GiB, loaded in "
        "%.2f s, process %.0f s"
        % (r["run"], r["patcher"], r["patcher_state"], r["init_shape"],
           " ".join(r["comfy_argv"]) or "no flags", r["model_size"] / GiB,
           r["load_s"], r["wall_s"]))
    for i, rep in enumerate(r["reps"]):
        ms = rep["steps_ms"]
        res = rep["vbar_resident"]
        say("    rep %d%s: steps ms %s; first %.0f ms, steady %.1f ms; "
            "sampling %.3f s; "
            "resident %s, vram usage %.2f GiB, torch reserved %.2f GiB, "
            "device used %.2f GiB; after the node: resident %s; latents %s%s"
            % (i, " (%s%s)" % (rep.get("label", ""), ", decode %.0f ms"
                                % rep["decode_ms"] if "decode_ms" in rep
                                else ""),
               " ".join("%.1f" % x for x in ms), ms[0], steady(ms),
               rep["sample_s"],
               "%.2f GiB" % (res / GiB) if res is not None else "-",
               rep["total_vram_usage"] / GiB, rep["torch_reserved"] / GiB,
               rep["device_used"] / GiB,
               "%.2f GiB" % (rep["after_node"]["vbar_resident"] / GiB)
               if rep["after_node"]["vbar_resident"] is not None else "-",
               rep["latent_sha256"][:16],
               "" if rep["latent_finite"] else " (NOT FINITE)"))


def max_abs_diff(a, name, rep):
    import array
    x = array.array("f", open(os.path.join(
        a.workdir, "latent_resident_%d.bin" % rep), "rb").read())
    y = array.array("f", open(os.path.join(
        a.workdir, "latent_%s_%d.bin" % (name, rep)), "rb").read())
    return max(abs(p - q) for p, q in zip(x, y))


def compare(a, summary):
    runs = summary["runs"]
    base = runs.get("resident")
    rc = 0 if all(r is not None for r in runs.values()) else 1
    if base is None:
        say("no all-resident run: no ratios, no comparison")
        return rc
    b0 = base["reps"][0]
    b_steady = steady(b0["steps_ms"])
    same_reps = len({r["latent_sha256"] for r in base["reps"]}) == 1
    say("all-resident repetitions: %s" % (
        "bitwise equal" if same_reps else "differ between themselves "
        "(ComfyUI's own behaviour; each repetition is compared with the "
        "all-resident run's same repetition)"))
    table = []
    for name, r in runs.items():
        if r is None:
            continue
        r0 = r["reps"][0]
        eqs, diffs = [], []
        for i, rep in enumerate(r["reps"][:len(base["reps"])]):
            eq = rep["latent_sha256"] == base["reps"][i]["latent_sha256"]
            eqs.append(eq)
            diffs.append(None if eq else max_abs_diff(a, name, i))
        row = {"run": name, "first_ms": r0["steps_ms"][0],
               "steady_ms": steady(r0["steps_ms"]),
               "first_ms_rep1": r["reps"][1]["steps_ms"][0]
               if len(r["reps"]) > 1 else None,
               "steady_ms_rep1": steady(r["reps"][1]["steps_ms"])
               if len(r["reps"]) > 1 else None,
               "first_over_steady": r0["steps_ms"][0] / steady(r0["steps_ms"]),
               "steady_over_resident": steady(r0["steps_ms"]) / b_steady,
               "resident_bytes": r0["vbar_resident"],
               "bitwise_equal_to_resident": eqs, "max_abs_diff": diffs}
        table.append(row)
        say("  %-9s first %7.0f ms  steady %6.1f ms  first/steady %5.1f  "
            "steady/resident %.3f  resident %s  latents %s"
            % (name, row["first_ms"], row["steady_ms"],
               row["first_over_steady"], row["steady_over_resident"],
               "%.2f GiB" % (row["resident_bytes"] / GiB)
               if row["resident_bytes"] is not None else "-",
               "bitwise equal to resident's (every repetition)" if all(eqs)
               else "DIFFER (max |d| by repetition: %s)" % diffs))
        if not all(eqs) and name != "legacy":
            rc = 2
    summary["table"] = table
    summary["resident_reps_equal"] = same_reps
    return rc


if __name__ == "__main__":
    sys.exit(main())
