"""A weight with a fill (set_fill: a LoRA's patch computed on the device)
that the settled schedule streams runs its fill once more, its bytes as
the fill left them go to a pinned host copy of its own, and from then on
it streams from there with its fill resting (keptfills.py); outputs stay
those of the patched model. A new fill, a fill taken away, the weight
turning resident, no RAM to spare or VPAGER_KEEP_FILLS=0: the fill runs
again as before.
    make && PYTHONPATH=python python3 tests/python/test_kept_fills.py
"""
import contextlib
import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)

from vpager.torch import hostpolicy, keptfills  # noqa: E402
from test_torch import (  # noqa: E402
    K, cuda_layers, environ, frozen_copy, no_pins, sim_opts,
    watching_every_forward)
import vpager.torch as vt  # noqa: E402


def _patched_model(share=0.6, device_share=None):
    """(h, ref, forward, patched): 120 layers offloaded at `share` of
    their bytes (on a device of `device_share` of them, its limit set to
    `share`) and run to a settled schedule, then every weight matrix
    given a fill (x2; ref patched the same), more than fit resident, so
    the plan made for them streams some; forward() runs one, its output
    checked against ref's as it is then, and returns the fills it ran."""
    from torch import nn
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(96, 96) for _ in range(120)]).eval()
    x = torch.randn(4, 96)
    ref = frozen_copy(m)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    h = vt.offload(m, device="cpu",
                   budget=int(total * (device_share or share)),
                   staging_size=512 * K, **dict(sim_opts(), lookahead=None))
    if device_share:
        h.device.set_limit(int(total * share))

    def forward():
        n = h.hot_path.fills
        with torch.no_grad():
            assert torch.equal(m(x), ref(x))
        return h.hot_path.fills - n
    for _ in range(4):
        forward()
    patched = [e for e in h.vbar_layout.entries if len(e.shape) == 2]
    for e in patched:
        h.set_fill(e.name, lambda v: v.mul_(2))
        ref.get_parameter(e.name).data.mul_(2)
    return h, ref, forward, patched


def _kept(h):
    return h.stats()["model"]["kept_fills"]


@contextlib.contextmanager
def _logged():
    """The messages logger "vpager" logs in the block."""
    lines = []

    class Catch(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    catch = Catch()
    logging.getLogger("vpager").addHandler(catch)
    try:
        yield lines
    finally:
        logging.getLogger("vpager").removeHandler(catch)


def test_streamed_fills_are_kept_and_run_no_more():
    """The fills of the streamed patched weights stop once their bytes
    are kept (a forward then runs no fill at all); the kept bytes are
    the streamed patched weights'; outputs those of the patched model
    throughout; nothing pinned after, the buffers freed at unload()."""
    h, ref, forward, patched = _patched_model()
    runs = [forward() for _ in range(8)]
    streamed = h.tuner.streamed()
    assert streamed, "the schedule settles and streams patched weights"
    s = h.stats()["model"]
    kept = [e for e in patched if e.kept is not None]
    assert kept and set(kept) <= set(streamed), (len(kept), len(streamed))
    assert s["kept_fills"] == len(kept), s
    assert s["kept_fill_bytes"] == sum(e.size for e in kept), s
    assert s["set_sources"] == 0, s
    assert runs[-1] == 0 and runs[-2] == 0, runs
    assert runs[0] >= len(kept), runs
    assert no_pins(h)
    h.unload()


def test_a_new_fill_runs_again_and_is_kept_again():
    """A strength change (a new fill: x-1 where it was x2) on kept
    weights: their fill runs again, once, on their own bytes (not the
    kept ones), its result caught in the same buffers (none page-locked
    anew) and kept from the next forward on; taken away, every weight is
    its own bytes again and no fill runs."""
    h, ref, forward, patched = _patched_model()
    for _ in range(8):
        forward()
    kept = [e for e in patched if e.kept is not None]
    assert kept
    for e in patched:
        h.set_fill(e.name, lambda v: v.neg_())
        ref.get_parameter(e.name).data.mul_(-0.5)   # (exact)
    assert _kept(h) == 0
    dev = h.device
    locked = []
    real = dev.register_hostbuf
    dev.register_hostbuf = lambda *a: (locked.append(a), real(*a))[1]
    try:
        runs = [forward() for _ in range(8)]
    finally:
        del dev.register_hostbuf
    assert runs[0] >= len(kept) and runs[1:] == [0] * 7, runs
    assert _kept(h) == len(kept) and not locked, (_kept(h), len(locked))
    for e in patched:
        h.set_fill(e.name, None)
        ref.get_parameter(e.name).data.neg_()
    assert _kept(h) == 0
    runs = [forward() for _ in range(3)]
    assert runs == [0, 0, 0], runs
    assert h.stats()["model"]["set_sources"] == 0
    assert no_pins(h)
    h.unload()


def test_kept_weights_turning_resident_get_their_fill_back_uncopied():
    """The room grows until every weight fits: the plan made again makes
    the kept weights resident; once their pages are, they take their own
    source and fill again without being copied (vp_weight_swap_source),
    their buffers freed; outputs unchanged, no fill runs."""
    with watching_every_forward():
        h, ref, forward, patched = _patched_model(0.6, device_share=2.0)
        for _ in range(8):
            forward()
        assert _kept(h) > 0
        h.device.set_limit(h.weight_bytes * 2)
        runs = [forward() for _ in range(6)]
    assert _kept(h) == 0, h.stats()["model"]
    assert all(e.fill is not None and e.alt is None for e in patched)
    assert sum(runs) == 0, runs     # not one fill ran again
    assert no_pins(h)
    h.unload()


def test_no_buffer_without_ram_to_spare_or_when_off():
    """RAM available below the reserve after a buffer, a pin budget that
    would not page-lock a buffer whole, or VPAGER_KEEP_FILLS=0: the
    streamed weights' fills run at every forward, outputs unchanged."""
    with hostpolicy.override(ram_available=keptfills.RESERVE):
        h, ref, forward, patched = _patched_model()
        runs = [forward() for _ in range(8)]
        assert _kept(h) == 0 and runs[-1] > 0, runs
        h.unload()
    h, ref, forward, patched = _patched_model()
    h.device.set_pin_budget(h.device.stats()["host_pinned_bytes"] + 4096)
    runs = [forward() for _ in range(8)]
    assert _kept(h) == 0 and runs[-1] > 0, runs
    assert not h._parts.kept.bufs and h._parts.kept.short
    h.unload()
    with environ(VPAGER_KEEP_FILLS="0"):
        h, ref, forward, patched = _patched_model()
        runs = [forward() for _ in range(8)]
        assert _kept(h) == 0 and runs[-1] > 0, runs
        h.unload()


def test_ram_running_short_lets_the_kept_fills_go():
    """RAM available falls under half the reserve while fills are kept:
    the next forward's start gives every kept weight its fill back and
    frees the buffers, said in one warning; the fills run again, outputs
    unchanged, and no buffer is taken again."""
    old = keptfills.CHECK_EVERY
    keptfills.CHECK_EVERY = 0.0     # RAM read at every forward's start
    try:
        h, ref, forward, patched = _patched_model()
        for _ in range(8):
            forward()
        assert _kept(h) > 0
        with hostpolicy.override(ram_available=1 << 30), _logged() as lines:
            runs = [forward() for _ in range(4)]
    finally:
        keptfills.CHECK_EVERY = old
    assert _kept(h) == 0, runs
    assert runs[0] > 0 and runs[-1] == runs[0], runs
    said = [x for x in lines if "were let go" in x]
    assert len(said) == 1, lines
    assert not h._parts.kept.bufs
    h.unload()


def test_buffers_are_made_off_the_forwards_thread():
    """The buffers are made and page-locked on a thread of their own:
    while it works (slowed here) the forwards go on, their fills running,
    and the forward after it finished arms them; unload() while it works
    waits for it and frees what it made."""
    import threading
    slow = threading.Event()
    seen = []
    real = keptfills.host_memory

    def host_memory(n):
        seen.append(threading.current_thread().name)
        slow.wait(5)
        return real(n)
    keptfills.host_memory = host_memory
    try:
        h, ref, forward, patched = _patched_model()
        runs = [forward() for _ in range(6)]
        assert runs[-1] > 0 and _kept(h) == 0, runs     # still making
        assert seen and set(seen) == {"vpager-kept-fills"}, seen
        slow.set()
        h._parts.kept.maker.join()
        runs = [forward() for _ in range(3)]
        assert _kept(h) > 0 and runs[-1] == 0, runs
        h.unload()
        slow.clear()
        h, ref, forward, patched = _patched_model()
        for _ in range(4):
            forward()
        assert h._parts.kept.maker is not None
        threading.Timer(0.2, slow.set).start()
        h.unload()                  # waits for the maker, frees its made
        assert h._parts.kept.maker is None and not h._parts.kept.made
    finally:
        keptfills.host_memory = real
        slow.set()


def test_a_capture_that_fails_never_fails_the_forward():
    """The copy of a fill's result to its buffer raising (here made to):
    the forward goes on, outputs unchanged, one warning, the buffer
    freed, no more buffers; the fills run as before."""
    h, ref, forward, patched = _patched_model()
    keeper = h._parts.kept
    real = keeper.ran

    def ran(e, v):
        class Broken:
            def copy_(self, *a, **k):
                raise RuntimeError("no copy (test)")
        if e in keeper.armed:
            keeper.bufs[e] = (keeper.bufs[e][0], Broken())
        real(e, v)
    keeper.ran = ran
    with _logged() as lines:
        runs = [forward() for _ in range(8)]
    assert _kept(h) == 0 and runs[-1] > 0, runs
    assert len([x for x in lines if "not kept" in x]) == 1, lines
    assert keeper.short
    h.unload()


def test_set_source_and_load_over_a_kept_weight():
    """set_source() on a kept weight replaces its kept bytes with the
    caller's (its fill gone); set_source(None) gives its own bytes back."""
    h, ref, forward, patched = _patched_model()
    for _ in range(8):
        forward()
    e = next(e for e in patched if e.kept is not None)
    p = ref.get_parameter(e.name)
    new = torch.full_like(p, 0.25)
    h.set_source(e.name, new)
    own = p.data.clone()
    p.data.copy_(new)
    assert e.kept is None and e.fill is None
    forward()
    h.set_source(e.name, None)
    p.data.copy_(own / 2)           # its own bytes: unpatched
    forward()
    forward()
    assert h.stats()["model"]["set_sources"] == 0
    h.unload()


def test_cuda_kept_fills_bitwise():
    """On CUDA (skipped without): 40 layers of 1024x1024 float32 at 60%,
    every weight matrix patched at fill (x2): the streamed ones' fills are
    kept, their copy to the host waited for by an event, and each output
    is bitwise the patched resident model's; then the patch taken away."""
    if not torch.cuda.is_available():
        _runner.skip("no CUDA device")
    m, ref, x, total = cuda_layers()
    h = vt.offload(m, device="cuda", budget=int(total * 0.6),
                   page_size="2M")
    patched = [e for e in h.vbar_layout.entries if len(e.shape) == 2]

    def forward():
        with torch.no_grad():
            assert torch.equal(m(x), ref(x))
    for _ in range(4):
        forward()
    for e in patched:
        h.set_fill(e.name, lambda v: v.mul_(2))
        ref.get_parameter(e.name).data.mul_(2)
    fills = []
    for _ in range(16):
        n = h.hot_path.fills
        forward()
        fills.append(h.hot_path.fills - n)
    kept = _kept(h)
    for e in patched:
        h.set_fill(e.name, None)
        ref.get_parameter(e.name).data.div_(2)
    for _ in range(3):
        forward()
    print("    fills a forward %s, kept %d of %d patched, schedule "
          "streams %d" % (fills, kept, len(patched),
                          len(h.tuner.streamed() or ())))
    assert kept > 0 and fills[-1] == 0 < fills[0], (fills, kept)
    assert no_pins(h)
    h.unload()


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
