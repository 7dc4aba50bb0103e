"""Progress while offload() copies a large model (issue 27): a bar on a
terminal, one line otherwise, nothing for a short copy; VPAGER_PROGRESS
forces it on or off. CPU torch, the simulated device."""

import io
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

_runner.require_torch(__name__)

from vpager.torch import progress  # noqa: E402

GiB = 1 << 30


class Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _env(value):
    old = os.environ.pop("VPAGER_PROGRESS", None)
    if value is not None:
        os.environ["VPAGER_PROGRESS"] = value
    return old


def _restore(old):
    os.environ.pop("VPAGER_PROGRESS", None)
    if old is not None:
        os.environ["VPAGER_PROGRESS"] = old


def run(total, steps, tty, seconds, value=None):
    """Advance `total` bytes in `steps` over `seconds`; what was written."""
    old = _env(value)
    try:
        out, clock = Stream(tty), Clock()
        p = progress.Progress(total, "copying", stream=out, clock=clock)
        for _ in range(steps):
            clock.t += seconds / steps
            p.advance(total // steps)
        p.close()
        return out.getvalue()
    finally:
        _restore(old)


def test_large_copy_on_a_terminal_draws_a_bar():
    out = run(4 * GiB, 32, tty=True, seconds=8.0)
    assert out.count("\r") > 10, out           # redrawn as it goes
    assert out.endswith("\n") and out.count("\n") == 1, out
    last = out.split("\r")[-1]
    assert "[" + "#" * 30 + "]" in last and "100%" in last, last
    assert "4.0 GiB/4.0 GiB" in last and "8.0 s" in last, last


def test_large_copy_elsewhere_is_one_line():
    out = run(4 * GiB, 40, tty=False, seconds=8.0)
    assert out == "copying: 4.0 GiB in 8.0 s (512 MiB/s)\n", out


def test_short_copy_says_nothing():
    assert run(64 << 20, 8, tty=True, seconds=0.1) == ""
    assert run(64 << 20, 8, tty=False, seconds=0.1) == ""


def test_slow_small_copy_is_shown():
    out = run(256 << 20, 8, tty=False, seconds=3.0)
    assert out.startswith("copying: 256 MiB in 3.0 s"), out


def test_forced_on_and_off():
    assert run(4 * GiB, 4, tty=False, seconds=8.0, value="0") == ""
    assert run(1 << 20, 4, tty=False, seconds=0.01, value="1") != ""


def test_offload_reports_its_copy():
    """offload() with VPAGER_PROGRESS=1, stderr not a terminal: one line
    naming the copy."""
    code = ("import warnings, torch, vpager.torch as vt\n"
            "warnings.simplefilter('ignore')\n"
            "m = torch.nn.Sequential(torch.nn.Linear(256, 256)).eval()\n"
            "vt.offload(m, device='sim').unload()\n")
    env = dict(os.environ, VPAGER_PROGRESS="1",
               PYTHONPATH=os.path.join(REPO, "python"))
    p = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if "copying the weights" in x]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("vpager.torch.offload: copying the weights "
                               "to pinned host memory: "), lines


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
