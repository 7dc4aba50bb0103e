"""A model's host copy filled behind offload(): a thread copies the
weights into the pinned copy's memory in its order (the VBAR's first
placement, close to the order of use) while offload() returns and the
first forward runs, page-locking it piece by piece as it fills.

A first load used to be two waits one after the other: the whole copy
(a 22 GiB model: 1.7 s on the H200, page-locking included), then the
first forward (1.3 s, every weight crossing the link). Behind, the
forward's units wait only for their own weights, so the two overlap: the
first forward ends about when the copy does. Measured, it did not: on
the H100 (10 GiB, bench/first_prompt_sim.py) the copy behind ran at 5.6
GiB/s against 7.5 made before, so offload and first forward took 1.80 s
against 1.61; it is off unless VPAGER_COPY_BEHIND=1 asks for it.

What keeps it correct (Layout and HotPath ask; the copier owns nothing
else): no byte of the copy is read before it is written. A unit's acquire
waits for its weights (wait(entries)); while the copy runs no weight of
the model prefetches (Layout.set_windows gives them windows of 0, so no
acquire copies another unit's weights ahead), and every other reader of
the host copy (held units, the tuner's warm fill, restoring the module's
tensors, a new file) waits for the whole copy. The copier never touches
the module's tensors (offload() puts placeholders in them meanwhile); it
holds the source tensors until their bytes are copied, then drops them,
so a model in anonymous memory leaves it as the copy advances. Each
batch's pages are page-locked (a HostBuf of their own, registering
touched memory: cheap) before its weights are said to be there, so the
first forward copies them at pinned speed; the C library splits a copy
at the pieces' edges (src/hostmem.c)."""

import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

# Bytes copied (on copy_all's threads) between two publications of
# progress: a unit waits at most about this much after its weights land.
BATCH = 64 << 20
# Edges of the page-locked pieces (a huge page: a multiple of any host
# page size): two registrations never share a page.
PIN_ALIGN = 2 << 20


def batches(jobs: Sequence[Tuple[Any, Any]], limit: int):
    """(i, j) ranges of jobs[i:j] in order, each at least one job and
    under `limit` bytes where it can be (jobs: (entry, ...) with
    entry.size)."""
    i = 0
    while i < len(jobs):
        j, size = i, 0
        while j < len(jobs) and (j == i or size < limit):
            size += jobs[j][0].size
            j += 1
        yield i, j
        i = j


class HostLoad:
    """The fill of one host copy on a thread of its own, and then the copy
    itself (size, close(): the layout's HostBuf in effect). jobs: [(entry,
    what to copy)] in the copy's order, ends[i] the offset in the copy
    where job i's bytes end; batch_copy(jobs) copies a batch of them
    (sources.copy_jobs: at memory speed); register(lo, hi) page-locks
    bytes [lo, hi) of the copy (lo, hi: PIN_ALIGN-aligned addresses' offsets;
    the last hi the mapping's end) and returns their HostBuf: each batch's
    pages as they are filled, so that the first forward copies from
    pinned memory too; end(): when it stops (its threads, the progress
    bar).
    Entries not in jobs are always ready."""

    def __init__(self, jobs: Sequence[Tuple[Any, Any]], ends: Sequence[int],
                 batch_copy: Callable[[List[Tuple[Any, Any]]], None],
                 register: Callable[[int, int], Any], total: int,
                 base: int, mapped: int,
                 end: Callable[[], None] = lambda: None) -> None:
        self.total = total          # bytes of the copy
        self._pos = {id(e): i for i, (e, _c) in enumerate(jobs)}
        self._jobs: Optional[List] = list(jobs)
        self._ends = list(ends)
        self._batch_copy = batch_copy
        self._register = register
        self._base, self._mapped = base, mapped
        self._end = end
        self.copied = 0             # jobs copied (and their pages locked)
        self.filled = False         # every job copied
        self.hbs: List[Any] = []    # HostBufs page-locking the copy
        self.error: Optional[BaseException] = None
        self.finished = False       # copied and locked, failed or stopped
        self.fill_s = self.lock_s = 0.0
        self._locked = 0            # bytes page-locked, from the start
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="vpager-host-copy")
        self._started = False

    def start(self) -> None:
        """The copier on its way (once; offload() starts it at its end,
        after the link is measured beside no copy; a wait starts it)."""
        with self._cond:            # (cancel() sees it started or not)
            if self._started:
                return
            self._started = True
            self._thread.start()

    @property
    def size(self) -> int:
        return self.total

    def close(self) -> None:
        """Stop the copier (cancel()), then the copy's HostBufs closed."""
        self.cancel()
        hbs, self.hbs = self.hbs, []
        for hb in hbs:
            hb.close()

    # ------------------------------------------------ the copier's thread
    def _lock_upto(self, end: int, last: bool) -> None:
        """Page-lock the copy's bytes from where the last call stopped up
        to `end` (down to a PIN_ALIGN edge; the last: the mapping's end)."""
        lo = self._locked
        if last:
            hi = self._mapped
        else:
            hi = (self._base + end) // PIN_ALIGN * PIN_ALIGN - self._base
        if hi <= lo:
            return
        t = time.perf_counter()
        self.hbs.append(self._register(lo, hi))
        self._locked = hi
        self.lock_s += time.perf_counter() - t

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            jobs = self._jobs
            for i, j in batches(jobs, BATCH):
                if self._stop:
                    return
                self._batch_copy(jobs[i:j])
                for k in range(i, j):       # the sources may go now
                    jobs[k] = (jobs[k][0], None)
                self._lock_upto(self._ends[j - 1], j == len(jobs))
                with self._cond:
                    self.copied = j
                    self.filled = j == len(jobs)
                    self._cond.notify_all()
            self.fill_s = time.perf_counter() - t0 - self.lock_s
        except BaseException as e:      # noqa: BLE001 (the waiters raise it)
            with self._cond:
                self.error = e
        finally:
            try:
                self._end()
            except Exception:   # noqa: BLE001 (a progress bar's end)
                pass
            with self._cond:
                self._jobs = None
                self.finished = True
                self._cond.notify_all()

    # ------------------------------------------------------- the readers
    def ready(self, entries: Sequence[Any]) -> bool:
        """Whether every one of `entries` has its bytes in the copy."""
        pos, copied = self._pos, self.copied
        return all(pos.get(id(e), -1) < copied for e in entries)

    def wait(self, entries: Optional[Sequence[Any]] = None) -> None:
        """Until `entries` (None: all) have their bytes in the copy (the
        page-locking may still run); the copier's error, if it failed
        first."""
        self.start()
        with self._cond:
            while not (self.finished or self.filled or (
                    entries is not None and self.ready(entries))):
                self._cond.wait()
            if self.error is not None:
                raise RuntimeError(
                    "vpager.torch: the host copy of the model failed while "
                    "the first forwards ran (%s: %s); offload() the model "
                    "again" % (type(self.error).__name__, self.error)
                ) from self.error
            if not (self.filled or (entries is not None
                                    and self.ready(entries))):
                raise RuntimeError("vpager.torch: the host copy of the "
                                   "model was stopped (the model closed)")

    def cancel(self) -> None:
        """Stop copying (after the batch in flight) and wait for the
        thread: the copy's memory may be freed once hbs are closed."""
        self._stop = True
        with self._cond:
            self._started = True        # never started from now on
            if self._thread.ident is None:      # nor was it: done
                self.finished = True
                self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
