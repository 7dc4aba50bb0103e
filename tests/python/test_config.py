"""offload()'s arguments and the VPAGER_* variables (issue 27): each value
checked once where it enters, errors naming the argument or variable the
user gave, a bad variable warned about once and its default kept (never a
feature turned off). Runs on the simulated device with CPU torch."""

import contextlib
import os
import subprocess
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

from _runner import raises, skip  # noqa: E402

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import vpager  # noqa: E402
from vpager import env  # noqa: E402
import vpager.torch as vt  # noqa: E402
from vpager.torch import ledger  # noqa: E402

K = 1 << 10
M = 1 << 20


@contextlib.contextmanager
def environ(**values):
    """os.environ with `values` set (None: unset), restored after; vpager's
    once-per-process warnings forgotten."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    env.reset_warnings()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def caught():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        yield w


def texts(w):
    return [str(x.message) for x in w]


def model(depth=4, width=128):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    return m.eval()


def offload(m, **kw):
    kw.setdefault("device", "sim")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the simulated-device note
        return vt.offload(m, **kw)


# ------------------------------------------------------------- vpager.env

def test_env_flag_word_size_count():
    with environ(VPAGER_SCHEDULE="off"):
        assert env.flag("VPAGER_SCHEDULE", True) is False
    with environ(VPAGER_SCHEDULE="YES"):
        assert env.flag("VPAGER_SCHEDULE", False) is True
    with environ(VPAGER_SCHEDULE=""):
        assert env.flag("VPAGER_SCHEDULE", True) is True
    with environ(VPAGER_ORDER="Tail"):
        assert env.word("VPAGER_ORDER") == "tail" and env.given("VPAGER_ORDER")
    with environ(VPAGER_LOOKAHEAD="64K"):
        assert env.size("VPAGER_LOOKAHEAD") == 64 * K
    with environ(VPAGER_COMPAT_THREADS="3"):
        assert env.count("VPAGER_COMPAT_THREADS") == 3
    raises(KeyError, env.flag, "VPAGER_NOT_DECLARED", True)


def test_env_bad_value_warns_once_and_keeps_default():
    """VPAGER_SCHEDULE=maybe: warned about once (naming it), the default
    (on) kept."""
    with environ(VPAGER_SCHEDULE="maybe"), caught() as w:
        for _ in range(3):
            assert env.flag("VPAGER_SCHEDULE", True) is True
    assert len(w) == 1, texts(w)
    assert "VPAGER_SCHEDULE='maybe'" in texts(w)[0], texts(w)
    assert "keeping the default" in texts(w)[0]
    with environ(VPAGER_COMPAT_THREADS="999"), caught() as w:
        assert env.count("VPAGER_COMPAT_THREADS") is None
    assert len(w) == 1 and "VPAGER_COMPAT_THREADS" in texts(w)[0]


def test_env_garbage_is_not_a_choice():
    """A bad VPAGER_ORDER (or empty) or VPAGER_PAGE_SIZE is not the user's
    choice: the schedule stays on (the C library warns about the value)."""
    for name, value in (("VPAGER_ORDER", "garbage"), ("VPAGER_ORDER", ""),
                        ("VPAGER_PAGE_SIZE", "abc"),
                        ("VPAGER_LOOKAHEAD", "soon"),
                        ("VPAGER_PAGE_SIZE", "3M")):
        with environ(**{name: value}):
            assert not env.given(name), (name, value)


def test_only_env_reads_the_environment():
    """Every VPAGER_* read of the Python layer is vpager/env.py's: no
    other os.environ/getenv read, but of a variable not vpager's ("OUT")
    or a bench's."""
    import re
    read = re.compile(r"os\.environ|getenv\(")
    other = re.compile(r"[\"'](?!VPAGER_)[A-Z][A-Z_]*[\"']")
    out = []
    for top in ("python", "integrations"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                path = os.path.join(root, f)
                # benches (bench_*.py) read their own settings
                if not f.endswith(".py") or f.startswith("bench_") or \
                        path.endswith(os.path.join("vpager", "env.py")):
                    continue
                with open(path) as fh:
                    for n, line in enumerate(fh, 1):
                        if read.search(line) and not other.search(line):
                            out.append("%s:%d" % (path, n))
    assert not out, out


def test_readme_table_names_every_variable():
    """python/README.md's one table of variables has every VPAGER_* the
    Python layer reads."""
    with open(os.path.join(REPO, "python", "README.md")) as f:
        doc = f.read()
    table = doc[doc.index("### Environment variables"):]
    missing = [n for n in env.VARIABLES if "`%s`" % n not in table]
    assert not missing, missing


# ------------------------------------------------- offload()'s arguments

def test_budget_errors_name_the_budget():
    for bad, why in ((-5, "above zero"), (0, "above zero"),
                     ("lots", "not a size"), (True, "not a size"),
                     (float("nan"), "not a size"), ([1], "not a size")):
        e = raises(ValueError, offload, model(), budget=bad)
        msg = str(e)
        assert "budget=%r" % (bad,) in msg and why in msg, msg
        assert "sim_capacity" not in msg, msg
    e = raises(ValueError, offload, model(), lookahead="x")
    assert "lookahead='x'" in str(e)


def test_order_is_checked_where_it_enters():
    e = raises(ValueError, offload, model(), order="random", budget="16M")
    assert "order='random' is not one of tail, interleaved" in str(e)


def test_order_keeps_the_simulated_pages():
    """Any order (even a valid one) kept the simulated device's 2 MiB pages
    off: order="tail", budget="16M" failed where no order works."""
    for kw in ({}, {"order": "tail"}, {"order": "interleaved"}):
        m = model()
        h = offload(m, budget="16M", **kw)
        assert h.device.page_size == 2 * M, (kw, h.device.page_size)
        m(torch.randn(2, 128))
        h.unload()


def test_page_size_larger_than_budget_names_both():
    e = raises(ValueError, offload, model(), budget="16M", page_size="1T")
    msg = str(e)
    assert "page_size (1 TiB)" in msg and "budget (16 MiB)" in msg, msg
    e = raises(ValueError, offload, model(), page_size="3M")
    assert "page_size='3M' is not a power of two" in str(e)
    e = raises(TypeError, offload, model(), page_sise="2M")
    assert "page_sise" in str(e)


def test_align_outside_schedule_checked():
    for kw, name in (({"align": 3}, "align=3"),
                     ({"outside": "disk"}, "'disk'"),
                     ({"schedule": "maybe"}, "'maybe'")):
        e = raises(ValueError, offload, model(), **kw)
        assert name in str(e), (kw, str(e))


def test_cuda_without_cuda_is_a_vpager_error():
    if torch.cuda.is_available():
        skip("torch has CUDA here")
    for device in ("cuda", "cuda:1", 0):
        e = raises(vpager.NoDeviceError, vt.offload, model(), device=device)
        msg = str(e)
        assert "no CUDA device" in msg and 'device="sim"' in msg, msg
    e = raises(ValueError, vt.offload, model(), device="tpu:0")
    assert "device='tpu:0' is not a device" in str(e)
    e = raises(vpager.NoDeviceError, vt.open_device, "cuda")
    assert "open_device: device='cuda'" in str(e) and 'device="sim"' in str(e)


def test_open_device_budget_named():
    e = raises(ValueError, vt.open_device, "sim", budget=-1)
    assert "open_device: budget=-1 is not a size above zero" in str(e)


def test_ledger_takes_sim():
    m = model()
    h = offload(m)
    assert [x["handle"] for x in ledger.models("sim")] == [h]
    assert ledger.models("cpu") == ledger.models("sim")
    e = raises(ValueError, ledger.models, "tpu")
    assert "device='tpu'" in str(e)
    h.unload()


def test_training_mode_says_requires_grad_is_off():
    from vpager.torch import config
    config._WARNED.discard("requires_grad")
    m = model().train()
    with caught() as w:
        h = vt.offload(m, device="sim")
    said = [t for t in texts(w) if "require grad" in t]
    assert len(said) == 1 and ".eval()" in said[0], texts(w)
    assert "element 0 of tensors does not require grad" in said[0]
    h.unload()
    assert all(p.requires_grad for p in m.parameters())
    config._WARNED.discard("requires_grad")
    with caught() as w:                 # eval(): inference, no warning
        h = vt.offload(model(), device="sim")
    assert not [t for t in texts(w) if "require grad" in t], texts(w)
    h.unload()


def test_budget_above_the_device_warns_once():
    from vpager.torch import config
    config._WARNED.clear()
    with caught() as w:
        for _ in range(2):
            h = vt.offload(model(), device="sim", budget="1G",
                           sim_capacity="64M")
            h.unload()
    said = [t for t in texts(w) if "more than the device" in t]
    assert len(said) == 1, texts(w)
    assert "budget=%d" % (1 << 30) in said[0] and "%d" % (64 * M) in said[0]
    assert "(1 GiB)" in said[0] and "(64 MiB)" in said[0], said
    config._WARNED.clear()
    with caught() as w:
        dev = vt.open_device("sim", budget="2G", sim_capacity="64M")
        dev.close()
    said = [t for t in texts(w) if "more than the device" in t]
    assert len(said) == 1 and "open_device: budget=" in said[0], texts(w)


# -------------------------------------------- variables, fresh processes

def _run(code, **values):
    e = dict(os.environ)
    e.update(values)
    e["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(REPO, "python"), e.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", code], env=e,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout, p.stderr)
    return p.stdout, p.stderr


_SCHEDULED = (
    "import warnings, torch, vpager.torch as vt\n"
    "warnings.simplefilter('default')\n"
    "torch.manual_seed(0)\n"
    "m = torch.nn.Sequential(*[torch.nn.Linear(128, 128)\n"
    "                          for _ in range(4)]).eval()\n"
    "h = vt.offload(m, device='sim', budget='16M')\n"
    "for _ in range(3): m(torch.randn(2, 128))\n"
    "print(h.order, h.device.page_size)\n")


def test_bad_variables_keep_the_schedule_and_warn_once():
    """VPAGER_ORDER garbage or empty, VPAGER_PAGE_SIZE=abc: the model is
    still scheduled on 2 MiB pages, each variable warned about once."""
    for name, value in (("VPAGER_ORDER", "garbage"), ("VPAGER_ORDER", ""),
                        ("VPAGER_PAGE_SIZE", "abc")):
        out, err = _run(_SCHEDULED, **{name: value})
        assert out.split() == ["scheduled", str(2 * M)], (name, out, err)
        assert err.count(name) == 1, (name, err)


def test_bad_sim_variables_warn_and_keep_the_default():
    """VPAGER_SIM_CAPACITY=0 and VPAGER_SIM_GRANULARITY=3M opened nothing
    ("no usable device could be opened", naming no variable)."""
    out, err = _run(_SCHEDULED, VPAGER_SIM_CAPACITY="0",
                    VPAGER_SIM_GRANULARITY="3M")
    assert out.split()[0] == "scheduled", (out, err)
    assert err.count("VPAGER_SIM_CAPACITY=0") == 1, err
    assert err.count("VPAGER_SIM_GRANULARITY=3M") == 1, err
    out, err = _run(_SCHEDULED, VPAGER_SCHEDULE="maybe")
    assert out.split()[0] == "scheduled", (out, err)
    assert err.count("VPAGER_SCHEDULE='maybe'") == 1, err


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
