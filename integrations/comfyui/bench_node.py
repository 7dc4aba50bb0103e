#!/usr/bin/env python3
"""ComfyUI 0.33 sampling with the vpager node against all-resident (issue 15).

The harness of bench/comfyui_run.py (ComfyUI in library mode, a random-weight
checkpoint made with ComfyUI's own classes, euler, steps timed by a
synchronizing callback, latents hashed), with one more kind of run:
"nodeN", ComfyUI with this package installed as its custom node (install()
after main.py's block B, as ComfyUI's custom-node loading does), under a
budget of N GiB (--reserve-vram = device total - N); "node" with no budget,
"nodehalf" (and the drop-in's "half") under half the checkpoint's weights.
Runs without the "node" prefix are bench/comfyui_run.py's own (resident:
the drop-in with every weight resident; N: the drop-in under N GiB).

    python3 integrations/comfyui/bench_node.py --comfyui build-clients/ComfyUI \\
        --runs resident,node6 --out $OUT/comfyui_node
    ... --dry-run            # 1 + 1 blocks, hidden 256, 256x256: a minute
    # issue 15's other points (bench/comfyui_run.py's --model/--lora/--vae):
    ... --lora --double 1 --single 2 --size 512 --steps 3 --runs legacy,node1
    ... --vae --double 4 --single 8 --steps 4 --runs resident,node3,3
    ... --model sdxl --runs resident,nodehalf,half
    ... --model video --runs resident,nodehalf,half

Prints per run: patcher class, steady step (median of steps 2..n) and first
step per repetition (prompt), vpager's counters; then each run's latents
against the resident run's (sha256 of the float32 bytes, prompt by
prompt); for runs under a budget the limit L = max(resident, (W - B +
2 w_max) / link) (B: the budget less torch's peak reservation in that run,
link: measured in the checkpoint's process) and steady / L; with --lora,
per prompt the weights whose patch set changed against what the node
refilled (its refills counter, bytes copied); with --vae, the second
prompt's first step over the first prompt's steady step (no thrash: <= 1.1).
Exit 0; 1 when a run failed; 2 when latents differ.
"""

import importlib.util
import json
import os
import sys
import tempfile
import time
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GiB = 1 << 30


def harness():
    path = os.path.join(ROOT, "bench", "comfyui_run.py")
    spec = importlib.util.spec_from_file_location("comfyui_run", path)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    return cr


def say(*a):
    print(*a, flush=True)


def split_args(argv):
    """(our options, bench/comfyui_run.py's)."""
    ours = {"runs": "resident,node6", "node": False, "timeout": 240,
            "out": None, "gen_only": False, "reuse": False}
    rest = []
    it = iter(argv)
    for x in it:
        if x == "--runs":
            ours["runs"] = next(it)
        elif x == "--node":
            ours["node"] = True
        elif x == "--timeout":
            ours["timeout"] = int(next(it))
        elif x == "--out":
            ours["out"] = next(it)
        elif x == "--gen-only":         # make the checkpoint, stop
            ours["gen_only"] = True
        elif x == "--reuse":            # --workdir's checkpoint if made
            ours["reuse"] = True
        else:
            rest.append(x)
    return ours, rest


# ---------------------------------------------------------------- child

def child(cr, a):
    """bench/comfyui_run.py's sample child, with the node installed right
    after main.py's block B and vpager's counters in the memory report."""
    orig_init, orig_memory = cr.comfy_init_devices, cr.memory
    info = {}

    def init_devices(args):
        state = orig_init(args)
        sys.path.insert(0, os.path.join(ROOT, "integrations"))
        import comfyui as node          # installs itself: comfy is loaded
        cls = node.install()
        info["node"] = cls.__name__ if cls is not None else None
        return state

    def memory(patcher, torch):
        m = orig_memory(patcher, torch)
        stats = getattr(patcher, "vpager_stats", None)
        s = stats() if stats is not None else None
        if s is not None:
            m["vpager"] = {k: s[k] for k in (
                "weights", "weight_bytes", "resident_bytes", "units",
                "acquires", "hits", "misses", "weight_fills",
                "weight_staged", "fill_bytes", "staged_bytes",
                "prefetch_bytes", "file_weights", "patched_weights",
                "refills", "set_sources", "replaced", "schedule")
                if k in s}
        m["node"] = info.get("node")
        return m

    cr.comfy_init_devices = init_devices
    cr.memory = memory
    return cr.child_sample(a)


def run_node_child(cr, a, run, budget, ckpt, log_path, timeout):
    """The node's child for run `run` ("node...") under `budget` GiB (a
    string; None: no budget, as resident)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--node",
           "--child", "sample"] + cr.common_args(a) + \
        ["--run", budget if budget is not None else "resident",
         "--tag", run, "--ckpt", ckpt]
    env = cr.child_env(a, [os.path.join(ROOT, "integrations")])
    return cr.spawn(cmd, env, log_path, timeout, run)


def budget_of(run, gen):
    """(the budget string a child takes, bytes) of a run name, or (None,
    None) for resident, "node" and legacy."""
    b = run[4:] if run.startswith("node") else run
    if b in ("", "resident", "legacy"):
        return None, None
    if b == "half":
        return "%.3f" % (gen["bytes"] / 2 / GiB), gen["bytes"] // 2
    return b, int(float(b) * GiB)


# --------------------------------------------------------- orchestrator

def report(cr, name, r):
    say("  %s: patcher %s, state %s, model %s %.2f GiB (%s), load %.2f s, "
        "process %.0f s" % (name, r.get("patcher"), r.get("patcher_state"),
                            r.get("model_class"),
                            r.get("model_size", 0) / GiB,
                            r.get("unet_dtype"), r.get("load_s", 0),
                            r.get("wall_s", 0)))
    if r.get("vae_patcher"):
        say("    VAE: patcher %s, %s" % (r["vae_patcher"], r.get("vae_dtype")))
    for i, rep in enumerate(r.get("reps", [])):
        ms = rep["steps_ms"]
        ff = rep.get("first_forward_ms")
        say("    %s: steady %.1f ms (steps %s), first %.0f ms%s; latent %s%s%s"
            % (rep.get("label", "rep %d" % i), cr.steady(ms),
               " ".join("%.1f" % x for x in ms), ms[0],
               " (its forward %.1f)" % ff if ff else "",
               rep["latent_sha256"][:16],
               "" if rep.get("latent_finite", True) else " (NOT FINITE)",
               "; decode %.0f ms, image %s" % (rep["decode_ms"],
                                               rep["image_sha256"][:16])
               if "decode_ms" in rep else ""))
        vp = rep.get("vpager")
        if vp:
            say("      vpager: %s" % json.dumps(vp))
        pc = rep.get("patch_changed")
        if pc is not None:
            d = rep.get("vpager_delta") or {}
            say("      patches: %d weights patched, %d changed (%.1f MiB); "
                "node refilled %s, refills +%s, bytes copied +%.1f MiB "
                "(fill %.1f, staged %.1f, prefetch %.1f)"
                % (pc["patched"], pc["weights"], pc["bytes"] / 2**20,
                   rep.get("node_refilled"), d.get("refills"),
                   copied(d) / 2**20, d.get("fill_bytes", 0) / 2**20,
                   d.get("staged_bytes", 0) / 2**20,
                   d.get("prefetch_bytes", 0) / 2**20))
        say("      resident %s, torch reserved %.2f GiB (peak %.2f), device "
            "used %.2f GiB" % (rep.get("patcher_loaded"),
                               rep["torch_reserved"] / GiB,
                               rep.get("torch_peak_reserved", 0) / GiB,
                               rep["device_used"] / GiB))


def copied(d):
    return sum(d.get(k, 0) for k in ("fill_bytes", "staged_bytes",
                                     "prefetch_bytes"))


def compare(cr, a, gen, summary):
    """Latents (and images) against resident's, prompt by prompt; L for
    budget runs; --lora's refill check, --vae's thrash ratio. Returns the
    exit code's part (2: latents differ)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import benchlib
    rc = 0
    runs = summary["runs"]
    base = runs.get("resident")
    link = gen.get("link_GBps")
    say("W %.2f GiB (%.2f GB), w_max %.1f MiB, link %.2f GB/s (pinned "
        "host->device, measured in the checkpoint's process)"
        % (gen["bytes"] / GiB, gen["bytes"] / 1e9,
           gen.get("w_max", 0) / 2**20, link or 0))
    table = {}
    for run, r in runs.items():
        if r is None:
            continue
        row = table[run] = {}
        reps = r["reps"]
        # ComfyUI's own outputs: resident (dynamic VRAM, every weight
        # resident: a LoRA applied at each cast, in the weight's dtype)
        # and legacy (ModelPatcher: the LoRA baked in at load, computed in
        # float32 and rounded stochastically, as the node does).
        equal_any = None
        for ref in ("resident", "legacy"):
            rr = runs.get(ref)
            if rr is None or ref == run or (ref == "legacy"
                                            and run == "resident"):
                continue
            same = [x["latent_sha256"] == y["latent_sha256"]
                    for x, y in zip(reps, rr["reps"])]
            row["latents_equal_" + ref] = same
            equal_any = same if equal_any is None else \
                [p or q for p, q in zip(equal_any, same)]
            ratio = [cr.steady(x["steps_ms"]) / cr.steady(y["steps_ms"])
                     for x, y in zip(reps, rr["reps"])]
            row["steady_over_" + ref] = ratio
            img = [x.get("image_sha256") == y.get("image_sha256")
                   for x, y in zip(reps, rr["reps"]) if "image_sha256" in x]
            say("%s vs %s: latents bitwise equal %s%s; steady step ratio %s"
                % (run, ref, same, "; images bitwise equal %s" % img
                   if img else "", " ".join("%.3f" % x for x in ratio)))
        if equal_any is not None and run != "legacy":
            row["latents_equal_a_reference"] = equal_any
            if not all(equal_any):
                rc = 2
        bs, bb = budget_of(run, gen)
        if bs is not None and base is not None and link:
            res_ms = cr.steady(base["reps"][-1]["steps_ms"])
            peak = max(x.get("torch_peak_reserved", 0) for x in reps)
            B = bb - peak
            lim, link_ms = benchlib.stream_limit_ms(
                res_ms, gen["bytes"], B, gen.get("w_max", 0), link)
            st = cr.steady(reps[-1]["steps_ms"])
            row.update(budget=bb, torch_peak=peak, B=B, L_ms=lim,
                       link_term_ms=link_ms, steady_ms=st, vs_L=st / lim)
            say("%s: budget %.2f GiB, torch peak %.2f GiB, B %.2f GiB; L = "
                "max(resident %.1f, link term %.1f) = %.1f ms; steady %.1f "
                "ms (last prompt) = %.3f x L" % (run, bb / GiB, peak / GiB,
                                                 B / GiB, res_ms, link_ms,
                                                 lim, st, st / lim))
        if a.vae:
            # Prompt i after prompt i - 1 of the same weights (no patch
            # change between them): its first step holds the reload of
            # what the VAE decode took from the diffusion model.
            pairs = []
            for i in range(1, len(reps)):
                pc = reps[i].get("patch_changed")
                if pc is not None and pc["weights"]:
                    continue
                s0 = cr.steady(reps[i - 1]["steps_ms"])
                f1 = reps[i]["steps_ms"][0]
                ff = reps[i].get("first_forward_ms")
                pairs.append({"prompt": reps[i].get("label"), "first_ms": f1,
                              "first_forward_ms": ff,
                              "prev_steady_ms": s0, "ratio": f1 / s0,
                              "forward_ratio": ff / s0 if ff else None})
                say("%s: UNet then VAE each prompt: %s's first step %.1f ms "
                    "/ %s's steady %.1f ms = %.3f; its first forward alone "
                    "(sample()'s set-up before it left out) %s (target "
                    "<= 1.1)" % (
                        run, reps[i].get("label"), f1,
                        reps[i - 1].get("label"), s0, f1 / s0,
                        "%.1f ms = %.3f" % (ff, ff / s0) if ff else "n/a"))
            row["thrash"] = pairs
            say("%s: decodes %s ms" % (run, " ".join(
                "%.0f" % x.get("decode_ms", 0) for x in reps)))
        if a.lora and reps and reps[0].get("vpager_delta") is not None:
            ok = []
            for x in reps[1:]:
                d = x.get("vpager_delta") or {}
                ok.append(d.get("refills") == x["patch_changed"]["weights"])
            row["refilled_only_changed"] = ok
            say("%s: LoRA prompts: refilled exactly the weights whose patch "
                "set changed %s (per prompt after the first)" % (run, ok))
    summary["table"] = table
    return rc


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = split_args(argv)
    cr = harness()
    if "--check" in rest:
        return cr.main(rest)
    if "--child" in rest:
        a = cr.parse(rest)
        a.timeout = ours["timeout"]
        return child(cr, a) if ours["node"] else cr.main(rest)
    a = cr.parse(rest + ["--runs", "resident"])
    out = ours["out"] or (os.path.join(os.environ["OUT"], "comfyui_node")
                          if os.environ.get("OUT") else "comfyui-node")
    os.makedirs(out, exist_ok=True)
    made = a.workdir is None
    if made:
        a.workdir = tempfile.mkdtemp(prefix="vp-comfyui-node-")
    os.makedirs(a.workdir, exist_ok=True)
    runs = [x.strip() for x in ours["runs"].split(",") if x.strip()]
    a.timeout = ours["timeout"]
    for ln in cr.machine(a):
        say(ln)
    say("inputs: %s; runs %s" % (cr.inputs_line(a), runs))
    summary = {"args": vars(a), "runs": {}}
    rc = 0
    try:
        gj = os.path.join(a.workdir, "gen.json")
        if ours["reuse"] and os.path.exists(gj):
            with open(gj) as f:
                gen = json.load(f)
            say("checkpoint reused from %s" % gj)
        else:
            gen = cr.run_child(a, "gen", [], os.path.join(out, "gen.log"))
            if gen is None:
                return 1
            with open(gj, "w") as f:
                json.dump(gen, f)
        if ours["gen_only"]:
            say("checkpoint made in %s (--gen-only)" % a.workdir)
            return 0
        say("checkpoint: %s %.2f GiB, %d tensors, %s, made %.1f s, saved "
            "%.1f s%s%s" % (gen.get("model_config"), gen["bytes"] / GiB,
                            gen["tensors"], gen.get("dtype"), gen["make_s"],
                            gen["save_s"],
                            "; LoRA A %d tensors on %d weights, B %d on %d"
                            % (gen["lora"]["a"]["tensors"],
                               len(gen["lora"]["a"]["weights"]),
                               gen["lora"]["b"]["tensors"],
                               len(gen["lora"]["b"]["weights"]))
                            if "lora" in gen else "",
                            "; VAE %.0f MiB" % (gen["vae"]["bytes"] / 2**20)
                            if "vae" in gen else ""))
        summary["checkpoint"] = gen
        for run in runs:
            t0 = time.perf_counter()
            log = os.path.join(out, "run_%s.log" % run)
            bs, _ = budget_of(run, gen)
            if run.startswith("node"):
                r = run_node_child(cr, a, run, bs, gen["path"], log,
                                   ours["timeout"])
            else:
                r = cr.run_child(a, "sample", ["--run", bs or run, "--tag",
                                               run, "--ckpt", gen["path"]],
                                 log)
            summary["runs"][run] = r
            if r is None:
                rc = 1
                continue
            report(cr, run, r)
            say("  (%.0f s)" % (time.perf_counter() - t0))
        c = compare(cr, a, gen, summary)
        rc = rc or c
    finally:
        if made:
            shutil.rmtree(a.workdir, ignore_errors=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
