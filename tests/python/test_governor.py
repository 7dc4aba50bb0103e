"""Tests of vpager.governor: one Governor per device, the only writer of
its limit, headroom and lookahead, on the simulated device.

    make && PYTHONPATH=python:integrations python3 tests/python/test_governor.py

The last tests need torch (they skip without it).
"""

import logging
import os
import re
import sys
import time

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
    """Only the Governor writes a device's limit, headroom, shared
    headroom, lookahead and pin budget: every call of the setters in python/ and integrations/ is in
    python/vpager/governor.py (the binding defines them)."""
    pat = re.compile(
        r"\.set_(limit|headroom|shared_headroom|lookahead|pin_budget)\(")
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


def test_two_threads_leave_the_device_as_recorded():
    """Two models on one device declare from their own threads (each
    under its own model's lock only): a write overtaken by the other's
    leaves what the Governor records the device's setting (else it
    would skip the write that puts the device right)."""
    import threading
    from vpager.governor import Governor

    class Dev:
        closed = False
        options = {"lookahead": 0}

        def __init__(self):
            self.headroom = self.shared = 0
            self.stall = threading.Event()
            self.in_first = threading.Event()

        def info(self):
            return {"headroom": 0}

        def set_shared_headroom(self, n):
            self.shared = n

        def set_headroom(self, n):
            self.headroom = n
            if n == PAGE:           # the first writer, slow to return
                self.in_first.set()
                self.stall.wait(0.5)

    dev = Dev()
    gov = Governor(dev)
    a = threading.Thread(target=gov.declare_headroom, args=(PAGE,))
    b = threading.Thread(target=gov.declare_headroom, args=(2 * PAGE,))
    a.start()
    assert dev.in_first.wait(5)
    b.start()
    b.join(0.1)                     # done by now unless it waits for a
    dev.stall.set()
    a.join(5)
    b.join(5)
    assert gov.headroom == dev.headroom == 2 * PAGE, (gov.headroom,
                                                      dev.headroom)
    assert gov.shared_headroom == dev.shared == 2 * PAGE


def test_a_masked_torch_peak_reads_as_the_one_before():
    """mask_torch_peak: torch's counter, raised by vpager's own work, reads
    as the peak before it (or what torch holds, if more) until it moves;
    a higher counter or a client's reset ends it."""
    dev = sim()
    try:
        gov = governor(dev)
        gov.declare_torch(100 * M, 900 * M)     # read between the two
        gov.mask_torch_peak(900 * M, 300 * M)
        assert gov.torch.peak == 300 * M
        assert gov.peak_seen(900 * M) == 300 * M    # a fill's read of it
        assert gov.peak_seen(950 * M) == 950 * M
        gov.declare_torch(100 * M, 900 * M)
        assert gov.torch.peak == 300 * M and gov.learned == 200 * M + 15 * M
        gov.declare_torch(500 * M, 900 * M)     # torch holds more now
        assert gov.torch.peak == 500 * M
        gov.declare_torch(100 * M, 200 * M)     # a client reset the counter
        assert gov.torch_mask is None and gov.torch.peak == 500 * M
        gov.declare_torch(100 * M, 900 * M)     # a real peak now
        assert gov.torch.peak == 900 * M
        gov.mask_torch_peak(950 * M, 900 * M)
        # The work's peak read, then a client's reset of the counter
        # before the work's end: the peak is the one before it still.
        gov.declare_torch(100 * M, 1900 * M)
        gov.mask_torch_peak(150 * M, 900 * M)
        assert gov.torch.peak == 900 * M
        assert gov.peak_seen(150 * M) == 900 * M
        gov.declare_torch(100 * M, 150 * M)
        assert gov.torch.peak == 900 * M
        gov.forget_torch_peak()
        assert gov.torch_mask is None
    finally:
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


def test_the_margin_settles_while_torchs_peak_holds():
    """The margin is 5% of torch's peak while the peak still rises, 1%
    once STEADY_READS reads in a row found it where it was (the limit and
    the learned headroom give the weights the rest), 5% again when it
    rises; an OOM margin stays above both."""
    from vpager import governor as G
    dev = sim()
    try:
        gov = governor(dev)
        gov.declare_flags(0, 5000 * M)
        gov.declare_torch(600 * M, 900 * M)
        assert gov.margin() == 900 * M // 20
        for _ in range(G.STEADY_READS - 1):
            gov.declare_torch(600 * M, 900 * M)
        assert gov.margin() == 900 * M // 20
        assert gov.limit == 5000 * M - 900 * M - 900 * M // 20
        gov.declare_torch(300 * M, 900 * M)     # (what it holds may move)
        assert gov.steady_reads == G.STEADY_READS
        assert gov.margin() == 900 * M // 100
        assert gov.limit == 5000 * M - 900 * M - 900 * M // 100
        assert gov.learned == 600 * M + 900 * M // 100
        assert gov.stats()["margin"] == 900 * M // 100
        gov.declare_torch(600 * M, 950 * M)     # a higher peak: 5% again
        assert gov.steady_reads == 0
        assert gov.margin() == 950 * M // 20
        assert gov.limit == 5000 * M - 950 * M - 950 * M // 20
        for _ in range(G.STEADY_READS):
            gov.declare_torch(600 * M, 950 * M)
        assert gov.margin() == 950 * M // 100
        gov.raise_oom_margin()
        gov.declare_torch(600 * M, 950 * M)
        assert gov.margin() == 512 * M
        gov.forget_torch_peak()
        assert gov.steady_reads == 0
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


# ------------------------------------------------ room for the desktop

def shared_pair(name):
    """Two device handles on one shared simulated GPU of 64 pages (two
    participants of its ledger, as two processes would be), no headroom
    given: the first serves a Linux desktop (its default headroom: the
    quarter of the device that caps the GPU figure, 16 pages), the second
    none (the sim's default, 0). Free memory is polled at every check:
    each sees the other's commits at once."""
    a = sim(sim_shared=name, poll_interval_us=0)
    a.sim_inject(vpager.SIM_SET_DESKTOP, 1)
    b = sim(sim_shared=name, poll_interval_us=0)
    return a, b


def reread(dev):
    """A publishing call after the ledger's reread interval (100 ms): the
    peers' shared headroom read again."""
    time.sleep(0.12)
    v = dev.create_vbar(PAGE)
    v.close()


def fill(dev, pages):
    """Fault (pinned) pages one by one until one misses; returns the VBAR
    and how many became resident."""
    v = dev.create_vbar(pages * PAGE)
    n = 0
    while n < pages and v.fault(n * PAGE, PAGE, gens=False)[0]:
        n += 1
    return v, n


def test_default_headroom_shared_by_two_devices():
    """With no budget flags the default headroom is kept by both: the
    device given none keeps the other's, and the device ends with the
    default free (issue 29: 99.8% used before)."""
    a, b = shared_pair("vpg-two-%d" % os.getpid())
    try:
        ga, gb = governor(a), governor(b)
        assert ga.user_headroom == 16 * PAGE and gb.user_headroom == 0
        ga.declare_torch(0, 0)          # a forward: the Governor shares
        assert ga.stats()["shared_headroom"] == 16 * PAGE
        assert b.info()["kept_free"] == 16 * PAGE
        va, na = fill(a, 30)
        vb, nb = fill(b, 64)
        assert (na, nb) == (30, 64 - 30 - 16), (na, nb)
        assert b.info()["free_memory"] == 16 * PAGE
        va.unpin(0, na * PAGE)
        vb.unpin(0, nb * PAGE)
        va.close()
        vb.close()
    finally:
        b.close()
        a.close()


def test_user_flags_override_the_default_headroom():
    """The user's headroom (the drop-in's init_device) and the node's
    --vram-headroom replace or add to the default in what the device
    shares; --reserve-vram (its reserve) replaces it; learned torch
    growth is never shared."""
    a, b = shared_pair("vpg-flags-%d" % os.getpid())
    try:
        ga = governor(a)
        ga.declare_headroom(3 * PAGE)           # the user's
        assert ga.stats()["shared_headroom"] == 3 * PAGE
        reread(b)
        assert b.info()["kept_free"] == 3 * PAGE
        ga.declare_torch(0, 20 * PAGE)          # learned: a's own
        assert ga.headroom > 20 * PAGE
        assert ga.stats()["shared_headroom"] == 3 * PAGE
        assert a.info()["shared_headroom"] == 3 * PAGE
        reread(b)
        assert b.info()["kept_free"] == 3 * PAGE
        # The node, --vram-headroom: the flags' headroom is shared.
        ga.declare_flags(16 * PAGE + 2 * PAGE, None)
        assert ga.stats()["shared_headroom"] == 18 * PAGE
        # The node, --reserve-vram: its reserve replaces the default.
        ga.declare_flags(0, 40 * PAGE, reserve=PAGE)
        st = ga.stats()
        assert st["shared_headroom"] == PAGE
        assert st["inputs"]["host_reserve"] == PAGE
        assert st["headroom"] == ga.learned     # no default added
        reread(b)
        assert b.info()["kept_free"] == PAGE
    finally:
        b.close()
        a.close()
    # A budget alone leaves the default where it is.
    a = sim()
    try:
        a.sim_inject(vpager.SIM_SET_DESKTOP, 2)
        g = governor(a)
        g.declare_budget(20 * PAGE)
        g.declare_torch(0, 0)
        assert g.headroom == 16 * PAGE and a.info()["kept_free"] == 16 * PAGE
    finally:
        a.close()



def test_bench_headroom_dry_run():
    """bench/bench_headroom.py --dry-run: two processes with no budget
    flags on a shared simulated device serving a desktop leave its
    default headroom free all along (issue 29's row)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        _runner.skip("needs torch")
    import subprocess
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    out = subprocess.run([sys.executable,
                          os.path.join(REPO, "bench", "bench_headroom.py"),
                          "--dry-run", "--seconds", "0.5"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "least free / default headroom" in out.stdout
    assert "MET" in out.stdout, out.stdout


def test_bench_headroom_limit():
    """bench/bench_headroom.py stops workers that run past --limit: each
    prints its threads' stacks (faulthandler, SIGUSR1), is stopped, and
    the run fails saying so, long before their forwards would end. On
    the H100 the workers spent minutes making their weights and the
    driver, silent until they end, looked hung until killed from
    outside, with nothing to say where."""
    try:
        import torch  # noqa: F401
    except ImportError:
        _runner.skip("needs torch")
    import subprocess
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(REPO, "python")
    name = "test-limit-%d" % os.getpid()
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable,
                              os.path.join(REPO, "bench",
                                           "bench_headroom.py"),
                              "--dry-run", "--seconds", "120", "--limit",
                              "6", "--name", name],
                             env=env, capture_output=True, text=True,
                             timeout=100)
    finally:
        # The stopped workers never left their shared device, ledger
        # and pin segments (POSIX shared memory, named after --name).
        if os.path.isdir("/dev/shm"):
            for f in os.listdir("/dev/shm"):
                if f.startswith("vpager-") and f.endswith(name):
                    os.unlink(os.path.join("/dev/shm", f))
    took = time.monotonic() - t0
    assert out.returncode != 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "within --limit 6 s" in out.stderr, out.stderr[-2000:]
    assert took < 60, took          # not the 120 s of forwards
    if "did not end" in out.stderr:     # they had started: their stacks
        assert "most recent call first" in out.stderr, out.stderr[-2000:]
        assert "bench_headroom.py" in out.stderr, out.stderr[-2000:]


def test_bench_headroom_fill_weights():
    """bench_headroom's weights: N(0, 1/width) in the model's dtype,
    drawn in float32 on the device given (a GPU in the bench: torch's CPU
    normal_ for float16 is a serial scalar loop, ~2 s an 8192x8192 layer,
    minutes for the bench's 8 GiB models)."""
    try:
        import torch
    except ImportError:
        _runner.skip("needs torch")
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        import bench_headroom
    finally:
        sys.path.remove(os.path.join(REPO, "bench"))
    width = 256
    model = torch.nn.Sequential(*[
        torch.nn.utils.skip_init(torch.nn.Linear, width, width, bias=False,
                                 dtype=torch.float16) for _ in range(3)])
    for p in model.parameters():
        p.data.fill_(float("nan"))
    bench_headroom.fill_weights(model, width, torch.device("cpu"))
    ws = [p.detach().float() for p in model.parameters()]
    for p, w in zip(model.parameters(), ws):
        assert p.dtype == torch.float16
        assert torch.isfinite(w).all()
        assert abs(w.std().item() * width ** 0.5 - 1) < 0.05, w.std()
        assert abs(w.mean().item()) < 0.01
    assert not torch.equal(ws[0], ws[1])

if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
