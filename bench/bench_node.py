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

    python3 bench/bench_node.py --comfyui build-clients/ComfyUI \\
        --runs resident,node6 --out $OUT/comfyui_node
    ... --dry-run            # 1 + 1 blocks, hidden 256, 256x256: a minute
    # issue 15's other points (bench/comfyui_run.py's --model/--lora/--vae):
    ... --lora --double 1 --single 2 --size 512 --steps 3 --runs legacy,node1
    ... --vae --double 4 --single 8 --steps 4 --runs resident,node3,3
    ... --model sdxl --runs resident,nodehalf,half
    ... --model video --runs resident,nodehalf,half
    # issue 26 point 1: UNETLoader's weight_dtype fp8_e4m3fn,
    # fp8_e4m3fn_fast, fp8_e5m2 (a bf16 file), without and with the LoRA
    # prompts, each cell resident / nodehalf / half (+ legacy): ~7 min
    ... --fp8 [--shape small|flux] [--dtypes A,B] [--fp8-lora off|on|both]
        [--fp8-budget half|N]
    ... --weight-dtype fp8_e4m3fn --runs resident,nodehalf,half
    # issue 26 point 3: a scaled-fp8 checkpoint (bench/comfyui_run.py
    # --quant: fp8 weights, per-tensor scales, the scaled_fp8 marker),
    # loaded by ComfyUI's loader as QuantizedTensor weights, without and
    # with the LoRA prompts, each cell resident / nodehalf / half (+ legacy
    # with the LoRA): ~4 min on the small shape
    ... --quant scaled_fp8 [--shape small|flux] [--fp8-lora off|on|both]
        [--fp8-budget half|N]      # formats: a comma list of --quant's

    # issues 28 (host memory) and 29 (the cost of change), each beside
    # ComfyUI's own dynamic path under the same budget:
    ... --double 19 --single 38 --runs resident,node8,8 --reps 4
    ... --switch 19x38 --runs resident,node12,12   # 9.4 GiB, then 22 GiB
    ... --double 19 --single 38 --switch 8x16 --cgroup-gib 32 \
        --runs resident,node8,8                  # memory pressure survived
    ... --lora --runs legacy,node6,6             # LoRA change
    ... --runs resident,node8,node8late,8   # first prompt: placed early or not
    ... --runs resident,node8,node8steps,8   # a placement in steps or not

Prints per run: patcher class, steady step (median of steps 2..n) and first
step per repetition (prompt), vpager's counters, the host's memory
(issue 28: RSS and MemAvailable after each prompt and before the load,
vpager's pinned bytes and the machine's; the node's host_by_kind and
host_policy among its counters); then each run's latents
against the resident run's (sha256 of the float32 bytes, prompt by
prompt); for runs under a budget the limit L = max(resident, (W - B +
2 w_max) / link) (B: the budget less torch's peak reservation in that run,
link: measured in the checkpoint's process) and steady / L (and, for a
run whose torch peak is above another run's of its budget, against the L
of that lesser peak: a loan of torch's cache that grows it), and for node
runs the budget use (weights resident after the last prompt / (budget -
torch's peak - the staging ring), target >= 0.95); with three
prompts or more (not --lora, not --switch), how far apart prompts
2..N's steady steps are (target <= 2%); with --lora,
per prompt the weights whose patch set changed against what the node
refilled (its refills counter, bytes copied); with --vae, the second
prompt's first step over the first prompt's steady step (no thrash: <= 1.1).
With --switch, each model switch (a prompt after one of the other model:
its sample() time less its steps at its own steady step) and the node's
over ComfyUI's (target <= 0.8); per run the largest RSS after a prompt
against the model files (target: <= files + 1.5 GiB) and the node's over
ComfyUI's (<= 1.05); with --cgroup-gib the cgroup's peak and OOM kills
(the reference runs, resident and legacy, run outside it).
Exit 0; 1 when a run failed; 2 when latents differ.
"""

import copy
import importlib.util
import json
import os
import sys
import tempfile
import time
import shutil
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GiB = 1 << 30


HARNESS = None


def harness():
    global HARNESS
    path = os.path.join(ROOT, "bench", "comfyui_run.py")
    spec = importlib.util.spec_from_file_location("comfyui_run", path)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    HARNESS = cr
    return cr


def say(*a):
    print(*a, flush=True)


FP8_DTYPES = ("fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
# --fp8's model shapes (bench/comfyui_run.py's options, which the command
# line can still override): "small", a Flux-class DiT of 2 + 4 blocks of
# 3072 (2.5 GiB bf16, 1.25 GiB as fp8) at 512x512, 4 steps: the whole
# matrix in about 5 minutes on an H200; "flux", the harness's default
# 8 + 16 blocks (9.4 GiB bf16) at 1024x1024, 6 steps.
SHAPES = {"small": ["--double", "2", "--single", "4", "--size", "512",
                    "--steps", "4"],
          "flux": []}


def split_args(argv):
    """(our options, bench/comfyui_run.py's)."""
    ours = {"runs": "resident,node6", "node": False, "timeout": 240,
            "out": None, "gen_only": False, "reuse": False, "fp8": False,
            "dtypes": ",".join(FP8_DTYPES), "fp8_lora": "both",
            "shape": "small", "fp8_budget": "half", "quant": None}
    rest = []
    it = iter(argv)
    for x in it:
        if x == "--fp8":                # the weight_dtype matrix
            ours["fp8"] = True
        elif x == "--dtypes":
            ours["dtypes"] = next(it)
        elif x == "--quant":            # the quantized-checkpoint matrix
            ours["quant"] = next(it)
        elif x == "--fp8-lora":
            ours["fp8_lora"] = next(it)
        elif x == "--shape":
            ours["shape"] = next(it)
        elif x == "--fp8-budget":
            ours["fp8_budget"] = next(it)
        elif x == "--runs":
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
            sch, dv, lent = s["schedule"], s["device"], s.get("lend")
            m["pinned"] = {k: dv.get(k) for k in (
                "host_pinned_bytes", "machine_pinned_bytes",
                "pin_fallback_bytes")}
            s = dict(s["model"], schedule=sch)
            m["vpager"] = {k: s[k] for k in (
                "weights", "weight_bytes", "resident_bytes", "units",
                "acquires", "hits", "misses", "weight_fills",
                "weight_staged", "fill_bytes", "staged_bytes",
                "prefetch_bytes", "file_weights", "converted_weights",
                "convert_ms", "patched_weights", "quantized_weights",
                "refills", "host_patched_weights", "host_patched_bytes",
                "patch_fills", "patch_staged_bytes",
                "patch_fill_bytes", "set_sources", "kept_fills",
                "kept_fill_bytes", "replaced", "unheld_forwards", "schedule",
                "host_by_kind", "host_policy")
                if k in s}
            if lent and lent["on"]:
                m["vpager"]["lend"] = dict(
                    lent, sm_copy_bytes=dv.get("sm_copy_bytes"))
        m["node"] = info.get("node")
        return m

    cr.comfy_init_devices = init_devices
    cr.memory = memory
    return cr.child_sample(a)


# A node run named node<budget><suffix> runs with these variables: "late"
# places the weights after the first forward, not before it; "steps"
# takes a placement in steps, "onestep" in one forward (the default) (the
# first prompt with and without each, beside the default in one run);
# "nokeep" computes a streamed weight's LoRA patch at each of its fills
# (no kept fills: vpager.torch's keptfills.py); "nocold" makes no plan
# from the first (cold) forward while the guessed placement is in place;
# "warm" plans from the cold forward with each unit's work at most its
# kind's median (vpager.torch's coldwork.py; the default), "nowarm"
# takes the first plan from the planner at a later forward; "move" copies
# the resident weights a placement moves on the device (relocate.py);
# "cache" and "cached" remember each unit's settled work in --workdir's
# plans/ (VPAGER_PLAN_CACHE, emptied when the bench starts): both read a
# plan there if one is (a model's plan is the same for any budget) and
# write theirs; named "cache" where it is the first, "cached" after one,
# as a process started again. "allmarks" marks every unit call of each
# measured forward (VPAGER_MARK_CALLS=0; by default a model with more than
# 300 calls is measured a span of them a forward, the spans of several
# forwards read as one). "nohold" holds no unit for the whole forward
# (VPAGER_HOLD=0: every unit takes the per-unit path); "gap" plans for
# the time between two forwards (VPAGER_BETWEEN=1); "lend" lends torch's
# free cache to the staging ring between forwards (VPAGER_LEND=1),
# "lendtrace" the same with torch's allocations recorded and what grew
# torch's cache during a loan printed (VPAGER_BENCH_LEND_TRACE, comfyui_run);
# "ab" after a lend suffix ("node6lend288ab") turns the loans off and on
# in turn from the second prompt (VPAGER_BENCH_LEND_ALTERNATE: an A/B in
# one process, the host's drift on both); "conds" moves the prompt's
# conditioning to the GPU once (VPAGER_BENCH_CONDS_ON_DEVICE: no client
# copy in a step's pause, an experiment: "node6lend288early288condsab" is
# what a fill of the whole pause gains when it holds no copy up);
# "spin10" / "spin20" / "spin100" make each unit's per-unit path 10 / 20 /
# 100 us longer on the host (VPAGER_BENCH_UNIT_SPIN: whether the step is
# the host's; 100 checks the instrument: a step it leaves as it was is a
# step the host's pace never sets);
# "page8" / "page16" open the device with 8 / 16 MiB pages (the GPU's
# default 32 MiB: a plan's spare page and its rounding cost a page each);
# "firstfit" opens the staging ring without its second view
# (VPAGER_STAGING_WRAP=0: a slot that does not fit before the end starts at
# 0, the plans count 90% of the ring, as before the fifty-fourth session).
# Suffixes combine:
# "node6warmsteps"; a name may end in a repeat mark, "node6warm.2"
# (_named).
SUFFIXES = {"late": {"VPAGER_PLACE_EARLY": "0"},
            "onestep": {"VPAGER_PLACE_STEPS": "0"},
            "steps": {"VPAGER_PLACE_STEPS": "1"},
            "nokeep": {"VPAGER_KEEP_FILLS": "0"},
            "nocold": {"VPAGER_COLD_PLAN": "0"},
            "warm": {"VPAGER_COLD_WORK": "1"},
            "nowarm": {"VPAGER_COLD_WORK": "0"},
            "move": {"VPAGER_RELOCATE": "1"},
            "allmarks": {"VPAGER_MARK_CALLS": "0"},
            "nohold": {"VPAGER_HOLD": "0"},
            "gap": {"VPAGER_BETWEEN": "1"},
            "lend": {"VPAGER_LEND": "1"},
            "lendtrace": {"VPAGER_LEND": "1", "VPAGER_BENCH_LEND_TRACE": "1"},
            "ab": {"VPAGER_BENCH_LEND_ALTERNATE": "1"},
            "conds": {"VPAGER_BENCH_CONDS_ON_DEVICE": "1"},
            "spin10": {"VPAGER_BENCH_UNIT_SPIN": "10"},
            "spin20": {"VPAGER_BENCH_UNIT_SPIN": "20"},
            "spin100": {"VPAGER_BENCH_UNIT_SPIN": "100"},
            "spare0": {"VPAGER_SPARE_PAGES": "0"},
            "page8": {"VPAGER_PAGE_SIZE": "8M"},
            "page16": {"VPAGER_PAGE_SIZE": "16M"},
            "firstfit": {"VPAGER_STAGING_WRAP": "0"},
            "cache": {"VPAGER_PLAN_CACHE": "{plans}"},
            "cached": {"VPAGER_PLAN_CACHE": "{plans}"}}
# "ring320": the staging ring fixed at 320 MiB (the plan tries no other):
# which ring runs best on one machine, beside what the plans predict.
SUFFIXES.update(("ring%d" % r, {"VPAGER_STAGING": "%dM" % r})
                for r in (224, 256, 288, 320, 352, 378, 448, 512))
# "lend288": loans of torch's cache of at most 288 MiB (room for the two
# blocks bench/idle_cache.py found idle from a Flux forward's end to the
# next one's second double block on the H100, 296 MB, and no third).
SUFFIXES.update(("lend%d" % c, {"VPAGER_LEND": "1",
                                "VPAGER_LEND_CAP": "%dM" % c})
                for c in (64, 128, 192, 288))
# "early96" after a lend suffix ("node6lend288early96"): the loan
# borrowed at a forward's end, its first 96 MiB lent then and filled in
# the pause, the rest at the next forward's start (VPAGER_LEND_EARLY).
SUFFIXES.update(("early%d" % e, {"VPAGER_LEND_EARLY": "%dM" % e})
                for e in (64, 96, 128, 192, 288))
# "sm16" after an early suffix ("node6lend288early288sm16ab"): the copies
# into the loan lent at a forward's end read by 16 blocks of SMs, not the
# copy engine (VPAGER_LEND_SM: the client's copies in the pause do not
# queue behind them).
SUFFIXES.update(("sm%d" % p, {"VPAGER_LEND_SM": "%d" % p})
                for p in (4, 8, 16, 32))


def _named(run):
    """A run's name without its repeat mark: "node6warm.2" is node6warm
    run again (a first prompt is one sample a run: its spread is seen
    only across runs of one name)."""
    head, dot, tail = run.rpartition(".")
    return head if dot and tail.isdigit() else run


def _last_suffix(rest):
    """The longest SUFFIXES key `rest` ends with ("nowarm", not "warm"),
    or None."""
    return max((k for k in SUFFIXES if rest.endswith(k)), key=len,
               default=None)


def _suffix(run):
    """The SUFFIXES keys a node run's name ends with, joined ("warmsteps":
    warm and steps), or None."""
    run = _named(run)
    if not run.startswith("node"):
        return None
    got, rest = "", run[4:]
    while True:
        k = _last_suffix(rest)
        if k is None:
            return got or None
        got, rest = k + got, rest[:-len(k)]


def _suffix_env(run):
    """The variables of the run's SUFFIXES keys."""
    env, rest = {}, _suffix(run) or ""
    while rest:
        k = _last_suffix(rest)
        env.update(SUFFIXES[k])
        rest = rest[:-len(k)]
    return env


def run_node_child(cr, a, run, budget, ckpt, log_path, timeout):
    """The node's child for run `run` ("node...") under `budget` GiB (a
    string; None: no budget, as resident), with its suffix's variables
    (SUFFIXES)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--node",
           "--child", "sample"] + cr.common_args(a) + \
        ["--run", budget if budget is not None else "resident",
         "--tag", run, "--ckpt", ckpt]
    env = cr.child_env(a, [os.path.join(ROOT, "integrations")])
    env = dict(env, **{k: v.format(plans=plans_folder(a)) if "{" in v
                       else v for k, v in _suffix_env(run).items()})
    return cr.spawn(cmd, env, log_path, timeout, run, a.cgroup_gib)


def plans_folder(a):
    """Where "cache" and "cached" runs remember their plans."""
    return os.path.join(a.workdir, "plans")


def budget_of(run, gen, weight_dtype="default"):
    """(the budget string a child takes, bytes) of a run name, or (None,
    None) for resident, "node" and legacy. "half": half the weights as
    held with weight_dtype (bench/comfyui_run.py's held())."""
    run = _named(run)
    b = run[4:] if run.startswith("node") else run
    if _suffix(run) is not None:
        b = b[:-len(_suffix(run))]
    if b in ("", "resident", "legacy"):
        return None, None
    if b == "half":
        w = HARNESS.held(gen, weight_dtype)[0] if HARNESS else gen["bytes"]
        return "%.3f" % (w / 2 / GiB), w // 2
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
        if "rss" in rep:
            hb = r.get("host_before_load") or {}
            pin = rep.get("pinned") or {}
            say("      host: RSS %.2f GiB (before load %.2f; anon %.2f "
                "(huge pages %.2f), files %.2f, shmem %.2f), MemAvailable "
                "%.2f GiB (before load %.2f), pinned %.2f GiB (machine %.2f)"
                % (rep["rss"] / GiB, hb.get("rss", 0) / GiB,
                   rep.get("rss_anon", 0) / GiB,
                   rep.get("rss_anon_huge", 0) / GiB,
                   rep.get("rss_file", 0) / GiB,
                   rep.get("rss_shmem", 0) / GiB,
                   rep.get("mem_available", 0) / GiB,
                   hb.get("mem_available", 0) / GiB,
                   (pin.get("host_pinned_bytes") or 0) / GiB,
                   (pin.get("machine_pinned_bytes") or 0) / GiB))
        say("      resident %s, torch reserved %.2f GiB (peak %.2f), device "
            "used %.2f GiB" % (rep.get("patcher_loaded"),
                               rep["torch_reserved"] / GiB,
                               rep.get("torch_peak_reserved", 0) / GiB,
                               rep["device_used"] / GiB))
    line = first_prompt_line(cr, r)
    if line:
        say("    " + line)


def first_prompt(cr, r):
    """(its first prompt's sample() s, its worst step after the first
    (ms, None if one step), the last prompt's steady step (ms)) of a
    run's result, or None where it has none."""
    reps = (r or {}).get("reps") or []
    if not reps or "sample_s" not in reps[0]:
        return None
    first = reps[0]["steps_ms"]
    return (reps[0]["sample_s"], max(first[1:]) if len(first) > 1 else None,
            cr.steady(reps[-1]["steps_ms"]))


def first_prompt_line(cr, r):
    """Issue 29's first prompt: its sample() time, and its worst step
    after the first over the last prompt's steady step (target <= 1.1);
    with the schedule's "remembered" (VPAGER_PLAN_CACHE) where told."""
    got = first_prompt(cr, r)
    if got is None:
        return None
    first_s, worst, steady = got
    sch = ((r["reps"][0].get("vpager") or {}).get("schedule") or {})
    return "first prompt %.3f s; worst step after the first %s%s" % (
        first_s,
        "%.1f ms = %.2f x the last prompt's steady %.1f" % (
            worst, worst / steady, steady) if worst and steady else "-",
        "; planned from remembered work" if sch.get("remembered") else "")


def copied(d):
    return sum(d.get(k, 0) for k in ("fill_bytes", "staged_bytes",
                                     "prefetch_bytes"))


def compare(cr, a, gen, summary, judged=lambda run: run != "legacy"):
    """Latents (and images) against resident's, prompt by prompt; L for
    budget runs (resident's step, or legacy's where resident did not run);
    --lora's refill check, --vae's thrash ratio. Returns the
    exit code's part (2: the latents of a run judged(run) equal neither
    reference)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import benchlib
    rc = 0
    runs = summary["runs"]
    # L's resident step: the resident run's last prompt, else legacy's
    # (--lora: its last prompt is the model resident, its LoRA removed).
    base = runs.get("resident") or runs.get("legacy")
    link = gen.get("link_GBps")
    W, w_max = cr.held(gen, a.weight_dtype)
    med = gen.get("link_GBps_median")
    say("W %.2f GiB (%.2f GB%s), w_max %.1f MiB, link %.2f GB/s (pinned "
        "host->device, the fastest of 7 rounds%s, measured in the "
        "checkpoint's process)"
        % (W / GiB, W / 1e9, ", held as %s" % a.weight_dtype
           if a.weight_dtype != "default" else "", w_max / 2**20,
           link or 0, "; their median %.2f" % med if med else ""))
    # The least torch peak of each budget's runs: a run whose own work
    # made torch reserve more (a loan of torch's cache) is judged against
    # the L of the peak it would have had, too.
    least_peak = {}
    for run, r in runs.items():
        bb = budget_of(run, gen, a.weight_dtype)[1] if r else None
        if bb is not None:
            pk = max(x.get("torch_peak_reserved", 0) for x in r["reps"])
            least_peak[bb] = min(least_peak.get(bb, pk), pk)
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
            if not all(equal_any) and judged(run):
                rc = 2
        bs, bb = budget_of(run, gen, a.weight_dtype)
        if bs is not None and base is not None and link:
            res_ms = cr.steady(base["reps"][-1]["steps_ms"])
            peak = max(x.get("torch_peak_reserved", 0) for x in reps)
            B = bb - peak
            # Under torch's peak the budget leaves the weights nothing
            # (every weight crosses the link each step), not less.
            lim, link_ms = benchlib.stream_limit_ms(
                res_ms, W, max(B, 0), w_max, link)
            st = cr.steady(reps[-1]["steps_ms"])
            row.update(budget=bb, torch_peak=peak, B=B, L_ms=lim,
                       link_term_ms=link_ms, steady_ms=st, vs_L=st / lim)
            say("%s: budget %.2f GiB, torch peak %.2f GiB, B %.2f GiB; L = "
                "max(resident %.1f, link term %.1f) = %.1f ms; steady %.1f "
                "ms (last prompt) = %.3f x L" % (run, bb / GiB, peak / GiB,
                                                 B / GiB, res_ms, link_ms,
                                                 lim, st, st / lim))
            after = r.get("link_after")
            if after:
                # The same limit at the link this run's process read after
                # its prompts: a figure beside L, not L.
                lim1, link1 = benchlib.stream_limit_ms(
                    res_ms, W, max(B, 0), w_max, after[0])
                row.update(link_after_GBps=after[0], L_after_ms=lim1,
                           vs_L_after=st / lim1)
                say("%s: the link read after its prompts %.1f GB/s (L's: "
                    "%.1f): link term %.1f ms; steady = %.3f x max(resident, "
                    "that)" % (run, after[0], link, link1, st / lim1))
            if peak > least_peak.get(bb, peak):
                lim0, _ = benchlib.stream_limit_ms(
                    res_ms, W, max(bb - least_peak[bb], 0), w_max, link)
                row.update(L_least_peak_ms=lim0, vs_L_least_peak=st / lim0)
                say("%s: at this budget's least torch peak (%.2f GiB, "
                    "another run's) L = %.1f ms: steady = %.3f x L"
                    % (run, least_peak[bb] / GiB, lim0, st / lim0))
            # A slow settled run: did its held units run held?
            unheld = (reps[-1].get("vpager") or {}).get("unheld_forwards")
            if unheld is not None:
                row["unheld_forwards"] = unheld
                say("%s: forwards whose held units took the per-unit path "
                    "(by why): %s" % (run, unheld))
            if a.lora:
                lora_vs_L(cr, run, reps, runs.get("legacy"), link_ms, row)
        if bs is not None:
            budget_row(run, reps, bb, row)
        if not a.lora and a.switch_shape is None:
            prompts_row(cr, run, reps, row)
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
                pc = x["patch_changed"]
                ok.append(d.get("refills") ==
                          pc["weights"] - pc.get("at_use", 0))
            row["refilled_only_changed"] = ok
            say("%s: LoRA prompts: refilled exactly the weights whose patch "
                "set changed %s (per prompt after the first; a weight its "
                "op patches at each use, none)" % (run, ok))
        if a.lora:
            lora_change(cr, run, reps, row)
        if a.switch_shape is not None:
            row["switch"] = cr.say_switch(a, run, r)
        host_row(run, r, row, summary)
    if a.switch_shape is not None:
        versus(table, "switch", "model switch (the second model's prompts "
               "after the first's: extra s)", SWITCH_TARGET,
               lambda row: [c["extra_s"] for c in row["switch"]
                            if c["prompt"].startswith("second")])
    versus(table, "rss_max", "host RSS, the largest after a prompt",
           RSS_TARGET, lambda row: [row["rss_max"]])
    summary["table"] = table
    return rc


def budget_row(run, reps, budget, row):
    """Issue 29's whole budget, for a node run (vpager's counters in its
    prompts): the weights resident after the last prompt over what the
    budget leaves them, budget - torch's peak reservation - the staging
    ring (target >= BUDGET_USE_TARGET)."""
    vp = reps[-1].get("vpager") if reps else None
    sch = (vp or {}).get("schedule") or {}
    if vp is None or vp.get("resident_bytes") is None or \
            sch.get("staging") is None:
        return
    peak = max(x.get("torch_peak_reserved", 0) for x in reps)
    room = budget - peak - sch["staging"]
    use = vp["resident_bytes"] / room if room > 0 else float("nan")
    row.update(resident_bytes=vp["resident_bytes"], weights_room=room,
               budget_use=use)
    # (A LoRA's fills raise torch's peak once, by their temporaries: the
    # largest peak of a LoRA workflow can leave no room by this count.)
    said = "%.3f" % use if room > 0 else "not measured (no room left)"
    say("%s: budget use: %.2f GiB of weights resident of %.2f GiB (budget "
        "%.2f - torch peak %.2f - ring %.2f) = %s (target >= %.2f)"
        % (run, vp["resident_bytes"] / GiB, room / GiB, budget / GiB,
           peak / GiB, sch["staging"] / GiB, said, BUDGET_USE_TARGET))


def prompts_row(cr, run, reps, row):
    """Issue 29's stable prompts: the steady steps of prompts 2..N of one
    workflow (the same prompt again), the largest over the smallest less
    one (target <= PROMPTS_APART); nothing with fewer than two of them."""
    steady = [cr.steady(x["steps_ms"]) for x in reps[1:]
              if x.get("steps_ms")]
    if len(steady) < 2 or min(steady) <= 0:
        return
    apart = max(steady) / min(steady) - 1
    row.update(prompts_steady_ms=steady, prompts_apart=apart)
    say("%s: prompts 2..%d steady %s ms: %.1f%% apart (target <= %.0f%%)"
        % (run, len(steady) + 1, " ".join("%.1f" % x for x in steady),
           apart * 100, PROMPTS_APART * 100))
    by = {"off": [], "on": []}
    for x in reps[1:]:
        if x.get("lending") in by and x.get("steps_ms"):
            by[x["lending"]].append(cr.steady(x["steps_ms"]))
    if by["off"] and by["on"]:      # VPAGER_BENCH_LEND_ALTERNATE ("ab")
        ratio = statistics.median(by["on"]) / statistics.median(by["off"])
        row.update(lend_ab_ms=by, lend_ab_ratio=ratio)
        say("%s: lending off %s ms, on %s ms (one process, in turn): "
            "median on / off = %.3f" % (
                run, " ".join("%.1f" % x for x in by["off"]),
                " ".join("%.1f" % x for x in by["on"]), ratio))


# Issue 29's stable prompts: prompts 2..N's steady steps, largest over
# smallest, at most this much apart.
PROMPTS_APART = 0.02
# Issue 29's model switch target (node / ComfyUI's dynamic path) and issue
# 28's host RSS target (node / ComfyUI's dynamic path; and at most the
# model files + RSS_OVER_FILES).
SWITCH_TARGET, RSS_TARGET, RSS_OVER_FILES = 0.8, 1.05, 1.5 * GiB
# Issue 29's whole budget: weights resident / (budget - torch's peak - ring).
BUDGET_USE_TARGET = 0.95


def model_files(summary):
    """Bytes of the files a sampling child loads: the checkpoints, and
    the LoRAs and the VAE it was given (each as written to disk)."""
    files = 0
    for k in ("checkpoint", "checkpoint2"):
        ck = summary.get(k) or {}
        files += ck.get("file_bytes", 0)
        files += sum(x.get("bytes", 0) for x in
                     (ck.get("lora") or {}).values())
        files += (ck.get("vae") or {}).get("file_bytes", 0)
    return files


def host_row(run, r, row, summary):
    """The run's host memory: the largest RSS after a prompt and its peak
    (VmHWM), against the model files it loaded (issue 28: <= files +
    1.5 GiB); the memory cgroup's peak and OOM kills with --cgroup-gib."""
    reps = r.get("reps", [])
    rss = [x["rss"] for x in reps if "rss" in x]
    if not rss:
        return
    files = model_files(summary)
    peak = max(x.get("rss_peak", 0) for x in reps)
    row.update(rss_max=max(rss), rss_peak=peak, model_files=files)
    cap = r.get("memcap")
    if cap is not None:
        row["memcap"] = cap
    say("%s: host RSS largest after a prompt %.2f GiB (peak %.2f), model "
        "files %.2f GiB: RSS - files %+.2f GiB (target <= %+.1f)%s" % (
            run, max(rss) / GiB, peak / GiB, files / GiB,
            (max(rss) - files) / GiB, RSS_OVER_FILES / GiB,
            "; cgroup v%d limit %.1f GiB: peak %s, OOM kills %d" % (
                cap["version"], cap["limit"] / GiB,
                "%.2f GiB" % (cap["peak"] / GiB) if cap["peak"] else "n/a",
                cap["oom_kills"]) if cap else ""))


def versus(table, key, what, goal, values):
    """Each node run's `values(row)` (summed) over the same budget's
    ComfyUI dynamic run's, against `goal` (node / ComfyUI's <= goal)."""
    for run, row in table.items():
        if not run.startswith("node") or key not in row:
            continue
        peer = table.get(run[4:])
        if peer is None or key not in peer:
            continue
        mine, theirs = sum(values(row)), sum(values(peer))
        if theirs > 0:
            say("%s vs %s: %s %.3f / %.3f = %.3f (target <= %.2f)"
                % (run, run[4:], what, mine, theirs, mine / theirs, goal))


# Issue 29's targets for a LoRA change (s) and the step with a LoRA.
LORA_FIRST_S, LORA_STRENGTH_S, LORA_STEP = 1.0, 0.3, 1.03


def lora_change(cr, run, reps, row):
    """The cost of a LoRA change (issue 29's "LoRA change" rows): each
    LoRA prompt's sample() time (its load included) less that of
    lora_b_again (the LoRA loaded, nothing to change): first application
    (lora_a), strength change (lora_a@0.5), another LoRA (lora_b), removed;
    the steady step with a LoRA over the one without (lora_b_again's over
    removed's); the node's patch fills a step and the patch sets it
    staged on the device for them (patch_stage)."""
    by = {x.get("label"): x for x in reps}
    same = by.get("lora_b_again")
    if same is None or "sample_s" not in same:
        return
    cost = {k: by[k]["sample_s"] - same["sample_s"]
            for k in ("lora_a", "lora_a@0.5", "lora_b", "removed")
            if k in by and "sample_s" in by[k]}
    step = None
    if "removed" in by:
        step = cr.steady(same["steps_ms"]) / cr.steady(
            by["removed"]["steps_ms"])
    row["lora_change_s"] = cost
    row["lora_step_ratio"] = step
    # The node's patches computed at fill in the unchanged LoRA prompt:
    # the streamed patched weights' per-step cost (bytes rewritten).
    i = reps.index(same)
    now = same.get("vpager") or {}
    was = (reps[i - 1].get("vpager") or {}) if i else {}
    fill_mib = None
    if "patch_fill_bytes" in now and same["steps_ms"]:
        fill_mib = (now["patch_fill_bytes"] - was.get("patch_fill_bytes", 0)
                    ) / len(same["steps_ms"]) / 2**20
        row["lora_fill_mib_per_step"] = fill_mib
    staged = now.get("patch_staged_bytes")
    kept = now.get("kept_fill_bytes")

    def fmt(k):
        return "%.2f s" % cost[k] if k in cost else "n/a"
    say("%s: LoRA change (a prompt's time less lora_b_again's): first "
        "application %s (target <= %.1f), strength change %s (target <= "
        "%.1f), another LoRA %s, removed %s; step with LoRA / without %s "
        "(target <= %.2f)%s%s%s" % (
            run, fmt("lora_a"), LORA_FIRST_S, fmt("lora_a@0.5"),
            LORA_STRENGTH_S, fmt("lora_b"), fmt("removed"),
            "%.3f" % step if step else "n/a", LORA_STEP,
            "; patched at fill %.0f MiB a step" % fill_mib
            if fill_mib is not None else "",
            ", its patches staged on the device %.1f MiB" % (staged / 2**20)
            if staged is not None else "",
            ", patched bytes kept on the host %.0f MiB" % (kept / 2**20)
            if kept is not None else ""))


# The runs the latents are compared against: with --cgroup-gib they run
# outside the cgroup (ComfyUI's resident run keeps every model file in
# its RSS: in 32 GiB with the 22 + 9.4 GiB models the cgroup killed it,
# and left the node's latents nothing to be compared with).
REFERENCES = ("resident", "legacy")


def _capped(a, run):
    """a as run `run` takes it: a reference run's without --cgroup-gib."""
    if run in REFERENCES and getattr(a, "cgroup_gib", None) is not None:
        say("  %s: the reference, run outside the %g GiB cgroup"
            % (run, a.cgroup_gib))
        a = copy.copy(a)
        a.cgroup_gib = None
    return a


def run_set(cr, a, ours, runs, out, gen, summary, judged=None):
    """Run `runs` (children, one after the other, logs in `out`) on the
    checkpoint `gen`, report each, compare; the exit code's part."""
    rc = 0
    for run in runs:
        t0 = time.perf_counter()
        log = os.path.join(out, "run_%s.log" % run)
        bs, _ = budget_of(run, gen, a.weight_dtype)
        if run.startswith("node"):
            r = run_node_child(cr, a, run, bs, gen["path"], log,
                               ours["timeout"])
        else:
            r = cr.run_child(_capped(a, run), "sample",
                             ["--run", bs or _named(run), "--tag", run,
                              "--ckpt", gen["path"]], log)
        summary["runs"][run] = r
        if r is None:
            rc = 1
            continue
        report(cr, run, r)
        say("  (%.0f s)" % (time.perf_counter() - t0))
    kw = {} if judged is None else {"judged": judged}
    c = compare(cr, a, gen, summary, **kw)
    first_prompts(cr, summary["runs"])
    return rc or c


# Issue 29's targets: a first prompt over ComfyUI's, its worst step after
# the first over the steady step.
FIRST_PROMPT, FIRST_WORST = 0.9, 1.1


def first_prompts(cr, runs):
    """Each node run's first prompt over the mean of ComfyUI's dynamic
    runs of its budget ("6", "6.2": a run repeated), and its worst step
    after the first over its last prompt's steady one, beside issue 29's
    targets; then the mean of each node run's repeats."""
    got = {run: first_prompt(cr, r) for run, r in runs.items()}
    theirs = {}
    for run, g in got.items():
        if g is not None and _named(run)[:1].isdigit():
            theirs.setdefault(_named(run), []).append(g[0])
    names = {}
    for run, g in got.items():
        if not run.startswith("node") or g is None:
            continue
        peer = theirs.get(budget_of(run, {"bytes": 0})[0] or "")
        ref = sum(peer) / len(peer) if peer else None
        worst = g[1] / g[2] if g[1] and g[2] else None
        names.setdefault(_named(run), []).append((g[0], ref, worst))
        say("%s: first prompt %.3f s%s; worst step after the first %s "
            "(targets <= %.1f, <= %.1f)" % (
                run, g[0], " = %.3f x ComfyUI's (%d runs)"
                % (g[0] / ref, len(peer)) if ref else "",
                "%.2f x steady" % worst if worst else "-",
                FIRST_PROMPT, FIRST_WORST))
    for name, got in names.items():
        if len(got) > 1:
            fs = [g[0] for g in got]
            ratio = [g[0] / g[1] for g in got if g[1]]
            say("%s, %d runs: first prompt %.3f s (%.3f-%.3f)%s; worst "
                "step %s" % (
                    name, len(got), sum(fs) / len(fs), min(fs), max(fs),
                    " = %.3f x ComfyUI's" % (sum(ratio) / len(ratio))
                    if ratio else "", ", ".join(
                        "%.2f" % g[2] for g in got if g[2])))


def fp8_configs(ours):
    """[(weight_dtype, lora)] of --fp8's matrix."""
    dtypes = [x.strip() for x in ours["dtypes"].split(",") if x.strip()]
    for d in dtypes:
        if d not in FP8_DTYPES + ("default",):
            raise SystemExit("--dtypes: %r is none of %s" % (d, ", ".join(
                FP8_DTYPES + ("default",))))
    loras = {"off": [False], "on": [True], "both": [False, True]}.get(
        ours["fp8_lora"])
    if loras is None:
        raise SystemExit("--fp8-lora: off, on or both")
    return [(d, lo) for d in dtypes for lo in loras]


def lora_vs_L(cr, run, reps, legacy, link_ms, row):
    """The steady step with a LoRA against its limit: lora_b_again's (the
    LoRA loaded, nothing changed) over max(legacy's lora_b_again: the
    LoRA baked in, every weight resident; the link term), into row
    (vs_L_lora). Nothing without a legacy run."""
    mine = {x.get("label"): x for x in reps}.get("lora_b_again")
    ref = None if legacy is None else {
        x.get("label"): x for x in legacy["reps"]}.get("lora_b_again")
    if mine is None or ref is None:
        return
    res = cr.steady(ref["steps_ms"])
    lim = max(res, link_ms)
    st = cr.steady(mine["steps_ms"])
    row.update(L_lora_ms=lim, steady_lora_ms=st, vs_L_lora=st / lim)
    say("%s: with the LoRA: L = max(legacy %.1f, link term %.1f) = %.1f ms; "
        "steady %.1f ms (lora_b_again) = %.3f x L" % (
            run, res, link_ms, lim, st, st / lim))


def fp8_runs(weight_dtype, lora, budget="half"):
    """A matrix cell's runs: ComfyUI's all-resident dynamic run (the
    reference), the node and ComfyUI's own dynamic path under the budget
    (--fp8-budget: "half", half the weights as held, or N GiB); ComfyUI's
    legacy ModelPatcher too where the node's latents are to be its (a
    LoRA baked in at load; fp8_e4m3fn_fast, whose fp8 matmul ComfyUI's
    dynamic path skips for a bf16 file)."""
    runs = ["resident", "node" + budget, budget]
    if lora or weight_dtype == "fp8_e4m3fn_fast":
        runs.append("legacy")
    return runs


def fp8_matrix(cr, a, ours, out, gen, summary):
    """--fp8: each weight_dtype with and without a LoRA (--fp8-lora), runs
    fp8_runs(); one table at the end. Judged: the node's latents, equal
    to resident's or legacy's, prompt by prompt (ComfyUI's own dynamic
    path under the budget is printed, not judged: with a LoRA it applies
    the patch at each cast, unrounded when the weight is not resident)."""
    rc = 0
    rows = []
    summary["matrix"] = {}
    for wd, lora in fp8_configs(ours):
        name = "%s%s" % (wd, "_lora" if lora else "")
        b = copy.copy(a)
        b.weight_dtype, b.lora = wd, lora
        sub = os.path.join(out, name)
        os.makedirs(sub, exist_ok=True)
        runs = fp8_runs(wd, lora, ours["fp8_budget"])
        say("")
        say("=== %s, %s: runs %s" % (wd, "LoRA prompts (base, A, A@0.5, B, "
                                     "B again, removed)" if lora else
                                     "%d repetitions" % a.reps, runs))
        t0 = time.perf_counter()
        # The checkpoint: the files its host RSS is measured against.
        cell = {"runs": {}, "checkpoint": gen}
        rc = run_set(cr, b, ours, runs, sub, gen, cell,
                     judged=lambda run: run.startswith("node")) or rc
        cell["wall_s"] = time.perf_counter() - t0
        summary["matrix"][name] = cell
        rows.append((wd, lora, cell))
    bud = ours["fp8_budget"]
    say("")
    say("fp8 matrix (budget %s GiB%s; steady: the last prompt's, in "
        "brackets a LoRA prompt's over the LoRA baked in; latents "
        "prompt by prompt: R equal to resident's, L to legacy's):"
        % (budget_of(bud, gen, "fp8_e4m3fn")[0], ", half the weights as "
           "held" if bud == "half" else ""))
    _say_rows("weight_dtype", rows, bud)
    return rc


def quant_formats(ours):
    """--quant's formats (bench/comfyui_run.py QUANTS, none excepted)."""
    fmts = [x.strip() for x in ours["quant"].split(",") if x.strip()]
    for f in fmts:
        if f not in HARNESS.QUANTS[1:]:
            raise SystemExit("--quant: %r is none of %s" % (
                f, ", ".join(HARNESS.QUANTS[1:])))
    return fmts


def quant_runs(lora, budget="half"):
    """A quantized checkpoint's runs: ComfyUI's all-resident dynamic run
    (the reference), the node and ComfyUI's own dynamic path under the
    budget; with the LoRA prompts ComfyUI's legacy ModelPatcher too (the
    LoRA baked in at load through the op's set_weight, requantized, as
    the node does)."""
    return ["resident", "node" + budget, budget] + (["legacy"] if lora
                                                   else [])


def quant_matrix(cr, a, ours, out, summary):
    """--quant: per format a checkpoint made by bench/comfyui_run.py's gen
    child with --quant (in its own folder under --workdir), then the
    cells without and with the LoRA prompts (--fp8-lora), runs
    quant_runs(); one table at the end. Judged as --fp8's: the node's
    latents equal to resident's or legacy's, prompt by prompt."""
    rc = 0
    rows = []
    bud = ours["fp8_budget"]
    summary["quant"] = {}
    loras = {"off": [False], "on": [True], "both": [False, True]}.get(
        ours["fp8_lora"])
    if loras is None:
        raise SystemExit("--fp8-lora: off, on or both")
    for fmt in quant_formats(ours):
        b = copy.copy(a)
        b.quant = fmt
        b.lora = any(loras)             # the checkpoint's LoRA files too
        b.workdir = os.path.join(a.workdir, fmt)
        os.makedirs(b.workdir, exist_ok=True)
        gj = os.path.join(b.workdir, "gen.json")
        if ours["reuse"] and os.path.exists(gj):
            with open(gj) as f:
                gen = json.load(f)
        else:
            gen = cr.run_child(b, "gen", [], os.path.join(
                out, "gen_%s.log" % fmt))
            if gen is None:
                rc = 1
                continue
            with open(gj, "w") as f:
                json.dump(gen, f)
        q = gen.get("quant", {})
        say("")
        say("checkpoint %s: %.2f GiB as held (file %.2f GiB), %d tensors, "
            "%s layers quantized, link %.1f GB/s" % (
                fmt, gen["bytes"] / GiB, gen.get("file_bytes", 0) / GiB,
                gen["tensors"], q.get("layers"), gen.get("link_GBps") or 0))
        for lora in loras:
            name = "%s%s" % (fmt, "_lora" if lora else "")
            c = copy.copy(b)
            c.lora = lora
            sub = os.path.join(out, name)
            os.makedirs(sub, exist_ok=True)
            runs = quant_runs(lora, bud)
            say("")
            say("=== %s, %s: runs %s" % (fmt, "LoRA prompts (base, A, A@0.5, "
                                         "B, B again, removed)" if lora else
                                         "%d repetitions" % a.reps, runs))
            t0 = time.perf_counter()
            cell = {"runs": {}, "checkpoint": gen}
            rc = run_set(cr, c, ours, runs, sub, gen, cell,
                         judged=lambda run: run.startswith("node")) or rc
            cell["wall_s"] = time.perf_counter() - t0
            summary["quant"][name] = cell
            rows.append((fmt, lora, cell))
    say("")
    say("quantized checkpoints (QuantizedTensor weights; budget %s; steady: "
        "the last prompt's; latents prompt by prompt: R equal to "
        "resident's, L to legacy's):" % ("half the weights as held"
                                         if bud == "half" else bud + " GiB"))
    _say_rows("format", rows, bud)
    return rc


def _say_rows(first, rows, bud):
    """The node's and ComfyUI's dynamic path's latents and times of each
    (`first`'s value, LoRA, cell) row of a matrix, under budget `bud`."""
    say("  %-16s %-4s %-28s %-12s %-12s %-9s %s" % (
        first, "LoRA", "node latents", "node/L", "dynamic/L",
        "node/dyn", "dynamic latents"))
    for what, lora, cell in rows:
        t = cell.get("table", {})
        n, h = t.get("node" + bud, {}), t.get(bud, {})
        ns, hs = n.get("steady_ms"), h.get("steady_ms")
        # With a LoRA: the node's LoRA prompt (lora_b_again) against the
        # LoRA baked in (legacy) too, after the last prompt's (removed).
        nl = " (%.3f)" % n["vs_L_lora"] if "vs_L_lora" in n else ""
        say("  %-16s %-4s %-28s %-12s %-12s %-9s %s" % (
            what, "yes" if lora else "no", _equal_words(n),
            ("%.3f" % n["vs_L"] if "vs_L" in n else "-") + nl,
            "%.3f" % h["vs_L"] if "vs_L" in h else "-",
            "%.3f" % (ns / hs) if ns and hs else "-", _equal_words(h)))


def _equal_words(row):
    """Per prompt: = resident, = legacy, or DIFFER."""
    r = row.get("latents_equal_resident")
    g = row.get("latents_equal_legacy")
    if r is None:
        return "-"
    words = []
    for i, x in enumerate(r):
        if x:
            words.append("R")
        elif g is not None and i < len(g) and g[i]:
            words.append("L")
        else:
            words.append("DIFFER")
    return "".join(words) if "DIFFER" not in words else " ".join(words)


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
    if ours["fp8"] and ours["quant"]:
        raise SystemExit("--fp8 and --quant: one matrix at a time")
    if ours["quant"]:
        quant_formats(ours)
        if ours["shape"] not in SHAPES:
            raise SystemExit("--shape: %s" % " or ".join(SHAPES))
        rest = SHAPES[ours["shape"]] + rest
    if ours["fp8"]:
        if ours["shape"] not in SHAPES:
            raise SystemExit("--shape: %s" % " or ".join(SHAPES))
        b = ours["fp8_budget"]
        if b != "half":
            try:
                float(b)
            except ValueError:
                raise SystemExit("--fp8-budget: half or a number of GiB")
        configs = fp8_configs(ours)
        # The shape first: the command line's own options win.
        rest = SHAPES[ours["shape"]] + rest
        if any(lo for _d, lo in configs) and "--lora" not in rest:
            rest.append("--lora")       # the checkpoint's LoRA files
    a = cr.parse(rest + ["--runs", "resident"])
    out = ours["out"] or (os.path.join(os.environ["OUT"], "comfyui_node")
                          if os.environ.get("OUT") else "comfyui-node")
    os.makedirs(out, exist_ok=True)
    made = a.workdir is None
    if made:
        a.workdir = tempfile.mkdtemp(prefix="vp-comfyui-node-")
    os.makedirs(a.workdir, exist_ok=True)
    shutil.rmtree(plans_folder(a), ignore_errors=True)
    runs = [x.strip() for x in ours["runs"].split(",") if x.strip()]
    a.timeout = ours["timeout"]
    for ln in cr.machine(a):
        say(ln)
    if ours["quant"]:
        say("inputs: %s; --quant matrix (shape %s): %s, LoRA %s" % (
            cr.inputs_line(a), ours["shape"], ours["quant"],
            ours["fp8_lora"]))
    elif ours["fp8"]:
        say("inputs: %s; --fp8 matrix (shape %s): %s" % (
            cr.inputs_line(a), ours["shape"], ", ".join(
                "%s%s" % (d, " + LoRA" if lo else "")
                for d, lo in fp8_configs(ours))))
    else:
        say("inputs: %s; runs %s" % (cr.inputs_line(a), runs))
    summary = {"args": vars(a), "runs": {}}
    rc = 0
    try:
        if ours["quant"]:
            rc = quant_matrix(cr, a, ours, out, summary)
            with open(os.path.join(out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
            return rc
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
        if a.switch_shape is not None:
            gj2 = os.path.join(a.workdir, "gen_second.json")
            if ours["reuse"] and os.path.exists(gj2):
                with open(gj2) as f:
                    gen2 = json.load(f)
                a.ckpt2 = gen2["path"]
            else:
                gen2 = cr.gen_second(a, out)
                if gen2 is None:
                    return 1
                with open(gj2, "w") as f:
                    json.dump(gen2, f)
            summary["checkpoint2"] = gen2
        if ours["fp8"]:
            rc = fp8_matrix(cr, a, ours, out, gen, summary)
        else:
            rc = run_set(cr, a, ours, runs, out, gen, summary)
    finally:
        if made:
            shutil.rmtree(a.workdir, ignore_errors=True)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
