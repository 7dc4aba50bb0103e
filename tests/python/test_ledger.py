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
REPO = os.path.dirname(os.path.dirname(HERE))
if os.path.join(REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "python"))

import vpager  # noqa: E402
from vpager import ledger  # noqa: E402

sys.path.insert(0, HERE)
import _runner  # noqa: E402
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
PAGE = %d
d = vpager.Device(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                  sim_capacity=8 * PAGE, sim_shared=name, lookahead=0)
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


def start_holder(name, label, pages):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, name, label,
                          str(pages)], stdin=subprocess.PIPE,
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


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
