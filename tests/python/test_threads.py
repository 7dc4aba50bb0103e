"""Threads sharing one offloaded model (python/README.md, "Threads"):
forwards of one model run one at a time, so every output is bitwise the
single-threaded one, whatever the threads call (the root, a submodule)
and whatever the handle changes between forwards. On CUDA when torch has
it, else on the simulated device (worker streams, prefetch on).
    make && PYTHONPATH=python python3 tests/python/test_threads.py
"""
import copy
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import vpager.torch as vt  # noqa: E402

THREADS = 4
CALLS = 50          # forwards a thread
WIDTH = 512         # 1 MiB of float32 weights a layer
DEPTH = 8


def target():
    return "cuda" if torch.cuda.is_available() else "cpu"


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]
                         ).eval()


def offload(m):
    """Half the weights fit: the rest streams through the ring."""
    half = DEPTH * WIDTH * WIDTH * 4 // 2
    if target() == "cuda":
        return vt.offload(m, device="cuda", budget=half, page_size="2M",
                          staging_size="4M")
    return vt.offload(m, device="cpu", budget=half, page_size="2M",
                      sim_streams="worker", lookahead="4M")


def inputs(n=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, WIDTH, generator=g).to(target())
            for _ in range(n)]


def run_threads(work):
    """work(t) on THREADS threads; the exceptions they raised."""
    errors = []

    def body(t):
        try:
            with torch.no_grad():
                work(t)
        except BaseException as e:     # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=body, args=(t,)) for t in range(THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def check(m, ref, calls):
    """calls(t, i) -> (module path, input index) for thread t's call i;
    every output bitwise the resident reference's."""
    xs = inputs()
    with torch.no_grad():
        want = {}
        for t in range(THREADS):
            for i in range(CALLS):
                k = calls(t, i)
                if k not in want:
                    want[k] = submodule(ref, k[0])(xs[k[1]])
    wrong = []

    def work(t):
        for i in range(CALLS):
            k = calls(t, i)
            y = submodule(m, k[0])(xs[k[1]])
            if not torch.equal(y, want[k]):
                wrong.append((t, i, k))

    errors = run_threads(work)
    assert not errors, errors[0]
    assert not wrong, "%d of %d outputs wrong, first %r" % (
        len(wrong), THREADS * CALLS, wrong[0])


def submodule(m, path):
    return m.get_submodule(path) if path else m


def test_threads_share_one_model():
    m = model()
    ref = copy.deepcopy(m).to(target())
    h = offload(m)
    check(m, ref, lambda t, i: ("", (t + i) % 8))
    h.unload()


def test_threads_call_submodules_and_the_root():
    """One thread calls layers of the model directly while the others
    run the whole model (its held units included)."""
    m = model(2)
    ref = copy.deepcopy(m).to(target())
    h = offload(m)
    with torch.no_grad():       # let the schedule settle first
        for x in inputs(3):
            m(x)
    check(m, ref, lambda t, i: (str(i % DEPTH) if t == 0 else "",
                                (t * 3 + i) % 8))
    h.unload()


def test_handle_changes_between_forwards_of_other_threads():
    """A thread gives a layer new bytes and back, and frees memory,
    while the others run forwards: each forward sees one version."""
    m = model(3)
    ref = copy.deepcopy(m).to(target())
    h = offload(m)
    name = "3.weight"
    new = torch.randn(WIDTH, WIDTH, generator=torch.Generator()
                      .manual_seed(9))
    alt = copy.deepcopy(ref)
    with torch.no_grad():
        alt[3].weight.copy_(new.to(target()))
    xs = inputs()
    with torch.no_grad():
        want = [(ref(x), alt(x)) for x in xs]
    wrong = []
    flips = []

    def work(t):
        if t == 0:
            for i in range(CALLS // 5):
                h.set_source(name, new if i % 2 == 0 else None)
                flips.append(i)
                h.free_memory(1 << 20)
            return
        for i in range(CALLS):
            k = (t + i) % 8
            y = m(xs[k])
            if not (torch.equal(y, want[k][0]) or torch.equal(y, want[k][1])):
                wrong.append((t, i))

    errors = run_threads(work)
    assert not errors, errors[0]
    assert not wrong, "%d outputs match neither version" % len(wrong)
    assert len(flips) == CALLS // 5
    h.unload()


if __name__ == "__main__":
    sys.exit(_runner.main(globals(), timing=True))
