"""What the Python tests share: raises(), skip(), and a plain runner for
machines without pytest. Each test file ends with

    if __name__ == "__main__":
        sys.exit(_runner.main(globals()))

main() runs every test_* function of the file in file order (arguments
select tests by substring) and closes with pytest's kind of line:
"N passed, N failed" (", N skipped" when some were). Under pytest the
same files run as usual and skip() is pytest.skip().
"""

import os
import sys
import time
import traceback

# The repository's root (this file is tests/python/_runner.py).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_PLAIN = []     # non-empty while main() runs the tests
# Schedules planned on the forward's thread, at the measured forward's
# end, so a test knows which forward they land at (vpager.torch.tuner;
# test_plan_thread.py turns the planner's thread on).
os.environ.setdefault("VPAGER_PLAN_THREAD", "0")
# A placement in one forward (the default too), so a test knows what the
# forward after a plan copies (whether a plan moves in steps hangs on the times measured:
# the host clock's); test_replan.py's step test turns steps on.
os.environ.setdefault("VPAGER_PLACE_STEPS", "0")
# No plan remembered from another test or run (plancache.py: on by
# default, in the user's cache folder); its tests name a folder.
os.environ.setdefault("VPAGER_PLAN_CACHE", "off")


def add_paths(*folders):
    """Put these folders of the repository ("python", "python/compat",
    "integrations") at the front of sys.path, the first named first
    (each once); returns REPO. A test file's preamble:

        HERE = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, HERE)
        import _runner
        REPO = _runner.add_paths("python")
    """
    for f in reversed(folders):
        p = os.path.join(REPO, *f.split("/"))
        if p not in sys.path:
            sys.path.insert(0, p)
    return REPO


def require_torch(module_name):
    """torch, for a test file that needs it (call at import, with the
    file's __name__). Without torch: under pytest the module is skipped;
    run as a script, the runner's "skipped" line is printed and the
    process exits 0; imported otherwise, the ImportError."""
    try:
        import torch
        return torch
    except ImportError:
        if "pytest" in sys.modules:
            import pytest
            pytest.skip("torch is not importable", allow_module_level=True)
        if module_name == "__main__":
            sys.exit(main({}, unavailable="torch is not importable"))
        raise


class Skipped(Exception):
    pass


def skip(why):
    """Skip the running test: pytest.skip under pytest, else Skipped."""
    if not _PLAIN and "pytest" in sys.modules:
        import pytest
        pytest.skip(why)
    raise Skipped(why)


def raises(exc, fn, *args, **kw):
    """The exception fn(*args, **kw) raised, which must be an exc."""
    try:
        fn(*args, **kw)
    except exc as e:
        return e
    raise AssertionError("%s did not raise %s" % (fn, exc.__name__))


def _run(name, fn, timing, counts):
    t0 = time.perf_counter()
    try:
        fn()
    except Skipped as e:
        counts["skipped"] += 1
        print("skip %s: %s" % (name, e))
    except Exception:
        counts["failed"] += 1
        print("FAIL %s" % name)
        traceback.print_exc()
    else:
        counts["passed"] += 1
        print("ok   %s%s" % (name, " (%.2fs)" % (time.perf_counter() - t0)
                              if timing else ""))


def main(namespace, timing=False, after_each=None, after_all=None,
         unavailable=None):
    """Run the test_* functions of `namespace` (a test file's globals());
    returns the exit status. timing: print each test's time; after_each,
    after_all: called after each test and after the last; unavailable: a
    reason to run nothing (counted as a pass of nothing)."""
    if unavailable:
        print("0 passed, 0 failed (%s: skipped)" % unavailable)
        return 0
    tests = [(n, f) for n, f in list(namespace.items())
             if n.startswith("test_") and callable(f)]
    only = sys.argv[1:]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    _PLAIN.append(True)
    try:
        for name, fn in tests:
            if only and not any(o in name for o in only):
                continue
            _run(name, fn, timing, counts)
            if after_each is not None:
                after_each()
        if after_all is not None:
            after_all()
    finally:
        _PLAIN.pop()
    print("%(passed)d passed, %(failed)d failed" % counts + (
        ", %d skipped" % counts["skipped"] if counts["skipped"] else ""))
    return 1 if counts["failed"] else 0
