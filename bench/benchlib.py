"""What the bench/ scripts share: the machine lines (GPU, host, software
and source revision), timing (CUDA events on a stream, or perf_counter on
the CPU), targets, the JSON of the figures, and vpager stats deltas.

    import benchlib as bl
    ctx = bl.Ctx(dry=False)                  # cuda: CUDA events; dry: CPU
    for ln in bl.machine_lines(ctx.cuda, extras=["accelerate 1.2"]):
        bl.say(ln)
    ts, wall = ctx.series(forward, 5, warmup=2)   # ms of each, wall ms/call
    bl.say(bl.target("decode / resident", med(ts) / ref, "<=", 1.1))
    bl.write_json("bench_x.json", RESULTS)   # into $OUT when it is set

Nothing heavy is imported here: torch is imported by the functions that
need it (placement_padding.py runs without torch), vpager only to name the
loaded library. The bench scripts find this module next to themselves
(python3 bench/<script>.py puts bench/ first on sys.path).
"""

import gc
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

# A bench measures a model's first run unless it asks for a plan
# remembered from an earlier process (vpager.torch's plancache.py, on by
# default: bench_node's "cache" and "cached" runs name a folder).
os.environ.setdefault("VPAGER_PLAN_CACHE", "off")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
T_START = time.perf_counter()

# What source_rev() hashes by default: the library and its Python package.
SOURCE_DIRS = ("include", "src", os.path.join("python", "vpager"))

__all__ = [
    "ROOT", "KiB", "MiB", "GiB", "GB", "SOURCE_DIRS", "torch_or_skip",
    "say", "elapsed",
    "med", "gbps", "host_ram", "gpu_line", "host_line", "source_rev",
    "module_versions", "software_line", "machine_lines", "utc_now", "Ctx",
    "TARGETS", "target", "target_lines", "targets_json", "write_json",
    "stats_delta", "copied_bytes", "stream_limit_ms", "WaitProbe",
]


def torch_or_skip(name):
    """torch, with the repository's python/ on sys.path first; where torch
    is not importable (make check-python without it) `name` says so and
    exits: 0 on a --dry-run, else 1."""
    if os.path.join(ROOT, "python") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "python"))
    try:
        import torch
    except ImportError:
        print("%s: torch is not importable: skipped" % name)
        sys.exit(0 if "--dry-run" in sys.argv else 1)
    return torch


def say(*args):
    print(*args, flush=True)


def elapsed():
    """Seconds since this module was imported (the script's start)."""
    return time.perf_counter() - T_START


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


# ------------------------------------------------------------- machine

def host_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 64 * GiB


def gpu_line(cuda=True, index=0):
    """The GPU (name, memory, SMs; driver and PCIe link from nvidia-smi),
    or, without CUDA, that none is used."""
    if not cuda:
        return ("gpu: none used (--dry-run: CPU tensors, vpager's simulated "
                "device)")
    import torch
    p = torch.cuda.get_device_properties(index)
    drv = "?"
    try:
        drv = subprocess.run(
            ["nvidia-smi", "--id=%d" % index, "--query-gpu=driver_version,"
             "pcie.link.gen.current,pcie.link.width.current",
             "--format=csv,noheader"], capture_output=True, text=True,
            timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        drv = "nvidia-smi failed: %s" % e
    return "gpu: %s, %.1f GiB, %d SMs; driver, PCIe gen, width: %s" % (
        p.name, p.total_memory / GiB, p.multi_processor_count, drv)


def host_line():
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return "host: %s, %d cpus, %.1f GiB RAM, Linux %s" % (
        cpu, os.cpu_count() or 0, host_ram() / GiB, platform.release())


def _tree_files(d):
    """The files under ROOT/d, recursively, in a stable order (relative
    paths; __pycache__ and dot-files left out)."""
    top = os.path.join(ROOT, d)
    out = []
    for base, dirs, files in os.walk(top):
        dirs[:] = sorted(x for x in dirs
                         if x != "__pycache__" and not x.startswith("."))
        for fn in sorted(files):
            if fn.startswith(".") or fn.endswith((".pyc", ".so", ".o")):
                continue
            out.append(os.path.relpath(os.path.join(base, fn), top))
    return out


def source_rev(dirs=SOURCE_DIRS):
    """The git revision (+ whether tracked files have uncommitted changes)
    and a sha1 of the files under `dirs` (recursively), which names the
    code even without git."""
    rev = "?"
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short",
                              "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip() or "?"
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        if dirty:
            rev += " + uncommitted changes"
    except Exception:  # noqa: BLE001
        pass
    try:
        h = hashlib.sha1()
        for d in dirs:
            for rel in _tree_files(d):
                with open(os.path.join(ROOT, d, rel), "rb") as f:
                    h.update(rel.encode() + f.read())
        rev += " (sha1 of %s: %s)" % (
            " + ".join(d + "/" for d in dirs), h.hexdigest()[:12])
    except OSError:
        pass
    return rev


def module_versions(names):
    """["transformers 4.57.1", "accelerate not importable (...)", ...]."""
    vers = []
    for name in names:
        try:
            mod = __import__(name)
            vers.append("%s %s" % (name, getattr(mod, "__version__", "?")))
        except Exception as e:  # noqa: BLE001
            vers.append("%s not importable (%s: %s)" % (
                name, type(e).__name__, str(e).splitlines()[0][:120]
                if str(e) else ""))
    return vers


def utc_now():
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime())


def software_line(extras=(), dirs=SOURCE_DIRS, library=True):
    """python, torch and CUDA (when the script imported torch), `extras`,
    the vpager source revision and (library=True) the libvpager.so that
    was loaded, and the time."""
    parts = ["python %s" % platform.python_version()]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append("torch %s (CUDA %s)" % (torch.__version__,
                                             torch.version.cuda))
    parts += list(extras)
    vp = "vpager %s" % source_rev(dirs)
    if library:
        try:
            import vpager
            vp += " (library %s)" % vpager.library_path()
        except Exception as e:  # noqa: BLE001
            vp += " (library not loaded: %s)" % e
    return "software: %s; %s; %s UTC" % (", ".join(parts), vp, utc_now())


def machine_lines(cuda, extras=(), dirs=SOURCE_DIRS, library=True):
    """The three lines every benchmark prints first: gpu, host, software."""
    return [gpu_line(cuda), host_line(),
            software_line(extras, dirs, library)]


# ------------------------------------------------------------- timing

class Ctx:
    """Where a benchmark runs and how it is timed: a CUDA GPU (CUDA events
    on a stream), or (dry run) the CPU and vpager's simulated device
    (perf_counter). `link`/`link_what`: the script's measured link, if any.
    """

    def __init__(self, dry):
        import torch
        self.torch = torch
        self.dry = dry
        self.cuda = not dry
        self.device = torch.device("cuda", 0) if self.cuda else \
            torch.device("cpu")
        self.link = None            # GB/s, measured by the script
        self.link_what = ""

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def empty_cache(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def stream(self):
        """The current stream as vpager takes it (0 on the CPU)."""
        return (self.torch.cuda.current_stream().cuda_stream if self.cuda
                else 0)

    def mark(self, stream=None):
        """A point in time: a CUDA event recorded on `stream` (default: the
        current stream), or perf_counter on the CPU."""
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            if stream is None:
                e.record()
            else:
                e.record(stream)
            return e
        return time.perf_counter()

    def ms(self, a, b):
        """ms between two marks (after sync())."""
        if self.cuda:
            return a.elapsed_time(b)
        return (b - a) * 1e3

    def series(self, fn, n, stream=None, warmup=0):
        """fn() `warmup` times untimed, then n times back to back: the ms of
        each (between consecutive marks on `stream`, the current stream by
        default) and the wall ms per call (perf_counter around all n)."""
        for _ in range(warmup):
            fn()
        self.sync()
        t0 = time.perf_counter()
        marks = [self.mark(stream)]
        for _ in range(n):
            fn()
            marks.append(self.mark(stream))
        self.sync()
        wall = (time.perf_counter() - t0) * 1e3 / max(n, 1)
        return [self.ms(marks[i], marks[i + 1]) for i in range(n)], wall

    def once(self, fn):
        """Wall ms of fn() with the device synchronized on both sides, and
        what fn returned."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3, out

    def host_ms(self, fn):
        """Host ms of fn(): synchronized before, timed until fn returns
        (what it costs the CPU to queue the work), synchronized after."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        self.sync()
        return t * 1e3

    def best_med(self, fn, reps, rep_s, calib=20):
        """fn(iters) timed by perf_counter over `reps` repetitions of about
        rep_s seconds each (iters calibrated from one fn(calib) call; gc
        off while timing): (best, median) seconds per iteration."""
        t0 = time.perf_counter()
        fn(calib)
        one = max((time.perf_counter() - t0) / calib, 1e-7)
        iters = max(calib, int(rep_s / one))
        ts = []
        gc_was = gc.isenabled()
        gc.disable()
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(iters)
                ts.append((time.perf_counter() - t0) / iters)
        finally:
            if gc_was:
                gc.enable()
        self.sync()
        return min(ts), med(ts)

    def mem(self):
        if not self.cuda:
            return "n/a (CPU)"
        cuda = self.torch.cuda
        free, total = cuda.mem_get_info()
        return "%.1f GiB free of %.1f, torch allocated %.2f GiB, reserved " \
            "%.2f GiB" % (free / GiB, total / GiB,
                          cuda.memory_allocated() / GiB,
                          cuda.memory_reserved() / GiB)


# ------------------------------------------------------------- results

TARGETS = []   # (name, value, op, goal, met), in the order checked


def target(name, value, op, goal):
    """Record a target (op "<=" or ">=") and return its verdict text."""
    met = value <= goal if op == "<=" else value >= goal
    TARGETS.append((name, value, op, goal, met))
    return "target %s %.2f: %s" % (op, goal, "MET" if met else "MISSED")


def target_lines(fmt):
    """One line per target, fmt % (name, value, op, goal, "MET"/"MISSED")."""
    return [fmt % (name, v, op, goal, "MET" if met else "MISSED")
            for name, v, op, goal, met in TARGETS]


def targets_json():
    return [dict(name=n, value=v, op=o, goal=g, met=m)
            for n, v, o, g, m in TARGETS]


def write_json(name, results):
    """Write results to $OUT/name when OUT names a directory; the path, or
    None."""
    out = os.environ.get("OUT")
    if not (out and os.path.isdir(out)):
        return None
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return path


# ------------------------------------------------------------- vpager stats

def settle(h, forward, limit=60):
    """Run forward() until vpager.torch's schedule for `h` is settled
    (measured, planned and placed: h.schedule()["settled"]), at most
    `limit` times, so that what is timed next is the steady state and
    not the forwards that run while the planner's thread plans. The number
    of forwards run, or None if it did not settle within them (a handle
    without a schedule: 0)."""
    if getattr(h, "tuner", None) is None:
        return 0
    for n in range(1, limit + 1):
        forward()
        sch = h.schedule()
        if sch is not None and sch.get("settled"):
            return n
    return None


def stats_delta(a, b):
    """b - a for two stats() dicts, key by key (counters; gauges too, as
    differences); entries that are not numbers (vpager.torch's per-device
    dicts) are left out."""
    return {k: b[k] - a[k] for k, v in a.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def copied_bytes(d):
    """Bytes vpager copied host->device in a stats delta: at acquire
    (staged_bytes, fill_bytes) and ahead of need (prefetch_bytes, counted
    apart)."""
    return d["staged_bytes"] + d["fill_bytes"] + d["prefetch_bytes"]


# ------------------------------------------------------------- issue 13

def stream_limit_ms(resident_ms, wbytes, budget, w_max, link_GBps):
    """The limit of issue 13: L = max(all-resident time, (W - B + 2 w_max)
    / link): what the budget forces across the link (double-buffered
    staging of the largest weight included), not what a streamer chose to
    copy. (L ms, the link term ms)."""
    link_ms = max(0, wbytes - budget + 2 * w_max) / (link_GBps * GB) * 1e3
    return max(resident_ms, link_ms), link_ms


def schedule_trace(path):
    """A VPAGER_SCHEDULE_LOG trace's plan inputs: (units [(name, bytes)],
    every per-unit work line in order [[seconds]], the first budget a plan
    was made for (bytes), the first link (B/s)); None where not logged."""
    units, works, total, link = None, [], None, None
    with open(path) as f:
        for line in f:
            if "units (name:bytes):" in line and units is None:
                units = [(u.rsplit(":", 1)[0], int(u.rsplit(":", 1)[1]))
                         for u in line.split("units (name:bytes): ")[1]
                         .split()]
            elif "work (ms):" in line:
                works.append([float(x) / 1e3 for x in
                              line.split("work (ms): ")[1].split()])
            m = re.search(r"planned for (\d+)", line)
            if m and total is None:
                total = int(m.group(1))
            m = re.search(r"link ([0-9.]+) GB/s", line)
            if m and link is None:
                link = float(m.group(1)) * 1e9
    return units, works, total, link


class WaitProbe:
    """How long the compute stream stood still in acquires: around every
    unit's vp_acquire (which makes the caller's stream wait on the copy
    stream's event, and enqueues nothing else there) a mark is taken
    before and after; on CUDA the marks are timing events recorded on the
    current stream, so the time between them is the stream's stall; on
    the CPU (simulated device) it is the host time of the acquire.

        probe = WaitProbe(ctx, units, hot)  # Unit objects, their HotPath
        with probe:                       # one instrumented forward
            model(x)
        probe.total_ms()                  # after ctx.sync()

    Marks cost host time (~2 events per unit), so use it on a forward of
    its own, not on the timed ones. On CUDA, when the host is what limits
    the forward (the stream idle, waiting for work), the time between the
    marks is also the acquire's own host time: host_ms() gives that sum,
    so a stall near it is the host's, not late copies."""

    class _Batch:
        __slots__ = ("_b", "_p")

        def __init__(self, b, probe):
            self._b, self._p = b, probe

        def acquire(self, stream=0):
            p = self._p
            a = p._mark()
            t0 = time.perf_counter()
            r = self._b.acquire(stream)
            p.host += time.perf_counter() - t0
            p.pairs.append((a, p._mark()))
            return r

        def __getattr__(self, k):
            return getattr(self._b, k)

    def __init__(self, ctx, units, hot=None, pool=0):
        self.ctx, self.units, self.pairs = ctx, list(units), []
        self.host = 0.0         # seconds the host spent in the acquires
        self.hot = hot          # a HotPath: its held units' acquire too
        self._pool = []
        if ctx.cuda:
            ev = ctx.torch.cuda.Event
            self._pool = [ev(enable_timing=True)
                          for _ in range(pool or 4 * len(self.units) + 8)]

    def _mark(self):
        if not self.ctx.cuda:
            return time.perf_counter()
        e = self._pool.pop() if self._pool else \
            self.ctx.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def __enter__(self):
        self.pairs, self.host = [], 0.0
        for u in self.units:
            u.batch = WaitProbe._Batch(u.batch, self)
        if self.hot is not None and self.hot.held is not None:
            self.hot.held = WaitProbe._Batch(self.hot.held, self)
        return self

    def __exit__(self, *exc):
        for u in self.units:
            if isinstance(u.batch, WaitProbe._Batch):
                u.batch = u.batch._b
        if self.hot is not None and isinstance(self.hot.held,
                                               WaitProbe._Batch):
            self.hot.held = self.hot.held._b
        return False

    def total_ms(self):
        """Summed stall of the instrumented forward(s), ms (sync first)."""
        return sum(self.ctx.ms(a, b) for a, b in self.pairs)

    def host_ms(self):
        """Host time of the probed acquires (the ctypes calls), ms."""
        return self.host * 1e3

    def count(self):
        """Acquires probed: one per unit not held, one for the held."""
        return len(self.pairs)
