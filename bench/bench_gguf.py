#!/usr/bin/env python3
"""ComfyUI-GGUF's models (city96/ComfyUI-GGUF) under ComfyUI 0.33 with and
without the vpager node (issue 26 point 4).

bench_node.py's harness (bench/comfyui_run.py: ComfyUI in library mode, a
random-weight Flux-class checkpoint made with ComfyUI's own classes,
euler, steps timed, latents hashed), its checkpoint turned into GGUF files
by the `gguf` package (gguf-py; bench/clients/prepare.py --gguf): every
weight of two or more dimensions quantized (Q4_0, Q4_1, Q5_0, Q5_1 by
gguf-py's own quantizer; Q8_0 by its steps in torch, on the GPU, bitwise
the same bytes; the K-quants, which gguf-py only reads, as random blocks
with finite scales), the other tensors F32, as ComfyUI-GGUF
keeps 1-D ones. Each file is loaded as ComfyUI-GGUF's UnetLoaderGGUF
loads it (gguf_sd_loader, load_diffusion_model_state_dict with GGMLOps,
GGUFModelPatcher.clone) and sampled:

  resident   ComfyUI-GGUF's path, every weight on the GPU (the reference)
  nodehalf   the node installed, budget = half the GGUF weights' bytes
  half       ComfyUI-GGUF's path under the same budget (ComfyUI's legacy
             partial loading: what it does today)

    python3 bench/bench_gguf.py --comfyui build-clients/ComfyUI \\
        [--comfyui-gguf build-clients/ComfyUI-GGUF] [--qtypes Q8_0,Q4_K] \\
        [--gguf-lora off|on|both] [--shape small|flux] [--runs ...] [--out D]

Prints per qtype and LoRA setting each run's steady step, latents against
resident's (prompt by prompt), steady / L under the budget (bench_node's
compare), and the node's log lines about the model: the node adopts
ComfyUI-GGUF's patcher and pages the GGMLTensor bytes ("... on vpager:
N weights ..."), or says in one line why the model stays on
ComfyUI-GGUF's path ("uses ComfyUI's own loading: ..."), when nodehalf
measures that path. Exit 0; 1 when a run failed; 2 when latents differ.
"""

import copy
import importlib.util
import json
import os
import sys
import tempfile
import time
import types
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_node as bn  # noqa: E402

GiB = 1 << 30
QTYPES = "Q8_0,Q4_K"
ENV_DIR = "BENCH_COMFYUI_GGUF"      # ComfyUI-GGUF's folder, for the children
RUNS = "resident,nodehalf,half"
# gguf-py's quantizers (numpy; Q8_0's steps run in torch: q8_0()); the
# others are written as random blocks.
QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# The K-quants: (offset of the fp16 scale d, of dmin or None) in a block.
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None),
            "Q2_K": (80, 82), "Q3_K": (108, None)}


def say(*a):
    print(*a, flush=True)


def split_args(argv):
    """(our options, bench/comfyui_run.py's)."""
    ours = {"runs": RUNS, "qtypes": QTYPES, "lora": "both",
            "shape": "small", "out": None, "timeout": 300,
            "comfyui_gguf": None, "child": False}
    rest = []
    it = iter(argv)
    for x in it:
        if x == "--qtypes":
            ours["qtypes"] = next(it)
        elif x == "--gguf-lora":
            ours["lora"] = next(it)
        elif x == "--shape":
            ours["shape"] = next(it)
        elif x == "--runs":
            ours["runs"] = next(it)
        elif x == "--out":
            ours["out"] = next(it)
        elif x == "--timeout":
            ours["timeout"] = int(next(it))
        elif x == "--comfyui-gguf":
            ours["comfyui_gguf"] = next(it)
        else:
            if x == "--child":
                ours["child"] = True
            rest.append(x)
    return ours, rest


# ------------------------------------------------------ the GGUF files

def import_gguf(deps=()):
    """The gguf package (build-clients/pydeps/gguf by default). Its
    tokenizer, progress-bar and model-card imports are stubbed when
    missing: writing and reading tensors needs none of them."""
    for d in list(deps) + [os.path.join(ROOT, "build-clients", "pydeps")]:
        if os.path.isdir(os.path.join(d, "gguf")) and d not in sys.path:
            sys.path.append(d)
    for name, attrs in (("sentencepiece", {"SentencePieceProcessor": None}),
                        ("tqdm", {"tqdm": lambda it=None, **kw: it}),
                        ("yaml", {})):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.SimpleNamespace(**attrs)
    import gguf
    return gguf


def quantizable(shape, block):
    return len(shape) >= 2 and shape[-1] % block == 0


def q8_0(t):
    """Q8_0 blocks of tensor t (last dimension a multiple of 32) as gguf's
    own quantizer writes them (per 32 values an fp16 scale max|x| / 127,
    then the values over it rounded half away from zero as int8), by
    torch on the GPU where there is one (the same IEEE float32 steps):
    numpy's quantizer takes ~4 minutes for a Flux-class model on one
    core. uint8, (rows, blocks x 34)."""
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = t.detach().to(dev, torch.float32).reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = x * inv
    q = (v.sign() * torch.floor(v.abs() + 0.5)).to(torch.int8)
    out = torch.cat([d.to(torch.float16).view(torch.uint8),
                     q.view(torch.uint8)], dim=1)
    return out.reshape(*t.shape[:-1], t.shape[-1] // 32 * 34).cpu().numpy()


def random_blocks(gguf, qtype, shape, rng):
    """uint8 blocks of a K-quant for a tensor of `shape`: random bytes,
    the fp16 scales set to small finite values (weights within ~0.25)."""
    import numpy as np
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = 1
    for s in shape:
        n *= s
    blocks = rng.integers(0, 256, size=(n // block, size), dtype=np.uint8)
    d_at, m_at = K_SCALES[qtype.name]
    d = (rng.random(n // block, dtype=np.float32) * 2e-4 + 1e-4)
    blocks[:, d_at:d_at + 2] = d.astype(np.float16).view(np.uint8).reshape(
        -1, 2)
    if m_at is not None:
        blocks[:, m_at:m_at + 2] = (d / 2).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return blocks.reshape(tuple(shape[:-1]) + (shape[-1] // block * size,))


def write_gguf(tensors, path, qtype_name, arch="flux", seed=0):
    """tensors {key: torch tensor} -> a GGUF file at path: tensors of two
    or more dimensions whose rows fill whole blocks in qtype_name, the
    others F32. Returns {"bytes": the tensors' bytes in the file,
    "w_max": the largest's, "types": {type: count}}."""
    import numpy as np
    import torch
    gguf = import_gguf()
    Q = gguf.GGMLQuantizationType
    qtype = getattr(Q, qtype_name, None)
    if qtype is None or (qtype_name not in QUANTIZED_BY_GGUF
                         and qtype_name not in K_SCALES):
        raise SystemExit("--qtypes: %r is none of %s" % (qtype_name, ", ".join(
            QUANTIZED_BY_GGUF + tuple(K_SCALES))))
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    total, w_max, types_ = 0, 0, {}
    for key in sorted(tensors):
        t = tensors[key]
        shape = tuple(t.shape)
        if quantizable(shape, block):
            if qtype_name == "Q8_0":
                data = q8_0(t)
            elif qtype_name in QUANTIZED_BY_GGUF:
                data = gguf.quants.quantize(
                    t.detach().to(torch.float32).cpu().numpy(), qtype)
            else:
                data = random_blocks(gguf, qtype, shape, rng)
            w.add_tensor(key, data, raw_dtype=qtype)
            name = qtype_name
        else:
            data = t.detach().to(torch.float32).cpu().numpy()
            w.add_tensor(key, data)
            name = "F32"
        types_[name] = types_.get(name, 0) + 1
        total += data.nbytes
        w_max = max(w_max, data.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"bytes": total, "w_max": w_max, "types": types_}


# ------------------------------------------------------------- children

def comfyui_gguf(folder):
    """ComfyUI-GGUF imported from its folder as a package (its nodes.py
    imports ComfyUI's nodes module, which library mode lacks: a stand-in
    with the loaders its CLIP nodes read is put there)."""
    if "ComfyUI_GGUF" in sys.modules:
        return sys.modules["ComfyUI_GGUF"]
    if "nodes" not in sys.modules:
        stub = types.ModuleType("nodes")

        class Loader:
            @classmethod
            def INPUT_TYPES(cls):
                return {"required": {"type": (["stable_diffusion"],)}}
        stub.CLIPLoader = stub.DualCLIPLoader = Loader
        sys.modules["nodes"] = stub
    spec = importlib.util.spec_from_file_location(
        "ComfyUI_GGUF", os.path.join(folder, "__init__.py"),
        submodule_search_locations=[folder])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["ComfyUI_GGUF"] = pkg
    spec.loader.exec_module(pkg)
    importlib.import_module("ComfyUI_GGUF.nodes")
    return pkg


def hook_loader(folder):
    """comfy.sd.load_diffusion_model loads a .gguf file the way
    ComfyUI-GGUF's UnetLoaderGGUF does (default dequant/patch dtypes)."""
    import comfy.sd
    orig = comfy.sd.load_diffusion_model

    def load(path, model_options={}, **kw):
        if not str(path).endswith(".gguf"):
            return orig(path, model_options, **kw)
        pkg = comfyui_gguf(folder)
        nodes, loader = pkg.nodes, sys.modules["ComfyUI_GGUF.loader"]
        ops = nodes.GGMLOps()
        ops.Linear.dequant_dtype = None
        ops.Linear.patch_dtype = None
        sd = loader.gguf_sd_loader(path)
        model = comfy.sd.load_diffusion_model_state_dict(
            sd, model_options={"custom_operations": ops})
        if model is None:
            raise RuntimeError("ComfyUI did not detect a model in %s" % path)
        model = nodes.GGUFModelPatcher.clone(model)
        model.patch_on_device = None
        return model

    comfy.sd.load_diffusion_model = load


def child(cr, a):
    """A sample child: ComfyUI-GGUF's loader hooked in; the node installed
    for the node runs (bench_node's child)."""
    folder = os.environ.get(ENV_DIR) or default_folder(a.comfyui)
    orig = cr.comfy_init_devices

    def init_devices(args):
        state = orig(args)
        hook_loader(folder)
        return state

    cr.comfy_init_devices = init_devices
    import_gguf(a.deps)         # before ComfyUI-GGUF imports it
    if (a.tag or "").startswith("node"):
        return bn.child(cr, a)
    return cr.child_sample(a)


def default_folder(comfyui):
    """build-clients/ComfyUI-GGUF beside ComfyUI's folder, else the
    checkout's .clients/ComfyUI-GGUF."""
    for d in (os.path.join(os.path.dirname(os.path.abspath(comfyui)),
                           "ComfyUI-GGUF"),
              os.path.join(ROOT, ".clients", "ComfyUI-GGUF")):
        if os.path.isfile(os.path.join(d, "nodes.py")):
            return d
    raise SystemExit("ComfyUI-GGUF not found: --comfyui-gguf DIR")


# --------------------------------------------------------- orchestrator

def node_lines(log_path):
    """The node's log lines about the model (fallbacks, paging)."""
    try:
        with open(log_path, errors="replace") as f:
            return [ln.split("vpager: ", 1)[1].strip() for ln in f
                    if "vpager: " in ln and ("uses ComfyUI's own loading"
                                             in ln or " on vpager" in ln)]
    except OSError:
        return []


def run_cell(cr, a, ours, runs, out, gen, cell):
    rc = 0
    for run in runs:
        t0 = time.perf_counter()
        log = os.path.join(out, "run_%s.log" % run)
        bs, _ = bn.budget_of(run, gen)
        cmd = [sys.executable, os.path.abspath(__file__), "--child",
               "sample"] + cr.common_args(a) + \
            ["--run", bs if bs is not None else "resident", "--tag", run,
             "--ckpt", gen["path"]]
        env = cr.child_env(a, [os.path.join(ROOT, "integrations")])
        r = cr.spawn(cmd, env, log, ours["timeout"], run)
        cell["runs"][run] = r
        if r is None:
            rc = 1
            continue
        bn.report(cr, run, r)
        for ln in node_lines(log)[:3]:
            say("    node: %s" % ln)
        r["node_lines"] = node_lines(log)
        say("  (%.0f s)" % (time.perf_counter() - t0))
    return bn.compare(cr, a, gen, cell) or rc


def worst_vs_L(cr, cell, run="nodehalf"):
    """The worst prompt of `run` after its first (whose steps include the
    plan settling) against its limit: max over them of its steady step /
    max(resident's steady step of the same prompt, the link term); None
    without both runs. ComfyUI-GGUF applies a LoRA on the fly, resident
    too, so each prompt's L is resident's own."""
    runs = cell.get("runs", {})
    mine, ref = runs.get(run), runs.get("resident")
    link = cell.get("table", {}).get(run, {}).get("link_term_ms")
    if not mine or not ref or link is None:
        return None
    res = {x.get("label"): cr.steady(x["steps_ms"]) for x in ref["reps"]}
    got = [cr.steady(x["steps_ms"]) / max(res[x.get("label")], link)
           for x in mine["reps"][1:] if x.get("label") in res]
    return max(got) if got else None


def lora_settings(s):
    v = {"off": [False], "on": [True], "both": [False, True]}.get(s)
    if v is None:
        raise SystemExit("--gguf-lora: off, on or both")
    return v


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = split_args(argv)
    cr = bn.harness()
    if ours["comfyui_gguf"]:
        os.environ[ENV_DIR] = os.path.abspath(ours["comfyui_gguf"])
    if ours["child"]:
        a = cr.parse(rest)
        a.timeout = ours["timeout"]
        return child(cr, a)
    if ours["shape"] not in bn.SHAPES:
        raise SystemExit("--shape: %s" % " or ".join(bn.SHAPES))
    loras = lora_settings(ours["lora"])
    qtypes = [q.strip() for q in ours["qtypes"].split(",") if q.strip()]
    rest = bn.SHAPES[ours["shape"]] + rest
    if any(loras) and "--lora" not in rest:
        rest.append("--lora")
    a = cr.parse(rest + ["--runs", "resident"])
    if a.model != "flux":
        raise SystemExit("--model: GGUF runs are of the flux model")
    os.environ.setdefault(ENV_DIR, default_folder(a.comfyui))
    out = ours["out"] or (os.path.join(os.environ["OUT"], "comfyui_gguf")
                          if os.environ.get("OUT") else "comfyui-gguf")
    os.makedirs(out, exist_ok=True)
    made = a.workdir is None
    if made:
        a.workdir = tempfile.mkdtemp(prefix="vp-comfyui-gguf-")
    os.makedirs(a.workdir, exist_ok=True)
    a.timeout = ours["timeout"]
    runs = [x.strip() for x in ours["runs"].split(",") if x.strip()]
    for ln in cr.machine(a):
        say(ln)
    say("inputs: %s; GGUF %s (ComfyUI-GGUF at %s), LoRA %s; runs %s" % (
        cr.inputs_line(a), ", ".join(qtypes), os.environ[ENV_DIR],
        ours["lora"], runs))
    summary = {"args": vars(a), "cells": {}}
    rc = 0
    rows = []
    try:
        gen = cr.run_child(a, "gen", [], os.path.join(out, "gen.log"))
        if gen is None:
            return 1
        say("checkpoint: %s %.2f GiB bf16, %d tensors" % (
            gen.get("model_config"), gen["bytes"] / GiB, gen["tensors"]))
        from safetensors.torch import load_file
        tensors = load_file(gen["path"])
        import_gguf(a.deps)
        for q in qtypes:
            t0 = time.perf_counter()
            path = os.path.join(a.workdir, "flux_random_%s.gguf" % q)
            info = write_gguf(tensors, path, q, seed=a.seed)
            g = dict(gen, path=path, bytes=info["bytes"],
                     w_max=info["w_max"], gguf=info,
                     held={"default": {"bytes": info["bytes"],
                                       "w_max": info["w_max"]}})
            say("")
            say("=== GGUF %s: %.2f GiB (%s), written in %.0f s" % (
                q, info["bytes"] / GiB, ", ".join(
                    "%s x%d" % kv for kv in sorted(info["types"].items())),
                time.perf_counter() - t0))
            for lora in loras:
                name = "%s%s" % (q, "_lora" if lora else "")
                b = copy.copy(a)
                b.lora = lora
                sub = os.path.join(out, name)
                os.makedirs(sub, exist_ok=True)
                say("--- %s%s" % (q, ", LoRA prompts" if lora else ""))
                cell = {"runs": {}}
                rc = run_cell(cr, b, ours, runs, sub, g, cell) or rc
                summary["cells"][name] = cell
                rows.append((q, lora, cell))
            os.remove(path)
    finally:
        if made:
            shutil.rmtree(a.workdir, ignore_errors=True)
    say("")
    say("GGUF (budget: half the GGUF weights; latents prompt by prompt, "
        "R equal to resident's):")
    say("  (node/L: the last prompt's; worst/L: the node's worst prompt "
        "after the first, each against resident's same prompt)")
    say("  %-6s %-4s %-22s %-10s %-10s %-10s %-9s %s" % (
        "qtype", "LoRA", "node latents", "node/L", "worst/L", "half/L",
        "node/half", "half latents"))
    for q, lora, cell in rows:
        t = cell.get("table", {})
        n, h = t.get("nodehalf", {}), t.get("half", {})
        ns, hs = n.get("steady_ms"), h.get("steady_ms")
        w = worst_vs_L(cr, cell)
        say("  %-6s %-4s %-22s %-10s %-10s %-10s %-9s %s" % (
            q, "yes" if lora else "no", bn._equal_words(n),
            "%.3f" % n["vs_L"] if "vs_L" in n else "-",
            "%.3f" % w if w is not None else "-",
            "%.3f" % h["vs_L"] if "vs_L" in h else "-",
            "%.3f" % (ns / hs) if ns and hs else "-", bn._equal_words(h)))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return rc


if __name__ == "__main__":
    sys.exit(main())
