"""bench_ledger: three processes share one GPU through the ledger (issue 14).

    python3 bench/bench_ledger.py            # the GPU (about 2 minutes)
    python3 bench/bench_ledger.py --defaults # the same with offload()'s own
                                             # page size and schedule
    python3 bench/bench_ledger.py --dry-run  # the simulated device (CI)

Three worker processes, each with vpager.torch: a diffusion-shaped model
(a DiT-like stack of wide linears on 4096 tokens: compute-bound), an LLM
decoder-shaped model (attention and MLP projections, decode at batch 4:
memory-bound) and an idle one (a model it loaded once, then a memory hog
that leaves POOL of device memory to the others). Sizes are in units U
(1 GiB on the GPU, 1 MiB on the simulated device, where the shared
simulated device of POOL units is the pool):

  1. the wait: the idle process holds an 8 U model; the diffusion process
     asks for N U (vpager.ledger.free_memory: a release request the idle
     process's service thread answers by evicting its own pages); time
     until the call returns with N U freed, N = 1, 4, 8 (target: at most
     5 ms + N x 3 ms on the GPU);
  2. the idle process leaves POOL U free (hog), then the two active
     models (6 U and 5 U, 11 U > POOL = 10 U) run side by side:
       - alone, each with the whole pool (reference);
       - cooperating: both with a budget of the whole pool, the ledger on
         (sharing is forced: each process's faults ask the other);
       - static splits: budgets x and POOL - x (no pressure between them),
         the best of them is the "best static split";
       - no cooperation: fresh processes with the ledger off, both with the
         whole pool as budget: what happens (who gets what, errors).
     Throughput: steps per second of each over the last part of each run.

Results: printed, and bench_ledger.json in $OUT.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib as bl  # noqa: E402

POOL = 10           # units of device memory the two active ones share
SLACK = 2           # and room for their staging rings and torch (GPU)
SIZES = {"diffusion": 6, "llm": 5, "idle": 8}
WAIT_N = (1, 4, 8)
SPLITS = (4, 5, 6)  # diffusion's units in the static splits


# ================================================================ worker

def _models(role, unit, dry):
    """The role's model on the CPU (built block by block on the GPU, where
    random weights are quick, then moved: a few hundred MB of the GPU at a
    time, so it can be built beside the hog), and its input on the device
    it computes on."""
    import torch
    dt = torch.float32 if dry else torch.bfloat16
    kw = dict(bias=False, dtype=dt, device="cpu" if dry else "cuda")

    def built(m):
        with torch.no_grad():
            for p in m.parameters():
                p.requires_grad_(False)
                p.normal_(0, 0.02)
        return m.cpu()
    nbytes = SIZES[role] * unit
    if role == "diffusion":
        h = 128 if dry else 3072
        per = (4 + 4 + 6) * h * h * (4 if dry else 2)   # up, down, mod
        blocks = max(1, nbytes // per)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.mod = torch.nn.Linear(h, 6 * h, **kw)
                self.up = torch.nn.Linear(h, 4 * h, **kw)
                self.down = torch.nn.Linear(4 * h, h, **kw)

            def forward(self, x):
                m = self.mod(x[:1]).chunk(6, dim=-1)
                y = self.down(torch.nn.functional.gelu(self.up(x * m[0])))
                return x + y * m[1]

        model = torch.nn.Sequential(*[built(Block()) for _ in range(blocks)])
        x = torch.randn(64 if dry else 4096, h, dtype=dt, device=kw["device"])
    else:
        h, inter = (128, 256) if dry else (4096, 11008)
        per = (4 * h * h + 3 * h * inter) * (4 if dry else 2)
        layers = max(1, nbytes // per)

        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(h, 3 * h, **kw)
                self.o = torch.nn.Linear(h, h, **kw)
                self.gate = torch.nn.Linear(h, inter, **kw)
                self.up = torch.nn.Linear(h, inter, **kw)
                self.down = torch.nn.Linear(inter, h, **kw)

            def forward(self, x):
                q, k, v = self.qkv(x).chunk(3, dim=-1)
                x = x + self.o(v * torch.sigmoid(q * k))
                g = torch.nn.functional.silu(self.gate(x)) * self.up(x)
                return x + self.down(g)

        model = torch.nn.Sequential(*[built(Layer()) for _ in range(layers)])
        x = torch.randn(4, h, dtype=dt, device=kw["device"])
    return model, x


def worker(role, name, unit, dry, budget, ledger_on):
    import torch
    import warnings
    warnings.simplefilter("ignore")
    import vpager
    import vpager.torch
    from vpager import ledger
    from vpager.torch import ledger as ml
    model, x = _models(role, unit, dry)
    opts = {}
    if dry:
        # The pool, and room for the three staging rings.
        opts = dict(device="cpu", sim_shared=name,
                    sim_capacity=(POOL + 3) * unit, page_size=unit // 16,
                    sim_granularity=unit // 16, staging_size=unit)
    elif os.environ.get("BENCH_LEDGER_DEFAULTS") == "1":
        opts = dict(device="cuda")  # --defaults: what offload() picks
    else:
        # 32 MiB pages (2 MiB ones cost ~23 ms/GiB to release: the first
        # H200 run); an order given, so offload() does not schedule (the
        # tuner's own residency choices are not what is measured here).
        opts = dict(device="cuda", page_size=32 << 20, order="interleaved")
    if dry and os.environ.get("BENCH_LEDGER_DEFAULTS") != "1":
        opts["order"] = "interleaved"
    if not ledger_on:
        opts["ledger"] = "off"
    t0 = time.perf_counter()
    h = vpager.torch.offload(model, budget=budget, **opts)
    ml.name(h, role)
    load_s = time.perf_counter() - t0
    dev = h.device
    sync = (lambda: torch.cuda.synchronize()) if not dry else (lambda: None)
    hog = []

    def step():
        with torch.no_grad():
            y = model(x)
        sync()
        return y

    def reply(**kw):
        print(json.dumps(kw), flush=True)

    reply(ready=True, load_s=load_s, weight_bytes=h.weight_bytes)
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd["cmd"]
        try:
            if c == "load":     # all of it resident again
                h.prioritize()
                step()
                reply(resident=ml.info(h)["loaded_size"])
            elif c == "free":   # get N bytes held by a peer
                want = cmd["bytes"]
                t = time.perf_counter()
                freed = ledger.free_memory(dev, want)
                ms = (time.perf_counter() - t) * 1e3
                reply(freed=freed, ms=ms)
            elif c == "evict":
                reply(freed=ml.unload_all(dev, keep=()))
            elif c == "hog":    # leave `free` bytes of the GPU free
                h.vbar.free_memory(1 << 62)
                torch.cuda.empty_cache()
                free, _ = torch.cuda.mem_get_info()
                n = free - cmd["free"]
                if n > 0:
                    hog.append(torch.empty(n, dtype=torch.uint8,
                                           device="cuda"))
                reply(hog=n, free=torch.cuda.mem_get_info()[0])
            elif c == "limit":
                lim = cmd["bytes"]
                dev.set_limit(lim)
                loaded = h.vbar.loaded_size()
                if loaded > lim:
                    h.vbar.free_memory(loaded - lim)
                h.prioritize()
                reply(limit=lim)
            elif c == "run":
                until = time.perf_counter() + cmd["seconds"]
                times, errors = [], []
                while time.perf_counter() < until:
                    t = time.perf_counter()
                    try:
                        step()
                    except Exception as e:  # what no cooperation does
                        errors.append(type(e).__name__ + ": " + str(e)[:120])
                        if len(errors) > 20:
                            break
                        continue
                    times.append(time.perf_counter() - t)
                tail = times[len(times) // 3:] or times
                st = h.stats()["model"]
                reply(steps=len(times), steady_ms=bl.med(tail) * 1e3
                      if tail else None,
                      steps_per_s=(1.0 / bl.med(tail)) if tail else 0.0,
                      resident=ml.info(h)["loaded_size"],
                      misses=st["misses"], staged=st["weight_staged"],
                      errors=errors[:3], nerrors=len(errors))
            elif c == "quit":
                break
        except Exception as e:
            reply(error="%s: %s" % (type(e).__name__, e))
    h.unload()
    if not dev.closed:
        dev.close()


# ================================================================ driver

class Proc:
    def __init__(self, role, name, unit, dry, budget, ledger_on=True):
        self.role = role
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(bl.ROOT, "python"), env.get("PYTHONPATH", "")])
        args = [sys.executable, os.path.abspath(__file__), "--worker", role,
                "--name", name, "--unit", str(unit),
                "--budget", str(budget if budget is not None else -1)]
        if dry:
            args.append("--dry-run")
        if not ledger_on:
            args.append("--no-ledger")
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env, text=True)
        self.ready = None

    def wait_ready(self):
        self.ready = self.read()
        return self.ready

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def read(self):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError("worker %s died (exit %s)"
                                   % (self.role, self.p.wait()))
            if line.startswith("{"):
                break
            bl.say("[%s] %s" % (self.role, line.rstrip()))
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError("worker %s: %s" % (self.role, out["error"]))
        return out

    def ask(self, **cmd):
        self.send(**cmd)
        return self.read()

    def quit(self):
        try:
            self.send(cmd="quit")
        except (BrokenPipeError, OSError):
            pass
        self.p.wait(timeout=60)


def run_both(procs, seconds):
    for p in procs:
        p.send(cmd="run", seconds=seconds)
    return {p.role: p.read() for p in procs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--worker")
    ap.add_argument("--name", default="")
    ap.add_argument("--unit", type=int, default=0)
    ap.add_argument("--budget", type=int, default=-1)
    ap.add_argument("--no-ledger", action="store_true")
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--defaults", action="store_true",
                    help="GPU: offload() with its own page size and "
                    "schedule (the workers inherit it)")
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.name, a.unit, a.dry_run,
               a.budget if a.budget >= 0 else None, not a.no_ledger)
        return 0
    dry = a.dry_run
    if a.defaults:
        os.environ["BENCH_LEDGER_DEFAULTS"] = "1"
    unit = bl.MiB if dry else bl.GiB
    secs = a.seconds or (1.0 if dry else 5.0)
    name = os.environ.get("VPAGER_SIM_SHARED") or "bl%d" % os.getpid()
    results = {"unit_bytes": unit, "pool_units": POOL, "sizes_units": SIZES}
    for ln in bl.machine_lines(not dry):
        bl.say(ln)
    if not dry:
        bl.say("inputs: " + ("offload() defaults (its page size and schedule)"
                             if a.defaults else "32 MiB pages, interleaved "
                             "order (no schedule)"))
    results["defaults"] = bool(a.defaults)
    pool = POOL * unit

    # ---- 1. the wait for N U held by an idle peer
    idle = Proc("idle", name, unit, dry, None)
    diff = Proc("diffusion", name, unit, dry, pool)
    llm = Proc("llm", name, unit, dry, pool)
    for p in (idle, diff, llm):
        r = p.wait_ready()
        bl.say("%-9s ready: %.2f U of weights, offload %.1f s"
               % (p.role, r["weight_bytes"] / unit, r["load_s"]))
    waits = []
    for n in WAIT_N:
        r = idle.ask(cmd="load")
        got = diff.ask(cmd="free", bytes=n * unit)
        goal = 5.0 + 3.0 * n
        line = ("wait for %d U held by an idle peer: %.2f ms (freed %.2f U;"
                " idle resident before %.2f U)" % (
                    n, got["ms"], got["freed"] / unit, r["resident"] / unit))
        whole = got["freed"] >= 0.99 * min(n * unit, r["resident"])
        if not dry:
            line += "  " + bl.target("wait %d GiB ms" % n, got["ms"]
                                     if whole else float("inf"), "<=", goal)
        if not whole:
            line += " (not all of it came: a peer skipped?)"
        bl.say(line)
        waits.append(dict(n=n, ms=got["ms"], freed=got["freed"],
                          idle_resident=r["resident"], goal_ms=goal))
    results["wait"] = waits

    # ---- 2. the pool: the idle one hogs the rest (GPU) or gives all back
    if dry:
        idle.ask(cmd="evict")
    else:
        r = idle.ask(cmd="hog", free=pool + SLACK * unit)
        bl.say("idle: hog %.2f GB, device free %.2f GB" % (
            r["hog"] / 1e9, r["free"] / 1e9))
    both = (diff, llm)
    phases = {}

    def phase(label, procs, seconds=secs):
        out = run_both(procs, seconds)
        phases[label] = out
        bl.say("%-15s " % label + "  ".join(
            "%s %.2f steps/s (%.1f ms, resident %.2f U, %d staged%s)" % (
                k, v["steps_per_s"], v["steady_ms"] or 0, v["resident"] / unit,
                v["staged"], ", %d errors: %s" % (v["nerrors"], v["errors"][:1])
                if v["nerrors"] else "") for k, v in out.items()))
        return out

    for p in both:          # alone, each with the whole pool
        other = llm if p is diff else diff
        other.ask(cmd="evict")
        p.ask(cmd="limit", bytes=pool)
        phase("alone " + p.role, (p,))
    for p in both:
        p.ask(cmd="limit", bytes=pool)
    phase("cooperating", both, secs * 1.5)
    best = None
    for x in SPLITS:
        diff.ask(cmd="limit", bytes=x * unit)
        llm.ask(cmd="limit", bytes=(POOL - x) * unit)
        out = phase("static %d/%d" % (x, POOL - x), both)
        score = _score(out, phases)
        if best is None or score > best[0]:
            best = (score, "static %d/%d" % (x, POOL - x))
    for p in (diff, llm):
        p.quit()

    # ---- no cooperation: fresh processes, ledger off, both the whole pool
    diff2 = Proc("diffusion", name, unit, dry, pool, ledger_on=False)
    llm2 = Proc("llm", name, unit, dry, pool, ledger_on=False)
    for p in (diff2, llm2):
        p.wait_ready()
    phase("no cooperation", (diff2, llm2), secs * 1.5)
    for p in (diff2, llm2, idle):     # the idle one's hog last
        p.quit()
    results["phases"] = phases
    coop = _score(results["phases"]["cooperating"], results["phases"])
    nocoop = _score(results["phases"]["no cooperation"], results["phases"])
    bl.say("combined throughput (sum of each one's share of its alone speed):"
           " cooperating %.2f, best static split (%s) %.2f, no cooperation "
           "%.2f" % (coop, best[1], best[0], nocoop))
    results["combined"] = dict(cooperating=coop, best_static=best[0],
                               best_static_split=best[1],
                               no_cooperation=nocoop)
    results["targets"] = bl.targets_json()
    path = bl.write_json("bench_ledger.json", results)
    if path:
        bl.say("wrote", path)
    return 0


def _score(out, phases):
    """The sum over the two of steps/s relative to that one alone."""
    s = 0.0
    for role, v in out.items():
        alone = phases.get("alone " + role, {}).get(role)
        if alone and alone["steps_per_s"]:
            s += v["steps_per_s"] / alone["steps_per_s"]
    return s


if __name__ == "__main__":
    sys.exit(main())
