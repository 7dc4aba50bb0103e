"""Offloaded.stats(), residency() and the torch demo's text (issue 27): one
documented shape, {"model", "device", "schedule", "governor"}, a counter
meaning one thing wherever its name appears; a readable residency map;
the demo's rows adding up. Simulated device, CPU torch."""

import os
import re
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import vpager  # noqa: E402
import vpager.torch as vt  # noqa: E402
from vpager.torch import counters  # noqa: E402

K = 1 << 10
PAGE = 64 * K


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)]).eval()


def offload(m, dev=None, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dev is not None:
            return vt.offload(m, dev=dev, **kw)
        return vt.offload(m, device="sim", budget=512 * K, page_size=PAGE,
                          sim_granularity=PAGE, staging_size=128 * K,
                          lookahead=0, **kw)


def test_stats_shape():
    m = model()
    h = offload(m)
    m(torch.randn(2, 128))
    s = h.stats()
    assert set(s) == {"model", "device", "schedule", "governor",
                      "lend"}, set(s)
    assert s["lend"] == {"on": False, "bytes": 0, "loans": 0,
                         "returned": 0, "forced": 0,
                         "shrunk": 0}   # not on by default
    for k in vpager.STAT_NAMES:
        assert k in s["device"], k
        assert (k in s["model"]) == (k not in counters.DEVICE_ONLY), k
    for k in counters.MODEL_SIZES:
        assert k in s["model"], k
    assert "activation_headroom" in s["device"]
    assert s["model"]["weights"] == 12 and s["model"]["units"] == 6
    assert s["model"]["acquires"] == s["device"]["acquires"] >= 12
    h.unload()


def test_model_and_device_counters_one_meaning():
    """Two models on one device: each "model" counts its own, "device"
    their sum (the same name, the same meaning, another scope)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dev = vt.open_device("sim", budget=1 << 20, page_size=PAGE,
                             sim_granularity=PAGE, staging_size=128 * K,
                             lookahead=0)
    ma, mb = model(0), model(1)
    ha, hb = offload(ma, dev), offload(mb, dev)
    x = torch.randn(2, 128)
    for _ in range(2):
        ma(x)
        mb(x)
    sa, sb = ha.stats(), hb.stats()
    for k in ("acquires", "hits", "misses", "weight_fills", "fills",
              "pages_committed", "committed_bytes"):
        assert sa["device"][k] == sb["device"][k], k
        both = sa["model"][k] + sb["model"][k]
        if k in ("acquires", "hits", "misses", "weight_fills"):
            assert both == sa["device"][k], k
        else:   # the device's also count the staging ring's pages
            assert both < sa["device"][k], k
    d = counters.delta(hb.stats(), sb)
    assert d == {}, d
    mb(x)
    assert counters.delta(hb.stats(), sb)["acquires"] == 12
    assert counters.delta(ha.stats(), sa, "device")["acquires"] == 12
    ha.unload()
    hb.unload()
    dev.close()


def test_residency_map_and_page_flags():
    m = model()
    h = offload(m)
    m(torch.randn(2, 128))
    r, flags = h.residency(), h.page_flags()
    assert isinstance(r, str) and isinstance(flags, bytes)
    assert len(r) == len(flags) == h.vbar.size // PAGE
    assert set(r) <= set("#.P") and "#" in r, r
    assert r == counters.residency_map(flags)
    assert counters.residency_map(bytes([0, vpager.PAGE_RESIDENT,
                                         vpager.PAGE_RESIDENT |
                                         vpager.PAGE_PINNED])) == ".#P"
    h.unload()


def test_readme_documents_every_key():
    """python/README.md's stats() tables name every key."""
    with open(os.path.join(REPO, "python", "README.md")) as f:
        doc = f.read()
    keys = (list(vpager.STAT_NAMES) + list(counters.MODEL_SIZES)
            + ["activation_headroom", "model", "device", "schedule",
               "governor"])
    missing = [k for k in keys if "`%s`" % k not in doc]
    assert not missing, missing


def test_demo_explains_itself():
    """demo/torch_demo.py: each row's acquires = hits + fills + misses, and
    the resident weights named as they are (2 weight matrices and 8
    biases, not "5 of the 12 layers")."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    p = subprocess.run([sys.executable, os.path.join(REPO, "demo",
                                                      "torch_demo.py")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout, p.stderr)
    rows = re.findall(r"^\s+(\d)\s+(\d+)(?:\+(\d+))?\s+(\d+)\s+(\d+)\s+"
                      r"(\d+)\s", p.stdout, re.M)
    assert len(rows) == 5, p.stdout
    for i, acq, more, hits, fills, misses in rows:
        assert int(acq) + int(more or 0) == \
            int(hits) + int(fills) + int(misses), (i, p.stdout)
    assert "layers stay resident" not in p.stdout
    # Which weights stay resident comes from the schedule's measured
    # costs (10 on an idle machine: 2 weight matrices and 8 biases; 11 or
    # 12 on a busy one): the count and its parts agree, whatever it is.
    said = re.search(r"(\d+) of the 24 weights stay resident .*\n(\d+) of "
                     r"the 12 weight matrices and (\d+) of the 12 biases",
                     p.stdout)
    assert said, p.stdout
    n, mats, biases = map(int, said.groups())
    assert n == mats + biases and 0 < n <= 24, p.stdout


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
