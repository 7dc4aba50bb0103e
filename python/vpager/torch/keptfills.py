"""A fill's result kept on the host for a weight the schedule streams.

A weight with a fill (patches.set_fill: a LoRA's patch computed on the
device) runs it each time its bytes come from their source: once while it
stays resident, at every step while it streams. On fp8 Flux with a LoRA at
half its bytes every patched weight streamed and its patch math (fp32, the
LoRA, stochastic rounding to fp8) ran at each fill: 1512 MiB a step, the
step 1.76x the one without (bench/RESULTS.md, twenty-fourth session).

So once the schedule in place has settled and streams such a weight, its
bytes as its fill left them are copied once into a pinned host buffer of
its own (at its next fill, after the fill, on the acquiring stream) and
from the next root forward on they are its source (vp_weight_swap_source:
what an acquire used stays valid) and its fill rests: it streams as an
unpatched weight does, for its copy's link time. The bytes are the fill's
own, so outputs stay bitwise those of the fill.

It gets its fill back and the buffer goes when its fill or source changes
(patches.py: restore(); a new fill of a streamed weight takes the same
buffer), and when it turns resident (its pages keep the bytes: swapped
back, nothing copied again). A buffer is taken only while RAM available
stays above RESERVE after it (where RAM is known) and only if the pin
budget page-locks it whole; otherwise the fill runs as before. The
buffers are made and page-locked on a thread of their own (BACKGROUND:
page-locking fresh memory costs 155-300 ms/GiB, bench/RESULTS.md, a stop
of the forward's thread of ~0.3 s for fp8 Flux's 1.5 GiB), armed at the
first root forward's start after it finished. RAM available below half of
the reserve (read at most once a CHECK_EVERY) lets every kept fill go,
said in one line. VPAGER_KEEP_FILLS=0 turns it off."""

import logging
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import torch

from .. import env
from ..errors import Error
from ..weights import Source
from .hostpolicy import ram_available, ram_total
from .layout import Layout
from .sources import host_memory

KEEP_FILLS = "VPAGER_KEEP_FILLS"
RESERVE = 4 << 30           # RAM left available after a buffer, at least
RESERVE_SHARE = 8           # ... and 1/8 of the machine's
CHECK_EVERY = 1.0           # seconds between two reads of RAM available
BACKGROUND = True           # buffers page-locked off the forward's thread

log = logging.getLogger("vpager")


def reserve() -> int:
    """RAM to leave available after a buffer (RESERVE, RESERVE_SHARE)."""
    return max(RESERVE, ram_total() // RESERVE_SHARE)


def restore(e: Any) -> None:
    """Weight e's fill back if its result was kept, before patches.py
    changes its fill or source (it sets e.own, its own source, again; the
    buffer stays the keeper's, to take the new fill's bytes or be freed
    at the next root forward's start)."""
    if e.kept is not None:
        e.fill, e.kept, e.alt = e.kept, None, None


class KeptFills:
    """The model's kept fills (module doc): ran() after each fill (the hot
    path), between() at each root forward's start (the root's "keep"
    slot of `hooks`, filled from a fill's run until nothing is left to
    do); streamed() says which weights the settled schedule streams (the
    tuner's), None while it is not settled. Each buffer is the keeper's
    (bufs) from its page-locking to its close: armed for a fill, caught
    (its bytes on the way), kept (the weight's source, e.alt too), or
    spare (its weight's fill changed: armed again for the new one)."""

    def __init__(self, layout: Layout, hooks: Any,
                 streamed: Callable[[], Optional[FrozenSet[Any]]]) -> None:
        self.layout = layout
        self.hooks = hooks
        self.streamed = streamed
        self.on = env.flag(KEEP_FILLS, True)
        self.bufs: Dict[Any, Tuple[Any, torch.Tensor]] = {}  # (HostBuf, host)
        # Entry -> (fill, source): its buffer takes the next run of that
        # fill over bytes from that source.
        self.armed: Dict[Any, Tuple[Any, Any]] = {}
        # Entry -> (fill, source, event or None): its bytes as the fill
        # left them, on their way into its buffer.
        self.caught: Dict[Any, Tuple[Any, Any, Any]] = {}
        self.ran_last: set = set()      # weights filled since between()
        self.short = False              # RAM or pins ran short: no more
        self.hooked = False             # between() in the "keep" slot
        self.check_at = 0.0             # when RAM available is read next
        self.said = 0                   # kept weights last logged
        self.arm_s = 0.0                # page-locking since, seconds
        self.maker: Optional[threading.Thread] = None   # _make()'s
        self.made: list = []            # its (Entry, HostBuf, host)

    def ran(self, e: Any, v: torch.Tensor) -> None:
        """Weight e's fill rewrote its bytes in v (on the current stream):
        into its buffer if one is armed for this fill and source."""
        if not self.on:
            return
        if not self.hooked:
            self.hooks.set("keep", pre=self.between)
            self.hooked = True
        self.ran_last.add(e)
        got = self.armed.pop(e, None)
        if got is None:
            return
        fill, src = got
        if fill is not e.fill or src is not e.src or not e.size:
            return                          # spare: between() decides
        host = self.bufs[e][1]
        try:
            # Its bytes as bytes (any dtype: fp8, a quantized payload).
            with torch.no_grad(), torch.inference_mode(False):
                host.copy_(v.reshape(-1).view(torch.uint8),
                           non_blocking=True)
            ev = None
            if v.is_cuda:
                ev = torch.cuda.Event()
                ev.record()
        except Exception as x:      # noqa: BLE001 (never fails a forward)
            # No more: every buffer armed and not caught yet goes too.
            self.short = True
            for a in list(self.armed) + [e]:
                self._free(a)
            log.warning("vpager: %s's fill not kept (%s: %s); no fills are "
                        "kept, they run at each fill", e.name,
                        type(x).__name__, x)
            return
        self.caught[e] = (fill, src, ev)

    def between(self, module: Any = None, args: Any = None) -> None:
        """At a root forward's start: caught bytes become their weight's
        source, kept weights now resident get their fill back, and the
        weights the settled schedule streams whose fill ran (or whose
        kept fill was just replaced) get a buffer."""
        ran, self.ran_last = self.ran_last, set()
        if not (ran or self.bufs or self.maker):
            self.hooks.clear("keep")        # (filled again by a fill)
            self.hooked = False
            return
        if self.bufs and self._pressed():
            self._let_go()
            return
        streamed = self.streamed()
        resident = self.layout.resident_now()
        for e in list(self.caught):
            fill, src, ev = self.caught[e]
            if ev is not None and not ev.query():
                continue
            del self.caught[e]
            # Another fill or source since, or resident now: not kept.
            if fill is e.fill and src is e.src and not e.cur and \
                    not resident(e):
                self._keep(e)
        for e in list(self.bufs):
            if e in self.caught:
                continue
            if e.kept is not None:
                if not e.cur and resident(e):
                    self._unkeep(e)
            elif e.fill is None or resident(e) or (
                    streamed is not None and e not in streamed):
                self._free(e)
            elif streamed is None:          # spare until the plan settles
                self.armed.pop(e, None)
            else:                           # its new fill's, same buffer
                self.armed[e] = (e.fill, e.src)
        if self.maker is not None and not self.maker.is_alive():
            self._take_made(streamed, resident)
        self._say()
        if streamed is None or self.short or self.maker is not None:
            return
        room, low = ram_available(), reserve()
        want = []
        for e in ran:
            if e.fill is not None and e in streamed and \
                    e not in self.bufs and not resident(e):
                if room and room - e.size < low:
                    self.short = True
                    break
                room -= e.size
                want.append(e)
        if want and BACKGROUND:
            self.maker = threading.Thread(target=self._make, args=(want,),
                                          name="vpager-kept-fills",
                                          daemon=True)
            self.maker.start()
        elif want:
            self._make(want)
            self._take_made(streamed, resident)

    def will_keep(self, entries: Any) -> bool:
        """True if the fills of `entries` (weights whose fill ran while
        streamed) are or soon will be kept: kept fills on, neither RAM
        nor pins ran short, each still has its fill or a kept one (a
        weight the settled schedule makes resident runs its fill once
        more, there), and RAM available (where known) stays above the
        reserve after buffers for those without one (as between() asks).
        The hot path reads their peak as a one-off then."""
        if not self.on or self.short or not all(
                e.fill is not None or e.kept is not None for e in entries):
            return False
        want = sum(e.size for e in entries if e not in self.bufs)
        room = ram_available() if want else 0
        return not room or room - want >= reserve()

    @property
    def kept_bytes(self) -> int:
        """Host bytes of the fills kept now."""
        return sum(e.size for e in self.bufs if e.kept is not None)

    def close(self) -> None:
        """The buffers that are no weight's source freed (the kept ones
        go with their weights: patches.drop_alt); a thread making some
        waited for."""
        self._drop_made()
        for e in list(self.bufs):
            if e.kept is None:
                self._free(e)
        self.bufs.clear()
        self.armed.clear()
        self.caught.clear()

    # ------------------------------------------------------------ inside
    def _pressed(self) -> bool:
        """RAM available (read at most once a CHECK_EVERY) below half the
        reserve."""
        now = time.monotonic()
        if now < self.check_at:
            return False
        self.check_at = now + CHECK_EVERY
        ram = ram_available()
        return bool(ram) and ram < reserve() // 2

    def _let_go(self) -> None:
        """Every kept fill given back (their patches computed at each fill
        again) and every buffer freed: RAM ran short."""
        n, size = 0, self.kept_bytes
        self._drop_made()
        for e in list(self.bufs):
            if e.kept is not None:
                self._unkeep(e)
                n += 1
            elif e in self.bufs:
                self._free(e)
        self.short = True
        log.warning("vpager: RAM available fell under %d MiB: the fills "
                    "of %d streamed weights kept in pinned host memory "
                    "(%d MiB) were let go; they run at each fill again",
                    reserve() // 2 >> 20, n, size >> 20)
        self.said = sum(e.kept is not None for e in self.bufs)

    def _say(self) -> None:
        """One line when the number of kept fills changed to some (none
        kept is the moment a patch changed: the next line follows)."""
        n = sum(e.kept is not None for e in self.bufs)
        if n != self.said:
            self.said = n
            if n == 0:
                return
            log.info("vpager: the fills of %d streamed weights are kept in "
                     "pinned host memory (%d MiB, page-locked in %d ms): "
                     "they run no more", n, self.kept_bytes >> 20,
                     round(self.arm_s * 1e3))
            self.arm_s = 0.0

    def _make(self, want: list) -> None:
        """A page-locked buffer for each entry of `want`, into self.made
        (on the maker thread, or inline: BACKGROUND); stops at the first
        the pin budget would not page-lock whole (short). Touches no
        entry: between() decides what each buffer is for."""
        t0 = time.perf_counter()
        dev = self.layout.device
        try:
            for e in want:
                host, buf = host_memory(e.size)
                hb = dev.register_hostbuf(buf, max(e.size, 1))
                if hb.info()["pinned_bytes"] < e.size:
                    hb.close()
                    self.short = True
                    break
                self.made.append((e, hb, host))
        except Exception as x:      # noqa: BLE001 (the fills run as before)
            self.short = True
            log.warning("vpager: no buffer for kept fills (%s: %s); the "
                        "patches are computed at each fill", type(x).__name__,
                        x)
        self.arm_s += time.perf_counter() - t0

    def _drop_made(self) -> None:
        """The maker waited for, its buffers freed."""
        if self.maker is not None:
            self.maker.join()
            self.maker = None
        for _e, hb, _host in self.made:
            hb.close()
        self.made = []

    def _take_made(self, streamed: Any, resident: Callable) -> None:
        """The maker's buffers armed for the entries still streamed with a
        fill and none yet; the others freed."""
        made, self.made, self.maker = self.made, [], None
        for e, hb, host in made:
            if e.fill is not None and e not in self.bufs and \
                    streamed is not None and e in streamed and \
                    not resident(e):
                self.bufs[e] = (hb, host)
                self.armed[e] = (e.fill, e.src)
            else:
                hb.close()

    def _free(self, e: Any) -> None:
        self.armed.pop(e, None)
        self.caught.pop(e, None)
        hb = self.bufs.pop(e)[0]
        if not hb.closed:
            hb.close()

    def _keep(self, e: Any) -> None:
        """e's source from now on: the fill's bytes in its buffer; its
        fill rests. Left as it is if the weight would not take it."""
        hb = self.bufs[e][0]
        own = e.src
        try:
            self.layout.swap_source(e, Source.from_host(hb.ptr))
        except Error:
            return
        e.own, e.alt = own, hb
        e.kept, e.fill = e.fill, None

    def _unkeep(self, e: Any) -> None:
        """e resident: its own source and its fill again, its pages kept
        (they hold what the fill makes); the buffer freed."""
        try:
            self.layout.swap_source(e, e.own)
        except Error:
            return
        e.own = e.alt = None
        e.fill, e.kept = e.kept, None
        self._free(e)
