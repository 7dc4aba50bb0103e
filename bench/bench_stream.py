#!/usr/bin/env python3
"""Streaming benchmarks of vpager on a GPU, each against baselines measured
in the same run (issue 4, "Benchmarks on the H200"):

  1. streaming throughput: weights that all miss (VBAR watermark 0) streamed
     through the staging ring, bytes/s against plain pinned copies of the
     same bytes (torch .copy_(non_blocking=True)); target >= 0.95;
  2. overlap: 96 bf16 8192x8192 layers (12 GiB) at a budget of weights/1.5,
     forward = x @ W per layer, at a copy-bound batch (16), at 4096 and at
     the batch where one layer's GEMM takes as long as its copy; against all
     weights resident, a naive per-layer copy on the compute stream and a
     hand-written double-buffered streamer over exactly the layers vpager
     streams; both eviction orders (tail-first, interleaved; also
     interleaved on a second device handle with 128 MiB pages, one page per
     layer; at batch 4096 each also with prefetch off, as a diagnostic);
     targets: copy-bound <= 1.02x (streamed bytes / link bandwidth), compute-bound
     <= 1.05x the hand-written streamer; the first (cold) forward apart;
  3. many small weights: 1536 x 2 MiB (3 GiB) at a 2 GiB budget, a small
     matmul per weight, 8 weights per acquire; against the hand-written
     streamer over the same non-resident set; target <= 1.15x;
  4. file -> VRAM: a 4 GiB safetensors file on local disk loaded with
     vp_st_open + vp_st_load; against min(the file's cold read speed
     measured in the run, the link); target >= 0.85.

    make -j16 && PYTHONUNBUFFERED=1 python3 bench/bench_stream.py

Needs torch with CUDA and build/libvpager.so; binds the C API with ctypes
(no vpager Python package yet). `--sim-dry-run` exercises the bindings and
the overlap benchmark's residency on the simulated device, without torch.
`--only 1,3` runs some benchmarks. Writes a JSON of the figures to
$OUT/bench_stream.json when OUT is set.
"""
import ctypes as C
import json
import mmap
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30

# ------------------------------------------------------------ C bindings
# Structs exactly as in include/vpager.h (x86-64 / LP64). Sizes are checked
# against the library where it reports them (vp_options_t.size).


class Options(C.Structure):
    _fields_ = [
        ("size", C.c_uint32),
        ("backend", C.c_int),
        ("device_index", C.c_int),
        ("page_size", C.c_uint64),
        ("headroom", C.c_int64),
        ("poll_interval_us", C.c_uint32),
        ("evict_order", C.c_int),
        ("sim_capacity", C.c_uint64),
        ("sim_granularity", C.c_uint64),
        ("sim_streams", C.c_int),
        ("sim_shared", C.c_char * 64),
        ("sim_fail_nth", C.c_int64),
        ("staging_size", C.c_uint64),
        ("lookahead", C.c_uint64),
        ("pin_budget", C.c_uint64),
        ("file_slots", C.c_uint32),
        ("file_slot_size", C.c_uint64),
    ]


class _Handle(C.Structure):
    _fields_ = [("id", C.c_uint64)]


class Device(_Handle):
    pass


class Vbar(_Handle):
    pass


class Weight(_Handle):
    pass


class Hostbuf(_Handle):
    pass


class St(_Handle):
    pass


class Source(C.Structure):
    _fields_ = [("kind", C.c_int), ("host", C.c_void_p), ("fd", C.c_int),
                ("file_offset", C.c_uint64)]


class DeviceInfo(C.Structure):
    _fields_ = [("page_size", C.c_uint64), ("granularity", C.c_uint64),
                ("total_memory", C.c_uint64), ("free_memory", C.c_uint64),
                ("committed", C.c_uint64), ("budget", C.c_uint64),
                ("headroom", C.c_int64), ("async_copies", C.c_int)]


class HostbufInfo(C.Structure):
    _fields_ = [("ptr", C.c_void_p), ("size", C.c_uint64),
                ("max_size", C.c_uint64), ("pinned_bytes", C.c_uint64)]


class StTensor(C.Structure):
    _fields_ = [("name", C.c_char_p), ("dtype", C.c_char * 16),
                ("ndim", C.c_uint32), ("shape", C.c_uint64 * 8),
                ("offset", C.c_uint64), ("size", C.c_uint64)]


def _stat_names():
    """The counters of vp_stats_t, in order, read from VP_STAT_FIELDS."""
    with open(os.path.join(ROOT, "include", "vpager.h")) as f:
        text = f.read()
    m = re.search(r"#define VP_STAT_FIELDS\(X\)(.*?)typedef struct vp_stats",
                  text, re.S)
    if not m:
        raise RuntimeError("VP_STAT_FIELDS not found in include/vpager.h")
    return re.findall(r"\bX\((\w+),", m.group(1))


STAT_NAMES = _stat_names()
Stats = type("Stats", (C.Structure,), {"_fields_": (
    [("size", C.c_uint32), ("version", C.c_uint32)] +
    [(n, C.c_uint64) for n in STAT_NAMES] +
    [("committed_bytes", C.c_uint64), ("pinned_bytes", C.c_uint64),
     ("reserved", C.c_uint64 * 8)])})

VP_MISS = 1
VP_ORDER_TAIL_FIRST, VP_ORDER_INTERLEAVED = 0, 1
ORDER_NAME = {0: "tail-first", 1: "interleaved"}
VP_SOURCE_HOST, VP_SOURCE_FILE = 1, 2
VP_PAGE_RESIDENT, VP_PAGE_PINNED = 1, 2
ACQ_RESIDENT, ACQ_STAGED, ACQ_COPIED, ACQ_EMPTY = 1, 2, 4, 8

_P = C.POINTER
_SIGS = {
    "vp_last_error": (C.c_char_p, []),
    "vp_err_name": (C.c_char_p, [C.c_int]),
    "vp_options_init": (C.c_int, [_P(Options)]),
    "vp_device_open": (C.c_int, [_P(Options), _P(Device)]),
    "vp_device_close": (C.c_int, [Device]),
    "vp_device_backend": (C.c_char_p, [Device]),
    "vp_device_info": (C.c_int, [Device, _P(DeviceInfo)]),
    "vp_device_set_headroom": (C.c_int, [Device, C.c_int64]),
    "vp_device_set_lookahead": (C.c_int, [Device, C.c_uint64]),
    "vp_device_stats": (C.c_int, [Device, _P(Stats)]),
    "vp_vbar_create": (C.c_int, [Device, C.c_uint64, _P(Vbar)]),
    "vp_vbar_destroy": (C.c_int, [Vbar]),
    "vp_vbar_base": (C.c_int, [Vbar, _P(C.c_uint64)]),
    "vp_vbar_page_count": (C.c_int, [Vbar, _P(C.c_uint64)]),
    "vp_vbar_set_order": (C.c_int, [Vbar, C.c_int]),
    "vp_vbar_set_watermark": (C.c_int, [Vbar, C.c_uint64]),
    "vp_vbar_get_watermark": (C.c_int, [Vbar, _P(C.c_uint64)]),
    "vp_vbar_residency": (C.c_int, [Vbar, C.c_void_p, C.c_size_t]),
    "vp_vbar_loaded_size": (C.c_int, [Vbar, _P(C.c_uint64)]),
    "vp_vbar_stats": (C.c_int, [Vbar, _P(Stats)]),
    "vp_fault": (C.c_int, [Vbar, C.c_uint64, C.c_uint64, C.c_void_p,
                           C.c_size_t]),
    "vp_unpin": (C.c_int, [Vbar, C.c_uint64, C.c_uint64, C.c_uint64]),
    "vp_weights_create": (C.c_int, [Vbar, C.c_size_t, C.c_void_p, C.c_void_p,
                                    C.c_void_p, C.c_void_p]),
    "vp_acquire": (C.c_int, [Device, C.c_void_p, C.c_size_t, C.c_uint64,
                             C.c_void_p, C.c_void_p]),
    "vp_release": (C.c_int, [Device, C.c_void_p, C.c_size_t, C.c_uint64]),
    "vp_hostbuf_alloc": (C.c_int, [Device, C.c_uint64, C.c_uint64,
                                   _P(Hostbuf)]),
    "vp_hostbuf_info": (C.c_int, [Hostbuf, _P(HostbufInfo)]),
    "vp_hostbuf_free": (C.c_int, [Hostbuf]),
}
_ST_SIGS = {
    "vp_st_open": (C.c_int, [Device, C.c_char_p, _P(St)]),
    "vp_st_close": (C.c_int, [St]),
    "vp_st_count": (C.c_int, [St, _P(C.c_size_t)]),
    "vp_st_tensor": (C.c_int, [St, C.c_size_t, _P(StTensor)]),
    "vp_st_load": (C.c_int, [St, C.c_size_t, C.c_void_p, Vbar, C.c_void_p,
                             C.c_uint64]),
    "vp_st_drop_pages": (C.c_int, [St]),
}


class VpError(RuntimeError):
    pass


def load_lib(path=None):
    path = path or os.path.join(ROOT, "build", "libvpager.so")
    lib = C.CDLL(path)
    for name, (res, args) in _SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    lib.have_st = True
    for name, (res, args) in _ST_SIGS.items():
        fn = getattr(lib, name, None)
        if fn is None:
            lib.have_st = False
            continue
        fn.restype, fn.argtypes = res, args
    return lib


def check(lib, rc, what, ok=(0,)):
    if rc not in ok:
        raise VpError("%s returned %s: %s" % (
            what, lib.vp_err_name(rc).decode(),
            lib.vp_last_error().decode(errors="replace")))
    return rc


def stats_of(lib, dev=None, vbar=None):
    s = Stats()
    s.size = C.sizeof(Stats)
    if vbar is not None:
        check(lib, lib.vp_vbar_stats(vbar, C.byref(s)), "vp_vbar_stats")
    else:
        check(lib, lib.vp_device_stats(dev, C.byref(s)), "vp_device_stats")
    return {n: getattr(s, n) for n in STAT_NAMES + ["committed_bytes",
                                                    "pinned_bytes"]}


def stats_delta(a, b):
    return {k: b[k] - a[k] for k in a}


def copied_bytes(d):
    """Bytes vpager copied host->device: at acquire (staged_bytes,
    fill_bytes) and ahead of need (prefetch_bytes, counted apart)."""
    return d["staged_bytes"] + d["fill_bytes"] + d["prefetch_bytes"]


def device_info(lib, dev, fresh=True):
    if fresh:  # the budget is re-polled once the poll interval has passed
        time.sleep(0.02)
    info = DeviceInfo()
    check(lib, lib.vp_device_info(dev, C.byref(info)), "vp_device_info")
    return info


def set_budget(lib, dev, budget):
    """Let vpager commit about `budget` bytes, whatever else uses the device
    (as demo/demo.c): headroom = free + committed - budget."""
    info = device_info(lib, dev)
    headroom = max(0, info.free_memory + info.committed - budget)
    check(lib, lib.vp_device_set_headroom(dev, headroom),
          "vp_device_set_headroom")
    return device_info(lib, dev)


class Model:
    """One VBAR of n weights (weights[i] = [offsets[i], +sizes[i])) whose
    host sources lie in memory at host_ptr + offsets[i] (one hostbuf in
    VBAR order, so vpager can merge adjacent copies), acquired `group`
    weights per call."""

    def __init__(self, lib, dev, size, offsets, sizes, host_ptr, order=None,
                 group=1):
        self.lib, self.dev, self.n, self.group = lib, dev, len(offsets), group
        self.vbar = Vbar()
        check(lib, lib.vp_vbar_create(dev, size, C.byref(self.vbar)),
              "vp_vbar_create")
        if order is not None:
            check(lib, lib.vp_vbar_set_order(self.vbar, order),
                  "vp_vbar_set_order")
        self.order = order
        n = self.n
        self.offsets, self.sizes = list(offsets), list(sizes)
        offs = (C.c_uint64 * n)(*offsets)
        szs = (C.c_uint64 * n)(*sizes)
        srcs = (Source * n)()
        for i in range(n):
            srcs[i].kind = VP_SOURCE_HOST
            srcs[i].host = host_ptr + offsets[i]
            srcs[i].fd = -1
        self.w = (Weight * n)()
        check(lib, lib.vp_weights_create(self.vbar, n, offs, szs, srcs,
                                         self.w), "vp_weights_create")
        self.ptrs = (C.c_uint64 * n)()
        self.flags = (C.c_uint8 * n)()
        self.waddr = C.addressof(self.w)
        self.paddr = C.addressof(self.ptrs)
        self.faddr = C.addressof(self.flags)
        self.base = C.c_uint64()
        check(lib, lib.vp_vbar_base(self.vbar, C.byref(self.base)),
              "vp_vbar_base")
        self.base = self.base.value

    def acquire(self, i, k, stream):
        rc = self.lib.vp_acquire(self.dev, self.waddr + 8 * i, k, stream,
                                 self.paddr + 8 * i, self.faddr + i)
        if rc:
            check(self.lib, rc, "vp_acquire(weights %d..%d)" % (i, i + k - 1))

    def release(self, i, k, stream):
        rc = self.lib.vp_release(self.dev, self.waddr + 8 * i, k, stream)
        if rc:
            check(self.lib, rc, "vp_release(weights %d..%d)" % (i, i + k - 1))

    def staged(self):
        return [i for i in range(self.n) if self.flags[i] & ACQ_STAGED]

    def flag_map(self):
        return "".join("s" if f & ACQ_STAGED else "#" for f in self.flags)

    def page_map(self):
        n = C.c_uint64()
        check(self.lib, self.lib.vp_vbar_page_count(self.vbar, C.byref(n)),
              "vp_vbar_page_count")
        fl = (C.c_uint8 * n.value)()
        check(self.lib, self.lib.vp_vbar_residency(self.vbar, fl, n.value),
              "vp_vbar_residency")
        return "".join("P" if f & VP_PAGE_PINNED else
                       "#" if f & VP_PAGE_RESIDENT else "." for f in fl)

    def loaded(self):
        b = C.c_uint64()
        check(self.lib, self.lib.vp_vbar_loaded_size(self.vbar, C.byref(b)),
              "vp_vbar_loaded_size")
        return b.value

    def destroy(self):
        check(self.lib, self.lib.vp_vbar_destroy(self.vbar), "vp_vbar_destroy")


def run_groups(model, stream, fn=None):
    """One pass: acquire each group, call fn(i, ptr) per weight, release."""
    g = model.group
    for i in range(0, model.n, g):
        k = min(g, model.n - i)
        model.acquire(i, k, stream)
        if fn:
            for j in range(i, i + k):
                fn(j, model.ptrs[j])
        model.release(i, k, stream)


# ------------------------------------------------------------ dry run


def sim_dry_run():
    """Bindings and the overlap benchmark's residency, scaled down 16x, on
    the simulated device: which layers stream in steady state under each
    eviction order."""
    lib = load_lib()
    L, LB, PAGE = 96, 8 * MiB, 2 * MiB
    for order in (VP_ORDER_TAIL_FIRST, VP_ORDER_INTERLEAVED):
        opts = Options()
        check(lib, lib.vp_options_init(C.byref(opts)), "vp_options_init")
        assert opts.size == C.sizeof(Options), (opts.size, C.sizeof(Options))
        opts.backend = 2
        opts.page_size = PAGE
        opts.sim_capacity = 2 * GiB
        opts.staging_size = 32 * MiB
        opts.lookahead = 16 * MiB
        opts.evict_order = order
        dev = Device()
        check(lib, lib.vp_device_open(C.byref(opts), C.byref(dev)),
              "vp_device_open")
        hb = Hostbuf()
        check(lib, lib.vp_hostbuf_alloc(dev, L * LB, L * LB, C.byref(hb)),
              "vp_hostbuf_alloc")
        hi = HostbufInfo()
        check(lib, lib.vp_hostbuf_info(hb, C.byref(hi)), "vp_hostbuf_info")
        budget = L * LB * 2 // 3
        info = set_budget(lib, dev, budget)
        m = Model(lib, dev, L * LB, [i * LB for i in range(L)], [LB] * L,
                  hi.ptr)
        for p in range(4):
            s0 = stats_of(lib, dev)
            run_groups(m, 0)
            d = stats_delta(s0, stats_of(lib, dev))
            print("%s pass %d: staged %2d layers, %4d MiB copied, budget %d "
                  "MiB, loaded %d MiB\n  flags %s\n  pages %s" % (
                      ORDER_NAME[order], p, len(m.staged()),
                      copied_bytes(d) >> 20,
                      info.budget >> 20, m.loaded() >> 20, m.flag_map(),
                      m.page_map()))
        m.destroy()
        check(lib, lib.vp_hostbuf_free(hb), "vp_hostbuf_free")
        check(lib, lib.vp_device_close(dev), "vp_device_close")
    print("sizes: Options %d Source %d Stats %d DeviceInfo %d StTensor %d" % (
        C.sizeof(Options), C.sizeof(Source), C.sizeof(Stats),
        C.sizeof(DeviceInfo), C.sizeof(StTensor)))


# =================================================================== GPU

torch = None
RESULTS = {}
TARGETS = []  # (name, value, op, target, met)


def target(name, value, op, goal):
    met = value <= goal if op == "<=" else value >= goal
    TARGETS.append((name, value, op, goal, met))
    return "target %s %.2f: %s" % (op, goal, "MET" if met else "MISSED")


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def med(xs):
    return statistics.median(xs)


class CAI:
    """A device pointer as a __cuda_array_interface__ object (int16 words)."""

    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {
            "shape": (nbytes // 2,), "typestr": "<i2", "data": (ptr, False),
            "strides": None, "version": 3}


def dev_tensor(ptr, shape):
    n = 1
    for s in shape:
        n *= s
    t = torch.as_tensor(CAI(ptr, 2 * n), device="cuda")
    return t.view(torch.bfloat16).view(*shape)


class TensorCache:
    """Device views by address: resident weights and ring slots reuse the
    same addresses, so each view is made once (zero copy)."""

    def __init__(self, shape):
        self.shape, self.d = shape, {}

    def get(self, ptr):
        t = self.d.get(ptr)
        if t is None:
            t = self.d[ptr] = dev_tensor(ptr, self.shape)
        return t


def time_forwards(fwd, n, stream):
    """Median and all of n back-to-back forwards' times on `stream` (CUDA
    events, ms), and wall time per forward (perf_counter around all n)."""
    ev = [(torch.cuda.Event(enable_timing=True),
           torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a, b in ev:
        a.record(stream)
        fwd()
        b.record(stream)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    ts = [a.elapsed_time(b) for a, b in ev]
    return med(ts), wall, ts


def time_once(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


class HandStreamer:
    """Hand-written double-buffered streamer over a fixed non-resident set.

    groups: list of lists of weight indices, in execution order; res[i]: a
    resident device tensor of weight i (used in place when i is not
    streamed); host_flat: an int16 CPU tensor over the pinned host buffer;
    host_off[i], nbytes[i], shape[i]: weight i's bytes there. Streamed
    weights of a group are copied (adjacent ones merged into one copy) into
    one of `nbuf` device buffers on a side stream; the compute stream waits
    for that copy's event, and the copy that reuses a buffer waits for the
    compute event of its last reader. The pipeline runs on across forwards:
    the next forward's first streamed groups are copied while this one
    ends (as vpager's prefetch wraps)."""

    def __init__(self, groups, streamed, res, host_flat, host_off, nbytes,
                 shape, compute, nbuf=2, inline=False):
        self.groups, self.res, self.compute = groups, res, compute
        self.streamed = set(streamed)
        self.inline = inline  # naive: copies on the compute stream, 1 buffer
        self.nbuf = 1 if inline else nbuf
        self.copy = compute if inline else torch.cuda.Stream()
        sg = []  # per streamed group: (group index, copies, views per buf)
        maxb = 0
        for gi, g in enumerate(groups):
            mem = [i for i in g if i in self.streamed]
            if not mem:
                continue
            runs, boff, place = [], 0, {}
            for i in mem:
                place[i] = boff
                if runs and runs[-1][0] + runs[-1][1] == host_off[i]:
                    runs[-1][1] += nbytes[i]
                else:
                    runs.append([host_off[i], nbytes[i], boff])
                boff += nbytes[i]
            maxb = max(maxb, boff)
            sg.append((gi, runs, place))
        self.bufs = [torch.empty(max(maxb, 2) // 2, dtype=torch.int16,
                                 device="cuda") for _ in range(self.nbuf)]
        self.plan = []  # per streamed group, per buffer: copies and views
        for gi, runs, place in sg:
            per = []
            for b in range(self.nbuf):
                buf = self.bufs[b]
                cps = [(buf[bo // 2:(bo + n) // 2],
                        host_flat[ho // 2:(ho + n) // 2]) for ho, n, bo in runs]
                views = {i: buf[o // 2:(o + nbytes[i]) // 2]
                         .view(torch.bfloat16).view(*shape[i])
                         for i, o in place.items()}
                per.append((cps, views))
            self.plan.append(per)
        self.gpos = {gi: k for k, (gi, _, _) in enumerate(sg)}
        self.nsg = len(sg)
        self.copy_done = [torch.cuda.Event() for _ in range(self.nbuf)]
        self.comp_done = [torch.cuda.Event() for _ in range(self.nbuf)]
        self.issued = self.used = 0
        self.bytes_per_forward = sum(nbytes[i] for i in self.streamed)
        if not inline:
            for _ in range(min(self.nbuf, self.nsg)):
                self._issue()

    def _issue(self):
        j = self.issued
        b, k = j % self.nbuf, j % self.nsg
        cps, _ = self.plan[k][b]
        with torch.cuda.stream(self.copy):
            if j >= self.nbuf:
                self.copy.wait_event(self.comp_done[b])
            for dst, src in cps:
                dst.copy_(src, non_blocking=True)
            self.copy_done[b].record(self.copy)
        self.issued += 1

    def forward(self, kernel):
        res = self.res
        for gi, g in enumerate(self.groups):
            k = self.gpos.get(gi)
            if k is None:
                for i in g:
                    kernel(i, res[i])
                continue
            if self.inline:
                cps, views = self.plan[k][0]
                for dst, src in cps:
                    dst.copy_(src, non_blocking=True)
            else:
                j = self.used
                b = j % self.nbuf
                assert j % self.nsg == k
                cps, views = self.plan[k][b]
                self.compute.wait_event(self.copy_done[b])
            for i in g:
                kernel(i, views[i] if i in views else res[i])
            if not self.inline:
                self.comp_done[b].record(self.compute)
                self.used += 1
                self._issue()


def machine_info():
    lines = []
    p = torch.cuda.get_device_properties(0)
    drv = "?"
    try:
        drv = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
             "pcie.link.width.current", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        drv = "nvidia-smi failed: %s" % e
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f.readline().split(":", 1)[1].strip()
    except OSError:
        pass
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
        import hashlib
        h = hashlib.sha1()
        for d in ("include", "src"):
            for fn in sorted(os.listdir(os.path.join(ROOT, d))):
                with open(os.path.join(ROOT, d, fn), "rb") as f:
                    h.update(fn.encode() + f.read())
        rev += " (sha1 of include/ + src/: %s)" % h.hexdigest()[:12]
    except OSError:
        pass
    lines.append("gpu: %s, %.1f GiB, %d SMs; driver, PCIe gen, width: %s" % (
        p.name, p.total_memory / GiB, p.multi_processor_count, drv))
    lines.append("host: %s, %d cpus, MemTotal %s, Linux %s" % (
        cpu, os.cpu_count(), mem, platform.release()))
    lines.append("software: python %s, torch %s (CUDA %s), vpager %s; %s UTC"
                 % (platform.python_version(), torch.__version__,
                    torch.version.cuda, rev,
                    time.strftime("%Y-%m-%d %H:%M", time.gmtime())))
    return lines


class Bench:
    def __init__(self, args):
        self.only = args.get("only")
        self.lib = load_lib()
        lib = self.lib
        torch.cuda.init()
        torch.cuda.set_device(0)
        for ln in machine_info():
            print(ln)
        self.opts = Options()
        check(lib, lib.vp_options_init(C.byref(self.opts)), "vp_options_init")
        if self.opts.size != C.sizeof(Options):
            raise VpError("vp_options_t is %d bytes in the library, %d here"
                          % (self.opts.size, C.sizeof(Options)))
        self.opts.backend = 1  # CUDA
        self.dev = Device()
        check(lib, lib.vp_device_open(C.byref(self.opts), C.byref(self.dev)),
              "vp_device_open")
        o = self.opts
        print("vpager options: backend %s, page %d MiB, staging ring %d MiB, "
              "lookahead %d MiB, default order %s, poll %d us, file slots "
              "%d x %d MiB" % (lib.vp_device_backend(self.dev).decode(),
                               o.page_size >> 20, o.staging_size >> 20,
                               o.lookahead >> 20, ORDER_NAME[o.evict_order],
                               o.poll_interval_us, o.file_slots,
                               o.file_slot_size >> 20))
        self.compute = torch.cuda.Stream()
        self.s = self.compute.cuda_stream
        # The host copy of the 96-layer model, one hostbuf in VBAR order;
        # benchmarks 1, 3 and 4 use parts of it.
        self.L, self.D = 96, 8192
        self.LB = self.D * self.D * 2
        size = self.L * self.LB
        t0 = time.perf_counter()
        self.hb = Hostbuf()
        check(lib, lib.vp_hostbuf_alloc(self.dev, size, size,
                                        C.byref(self.hb)), "vp_hostbuf_alloc")
        hi = HostbufInfo()
        check(lib, lib.vp_hostbuf_info(self.hb, C.byref(hi)),
              "vp_hostbuf_info")
        t_alloc = time.perf_counter() - t0
        self.hptr = hi.ptr
        arr = (C.c_int16 * (size // 2)).from_address(self.hptr)
        self.host_flat = torch.frombuffer(arr, dtype=torch.int16)
        self.host = self.host_flat.view(torch.bfloat16).view(self.L, self.D,
                                                             self.D)
        pinned = self.host_flat.is_pinned()
        # Resident copies (baseline) and the host bytes: random bf16.
        t0 = time.perf_counter()
        g = torch.Generator(device="cuda").manual_seed(1)
        self.res = []
        for i in range(self.L):
            w = torch.randn(self.D, self.D, device="cuda", dtype=torch.bfloat16,
                            generator=g) * 0.02
            self.host[i].copy_(w)
            self.res.append(w)
        torch.cuda.synchronize()
        print("host model: one hostbuf of %d GiB (vp_hostbuf_alloc %.2f s, "
              "%d GiB page-locked, torch sees pinned=%s); filled with random "
              "bf16 from the GPU in %.2f s" % (size >> 30, t_alloc,
                                              hi.pinned_bytes >> 30, pinned,
                                              time.perf_counter() - t0))
        if not pinned or hi.pinned_bytes < size:
            print("WARNING: the host buffer is not (all) page-locked: copies "
                  "will be slow and the baselines too")
        self.link = None

    def want(self, k):
        return not self.only or k in self.only

    # ------------------------------------------------------------- link
    def measure_link(self):
        """Plain pinned host->device copies of 128 MiB (32 of them, 4 GiB)
        and of 2 MiB (2048), torch .copy_(non_blocking=True) on one stream,
        from the same host buffer."""
        dst = torch.empty(self.LB // 2, dtype=torch.int16, device="cuda")
        src128 = [self.host_flat[i * self.LB // 2:(i + 1) * self.LB // 2]
                  for i in range(32)]
        n2 = 2 * MiB // 2
        src2 = [self.host_flat[i * n2:(i + 1) * n2] for i in range(2048)]
        dst2 = dst[:n2]
        out = {}
        for name, srcs, d in (("128MiB", src128, dst), ("2MiB", src2, dst2)):
            nb = sum(s.numel() * 2 for s in srcs)

            def go(srcs=srcs, d=d):
                with torch.cuda.stream(self.compute):
                    for s in srcs:
                        d.copy_(s, non_blocking=True)
            go()
            m, wall, _ = time_forwards(go, 5, self.compute)
            out[name] = gbps(nb, m / 1e3)
        self.link = out["128MiB"]
        self.link2 = out["2MiB"]
        print("link (in-run baseline): pinned host->device %.2f GB/s in 128 "
              "MiB copies, %.2f GB/s in 2 MiB copies (median of 5 x 4 GiB)"
              % (self.link, self.link2))
        RESULTS["link_GBps"] = out
        del dst

    # ------------------------------------------------------- benchmark 1
    def bench_throughput(self):
        lib, dev = self.lib, self.dev
        print("\n1. streaming throughput: weights that all miss (VBAR "
              "watermark 0) acquired and released in order on one stream, no "
              "kernels; 4 GiB a round, 6 rounds back to back, median of rounds "
              "2-6 (CUDA events on the stream); baseline: plain pinned copies "
              "of the same host bytes in the same chunks (torch copy_)")
        for wsize, base in ((128 * MiB, self.link), (2 * MiB, self.link2)):
            n = 4 * GiB // wsize
            m = Model(lib, dev, 4 * GiB, [i * wsize for i in range(n)],
                      [wsize] * n, self.hptr)
            check(lib, lib.vp_vbar_set_watermark(m.vbar, 0),
                  "vp_vbar_set_watermark")
            s = self.s
            run_groups(m, s)  # opens the staging ring
            torch.cuda.synchronize()
            s0 = stats_of(lib, dev)
            med_ms, wall, ts = time_forwards(lambda: run_groups(m, s), 6,
                                             self.compute)
            d = stats_delta(s0, stats_of(lib, dev))
            med_ms = med(ts[1:])
            r = gbps(4 * GiB, med_ms / 1e3)
            cpu_us = self._cpu_cost(lambda: run_groups(m, s), n)
            staged = len(m.staged())
            print("   %3d MiB weights x %4d: vpager %.2f GB/s (%.1f ms/round, "
                  "wall %.1f) | baseline %.2f GB/s | ratio %.3f, %s" % (
                      wsize >> 20, n, r, med_ms, wall, base, r / base,
                      target("1. throughput %d MiB weights" % (wsize >> 20),
                             r / base, ">=", 0.95)))
            print("       per round: staged %d of %d weights, %.0f MiB copied, "
                  "%d copies after merging, %d ring waits, prefetch %.0f MiB "
                  "(used %.0f, dropped %.0f); host cost %.1f us per "
                  "acquire+release" % (
                      staged, n, copied_bytes(d) / 6 / MiB, d["copies"] / 6,
                      d["ring_waits"] / 6, d["prefetch_bytes"] / 6 / MiB,
                      d["prefetch_used_bytes"] / 6 / MiB,
                      d["prefetch_dropped_bytes"] / 6 / MiB, cpu_us))
            RESULTS["throughput_%dMiB" % (wsize >> 20)] = {
                "GBps": r, "baseline_GBps": base, "ratio": r / base}
            torch.cuda.synchronize()
            m.destroy()
        if self.link2 < self.link:
            print("   (2 MiB weights against one 128 MiB-chunk copy: ratio "
                  "%.3f)" % (RESULTS["throughput_2MiB"]["GBps"] / self.link))

    def _cpu_cost(self, fn, calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        torch.cuda.synchronize()
        return t / calls * 1e6

    # ------------------------------------------------------- benchmark 2
    def bench_overlap(self):
        lib, dev = self.lib, self.dev
        L, D, LB = self.L, self.D, self.LB
        cs = self.compute
        s = self.s
        weights = L * LB
        budget = int(weights / 1.5)
        print("\n2. overlap: %d bf16 %dx%d layers (%d MiB each, %d GiB), "
              "vpager budget %.2f GiB (weights/1.5, staging ring included), "
              "forward = x @ W_i for every layer on one stream" % (
                  L, D, D, LB >> 20, weights >> 30, budget / GiB))
        # Per-layer copy and GEMM times, to pick the balanced batch.
        dst = torch.empty(D, D, dtype=torch.bfloat16, device="cuda")
        xs = {}

        def gemm_ms(b):
            x = torch.randn(b, D, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(b, D, device="cuda", dtype=torch.bfloat16)

            def f():
                with torch.cuda.stream(cs):
                    for i in range(L):
                        torch.mm(x, self.res[i], out=o)
            f()
            m, _, _ = time_forwards(f, 3, cs)
            return m / L
        t_copy = LB / (self.link * 1e9) * 1e3
        g4096 = gemm_ms(4096)
        beq = int(round(4096 * t_copy / g4096 / 512)) * 512
        beq = max(4096, min(beq, 32768))
        geq = gemm_ms(beq)
        batches = [16, 4096, beq]
        print("   per layer: copy %.3f ms at %.2f GB/s; GEMM %.3f ms at 4096 "
              "tokens (%.0f TFLOP/s), %.3f ms at %d (balanced: GEMM ~ copy); "
              "batches %s" % (t_copy, self.link, g4096,
                              2 * 4096 * D * D / g4096 / 1e9, geq, beq,
                              batches))
        for b in batches:
            xs[b] = (torch.randn(b, D, device="cuda", dtype=torch.bfloat16),
                     [torch.empty(b, D, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2)])
        with torch.cuda.stream(cs):  # torch's pools are per stream
            assert torch.equal(self.res[0], self.res[0])
        del dst
        torch.cuda.synchronize()
        cache = TensorCache((D, D))
        NT = 5
        out = RESULTS.setdefault("overlap", {})

        def kern_for(b):
            x, outs = xs[b]

            def k(i, w):
                torch.mm(x, w, out=outs[i & 1])
            return k

        def resident_fwd(b):
            k = kern_for(b)

            def f():
                with torch.cuda.stream(cs):
                    for i in range(L):
                        k(i, self.res[i])
            return f

        def vp_fwd(m, b, verify=None):
            k = kern_for(b)
            acq, rel, ptrs = m.acquire, m.release, m.ptrs

            def f():
                with torch.cuda.stream(cs):
                    for i in range(L):
                        acq(i, 1, s)
                        w = cache.get(ptrs[i])
                        if verify is not None:
                            if not torch.equal(w, self.res[i]):
                                verify.append(i)
                        k(i, w)
                        rel(i, 1, s)
            return f

        # Prime torch's cache with the streamers' buffers, so that making
        # them later does not move the device's free memory (vpager's
        # budget follows it).
        tmp = [torch.empty(LB // 2, dtype=torch.int16, device="cuda")
               for _ in range(3)]
        del tmp
        torch.cuda.synchronize()
        # A second device handle with 128 MiB pages (one page per layer) for
        # the interleaved order at the weights' own granularity.
        o2 = Options()
        C.memmove(C.byref(o2), C.byref(self.opts), C.sizeof(Options))
        o2.page_size = LB
        o2.evict_order = VP_ORDER_INTERLEAVED
        dev2 = Device()
        check(lib, lib.vp_device_open(C.byref(o2), C.byref(dev2)),
              "vp_device_open (128 MiB pages)")
        variants = (
            ("tail-first", dev, VP_ORDER_TAIL_FIRST, "%d MiB pages" % (
                self.opts.page_size >> 20)),
            ("interleaved", dev, VP_ORDER_INTERLEAVED, "%d MiB pages" % (
                self.opts.page_size >> 20)),
            ("interleaved-128MiB-pages", dev2, None,
             "a second device handle opened with page_size 128 MiB and "
             "evict_order interleaved"))
        base = {}
        for oname, vdev, order, how in variants:
            info = set_budget(lib, vdev, budget)
            m = Model(lib, vdev, weights, [i * LB for i in range(L)],
                      [LB] * L, self.hptr, order=order)
            s0 = stats_of(lib, vdev)
            cold = time_once(vp_fwd(m, batches[0]))
            d = stats_delta(s0, stats_of(lib, vdev))
            cold_bytes = copied_bytes(d)
            print("\n   vpager, %s eviction order (%s): budget %.2f GiB "
                  "(headroom %.1f GiB, device free %.1f GiB)" % (
                      oname, how, info.budget / GiB, info.headroom / GiB,
                      info.free_memory / GiB))
            print("   cold forward (the first, batch %d): %.1f ms, %.2f GiB "
                  "copied (%d pages committed, %d evicted) = %.2f GB/s; "
                  "baseline: the same bytes at the link's %.2f GB/s %.1f ms, "
                  "ratio %.2f" % (batches[0], cold, cold_bytes / GiB,
                                  d["pages_committed"], d["pages_evicted"],
                                  gbps(cold_bytes, cold / 1e3), self.link,
                                  cold_bytes / self.link / 1e6,
                                  cold / (cold_bytes / self.link / 1e6)))
            out.setdefault(oname, {})["cold_ms"] = cold
            for b in batches:
                bad = []
                f = vp_fwd(m, b)
                f()
                f()
                vp_fwd(m, b, verify=bad)()  # a third warm-up, checked
                s0 = stats_of(lib, vdev)
                t_vp, wall_vp, ts = time_forwards(f, NT, cs)
                d = stats_delta(s0, stats_of(lib, vdev))
                streamed = m.staged()
                sbytes = len(streamed) * LB
                cbytes = copied_bytes(d) / NT
                ideal = sbytes / (self.link * 1e9) * 1e3
                # The hand-written streamer over exactly this set.
                hs = HandStreamer([[i] for i in range(L)], streamed, self.res,
                                  self.host_flat, [i * LB for i in range(L)],
                                  [LB] * L, [(D, D)] * L, cs)
                k = kern_for(b)

                def hf(hs=hs, k=k):
                    with torch.cuda.stream(cs):
                        hs.forward(k)
                hf()
                hf()
                t_hand, wall_hand, _ = time_forwards(hf, NT, cs)
                if b not in base:
                    t_res, _, _ = time_forwards(resident_fwd(b), NT, cs)
                    base[b] = {"resident": t_res}
                if "naive" not in base[b]:
                    nv = HandStreamer([[i] for i in range(L)], streamed,
                                      self.res, self.host_flat,
                                      [i * LB for i in range(L)], [LB] * L,
                                      [(D, D)] * L, cs, inline=True)

                    def nf(nv=nv, k=k):
                        with torch.cuda.stream(cs):
                            nv.forward(k)
                    nf()
                    base[b]["naive"], _, _ = time_forwards(nf, NT, cs)
                    base[b]["naive_set"] = oname
                    del nv
                t_res = base[b]["resident"]
                print("   batch %5d: vpager %.2f ms (wall %.2f; forwards %s) | "
                      "hand-written streamer %.2f ms | resident %.2f ms | "
                      "naive (%s set) %.2f ms" % (
                          b, t_vp, wall_vp, " ".join("%.1f" % t for t in ts),
                          t_hand, t_res, base[b]["naive_set"],
                          base[b]["naive"]))
                print("      streamed %d of %d layers, %.2f GiB a forward "
                      "(vpager copied %.2f GiB in %d copies; %d ring waits, "
                      "%d evictions); copy-bound ideal %.2f ms; vpager/ideal "
                      "%.3f, hand/ideal %.3f, vpager/hand %.3f, "
                      "vpager/resident %.2f%s" % (
                          len(streamed), L, sbytes / GiB, cbytes / GiB,
                          d["copies"] / NT, d["ring_waits"] / NT,
                          d["pages_evicted"] / NT, ideal, t_vp / ideal,
                          t_hand / ideal, t_vp / t_hand, t_vp / t_res,
                          "; DATA MISMATCH in layers %s" % bad if bad else
                          "; data verified"))
                if b == 4096:
                    # Diagnostic: the same without prefetch. An acquire's
                    # stream then waits only for copies issued up to and
                    # including its own weights (no prefetched later ones).
                    check(lib, lib.vp_device_set_lookahead(vdev, 0),
                          "vp_device_set_lookahead")
                    f()
                    f()
                    t_nola, _, _ = time_forwards(f, NT, cs)
                    check(lib, lib.vp_device_set_lookahead(
                        vdev, self.opts.lookahead), "vp_device_set_lookahead")
                    f()
                    print("      diagnostic, lookahead 0 (no prefetch): vpager "
                          "%.2f ms, vpager/hand %.3f" % (t_nola,
                                                         t_nola / t_hand))
                if b == batches[0]:
                    print("      layers ('#' in place, 's' staged): %s" %
                          m.flag_map())
                    print("      pages  ('#' resident, '.' not):    %s" %
                          m.page_map())
                rec = {"vpager_ms": t_vp, "hand_ms": t_hand,
                       "resident_ms": t_res, "naive_ms": base[b]["naive"],
                       "streamed_layers": len(streamed),
                       "streamed_GiB": sbytes / GiB,
                       "copied_GiB": cbytes / GiB, "ideal_ms": ideal,
                       "forwards_ms": ts, "verified": not bad}
                out[oname]["batch_%d" % b] = rec
                if b == batches[0]:
                    print("      " + target("2. copy-bound b%d %s vp/ideal" % (
                        b, oname), t_vp / ideal, "<=", 1.02))
                if b == beq:
                    print("      " + target("2. compute-bound b%d %s vp/hand"
                                            % (b, oname), t_vp / t_hand,
                                            "<=", 1.05))
                del hs
            torch.cuda.synchronize()
            m.destroy()
        check(lib, lib.vp_device_close(dev2), "vp_device_close (128 MiB)")
        print("   cache of device views: %d addresses" % len(cache.d))

    # ------------------------------------------------------- benchmark 3
    def bench_small(self):
        lib, dev, cs, s = self.lib, self.dev, self.compute, self.s
        N, WS, G = 1536, 2 * MiB, 8
        budget = 2 * GiB
        per_layer = self.LB // WS
        print("\n3. many small weights: %d weights of %d MiB (%d GiB), "
              "budget %d GiB (staging ring included), %d weights per "
              "acquire, kernel per weight: x[16,1024] @ W[1024,1024]" % (
                  N, WS >> 20, N * WS >> 30, budget >> 30, G))
        res = [self.res[i // per_layer].view(-1)[
            (i % per_layer) * (WS // 2):(i % per_layer + 1) * (WS // 2)]
            .view(1024, 1024) for i in range(N)]
        x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
                for _ in range(2)]

        def k(i, w):
            torch.mm(x, w, out=outs[i & 1])
        groups = [list(range(i, min(i + G, N))) for i in range(0, N, G)]
        cache = TensorCache((1024, 1024))
        torch.cuda.synchronize()
        info = set_budget(lib, dev, budget)
        m = Model(lib, dev, N * WS, [i * WS for i in range(N)], [WS] * N,
                  self.hptr, group=G)

        def vf(verify=None):
            def f():
                with torch.cuda.stream(cs):
                    for g0 in range(0, N, G):
                        m.acquire(g0, G, s)
                        for j in range(g0, g0 + G):
                            w = cache.get(m.ptrs[j])
                            if verify is not None and not torch.equal(
                                    w, res[j]):
                                verify.append(j)
                            k(j, w)
                        m.release(g0, G, s)
            return f
        cold = time_once(vf())
        bad = []
        vf()()
        vf(bad)()
        s0 = stats_of(lib, dev)
        NT = 7
        t_vp, wall_vp, ts = time_forwards(vf(), NT, cs)
        d = stats_delta(s0, stats_of(lib, dev))
        streamed = m.staged()
        sbytes = len(streamed) * WS
        cbytes = copied_bytes(d) / NT
        hs = HandStreamer(groups, streamed, res, self.host_flat,
                          [i * WS for i in range(N)], [WS] * N,
                          [(1024, 1024)] * N, cs)

        def hf():
            with torch.cuda.stream(cs):
                hs.forward(k)
        hf()
        hf()
        t_hand, wall_hand, _ = time_forwards(hf, NT, cs)

        def rf():
            with torch.cuda.stream(cs):
                for i in range(N):
                    k(i, res[i])
        rf()
        t_res, wall_res, _ = time_forwards(rf, NT, cs)
        cpu = self._cpu_cost(vf(), N)
        ideal = sbytes / (self.link * 1e9) * 1e3
        print("   budget %.2f GiB; cold forward %.1f ms" % (info.budget / GiB,
                                                         cold))
        print("   vpager %.2f ms (wall %.2f) | hand-written streamer %.2f ms "
              "(wall %.2f) | resident %.2f ms (wall %.2f) | copy ideal %.2f "
              "ms at %.2f GB/s" % (t_vp, wall_vp, t_hand, wall_hand, t_res,
                                    wall_res, ideal, self.link))
        print("   streamed %d of %d weights, %.2f GiB a forward (vpager copied "
              "%.2f GiB), %d copies a forward after merging, %d ring waits, "
              "prefetch used %.0f MiB dropped %.0f MiB; host cost %.1f us a "
              "weight (acquire/release of %d + kernel launches)%s" % (
                  len(streamed), N, sbytes / GiB, cbytes / GiB,
                  d["copies"] / NT,
                  d["ring_waits"] / NT, d["prefetch_used_bytes"] / NT / MiB,
                  d["prefetch_dropped_bytes"] / NT / MiB, cpu, G,
                  "; DATA MISMATCH at %s" % bad[:10] if bad else
                  "; data verified"))
        print("   vpager/hand %.3f, %s; vpager/ideal %.3f, hand/ideal %.3f"
              % (t_vp / t_hand, target("3. many small weights vpager/hand",
                                       t_vp / t_hand, "<=", 1.15),
                 t_vp / ideal, t_hand / ideal))
        RESULTS["small"] = {"vpager_ms": t_vp, "hand_ms": t_hand,
                            "resident_ms": t_res, "ideal_ms": ideal,
                            "cold_ms": cold, "streamed": len(streamed),
                            "verified": not bad}
        torch.cuda.synchronize()
        m.destroy()
        del hs

    # ------------------------------------------------------- benchmark 4
    def bench_file(self):
        lib, dev = self.lib, self.dev
        print("\n4. file -> VRAM: safetensors file on local disk, vp_st_open + "
              "vp_st_load of every tensor into a VBAR")
        if not lib.have_st:
            print("   SKIPPED: the library has no safetensors reader (vp_st_* "
                  "missing from build/libvpager.so)")
            return
        d_, why = pick_disk_dir(6 * GiB)
        if d_ is None:
            print("   SKIPPED: %s" % why)
            return
        path = os.path.join(d_, "vpager_bench_stream.safetensors")
        NT, TB = 32, self.LB
        total = NT * TB
        hdr = {"__metadata__": {"format": "pt", "by": "bench_stream.py"}}
        for i in range(NT):
            hdr["layers.%02d.weight" % i] = {
                "dtype": "BF16", "shape": [self.D, self.D],
                "data_offsets": [i * TB, (i + 1) * TB]}
        hj = json.dumps(hdr, separators=(",", ":")).encode()
        pad = (-(8 + len(hj))) % 4096
        hj += b" " * pad
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, len(hj).to_bytes(8, "little") + hj)
            for i in range(NT):
                mv = memoryview((C.c_char * TB).from_address(
                    self.hptr + i * TB)).cast("B")
                done = 0
                while done < TB:
                    done += os.write(fd, mv[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        t_write = time.perf_counter() - t0
        fsize = os.path.getsize(path)
        print("   file: %s on %s, %d tensors BF16 [%d, %d], %.2f GiB, header "
              "%d bytes (data aligned to 4096); written and fsynced in %.1f s "
              "(%.2f GB/s)" % (path, why, NT, self.D, self.D, fsize / GiB,
                               8 + len(hj), t_write, gbps(fsize, t_write)))
        buf = mmap.mmap(-1, 64 * MiB)
        CH = 64 * MiB

        def read_all(direct):
            flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
            fd = os.open(path, flags)
            try:
                if not direct:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = time.perf_counter()
                off = 0
                while off < fsize:
                    n = os.preadv(fd, [buf], off)
                    if n <= 0:
                        raise OSError("short read at %d" % off)
                    off += n
                return time.perf_counter() - t0
            finally:
                os.close(fd)

        def read_hot():
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                t0 = time.perf_counter()
                while off < fsize:
                    off += os.preadv(fd, [buf], off)
                return time.perf_counter() - t0
            finally:
                os.close(fd)
        st = St()
        check(lib, lib.vp_st_open(dev, path.encode(), C.byref(st)),
              "vp_st_open")
        n = C.c_size_t()
        check(lib, lib.vp_st_count(st, C.byref(n)), "vp_st_count")
        n = n.value
        tens = []
        for i in range(n):
            t = StTensor()
            check(lib, lib.vp_st_tensor(st, i, C.byref(t)), "vp_st_tensor")
            tens.append((t.name.decode(), t.offset, t.size))
        idx = (C.c_size_t * n)(*range(n))
        offs = (C.c_uint64 * n)(*[i * TB for i in range(n)])
        info = set_budget(lib, dev, total + 4 * GiB)
        s = self.s

        def vp_load():
            vb = Vbar()
            check(lib, lib.vp_vbar_create(dev, total, C.byref(vb)),
                  "vp_vbar_create")
            check(lib, lib.vp_st_drop_pages(st), "vp_st_drop_pages")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            check(lib, lib.vp_st_load(st, n, idx, vb, offs, s), "vp_st_load")
            torch.cuda.synchronize()
            return time.perf_counter() - t0, vb
        rounds = 3
        r_direct, r_cold, r_vp = [], [], []
        bad = None
        hot = None
        for r in range(rounds):
            try:
                r_direct.append(read_all(True))
            except OSError as e:
                if r == 0:
                    print("   O_DIRECT read failed (%s); using buffered reads "
                          "after POSIX_FADV_DONTNEED only" % e)
            r_cold.append(read_all(False))
            t, vb = vp_load()
            r_vp.append(t)
            if bad is None:  # check the bytes once: tensors 0 and n-1
                bad = []
                for i in (0, n - 1):
                    check(lib, lib.vp_fault(vb, i * TB, TB, None, 0),
                          "vp_fault")
                    base = C.c_uint64()
                    lib.vp_vbar_base(vb, C.byref(base))
                    w = dev_tensor(base.value + i * TB, (self.D, self.D))
                    with torch.cuda.stream(self.compute):
                        ok = torch.equal(w, self.res[i])
                    check(lib, lib.vp_unpin(vb, i * TB, TB, s), "vp_unpin")
                    if not ok:
                        bad.append(tens[i][0])
                torch.cuda.synchronize()
            check(lib, lib.vp_vbar_destroy(vb), "vp_vbar_destroy")
            if r == 0 and r_cold[0] > 8:
                rounds = 2
            if r + 1 >= rounds:
                break
        hot = read_hot()
        sd = stats_of(lib, dev)
        check(lib, lib.vp_st_close(st), "vp_st_close")
        gb_direct = gbps(fsize, med(r_direct)) if r_direct else 0.0
        gb_cold = gbps(fsize, med(r_cold))
        gb_vp = gbps(total, med(r_vp))
        read = max(gb_direct, gb_cold)
        ceiling = min(read, self.link)
        print("   file read speed (single thread, 64 MiB preadv): O_DIRECT "
              "%s | buffered after POSIX_FADV_DONTNEED %.2f GB/s | page cache "
              "hot %.2f GB/s (shows whether the drop worked)" % (
                  "%.2f GB/s" % gb_direct if r_direct else "n/a", gb_cold,
                  gbps(fsize, hot)))
        print("   vpager vp_st_load (vp_st_drop_pages first, VBAR created "
              "fresh, commit included): %.2f GB/s (%s s) | baseline min(read "
              "%.2f [the faster of O_DIRECT and cold buffered], link %.2f) = "
              "%.2f GB/s | ratio %.3f, %s; %s" % (
                  gb_vp, " ".join("%.2f" % t for t in r_vp), read, self.link,
                  ceiling, gb_vp / ceiling,
                  target("4. file -> VRAM / min(read, link)", gb_vp / ceiling,
                         ">=", 0.85),
                  "data verified (tensors 0 and %d)" % (n - 1) if not bad else
                  "DATA MISMATCH in %s" % bad))
        print("   file_bytes_read so far %.2f GiB; budget was %.1f GiB" % (
            sd["file_bytes_read"] / GiB, info.budget / GiB))
        RESULTS["file"] = {"vpager_GBps": gb_vp, "odirect_GBps": gb_direct,
                           "cold_buffered_GBps": gb_cold,
                           "hot_GBps": gbps(fsize, hot), "link_GBps": self.link,
                           "ratio": gb_vp / ceiling}
        try:
            os.unlink(path)
        except OSError:
            pass

    def close(self):
        torch.cuda.synchronize()
        sd = stats_of(self.lib, self.dev)
        print("\ndevice totals: %s" % ", ".join(
            "%s %d" % (k, sd[k]) for k in (
                "acquires", "weight_staged", "weight_fills", "copies",
                "stream_waits", "ring_waits", "pages_committed",
                "pages_evicted", "budget_misses", "watermark_misses",
                "pin_fallback_bytes")))
        check(self.lib, self.lib.vp_hostbuf_free(self.hb), "vp_hostbuf_free")
        check(self.lib, self.lib.vp_device_close(self.dev), "vp_device_close")


def pick_disk_dir(need):
    """A directory on a real disk (not tmpfs) with `need` bytes free."""
    mounts = []
    try:
        with open("/proc/mounts") as f:
            for ln in f:
                p = ln.split()
                if len(p) >= 3:
                    mounts.append((p[1], p[2], p[0]))
    except OSError:
        pass

    def fstype(d):
        best = ("", "?", "?")
        real = os.path.realpath(d)
        for mp, t, src in mounts:
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and \
                    len(mp) >= len(best[0]):
                best = (mp, t, src)
        return best
    tried = []
    for d in ("/tmp", "/var/tmp", ROOT, os.path.expanduser("~")):
        if not os.path.isdir(d) or not os.access(d, os.W_OK):
            continue
        mp, t, src = fstype(d)
        sv = os.statvfs(d)
        free = sv.f_bavail * sv.f_frsize
        tried.append("%s: %s %s, %.0f GiB free" % (d, t, src, free / GiB))
        if t in ("tmpfs", "ramfs"):
            continue
        if free >= need:
            return d, "%s (%s %s, mounted at %s)" % (d, t, src, mp)
    return None, "no directory on a disk with %d GiB free: %s" % (
        need >> 30, "; ".join(tried))


def main():
    args = {}
    argv = sys.argv[1:]
    if "--sim-dry-run" in argv:
        sim_dry_run()
        return 0
    if "--only" in argv:
        args["only"] = set(int(x) for x in
                           argv[argv.index("--only") + 1].split(","))
    global torch
    import torch as _torch
    torch = _torch
    if not torch.cuda.is_available():
        print("bench_stream: no CUDA GPU visible to torch; nothing to do")
        return 0
    t_start = time.perf_counter()
    b = Bench(args)
    b.measure_link()
    steps = ((1, b.bench_throughput), (2, b.bench_overlap),
             (3, b.bench_small), (4, b.bench_file))
    for k, fn in steps:
        if b.want(k):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report, run the rest
                import traceback
                traceback.print_exc(file=sys.stdout)
                print("   FAILED: %s: %s" % (type(e).__name__, e))
                RESULTS.setdefault("errors", []).append(str(e))
                torch.cuda.synchronize()
            print("   (benchmark %d took %.1f s)" % (k, time.perf_counter() - t0))
    b.close()
    print("\ntargets:")
    for name, v, op, goal, met in TARGETS:
        print("   %-52s %.3f %s %.2f  %s" % (name, v, op, goal,
                                            "MET" if met else "MISSED"))
    print("total run time %.1f s" % (time.perf_counter() - t_start))
    RESULTS["targets"] = [dict(name=n, value=v, op=o, goal=g, met=m)
                          for n, v, o, g, m in TARGETS]
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "bench_stream.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
