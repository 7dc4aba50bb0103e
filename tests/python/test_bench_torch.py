"""bench/bench_torch.py --dry-run on the simulated device (CI): the issue-13
sections (4. Flux-class DiT, 5. small weights with the hand-written
streamer, 6. the Llama decoder at three budgets) run at tiny sizes without
an error, report every budget, and their outputs are bitwise equal to the
all-resident model's. No figure is checked: timing belongs to bench/.

    PYTHONPATH=python VPAGER_LIBRARY=build/libvpager.so \\
        /usr/bin/python3 tests/python/test_bench_torch.py
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import _runner

REPO = _runner.REPO


def have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _run(only):
    out = tempfile.mkdtemp()
    try:
        env = dict(os.environ, OUT=out, PYTHONUNBUFFERED="1")
        env.pop("VPAGER_BACKEND", None)
        r = subprocess.run(
            [sys.executable, os.path.join(REPO, "bench", "bench_torch.py"),
             "--dry-run", "--only", only, "--iters", "2"],
            env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
        with open(os.path.join(out, "bench_torch.json")) as f:
            return json.load(f), r.stdout
    finally:
        shutil.rmtree(out, ignore_errors=True)


FRACS = ("1/3", "1/2", "2/3")


def test_issue13_sections_dry_run():
    if not have_torch():
        _runner.skip("torch is not importable")
    res, log = _run("4,5,6")
    assert "errors" not in res, res["errors"]
    assert "FAILED" not in log, log[-3000:]
    for name in ("flux", "small"):
        sec = res[name]
        assert sec["resident_ms"] > 0
        for fn in FRACS:
            r = sec[fn]
            assert "error" not in r, r["error"]
            assert r["equal"], (name, fn)
            assert r["copied_bytes"] > 0, (name, fn)
            assert r["limit_ms"] >= sec["resident_ms"]
            held = r["held"]        # acquired together, once
            if held:
                assert r["held_pair"]["ratio"] > 0, r
            assert r["wait_ms"] >= 0 and \
                r["waits_probed"] == r["units"] - held + (held > 0), r
            # on the CPU the wait is host time around the acquires
            assert 0 < r["wait_host_ms"] <= r["wait_ms"], r
    for fn in FRACS:
        h = res["small"]["hand"][fn]
        assert h["equal"] and h["streamed"] > 0
        assert "vs_hand" in res["small"][fn]
        # the hand streamer calling a module per layer: equal, paired
        assert h["modules"]["equal"] and h["modules"]["vs_hand"] > 0
        assert res["small"][fn]["vs_hand_modules"] > 0
    ll = res["llama3"]
    for fn in FRACS:
        r = ll[fn]
        assert "error" not in r, r["error"]
        assert r["equal"], r["same"]
        assert r["prefill_vs_limit"] > 0 and r["decode_vs_limit"] > 0
        assert r["prefill_bytes"] > 0 and r["decode_bytes"] > 0
    names = [t["name"] for t in res["targets"]]
    assert any(n.startswith("5. small weights at 2/3") for n in names)


def test_existing_sections_dry_run():
    """Sections 1-3 (the existing CLI) still run."""
    if not have_torch():
        _runner.skip("torch is not importable")
    res, log = _run("1,2,3")
    assert "errors" not in res, res["errors"]
    assert "hotpath" in res and "llama" in res and "dit" in res


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
