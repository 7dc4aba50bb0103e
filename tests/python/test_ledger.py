"""Tests of vpager.ledger and `python -m vpager top` on the simulated
device shared between processes (sim_shared).

    make && PYTHONPATH=python python3 tests/python/test_ledger.py

Needs only the standard library.
"""

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

import vpager  # noqa: E402
from vpager import ledger  # noqa: E402

from _runner import raises  # noqa: E402

PAGE = 64 << 10
_count = [0]


def shared_name(tag):
    _count[0] += 1
    return "vpl-py-%s-%d-%d" % (tag, os.getpid(), _count[0])


def sim(name, **kw):
    opts = dict(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                sim_capacity=8 * PAGE, sim_shared=name, lookahead=0,
                staging_size=PAGE, ledger_timeout_us=2000000)
    opts.update(kw)
    return vpager.Device(**opts)


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python") + os.pathsep + \
        env.get("PYTHONPATH", "")
    return env


# A process that holds a labelled model until its stdin closes.
HOLDER = r"""
import sys, vpager
name, label, pages = sys.argv[1], sys.argv[2], int(sys.argv[3])
cap = int(sys.argv[4]) if len(sys.argv) > 4 else 8
PAGE = %d
d = vpager.Device(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                  sim_capacity=cap * PAGE, sim_shared=name, lookahead=0)
v = d.create_vbar(pages * PAGE)
v.label = label
for p in range(pages):
    ok, _ = v.fault(p * PAGE, PAGE)
    assert ok
    v.unpin(p * PAGE, PAGE)
d.set_external_reserved(4242)
print("ready", flush=True)
sys.stdin.read()
d.close()
""" % PAGE


def start_holder(name, label, pages, cap=8):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, name, label,
                          str(pages), str(cap)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=_env(), text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def stop_holder(p):
    p.stdin.close()
    assert p.wait(timeout=30) == 0


def top_json(*args):
    out = subprocess.run([sys.executable, "-m", "vpager", "top", "--json"] +
                         list(args), env=_env(), capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_top_json_sees_another_process():
    name = shared_name("top")
    holder = start_holder(name, "sd15-unet", 3)
    try:
        snap = top_json()
        mine = [led for led in snap["ledgers"]
                if led["ledger"] == "sim-" + name]
        assert len(mine) == 1, snap
        led = mine[0]
        assert led["joined"] is False          # top only reads
        assert led["device"]["total"] == 8 * PAGE
        (proc,) = led["processes"]
        assert proc["pid"] == holder.pid and proc["alive"]
        assert proc["external_reserved"] == 4242
        (vb,) = proc["vbars"]
        assert vb["label"] == "sd15-unet"
        assert vb["resident"] == 3 * PAGE and vb["reclaimable"] == 3 * PAGE
        only = top_json("--ledger", "sim-" + name)["ledgers"]
        assert [x["ledger"] for x in only] == ["sim-" + name]
    finally:
        stop_holder(holder)
    gone = [led for led in top_json()["ledgers"]
            if led["ledger"] == "sim-" + name]
    assert gone == []                          # the last one out removed it


def test_top_text_frames():
    name = shared_name("text")
    holder = start_holder(name, "vae", 1)
    try:
        out = subprocess.run([sys.executable, "-m", "vpager", "top",
                              "--ledger", "sim-" + name, "--count", "2",
                              "--interval", "0.05"], env=_env(),
                             capture_output=True, text=True, timeout=60,
                             check=True).stdout
        assert out.count("vpager top") == 2
        assert "ledger sim-%s" % name in out and "vae" in out
    finally:
        stop_holder(holder)


def test_free_memory_takes_an_idle_process_pages():
    name = shared_name("free")
    holder = start_holder(name, "idle", 4)
    try:
        with sim(name) as dev:
            vb = dev.create_vbar(2 * PAGE)
            vb.label = "mine"
            assert vb.label == "mine"
            snap = ledger.snapshot(dev)
            assert snap["joined"] is True
            assert {p["pid"] for p in snap["processes"]} == \
                {os.getpid(), holder.pid}
            assert ledger.free_memory(dev, 2 * PAGE) == 2 * PAGE
            other = [p for p in ledger.snapshot(dev)["processes"]
                     if p["pid"] == holder.pid][0]
            assert other["vbars"][0]["resident"] == 2 * PAGE
            assert other["released"] == 2 * PAGE
            # A fault that needs more than is free takes the rest.
            ok, _ = vb.fault(0, 2 * PAGE)
            assert ok
            vb.unpin(0, 2 * PAGE)
            assert "sim-" + name in ledger.names()
            assert ledger.read("sim-" + name)["joined"] is False
    finally:
        stop_holder(holder)


def test_errors():
    with sim("") as dev:                       # unshared: no ledger
        snap = dev.ledger_snapshot()
        assert snap["joined"] is False and "not shared" in snap["reason"]
        vb = dev.create_vbar(PAGE)
        raises(vpager.InvalidArgument, setattr, vb, "label", 'a"b')
        raises(vpager.InvalidArgument, setattr, vb, "label", "x" * 64)
        assert dev.ledger_free_memory(PAGE) == 0
    raises(vpager.NoDeviceError, ledger.read, "sim-no-such-ledger")
    raises(vpager.InvalidArgument, ledger.read, "bad/name")
    with sim(shared_name("off"), ledger="off") as dev:
        assert "off" in dev.ledger_snapshot()["reason"]


# ------------------------------------------------------ vpager.torch.ledger

def _torch():
    try:
        import torch
        import vpager.torch  # noqa: F401
        from vpager.torch import ledger as ml
    except ImportError as e:
        _runner.skip("no torch: %s" % e)
    return torch, vpager.torch, ml


def _stack(torch, n, width=128):
    """n linears of width x width (fp32: 64 KiB each with the bias
    aligned), outputs deterministic."""
    torch.manual_seed(n)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                 for _ in range(n)])


def _offload(vt, module, name, pages, **kw):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return vt.offload(module, device="cpu", sim_shared=name,
                          page_size=PAGE, sim_granularity=PAGE,
                          sim_capacity=pages * PAGE, lookahead=0,
                          ledger_timeout_us=2000000, order="tail",
                          reorder=False, **kw)


def _in_ledger(dev, pid=None):
    """{label: vbar entry} of one process's VBARs in dev's ledger (all
    its devices)."""
    pid = os.getpid() if pid is None else pid
    return {v["label"]: v for p in ledger.snapshot(dev)["processes"]
            if p["pid"] == pid for v in p["vbars"]}


def test_torch_models_named_sized_freed():
    torch, vt, ml = _torch()
    name = shared_name("tmodel")
    holder = start_holder(name, "idle-peer", 4, 24)
    try:
        a, b = _stack(torch, 4), _stack(torch, 3)
        x = torch.randn(2, 128)
        with torch.no_grad():
            ra, rb = a(x), b(x)
        dev = vpager.Device(backend="sim", page_size=PAGE,
                            sim_granularity=PAGE, sim_capacity=24 * PAGE,
                            sim_shared=name, lookahead=0,
                            staging_size=2 * PAGE,
                            ledger_timeout_us=2000000)
        ha = vt.offload(a, dev=dev, order="tail", reorder=False)
        hb = vt.offload(b, dev=dev, order="tail", reorder=False)
        assert ha.vbar.label == "Sequential"        # the class name
        assert ml.name(hb, 'text "encoder"') == "text _encoder_"
        with torch.no_grad():
            assert torch.equal(a(x), ra) and torch.equal(b(x), rb)
        ia, ib = ml.info(ha), ml.info(hb)
        assert ia["size"] == ha.weight_bytes and ia["loaded_size"] > 0
        assert ia["reclaimable"] == ia["loaded_size"] and ia["pinned"] == 0
        assert [m["name"] for m in ml.models("cpu")
                if m["handle"] in (ha, hb)] == ["Sequential", "text _encoder_"]
        labels = _in_ledger(dev)
        assert set(labels) == {"Sequential", "text _encoder_"}, labels
        # Make the whole device free but keep a: the idle peer (least
        # recently used) and b go; only the shortfall is freed.
        free0 = dev.info()["free_memory"]
        want = free0 + 4 * PAGE + ib["loaded_size"]
        freed = ml.free_memory("cpu", want, keep=[a])
        assert freed == 4 * PAGE + ib["loaded_size"], (freed, want, free0)
        assert ml.info(ha)["loaded_size"] == ia["loaded_size"]
        assert ml.info(hb)["loaded_size"] == 0
        assert _in_ledger(dev, holder.pid)["idle-peer"]["resident"] == 0
        assert ml.free_memory(dev, 1) == 0          # already free: nothing
        # b was evicted: its next forward brings it back whole.
        with torch.no_grad():
            assert torch.equal(b(x), rb)
        assert ml.info(hb)["loaded_size"] == ib["loaded_size"]
        # unload_all: every model not in use; each comes back when used.
        assert ml.unload_all("cpu") == ia["loaded_size"] + ib["loaded_size"]
        assert ml.info(ha)["loaded_size"] == 0
        with torch.no_grad():
            assert torch.equal(a(x), ra)
        assert ml.info(ha)["loaded_size"] == ia["loaded_size"]
        raises(ValueError, ml.free_memory, "cpu", want, keep=[object()])
        ha.unload()
        hb.unload()
        dev.close()
    finally:
        stop_holder(holder)


def test_torch_dead_handle_leaves_ledger():
    import gc
    torch, vt, ml = _torch()
    name = shared_name("tdead")
    keep_dev = sim(name, sim_capacity=16 * PAGE)    # keeps the ledger
    m = _stack(torch, 2)
    h = _offload(vt, m, name, 16)
    ml.name(h, "doomed")
    dev = h.device
    with torch.no_grad():
        m(torch.randn(1, 128))
    assert "doomed" in _in_ledger(keep_dev)
    del m, h
    gc.collect()
    assert "doomed" not in _in_ledger(keep_dev)
    assert dev.closed                   # offload() opened it: closed too
    keep_dev.close()


def test_torch_publishes_reserved_floor_and_platform_limit():
    torch, vt, ml = _torch()
    name = shared_name("tpub")
    m = _stack(torch, 2)
    h = _offload(vt, m, name, 16)
    pub = ml._DEVICES[h.device]
    pub.index = 0                       # as on CUDA device 0
    # The real reading: vp_device_soft_limit of the device offloaded on
    # index 0 (on the simulated device, what the test sets); no other.
    assert ml.platform_soft_limit(0) is None
    h.device.sim_inject(vpager.SIM_SET_SOFT_LIMIT, 10 * PAGE)
    assert ml.platform_soft_limit(0) == 10 * PAGE
    assert ml.platform_soft_limit(1) is None
    h.device.sim_inject(vpager.SIM_SET_SOFT_LIMIT, 0)
    seen = {"reserved": 3 * PAGE, "peak": 9 * PAGE}
    old = (vt._torch_reserved, ml.platform_soft_limit, ml._LIMIT_MARGIN)
    vt._torch_reserved = lambda i: (seen["reserved"], seen["peak"])
    ml.platform_soft_limit = lambda i: 10 * PAGE
    ml._LIMIT_MARGIN = 0
    try:
        x = torch.randn(1, 128)
        with torch.no_grad():
            m(x)
        (me,) = [p for p in ledger.snapshot(h.device)["processes"]
                 if p["self"]]
        assert me["external_reserved"] == 3 * PAGE      # never the peak
        assert me["external_floor"] == 3 * PAGE
        seen["reserved"] = 5 * PAGE
        ml.publish(h.device, force=True)
        (me,) = [p for p in ledger.snapshot(h.device)["processes"]
                 if p["self"]]
        assert me["external_reserved"] == 5 * PAGE
        assert me["external_floor"] == 3 * PAGE        # measured once
        # Under the soft limit: vpager may commit soft - reserved at most.
        pub.limit_at = float("-inf")
        ml.publish(h.device, force=True)
        assert h.device.info()["budget"] <= 5 * PAGE
        ml.platform_soft_limit = lambda i: None        # the limit went away
        pub.limit_at = float("-inf")
        ml.publish(h.device, force=True)
        assert h.device.info()["budget"] > 5 * PAGE
        assert ml.platform_soft_limit is not old[1]
        assert old[1](0) is None or isinstance(old[1](0), int)
    finally:
        vt._torch_reserved, ml.platform_soft_limit, ml._LIMIT_MARGIN = old
        h.unload()


# A process that frees memory over the ledger when told to (a line on
# stdin: the bytes), answering what it freed.
ASKER = r"""
import sys, vpager
from vpager import ledger
name, cap = sys.argv[1], int(sys.argv[2])
PAGE = %d
d = vpager.Device(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                  sim_capacity=cap * PAGE, sim_shared=name, lookahead=0,
                  ledger_timeout_us=2000000)
print("ready", flush=True)
for line in sys.stdin:
    print(ledger.free_memory(d, int(line)), flush=True)
d.close()
""" % PAGE


def test_torch_model_taken_while_idle_comes_back():
    torch, vt, ml = _torch()
    name = shared_name("tback")
    m = _stack(torch, 4)
    x = torch.randn(2, 128)
    with torch.no_grad():
        ref = m(x)
    h = _offload(vt, m, name, 24, staging_size=2 * PAGE)
    asker = subprocess.Popen([sys.executable, "-c", ASKER, name, "24"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=_env(), text=True)
    old = ml.COME_BACK_IDLE
    try:
        assert asker.stdout.readline().strip() == "ready"
        with torch.no_grad():
            assert torch.equal(m(x), ref)
        whole = ml.info(h)["loaded_size"]
        assert whole >= 4 * PAGE
        # Busy (forwards back to back): pages taken stay misses, streamed.
        ml.COME_BACK_IDLE = 60.0
        asker.stdin.write("%d\n" % (2 * PAGE))
        asker.stdin.flush()
        assert int(asker.stdout.readline()) == 2 * PAGE
        with torch.no_grad():
            assert torch.equal(m(x), ref)
        assert ml.info(h)["loaded_size"] == whole - 2 * PAGE
        # Idle a while, then used: it comes back whole.
        ml.COME_BACK_IDLE = 0.0
        with torch.no_grad():
            assert torch.equal(m(x), ref)
        assert ml.info(h)["loaded_size"] == whole
    finally:
        ml.COME_BACK_IDLE = old
        asker.stdin.close()
        asker.wait(timeout=30)
        h.unload()


def test_bench_ledger_dry_run():
    _torch()
    env = _env()
    env["VPAGER_SIM_SHARED"] = shared_name("bench")
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench",
                                                       "bench_ledger.py"),
                          "--dry-run", "--seconds", "0.3"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "wait for 8 U held by an idle peer" in out.stdout
    assert "combined throughput" in out.stdout, out.stdout[-2000:]


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
