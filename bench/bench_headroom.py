"""bench_headroom: room for the desktop (issue 29 point 4).

Two processes each offload a model with vpager.torch and no budget flags
on a GPU whose free memory a hog squeezed to FREE GiB, and run forwards
side by side; the device's free memory is sampled all along. Its least
must stay at vpager's default headroom (the larger of 512 MiB and 2% of
the GPU, 768 MiB and 4% under WDDM, at most a quarter: what every vpager
process on the GPU keeps free through the ledger), where two node
processes with no --reserve-vram drove an H200 to 139.49 of 139.8 GiB
(99.8%) before.

    python3 bench/bench_headroom.py                      # the GPU (~1 min)
    python3 bench/bench_headroom.py --free 16 --size 8 --seconds 20
    python3 bench/bench_headroom.py --dry-run            # simulated (CI)

The workers' weights are drawn on the GPU (fill_weights): torch's CPU
normal_ for float16 is a serial scalar loop, 2.1-2.6 s an 8192x8192
layer (torch 1.13, one core of an EPYC), so the 64 layers of each 8 GiB
model took each worker about 2-3 minutes before it said it was ready;
the driver prints nothing until the workers end, and the H100's two
runs (timeout 100 s, 200 s) looked hung. The workers must now end
within --limit seconds (default: --seconds + 80, under
bench/device_phases.sh's 120 s), else each one still running prints
its threads' stacks on stderr (SIGUSR1: faulthandler) and is stopped,
and the run fails saying so.

--dry-run: a shared simulated device of 16 MiB serving a Linux desktop
(VP_SIM_SET_DESKTOP: its default headroom is a quarter of it, 4 MiB), two
models of 6 MiB, 1 MiB staging rings (14 MiB wanted of the 12 the
headroom leaves), free memory polled at every check
(poll_interval_us=0); each worker samples the device's free memory after
every forward.

Results: printed, and bench_headroom.json in $OUT.
"""

import argparse
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import benchlib as bl  # noqa: E402

SIM_CAPACITY = 16 * bl.MiB      # --dry-run's device
SIM_MODEL = 6 * bl.MiB          # each worker's model: with its ring,
                                # 14 MiB wanted of the 12 MiB room


def default_headroom(total, wddm=False):
    """vpager's default (src/options.c vp__default_headroom)."""
    floor, share = (768 * bl.MiB, total // 25) if wddm else \
        (512 * bl.MiB, total // 50)
    return min(max(floor, share), total // 4)


# ================================================================ worker

def fill_weights(model, width, device):
    """Each parameter of `model` (host tensors) drawn from N(0, 1/width),
    one at a time on `device` in float32 and copied in: on a GPU its
    generator takes milliseconds a layer where torch's CPU normal_ for
    float16 (a serial scalar loop) took 2.1-2.6 s an 8192x8192 one."""
    import torch
    with torch.no_grad():
        for p in model.parameters():
            w = torch.randn(p.shape, dtype=torch.float32, device=device)
            p.copy_(w.mul_(width ** -0.5))
            del w
    if device.type == "cuda":
        # What the draws held is torch's no more, nor its peak: the
        # headroom vpager learns from torch is the forwards'.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def worker(args):
    # A driver whose limit passed asks for our stacks (SIGUSR1) before
    # it stops us: registered first, so that even an import that hangs
    # shows where.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import vpager
    import vpager.torch as vt
    if args.dry_run:
        import warnings
        warnings.simplefilter("ignore", RuntimeWarning)   # "sim" asked
        width, dtype = 256, torch.float32          # 256 KiB a layer
        layers = SIM_MODEL // (width * width * 4)
        dev = vt.open_device("sim", sim_capacity=SIM_CAPACITY,
                             sim_shared=args.name, page_size=256 * bl.KiB,
                             sim_granularity=64 * bl.KiB,
                             staging_size=bl.MiB, poll_interval_us=0)
        dev.sim_inject(vpager.SIM_SET_DESKTOP, 1)
        x = torch.randn(4, width)
    else:
        width, dtype = 8192, torch.float16         # 128 MiB a layer
        layers = int(args.size * bl.GiB) // (width * width * 2)
        dev = vt.open_device("cuda")
        x = torch.randn(16, width, dtype=dtype, device="cuda")
    model = torch.nn.Sequential(*[
        torch.nn.utils.skip_init(torch.nn.Linear, width, width, bias=False,
                                 dtype=dtype) for _ in range(layers)])
    fill_weights(model, width, x.device)
    # Both workers hold their device before either places its model: the
    # first to place must not leave the other no room for its ring.
    print("ready", flush=True)
    sys.stdin.readline()
    h = vt.offload(model.eval(), dev=dev)

    def free_now():
        if args.dry_run:
            return dev.info()["free_memory"]
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    least, steps = free_now(), 0
    end = time.perf_counter() + args.seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            model(x)
            steps += 1
            least = min(least, free_now())
    info, gov = dev.info(), h.stats()["governor"]
    print(json.dumps(dict(least_free=least, steps=steps,
                          headroom=info["headroom"],
                          kept_free=info["kept_free"],
                          shared_headroom=gov["shared_headroom"],
                          committed=info["committed"],
                          model=layers * width * width *
                          (4 if args.dry_run else 2))), flush=True)
    h.unload()


# ================================================================ driver

class Watchdog:
    """`limit` seconds from now, each of `procs` still running is asked
    for its threads' stacks (SIGUSR1: worker() registered faulthandler;
    they go to its stderr, the driver's) and then stopped;
    fired then says so. The driver prints nothing until its workers end:
    without this a worker that never ends kept it waiting silently until
    something outside killed it, with nothing to say where. cancel() when
    they ended."""

    GRACE = 0.5         # seconds after each one's stacks are asked for

    def __init__(self, procs, limit):
        self.procs = procs
        self.fired = False
        self._timer = threading.Timer(limit, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        self.fired = True
        running = [p for p in self.procs if p.poll() is None]
        if hasattr(signal, "SIGUSR1"):
            for p in running:     # one at a time: their lines not mixed
                try:
                    p.send_signal(signal.SIGUSR1)
                except OSError:
                    pass
                time.sleep(self.GRACE)
        for p in running:
            if p.poll() is None:
                p.kill()

    def cancel(self):
        self._timer.cancel()


def run_workers(cmd, args, sample, least):
    """Start the two workers (`cmd`), let them go together once both are
    ready, wait for them (sample(): device free memory, taken every 10
    ms; None: not sampled) within --limit seconds (Watchdog); returns
    (their JSON results, the least free memory sampled or `least`). A
    failure stops the workers still running."""
    limit = args.limit if args.limit is not None else args.seconds + 80
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    t0 = time.perf_counter()
    dog = Watchdog(procs, limit)

    def past_limit(what):
        return SystemExit(
            "bench_headroom: the workers did not %s within --limit %g s; "
            "each one still running printed its threads' stacks above (on "
            "stderr) and was stopped" % (what, limit))
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                code = p.wait()
                if dog.fired:
                    raise past_limit("start")
                raise SystemExit("a worker did not start: %d" % code)
        bl.say("workers ready after %.1f s; each offloads its model and "
               "runs forwards for %g s" % (time.perf_counter() - t0,
                                           args.seconds))
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        while any(p.poll() is None for p in procs):
            if sample is not None:
                least = min(least, sample())
            time.sleep(0.01)
        dog.cancel()
        if dog.fired:
            raise past_limit("end")
        outs = []
        for i, p in enumerate(procs):
            text = p.stdout.read()
            if p.returncode:
                raise SystemExit("worker %d failed (%d): %s" % (
                    i, p.returncode, text[-2000:]))
            outs.append(json.loads(text.strip().splitlines()[-1]))
        return outs, least
    finally:
        dog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def run(args):
    torch = None
    hog = None
    if args.dry_run:
        total = SIM_CAPACITY
        expect = min(512 * bl.MiB, total // 4)
        squeezed = total
        args.name = args.name or "bench-headroom-%d" % os.getpid()
    else:
        import torch
        for ln in bl.machine_lines(True):
            bl.say(ln)
        free, total = torch.cuda.mem_get_info()
        wddm = os.path.exists("/dev/dxg")
        expect = default_headroom(total, wddm)
        want = int(args.free * bl.GiB)
        if free > want:
            hog = torch.empty(free - want, dtype=torch.uint8, device="cuda")
        squeezed = torch.cuda.mem_get_info()[0]
    u, un = (bl.MiB, "MiB") if args.dry_run else (bl.GiB, "GiB")
    bl.say("device %.2f %s, free %.2f %s for the two workers; vpager's "
           "default headroom %.3f %s" % (total / u, un, squeezed / u, un,
                                         expect / u, un))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker",
           "--seconds", str(args.seconds), "--size", str(args.size),
           "--name", args.name or ""] + (["--dry-run"] if args.dry_run
                                         else [])
    sample = ((lambda: torch.cuda.mem_get_info()[0]) if torch is not None
              else None)
    outs, least = run_workers(cmd, args, sample, squeezed)
    del hog
    for i, o in enumerate(outs):
        bl.say("worker %d: %d forwards of a %.2f %s model, %.2f %s "
               "committed, headroom %.3f %s, kept free %.3f %s, least "
               "free seen %.3f %s" % (
                   i, o["steps"], o["model"] / u, un, o["committed"] / u, un,
                   o["headroom"] / u, un, o["kept_free"] / u, un,
                   o["least_free"] / u, un))
        least = min(least, o["least_free"])
    used = 1 - least / total
    bl.say("device use with no budget flags, 2 processes: %.1f%% (least "
           "free %.3f %s)" % (100 * used, least / u, un))
    ratio = least / expect
    bl.say("least free / default headroom %.3f, %s" % (
        ratio, bl.target("least free / default headroom", ratio, ">=",
                         1.0)))
    bl.write_json("bench_headroom.json", dict(
        total=total, squeezed_free=squeezed, default_headroom=expect,
        least_free=least, device_use=used, workers=outs,
        targets=bl.targets_json()))
    return least >= expect


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the simulated device (CI)")
    ap.add_argument("--free", type=float, default=16,
                    help="GiB the hog leaves free (GPU)")
    ap.add_argument("--size", type=float, default=8,
                    help="GiB of each worker's model (GPU): two of them "
                    "and their rings want more than --free less the "
                    "headroom; one fits beside the other's ring")
    ap.add_argument("--seconds", type=float, default=20,
                    help="how long the workers run forwards")
    ap.add_argument("--limit", type=float, default=None,
                    help="seconds the workers may take in all (start, "
                    "offload, forwards, exit; default --seconds + 80): "
                    "past it each one still running prints its stacks "
                    "and is stopped, and the run fails")
    ap.add_argument("--name", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
