"""One copy of a model in host memory (issue 28): weights over a mapped
file stay where they are (in place or read from the file), the RAM-aware
policy's choices (a fake small RAM, a slow disk), outputs bitwise in each
source kind, and what offload() adds to the process's RSS.
    make && PYTHONPATH=python python3 tests/python/test_hostmem.py
Needs torch (Debian's python3-torch 1.13); skipped without it."""
import contextlib
import gc
import logging
import mmap
import os
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

REPO = _runner.add_paths("python")
torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import vpager.torch as vt  # noqa: E402
from vpager.torch import hostpolicy  # noqa: E402
from test_torch import (frozen_copy, offload_sim,  # noqa: E402
                        write_safetensors)

K, M = 1 << 10, 1 << 20
GiB = 1 << 30


def mlp(width=256, depth=6, seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    m = nn.Sequential(*layers).eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def map_into(model, path, writable=False):
    """The model's parameters become tensors over a mapping of `path` (as
    safetensors' safe_open maps it read-only; writable: a private
    read-write mapping, as torch's from_file and ComfyUI's loader make)."""
    where = write_safetensors(path, model.state_dict())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable
                                              else 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a read-only buffer
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    for name, p in model.named_parameters():
        at, n = where[name], p.numel() * p.element_size()
        p.data = flat[at:at + n].view(p.dtype).view(p.shape)
    return mm


def rss(key="VmRSS:"):
    """The process's RSS (key "VmHWM:": its peak), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * K
    return 0


@contextlib.contextmanager
def mapped_model(writable=False, **kw):
    with tempfile.TemporaryDirectory() as tmp:
        m = mlp(**kw)
        map_into(m, os.path.join(tmp, "m.safetensors"), writable)
        yield m


def run_bitwise(m, kind, **kw):
    x = torch.randn(8, m[0].in_features)
    with torch.no_grad():
        want = m(x).clone()
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    h = offload_sim(m, 768 * K, 320 * K, **kw)
    s = h.stats()["model"]
    assert s["host_by_kind"][kind] == params, s
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(m(x), want)
    return h, want, x


def test_mapped_model_stays_in_place_bitwise():
    with mapped_model() as m:
        first = m[0].weight.data_ptr()
        h, want, x = run_bitwise(m, hostpolicy.IN_PLACE)
        s = h.stats()["model"]
        assert s["host_bytes"] == 0, s          # no copy at all
        assert {k for _, _, _, k in h.layout()} == {"file"}
        assert "in place, registered" in s["host_policy"], s["host_policy"]
        assert s["host_by_kind"][hostpolicy.PINNED_COPY] == 0, s
        h.unload()                  # the caller's mapped tensor back
        assert m[0].weight.data_ptr() == first
        with torch.no_grad():
            assert torch.equal(m(x), want)


def test_outside_host_holds_the_mapping_itself():
    with mapped_model() as m:
        first = m[2].weight.data_ptr()
        h, want, x = run_bitwise(m, hostpolicy.IN_PLACE, outside="host")
        assert m[2].weight.data_ptr() == first     # no second copy
        h.close()


def test_small_ram_reads_the_file_bitwise():
    with hostpolicy.override(ram_available=1 * M), mapped_model() as m:
        h, want, x = run_bitwise(m, hostpolicy.FILE)
        s = h.stats()
        assert "do not fit in RAM" in s["model"]["host_policy"]
        assert s["model"]["file_bytes_read"] > 0 or \
            s["device"]["file_bytes_read"] > 0
        h.unload()
        with torch.no_grad():
            assert torch.equal(m(x), want)


def test_policy_choices():
    ch = hostpolicy.choose
    with hostpolicy.override(ram_available=32 * GiB,
                             disk_bytes_per_s=0.2e9):
        assert ch(9 * GiB, 0, None).kind == hostpolicy.IN_PLACE
        assert ch(25 * GiB, GiB, None).kind == hostpolicy.IN_PLACE  # slow
        c = ch(25 * GiB, 0, None)       # tight, but read once: the file
        assert c.kind == hostpolicy.FILE and "read once" in c.reason
        assert ch(30 * GiB, GiB, None).kind == hostpolicy.FILE   # no room
    with hostpolicy.override(ram_available=32 * GiB, disk_bytes_per_s=7e9):
        assert ch(9 * GiB, 0, None).kind == hostpolicy.IN_PLACE
        c = ch(25 * GiB, 4 * GiB, None)         # tight RAM, fast disk
        assert c.kind == hostpolicy.FILE and "disk is fast" in c.reason
        assert "4.0 GiB streamed a step" in c.reason, c.reason
    with hostpolicy.override(ram_available=8 * GiB, disk_bytes_per_s=0.2e9):
        c = ch(9 * GiB, 0, None)
        assert c.kind == hostpolicy.FILE and "RAM available 8.0 GiB" in \
            c.reason, c.reason


def test_tight_ram_fast_disk_reads_the_file_slow_disk_stays():
    """The policy through offload(): RAM for the model twice over, a fast
    disk: the file is read; the same RAM and a slow disk: in place."""
    size = sum(p.numel() * 4 for p in mlp().parameters())
    for disk, kind in ((7e9, hostpolicy.FILE), (0.1e9, hostpolicy.IN_PLACE)):
        with hostpolicy.override(ram_available=size * 3 // 2,
                                 disk_bytes_per_s=disk), \
                mapped_model() as m:
            run_bitwise(m, kind)[0].close()


def test_a_gpu_copies_a_mapped_model():
    """A GPU pins no read-only file mapping (on the H200 VM CUDA's
    read-only registration did not return): weights that would stay in
    place get a pinned copy there, said in the line; those that do not fit
    RAM are still read from the file. Bitwise either way."""
    from vpager.torch import sources
    saved = sources.pins_mappings
    sources.pins_mappings = lambda dev: False       # as on a GPU
    try:
        with mapped_model() as m:
            h, want, x = run_bitwise(m, hostpolicy.PINNED_COPY)
            line = h.stats()["model"]["host_policy"]
            assert "pins no read-only file mapping" in line, line
            assert "(not file-backed)" not in line, line
            h.unload()
            with torch.no_grad():
                assert torch.equal(m(x), want)
        with hostpolicy.override(ram_available=1 * M), mapped_model() as m:
            h, want, x = run_bitwise(m, hostpolicy.FILE)
            h.close()
    finally:
        sources.pins_mappings = saved
    c = hostpolicy.choose(1 * M, 0, None, pins_mappings=False)
    assert c.kind == hostpolicy.PINNED_COPY, c


def test_the_line_says_what_is_pinned():
    kinds = {hostpolicy.IN_PLACE: 10 * GiB, hostpolicy.PINNED_COPY: 2 * M}
    c = hostpolicy.Choice(hostpolicy.IN_PLACE, "why")
    line = hostpolicy.say("Flux", kinds, c, (4 * GiB, 10 * GiB))
    assert line == ("vpager: Flux: 10.0 GiB of weights stay in the mapped "
                    "file (in place, registered: 4.0 GiB of it pinned, the "
                    "rest pageable (the pin budget)); 2 MiB are in a pinned "
                    "copy (not file-backed): why"), line
    assert "(in place, pageable)" in hostpolicy.say("F", kinds, c, None)


def test_one_line_a_model_says_why():
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log = logging.getLogger("vpager")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        with hostpolicy.override(ram_available=64 * GiB,
                                 disk_bytes_per_s=0.5e9), mapped_model() as m:
            h = offload_sim(m, 768 * K, 320 * K)
            h.close()
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    mine = [x for x in lines if x.startswith("vpager: Sequential:")]
    assert len(mine) == 1, lines
    assert "stay in the mapped file (in place, registered)" in mine[0]
    assert "RAM available 64.0 GiB, disk 0.50 GB/s" in mine[0], mine[0]


def test_anonymous_tensors_get_one_pinned_copy():
    # (the caller may change their tensor in place later: the copy
    # replaces it, so the process still holds one)
    m = mlp()
    h, want, x = run_bitwise(m, hostpolicy.PINNED_COPY)
    s = h.stats()["model"]
    assert s["host_bytes"] == h.weight_bytes, s
    assert "pinned copy (not file-backed)" in s["host_policy"], s
    h.unload()
    with torch.no_grad():
        assert torch.equal(m(x), want)


def test_writable_private_mapping_is_read_through_our_own():
    """A private writable mapping (torch's from_file, ComfyUI's loader):
    used in place through a read-only mapping of vpager's own of the
    same file (pinning the caller's for write would copy its pages); the
    caller's tensors are theirs again after unload()."""
    with mapped_model(writable=True) as m:
        first = m[0].weight.data_ptr()
        h, want, x = run_bitwise(m, hostpolicy.IN_PLACE)
        assert h.stats()["model"]["host_bytes"] == 0
        h.unload()
        assert m[0].weight.data_ptr() == first
    with hostpolicy.override(ram_available=1 * M), \
            mapped_model(writable=True) as m:
        run_bitwise(m, hostpolicy.FILE)[0].close()


def test_a_written_private_mapping_gets_a_pinned_copy():
    """The caller changed their private mapping's bytes: the file no
    longer holds them, so vpager keeps a pinned copy of what the tensor
    holds."""
    with mapped_model(writable=True) as m:
        with torch.no_grad():
            m[0].weight.mul_(2)
        run_bitwise(m, hostpolicy.PINNED_COPY)[0].close()


def test_no_pin_budget_reads_the_file_bitwise():
    """Registration pins nothing (the pin budget is spent): the mapped
    weights are read from their file instead, bitwise."""
    with hostpolicy.override(ram_available=64 * GiB), mapped_model() as m:
        h, want, x = run_bitwise(m, hostpolicy.FILE, pin_budget=1)
        assert "read from the file instead" in \
            h.stats()["model"]["host_policy"]
        assert h.stats()["device"]["machine_pinned_bytes"] <= 1
        h.close()


def _model_file(tmp, seed=0):
    """(path, x, want): mlp(seed)'s weights in a safetensors file in tmp,
    an input and the model's output for it."""
    ref = mlp(seed=seed)
    path = os.path.join(tmp, "m%d.safetensors" % seed)
    write_safetensors(path, ref.state_dict())
    x = torch.randn(8, 256)
    with torch.no_grad():
        return path, x, frozen_copy(ref)(x)


def test_weights_from_in_place_and_file():
    with tempfile.TemporaryDirectory() as tmp:
        path, x, want = _model_file(tmp)
        for ram, kind in ((64 * GiB, hostpolicy.IN_PLACE),
                          (1 * M, hostpolicy.FILE)):
            with hostpolicy.override(ram_available=ram):
                m = mlp(seed=5)
                h = offload_sim(m, 768 * K, 320 * K, weights_from=path)
                s = h.stats()["model"]
                params = sum(p.numel() * 4 for p in m.parameters())
                assert s["host_by_kind"][kind] == params, s
                with torch.no_grad():
                    for _ in range(2):
                        assert torch.equal(m(x), want)
                h.close()


def _rss_growth_of_a_big_mapped_model(kind):
    """A 96 MiB model over a mapped file, offloaded with budget B = 8 MiB
    (its host bytes of `kind`), run bitwise, unloaded: (the process's RSS
    growth over the offload and the forwards, B, the model's bytes)."""
    width, depth = 512, 96           # 96 x 1 MiB
    budget = 8 * M
    with tempfile.TemporaryDirectory() as tmp:
        m = mlp(width, depth)
        mm = map_into(m, os.path.join(tmp, "big.safetensors"))
        gc.collect()
        size = sum(p.numel() * 4 for p in m.parameters())
        x = torch.randn(4, width)
        with torch.no_grad():
            want = m(x).clone()         # the mapping's pages are in now
        before = rss()
        with hostpolicy.override(ram_available=64 * GiB):
            h = offload_sim(m, budget, 2 * M)
        assert h.stats()["model"]["host_by_kind"][kind] == size
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(x), want)
        grown = rss() - before
        h.unload()
        with torch.no_grad():
            assert torch.equal(m(x), want)
        del mm
    return grown, budget, size


def test_mapped_model_grows_rss_by_the_budget_only():
    """In place, the process grows by <= B + 10% of the model (a host copy
    would add the whole model)."""
    grown, budget, size = _rss_growth_of_a_big_mapped_model(
        hostpolicy.IN_PLACE)
    assert grown <= budget + size // 10, \
        "RSS grew by %.1f MiB (budget %d MiB, model %d MiB)" % (
            grown / M, budget // M, size // M)


def _peak_rss():
    return rss("VmHWM:")


def test_a_copy_of_anonymous_tensors_peaks_at_one_model_and_a_batch():
    """offload()'s pinned copy of a model in anonymous memory lets each
    tensor's old storage go once its batch is copied, made in offload()
    or behind it: the process's peak grows by about a batch, not by a
    second model."""
    from vpager.torch import sources
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")        # the peak RSS reset
    except OSError as e:
        _runner.skip("no peak RSS reset here: %s" % e)
    saved = sources._COPY_BATCH
    sources._COPY_BATCH = 16 * M
    try:
        for behind in (False, True):
            with (copying_behind() if behind else contextlib.nullcontext()):
                # 64 MiB weights: glibc maps each and unmaps it when freed
                # (smaller ones may come from its heap, which keeps freed
                # memory until its top is free: a peak of its own)
                m = mlp(width=4096, depth=4)        # 257 MiB
                size = sum(p.numel() * 4 for p in m.parameters())
                gc.collect()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                before = rss()
                h = offload_sim(m, budget=160 * M, staging=136 * M)
                h._parts.layout.wait_loaded()       # the copy's end
                grown = _peak_rss() - before
                h.close()
                del m, h
            assert grown < size // 2, \
                "peak grew by %d MiB for a %d MiB model (behind: %s)" % (
                    grown // M, size // M, behind)
    finally:
        sources._COPY_BATCH = saved


def test_a_copy_out_of_a_mapping_is_the_one_copy_in_rss():
    """On a GPU a mapped model gets a pinned copy (test_a_gpu_copies_a_
    mapped_model): the mapping's pages it was copied from leave the
    process's RSS (the page cache keeps them), so RSS grows by the budget
    only, as in place, not by a second model (106 MiB without the drop)."""
    from vpager.torch import sources
    saved = sources.pins_mappings
    sources.pins_mappings = lambda dev: False       # as on a GPU
    try:
        grown, budget, size = _rss_growth_of_a_big_mapped_model(
            hostpolicy.PINNED_COPY)
    finally:
        sources.pins_mappings = saved
    # The copy (the model) in, the mapping's pages (the model) out.
    assert grown <= budget + size // 10, \
        "RSS grew by %.1f MiB (budget %d MiB, model %d MiB)" % (
            grown / M, budget // M, size // M)


# ------------------------------------------- the host copy behind offload()

@contextlib.contextmanager
def copying_behind(gate=None, fail=None):
    """Every pinned copy filled behind offload() (hostload.py), however
    small and on the simulated device too (VPAGER_COPY_BEHIND=1), in
    batches of one weight: the copier waits for `gate` (a
    threading.Event) before its first batch and raises `fail` at its
    third, when given."""
    from vpager.torch import hostload, sources
    saved = sources.BEHIND_MIN, hostload.BATCH, sources.copy_jobs
    batches = []

    def copy(jobs, drop, advance, moved=None, **kw):
        if gate is not None:
            gate.wait(30)
        batches.append(len(jobs))
        if fail is not None and len(batches) == 3:
            raise fail
        return saved[2](jobs, drop, advance, moved, **kw)

    sources.BEHIND_MIN, hostload.BATCH, sources.copy_jobs = 0, 1, copy
    old = os.environ.get("VPAGER_COPY_BEHIND")
    os.environ["VPAGER_COPY_BEHIND"] = "1"      # (off by default)
    try:
        yield batches
    finally:
        sources.BEHIND_MIN, hostload.BATCH, sources.copy_jobs = saved
        if old is None:
            os.environ.pop("VPAGER_COPY_BEHIND", None)
        else:
            os.environ["VPAGER_COPY_BEHIND"] = old


def _behind_model():
    m = mlp(width=256, depth=8)
    return m, m.state_dict(), torch.randn(4, 256)


def test_hostload_on_its_own():
    """HostLoad with stand-in jobs: batches in order, each published after
    its pages are locked (PIN_ALIGN edges, the last piece to the mapping's
    end); a wait for the first entries returns before the last batch; a
    stopped copy never lets a wait through; a failed one says why."""
    import threading
    import types
    from vpager.torch import hostload
    saved = hostload.BATCH
    hostload.BATCH = 1
    try:
        es = [types.SimpleNamespace(size=3 * M) for _ in range(4)]
        ends = [3 * M * (i + 1) for i in range(4)]
        gate, copied, locked = threading.Event(), [], []

        class Piece:
            def __init__(self, lo, hi):
                self.span = (lo, hi)
                locked.append(self.span)

            def close(self):
                locked.remove(self.span)

        def copy(batch):
            if len(copied) == 2:
                gate.wait(30)
            copied.extend(e for e, _w in batch)
        load = hostload.HostLoad([(e, None) for e in es], ends, copy, Piece,
                                 12 * M, 0, 14 * M)
        load.start()
        load.wait(es[:2])               # the third batch still waits
        assert copied == es[:2] and not load.filled
        assert locked == [(0, 2 * M), (2 * M, 6 * M)], locked
        gate.set()
        load.wait()
        assert load.filled and copied == es
        load.close()
        assert locked == [] and load.finished
        # Stopped before it started: a wait raises, it does not pass.
        load = hostload.HostLoad([(e, None) for e in es], ends, copy, Piece,
                                 12 * M, 0, 14 * M)
        load.cancel()
        e = _runner.raises(RuntimeError, load.wait, es[:1])
        assert "stopped" in str(e), e
        # A copy that fails: every wait says so.
        def boom(batch):
            raise OSError("disk gone")
        load = hostload.HostLoad([(e, None) for e in es], ends, boom, Piece,
                                 12 * M, 0, 14 * M)
        for _ in range(2):
            e = _runner.raises(RuntimeError, load.wait, es[:1])
            assert "disk gone" in str(e), e
        load.close()
    finally:
        hostload.BATCH = saved


def test_copy_behind_the_first_forward_bitwise():
    """offload() returns before the host copy is filled; the first
    forward's units wait for their own weights, no weight prefetches
    while the copy runs (windows 0), outputs are bitwise the resident
    model's on every forward, and once the copy is whole it is the
    layout's HostBuf (page-locked, its times kept) and the windows are
    the units' again."""
    import threading
    gate = threading.Event()
    m, _sd, x = _behind_model()
    ref = frozen_copy(m)
    with torch.no_grad():
        want = ref(x)
    with copying_behind(gate) as batches:
        # (a device lookahead: the weights would prefetch but for the copy)
        h = offload_sim(m, budget=1024 * K, staging=512 * K,
                        lookahead=128 * K)
        lay = h._parts.layout
        assert lay.loading is not None and lay.hb is None
        assert batches == []                # offload() did not wait
        assert h.stats()["model"]["host_bytes"] == h.weight_bytes
        ws = lay.weights
        assert all(ws.window(e.index) == 0 for e in lay.entries)
        tuner = h._parts.tuner
        assert tuner is not None
        load = lay.loading
        threading.Timer(0.1, gate.set).start()
        with torch.no_grad():
            assert torch.equal(m(x), want)      # waits for the copy
            # (that forward's units waited: not measured for the schedule)
            assert tuner.rounds == 0, tuner.rounds
            load._thread.join(10)               # page-locked now
            for _ in range(3):
                assert torch.equal(m(x), want)
        assert tuner.rounds >= 1
        assert lay.loading is None and lay.hb is not None
        assert len(batches) == len(lay.entries)
        assert lay.load_times["host_fill_s"] > 0
        assert all(ws.window(e.index) == u.window for u in lay.units
                   for e in u.entries)
        assert h.stats()["model"]["host_bytes"] == h.weight_bytes
        h.close()


def test_copy_behind_pins_piece_by_piece():
    """Each batch's pages are page-locked as the copy reaches them (so the
    first forward copies from pinned memory), in pieces that meet at 2
    MiB edges and cover the whole mapping; outputs stay bitwise."""
    from vpager.torch import hostload
    m = mlp(width=512, depth=8)         # 8.4 MiB: edges inside it
    x = torch.randn(4, 512)
    ref = frozen_copy(m)
    with torch.no_grad():
        want = ref(x)
    with copying_behind():
        h = offload_sim(m, budget=4 * M, staging=2 * M)
        lay = h._parts.layout
        load = lay.loading
        load._thread.join(10)
        with torch.no_grad():
            assert torch.equal(m(x), want)
        assert lay.hb is load and lay.loading is None
        ptrs = [(hb.ptr, hb.size) for hb in load.hbs]
        assert len(ptrs) >= 3, ptrs
        for (p, n), (q, _k) in zip(ptrs, ptrs[1:]):
            assert p + n == q and q % hostload.PIN_ALIGN == 0, ptrs
        assert sum(n for _p, n in ptrs) >= h.weight_bytes
        h.close()
        assert load.hbs == []


def test_copy_behind_readers_wait_for_it():
    """state_dict() and unload() while the copy is still filling read the
    whole copy (they wait for it): the model's own values."""
    import threading
    for what in ("state_dict", "unload"):
        gate = threading.Event()
        m, sd, x = _behind_model()
        with copying_behind(gate):
            h = offload_sim(m, budget=1024 * K, staging=512 * K)
            threading.Timer(0.2, gate.set).start()
            if what == "state_dict":
                got = m.state_dict()
                assert all(torch.equal(got[k], v) for k, v in sd.items())
                h.close()
            else:
                h.unload()
                assert all(torch.equal(p, sd[k])
                           for k, p in m.state_dict().items())


def test_copy_behind_then_a_new_file():
    """load_safetensors() while the copy is still filling waits for it,
    then the new file's bytes replace it (the copy freed): the file's
    model, bitwise."""
    import threading
    gate = threading.Event()
    with copying_behind(gate), tempfile.TemporaryDirectory() as tmp:
        path, x, want = _model_file(tmp, seed=3)
        m = mlp(seed=5)
        h = offload_sim(m, budget=1024 * K, staging=512 * K)
        lay = h._parts.layout
        assert lay.loading is not None
        threading.Timer(0.2, gate.set).start()
        h.load_safetensors(path)
        assert lay.loading is None
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(m(x), want)
        h.close()


def test_copy_behind_closed_before_it_ends():
    """close() while the copier still waits to copy stops it first (its
    memory is freed after): nothing crashes, the model refuses to run."""
    import threading
    gate = threading.Event()
    m, _sd, x = _behind_model()
    with copying_behind(gate) as batches:
        h = offload_sim(m, budget=1024 * K, staging=512 * K)
        lay = h._parts.layout
        threading.Timer(0.2, gate.set).start()
        h.close()
        assert lay.loading is None
        assert len(batches) <= 1            # stopped after one batch
        with torch.no_grad():
            _runner.raises(RuntimeError, m, x)


def test_copy_behind_an_offload_that_fails():
    """offload() failing after its layout (the host copy made but not yet
    started) leaves the module as it was and no copier behind."""
    import threading
    from vpager.torch import install
    m, sd, x = _behind_model()
    ref = frozen_copy(m)
    with torch.no_grad():
        want = ref(x)
    saved = install.Installation.install

    def fails(self, wrap):
        raise RuntimeError("installing failed")
    install.Installation.install = fails
    try:
        with copying_behind() as batches:
            before = threading.active_count()
            _runner.raises(RuntimeError, offload_sim, m, budget=1024 * K,
                           staging=512 * K)
            assert batches == [] and threading.active_count() == before
    finally:
        install.Installation.install = saved
    with torch.no_grad():
        assert torch.equal(m(x), want)


def test_copy_behind_failing_says_so():
    """A copy that fails behind offload() fails the forward that waits for
    it with an error naming the host copy, every time; close() works."""
    m, _sd, x = _behind_model()
    with copying_behind(fail=MemoryError("no room for the copy")):
        h = offload_sim(m, budget=1024 * K, staging=512 * K)
        for _ in range(2):
            with torch.no_grad():
                err = _runner.raises(RuntimeError, m, x)
            assert "host copy" in str(err) and \
                "no room for the copy" in str(err), err
        h.close()


def test_copy_behind_threads_share_the_first_forwards():
    """Four threads running the model while its copy fills: every output
    is the resident model's."""
    import threading
    m, _sd, x = _behind_model()
    ref = frozen_copy(m)
    with torch.no_grad():
        want = ref(x)
    gate = threading.Event()
    with copying_behind(gate):
        h = offload_sim(m, budget=1024 * K, staging=512 * K)
        bad = []

        def run():
            try:
                with torch.no_grad():
                    for _ in range(5):
                        if not torch.equal(m(x), want):
                            bad.append("differs")
            except Exception as e:      # noqa: BLE001 (counted, said)
                bad.append(repr(e))
        ts = [threading.Thread(target=run) for _ in range(4)]
        for t in ts:
            t.start()
        gate.set()
        for t in ts:
            t.join()
        assert not bad, bad
        h.close()


def test_copy_behind_a_mapped_model():
    """ComfyUI's case: a model over a read-only file mapping on a device
    that pins none (a GPU) gets its pinned copy behind offload(), copied
    out of the mapping: bitwise, and the mapping's pages it was copied
    from dropped as each batch lands (not all at the end)."""
    import threading
    from vpager.torch import sources
    saved = sources.pins_mappings
    sources.pins_mappings = lambda dev: False       # as on a GPU
    gate = threading.Event()
    try:
        with copying_behind(gate), mapped_model() as m:
            ref = frozen_copy(m)
            x = torch.randn(4, 256)
            with torch.no_grad():
                want = ref(x)
            h = offload_sim(m, budget=1024 * K, staging=512 * K)
            assert h._parts.layout.loading is not None
            gate.set()
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(m(x), want)
            s = h.stats()["model"]
            assert s["host_by_kind"][hostpolicy.PINNED_COPY] == \
                h.weight_bytes, s
            h.unload()
            with torch.no_grad():
                assert torch.equal(m(x), want)
    finally:
        sources.pins_mappings = saved


def test_copy_behind_weights_from_a_file():
    """offload(weights_from=) on a device that pins no file mapping (a
    GPU): the pinned copy is read out of the file behind offload(),
    bitwise the file's model."""
    import threading
    from vpager.torch import sources
    saved = sources.pins_mappings
    sources.pins_mappings = lambda dev: False       # as on a GPU
    gate = threading.Event()
    try:
        with copying_behind(gate), tempfile.TemporaryDirectory() as tmp:
            path, x, want = _model_file(tmp)
            m = mlp(seed=5)         # its own values: the file's win
            h = offload_sim(m, budget=1024 * K, staging=512 * K,
                            weights_from=path)
            assert h._parts.layout.loading is not None
            gate.set()
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(m(x), want)
            h.close()
    finally:
        sources.pins_mappings = saved


def test_copy_behind_on_cuda():
    """The same on a GPU (skipped without one): the first forwards read
    the copy while it fills, pageable until it is page-locked."""
    import threading
    if not torch.cuda.is_available():
        _runner.skip("no CUDA")
    gate = threading.Event()
    m = mlp(width=512, depth=8)         # 8.4 MiB in a 6 MiB budget
    x = torch.randn(16, 512)
    ref = frozen_copy(m).cuda()
    xc = x.cuda()
    with torch.no_grad():
        want = ref(xc)
    with copying_behind(gate):
        h = vt.offload(m, device="cuda", budget=6 * M, staging_size=2 * M,
                       page_size=2 * M)
        assert h._parts.layout.loading is not None
        threading.Timer(0.1, gate.set).start()
        with torch.no_grad():
            for _ in range(4):
                assert torch.equal(m(xc), want)
        h.close()


def test_copy_behind_off_and_outside_host():
    """VPAGER_COPY_BEHIND=0, unset (the default: slower on the H100), and
    outside="host" (the module's tensors are the copy) make the copy
    before offload() returns."""
    with copying_behind():
        for kw, env in (({}, "0"), ({}, None), ({"outside": "host"}, "1")):
            m, _sd, _x = _behind_model()
            old = os.environ.pop("VPAGER_COPY_BEHIND", None)
            if env is not None:
                os.environ["VPAGER_COPY_BEHIND"] = env
            try:
                h = offload_sim(m, budget=1024 * K, staging=512 * K, **kw)
            finally:
                os.environ.pop("VPAGER_COPY_BEHIND", None)
                if old is not None:
                    os.environ["VPAGER_COPY_BEHIND"] = old
            lay = h._parts.layout
            assert lay.loading is None and lay.hb is not None, kw
            h.close()


if __name__ == "__main__":
    sys.exit(_runner.main(globals(), after_each=gc.collect))
