#!/usr/bin/env python3
"""comfy_aimdo on vpager, cold start (issue 12 section 2): HostBuffer
extend + registration and read_file_slice / read_file_to_device from the
page cache, against baselines measured in the same run.

1. Registration, as ComfyUI >= 0.38 pins weights: HostBuffer(0,
   prewarm=64 MiB, max_grow_size=size), then per weight ptr =
   extend(n, register=False) and cudaHostRegister(ptr, n, 1) (through
   torch.cuda.cudart(), as ComfyUI calls it; --register driver:
   cuMemHostRegister through ctypes), --size bytes (9.4 GiB) in pieces of
   --extend-size (9.4 GiB / 138, the profile's 138 calls). Baselines:
   plain touched memory (anonymous mmap, one MADV_POPULATE_WRITE, the same
   registrations) and untouched memory (mmap, registered without a touch:
   what the drop-in's HostBuffer handed out before, every 4 KiB page
   faulted in by the registration). ms/GiB of extend, of registration and
   of both; ratios to the baselines; target registration <= 60 ms/GiB.
2. read_file_slice of a --size file in the page cache into a HostBuffer,
   in slices of about --read-size (9.4 GiB / 276, the profile's 276 calls;
   sizes and offsets not aligned), against a multi-threaded pread of the
   same file (threads x one contiguous pread each, into touched memory)
   and a one-thread pread (what the drop-in did before). GB/s, ratio;
   target >= 20 GB/s. A sample of the bytes is compared with the file.
3. Chained to the device: read_file_slice(..., device_ptr) into torch
   device memory and into pinned VBAR memory, and read_file_to_device into
   both, from a HostBuffer registered as ComfyUI registers it (one
   extend + registration per slice), against the
   link (the same pieces copied host->device from that buffer) and the
   floor max(read, link); target chained / floor <= 1.25.

    make -j16 && PYTHONUNBUFFERED=1 PYTHONPATH=python:python/compat \\
        python3 bench/bench_compat_cold.py | tee $OUT/bench_compat_cold.log
    PYTHONPATH=python:python/compat /usr/bin/python3 \\
        bench/bench_compat_cold.py --dry-run

--dry-run: no CUDA, vpager's simulated device (VPAGER_BACKEND=sim), --size
512 MiB unless given; registration is mlock + munlock (it pins pages as a
registration does, faulting untouched ones in) where the process may lock
memory, else skipped (--register none); the device uploads are the
simulated device's copies. It checks the script; the CPU figures say how
populating and parallel reads compare on this host, not what a GPU host
does. Threads: VPAGER_COMPAT_THREADS or --threads (default min(8, CPUs)).
The file goes to --dir (default: the system's temporary directory) and is
removed at the end. Writes $OUT/bench_compat_cold.json when OUT is set.
Every section catches and prints its own errors.
"""

import argparse
import ctypes
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "python", "compat"),
           os.path.join(ROOT, "python")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import benchlib  # noqa: E402
from benchlib import GiB, MiB, Ctx, elapsed, say  # noqa: E402

RESULTS = {}
torch = None


def fail(what):
    traceback.print_exc(file=sys.stdout)
    say("   %s: FAILED" % what)
    RESULTS.setdefault("errors", []).append(
        "%s: %s" % (what, traceback.format_exc().strip().splitlines()[-1]))


def parse_size(text):
    t = str(text).strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))


FULL = int(9.4 * GiB)           # the profile's model


# ---------------------------------------------------------- registration

class Registrar:
    """register(ptr, n) / unregister(ptr): cudart (torch), the driver
    (ctypes), mlock (CPU stand-in) or none. Each returns 0 on success."""

    def __init__(self, how):
        self.how = how
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.sizes = {}
        if how == "cudart":
            self.rt = torch.cuda.cudart()
        elif how == "driver":
            torch.zeros(1, device="cuda")           # a current context
            self.cu = ctypes.CDLL("libcuda.so.1")
            self.cu.cuMemHostRegister_v2.argtypes = [
                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            self.cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]

    def describe(self):
        return {"cudart": "cudaHostRegister(ptr, n, 1) through "
                          "torch.cuda.cudart() (as ComfyUI)",
                "driver": "cuMemHostRegister_v2(ptr, n, PORTABLE) through "
                          "ctypes",
                "mlock": "mlock + munlock (CPU stand-in: pins the pages, "
                         "faulting in untouched ones)",
                "none": "none (registration skipped)"}[self.how]

    def register(self, ptr, n):
        self.sizes[ptr] = n
        if self.how == "cudart":
            return int(self.rt.cudaHostRegister(ptr, n, 1))
        if self.how == "driver":
            return self.cu.cuMemHostRegister_v2(ptr, n, 1)
        if self.how == "mlock":
            if self.libc.mlock(ptr, n) != 0:
                return ctypes.get_errno()
            return 0
        return 0

    def unregister(self, ptr):
        n = self.sizes.pop(ptr, 0)
        if self.how == "cudart":
            return int(self.rt.cudaHostUnregister(ptr))
        if self.how == "driver":
            return self.cu.cuMemHostUnregister(ptr)
        if self.how == "mlock":
            return self.libc.munlock(ptr, n)
        return 0


def _rw(_hostio, size):
    """Anonymous read-write memory of `size` bytes, untouched (the
    drop-in's calls: reserved, then committed; _hostio.release frees it)."""
    base = _hostio.map_anon(size)
    _hostio.commit(base, size)
    return base


def pick_registrar(args, dry):
    how = args.register or ("mlock" if dry else "cudart")
    if how == "cudart" and not hasattr(torch.cuda, "cudart"):
        how = "driver"
    if how == "mlock":
        r = Registrar("mlock")
        from comfy_aimdo import _hostio
        p = _rw(_hostio, 32 * MiB)
        ok = r.register(p, 32 * MiB) == 0
        if ok:
            r.unregister(p)
        _hostio.release(p, 32 * MiB)
        if not ok:
            say("   (mlock refused here: registration skipped)")
            how = "none"
    return Registrar(how)


def pieces_of(total, piece, align, rng=None):
    """Sizes adding up to total: `piece` each (multiples of align), the
    last one what is left; with rng, each within +-12% of piece."""
    out, left = [], total
    while left > 0:
        n = piece
        if rng is not None:
            n = int(piece * rng.uniform(0.88, 1.12))
        n = max(align, n // align * align)
        n = min(n, left)
        out.append(n)
        left -= n
    return out


def huge_share(lo, hi):
    """Share of [lo, hi) backed by transparent huge pages (smaps)."""
    huge = rss = 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for ln in f:
                head = ln.split()
                if head and "-" in head[0] and ":" not in head[0]:
                    a, b = (int(x, 16) for x in head[0].split("-"))
                    inside = a < hi and lo < b
                    continue
                if inside and ln.startswith("AnonHugePages:"):
                    huge += int(head[1]) * 1024
                elif inside and ln.startswith("Rss:"):
                    rss += int(head[1]) * 1024
    except OSError:
        return None
    return huge / rss if rss else 0.0


def reg_dropin(cfg, reg, thp=True):
    """ComfyUI >= 0.38's pins: extend(register=False) + registration;
    thp=False: without the buffer's huge page advice."""
    from comfy_aimdo import _hostio, host_buffer
    saved, _hostio.THP = _hostio.THP, thp and _hostio.THP
    try:
        hb = host_buffer.HostBuffer(0, prewarm=64 * MiB,
                                    max_grow_size=cfg.size)
    finally:
        _hostio.THP = saved
    t_ext = t_reg = 0.0
    ptrs, failed = [], 0
    for n in cfg.ext_pieces:
        t0 = time.perf_counter()
        p = hb.extend(n, register=False)
        t1 = time.perf_counter()
        rc = reg.register(p, n)
        t2 = time.perf_counter()
        t_ext += t1 - t0
        t_reg += t2 - t1
        if rc == 0:
            ptrs.append(p)
        else:
            failed += 1
    base = hb.get_raw_address()
    huge = huge_share(base, base + hb.size)
    t0 = time.perf_counter()
    for p in ptrs:
        reg.unregister(p)
    t_unreg = time.perf_counter() - t0
    hb.close()
    return dict(extend_s=t_ext, register_s=t_reg, unregister_s=t_unreg,
                failed=failed, huge_share=huge)


def reg_plain(cfg, reg, touch):
    """One anonymous mmap (no huge page advice), touched (one
    MADV_POPULATE_WRITE, or a memset) or not, registered in the same
    pieces."""
    from comfy_aimdo import _hostio
    size = cfg.size
    base = _rw(_hostio, size)
    t_touch = 0.0
    if touch:
        t0 = time.perf_counter()
        _hostio.populate(base, size, workers=1)
        t_touch = time.perf_counter() - t0
    t_reg, ptrs, failed, off = 0.0, [], 0, 0
    for n in cfg.ext_pieces:
        p = base + off
        off += n
        t0 = time.perf_counter()
        rc = reg.register(p, n)
        t_reg += time.perf_counter() - t0
        if rc == 0:
            ptrs.append(p)
        else:
            failed += 1
    huge = huge_share(base, base + size)
    t0 = time.perf_counter()
    for p in ptrs:
        reg.unregister(p)
    t_unreg = time.perf_counter() - t0
    _hostio.release(base, size)
    return dict(touch_s=t_touch, register_s=t_reg, unregister_s=t_unreg,
                failed=failed, huge_share=huge)


def section_register(cfg, reg):
    say("\n1. HostBuffer extend + registration, %.2f GiB in %d pieces of "
        "~%.1f MiB; registration: %s" % (
            cfg.size / GiB, len(cfg.ext_pieces),
            cfg.size / len(cfg.ext_pieces) / MiB, reg.describe()))
    gib = cfg.size / GiB
    runs = {"dropin": [], "touched": [], "untouched": [], "dropin_4k": []}
    for rep in range(cfg.reps):
        for name in ("dropin", "touched") + (
                ("untouched",) if cfg.untouched and rep == 0 else ()) + \
                (("dropin_4k",) if rep == 0 else ()):
            try:
                if name.startswith("dropin"):
                    r = reg_dropin(cfg, reg, thp=name == "dropin")
                    say("   rep %d %-10s extend %7.1f ms/GiB, register "
                        "%7.1f ms/GiB, both %7.1f ms/GiB (unregister %.1f; "
                        "huge pages %s; %d refused)" % (
                            rep, {"dropin": "drop-in:", "dropin_4k":
                                  "no-THP:"}[name], r["extend_s"] * 1e3 / gib,
                            r["register_s"] * 1e3 / gib,
                            (r["extend_s"] + r["register_s"]) * 1e3 / gib,
                            r["unregister_s"] * 1e3 / gib,
                            "%.0f%%" % (100 * r["huge_share"])
                            if r["huge_share"] is not None else "?",
                            r["failed"]))
                else:
                    r = reg_plain(cfg, reg, name == "touched")
                    say("   rep %d %-10s touch  %7.1f ms/GiB, register "
                        "%7.1f ms/GiB, both %7.1f ms/GiB (unregister %.1f; "
                        "huge pages %s; %d refused)" % (
                            rep, name + ":", r["touch_s"] * 1e3 / gib,
                            r["register_s"] * 1e3 / gib,
                            (r["touch_s"] + r["register_s"]) * 1e3 / gib,
                            r["unregister_s"] * 1e3 / gib,
                            "%.0f%%" % (100 * r["huge_share"])
                            if r["huge_share"] is not None else "?",
                            r["failed"]))
                runs[name].append(r)
            except Exception:  # noqa: BLE001
                fail("registration, %s, rep %d" % (name, rep))
    RESULTS["register"] = dict(size=cfg.size, pieces=len(cfg.ext_pieces),
                               how=reg.how, runs=runs)

    def m(name, key):
        xs = [r[key] for r in runs[name]]
        return statistics.median(xs) * 1e3 / gib if xs else float("nan")
    d_ext, d_reg = m("dropin", "extend_s"), m("dropin", "register_s")
    t_touch, t_reg = m("touched", "touch_s"), m("touched", "register_s")
    u_reg = m("untouched", "register_s")
    n_ext, n_reg = m("dropin_4k", "extend_s"), m("dropin_4k", "register_s")
    s = dict(dropin_extend_ms_gib=d_ext, dropin_register_ms_gib=d_reg,
             dropin_both_ms_gib=d_ext + d_reg, touched_touch_ms_gib=t_touch,
             touched_register_ms_gib=t_reg, untouched_register_ms_gib=u_reg,
             register_over_touched=d_reg / t_reg if t_reg else None,
             both_over_touched_both=(d_ext + d_reg) / (t_touch + t_reg)
             if t_touch + t_reg else None,
             untouched_over_dropin_both=u_reg / (d_ext + d_reg)
             if d_ext + d_reg else None,
             no_thp_extend_ms_gib=n_ext, no_thp_register_ms_gib=n_reg)
    RESULTS["register"]["summary"] = s
    say("   medians (ms/GiB): drop-in extend %.1f + register %.1f = %.1f; "
        "touched memory: touch %.1f + register %.1f = %.1f; untouched "
        "memory: register %.1f; drop-in without THP advice: extend %.1f + "
        "register %.1f = %.1f" % (d_ext, d_reg, d_ext + d_reg, t_touch,
                                  t_reg, t_touch + t_reg, u_reg, n_ext,
                                  n_reg, n_ext + n_reg))
    say("   ratios: drop-in register / touched register %.2f; drop-in "
        "(extend + register) / touched (touch + register) %.2f; untouched "
        "register / drop-in (extend + register) %.2f" % (
            s["register_over_touched"] or float("nan"),
            s["both_over_touched_both"] or float("nan"),
            s["untouched_over_dropin_both"] or float("nan")))
    if cfg.cuda and reg.how in ("cudart", "driver"):
        say("   " + benchlib.target("drop-in registration ms/GiB", d_reg,
                                    "<=", 60.0))
        say("   " + benchlib.target("drop-in register / touched register",
                                    d_reg / t_reg, "<=", 1.10))


# ----------------------------------------------------------------- files

class TheFile:
    """A --size file of distinct 64 MiB blocks, fsync'ed, read once so it
    is in the page cache."""

    def __init__(self, cfg):
        d = cfg.dir or tempfile.gettempdir()
        free = shutil.disk_usage(d).free
        if free < cfg.size + GiB:
            raise RuntimeError("%s has %.1f GiB free; the file needs %.1f"
                               % (d, free / GiB, cfg.size / GiB + 1))
        fd, self.path = tempfile.mkstemp(prefix="bench_compat_cold.",
                                         dir=d)
        self.size = cfg.size
        block = bytearray(os.urandom(64 * MiB))
        t0 = time.perf_counter()
        try:
            off, i = 0, 0
            while off < self.size:
                block[:8] = i.to_bytes(8, "little")
                n = min(len(block), self.size - off)
                os.write(fd, memoryview(block)[:n])
                off += n
                i += 1
            os.fsync(fd)
        finally:
            os.close(fd)
        self.fd = os.open(self.path, os.O_RDONLY)
        t1 = time.perf_counter()
        self.warm()
        say("   file %s: %.2f GiB written in %.1f s, read once (%.1f s); "
            "%.0f%% in the page cache" % (self.path, self.size / GiB,
                                          t1 - t0, time.perf_counter() - t1,
                                          100 * self.cached()))

    def warm(self):
        from comfy_aimdo import _hostio
        buf = _rw(_hostio, 64 * MiB)
        try:
            off = 0
            while off < self.size:
                n = min(64 * MiB, self.size - off)
                _hostio.pread_into(self.fd, buf, n, off)
                off += n
        finally:
            _hostio.release(buf, 64 * MiB)

    def cached(self):
        """Share of the file's pages in the page cache (mincore over a
        read-only mapping of it)."""
        from comfy_aimdo import _hostio
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p]
        pg = os.sysconf("SC_PAGE_SIZE")
        npages = (self.size + pg - 1) // pg
        vec = (ctypes.c_ubyte * npages)()
        a = _hostio.map_file(self.fd, self.size)
        try:
            if libc.mincore(a, self.size, vec) != 0:
                return float("nan")
        finally:
            _hostio.unmap_file(a, self.size)
        return bytes(vec).count(1) / npages if npages else 1.0

    def sample_ok(self, addr, rng, count=16):
        """count random ranges of the memory at addr equal the file."""
        for _ in range(count):
            n = rng.randint(1, 1 << 20)
            off = rng.randrange(max(1, self.size - n))
            if ctypes.string_at(addr + off, n) != os.pread(self.fd, n, off):
                return False
        return True

    def close(self):
        try:
            os.close(self.fd)
        finally:
            os.unlink(self.path)


def mt_pread(fd, addr, size, threads):
    """threads x one contiguous pread each (the baseline)."""
    from comfy_aimdo import _hostio
    step = (size + threads - 1) // threads
    errs = []

    def one(k):
        lo, hi = k * step, min(size, (k + 1) * step)
        try:
            if hi > lo:
                _hostio.pread_into(fd, addr + lo, hi - lo, lo)
        except Exception as e:  # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errs:
        raise errs[0]
    return dt


def section_read(cfg, f):
    from comfy_aimdo import _hostio, _par, host_buffer
    threads = _par.threads()
    say("\n2. read_file_slice from the page cache: %.2f GiB in %d slices of "
        "~%.1f MiB (unaligned), %d threads" % (
            cfg.size / GiB, len(cfg.read_pieces),
            cfg.size / len(cfg.read_pieces) / MiB, threads))
    size, rng = cfg.size, random.Random(7)
    hb = host_buffer.HostBuffer(0, 0, 0)
    hb.extend(size, register=False)
    base = hb.get_raw_address()
    plain = _rw(_hostio, size)
    _hostio.populate(plain, size)
    runs = {"dropin": [], "mt_pread": [], "pread_1": []}
    try:
        for rep in range(cfg.reps):
            try:
                ctypes.memset(base, 0, 4096)
                t0 = time.perf_counter()
                off = 0
                for n in cfg.read_pieces:
                    hb.read_file_slice(f.fd, off, n, offset=off)
                    off += n
                dt = time.perf_counter() - t0
                ok = f.sample_ok(base, rng) and \
                    ctypes.string_at(base, 4096) == os.pread(f.fd, 4096, 0)
                runs["dropin"].append(dict(s=dt, gbps=size / dt / 1e9,
                                           equal=ok))
                say("   rep %d drop-in read_file_slice: %6.2f GB/s (%.3f s);"
                    " bytes %s" % (rep, size / dt / 1e9, dt,
                                   "EQUAL to the file" if ok else "DIFFER"))
            except Exception:  # noqa: BLE001
                fail("read_file_slice, rep %d" % rep)
            try:
                dt = mt_pread(f.fd, plain, size, threads)
                runs["mt_pread"].append(dict(s=dt, gbps=size / dt / 1e9))
                say("   rep %d pread, %d threads:       %6.2f GB/s (%.3f s)"
                    % (rep, threads, size / dt / 1e9, dt))
            except Exception:  # noqa: BLE001
                fail("multi-threaded pread, rep %d" % rep)
            if rep == 0:
                try:
                    t0 = time.perf_counter()
                    off = 0
                    for n in cfg.read_pieces:
                        _hostio.pread_into(f.fd, plain + off, n, off)
                        off += n
                    dt = time.perf_counter() - t0
                    runs["pread_1"].append(dict(s=dt, gbps=size / dt / 1e9))
                    say("   rep %d pread, 1 thread, same slices: %6.2f GB/s "
                        "(%.3f s; the drop-in before)"
                        % (rep, size / dt / 1e9, dt))
                except Exception:  # noqa: BLE001
                    fail("one-thread pread")
    finally:
        _hostio.release(plain, size)
        hb.close()

    def m(name):
        xs = [r["gbps"] for r in runs[name]]
        return statistics.median(xs) if xs else float("nan")
    d, b, one = m("dropin"), m("mt_pread"), m("pread_1")
    RESULTS["read"] = dict(size=size, slices=len(cfg.read_pieces),
                           threads=threads, runs=runs,
                           summary=dict(dropin_gbps=d, mt_pread_gbps=b,
                                        pread_1_gbps=one,
                                        dropin_over_mt=d / b))
    say("   medians: drop-in %.2f GB/s, %d-thread pread %.2f GB/s, one "
        "thread %.2f GB/s; drop-in / %d-thread pread %.2f; drop-in / one "
        "thread %.2f" % (d, threads, b, one, threads, d / b, d / one))
    if cfg.cuda:
        say("   " + benchlib.target("read_file_slice GB/s", d, ">=", 20.0))
    return d


def section_chain(cfg, f, reg, read_gbps):
    """read_file_slice(device_ptr) and read_file_to_device into torch and
    VBAR device memory, against the link and max(read, link)."""
    from comfy_aimdo import control, host_buffer, model_vbar
    size = cfg.size
    say("\n3. chained to the device: %.2f GiB, the same %d slices, from a "
        "HostBuffer registered as ComfyUI does" % (
            size / GiB, len(cfg.read_pieces)))
    dev = control.get_devctx(0)
    hb = host_buffer.HostBuffer(0, 64 * MiB, size)
    regd = []
    # One pin (extend + registration) per slice, as ComfyUI pins each
    # module: a copy may not span two registrations.
    for n in cfg.read_pieces:
        p = hb.extend(n, register=False)
        if reg.how in ("cudart", "driver") and reg.register(p, n) == 0:
            regd.append(p)
    base = hb.get_raw_address()
    if cfg.cuda:
        s = torch.cuda.Stream()
        stream = s.cuda_stream
        sync = s.synchronize
    else:
        stream = 0

        def sync():
            dev.synchronize(stream)
    targets = {}
    keep = []
    try:
        if cfg.cuda:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
            keep.append(t)
            targets["torch memory"] = (t.data_ptr(), None)
        vb = model_vbar.ModelVBAR(size + 64 * MiB, 0)
        a = vb.alloc(size)
        if model_vbar.vbar_fault(a) is None:
            say("   (the VBAR range did not fit: VBAR target left out)")
        else:
            targets["VBAR memory"] = (a[1], a)
        keep.append(vb)
        # The link: the same pieces copied from the registered buffer.
        link = None
        if targets:
            dptr = next(iter(targets.values()))[0]
            up = host_buffer._Uploader(dptr, stream, 0)
            for _ in range(2):          # the first one warms the memory up
                off = 0
                sync()
                t0 = time.perf_counter()
                for n in cfg.read_pieces:
                    up.upload(off, base + off, n)
                    off += n
                sync()
                dt = time.perf_counter() - t0
                link = max(link or 0, size / dt / 1e9)
            say("   link, host->device copies of the same slices (%s, %s):"
                " %.2f GB/s" % (next(iter(targets)), up.how, link))
        floor = max(size / (read_gbps * 1e9), size / (link * 1e9)) \
            if link and read_gbps == read_gbps else float("nan")
        out = dict(link_gbps=link, floor_s=floor, runs={})
        if targets:
            # The first read_file_to_device makes the file reader's staging
            # slots (populated, registered): once per device, timed apart.
            dptr = next(iter(targets.values()))[0]
            n = min(size, 64 * MiB)
            sync()
            t0 = time.perf_counter()
            hb.read_file_to_device(f.fd, 0, n, stream, dptr, 0,
                                   mark_cold=False)
            sync()
            out["first_to_device_s"] = time.perf_counter() - t0
            say("   first read_file_to_device (%d MiB; makes the staging "
                "slots): %.1f ms" % (n // MiB,
                                     out["first_to_device_s"] * 1e3))
        for tname, (dptr, _) in targets.items():
            for call in ("read_file_slice", "read_file_to_device"):
                try:
                    sync()
                    t0 = time.perf_counter()
                    off = 0
                    for n in cfg.read_pieces:
                        if call == "read_file_slice":
                            hb.read_file_slice(f.fd, off, n, offset=off,
                                               stream=stream,
                                               device_ptr=dptr + off,
                                               device=0)
                        else:
                            hb.read_file_to_device(f.fd, off, n, stream,
                                                   dptr + off, 0,
                                                   mark_cold=False)
                        off += n
                    sync()
                    dt = time.perf_counter() - t0
                    ok = check_device(cfg, dev, dptr, f)
                    r = dict(s=dt, gbps=size / dt / 1e9, over_link=(
                        size / dt / 1e9) / link if link else None,
                        over_floor=dt / floor, equal=ok)
                    out["runs"]["%s -> %s" % (call, tname)] = r
                    say("   %-20s -> %-12s %6.2f GB/s (%.3f s), %.2f of the "
                        "link, time / max(read, link) %.2f; bytes %s" % (
                            call, tname, r["gbps"], dt,
                            r["over_link"] or float("nan"), r["over_floor"],
                            "EQUAL" if ok else "DIFFER"))
                    if cfg.cuda:
                        say("      " + benchlib.target(
                            "%s -> %s time / max(read, link)" % (call, tname),
                            r["over_floor"], "<=", 1.25))
                except Exception:  # noqa: BLE001
                    fail("%s -> %s" % (call, tname))
        RESULTS["chain"] = out
        if "VBAR memory" in targets:
            model_vbar.vbar_unpin(targets["VBAR memory"][1])
    finally:
        sync()
        for p in regd:
            reg.unregister(p)
        hb.truncate(0, do_unregister=False)
        hb.close()
        for k in keep:
            if hasattr(k, "close"):
                k.close()
        keep.clear()
        hb.cleanup_file_reader()


def check_device(cfg, dev, dptr, f, count=8):
    rng = random.Random(3)
    for _ in range(count):
        n = rng.randint(1, 1 << 20)
        off = rng.randrange(max(1, f.size - n))
        want = os.pread(f.fd, n, off)
        if cfg.cuda:
            from vpager import _views
            host = _views.view(dptr + off, torch.uint8, (n,),
                               torch.device("cuda", 0)).cpu()
            got = ctypes.string_at(host.data_ptr(), n)
        else:
            got = ctypes.string_at(dptr + off, n)
        if got != want:
            return False
    return True


# ------------------------------------------------------------------ main

class Cfg:
    def __init__(self, args, cuda):
        self.cuda = cuda
        self.dry = not cuda
        self.size = parse_size(args.size) if args.size else \
            (512 * MiB if self.dry else FULL)
        ext = parse_size(args.extend_size) if args.extend_size else \
            FULL // 138
        rd = parse_size(args.read_size) if args.read_size else FULL // 276
        self.ext_pieces = pieces_of(self.size, ext, 1024)
        self.read_pieces = pieces_of(self.size, rd, 1, random.Random(276))
        self.reps = args.reps if args.reps else (1 if self.dry else 2)
        self.dir = args.dir
        self.untouched = not args.no_untouched


def main():
    global torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no CUDA: the simulated device, 512 MiB")
    ap.add_argument("--size", help="bytes (9.4G; dry 512M); K/M/G suffixes")
    ap.add_argument("--extend-size", help="bytes per extend (9.4G / 138)")
    ap.add_argument("--read-size", help="bytes per read slice, about "
                    "(9.4G / 276)")
    ap.add_argument("--reps", type=int, help="repetitions (2; dry 1)")
    ap.add_argument("--threads", type=int, help="comfy_aimdo's worker "
                    "threads (VPAGER_COMPAT_THREADS, else min(8, CPUs))")
    ap.add_argument("--register", choices=("cudart", "driver", "mlock",
                                           "none"),
                    help="how memory is registered (cudart; dry mlock)")
    ap.add_argument("--dir", help="where the file goes (the temp dir)")
    ap.add_argument("--no-untouched", action="store_true",
                    help="skip the untouched-memory baseline")
    ap.add_argument("--skip", default="", help="comma-separated sections "
                    "to skip: register,read,chain")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["VPAGER_BACKEND"] = "sim"
    import torch as _torch
    torch = _torch
    if not args.dry_run and not torch.cuda.is_available():
        say("bench_compat_cold: no CUDA GPU visible to torch; use --dry-run "
            "for the CPU check")
        return 1
    ctx = Ctx(args.dry_run)
    cfg = Cfg(args, ctx.cuda)
    if args.dry_run:
        os.environ.setdefault("VPAGER_SIM_CAPACITY",
                              "%dM" % ((cfg.size + 256 * MiB) // MiB))
    if ctx.cuda:
        torch.cuda.init()
        torch.cuda.set_device(0)
    from comfy_aimdo import _hostio, _par, control
    if args.threads:
        _par.set_threads(args.threads)
    skip = set(x.strip() for x in args.skip.split(",") if x.strip())
    try:
        import comfy_aimdo
        thp = []
        for k in ("enabled", "defrag"):
            try:
                with open("/sys/kernel/mm/transparent_hugepage/" + k) as fh:
                    thp.append("%s %s" % (k, fh.read().strip()))
            except OSError:
                pass
        for ln in benchlib.machine_lines(
                ctx.cuda, extras=[
                    "comfy_aimdo %s from %s" % (
                        comfy_aimdo.__version__,
                        os.path.dirname(comfy_aimdo.__file__)),
                    "%d worker threads" % _par.threads(),
                    "THP: %s" % "; ".join(thp) if thp else "THP: ?"],
                dirs=benchlib.SOURCE_DIRS + (
                    os.path.join("python", "compat", "comfy_aimdo"),)):
            say(ln)
    except Exception:  # noqa: BLE001
        fail("machine info")
    say("mode: %s" % ("DRY RUN (no CUDA; simulated device, "
                      "VPAGER_SIM_CAPACITY=%s; CPU figures)"
                      % os.environ.get("VPAGER_SIM_CAPACITY")
                      if args.dry_run else "GPU"))
    RESULTS.update(size=cfg.size, dry_run=cfg.dry, threads=_par.threads(),
                   huge_page=_hostio.HUGE)
    control.init()
    control.init_devices([0])
    reg = pick_registrar(args, cfg.dry)
    if "register" not in skip:
        section_register(cfg, reg)
    f = None
    if not {"read", "chain"} <= skip:
        try:
            say("\nthe file:")
            f = TheFile(cfg)
        except Exception:  # noqa: BLE001
            fail("writing the file")
    read_gbps = float("nan")
    if f is not None:
        try:
            if "read" not in skip:
                read_gbps = section_read(cfg, f)
            if "chain" not in skip:
                section_chain(cfg, f, reg, read_gbps)
        except Exception:  # noqa: BLE001
            fail("files")
        finally:
            f.close()
    if benchlib.TARGETS:
        say("\ntargets:")
        for ln in benchlib.target_lines("   %s %.2f (%s %.2f): %s"):
            say(ln)
    RESULTS["targets"] = benchlib.targets_json()
    try:
        control.deinit()
    except Exception:  # noqa: BLE001
        fail("deinit")
    say("total run time %.1f s" % elapsed())
    RESULTS["run_s"] = elapsed()
    try:
        benchlib.write_json("bench_compat_cold.json", RESULTS)
    except Exception:  # noqa: BLE001
        fail("writing bench_compat_cold.json")
    return 1 if "errors" in RESULTS else 0


if __name__ == "__main__":
    sys.exit(main())
