"""Torch's idle cache lent to the staging ring at a forward's start
(VPAGER_LEND=1; off by default: Flux on the H100 ran 0.1-3.3% faster a
step lent than not, in one process, lent at the end within the host's
noise, and no other workflow was measured with it: bench/RESULTS.md,
forty-fourth to fifty-first sessions).

Between a sampler's steps the GPU waits for the host (the sampler, the
client's callback, the next step's inputs: Flux under the ComfyUI node on
the H100, ~7 ms from a step's start to its forward's first large
kernel, the same resident). The ring is full of the forward's first
streamed weights then, and the copy engine stands idle until the first
streamed unit releases a slot, while torch's allocator holds blocks free
that the forward's first units do not touch. At the start of a root
forward, once the device's Lender has a plan's last streamed unit, it
borrows the largest of the blocks free then (torch.empty on the
forward's stream: torch's own stream order keeps them from its other
users) and lends them to the ring (vp_device_lend_staging); that unit's
prefetch then goes on into them, staging the forward's weights after
those the ring holds (HotPath.lend_before). The forward uses them after
the ring's; after each of its streamed units the Lender asks for them
back (vp_device_reclaim_staging: not while a weight staged there is
acquired or still waits for its acquire), the forward's stream then
waits for their copies (not for the ring's queued since), and the blocks
go back to torch's cache. Before another model's unit, at an
out-of-memory retry, at the next loan or when the model is unloaded
they are taken back whatever they hold.

Why at the forward's start, not its end: a loan made at the end filled
during the pause, and the client's own host-to-device copies in the
pause (ComfyUI moves a step's conditioning, 4 MB for Flux, from pageable
memory each step: the host waits for it) queued behind the loan's copies
on the copy engine: the host stalled 4-5 ms, the forward started that
much later (kineto traces, forty-ninth session). The forward's own
inputs are on the device by its start. Torch's allocation history over
a Flux step (bench/idle_cache.py, H100) left 296 MB of its large
segments untouched (two blocks, 189 and 107 MB) from a forward's end to
the next forward's second double block: a loan of those blocks at the
start lasts until about then.

With VPAGER_LEND_EARLY=N the loan is borrowed at the root forward's end
instead and only its first N bytes lent then (HotPath.lend_after): the
prefetch fills them in the pause before the next forward, and the rest
is lent at that forward's start (lend_rest(); a range that continues one
lent lengthens it). N is meant to be what the link copies before the
client's first copy of the next step is asked for (Flux under ComfyUI:
~2 ms into the pause, ~100 MB on an H100): a copy engine takes copies in
the order they were queued, whatever their stream (bench/
copy_queue_probe.py), so a longer fill holds that copy up. With
VPAGER_LEND_SM=P as well, the fill at the end is read by P blocks of SMs
(vp_prefetch_sm) from the pinned host copy instead: it shares the link
with the client's copies and holds none up, so N may be the whole loan;
the SMs it takes are idle then (the GPU waits for its host).

A loan during which torch's allocator reserved more than the most it is
known to have held (the Governor's torch peak: it wanted a block the
loan held before the loan came back, or found none free of a borrowed
size) shrinks the loans after it: a loan of several blocks loses its
smallest (Flux: with 189, 107 and 27 MB lent torch grew, with the 189
and 107 alone it did not), one of a single block is halved, and lending
ends on the device below MIN_PIECE; torch's cache is emptied, so the
extra reservation goes (one GPU synchronize each time). Torch growing again up to that peak is not a
loan's doing (a client emptied torch's cache: ComfyUI at each prompt).
The block sizes are read from torch's memory snapshot at the first loan
and after each shrink: the same forwards free the same blocks."""

import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import LENT_RANGES, env
from ..errors import Error

LEND = "VPAGER_LEND"
LEND_CAP = "VPAGER_LEND_CAP"
LEND_EARLY = "VPAGER_LEND_EARLY"
LEND_SM = "VPAGER_LEND_SM"
log = logging.getLogger("vpager")

MIN_PIECE = 8 << 20         # smaller free blocks are not worth a range
PIECE_ALIGN = 512           # torch's block granularity


def enabled() -> bool:
    return env.flag(LEND, False)


class TorchCache:
    """torch's CUDA caching allocator on one device, as a Lender borrows
    from it. reserved: () -> the bytes it holds now; peak: () -> the most
    it is known to have held (the device's Governor's)."""

    def __init__(self, target: torch.device, index: int,
                 reserved: Callable[[], int], peak: Callable[[], int]):
        self.target, self.index = target, index
        self.reserved, self.peak = reserved, peak

    @staticmethod
    def usable() -> bool:
        """Blocks of torch's native allocator without expandable segments
        (whose free blocks the snapshot lists as lendable ranges)."""
        backend = getattr(torch.cuda, "get_allocator_backend", None)
        if backend is not None and backend() != "native":
            return False
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        return "expandable_segments:true" not in conf.replace(
            " ", "").lower()

    def free_blocks(self, stream: int) -> List[int]:
        """Sizes of the free blocks of this device's large segments that
        allocations on `stream` may take, largest first."""
        out = []
        for seg in torch.cuda.memory_snapshot():
            if (seg.get("device") != self.index
                    or seg.get("segment_type") != "large"
                    or int(seg.get("stream", 0)) != stream):
                continue
            out.extend(int(b["size"]) for b in seg.get("blocks", ())
                       if b.get("state") == "inactive")
        return sorted(out, reverse=True)

    def borrow(self, nbytes: int) -> Tuple[Any, int]:
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.target)
        return t, t.data_ptr()

    def shrink(self) -> None:
        torch.cuda.empty_cache()


def split_ranges(ranges: List[Tuple[int, int]], first: int
                 ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """ranges [(addr, bytes)] cut after their first `first` bytes (down to
    PIECE_ALIGN): (those bytes' ranges, the rest's)."""
    now, later = [], []
    left = max(first, 0) // PIECE_ALIGN * PIECE_ALIGN
    for a, n in ranges:
        if left >= n:
            now.append((a, n))
            left -= n
        elif left:
            now.append((a, left))
            later.append((a + left, n - left))
            left = 0
        else:
            later.append((a, n))
    return now, later


def piece_sizes(free: List[int], cap: int) -> List[int]:
    """What to borrow of free blocks (largest first): whole blocks that
    fit in what is left of cap bytes, at most LENT_RANGES, each at least
    MIN_PIECE. Whole: torch's allocator gives a request the smallest free
    block that holds it, so a block's own size lands on that block (or
    one as large), where a part of it would be cut from whichever block
    fits best, a block the next forward may want."""
    out, total = [], 0
    for b in free:
        if len(out) == LENT_RANGES:
            break
        if MIN_PIECE <= b <= cap - total and b % PIECE_ALIGN == 0:
            out.append(b)
            total += b
    return out


class Lender:
    """The device's loans of torch's cache to its staging ring (module
    doc). Off (cache None) until a CUDA model's hot path brings torch's
    allocator (use()) with VPAGER_LEND=1.

    Models on one device run forwards on several threads at once
    (serial.py locks a model, not the device): each method here runs
    under the Lender's lock, so that a loan's blocks never go back to
    torch while another thread still lends them to the ring; and a loan
    is lent and reclaimed on the stream it was borrowed on (torch gives
    its blocks to that stream's allocations next), whichever model's
    thread takes it back."""

    __slots__ = ("dev", "cache", "sizes", "cap", "early", "sm", "pieces",
                 "rest", "stream", "reserved", "owner", "loans", "returned",
                 "forced", "shrunk", "lock")

    def __init__(self, dev):
        self.lock = threading.RLock()
        self.dev = dev
        self.cache: Optional[TorchCache] = None
        self.sizes: Optional[List[int]] = None  # learned at the first loan
        self.cap: Optional[int] = None  # a loan's most bytes (the ring's)
        self.early = 0              # bytes lent at a forward's end
        self.sm = 0                 # their copies by that many SM blocks
        self.pieces: List[Tuple[Any, int, int]] = []  # (keep, addr, bytes)
        # An end loan's ranges borrowed and not lent yet (None: no loan
        # lent in part at a forward's end is out)
        self.rest: Optional[List[Tuple[int, int]]] = None
        self.stream = 0             # the loan's: borrowed, lent, reclaimed
        self.reserved = 0           # torch's reservation at the loan
        self.owner: Any = None      # the hot path whose forward lent
        self.loans = self.returned = 0     # made, come back
        self.forced = 0             # taken back whatever they held
        self.shrunk = 0             # loans shrunk: torch reserved more

    @property
    def out(self) -> bool:
        return bool(self.pieces)

    def use(self, target: torch.device, index: int,
            reserved: Callable[[], int], peak: Callable[[], int]) -> None:
        """Lend from torch's cache on `target` (once per device; nothing
        unless VPAGER_LEND=1 and torch's allocator has lendable blocks)."""
        with self.lock:
            if self.cache is None and enabled() and TorchCache.usable():
                self.cache = TorchCache(target, index, reserved, peak)
                self.early = env.size(LEND_EARLY) or 0
                self.sm = env.count(LEND_SM) or 0

    def lend_at_start(self, owner: Any, stream: int) -> bool:
        """At the start of owner's root forward, on its stream: the rest
        of the loan its last forward lent in part at its end, else a new
        loan; True if anything was lent."""
        with self.lock:
            if self.rest is not None and self.owner is owner:
                return self.lend_rest()
            return self.lend(owner, stream)

    def lend(self, owner: Any, stream: int,
             first: Optional[int] = None) -> bool:
        """At the start of owner's root forward, on its stream (or, first
        bytes of it, at its end: the rest is lend_rest()'s); True if a
        loan was made."""
        with self.lock:
            return self._lend(owner, stream, first)

    def _lend(self, owner: Any, stream: int, first: Optional[int]) -> bool:
        cache = self.cache
        if cache is None:
            return False
        if self.pieces and not self.take_back(force=True):
            return False        # a weight staged there is acquired still
        learned = self.sizes is None
        if learned:
            if self.cap is None:
                ring = int(self.dev.options["staging_size"])
                given = env.size(LEND_CAP)
                self.cap = ring if given is None else min(given, ring)
            self.sizes = piece_sizes(cache.free_blocks(stream), self.cap)
        if not self.sizes:
            return False
        # Torch may hold up to its known peak while the loan is out.
        before = max(cache.reserved(), cache.peak())
        pieces, failed = [], None
        try:
            for n in self.sizes:
                keep, addr = cache.borrow(n)
                pieces.append((keep, addr, n))
                del keep
        except RuntimeError as e:   # torch's out of memory: none free,
            failed = str(e)         # none to be had (not e: its frames)
        if failed is not None or cache.reserved() > before:
            pieces.clear()          # (before torch's cache empties)
            self._shrink("a block of %s was not free%s" % (
                ", ".join(str(n) for n in self.sizes),
                "" if failed is None else " (%s)" % failed.split("\n")[0]))
            return False
        self.reserved, self.owner, self.stream = before, owner, stream
        ranges = [(a, n) for _, a, n in pieces]
        now, rest = (ranges, []) if first is None else \
            split_ranges(ranges, first)
        self.rest = None if first is None else rest
        self.pieces, pieces = pieces, None
        if not self._lend_ranges(now):
            return False
        self.loans += 1
        if learned:     # the blocks a loan of these sizes takes
            log.info("vpager.torch (%s=1): a loan of %d bytes: %s", LEND,
                     sum(self.sizes), ", ".join(
                         "%d at 0x%x" % (n, a) for _, a, n in self.pieces))
        return True

    def lend_rest(self) -> bool:
        """At the start of the forward after one that lent the first bytes
        of a loan at its end: the rest of it lent (each range continues
        one lent or is a block of its own); True if anything was."""
        with self.lock:
            rest, self.rest = self.rest or [], None
            return bool(rest) and self._lend_ranges(rest)

    def _lend_ranges(self, ranges: List[Tuple[int, int]]) -> bool:
        """ranges of the borrowed blocks lent to the ring on the loan's
        stream; a refusal ends lending on the device (a forward goes on
        without a loan)."""
        refused = None
        try:
            for a, n in ranges:
                self.dev.lend_staging(a, n, self.stream)
        except Error as e:
            refused = str(e)    # not e: its frames hold the blocks
        if refused is None:
            return True
        self.dev.reclaim_staging(self.stream, True)
        self.pieces, self.rest, self.owner = [], None, None
        self.cache = None
        log.warning("vpager.torch (%s=1): lending torch's cache to the "
                    "staging ring failed, off for this device: %s",
                    LEND, refused)
        return False

    def released(self) -> None:
        """After a streamed unit's release: the loan back if nothing
        staged there waits any more."""
        with self.lock:
            if self.pieces and self.dev.reclaim_staging(self.stream):
                self._returned()

    def take_back(self, force: bool = True) -> bool:
        """The loan back now (force: the weights staged there and not
        acquired dropped); False while an acquire holds one of them."""
        with self.lock:
            if not self.pieces:
                return True
            if not self.dev.reclaim_staging(self.stream, force):
                return False
            self.forced += force
            self._returned()
            return True

    def take_back_unless(self, owner: Any) -> None:
        """Before a unit of owner's: a loan another model's forward made,
        back whatever it holds (owner's prefetch would stage there)."""
        with self.lock:
            if self.pieces and self.owner is not owner:
                self.take_back(force=True)

    def take_back_of(self, owner: Any) -> None:
        """owner's loan back (its model unloads), whatever it holds."""
        with self.lock:
            if self.owner is owner:
                self.take_back(force=True)

    def stats(self) -> Dict[str, Any]:
        """{"on": lending, "bytes": a loan's, "loans", "returned",
        "forced": loans made, come back, taken back whatever they held,
        "shrunk": times torch reserved more across a loan}."""
        return {"on": self.cache is not None,
                "bytes": sum(self.sizes or ()), "loans": self.loans,
                "returned": self.returned, "forced": self.forced,
                "shrunk": self.shrunk}

    def holds(self, addr: int) -> bool:
        return any(a <= addr < a + n for _, a, n in self.pieces)

    def _returned(self) -> None:
        self.pieces = []        # the blocks back to torch, in stream order
        self.rest = None
        self.owner = None
        self.returned += 1
        cache = self.cache
        # The peak known now, not at the loan: the Governor may have
        # learned a higher one since (a client's work before this
        # forward, a VAE's decode between two prompts), not the loan's.
        if cache is not None and \
                cache.reserved() > max(self.reserved, cache.peak()):
            self._shrink("torch's allocator reserved more than its known "
                        "peak while it was out")

    def _shrink(self, why: str) -> None:
        """The loans after this one without its smallest block (half of
        a single one; none below MIN_PIECE), torch's extra reservation
        given back."""
        self.shrunk += 1
        sizes = self.sizes or [0]
        self.cap = (sum(sizes) - min(sizes) if len(sizes) > 1
                    else sizes[0] // 2)
        self.sizes = None
        cache = self.cache
        if self.cap < MIN_PIECE:
            self.cache = None
        log.info("vpager.torch (%s=1): %s; %s", LEND, why,
                 "lending torch's cache to the staging ring is off for "
                 "this device" if self.cache is None else
                 "a loan is at most %d bytes from now" % self.cap)
        cache.shrink()
