"""Tests of the comfy_aimdo compatibility package (python/compat) on
vpager: the simulated device without a GPU (CI), CUDA with one.

    make && PYTHONPATH=python:python/compat python3 tests/python/test_compat.py
    make && PYTHONPATH=python:python/compat python3 -m pytest -q \
        tests/python/test_compat.py

Budgets are set through set_simple_vram_headroom (total - budget), so the
same tests run on either backend. Tests needing torch are skipped (counted
as passed, with a note) when torch cannot be imported.
"""

import array
import ctypes
import json
import os
import pkgutil
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python", "python/compat")
from _runner import raises  # noqa: E402,F401

from comfy_aimdo import control  # noqa: E402
from comfy_aimdo import host_buffer, model_mmap, model_vbar  # noqa: E402
from comfy_aimdo import malloc_graph, storage, vram_buffer  # noqa: E402

MiB = 1 << 20
PAGE = 32 * MiB
ENV = dict(os.environ,
           PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python", "compat"),
                                       os.path.join(REPO, "python")]))


def fresh(budget_pages=None):
    """deinit, init, device 0; with a budget of whole pages if given."""
    control.deinit()
    assert control.init() is True
    assert control.init_device(0) is True
    dev = control.get_devctx(0)
    if budget_pages is not None:
        total = dev.info()["total_memory"]
        control.set_simple_vram_headroom(total - budget_pages * PAGE)
    return dev


def tdevice(dev):
    return "cpu" if dev.backend == "sim" else "cuda:0"


def have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        print("     (torch not importable: skipped)")
        return False


def data_for(seed, size):
    block = random.Random(seed).randbytes(4099) \
        if hasattr(random.Random, "randbytes") else \
        bytes(random.Random(seed).getrandbits(8) for _ in range(4099))
    return (block * (size // 4099 + 1))[:size]


def run_py(code):
    r = subprocess.run([sys.executable, "-c", code], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


# ------------------------------------------------------ imports, no init

def test_control_does_not_import_torch():
    out = run_py("import sys, comfy_aimdo.control as c\n"
                 "print('torch' in sys.modules, c.lib)\n"
                 "import comfy_aimdo\n"
                 "print('torch' in sys.modules)\n")
    assert out.split() == ["False", "None", "False"], out


def test_every_submodule_imports_without_init():
    out = run_py(
        "import comfy_aimdo.control as c, comfy_aimdo.model_vbar as mv\n"
        "import comfy_aimdo.host_buffer, comfy_aimdo.vram_buffer\n"
        "import comfy_aimdo.model_mmap, comfy_aimdo.malloc_graph as mg\n"
        "import comfy_aimdo.storage as st\n"
        "try:\n import comfy_aimdo.torch\nexcept ImportError as e:\n"
        " assert 'torch' in str(e), e\n"
        "assert c.lib is None\n"
        "assert c.get_total_vram_usage() == 0\n"
        "assert mv.vbars_analyze() == 0 and mv.vbars_analyze(0) == 0\n"
        "assert c.analyze() is None\n"
        "assert c.init_devices([0]) is False\n"
        "assert c.init_device(0) is False\n"
        "mv.vbar_unpin(None)\n"
        "mv.vbars_reset_watermark_limits()\n"
        "c.set_log_info(); c.set_log_warning()\n"
        "assert st.fast_disk('/') is None\n"
        "g = mg.record(None); g.push('a'); assert g.pop() is False\n"
        "assert g.pop() is False; g.abort()\n"
        "assert c.get_simple_vram_headroom() == 0\n"
        "try:\n c.get_devctx(0)\nexcept RuntimeError:\n print('ok')\n")
    assert out.strip() == "ok", out


def _submodules():
    import comfy_aimdo
    return sorted(m.name for m in pkgutil.iter_modules(comfy_aimdo.__path__))


def test_each_submodule_imports_alone_without_torch():
    """Every comfy_aimdo submodule, each in a fresh interpreter: it imports
    before init() and imports neither torch nor vpager (comfy_aimdo.torch
    is the one that is about torch)."""
    names = _submodules()
    for new in ("malloc_graph", "storage", "control", "host_buffer",
                "model_vbar", "vram_buffer", "model_mmap"):
        assert new in names, names
    for name in names:
        if name == "torch":
            continue
        out = run_py(
            "import importlib, json, sys\n"
            "m = importlib.import_module('comfy_aimdo.%s')\n"
            "import comfy_aimdo.control as c\n"
            "print(json.dumps([m.__name__, 'torch' in sys.modules,\n"
            "                  'vpager' in sys.modules, c.lib is None]))\n"
            % name)
        assert json.loads(out) == ["comfy_aimdo." + name, False, False,
                                   True], (name, out)
    # The package itself imports every torch-free submodule, still no torch.
    out = run_py("import sys, comfy_aimdo\n"
                 "print(sorted(n for n in sys.modules\n"
                 "             if n.startswith('comfy_aimdo.')),\n"
                 "      'torch' in sys.modules)\n")
    for name in names:
        if name != "torch" and not name.startswith("_"):
            assert "comfy_aimdo." + name in out, (name, out)
    assert out.strip().endswith("False"), out


# -------------------------------------------------------------- storage

def test_storage_fast_disk_is_none_on_linux_and_never_raises():
    path = _tmpfile(b"x" * 100)
    try:
        for arg in (path, "/", "/nonexistent/model.safetensors", "", b"/",
                    os.path.dirname(path), None, 0, -1, 1 << 80, 1.5,
                    float("nan"), [], {}, object(), ("a", "b"), "\0bad",
                    "x" * 100000, type("P", (), {"__fspath__":
                                                  lambda self: 1 / 0})()):
            assert storage.fast_disk(arg) is None, arg
        assert storage.fast_disk() is None
        assert storage.fast_disk(path, 1, 2, key="v") is None
        rng = random.Random(12)
        for _ in range(200):
            junk = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 40)))
            assert storage.fast_disk(junk.decode("latin-1")) is None
            assert storage.fast_disk(junk) is None
    finally:
        os.unlink(path)


# -------------------------------------------------------------- control

def test_init_call_shapes():
    # A client tries both keywords, then only the headroom, then none.
    for kw in (dict(simple_vram_headroom=1 << 30, nvml_pressure=False),
               dict(simple_vram_headroom=1 << 30), dict()):
        control.deinit()
        assert control.lib is None
        assert control.init(**kw) is True
        assert control.lib is not None
        assert control.init_device(0) is True
        dev = control.get_devctx(0)
        total = dev.info()["total_memory"]
        if kw:
            assert dev.info()["budget"] <= total - (1 << 30)
    assert control.init(None, 2 << 30, False) is True       # positional
    # Again: only the settings change; the device stays.
    dev = control.get_devctx(0)
    assert control.init(simple_vram_headroom=0) is True
    assert control.get_devctx(0) is dev
    control.lib.set_simple_vram_headroom(3 << 30)
    assert dev.info()["budget"] <= dev.info()["total_memory"] - (3 << 30)
    raises(ValueError, control.set_simple_vram_headroom, -1)


def _reinit():
    control.deinit()
    assert control.init() is True


def test_init_devices_shapes():
    control.deinit()
    assert control.init_devices(i for i in [0]) is False   # before init
    _reinit()
    assert control.init_devices(i for i in [0]) is True    # a generator
    _reinit()
    assert control.init_devices([0]) is True                # bare indices
    _reinit()
    assert control.init_devices([(0, 64 * MiB)]) is True   # (index, extra)
    dev = control.get_devctx(0)
    base = control._default_headroom[0]
    assert dev.info()["headroom"] == base + 64 * MiB
    _reinit()
    assert control.init_devices(((0, 0) for _ in range(1))) is True
    assert control.get_devctx(0).info()["headroom"] == base
    _reinit()
    raises(ValueError, control.init_devices, [(0, -1)])
    raises(ValueError, control.init_device, 0, -5)
    assert control.init_device(-1) is False                  # unusable
    _reinit()
    assert control.init_devices([0, -1]) is False
    raises(RuntimeError, control.get_devctx, 7)


def test_init_devices_twice_warns_and_keeps_devices():
    _reinit()
    assert control.init_devices([(0, 64 * MiB)]) is True
    dev = control.get_devctx(0)
    base = control._default_headroom[0]
    vb = model_vbar.ModelVBAR(PAGE, 0)
    for again in ([0], [(0, 0)], ((0, 128 * MiB) for _ in range(1)), []):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert control.init_devices(again) is False
        assert [x.category for x in w] == [RuntimeWarning], w
        assert "init_devices" in str(w[0].message)
        # The devices stay as they are: same object, same headroom.
        assert control.get_devctx(0) is dev and not dev.closed
        assert dev.info()["headroom"] == base + 64 * MiB
        assert not vb.closed
    # Bad arguments are still refused as such, before the warning.
    raises(ValueError, control.init_devices, [(0, -1)])
    raises(ValueError, control.init_devices, [(0, 1, 2)])
    # init_device() still retunes one device; deinit() allows it again.
    assert control.init_device(0, 0) is True
    assert dev.info()["headroom"] == base
    control.deinit()
    assert control.init() is True
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert control.init_devices([0]) is True
    assert not w
    assert control.get_devctx(0) is not dev


def test_simple_vram_headroom_get_set_rules():
    control.deinit()
    assert control.get_simple_vram_headroom() == 0           # before init
    raises(RuntimeError, control.set_simple_vram_headroom, 1 << 30)
    # Out of range is a ValueError, before init too (checked first).
    for bad in (-1, -(1 << 70), (1 << 60) + 1, 1 << 64, float("inf"),
                float("-inf"), float("nan"), -0.5e9):
        raises(ValueError, control.set_simple_vram_headroom, bad)
    for bad in ("1", b"1", [], {}, object(), 1j):
        raises(TypeError, control.set_simple_vram_headroom, bad)
    raises(ValueError, control.init, simple_vram_headroom=(1 << 60) + 1)
    assert control.lib is None                # a refused init loads nothing
    assert control.init(simple_vram_headroom=3 << 30) is True
    assert control.get_simple_vram_headroom() == 3 << 30
    assert control.lib.get_simple_vram_headroom() == 3 << 30
    assert control.init_devices([0]) is True
    dev = control.get_devctx(0)
    total = dev.info()["total_memory"]
    for v in (0, 1, 512 * MiB, total, total + 1, 1 << 60, 2.0 * (1 << 30),
              True, None):
        control.set_simple_vram_headroom(v)
        want = 0 if v is None else int(v)
        assert control.get_simple_vram_headroom() == want, v
        assert type(control.get_simple_vram_headroom()) is int
        assert dev.info()["budget"] <= max(total - want, 0) or v is None
    control.lib.set_simple_vram_headroom(total)     # nothing may be held
    vb = model_vbar.ModelVBAR(PAGE, 0)
    assert model_vbar.vbar_fault(vb.alloc(10)) is None
    control.set_simple_vram_headroom(0)
    a = (vb, vb.base, 10)
    assert model_vbar.vbar_fault(a) is not None
    model_vbar.vbar_unpin(a)
    # Property: any int either sets exactly that or is a ValueError, and a
    # refused value leaves the last one in place.
    rng = random.Random(60)
    last = control.get_simple_vram_headroom()
    for _ in range(300):
        v = rng.choice([rng.randint(-(1 << 62), 1 << 62),
                        rng.randint(0, 1 << 61), rng.randint(0, total * 2)])
        if 0 <= v <= 1 << 60:
            control.set_simple_vram_headroom(v)
            last = v
        else:
            raises(ValueError, control.set_simple_vram_headroom, v)
        assert control.get_simple_vram_headroom() == last
    control.deinit()
    assert control.get_simple_vram_headroom() == 0
    raises(RuntimeError, control.set_simple_vram_headroom, 0)


def test_log_setters_and_analyze():
    for name in ("none", "critical", "error", "warning", "info", "detail",
                 "debug", "verbose", "vverbose"):
        getattr(control, "set_log_" + name)()
    control.set_log_warning()
    fresh()
    control.set_log_error()
    control.analyze()
    control.set_log_warning()


def test_total_usage_and_live_headroom():
    dev = fresh(budget_pages=3)
    assert control.get_total_vram_usage() == 0
    vb = model_vbar.ModelVBAR(8 * PAGE, 0)
    big = vb.alloc(4 * PAGE)
    assert model_vbar.vbar_fault(big) is None        # over the budget
    small = (vb, vb.base + 4 * PAGE, 3 * PAGE)
    sig = model_vbar.vbar_fault(small)
    assert sig is not None
    model_vbar.vbar_unpin(small)
    assert control.get_total_vram_usage() == 3 * PAGE
    # Live: a smaller budget holds at the next fault.
    total = dev.info()["total_memory"]
    control.set_simple_vram_headroom(total - PAGE)
    one = (vb, vb.base, 1000)
    assert model_vbar.vbar_fault(one) is not None
    assert control.get_total_vram_usage() <= PAGE
    model_vbar.vbar_unpin(one)
    control.set_simple_vram_headroom(None)
    assert model_vbar.vbar_fault(big) is not None
    model_vbar.vbar_unpin(big)


# ----------------------------------------------------------- model_vbar

def test_model_vbar_alloc_and_signature_length():
    fresh()
    vb = model_vbar.ModelVBAR(100 * MiB, 0)
    a = vb.alloc(1)
    b = vb.alloc(1000)
    c = vb.alloc(0)
    d = vb.alloc(40 * MiB)
    for x in (a, b, c, d):
        assert x[0] is vb and (x[1] - vb.base) % 512 == 0
    assert b[1] - a[1] == 512 and c[1] - b[1] == 1024 and d[2] == 40 * MiB
    raises(MemoryError, vb.alloc, 100 * MiB)
    assert vb.alloc(100 * MiB - (d[1] - vb.base) - 40 * MiB)
    raises(MemoryError, vb.alloc, 1)
    for x in (a, b, d):
        sig = model_vbar.vbar_fault(x)
        assert isinstance(sig, array.array) and sig.typecode == "I"
        assert len(sig) == x[2] // PAGE + 2
        model_vbar.vbar_unpin(x)
    assert len(model_vbar.vbar_fault(c)) == 2
    model_vbar.vbar_unpin(c)
    model_vbar.vbar_unpin(None)
    # A range straddling a page boundary: 2 pages, length rule still.
    s = (vb, vb.base + PAGE - 512, 1024)
    sig = model_vbar.vbar_fault(s)
    assert len(sig) == 2 and sig[0] and sig[1]
    model_vbar.vbar_unpin(s)
    raises(MemoryError, model_vbar.ModelVBAR, 1 << 62, 0)


def test_signature_compare_rules():
    fresh()
    vb = model_vbar.ModelVBAR(4 * PAGE, 0)
    a = vb.alloc(PAGE)
    s1 = model_vbar.vbar_fault(a)
    model_vbar.vbar_unpin(a)
    s2 = model_vbar.vbar_fault(a)
    model_vbar.vbar_unpin(a)
    assert model_vbar.vbar_signature_compare(s1, s2) is True
    assert model_vbar.vbar_signature_compare(None, s2) is False
    assert model_vbar.vbar_signature_compare(s1, None) is False
    raises(ValueError, model_vbar.vbar_signature_compare, s1,
           array.array("I", [0] * 5))
    assert vb.free_memory(PAGE) == PAGE
    assert model_vbar.vbar_fault(a) is None     # eviction lowered the mark
    vb.prioritize()
    s3 = model_vbar.vbar_fault(a)
    model_vbar.vbar_unpin(a)
    assert model_vbar.vbar_signature_compare(s1, s3) is False


def test_model_vbar_methods():
    dev = fresh()
    vb = model_vbar.ModelVBAR(6 * PAGE, 0)
    assert vb.get_nr_pages() == 6 and vb.get_watermark() == 6
    a = vb.alloc(6 * PAGE)
    assert vb.fault(a[1], 2 * PAGE) is not None
    assert vb.get_residency()[:3] == [3, 3, 0]
    vb.unpin(a[1], 2 * PAGE)
    assert vb.get_residency()[:3] == [1, 1, 0]
    assert vb.loaded_size() == 2 * PAGE
    assert model_vbar.vbars_analyze() == 2 * PAGE
    assert model_vbar.vbars_analyze(0) == 2 * PAGE
    vb.set_watermark(PAGE)
    assert vb.get_watermark() == 1
    assert vb.fault(a[1] + 3 * PAGE, 10) is None      # above the watermark
    vb.prioritize()
    assert vb.get_watermark() == 6
    vb.set_watermark_limit(2 * PAGE)
    assert vb.fault(a[1] + 3 * PAGE, 10) is None      # above the limit
    model_vbar.vbars_reset_watermark_limits()
    sig = vb.fault(a[1] + 3 * PAGE, 10)
    assert sig is not None
    vb.unpin(a[1] + 3 * PAGE, 10)
    vb.deprioritize()
    assert vb.free_memory(PAGE) >= PAGE
    assert vb.loaded_size() < 3 * PAGE
    assert dev.info()["committed"] == vb.loaded_size()


def test_fault_spans_allocations_pins_counted():
    dev = fresh()
    vb = model_vbar.ModelVBAR(4 * PAGE, 0)
    mods = [vb.alloc(10 * MiB) for _ in range(5)]
    block = (vb, mods[0][1], mods[-1][1] + mods[-1][2] - mods[0][1])
    bsig = model_vbar.vbar_fault(block)
    assert bsig is not None and len(bsig) == block[2] // PAGE + 2
    sigs = [model_vbar.vbar_fault(m) for m in mods]
    assert all(s is not None for s in sigs)
    for m in mods:
        model_vbar.vbar_unpin(m)
    assert all(f & 2 for f in vb.get_residency()[:2])      # block pin left
    model_vbar.vbar_unpin(block)
    assert not any(f & 2 for f in vb.get_residency())
    raises(RuntimeError, model_vbar.vbar_unpin, mods[0])   # not pinned


class _Weight:
    def __init__(self, model, alloc, data):
        self.model, self.alloc, self.data = model, alloc, data
        self.sig = None
        self.fills = None       # the oracle's fill counts at the last copy


def _pages(w):
    off = w.alloc[1] - w.model.base
    return range(off // PAGE, (off + w.alloc[2] - 1) // PAGE + 1)


def test_comfy_per_weight_cycle_two_models():
    """ComfyUI's cycle: fault, compare the signature, copy when it differs,
    use, unpin; model A is bigger than the budget, B alternates with it
    (prioritize). Data must be right, and signatures must differ exactly
    when a page of the weight was committed again since its copy (the
    oracle: residency before and after each fault)."""
    dev = fresh(budget_pages=5)
    rng = random.Random(7)
    models = {}
    weights = {}
    seed = 0
    for name, npages in (("A", 7), ("B", 3)):
        vb = model_vbar.ModelVBAR(npages * PAGE, 0)
        ws = []
        while True:
            n = rng.choice([512 + 3, 1 * MiB, 5 * MiB + 7, 12 * MiB,
                            30 * MiB])
            try:
                a = vb.alloc(n)
            except MemoryError:
                break
            seed += 1
            ws.append(_Weight(vb, a, data_for(seed, n)))
        models[name], weights[name] = vb, ws
    fills = {name: [0] * vb.get_nr_pages() for name, vb in models.items()}
    counts = dict(reuse=0, copy=0, miss=0)
    for rnd in range(6):
        for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
            vb = models[name]
            vb.prioritize()
            for w in weights[name]:
                before = vb.get_residency()
                sig = model_vbar.vbar_fault(w.alloc)
                after = vb.get_residency()
                for p, (b, a) in enumerate(zip(before, after)):
                    if not b & 1 and a & 1:
                        fills[name][p] += 1
                if sig is None:
                    counts["miss"] += 1      # ComfyUI uses the host copy
                    w.sig = None
                    continue
                now = [fills[name][p] for p in _pages(w)]
                same = model_vbar.vbar_signature_compare(sig, w.sig)
                if w.sig is not None:
                    assert same == (now == w.fills), (name, rnd, now,
                                                      w.fills)
                if same:
                    counts["reuse"] += 1
                else:
                    dev.copy_to_device(w.alloc[1], w.data)
                    dev.synchronize()
                    w.sig, w.fills = sig, now
                    counts["copy"] += 1
                # Use: the bytes must be the weight's.
                got = dev.read(w.alloc[1], w.alloc[2])
                assert got == w.data, (name, rnd, w.alloc[2])
                model_vbar.vbar_unpin(w.alloc)
                assert control.get_total_vram_usage() <= 5 * PAGE
    print("     cycle: %s" % counts)
    assert counts["reuse"] > 0 and counts["copy"] > 0, counts
    assert counts["miss"] > 0, counts      # A cannot fit: some weights miss
    # Dropping the cap lets everything in.
    control.set_simple_vram_headroom(None)
    for name in ("A", "B"):
        models[name].prioritize()
        for w in weights[name]:
            assert model_vbar.vbar_fault(w.alloc) is not None
            model_vbar.vbar_unpin(w.alloc)


def test_broken_device_raises_runtime_error():
    dev = fresh()
    if dev.backend != "sim":
        return
    vb = model_vbar.ModelVBAR(2 * PAGE, 0)
    a = vb.alloc(PAGE)
    import vpager
    dev.sim_inject(vpager.SIM_BREAK)
    raises(RuntimeError, model_vbar.vbar_fault, a)
    control.deinit()


# ---------------------------------------------------------- vram_buffer

def test_vram_buffer_cheap_and_commit_on_demand():
    dev = fresh()
    t0 = time.perf_counter()
    for _ in range(200):
        vram_buffer.VRAMBuffer(16 << 30, 0).close()
    per = (time.perf_counter() - t0) / 200
    print("    %.1f us per 16 GiB VRAMBuffer" % (per * 1e6))
    # Creating one reserves address space only: nothing is committed.
    assert control.get_total_vram_usage() == 0
    vbuf = vram_buffer.VRAMBuffer(16 << 30, 0)
    assert vbuf.size() == 0
    buf, addr, size = vbuf.get(40 * MiB)
    assert buf is vbuf and addr == vbuf.base and size == 40 * MiB
    assert vbuf.size() == 2 * PAGE
    assert control.get_total_vram_usage() == 2 * PAGE
    _, addr2, _ = vbuf.get(10 * MiB, offset=60 * MiB)   # pages 1 and 2
    assert addr2 == vbuf.base + 60 * MiB and vbuf.size() == 3 * PAGE
    dev.copy_to_device(addr2, b"x" * 100)
    dev.synchronize()
    assert dev.read(addr2, 100) == b"x" * 100
    vbuf.get(40 * MiB)                      # again: nothing more pinned
    assert vbuf.size() == 3 * PAGE
    raises(MemoryError, vbuf.get, 1, 16 << 30)
    del buf
    vbuf.close()
    assert control.get_total_vram_usage() == 0
    # It takes memory from model weights under a budget.
    control.set_simple_vram_headroom(dev.info()["total_memory"] - 3 * PAGE)
    vb = model_vbar.ModelVBAR(3 * PAGE, 0)
    a = vb.alloc(3 * PAGE)
    assert model_vbar.vbar_fault(a) is not None
    model_vbar.vbar_unpin(a)
    v = vram_buffer.VRAMBuffer(1 << 30, 0)
    v.get(2 * PAGE)
    assert vb.loaded_size() == PAGE
    raises(MemoryError, v.get, 4 * PAGE)
    del v
    assert control.get_total_vram_usage() == vb.loaded_size() <= PAGE


# -------------------------------------------------------- malloc_graph

class _FakeStream:
    """A stand-in for a torch stream on a machine without CUDA."""

    def __init__(self, name="s", cuda=False):
        self.name, self.fake_cuda = name, cuda
        self.device = types.SimpleNamespace(type="cuda" if cuda else "cpu",
                                            index=0 if cuda else None)

    def __repr__(self):
        return "<stream %s>" % self.name


def _fresh_thread_graph():
    """No active graph on this thread (a test before may have left one)."""
    g = malloc_graph.active_graph()
    if g is not None:
        g.abort()


def test_malloc_graph_interface_pass_through():
    _fresh_thread_graph()
    raises(RuntimeError, malloc_graph.MallocGraph)
    g = malloc_graph.record(None)
    assert isinstance(g, malloc_graph.MallocGraph)
    for attr in ("peak_used", "virtual_bytes", "physical_bytes",
                 "rogue_count"):
        assert type(getattr(g, attr)) is int and getattr(g, attr) == 0
    assert g.depth == 1 and g.active and malloc_graph.active_graph() is g
    # One graph per thread.
    e = raises(RuntimeError, malloc_graph.record, None)
    assert "one per thread" in str(e)
    # Scopes: push/pop nest; iterate replaces its own scope; pop closes
    # what iterate left open inside the pushed scope.
    g.push()
    g.push("blocks")
    assert g.depth == 3
    assert g.iterate("block") is False and g.depth == 4
    assert g.iterate("block") is False and g.depth == 4
    assert g.iterate(None) is False and g.depth == 3
    assert g.iterate(None) is False and g.depth == 3    # nothing to close
    assert g.iterate("x") is False and g.depth == 4
    assert g.pop() is False and g.depth == 2             # x and "blocks"
    assert g.pop() is False and g.pop() is False and g.depth == 0
    e = raises(RuntimeError, g.pop)
    assert "pop without" in str(e)
    raises(RuntimeError, g.iterate, "block")             # no scope open
    g.push()                                             # a graph reopens
    assert g.depth == 1
    # pause/resume nest; resume without pause is an error.
    raises(RuntimeError, g.resume)
    g.pause()
    g.pause(sync=True)
    g.resume(sync=True)
    g.resume()
    raises(RuntimeError, g.resume, sync=True)
    # use_stream follows a stream and restores the previous one.
    s1, s2 = _FakeStream("1"), _FakeStream("2")
    with g.use_stream(s1) as same:
        assert same is g and g.stream is s1
        with g.use_stream(s2):
            assert g.stream is s2
        assert g.stream is s1
    assert g.stream is None
    try:
        with g.use_stream(s1):
            raise KeyError("inside")
    except KeyError:
        pass
    assert g.stream is None
    # Bad arguments.
    for bad in ("s", 3, 2.5, b"x", True, [], object()):
        raises(RuntimeError, g.use_stream, bad)
        raises(RuntimeError, malloc_graph.record, bad)
    for bad in (3, b"x", [], object(), 1.5):
        raises(RuntimeError, g.push, bad)
        raises(RuntimeError, g.iterate, bad)
    assert g.depth == 1
    # Clients hang their own state on it (ComfyUI does).
    g._comfy_active = True
    g._comfy_cuda_graph_modules = set()
    for attr in ("peak_used", "rogue_count", "virtual_bytes"):
        try:
            setattr(g, attr, 5)
        except AttributeError:
            pass
        else:
            raise AssertionError("%s is writable" % attr)
    # Another thread: its own graph; this thread's graph refuses its calls.
    seen = []

    def other():
        try:
            h = malloc_graph.record(_FakeStream("t"))
            h.push("a")
            h.pop()
            seen.append(h.pop())
            try:
                g.push()
            except RuntimeError as e:
                seen.append("refused: %s" % e)
            h.abort()
        except Exception as e:      # reported below
            seen.append(e)
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen[0] is False and "from thread" in seen[1], seen
    # abort: the end; attributes stay; every other call refuses; a second
    # abort is a no-op; the thread may record again.
    with g.use_stream(s1):
        g.abort()                       # inside a block: exit is quiet
    assert not g.active and g.depth == 0 and g.rogue_count == 0
    assert g.peak_used == 0 and g.physical_bytes == 0
    g.abort()
    for call in (g.push, g.pop, g.iterate, g.pause, g.resume,
                 lambda: g.use_stream(None), lambda: g.iterate("b")):
        e = raises(RuntimeError, call)
        assert "abort" in str(e), e
    assert malloc_graph.active_graph() is None
    g2 = malloc_graph.record(None, assert_graph_breaks=True)
    assert g2.assert_graph_breaks is True and g2 is not g
    # A dropped graph frees the thread, also from inside a reference cycle.
    del g2
    g3 = malloc_graph.record(None)
    g3.cycle = g3
    del g3
    g4 = malloc_graph.record(None)          # gc.collect() found the cycle
    g4.abort()
    assert "aborted" in repr(g4)


def test_malloc_graph_random_calls_against_a_model():
    """Property: random calls (with random and garbage arguments) on one
    graph either succeed or raise RuntimeError exactly when the rules say;
    nothing else is ever raised, and the depth follows the model."""
    import contextlib
    rng = random.Random(35)
    names = [None, "block", "a", "b", "", 7, b"n", [], 1.5]
    streams = [None, _FakeStream("x"), _FakeStream("y"), "junk", 5, object()]
    for trial in range(30):
        _fresh_thread_graph()
        first = rng.choice(streams[:3])
        g = malloc_graph.record(first)
        frames, paused, aborted = ["push"], 0, False
        with contextlib.ExitStack() as stack:
            opened = []             # use_stream blocks entered, innermost last
            for step in range(120):
                op = rng.choice(["push", "pop", "iterate", "pause", "resume",
                                 "enter", "exit", "abort", "record",
                                 "attrs"] + ["iterate", "push", "pop"] * 2)
                name = rng.choice(names)
                stream = rng.choice(streams)
                good_name = name is None or isinstance(name, str)
                good_stream = stream is None or isinstance(stream,
                                                           _FakeStream)
                if op == "push":
                    err = aborted or not good_name
                    call = lambda: g.push(name)
                elif op == "pop":
                    err = aborted or "push" not in frames
                    call = g.pop
                elif op == "iterate":
                    err = aborted or not good_name or not frames
                    call = lambda: g.iterate(name)
                elif op == "pause":
                    err = aborted
                    call = lambda: g.pause(sync=rng.random() < 0.5)
                elif op == "resume":
                    err = aborted or paused == 0
                    call = lambda: g.resume(sync=rng.random() < 0.5)
                elif op == "enter":
                    err = aborted or not good_stream
                    call = lambda: (stack.enter_context(g.use_stream(stream)),
                                    opened.append(stream))
                elif op == "exit":
                    err = False             # every open block, innermost first
                    call = stack.close
                elif op == "abort":
                    err = False
                    call = g.abort
                elif op == "record":
                    err = not aborted
                    call = lambda: malloc_graph.record(None).abort()
                else:
                    assert (g.peak_used, g.virtual_bytes, g.physical_bytes,
                            g.rogue_count) == (0, 0, 0, 0)
                    continue
                if call is not None:
                    try:
                        r = call()
                    except RuntimeError:
                        assert err, (trial, step, op, name, stream)
                        continue
                    assert not err, (trial, step, op, name, stream)
                    if op in ("pop", "iterate"):
                        assert r is False
                if op == "push":
                    frames.append("push")
                elif op == "pop":
                    i = len(frames) - 1 - frames[::-1].index("push")
                    del frames[i:]
                elif op == "iterate":
                    if frames[-1] == "iter":
                        frames.pop()
                    if name is not None:
                        frames.append("iter")
                elif op == "pause":
                    paused += 1
                elif op == "resume":
                    paused -= 1
                elif op == "abort":
                    aborted, frames, paused = True, [], 0
                elif op == "exit":
                    opened.clear()
                elif op == "record":
                    # The thread was free: record() made a graph and it was
                    # aborted at once. g stays aborted.
                    pass
                assert g.depth == len(frames), (trial, step, op)
                assert g.active is not aborted
                if not aborted:
                    assert g.stream is (opened[-1] if opened else first)
        g.abort()


def test_malloc_graph_peak_used_from_torch_stats():
    """peak_used, with torch's allocator statistics played by a fake: the
    most the device held inside the graph's scopes (exact when that was a
    new peak, else what the scope boundaries saw); paused time and time
    outside every scope do not count; torch's counters are never reset."""
    class Alloc:
        cur = peak = 0

        def take(self, n):
            self.cur += n
            self.peak = max(self.peak, self.cur)

        def give(self, n):
            self.cur -= n
    gpu = Alloc()
    calls = []

    def stats(index):
        calls.append(index)
        return None if index is None else (gpu.cur, gpu.peak)
    saved = malloc_graph._stats, malloc_graph._cuda_index
    malloc_graph._stats = stats
    malloc_graph._cuda_index = lambda s: 0 if getattr(s, "fake_cuda",
                                                      False) else None
    _fresh_thread_graph()
    try:
        cuda = _FakeStream("cuda", cuda=True)
        gpu.take(100)
        gpu.give(100)                       # a peak of 100 before the graph
        g = malloc_graph.record(cuda)
        gpu.take(30)
        gpu.give(30)                        # under the old peak: unseen
        assert g.pop() is False
        assert g.peak_used == 0
        g.push()
        gpu.take(150)
        gpu.give(150)                       # a new peak, inside: exact
        g.pop()
        assert g.peak_used == 150
        g.push()
        g.pause(sync=True)
        gpu.take(500)
        gpu.give(500)                       # paused: not the graph's
        g.resume(sync=True)
        g.pop()
        assert g.peak_used == 150
        gpu.take(1000)
        gpu.give(1000)                      # outside every scope
        g.push()
        assert g.peak_used == 150
        gpu.take(200)
        assert g.peak_used == 200           # read while inside: sampled
        with g.use_stream(_FakeStream("cpu")):
            gpu.take(5000)                  # another device's stream
            gpu.give(5000)
        gpu.take(50)
        assert g.peak_used == 250
        gpu.give(250)
        g.iterate("block")
        g.iterate(None)
        g.pop()
        assert g.peak_used == 250 and gpu.peak == 5200
        assert all(i in (0, None) for i in calls)
        g.abort()
        assert g.peak_used == 250                   # readable after abort
        # CPU and None streams: 0, and torch is not consulted.
        calls.clear()
        h = malloc_graph.record(None)
        gpu.take(1 << 20)
        h.pop()
        assert h.peak_used == 0 and set(calls) <= {None}
        h.abort()
    finally:
        malloc_graph._stats, malloc_graph._cuda_index = saved


class _ComfyPrefetch:
    """Drives comfy_aimdo.malloc_graph with the call sequence of ComfyUI's
    comfy/model_prefetch.py (>= 0.35; read from its public source, written
    anew here): one graph per thread kept in a dict; a model forward is a
    scope (record the first time, push after; pop at its end, counting a
    break when pop says True, dropping the graph when pop raises); each
    transformer block iterate()s a named scope, or None when a captured
    CUDA graph of the block is replayed instead; a block being captured
    pauses around creating the capture, then pause(sync=True), use_stream
    (capture stream) with resume()/core/pause() inside, resume(sync=True);
    a warm-up block runs under use_stream(capture stream); BLAS workspaces
    are made under pause()/resume() once; at the end of every node the
    graph is aborted if a scope is open, and its rogue_count summed."""

    def __init__(self, stream, capture_stream):
        self.graphs = {}
        self.breaks = self.rogues = 0
        self.used = False
        self.stream, self.capture = stream, capture_stream
        self.blas_ready = False
        self.log = []

    def _graph(self):
        return self.graphs.get(threading.get_ident())

    # model_prefetch's malloc_graph_begin / _end / cleanup_malloc_graph
    def begin(self):
        g = self._graph()
        if g is None:
            g = malloc_graph.record(self.stream, False)
            g._comfy_cuda_graph_modules = set()
            self.graphs[threading.get_ident()] = g
        else:
            g.push()
        g._comfy_active = True
        self.used = True

    def end(self):
        g = self._graph()
        if g is not None and g._comfy_active:
            try:
                broken = g.pop()
            except Exception:
                self.graphs.pop(threading.get_ident(), None)
                g._comfy_active = False
                raise
            g._comfy_active = False
            if broken:
                self.breaks += 1

    def cleanup(self):
        g = self.graphs.pop(threading.get_ident(), None)
        if g is not None:
            if g._comfy_active:
                g._comfy_active = False
                try:
                    g.abort()
                except Exception as e:
                    self.log.append("abort failed: %s" % e)
            g._comfy_cuda_graph_modules.clear()
            self.rogues += g.rogue_count

    def paused(self, sync=False):
        """_PauseMallocGraph: pause/resume only while a scope is active."""
        import contextlib

        @contextlib.contextmanager
        def cm():
            g = self._graph()
            if g is not None and g._comfy_active:
                g.pause(sync=sync)
            try:
                yield
            finally:
                g = self._graph()
                if g is not None and g._comfy_active:
                    g.resume(sync=sync)
        return cm()

    def block(self, blk, core, use_graphs):
        """prefetch_queue_pop for one block (malloc_scope="block")."""
        g = self._graph()
        if g is not None and not g._comfy_active:
            g = None
        enable = use_graphs and g is not None
        if enable and not self.blas_ready:
            g.pause()
            core(workspace=True)
            g.resume()
            self.blas_ready = True
        hit = False
        sig = None
        if enable and blk.captured is not None:
            sig = model_vbar.vbar_fault(blk.span)
            if sig is not None:
                blk.span_faulted = True
                hit = model_vbar.vbar_signature_compare(sig, blk.captured)
        if g is not None:
            if g.iterate(None if hit else "block"):
                self.breaks += 1
        if hit:
            blk.replays += 1
            return
        if enable and blk.warm:
            if sig is None:
                sig = model_vbar.vbar_fault(blk.span)
                blk.span_faulted = sig is not None
            if sig is not None:
                g.pause()
                g.resume()                      # the CUDAGraph object
                g.pause(sync=True)
                with g.use_stream(self.capture):
                    g.resume()
                    with self.paused():         # comfy-kitchen's context
                        pass
                    core()
                    g.pause()
                g.resume(sync=True)
                blk.captured = sig
                blk.captures += 1
                g._comfy_cuda_graph_modules.add(blk)
                return
        if enable:
            with g.use_stream(self.capture):
                core()
            blk.warm = True
        else:
            core()

    def forward(self, blocks, core, use_graphs, fail_at=None):
        """A model forward: the scope, the blocks, iterate(None) after."""
        self.begin()
        try:
            for i, blk in enumerate(blocks):
                if i == fail_at:
                    raise ValueError("a node failed in block %d" % i)
                self.block(blk, lambda workspace=False, b=blk:
                           None if workspace else core(b), use_graphs)
            g = self._graph()
            if g is not None and g._comfy_active:
                if g.iterate(None):
                    self.breaks += 1
        except BaseException:
            self.cleanup()
            raise
        self.end()
        self.release(blocks)

    @staticmethod
    def release(blocks):
        """cleanup_prefetched_modules: unpin the block spans faulted."""
        for blk in blocks:
            if blk.span_faulted:
                model_vbar.vbar_unpin(blk.span)
                blk.span_faulted = False


class _Block:
    def __init__(self, allocs):
        self.allocs = allocs
        v = allocs[0]
        for a in allocs[1:]:        # ComfyUI's _v_block rule
            v = (v[0], v[1], max(v[2], a[1] + a[2] - v[1]))
        self.span = v
        self.captured = None
        self.warm = False
        self.span_faulted = False
        self.captures = self.replays = 0


def _comfy_model(vb, rng, nblocks=6):
    """ComfyUI's layout in a VBAR: tiny modules first, then the blocks'
    weights largest first, 512-byte aligned; a block is adjacent ones."""
    for _ in range(12):
        vb.alloc(rng.choice([256, 1024, 4096]))
    sizes = sorted((rng.randint(1, 24) * MiB + rng.randint(0, 4096)
                    for _ in range(nblocks * 3)), reverse=True)
    allocs = [vb.alloc(n) for n in sizes]
    return [_Block(allocs[i:i + 3]) for i in range(0, len(allocs), 3)]


def test_malloc_graph_driven_as_model_prefetch_does():
    dev = fresh(budget_pages=8)
    rng = random.Random(38)
    vb = model_vbar.ModelVBAR(16 * PAGE, 0)
    blocks = _comfy_model(vb, rng)
    used = []

    def core(blk):
        for a in blk.allocs:                    # the per-weight cycle
            s = model_vbar.vbar_fault(a)
            if s is not None:
                model_vbar.vbar_unpin(a)
        used.append(blk)

    def node(driver, steps, use_graphs, fail_at=None, model=None):
        try:
            for step in range(steps):
                driver.forward(model or blocks, core, use_graphs,
                               fail_at if step == steps - 1 else None)
        finally:
            driver.cleanup()                    # every node's end
            driver.release(model or blocks)
    d = _ComfyPrefetch(_FakeStream("main"), _FakeStream("capture"))
    _fresh_thread_graph()
    for use_graphs in (False, True, True):
        node(d, 4, use_graphs)
        assert d.graphs == {} and malloc_graph.active_graph() is None
    assert d.breaks == 0 and d.rogues == 0 and d.log == []
    assert sum(b.captures for b in blocks) >= len(blocks)
    assert sum(b.replays for b in blocks) > 0
    assert len(used) == 12 * len(blocks) - sum(b.replays for b in blocks)
    # A node that raises in the middle of a forward: the scope's exit runs
    # cleanup, which aborts the open graph; the next node records anew.
    try:
        node(d, 3, True, fail_at=2)
    except ValueError:
        pass
    else:
        raise AssertionError("the failing node did not fail")
    assert d.graphs == {} and d.log == [] and d.rogues == 0
    node(d, 2, True)
    assert d.breaks == 0
    # pop() raising: the client drops the graph without abort(); the next
    # record() on the thread must work (the dropped graph frees it).
    d.begin()
    g = d._graph()
    g.pop()                                   # a misbehaving extra pop
    try:
        d.end()
    except RuntimeError:
        pass
    else:
        raise AssertionError("pop without a scope did not raise")
    del g
    assert d.graphs == {}
    node(d, 1, True)
    # Two threads at once, each with its own graph and model.
    errs = []
    models = [_comfy_model(model_vbar.ModelVBAR(16 * PAGE, 0),
                           random.Random(i), 3) for i in range(2)]

    def worker(seed):
        try:
            w = _ComfyPrefetch(_FakeStream("main%d" % seed),
                               _FakeStream("cap%d" % seed))
            for _ in range(3):
                node(w, 2, seed % 2 == 0, model=models[seed])
            assert w.breaks == 0 and w.rogues == 0 and w.log == []
        except Exception as e:
            errs.append(e)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errs == [], errs
    for blk in blocks:
        assert not blk.span_faulted
    assert not any(f & 2 for f in vb.get_residency())     # nothing pinned
    assert dev.info()["committed"] <= 8 * PAGE


# ---------------------------------------------------------- host_buffer

def _tmpfile(data):
    f = tempfile.NamedTemporaryFile(delete=False)
    f.write(data)
    f.close()
    return f.name


def test_host_buffer_empty_is_cheap():
    control.deinit()
    t0 = time.perf_counter()
    for _ in range(1000):
        hb = host_buffer.HostBuffer(0, 0, 0)
        assert hb.size == 0
        del hb
    print("    %.1f us per HostBuffer(0, 0, 0)"
          % ((time.perf_counter() - t0) / 1000 * 1e6))


def test_host_buffer_extend_truncate_register():
    fresh()
    hb = host_buffer.HostBuffer(0, 0, 0)
    p0 = hb.extend(10 * MiB)
    base = hb.get_raw_address()
    assert p0 == base and hb.size == 10 * MiB
    ctypes.memset(p0, 7, 10 * MiB)
    p1 = hb.extend(5000, register=False)
    assert p1 == base + 10 * MiB and hb.size == 10 * MiB + 5000
    assert hb.get_raw_address() == base                  # address-stable
    assert ctypes.string_at(p1, 5000) == bytes(5000)     # zeroed
    assert p1 % 512 == 0
    hb.register(10 * MiB, 5000)
    raises(ValueError, hb.register, 10 * MiB, 5000)
    hb.unregister(10 * MiB)
    hb.unregister(12345)                                  # unknown: no-op
    hb.truncate(4 * MiB)
    assert hb.size == 4 * MiB and hb.get_raw_address() == base
    assert ctypes.string_at(base + 4 * MiB - 3, 3) == b"\x07" * 3
    p2 = hb.extend(MiB)
    assert p2 == base + 4 * MiB
    assert ctypes.string_at(p2, 16) == bytes(16)          # fresh memory
    raises(ValueError, hb.truncate, 100 * MiB)
    # Initial size and prewarm.
    hb2 = host_buffer.HostBuffer(3 * MiB, prewarm=MiB, max_grow_size=8 * MiB)
    assert hb2.size == 3 * MiB and hb2.get_raw_address()
    hb2.close()
    hb.close()


def test_host_buffer_read_file_slice_and_to_device():
    dev = fresh()
    data = data_for(99, 3 * MiB + 123)
    path = _tmpfile(data)
    try:
        hb = host_buffer.HostBuffer(0, 0, 0)
        hb.extend(4 * MiB)
        with open(path, "rb") as f:
            hb.read_file_slice(f, 1000, 5000, offset=77)    # file object
        assert ctypes.string_at(hb.get_raw_address() + 77, 5000) == \
            data[1000:6000]
        fd = os.open(path, os.O_RDONLY)
        try:
            vb = model_vbar.ModelVBAR(2 * PAGE, 0)
            a = vb.alloc(2 * MiB)
            assert model_vbar.vbar_fault(a) is not None
            hb.read_file_slice(fd, 4096, 2 * MiB, offset=0, stream=0,
                               device_ptr=a[1], device=0)
            dev.synchronize()
            assert dev.read(a[1], 2 * MiB) == data[4096:4096 + 2 * MiB]
            b = vb.alloc(3 * MiB)
            assert model_vbar.vbar_fault(b) is not None
            hb.read_file_to_device(fd, 123, 3 * MiB, 0, b[1], 0)
            dev.synchronize()
            assert dev.read(b[1], 3 * MiB) == data[123:123 + 3 * MiB]
            hb.read_file_to_device(fd, 0, 1000, 0, b[1], -1, mark_cold=False)
            dev.synchronize()
            assert dev.read(b[1], 1000) == data[:1000]
            raises(OSError, hb.read_file_slice, fd, len(data) - 10, 100)
            raises(ValueError, hb.read_file_slice, fd, 0, 5 * MiB)
            model_vbar.vbar_unpin(a)
            model_vbar.vbar_unpin(b)
            hb.cleanup_file_reader()
        finally:
            os.close(fd)
    finally:
        os.unlink(path)


class _FakeCudart:
    """The registrations a CUDA driver keeps, as ComfyUI reaches them
    through torch.cuda.cudart(): ranges that may not overlap, unregistered
    by their start address (713: not registered). The memory must be
    mapped read-write to be registered (checked by writing a byte)."""

    def __init__(self):
        self.regs = {}                  # start -> size
        self.by = []                    # (who, ptr, rc) of every unregister

    def cudaHostRegister(self, ptr, size, flags):
        for s, n in self.regs.items():
            if ptr < s + n and s < ptr + size:
                return 712              # already registered
        b = ctypes.c_ubyte.from_address(ptr)
        b.value = b.value               # faults if not mapped read-write
        self.regs[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr, who="client"):
        rc = 0 if self.regs.pop(ptr, None) is not None else 713
        self.by.append((who, ptr, rc))
        return rc

    def bad(self):
        return [x for x in self.by if x[2] != 0]


class _Pins:
    """ComfyUI >= 0.38's pins over one HostBuffer (comfy/pinned_memory.py
    and ModelPatcherDynamic, read from the public source and written anew
    here): pin = extend(register=False) + cudaHostRegister of the new part;
    a refused registration truncates it back (do_unregister=False);
    unregister_inactive = cudaHostUnregister by the client, the buffer
    left mapped; unload = pop pins, truncate(offset,
    do_unregister=registered)."""

    def __init__(self, hb, cudart):
        self.hb, self.cu = hb, cudart
        self.stack = []                 # [offset, size, registered]
        self.split = -1

    def pin(self, size):
        off = self.hb.size
        ptr = self.hb.extend(size=size, register=False)
        assert ptr == self.hb.get_raw_address() + off
        if self.cu.cudaHostRegister(ptr, size, 1) != 0:
            self.hb.truncate(off, do_unregister=False)
            return False
        self.stack.append([off, size, True])
        self.split = max(self.split, len(self.stack) - 1)
        return True

    def unregister_inactive(self, n):
        while self.split >= 0 and n > 0:
            pin = self.stack[self.split]
            self.split -= 1
            if not pin[2]:
                continue
            base = self.hb.get_raw_address()
            assert self.cu.cudaHostUnregister(base + pin[0]) == 0
            pin[2] = False
            n -= 1

    def unload(self, n):
        while self.stack and n > 0:
            off, size, registered = self.stack.pop()
            self.hb.truncate(off, do_unregister=registered)
            self.split = min(self.split, len(self.stack) - 1)
            n -= 1

    def check(self):
        """Every live registration lies inside the buffer, at a pin the
        client holds registered."""
        base, size = self.hb.get_raw_address(), self.hb.size
        mine = {base + o: n for o, n, r in self.stack if r}
        inside = {p: n for p, n in self.cu.regs.items()
                  if base <= p < base + max(size, 1)}
        assert inside == mine, (inside, mine)
        for p, n in inside.items():
            assert p + n <= base + size


def _with_fake_cudart(fn):
    cu = _FakeCudart()
    saved = host_buffer._external_unregister
    host_buffer._external_unregister = \
        lambda ptr: cu.cudaHostUnregister(ptr, "buffer") == 0
    try:
        fn(cu)
    finally:
        host_buffer._external_unregister = saved


def test_host_buffer_comfy_038_six_per_model():
    fresh()
    t0 = time.perf_counter()
    # The placeholders made per model and device, then the real ones.
    holders = {k: host_buffer.HostBuffer(0, 0, 0) for k in (
        "weights", "patches", "weights-loaded", "patches-loaded",
        "weights-fast", "patches-fast")}
    for hb in holders.values():
        assert hb.size == 0 and hb.get_raw_address() == 0
    t1 = time.perf_counter()
    grow = 3 << 30
    bufs = {}
    for k in holders:
        warm = (64 if k.startswith("weights") else 8) * MiB
        bufs[k] = host_buffer.HostBuffer(0, warm, grow) if k.endswith("s") \
            else host_buffer.HostBuffer(0, prewarm=warm, max_grow_size=grow)
    t2 = time.perf_counter()
    print("    6 placeholders %.0f us; 6 prewarmed buffers %.1f ms"
          % ((t1 - t0) * 1e6, (t2 - t1) * 1e3))
    holders.clear()                                   # replaced, freed
    for k, hb in bufs.items():
        assert hb.size == 0 and hb.get_raw_address() != 0
        p = hb.extend(5 * MiB, register=False)        # on warm memory
        assert p == hb.get_raw_address()
        ctypes.memset(p, 1, 5 * MiB)
        assert hb.extend(1000, register=False) == p + 5 * MiB
        hb.truncate(0, do_unregister=False)
        assert hb.size == 0
    # Also accepted: max_grow_size 0 (pinning disabled), whole floats,
    # None for the optional sizes; refused: the rest.
    host_buffer.HostBuffer(0, 8 * MiB, 0).close()
    host_buffer.HostBuffer(0.0, float(MiB), None).close()
    host_buffer.HostBuffer(MiB, None, None, False).close()
    for args in ((-1,), (0, -1), (0, 0, -1), ("1",), (0, "x"), (0, 0, []),
                 (1.5,), (float("nan"),), (1 << 57,), (0, 1 << 70),
                 (0, 0, 1 << 64), (object(),)):
        try:
            host_buffer.HostBuffer(*args)
        except (TypeError, ValueError):
            continue
        raise AssertionError("HostBuffer%r was accepted" % (args,))
    for hb in bufs.values():
        hb.close()


def test_host_buffer_caller_registers_and_unregisters_parts():
    """ComfyUI >= 0.38 registers register=False parts itself and may
    unregister them itself, leaving the buffer mapped: the buffer must
    drop exactly the registrations still held when told to
    (truncate(do_unregister=True), close()), each once, never one the
    caller dropped, never its own; and new pins over truncated memory must
    register (no stale registration left)."""
    def run(cu):
        dev = fresh()
        rng = random.Random(238)
        bufs = [host_buffer.HostBuffer(0, rng.choice([8, 64]) * MiB,
                                       1 << 30) for _ in range(6)]
        pins = [_Pins(hb, cu) for hb in bufs]
        for step in range(400):
            p = rng.choice(pins)
            op = rng.random()
            if op < 0.5:
                assert p.pin(rng.choice([4096, 100000, MiB, 3 * MiB + 512]))
            elif op < 0.7:
                p.unregister_inactive(rng.randint(1, 3))
            else:
                p.unload(rng.randint(1, 4))
            p.check()
            assert cu.bad() == [], cu.bad()[:3]
        # The buffer's calls: one per registered pin it truncated, no more.
        mine = [x for x in cu.by if x[0] == "buffer"]
        assert mine and len(set(x[1] for x in mine)) >= 1
        # Unload everything: no registration left, none dropped twice.
        for p in pins:
            p.unload(1 << 30)
            p.check()
        assert cu.regs == {} and cu.bad() == []
        # close() with pins still registered drops each of them once.
        for p in pins[:3]:
            for _ in range(3):
                p.pin(MiB)
        pins[0].unregister_inactive(1)            # one the client dropped
        n_before = len(cu.by)
        for hb in bufs:
            hb.close()
        closing = cu.by[n_before:]
        assert cu.regs == {}, cu.regs
        assert all(who == "buffer" for who, _, _ in closing)
        assert len(closing) == len(set(p for _, p, _ in closing)) == 9
        # The one the client dropped answers "not registered": ignored.
        assert [rc for _, _, rc in closing].count(713) == 1
        for hb in bufs:
            hb.close()                            # twice: nothing more
        assert len(cu.by) == n_before + 9
        # The buffer's own registrations are vpager's, never the driver's:
        # a caller unregistering one behind its back leaves nothing to
        # double-free (vpager ignores the refused unregister), and the
        # buffer never sends it to the driver shim.
        hb = host_buffer.HostBuffer(0, 0, 0)
        own = hb.extend(2 * MiB)                  # register=True: vpager's
        assert dev.stats()["host_pinned_bytes"] == 2 * MiB
        ext = hb.extend(MiB, register=False)
        assert cu.cudaHostRegister(ext, MiB, 1) == 0
        n_before = len(cu.by)
        hb.truncate(MiB, do_unregister=True)
        assert cu.by[n_before:] == [("buffer", ext, 0)]  # the caller's one
        assert dev.stats()["host_pinned_bytes"] == 0
        hb.register(0, MiB)                       # the buffer's again
        hb.extend(MiB, register=False)
        hb.register(MiB, MiB)         # a part made the buffer's: not sent
        n_before = len(cu.by)
        hb.truncate(0, do_unregister=True)
        hb.close()
        assert cu.by[n_before:] == [] and cu.regs == {}
        assert dev.stats()["host_pinned_bytes"] == 0
        del own
    _with_fake_cudart(run)


def test_host_buffer_default_unregister_without_cuda():
    """Without CUDA the default driver call is never made (and the
    simulated device's memory needs no registration)."""
    fresh()
    hb = host_buffer.HostBuffer(0, 0, 0)
    p = hb.extend(MiB, register=False)
    if control._probe_cuda():
        hb.close()
        _runner.skip("this machine has CUDA")
    assert host_buffer._external_unregister(p) is False
    hb.truncate(0, do_unregister=True)
    hb.extend(MiB, register=False)
    hb.close()
    # Where a CUDA device is open, the default goes to vpager's
    # vp_host_unregister on the lowest-index one (played here by a fake
    # device): True is "dropped", False "was not registered"; a vpager
    # error is False too.
    calls = []
    answers = iter([True, False, control._vpager.Error(-1, "VP_EINVAL", "")])

    class FakeCudaDevice:
        backend, closed = "cuda", False

        def __init__(self, index):
            self.index = index

        def host_unregister(self, ptr):
            calls.append((ptr, self.index))
            a = next(answers)
            if isinstance(a, Exception):
                raise a
            return a
    sim = control.devices()
    saved = control.devices
    control.devices = lambda: {**sim, 3: FakeCudaDevice(3),
                               1: FakeCudaDevice(1)}
    try:
        assert host_buffer._external_unregister(4096) is True
        assert host_buffer._external_unregister(8192) is False
        assert host_buffer._external_unregister(12288) is False
    finally:
        control.devices = saved
    assert calls == [(4096, 1), (8192, 1), (12288, 1)], calls


# ----------------------------------------------- host_buffer: cold start

def _resident(addr, size):
    """Resident pages of those [addr, +size) touches (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pg = os.sysconf("SC_PAGE_SIZE")
    size += addr % pg
    addr -= addr % pg
    n = (size + pg - 1) // pg
    vec = (ctypes.c_ubyte * n)()
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size),
                        vec) == 0, os.strerror(ctypes.get_errno())
    return sum(v & 1 for v in vec)


def _vma_flags(addr):
    """The VmFlags of the mapping holding addr (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for ln in f:
            head = ln.split()
            if head and "-" in head[0] and not ln.startswith("VmFlags"):
                try:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    inside = lo <= addr < hi
                    continue
                except ValueError:
                    pass
            if inside and ln.startswith("VmFlags:"):
                return ln.split()[1:]
    return None


def test_host_buffer_extend_populates_memory():
    """extend() hands out memory that is faulted in already (a client's
    cudaHostRegister of it pins what is there), advised for transparent
    huge pages, starting on a huge page; truncate() returns it; over one
    thread or several (the library's vp_host_populate: MADV_POPULATE_WRITE,
    or writing each page on kernels without it)."""
    from comfy_aimdo import _hostio, _par
    pg = os.sysconf("SC_PAGE_SIZE")
    control.deinit()
    saved = _par.threads()
    try:
        for threads in (1, 4, 3):
            _par.set_threads(threads)
            hb = host_buffer.HostBuffer(0, 0, 0)
            p = hb.extend(37 * MiB + 1000, register=False)
            base = hb.get_raw_address()
            assert base % _hostio.HUGE == 0
            npg = lambda a, n: (a + n - 1) // pg - a // pg + 1  # noqa: E731
            assert _resident(p, 37 * MiB + 1000) == \
                npg(p, 37 * MiB + 1000)                 # all of it
            assert "hg" in (_vma_flags(base) or ["hg"])  # THP advised
            p2 = hb.extend(20 * MiB + 3, register=False)
            assert p2 == p + 37 * MiB + 1000
            assert _resident(p2, 20 * MiB + 3) == npg(p2, 20 * MiB + 3)
            assert ctypes.string_at(p2, 4096) == bytes(4096)   # zeroed
            ctypes.memset(base, 9, hb.size)
            hb.truncate(5 * MiB + 17)
            past = base + _hostio.page_up(5 * MiB + 17)
            assert _resident(past, 40 * MiB) == 0           # given back
            # The rest of the last page was zeroed: extend gives zeros.
            p3 = hb.extend(MiB, register=False)
            assert ctypes.string_at(p3, MiB) == bytes(MiB)
            assert _resident(p3, MiB) == npg(p3, MiB)
            assert ctypes.string_at(base + 5 * MiB, 17) == b"\x09" * 17
            hb.close()
        # Prewarm populates too.
        hb = host_buffer.HostBuffer(0, 8 * MiB, 1 << 30)
        assert _resident(hb.get_raw_address(), 8 * MiB) == 8 * MiB // pg
        hb.close()
    finally:
        _par.set_threads(saved)


def test_host_buffer_extend_out_of_memory_leaves_it_as_it_was():
    """A populate that fails (the kernel's ENOMEM) makes extend() a
    RuntimeError, as ComfyUI expects of a buffer that cannot grow, and
    leaves the buffer as it was (size, mapping, what it holds)."""
    import errno
    from comfy_aimdo import _hostio
    control.deinit()
    hb = host_buffer.HostBuffer(0, 0, 0)
    p = hb.extend(3 * MiB, register=False)
    ctypes.memset(p, 5, 3 * MiB)
    saved = _hostio.populate

    def refuse(addr, size, workers=None):
        raise OSError(errno.ENOMEM, "no memory")
    _hostio.populate = refuse
    try:
        raises(RuntimeError, hb.extend, 64 * MiB, register=False)
    finally:
        _hostio.populate = saved
    assert hb.size == 3 * MiB
    assert _resident(hb.get_raw_address() + 4 * MiB, 64 * MiB) == 0
    assert ctypes.string_at(p, 3 * MiB) == b"\x05" * (3 * MiB)
    assert hb.extend(64 * MiB, register=False) == p + 3 * MiB
    hb.close()


def test_host_buffer_reallocate_and_memory_limits():
    """extend(reallocate=True) past the reservation moves the buffer with
    its bytes and registrations, the new memory populated; without
    reallocate it is a RuntimeError; an extend of more memory than the
    system has available is a RuntimeError before anything is touched
    (not a visit from the OOM killer)."""
    from comfy_aimdo import _hostio
    dev = fresh()
    saved = host_buffer._ram
    host_buffer._ram = lambda: 8 * MiB         # a small reservation
    try:
        hb = host_buffer.HostBuffer(0, 0, 0)
        p = hb.extend(3 * MiB)                   # registered: vpager's
        ctypes.memset(p, 3, 3 * MiB)
        q = hb.extend(4 * MiB + 5, register=False)
        ctypes.memset(q, 4, 4 * MiB + 5)
        assert hb._cap == 8 * MiB
        raises(RuntimeError, hb.extend, 2 * MiB)
        assert hb.size == 7 * MiB + 5
        r = hb.extend(2 * MiB, reallocate=True, register=False)
        base = hb.get_raw_address()
        assert base % _hostio.HUGE == 0 and r == base + 7 * MiB + 5
        assert ctypes.string_at(base, 3 * MiB) == b"\x03" * (3 * MiB)
        assert ctypes.string_at(base + 3 * MiB, 4 * MiB + 5) == \
            b"\x04" * (4 * MiB + 5)
        assert ctypes.string_at(r, 2 * MiB) == bytes(2 * MiB)
        assert _resident(base, hb.size) == \
            (hb.size + os.sysconf("SC_PAGE_SIZE") - 1) // \
            os.sysconf("SC_PAGE_SIZE")
        assert dev.stats()["host_pinned_bytes"] == 3 * MiB   # redone
        hb.close()
        assert dev.stats()["host_pinned_bytes"] == 0
    finally:
        host_buffer._ram = saved
    avail = _hostio.mem_available()
    if avail is None:
        return
    hb = host_buffer.HostBuffer(0, 0, 2 * avail + (4 << 30))
    hb.extend(MiB, register=False)
    raises(RuntimeError, hb.extend, avail + (1 << 30), register=False)
    assert hb.size == MiB
    assert _resident(hb.get_raw_address() + 2 * MiB, 64 * MiB) == 0
    hb.close()


def test_par_run_order_and_errors():
    """_par.run: results in item order; an exception is raised only after
    every call finished (they write memory the caller then owns)."""
    from comfy_aimdo import _par
    saved = _par.set_threads(4)
    try:
        assert _par.run(lambda x: x * x, range(50)) == [x * x for x in
                                                         range(50)]
        assert _par.run(lambda x: x, []) == []
        finished = []

        def work(x):
            time.sleep(0.002 * (x % 3))
            finished.append(x)
            if x in (3, 7):
                raise OSError("piece %d" % x)
            return x
        try:
            _par.run(work, range(12))
            raise AssertionError("no error")
        except OSError as e:
            assert str(e) == "piece 3", e
        assert sorted(finished) == list(range(12))
        _par.set_threads(1)
        assert _par.run(lambda x: threading.get_ident(), range(5)) == \
            [threading.get_ident()] * 5
    finally:
        _par.set_threads(saved)


def test_host_buffer_read_file_slice_threads_equal_and_errors():
    """read_file_slice: the file's bytes for unaligned offsets and sizes,
    the same over one thread and several (pieces of every size, also the
    small pieces of a chained upload); a range past the file's end, a bad
    descriptor, a directory, a pipe: OSError with the buffer unchanged
    where the range is known to be bad before reading; bad numbers:
    ValueError or TypeError."""
    from comfy_aimdo import _hostio, _par
    dev = fresh()
    data = data_for(1212, 29 * MiB + 4321)
    path = _tmpfile(data)
    rng = random.Random(1212)
    saved = _par.threads(), _hostio.READ_PIECE
    fd = os.open(path, os.O_RDONLY)
    try:
        hb = host_buffer.HostBuffer(0, 0, 0)
        hb.extend(30 * MiB, register=False)
        base = hb.get_raw_address()
        _hostio.READ_PIECE = 256 << 10            # many pieces
        cases = [(0, len(data), 0), (1, len(data) - 1, 3),
                 (len(data) - 1, 1, 30 * MiB - 1), (4096, 5 * MiB, 4096)]
        cases += [(rng.randrange(len(data) - 1), None, None)
                  for _ in range(12)]
        for fo, n, off in cases:
            if n is None:
                n = rng.randint(1, min(len(data) - fo, 12 * MiB))
                off = rng.randrange(30 * MiB - n + 1)
            got = []
            for threads in (1, 2, 5):
                _par.set_threads(threads)
                ctypes.memset(base, 0xEE, 30 * MiB)
                hb.read_file_slice(fd, fo, n, offset=off)
                assert ctypes.string_at(base + off, n) == data[fo:fo + n], \
                    (fo, n, off, threads)
                got.append(ctypes.string_at(base, 30 * MiB))
            assert got[0] == got[1] == got[2]       # nothing else written
        # Chained to an upload: the pieces (forced small) arrive whole.
        vb = model_vbar.ModelVBAR(2 * PAGE, 0)
        a = vb.alloc(20 * MiB)
        assert model_vbar.vbar_fault(a) is not None
        for threads in (1, 4):
            _par.set_threads(threads)
            hb.read_file_slice(fd, 999, 19 * MiB + 77, offset=12345,
                               stream=0, device_ptr=a[1], device=0)
            dev.synchronize()
            assert dev.read(a[1], 19 * MiB + 77) == \
                data[999:999 + 19 * MiB + 77]
        seen = []
        _par.set_threads(3)
        _hostio.read_pieces(fd, base, 7 * MiB + 5, 11,
                          lambda p, n: seen.append((p - base, n)),
                          piece=300000)
        assert seen[0][0] == 0 and sum(n for _, n in seen) == 7 * MiB + 5
        assert all(seen[i][0] + seen[i][1] == seen[i + 1][0]
                   for i in range(len(seen) - 1))
        assert ctypes.string_at(base, 7 * MiB + 5) == data[11:11 + 7 * MiB
                                                           + 5]

        def boom(p, n):
            raise RuntimeError("upload failed")
        raises(RuntimeError, _hostio.read_pieces, fd, base, 7 * MiB, 0, boom,
               300000)
        # Errors.
        ctypes.memset(base, 0xEE, 30 * MiB)
        before = ctypes.string_at(base, 30 * MiB)
        for threads in (1, 4):
            _par.set_threads(threads)
            raises(OSError, hb.read_file_slice, fd, len(data) - 10, 100)
            raises(OSError, hb.read_file_slice, fd, 0, 29 * MiB + 4322)
            raises(OSError, hb.read_file_slice, fd, 5 * MiB, 25 * MiB)
            raises(OSError, hb.read_file_slice, fd, len(data) - 10, 100,
                   0, 0, a[1], 0)
        assert ctypes.string_at(base, 30 * MiB) == before   # untouched
        raises(ValueError, hb.read_file_slice, fd, 0, 31 * MiB)
        raises(ValueError, hb.read_file_slice, fd, -1, 10)
        raises(ValueError, hb.read_file_slice, fd, 0, 10, -5)
        raises(TypeError, hb.read_file_slice, fd, 0, "10")
        raises(TypeError, hb.read_file_slice, fd, 1.5, 10)
        hb.read_file_slice(fd, 0, 0)                        # nothing
        bad = os.open(path, os.O_RDONLY)
        os.close(bad)
        raises(OSError, hb.read_file_slice, bad, 0, 10)      # EBADF
        d = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            raises(OSError, hb.read_file_slice, d, 0, 10)    # EISDIR
        finally:
            os.close(d)
        r, w = os.pipe()
        try:
            raises(OSError, hb.read_file_slice, r, 0, 10)    # ESPIPE
        finally:
            os.close(r)
            os.close(w)
        model_vbar.vbar_unpin(a)
        hb.close()
    finally:
        _par.set_threads(saved[0])
        _hostio.READ_PIECE = saved[1]
        os.close(fd)
        os.unlink(path)


def test_host_buffer_read_file_to_device_staged():
    """read_file_to_device through vpager's file reader (its slots: large
    reads, or memory vpager does not manage) equals the file, across slot
    edges and slot reuse, over one thread and several; a range past the
    file's end is an OSError before anything is uploaded;
    cleanup_file_reader() and deinit() free the slots (their pinned host
    memory), which come back on the next read."""
    from comfy_aimdo import _par
    dev = fresh()
    slot = 64 * MiB                 # VPAGER_FILE_SLOT_SIZE's default
    data = data_for(4242, 3 * slot + 5 * MiB + 11)
    path = _tmpfile(data)
    saved = _par.threads()
    fd = os.open(path, os.O_RDONLY)
    try:
        hb = host_buffer.HostBuffer(0, 0, 0)
        vb = model_vbar.ModelVBAR(len(data) + PAGE, 0)
        a = vb.alloc(len(data))
        assert model_vbar.vbar_fault(a) is not None
        for threads in (1, 3):
            _par.set_threads(threads)
            for fo, n, off in ((0, len(data), 0),
                               (7, len(data) - 7 - 4096, 512),
                               (slot - 3, slot + 6, 1)):
                hb.read_file_to_device(fd, fo, n, 0, a[1] + off, 0,
                                       mark_cold=False)
                dev.synchronize()
                assert dev.read(a[1] + off, n) == data[fo:fo + n], \
                    (threads, fo, n)
        slots_pinned = dev.stats()["host_pinned_bytes"]
        assert slots_pinned >= 3 * slot             # slots were used
        # Memory vpager does not manage goes through the slots even when
        # small: on the simulated device host memory, on a GPU a torch
        # tensor's (a host address is no device address there: the H200
        # refused the upload, VP_EINVAL).
        if dev.backend == "sim":
            out = ctypes.create_string_buffer(3 * MiB)
            hb.read_file_to_device(fd, 33, 3 * MiB, 0, ctypes.addressof(out),
                                   0)
            assert out.raw == data[33:33 + 3 * MiB]
        elif have_torch():
            import torch
            t = torch.empty(3 * MiB, dtype=torch.uint8, device=tdevice(dev))
            hb.read_file_to_device(fd, 33, 3 * MiB, 0, t.data_ptr(), 0)
            dev.synchronize()
            assert t.cpu().numpy().tobytes() == data[33:33 + 3 * MiB]
        # (a device address on a GPU: zeroed by a copy, not the host's
        # memset, which segfaulted there)
        dev.copy_to_device(a[1], bytes(4096))
        dev.synchronize()
        raises(OSError, hb.read_file_to_device, fd, len(data) - 100, 200, 0,
               a[1], 0)
        dev.synchronize()
        assert dev.read(a[1], 4096) == bytes(4096)
        raises(ValueError, hb.read_file_to_device, fd, -1, 200, 0, a[1], 0)
        hb.cleanup_file_reader()
        assert dev.stats()["host_pinned_bytes"] == slots_pinned - 3 * slot
        hb.read_file_to_device(fd, 0, 20 * MiB, 0, a[1], 0)
        dev.synchronize()
        assert dev.read(a[1], 20 * MiB) == data[:20 * MiB]
        model_vbar.vbar_unpin(a)
        assert dev.stats()["host_pinned_bytes"] == slots_pinned - 2 * slot
        control.deinit()
        assert dev.closed                           # and its slots with it
        hb.close()
    finally:
        _par.set_threads(saved)
        os.close(fd)
        os.unlink(path)


def test_bench_compat_cold_dry_run():
    """bench/bench_compat_cold.py --dry-run (small) runs every section on
    the simulated device without an error, the bytes equal the file."""
    if not have_torch():
        return
    out = tempfile.mkdtemp()
    try:
        env = dict(ENV, OUT=out, VPAGER_COMPAT_THREADS="3")
        env.pop("VPAGER_BACKEND", None)
        r = subprocess.run(
            [sys.executable, os.path.join(REPO, "bench",
                                          "bench_compat_cold.py"),
             "--dry-run", "--size", "40M", "--extend-size", "3M",
             "--read-size", "5M", "--register", "none", "--dir", out],
            env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        with open(os.path.join(out, "bench_compat_cold.json")) as f:
            res = json.load(f)
        assert "errors" not in res, res["errors"]
        assert res["threads"] == 3
        assert all(x["equal"] for x in res["read"]["runs"]["dropin"])
        chain = res["chain"]["runs"]
        assert len(chain) == 2 and all(x["equal"] for x in chain.values())
        assert [n for n in os.listdir(out)
                if n.startswith("bench_compat_cold.")] == \
            ["bench_compat_cold.json"]              # the file is removed
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_bench_compat_dry_run():
    """bench/bench_compat.py --dry-run runs the round trip and both steady
    shapes (ComfyUI's layout, block spans, the hand streamer) on the
    simulated device without an error, every output bitwise equal."""
    if not have_torch():
        return
    out = tempfile.mkdtemp()
    try:
        env = dict(ENV, OUT=out)
        env.pop("VPAGER_BACKEND", None)
        r = subprocess.run(
            [sys.executable, os.path.join(REPO, "bench", "bench_compat.py"),
             "--dry-run", "--iters", "1", "--warmup", "0", "--pairs", "2000"],
            env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        with open(os.path.join(out, "bench_compat.json")) as f:
            res = json.load(f)
        assert "errors" not in res, res["errors"]
        assert len(res["fault"]) == 4, res["fault"]
        for name in ("uniform", "small"):
            sh = res["shapes"][name]
            assert sh["verify"]["bad"] == [] and sh["verify"]["checked"] > 0
            for row in sh["batch"].values():
                v = row["vpager"]
                assert v["equal"] and row["hand"]["equal"], row
                assert v["counts"]["miss"] > 0 and v["counts"]["hit"] > 0
                assert v["stats"]["pages_committed"] == 0     # steady
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ----------------------------------------------------------- model_mmap

def test_model_mmap_get_bounce():
    data = data_for(5, 3 * MiB + 17)
    path = _tmpfile(data)
    try:
        mm = model_mmap.ModelMMAP(path)
        assert ctypes.string_at(mm.get(), len(data)) == data
        st = os.fstat(mm.get_file_handle())
        assert st.st_size == len(data)
        mm.bounce()
        mm.bounce()                                       # idempotent
        assert ctypes.string_at(mm.get() + 1000, 5000) == data[1000:6000]
        mm.close()
        raises(ValueError, mm.get)
    finally:
        os.unlink(path)


# ---------------------------------------------------------------- torch

def test_torch_views():
    if not have_torch():
        return
    import torch
    from comfy_aimdo import torch as at
    dev = fresh()
    td = tdevice(dev)
    vb = model_vbar.ModelVBAR(PAGE, 0)
    a = vb.alloc(4096)
    assert model_vbar.vbar_fault(a) is not None
    t = at.aimdo_to_tensor(a, torch.device(td))
    assert t.dtype == torch.uint8 and t.numel() == 4096
    t.fill_(9)
    t[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8, device=t.device)
    if t.is_cuda:
        torch.cuda.synchronize()
    assert dev.read(a[1], 5) == bytes([1, 2, 3, 9, 9])
    r = at.get_tensor_from_raw_ptr(a[1] + 1, 2, td)
    assert r.cpu().tolist() == [2, 3]
    f = t[:16].view(torch.float32)
    assert f.shape == (4,)
    model_vbar.vbar_unpin(a)
    hb = host_buffer.HostBuffer(0, 0, 0)
    assert at.hostbuf_to_tensor(hb).numel() == 0
    hb.extend(1000)
    ht = at.hostbuf_to_tensor(hb)
    assert ht.device.type == "cpu" and ht.numel() == 1000
    ht[10] = 200
    assert ctypes.string_at(hb.get_raw_address() + 10, 1) == b"\xc8"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert at.get_torch_allocator() is None
        assert w


def test_block_span_signature_stable_exactly_while_resident():
    """vbar_fault on a synthetic (vbar, first address, span) over a whole
    block of adjacent allocations (ComfyUI's _v_block): the signature
    compares equal to the last one exactly when every page of the span
    stayed resident and was not refilled since (the oracle: residency
    before and after every fault), under pressure from a second model,
    evictions, budget changes and nested faults of the members."""
    dev = fresh(budget_pages=6)
    rng = random.Random(812)
    vb = model_vbar.ModelVBAR(14 * PAGE, 0)
    blocks = _comfy_model(vb, rng, nblocks=7)
    other = model_vbar.ModelVBAR(6 * PAGE, 0)
    fills = {id(vb): [0] * vb.get_nr_pages(),
             id(other): [0] * other.get_nr_pages()}

    def pages(alloc):
        v, a, n = alloc
        first = (a - v.base) // PAGE
        return range(first, (a - v.base + max(n, 1) - 1) // PAGE + 1)

    def fault(alloc):
        v = alloc[0]
        before = v.get_residency()
        sig = model_vbar.vbar_fault(alloc)
        after = v.get_residency()
        f = fills[id(v)]
        for p in range(len(f)):
            if not before[p] & 1 and after[p] & 1:
                f[p] += 1
        if sig is not None:
            assert all(after[p] & 3 == 3 for p in pages(alloc))
        return sig

    for b in blocks:
        b.sig = b.seen = None
    counts = dict(same=0, changed=0, miss=0)
    for step in range(500):
        op = rng.random()
        if op < 0.45:
            b = rng.choice(blocks)
            sig = fault(b.span)
            if sig is None:
                counts["miss"] += 1
                continue
            assert len(sig) == b.span[2] // PAGE + 2
            now = [fills[id(vb)][p] for p in pages(b.span)]
            if b.sig is not None:
                same = model_vbar.vbar_signature_compare(sig, b.sig)
                assert same == (now == b.seen), (step, now, b.seen)
                counts["same" if same else "changed"] += 1
            b.sig, b.seen = sig, now
            for a in rng.sample(b.allocs, rng.randint(0, len(b.allocs))):
                s = fault(a)                    # nested: pinned already
                assert s is not None
                model_vbar.vbar_unpin(a)
            model_vbar.vbar_unpin(b.span, stream=0)
        elif op < 0.6:
            a = rng.choice(rng.choice(blocks).allocs)
            if fault(a) is not None:
                model_vbar.vbar_unpin(a)
        elif op < 0.72:
            span = (other, other.base + rng.randrange(4) * PAGE,
                    rng.randint(1, 2) * PAGE)
            if fault(span) is not None:
                model_vbar.vbar_unpin(span)
        elif op < 0.82:
            vb.free_memory(rng.randint(1, 3) * PAGE)
        elif op < 0.92:
            rng.choice([vb, other]).prioritize()
        else:
            total = dev.info()["total_memory"]
            control.set_simple_vram_headroom(total - rng.randint(4, 8) * PAGE)
    print("     block spans:", counts)
    assert counts["same"] >= 10 and counts["changed"] >= 10, counts
    assert not any(f & 2 for f in vb.get_residency() + other.get_residency())
    # The span is stable while resident: fault it twice in a row.
    vb.prioritize()
    control.set_simple_vram_headroom(None)
    b = blocks[0]
    s1 = fault(b.span)
    model_vbar.vbar_unpin(b.span)
    s2 = fault(b.span)
    model_vbar.vbar_unpin(b.span)
    assert model_vbar.vbar_signature_compare(s1, s2)


def test_aimdo_to_tensor_labels_the_vbars_device():
    if not have_torch():
        return
    import torch
    from comfy_aimdo import torch as at
    dev = fresh()
    vb = model_vbar.ModelVBAR(PAGE, 0)
    a = vb.alloc(4096)
    assert model_vbar.vbar_fault(a) is not None
    want = torch.device(tdevice(dev))
    for asked in (None, "cuda", "cuda:0", "cuda:1", torch.device("cuda", 3),
                  "cpu", 0, 1):
        t = at.aimdo_to_tensor(a, asked)
        assert t.device == want, (asked, t.device)
        assert t.numel() == 4096 and t.dtype == torch.uint8
    vbuf = vram_buffer.VRAMBuffer(PAGE, 0)
    assert at.aimdo_to_tensor(vbuf.get(100), "cuda:5").device == want
    # A VBAR of another GPU keeps its own label, whatever the caller says
    # (the caller's device being the other GPU is the case that matters).
    class Owner:
        def __init__(self, backend, index, closed=False):
            self.device = types.SimpleNamespace(backend=backend,
                                                closed=closed)
            self.device_index = index
    assert at._alloc_device(Owner("cuda", 1), "cuda:0") == \
        torch.device("cuda", 1)
    assert at._alloc_device(Owner("cuda", 0), torch.device("cuda", 1)) == \
        torch.device("cuda", 0)
    assert at._alloc_device(Owner("sim", 1), "cuda:1") == \
        torch.device("cpu")
    raises(RuntimeError, at._alloc_device, Owner("cuda", 1, True), "cuda")
    # Garbage allocations are refused as such.
    for bad in (None, (), (vb,), (vb, a[1]), (vb, "x", 10), (vb, a[1], 1.5),
                (vb, a[1], -1), (vb, 0, 10), 5, "alloc"):
        raises((TypeError, ValueError), at.aimdo_to_tensor, bad, "cuda")
    model_vbar.vbar_unpin(a)
    vbuf.close()
    control.deinit()
    raises(RuntimeError, at.aimdo_to_tensor, a, "cuda:0")     # device gone


_GARBAGE = [None, -1, -(1 << 63), 1 << 64, 1 << 70, 1.5, float("nan"),
            float("inf"), "x", b"x", [], {}, (1, 2), object(), True, 1j]


def test_garbage_arguments_raise_clear_exceptions():
    """Property: every entry point, called with garbage, returns or raises
    TypeError, ValueError, RuntimeError, MemoryError or OverflowError
    (OSError for file calls); never another exception, never a crash (it
    runs in a subprocess, so a crash shows as its exit status)."""
    code = r'''
import json, random, sys
import comfy_aimdo.control as c, comfy_aimdo.model_vbar as mv
import comfy_aimdo.host_buffer as hbm, comfy_aimdo.vram_buffer as vbm
import comfy_aimdo.malloc_graph as mg, comfy_aimdo.storage as st
import comfy_aimdo.model_mmap as mm
G = %s
OK = (TypeError, ValueError, RuntimeError, MemoryError, OverflowError)
bad, calls = [], 0
def call(name, fn, *a, ok=OK, **kw):
    global calls
    calls += 1
    try:
        fn(*a, **kw)
    except ok:
        pass
    except BaseException as e:
        bad.append("%%s%%r: %%s: %%s" %% (name, a, type(e).__name__, e))
for g in G:
    call("init_devices", c.init_devices, g)
    call("init_devices([g])", c.init_devices, [g])
assert c.init() and c.init_devices([0])
vb = mv.ModelVBAR(1 << 30, 0)
a = vb.alloc(4096)
hb = hbm.HostBuffer(0, 0, 0)
hb.extend(1 << 20)
vbuf = vbm.VRAMBuffer(1 << 30, 0)
gr = mg.record(None)
for g in G:
    for h in G[:6]:
        call("ModelVBAR", mv.ModelVBAR, g, 0)
        call("ModelVBAR(dev)", mv.ModelVBAR, 1 << 20, g)
        call("alloc", vb.alloc, g)
        call("vbar_fault", mv.vbar_fault, g)
        call("vbar_fault3", mv.vbar_fault, (vb, g, h))
        call("vbar_fault3b", mv.vbar_fault, (vb, a[1], g))
        call("vbar_unpin", mv.vbar_unpin, (vb, g, h))
        call("vbar_unpin(stream)", mv.vbar_unpin, a, g)
        call("compare", mv.vbar_signature_compare, g, h)
        call("set_watermark", vb.set_watermark, g)
        call("set_watermark_limit", vb.set_watermark_limit, g)
        call("free_memory", vb.free_memory, g)
        call("vbars_analyze", mv.vbars_analyze, g)
        call("HostBuffer", hbm.HostBuffer, g, h, 0)
        call("HostBuffer3", hbm.HostBuffer, 0, h, g)
        call("extend", hb.extend, g)
        call("truncate", hb.truncate, g, h)
        call("register", hb.register, g, h)
        call("unregister", hb.unregister, g)
        call("read_file_slice", hb.read_file_slice, 0, g, h,
             ok=OK + (OSError,))
        call("VRAMBuffer", vbm.VRAMBuffer, g, 0)
        call("VRAMBuffer.get", vbuf.get, g, h)
        call("init_device", c.init_device, g, h)
        call("set_headroom", c.set_simple_vram_headroom, g)
        call("get_devctx", c.get_devctx, g)
        call("record", mg.record, g, h)
        call("push", gr.push, g)
        call("iterate", gr.iterate, g)
        call("pause", gr.pause, g)
        call("use_stream", gr.use_stream, g)
        call("ModelMMAP", mm.ModelMMAP, g, ok=OK + (OSError,))
    if st.fast_disk(g) is not None:
        bad.append("fast_disk(%%r)" %% (g,))
gr.abort()
try:
    import torch, comfy_aimdo.torch as at
    for g in G:
        for h in G[:6]:
            call("aimdo_to_tensor", at.aimdo_to_tensor, g, h)
            call("aimdo_to_tensor3", at.aimdo_to_tensor, (vb, g, h), "cuda")
            call("raw_ptr", at.get_tensor_from_raw_ptr, g, 0, h)
except ImportError:
    pass
print(json.dumps({"bad": bad, "calls": calls}))
''' % repr(_GARBAGE)
    # repr() of object() and nan/inf is not Python source: build them there.
    code = code.replace(repr(_GARBAGE), "[None, -1, -(1 << 63), 1 << 64, "
                        "1 << 70, 1.5, float('nan'), float('inf'), 'x', "
                        "b'x', [], {}, (1, 2), object(), True, 1j]")
    env = dict(ENV, VPAGER_BACKEND="sim")
    r = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print("     %d garbage calls" % out["calls"])
    assert out["bad"] == [], "\n".join(out["bad"][:30])


def test_hit_path_same_as_plain_path():
    """vbar_fault / vbar_unpin (vp_fault_range on a range described once,
    issue 12) against ModelVBAR.fault / unpin (vp_fault through the
    binding): the same signatures, the same pins, for allocations, spans
    over several of them, ranges straddling pages, fresh tuples of the
    same values and tuples whose id is recycled with other values."""
    dev = fresh(budget_pages=6)
    rng = random.Random(1212)
    vb = model_vbar.ModelVBAR(10 * PAGE + 4096, 0)
    blocks = _comfy_model(vb, rng, nblocks=4)
    ranges = [a for b in blocks for a in b.allocs] + [b.span for b in blocks]
    for _ in range(40):
        a = rng.randrange(vb.size)
        ranges.append((vb, vb.base + a, rng.randint(1, vb.size - a)))

    def pinned():
        return [f & 2 for f in vb.get_residency()]
    for r in ranges * 2:
        for make in (lambda: r, lambda: (r[0], r[1], r[2]),
                     lambda: [r[0], r[1], r[2]]):
            sig = model_vbar.vbar_fault(make())
            if sig is None:
                assert vb.fault(r[1], r[2]) is None
                assert not any(pinned())
                continue
            ref = vb.fault(r[1], r[2])
            assert isinstance(sig, array.array) and sig.typecode == "I"
            assert sig == ref and len(sig) == r[2] // PAGE + 2, (sig, ref)
            assert model_vbar.vbar_signature_compare(sig, ref)
            vb.unpin(r[1], r[2])
            first = (r[1] - vb.base) // PAGE
            last = (r[1] - vb.base + r[2] - 1) // PAGE
            assert pinned() == [2 if first <= p <= last else 0
                                for p in range(vb.get_nr_pages())]
            model_vbar.vbar_unpin(make())
            assert not any(pinned())
    # A recycled id: one list object, its values changed between calls.
    lst = [vb, vb.base, MiB]
    vb.prioritize()                             # lift the watermark
    for off in (0, 3 * PAGE + 5, 0, 5 * PAGE, 0):
        lst[1] = vb.base + off
        sig = model_vbar.vbar_fault(lst)
        assert sig is not None and sig == vb.fault(lst[1], lst[2])
        assert pinned()[off // PAGE] == 2, (off, vb.get_residency())
        vb.unpin(lst[1], lst[2])
        model_vbar.vbar_unpin(lst)
        assert not any(pinned())
    # Size 0 takes the plain path: zeros, nothing pinned, unpin a no-op.
    z = model_vbar.vbar_fault((vb, vb.base + PAGE, 0))
    assert z == array.array("I", [0, 0]) and not any(pinned())
    model_vbar.vbar_unpin((vb, vb.base + PAGE, 0))
    # Torch-style stream objects and ints reach vp_unpin_range.
    a = blocks[0].allocs[0]
    own = dev.create_stream()
    for stream in (0, None, own, types.SimpleNamespace(cuda_stream=own),
                   types.SimpleNamespace(cuda_stream=0)):
        assert model_vbar.vbar_fault(a) is not None
        model_vbar.vbar_unpin(a, stream)
    dev.synchronize(own)
    dev.destroy_stream(own)
    assert not any(pinned())
    # The same errors as before: a range unpinned twice, outside the VBAR,
    # a closed VBAR, something that is no allocation.
    model_vbar.vbar_fault(a)
    model_vbar.vbar_unpin(a)
    raises(control._vpager.NotPinnedError, model_vbar.vbar_unpin, a)
    raises(ValueError, model_vbar.vbar_fault, (vb, vb.base - 512, 1024))
    raises(ValueError, model_vbar.vbar_unpin, (vb, vb.base + 11 * PAGE, 1))
    raises(TypeError, model_vbar.vbar_fault, (object(), vb.base, 1))
    raises(TypeError, model_vbar.vbar_fault, (vb, vb.base))
    raises(TypeError, model_vbar.vbar_unpin, 5)
    vb.close()
    raises(control._vpager.HandleError, model_vbar.vbar_fault, a)
    raises(control._vpager.HandleError, model_vbar.vbar_unpin, a)


def test_hit_path_threads_get_their_own_signatures():
    """Two threads faulting the same ranges at once (the calls drop the
    GIL): each signature is the one vp_fault gives, and every pin is
    dropped."""
    dev = fresh(budget_pages=4)
    vb = model_vbar.ModelVBAR(4 * PAGE, 0)
    allocs = [vb.alloc(PAGE // 2) for _ in range(8)]
    for a in allocs:
        assert model_vbar.vbar_fault(a) is not None
        model_vbar.vbar_unpin(a)
    ref = {id(a): vb.fault(a[1], a[2]) for a in allocs}
    for a in allocs:
        vb.unpin(a[1], a[2])
    errs = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(3000):
                a = rng.choice(allocs)
                sig = model_vbar.vbar_fault(a)
                assert sig == ref[id(a)], (sig, ref[id(a)])
                model_vbar.vbar_unpin(a)
        except Exception as e:      # noqa: BLE001
            errs.append(e)
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errs == [], errs[:3]
    assert not any(f & 2 for f in vb.get_residency())
    assert dev.stats()["pages_committed"] >= 4


def test_hit_path_after_deinit_raises():
    """A ModelVBAR whose device deinit() closed: its remembered ranges
    raise HandleError as the plain path does, never touch memory."""
    fresh()
    vb = model_vbar.ModelVBAR(2 * PAGE, 0)
    a = vb.alloc(MiB)
    assert model_vbar.vbar_fault(a) is not None
    model_vbar.vbar_unpin(a)
    import vpager
    control.deinit()
    raises(vpager.HandleError, model_vbar.vbar_fault, a)
    raises(vpager.HandleError, model_vbar.vbar_unpin, a)
    fresh()
    vb2 = model_vbar.ModelVBAR(2 * PAGE, 0)
    raises(vpager.HandleError, model_vbar.vbar_fault, a)
    b = vb2.alloc(MiB)
    assert model_vbar.vbar_fault(b) is not None
    model_vbar.vbar_unpin(b)


def test_deinit_closes_everything():
    fresh()
    vb = model_vbar.ModelVBAR(PAGE, 0)
    a = vb.alloc(10)
    assert model_vbar.vbar_fault(a) is not None
    model_vbar.vbar_unpin(a)
    control.deinit()
    assert control.lib is None and control.get_total_vram_usage() == 0
    assert model_vbar.vbars_analyze() == 0
    raises(RuntimeError, control.get_devctx, 0)
    raises(RuntimeError, model_vbar.ModelVBAR, PAGE, 0)
    control.deinit()                                       # twice: fine


if __name__ == "__main__":
    sys.exit(_runner.main(globals(), timing=True, after_all=control.deinit))
