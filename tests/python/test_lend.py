"""torch's idle cache lent to the staging ring between forwards (lend.py,
VPAGER_LEND=1), on the simulated device: the "cache" is a pinned range
of a second VBAR on the model's device (on a GPU, blocks of torch's
caching allocator), brought in through the Lender's seam.

* a forward lends it at its start, once a plan named its last streamed
  unit: that unit's prefetch goes on into it at once (the forward's
  streamed weights after the ring's are there);
* the forward takes those weights from it, and the loan comes back
  during that forward, after its streamed units used them, not forced;
* outputs stay bitwise the resident model's, prompt after prompt;
* VPAGER_LEND_EARLY: a loan borrowed at a forward's end, its first
  bytes lent and filled then, the rest lent at the next forward's start;
  pause() gives it back before then; VPAGER_LEND_SM: its copies by SMs;
* another model's forward and unload() take it back, on the stream it
  was borrowed on, and never while another thread lends it; a loan during
  which torch's allocator reserved more than its known peak shrinks the
  loans after it (its cache emptied), down to none, as does a borrow
  that runs out of memory; torch growing again up to that peak (a
  client emptied its cache) does not;
* a loan the library refuses does not fail the forward: lending ends;
* VPAGER_LEND_CAP bounds a loan's bytes;
* nothing is lent unless VPAGER_LEND=1 and torch's allocator is native.
No timed assertions.

    make && PYTHONPATH=python python3 tests/python/test_lend.py
"""
import logging
import os
import sys
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)

import vpager.torch as vt  # noqa: E402
from vpager.torch import devices, lend  # noqa: E402
from _runner import skip  # noqa: E402
from test_torch import (  # noqa: E402
    PAGE, K, environ, frozen_copy, mlp, offload_sim, sim_opts)

LENT = 640 * K              # the fake cache's free bytes
lend.MIN_PIECE = 64 * K     # blocks of a small model's size lent too


class Piece:
    """A borrowed block: its return is the last reference going (the
    cache's `out` holds it weakly)."""

    def __init__(self, cache, addr, n):
        self.addr, self.n = addr, n
        cache.out.add(self)


class FakeCache:
    """torch's cache as a Lender sees it, over a pinned range of a VBAR
    of the model's device: two free blocks; reserved() grows when `grow`
    says a borrow found no free block."""

    def __init__(self, dev):
        self.vbar = dev.create_vbar(LENT)
        self.vbar.fault(0, LENT, gens=False)
        self.base = self.vbar.base
        self.out = weakref.WeakSet()
        self.reserved_now = 10 << 20
        self.peak_now = 0       # the Governor's torch peak
        self.grow = False
        self.skew = 0           # bytes off the block's start (a bad one)
        self.oom = None         # bytes a borrow past which runs out
        self.shrinks = 0

    def reserved(self):
        return self.reserved_now

    def peak(self):
        return self.peak_now

    def free_blocks(self, stream):
        return [256 * K, 128 * K, 96 * K, 64 * K, 64 * K, 32 * K]

    def borrow(self, n):
        at = sum(p.n for p in self.out)
        assert at + n <= LENT, "the fake cache lent more than it holds"
        if self.oom is not None and at + n > self.oom:
            raise RuntimeError("CUDA out of memory. Tried to allocate %d "
                               "bytes\n(the fake cache's)" % n)
        if self.grow:
            self.reserved_now += n
        p = Piece(self, self.base + at + self.skew, n)
        return p, p.addr

    def shrink(self):
        self.shrinks += 1

    def close(self, stream=0):
        self.vbar.unpin(0, LENT, stream)


def _offload(m):
    """m offloaded as test_torch's _scheduled_mlp() offloads it (900 KiB
    for it, ring 320 KiB), the device's budget larger by the fake
    cache's pages."""
    opts = dict(sim_opts(), page_size=PAGE)
    del opts["lookahead"]
    return vt.offload(m, device="cpu", budget=900 * K + LENT,
                      staging_size=320 * K, **opts)


def _lending(h):
    """h's device's Lender with a FakeCache in it: (lender, cache)."""
    ds = devices.devstate(h.device)
    cache = FakeCache(h.device)
    ds.lender.cache = cache
    ds.lender.sizes = None
    return ds.lender, cache


def _lent_mlp():
    """An 8-layer MLP offloaded as _offload() does, its device lending to
    a FakeCache: (m, x, its output resident, h, lender, cache)."""
    m = mlp(depth=8)
    x = torch.randn(8, 64)
    want = frozen_copy(m)(x)
    h = _offload(m)
    return (m, x, want, h) + _lending(h)


def _finish(lender, cache, *handles):
    """The loan back, the fake cache's pages unpinned, the models
    unloaded (the device closes with the last)."""
    lender.take_back()
    assert not lender.out and not cache.out
    cache.close()
    for h in handles:
        if h is not None:
            h.unload()


def _weight_bytes(m):
    return [p.detach().numpy().tobytes() for p in m.parameters()
            if p.dim() == 2]


def test_a_forward_lends_at_its_start_and_takes_it_back():
    """The loan made at a forward's start holds that forward's weights
    when its first unit runs (their bytes are in it), the forward takes
    them from it and gives it back before its last module runs,
    unforced; outputs bitwise over six forwards."""
    m, x, want, h, lender, cache = _lent_mlp()
    weights = _weight_bytes(mlp(depth=8))   # the same seed: its weights
    other = None
    at_first, out_at_last = [], []

    def first_unit(mod, args):
        if not lender.out:
            at_first.append(None)
            return
        h.device.synchronize()
        held = h.device.read(cache.base, LENT)
        at_first.append(any(w[:4096] in held for w in weights))

    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    linears[0].register_forward_pre_hook(first_unit)
    linears[-1].register_forward_pre_hook(
        lambda mod, args: out_at_last.append(lender.out))
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        for i in range(6):
            returned, forced = lender.returned, lender.forced
            assert torch.equal(m(x), want), "forward %d" % i
            assert not lender.out, "forward %d kept its loan" % i
            assert lender.returned == returned + 1, "forward %d" % i
            assert lender.forced == forced
        assert lender.loans == 6
        assert at_first == [None] + [True] * 6, at_first
        assert out_at_last == [False] * 7, out_at_last
        # unload() gives a loan still out back (another model keeps the
        # device and the fake cache open).
        other = vt.offload(mlp(seed=3, depth=1), device=h.device)
        h.hot_path.lend_before()
        assert lender.out
        h.unload()
        assert not lender.out and not cache.out
    finally:
        _finish(lender, cache, h, other)


def test_a_loan_lent_in_part_at_a_forwards_end():
    """VPAGER_LEND_EARLY: the loan is borrowed at a forward's end and only
    its first bytes lent then: the prefetch fills those (the pause's
    copies), nothing past them; the next forward's start lends the rest
    and the prefetch goes on there; that forward takes the weights from
    both and gives the loan back unforced; bitwise over six forwards."""
    m, x, want, h, lender, cache = _lent_mlp()
    weights = _weight_bytes(mlp(depth=8))   # the same seed: its weights
    # Loans of the whole fake cache, 256 KiB of them (a weight's) lent
    # at an end: the prefetch stages whole weights only.
    lender.cap, lender.early = LENT, 256 * K
    dev = h.device
    zeros = bytes(LENT)
    at_end, at_first = [], []

    def held(lo, hi):
        dev.synchronize()
        got = dev.read(cache.base + lo, hi - lo)
        return any(w[:4096] in got for w in weights), got == zeros[:hi - lo]

    def last_unit(mod, args):       # the start's loan is back by now
        dev.synchronize()
        dev.copy_to_device(cache.base, zeros)
        dev.synchronize()

    def first_unit(mod, args):
        at_first.append(held(256 * K, LENT) if lender.out else None)

    linears = [x for x in m.modules() if isinstance(x, torch.nn.Linear)]
    linears[-1].register_forward_pre_hook(last_unit)
    linears[0].register_forward_pre_hook(first_unit)
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        for i in range(6):
            returned = lender.returned
            assert torch.equal(m(x), want), "forward %d" % i
            assert lender.out and lender.rest, "forward %d" % i
            at_end.append((held(0, 256 * K)[0], held(256 * K, LENT)[1]))
            if i:
                assert lender.returned == returned + 1, "forward %d" % i
        # The first at a start (no end loan was out yet), one each end.
        assert lender.forced == 0 and lender.loans == 7, lender.stats()
        # At each end: a weight in the first 256 KiB, nothing past them.
        assert at_end == [(True, True)] * 6, at_end
        # At the first unit after an end loan: the rest holds weights.
        assert [a[0] for a in at_first[2:]] == [True] * 5, at_first
    finally:
        _finish(lender, cache, h)


def test_a_loan_filled_by_sms_at_a_forwards_end():
    """VPAGER_LEND_SM: the copies into the loan lent at a forward's end
    are read by SMs (vp_prefetch_sm; the simulated device copies as a
    GPU's kernel would: stats' sm_copy_bytes counts them) from the
    model's pinned host copy; outputs bitwise, the loans back unforced."""
    m, x, want, h, lender, cache = _lent_mlp()
    lender.cap, lender.early, lender.sm = LENT, LENT, 8
    dev = h.device
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        grew = []
        for i in range(4):
            before = dev.stats()["sm_copy_bytes"]
            assert torch.equal(m(x), want), "forward %d" % i
            assert lender.out and lender.rest == []
            grew.append(dev.stats()["sm_copy_bytes"] - before)
        assert all(g > 0 for g in grew), grew
        assert lender.forced == 0, lender.stats()
    finally:
        _finish(lender, cache, h)


def test_pause_gives_a_loan_made_at_a_forwards_end_back():
    """Offloaded.pause() (a sampler's run of forwards done): the loan the
    last forward's end made goes back to torch at once, its staged
    weights dropped; the next forward runs bitwise and lends anew; a
    pause with nothing lent does nothing."""
    m, x, want, h, lender, cache = _lent_mlp()
    lender.cap, lender.early = LENT, 256 * K
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        assert torch.equal(m(x), want)
        assert lender.out and lender.rest and cache.out
        forced = lender.forced
        h.pause()
        assert not lender.out and not cache.out and lender.rest is None
        assert lender.forced == forced + 1
        h.pause()
        assert lender.forced == forced + 1
        loans = lender.loans
        assert torch.equal(m(x), want)
        assert lender.loans == loans + 2    # at its start, at its end
    finally:
        _finish(lender, cache, h)


def test_split_ranges():
    r = [(0, 256 * K), (1 << 20, 64 * K)]
    assert lend.split_ranges(r, 96 * K) == (
        [(0, 96 * K)], [(96 * K, 160 * K), (1 << 20, 64 * K)])
    assert lend.split_ranges(r, 256 * K + 1000) == (
        [(0, 256 * K), (1 << 20, 512)], [((1 << 20) + 512, 64 * K - 512)])
    assert lend.split_ranges(r, 1 << 30) == (r, [])
    assert lend.split_ranges(r, 0) == ([], r)


def _two_models():
    """Two 8-layer MLPs on one device, the first offloaded as _offload()
    does, its device lending to a FakeCache: (m1, m2, x, their outputs
    resident, h1, h2, lender, cache)."""
    m1, m2 = mlp(seed=1, depth=8), mlp(seed=2, depth=8)
    x = torch.randn(8, 64)
    w1, w2 = frozen_copy(m1)(x), frozen_copy(m2)(x)
    h1 = _offload(m1)
    h2 = vt.offload(m2, device=h1.device)
    return (m1, m2, x, w1, w2, h1, h2) + _lending(h1)


def test_another_model_takes_the_loan_back():
    """A loan one model's forward still has out (lent as its forward's
    start lends) is taken back (forced) before another model's unit runs
    on the device; both stay bitwise."""
    m1, m2, x, w1, w2, h1, h2, lender, cache = _two_models()
    try:
        assert torch.equal(m1(x), w1)       # the first: recorded
        for _ in range(3):
            assert torch.equal(m1(x), w1)
            h1.hot_path.lend_before()
            assert lender.out and lender.owner is h1.hot_path
            forced = lender.forced
            assert torch.equal(m2(x), w2)
            assert lender.forced == forced + 1
            assert not lender.out or lender.owner is h2.hot_path
    finally:
        _finish(lender, cache, h2, h1)


class _Reclaims:
    """A device whose reclaim_staging calls are recorded (stream, force)."""

    def __init__(self, dev):
        self.dev, self.calls = dev, []

    def __getattr__(self, name):
        return getattr(self.dev, name)

    def reclaim_staging(self, stream=0, force=False):
        self.calls.append((stream, force))
        return self.dev.reclaim_staging(stream, force)


def test_a_loan_goes_back_on_the_stream_it_was_borrowed_on():
    """A loan one model's forward made on its stream is reclaimed on that
    stream whoever takes it back (torch hands its blocks to that stream's
    allocations next): before another model's unit, at its own unit's
    end, and its rest is lent there too."""
    m1, m2, x, w1, w2, h1, h2, lender, cache = _two_models()
    spy = lender.dev = _Reclaims(lender.dev)
    s1 = h1.device.create_stream()
    try:
        assert torch.equal(m1(x), w1)       # the first: recorded
        assert lender.lend(h1.hot_path, s1)
        assert torch.equal(m2(x), w2)       # takes it back, forced
        assert spy.calls == [(s1, True)], spy.calls
        assert not lender.out
        del spy.calls[:]
        lender.early = 64 * K
        assert lender.lend(h1.hot_path, s1, first=lender.early)
        lent = []
        lend_staging = h1.device.lend_staging
        spy.lend_staging = lambda a, n, st=0: (lent.append(st),
                                               lend_staging(a, n, st))
        assert lender.lend_at_start(h1.hot_path, 0)
        assert lent and set(lent) == {s1}, lent     # each range of the rest
        lender.released()       # nothing staged there waits: back
        assert not lender.out and spy.calls == [(s1, False)], spy.calls
    finally:
        lender.dev = spy.dev
        h1.device.synchronize()
        h1.device.destroy_stream(s1)
        _finish(lender, cache, h2, h1)


def test_a_loan_is_not_taken_back_while_another_thread_lends_it():
    """Models on one device run on several threads: a take_back() from
    another thread while a loan is being borrowed and lent waits for
    the lend to finish, then gets the whole loan back (without the
    Lender's lock it found no pieces yet and the loan stayed out, or
    gave the blocks back to torch while they were being lent)."""
    import threading
    m, x, want, h, lender, cache = _lent_mlp()
    borrow = cache.borrow
    taker, done = [], []

    def borrow_beside_a_taker(n):
        if not taker:
            t = threading.Thread(target=lambda: done.append(
                lender.take_back()))
            taker.append(t)
            t.start()
            t.join(0.2)
            # Still waiting for the lend (deterministic with the lock: it
            # cannot go on while this thread holds it).
            done.append(t.is_alive())
        return borrow(n)

    try:
        assert torch.equal(m(x), want)      # the first: recorded
        cache.borrow = borrow_beside_a_taker
        assert lender.lend(h.hot_path, 0)
        pieces = len(lender.pieces)
        taker[0].join()
        assert done == [True, True], done
        assert pieces > 1 and not lender.out and not cache.out
        assert lender.forced == 1 and lender.returned == 1
        cache.borrow = borrow
        assert torch.equal(m(x), want)
    finally:
        cache.borrow = borrow
        _finish(lender, cache, h)


def test_a_loan_that_grew_torch_shrinks_the_loans():
    """torch's allocator reserving more across a loan (here: at each
    borrow, as if no free block fitted) shrinks the loans after it and
    empties torch's cache each time: a loan of two blocks loses its
    smaller, one of a single block is halved, until a loan would be
    under MIN_PIECE: lending ends on the device; the model runs on,
    bitwise."""
    m, x, want, h, lender, cache = _lent_mlp()
    cache.grow = True
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        caps = []
        for _ in range(4):      # 256 + 64 KiB lent: 256, 128, 64, 32 (under
                                # MIN_PIECE)
            assert torch.equal(m(x), want)
            caps.append(lender.cap)
        assert caps == [256 * K, 128 * K, 64 * K, 32 * K], caps
        assert lender.cache is None and cache.shrinks == lender.shrunk == 4
        assert not cache.out and lender.loans == 0
    finally:
        _finish(lender, cache, h)


def test_a_borrow_out_of_memory_shrinks_the_loans():
    """torch running out of memory for a borrow (no free block of the
    size, no memory to make one) does not fail the forward: the blocks
    borrowed go back, the loans after it shrink as when torch grew, and
    a loan that fits is made; bitwise."""
    m, x, want, h, lender, cache = _lent_mlp()
    cache.oom = 300 * K     # 256 + 64 KiB: the second borrow runs out
    try:
        assert torch.equal(m(x), want)      # the first: recorded
        for _ in range(3):
            assert torch.equal(m(x), want)
        assert lender.shrunk == 1 and cache.shrinks == 1, lender.stats()
        assert lender.cap == 256 * K and lender.loans == 2, lender.stats()
        assert lender.returned == 2 and not lender.out
    finally:
        _finish(lender, cache, h)


def test_torch_growing_back_to_its_peak_is_not_the_loans_doing():
    """Torch reserving more during a loan, but no more than the most it
    is known to have held (a client emptied its cache and the forward
    grew it back: ComfyUI at each prompt), shrinks nothing: every loan is
    made whole and comes back; past that peak, the next loan shrinks."""
    m, x, want, h, lender, cache = _lent_mlp()
    cache.grow = True
    cache.peak_now = cache.reserved_now + 64 * LENT
    try:
        for _ in range(5):
            assert torch.equal(m(x), want)
        assert lender.shrunk == 0 and lender.loans == 4, lender.stats()
        assert lender.returned == 4 and lender.cap == 320 * K
        cache.peak_now = 0
        assert torch.equal(m(x), want)
        assert lender.shrunk == 1 and lender.cap == 256 * K
    finally:
        _finish(lender, cache, h)


class _Kept(logging.Handler):
    """Keeps every record, its arguments alive, as pytest's log capture
    does."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_a_loan_the_library_refuses_ends_lending():
    """A loan vp_device_lend_staging refuses (here: a block that is not
    256-byte aligned) does not fail the forward: nothing stays lent,
    lending is off for the device, the outputs stay bitwise; the warning
    names the setting, and keeping its record (a log capture does) keeps
    no borrowed block alive."""
    m, x, want, h, lender, cache = _lent_mlp()
    cache.skew = 8
    kept = _Kept()
    logging.getLogger("vpager").addHandler(kept)
    try:
        for _ in range(3):
            assert torch.equal(m(x), want)
        assert lender.cache is None and not lender.out
        assert lender.loans == 0 and not cache.out
        said = [r.getMessage() for r in kept.records]
        assert any("VPAGER_LEND=1" in t and "vp_device_lend_staging" in t
                   for t in said), said
    finally:
        logging.getLogger("vpager").removeHandler(kept)
        _finish(lender, cache, h)


def test_a_loan_takes_at_most_its_cap():
    """VPAGER_LEND_CAP bounds a loan's bytes below the ring's (the fake
    cache's two free blocks would give the ring's 320 KiB); outputs stay
    bitwise."""
    m, x, want, h, lender, cache = _lent_mlp()
    lender.cap = None       # learned at the first loan, as from use()
    try:
        with environ(VPAGER_LEND_CAP="96K"):
            for i in range(3):
                assert torch.equal(m(x), want), "forward %d" % i
        assert lender.loans >= 1
        assert lender.stats()["bytes"] == 96 * K
    finally:
        _finish(lender, cache, h)


def test_nothing_is_lent_by_default():
    """Without VPAGER_LEND=1 (and on the simulated device, whatever it
    says) the device's Lender has no cache and no forward lends."""
    with environ(VPAGER_LEND="0"):
        assert not lend.enabled()
    m = mlp(depth=8)
    x = torch.randn(8, 64)
    want = frozen_copy(m)(x)
    h = offload_sim(m, 900 * K, 320 * K)
    try:
        for _ in range(2):
            assert torch.equal(m(x), want)
        lender = devices.devstate(h.device).lender
        assert lender.cache is None and not lender.out
    finally:
        h.unload()


def test_piece_sizes():
    """Whole free blocks, largest first, that fit in what is left of the
    cap, at most VP_LENT_RANGES of at least MIN_PIECE, each a multiple of
    512."""
    M = 1 << 20
    lend.MIN_PIECE = 8 * M
    assert lend.piece_sizes([100 * M, 50 * M, 30 * M], 128 * M) == \
        [100 * M]
    assert lend.piece_sizes([100 * M, 50 * M, 20 * M], 128 * M) == \
        [100 * M, 20 * M]
    assert lend.piece_sizes([4 * M, 2 * M], 128 * M) == []
    assert lend.piece_sizes([9 * M] * 20, 1 << 40) == [9 * M] * 8
    assert lend.piece_sizes([10 * M + 700], 20 * M) == []
    lend.MIN_PIECE = 64 * K


def test_cuda_lends_torchs_cache():
    """On a GPU: 12 layers of 2048x2048 float32 (192 MiB) at a 96 MiB
    budget with VPAGER_LEND=1 and activations of 32 MiB: forwards lend
    torch's freed blocks and take them back, bitwise, and torch's
    allocator reserves no more for it; the same with the loan lent in
    part at each forward's end (VPAGER_LEND_EARLY: a weight's 16 MiB),
    and whole there, filled by SMs (VPAGER_LEND_SM: the kernel's bytes,
    sm_copy_bytes counting them)."""
    if not torch.cuda.is_available():
        skip("no CUDA")
    M = 1 << 20
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048)
                              for _ in range(12)]).eval()
    ref = frozen_copy(m).cuda()
    x = torch.randn(4096, 2048, device="cuda")
    want = ref(x)
    for early, sm in (("0", "0"), ("16M", "0"), ("64M", "16")):
        with environ(VPAGER_LEND="1", VPAGER_LEND_EARLY=early,
                     VPAGER_LEND_SM=sm):
            h = vt.offload(m, device="cuda", budget=96 * M,
                           staging_size=32 * M, page_size=2 * M)
        try:
            before = h.stats()["device"]["sm_copy_bytes"]
            for i in range(10):
                assert torch.equal(m(x), want), "forward %d" % i
            torch.cuda.synchronize()
            st = h.stats()["lend"]
            by_sm = h.stats()["device"]["sm_copy_bytes"] - before
            print("    lend (early %s, sm %s): %s; %d bytes by SMs" % (
                early, sm, st, by_sm))
            assert st["on"] and st["loans"] >= 5, st
            assert st["returned"] >= st["loans"] - 1, st
            assert (by_sm > 0) == (sm != "0"), by_sm
        finally:
            h.unload()


def _no_grad(fn):
    """Inference, as a sampler runs it (a loan needs no autograd)."""
    def run():
        with torch.no_grad():
            fn()
    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


for _name in [n for n in list(globals()) if n.startswith("test_")]:
    globals()[_name] = _no_grad(globals()[_name])

if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
