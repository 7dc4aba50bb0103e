"""The machine's pinned-host budget from Python, on the simulated device:
a model offloads and runs bitwise when the budget is tiny (its host copy
stays pageable), the Governor is the one writer of the budget, and the
drop-in's HostBuffer degrades the same way.

    make && PYTHONPATH=python python3 tests/python/test_pins.py
"""

import copy
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python", "python/compat")

import vpager  # noqa: E402
from vpager.governor import governor  # noqa: E402

try:
    import torch
    from torch import nn
except ImportError:         # pragma: no cover - depends on the machine
    torch = None

K = 1 << 10
PAGE = 64 * K


def sim_opts(**kw):
    opts = dict(page_size=PAGE, sim_granularity=PAGE, lookahead=0,
                sim_shared="", sim_streams="sync")
    opts.update(kw)
    return opts


def ledger_name(what):
    return "vpp-py-%s-%d" % (what, os.getpid())


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256),
                         nn.ReLU(), nn.Linear(256, 64))


def frozen(m):
    ref = copy.deepcopy(m)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def test_tiny_pin_budget_offloads_bitwise():
    """A budget of one page, shared by name: the host copy stays pageable,
    every forward is bitwise equal, nothing past the budget is pinned."""
    if torch is None:
        _runner.skip("torch is not importable")
    import vpager.torch as vt
    m = model().eval()
    ref = frozen(m)
    x = torch.randn(4, 64)
    want = ref(x)
    with warnings.catch_warnings():     # "the simulated device" notice
        warnings.simplefilter("ignore", RuntimeWarning)
        h = vt.offload(m, device="sim", budget=12 * PAGE,
                       staging_size=5 * PAGE,
                       **sim_opts(pin_budget=PAGE, ledger=ledger_name("tiny")))
    for _ in range(4):
        assert torch.equal(m(x), want)
    dev = h.stats()["device"]
    assert dev["machine_pinned_bytes"] <= PAGE, dev
    assert dev["pin_fallback_bytes"] > 0, dev
    assert "machine_pinned_bytes" not in h.stats()["model"]
    h.unload()


def test_governor_writes_the_machines_pin_budget():
    """declare_pin_budget is the Governor's input: 0 pins nothing more, a
    HostBuf still works pageable, and a model offloaded then runs
    bitwise; the Governor's stats show it."""
    name = ledger_name("gov")
    with vpager.Device(backend="sim", ledger=name, pin_budget=64 * PAGE,
                       **sim_opts()) as dev:
        gov = governor(dev)
        gov.declare_pin_budget(0)
        assert gov.stats()["pin_budget"] == 0
        assert gov.stats()["inputs"]["user_pin_budget"] == 0
        hb = dev.alloc_hostbuf(4 * PAGE)
        assert hb.pinned_bytes == 0
        hb.view()[:4] = b"abcd"
        assert bytes(hb.view()[:4]) == b"abcd"
        hb.close()
        gov.declare_pin_budget(8 * PAGE)
        hb = dev.alloc_hostbuf(4 * PAGE)
        assert hb.pinned_bytes == 4 * PAGE
        assert dev.stats()["machine_pinned_bytes"] == 4 * PAGE
        hb.close()
        try:
            gov.declare_pin_budget(-1)
        except ValueError:
            pass
        else:
            raise AssertionError("a negative pin budget was taken")


def test_compat_host_buffer_without_pinned_memory():
    """The drop-in's HostBuffer registers its parts through vpager: with
    nothing left to pin they stay pageable and usable."""
    try:
        from comfy_aimdo import host_buffer
    except ImportError as e:  # pragma: no cover - depends on the machine
        _runner.skip("comfy_aimdo: %s" % e)
    with vpager.Device(backend="sim", pin_budget=PAGE, ledger="off",
                       **sim_opts()) as dev:
        orig = host_buffer._pin_device
        host_buffer._pin_device = lambda: dev
        try:
            buf = host_buffer.HostBuffer(4 * PAGE)
            assert dev.stats()["pinned_bytes"] == 0
            assert dev.stats()["machine_pinned_bytes"] <= PAGE
            assert dev.stats()["pin_fallback_bytes"] >= 4 * PAGE
            buf.truncate(0)
        finally:
            host_buffer._pin_device = orig


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
