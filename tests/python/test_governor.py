"""Tests of vpager.governor: one Governor per device, the only writer of
its limit, headroom and lookahead, on the simulated device.

    make && PYTHONPATH=python:integrations python3 tests/python/test_governor.py

The last tests need torch (they skip without it).
"""

import logging
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python", "integrations")

import vpager  # noqa: E402
from vpager.governor import NO_LIMIT, governor  # noqa: E402

PAGE = 64 << 10
M = 1 << 20


def sim(**kw):
    opts = dict(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                sim_capacity=64 * PAGE, lookahead=4 * PAGE,
                staging_size=4 * PAGE)
    opts.update(kw)
    return vpager.Device(**opts)


def test_one_writer():
    """Only the Governor writes a device's limit, headroom, lookahead and
    pin budget: every call of the setters in python/ and integrations/ is in
    python/vpager/governor.py (the binding defines them)."""
    pat = re.compile(r"\.set_(limit|headroom|lookahead|pin_budget)\(")
    found = set()
    for top in ("python", "integrations"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(root, f)
                with open(path) as fh:
                    for line in fh:
                        if pat.search(line) and "def set_" not in line:
                            found.add(os.path.relpath(path, REPO))
    assert found == {os.path.join("python", "vpager", "governor.py")}, found


def test_the_binding_stays_private():
    """Nothing above python/vpager/*.py imports the ctypes binding
    (vpager._lib): vpager.torch, the drop-in and the node use the public
    binding API (vpager's constants, vpager.vbar's prepared calls)."""
    pat = re.compile(r"(from\s+(vpager|\.\.?)\s+import\s+[^#\n]*\b_lib\b)"
                     r"|(vpager\._lib\b)|(from\s+(vpager)?\.*_lib\s+import)")
    found = []
    for top in ("python", "integrations"):
        for root, _dirs, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                path = os.path.join(root, f)
                rel = os.path.relpath(path, REPO)
                if not f.endswith(".py") or os.path.dirname(rel) == \
                        os.path.join("python", "vpager"):
                    continue
                with open(path) as fh:
                    if pat.search(fh.read()):
                        found.append(rel)
    assert found == [], found


def test_one_governor_per_device():
    dev = sim()
    try:
        assert governor(dev) is governor(dev)
        other = sim()
        assert governor(other) is not governor(dev)
        other.close()
    finally:
        dev.close()


def test_writes_only_on_change_and_logs_each():
    dev = sim(headroom=PAGE)
    log = logging.getLogger("vpager.governor")
    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Grab(level=logging.DEBUG)
    log.addHandler(h)
    old = log.level
    log.setLevel(logging.DEBUG)
    try:
        gov = governor(dev)
        assert gov.headroom == PAGE and gov.limit == NO_LIMIT
        gov.declare_budget(32 * PAGE)
        assert dev.info()["budget"] <= 32 * PAGE
        assert len(seen) == 1 and "limit" in seen[0] \
            and "user budget" in seen[0]
        gov.declare_budget(32 * PAGE)           # the same: no write
        assert len(seen) == 1 and gov.changes == 1
        gov.declare_lookahead(2 * PAGE)
        assert gov.lookahead == 2 * PAGE
        assert "lookahead" in seen[-1] and "device lookahead" in seen[-1]
        gov.declare_lookahead(2 * PAGE)         # the same: no write
        assert len(seen) == 2
        gov.declare_lookahead(4 * PAGE)
        assert gov.lookahead == 4 * PAGE and len(seen) == 3
        gov.declare_budget(None)
        assert dev.info()["budget"] > 32 * PAGE
        assert gov.changes == len(seen) == 4
    finally:
        log.removeHandler(h)
        log.setLevel(old)
        dev.close()


def test_derived_limit_is_the_smallest_input():
    """The user's budget, a shared budget less torch's peak and margin,
    the platform's soft limit less torch's reservation and its margin:
    the limit is the smallest; headroom: the flags' plus what is learned."""
    dev = sim()
    try:
        gov = governor(dev)
        gov.declare_budget(6000 * M)
        gov.declare_flags(256 * M, 5000 * M)
        assert gov.limit == 6000 * M            # nothing learned yet
        gov.declare_torch(600 * M, 900 * M)
        margin = 900 * M // 20
        assert gov.learned == 300 * M + margin
        assert gov.headroom == 256 * M + 300 * M + margin
        assert gov.limit == 5000 * M - 900 * M - margin
        gov.declare_platform(3000 * M, 256 * M, reserved=600 * M)
        assert gov.limit == 3000 * M - 600 * M - 256 * M
        gov.declare_platform(None, 256 * M)     # the soft limit went away
        assert gov.limit == 5000 * M - 900 * M - margin
        gov.raise_oom_margin()                  # one OOM margin
        gov.declare_torch(600 * M, 900 * M)
        assert gov.oom_margin == 512 * M
        assert gov.limit == 5000 * M - 900 * M - 512 * M
        s = gov.stats()
        assert s["limit"] == gov.limit and s["headroom"] == gov.headroom
        assert s["inputs"]["user_budget"] == 6000 * M
        assert s["inputs"]["shared_budget"] == 5000 * M
        assert s["inputs"]["torch_peak"] == 900 * M
        assert s["inputs"]["oom_margin"] == 512 * M
        gov.forget_learned()
        assert gov.headroom == 256 * M
    finally:
        dev.close()


def _torch():
    try:
        import torch
    except ImportError:
        _runner.skip("needs torch")
    import vpager.torch as vt
    return torch, vt


def test_two_models_and_the_nodes_inputs_give_one_limit():
    """Two models offloaded onto one device with a budget, and ComfyUI's
    flags as the node declares them: one derived limit, shown by every
    handle's stats()["governor"]."""
    torch, vt = _torch()
    import warnings
    warnings.simplefilter("ignore", RuntimeWarning)
    dev = vt.open_device("sim", budget=48 * PAGE, page_size=PAGE,
                         sim_granularity=PAGE, sim_capacity=64 * PAGE,
                         staging_size=8 * PAGE)
    try:
        a = torch.nn.Sequential(torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 64))
        b = torch.nn.Sequential(torch.nn.Linear(64, 64))
        ha = vt.offload(a, dev=dev)
        hb = vt.offload(b, dev=dev, budget=40 * PAGE)
        gov = governor(dev)
        assert gov.limit == 40 * PAGE           # the later budget
        gov.declare_flags(PAGE, 36 * PAGE)      # what engine.Pager declares
        gov.declare_torch(2 * PAGE, 4 * PAGE)
        want = 36 * PAGE - 4 * PAGE - gov.margin()
        assert gov.limit == want
        assert dev.info()["budget"] <= want
        with torch.no_grad():
            a(torch.randn(2, 64))
            b(torch.randn(2, 64))
        sa, sb = ha.stats()["governor"], hb.stats()["governor"]
        assert sa == sb and sa["limit"] == want
        assert sa["inputs"]["shared_budget"] == 36 * PAGE
        ha.unload()
        hb.unload()
        assert gov.headroom == PAGE             # learned forgotten
    finally:
        dev.close()


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
