#!/usr/bin/env python3
"""ComfyUI 0.33 sampling with the vpager node against all-resident (issue 15).

The harness of bench/comfyui_run.py (ComfyUI in library mode, a random-weight
Flux-class checkpoint made with ComfyUI's own classes, 1024x1024, euler,
steps timed by a synchronizing callback, latents hashed), with one more kind
of run: "nodeN", ComfyUI with this package installed as its custom node
(install() after main.py's block B, as ComfyUI's custom-node loading does),
under a budget of N GiB (--reserve-vram = device total - N). Runs without
the "node" prefix are bench/comfyui_run.py's own (resident: the drop-in with
every weight resident; N: the drop-in under N GiB).

    python3 integrations/comfyui/bench_node.py --comfyui build-clients/ComfyUI \\
        --runs resident,node6 --out $OUT/comfyui_node
    ... --dry-run            # 1 + 1 blocks, hidden 256, 256x256: a minute

Prints per run: patcher class, steady step (median of steps 2..n) and first
step per repetition, vpager's counters; then each run's latents against the
resident run's (sha256 of the float32 bytes, repetition by repetition).
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
            "out": None}
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
                "replaced", "schedule")
                if k in s}
        m["node"] = info.get("node")
        return m

    cr.comfy_init_devices = init_devices
    cr.memory = memory
    return cr.child_sample(a)


def run_node_child(cr, a, budget, ckpt, log_path, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--node",
           "--child", "sample", "--comfyui", a.comfyui,
           "--workdir", a.workdir, "--steps", str(a.steps),
           "--size", str(a.size), "--double", str(a.double),
           "--single", str(a.single), "--hidden", str(a.hidden),
           "--reps", str(a.reps), "--seed", str(a.seed),
           "--run", budget, "--ckpt", ckpt] + \
        (["--dry-run"] if a.dry_run else []) + \
        [x for d in a.deps for x in ("--deps", d)]
    env = cr.child_env(a, [os.path.join(ROOT, "integrations")])
    return cr.spawn(cmd, env, log_path, timeout, "node" + budget)


# --------------------------------------------------------- orchestrator

def report(cr, name, r):
    say("  %s: patcher %s, state %s, model %.2f GiB, load %.2f s, process "
        "%.0f s" % (name, r.get("patcher"), r.get("patcher_state"),
                    r.get("model_size", 0) / GiB, r.get("load_s", 0),
                    r.get("wall_s", 0)))
    for i, rep in enumerate(r.get("reps", [])):
        ms = rep["steps_ms"]
        say("    rep %d: steady %.1f ms (steps %s), first %.0f ms; latent %s"
            % (i, cr.steady(ms), " ".join("%.1f" % x for x in ms), ms[0],
               rep["latent_sha256"][:16]))
        vp = rep.get("vpager")
        if vp:
            say("      vpager: %s" % json.dumps(vp))
        say("      resident %s, torch reserved %.2f GiB, device used %.2f GiB"
            % (rep.get("patcher_loaded"), rep["torch_reserved"] / GiB,
               rep["device_used"] / GiB))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = split_args(argv)
    cr = harness()
    if "--check" in rest:
        return cr.main(rest)
    if "--child" in rest:
        a = cr.parse(rest)
        return child(cr, a) if ours["node"] else cr.main(rest)
    a = cr.parse(rest + ["--runs", "resident"])
    out = ours["out"] or (os.path.join(os.environ["OUT"], "comfyui_node")
                          if os.environ.get("OUT") else "comfyui-node")
    os.makedirs(out, exist_ok=True)
    made = a.workdir is None
    if made:
        a.workdir = tempfile.mkdtemp(prefix="vp-comfyui-node-")
    runs = [x.strip() for x in ours["runs"].split(",") if x.strip()]
    a.timeout = ours["timeout"]
    for ln in cr.machine(a):
        say(ln)
    say("inputs: Flux-class random weights, %d double + %d single blocks, "
        "hidden %d, bf16; %dx%d, euler/simple, %d steps, %d reps; runs %s%s"
        % (a.double, a.single, a.hidden, a.size, a.size, a.steps, a.reps,
           runs, "; DRY RUN" if a.dry_run else ""))
    summary = {"runs": {}}
    rc = 0
    try:
        gen = cr.run_child(a, "gen", [], os.path.join(out, "gen.log"))
        if gen is None:
            return 1
        say("checkpoint: %.2f GiB, %d tensors, made %.1f s, saved %.1f s"
            % (gen["bytes"] / GiB, gen["tensors"], gen["make_s"],
               gen["save_s"]))
        summary["checkpoint"] = gen
        for run in runs:
            t0 = time.perf_counter()
            log = os.path.join(out, "run_%s.log" % run)
            if run.startswith("node"):
                r = run_node_child(cr, a, run[4:], gen["path"], log,
                                   ours["timeout"])
            else:
                r = cr.run_child(a, "sample", ["--run", run, "--ckpt",
                                               gen["path"]], log)
            summary["runs"][run] = r
            if r is None:
                rc = 1
                continue
            report(cr, run, r)
            say("  (%.0f s)" % (time.perf_counter() - t0))
        base = summary["runs"].get("resident")
        if base is not None:
            for run, r in summary["runs"].items():
                if run == "resident" or r is None:
                    continue
                same = [x["latent_sha256"] == y["latent_sha256"]
                        for x, y in zip(r["reps"], base["reps"])]
                ratio = [cr.steady(x["steps_ms"])
                         / cr.steady(y["steps_ms"])
                         for x, y in zip(r["reps"], base["reps"])]
                say("%s vs resident: latents bitwise equal %s; steady "
                    "step ratio %s" % (run, same,
                                       " ".join("%.3f" % x for x in ratio)))
                if not all(same):
                    rc = rc or 2
    finally:
        if made:
            shutil.rmtree(a.workdir, ignore_errors=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
