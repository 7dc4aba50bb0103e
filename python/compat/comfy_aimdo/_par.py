"""Worker threads for the bulk host work of comfy_aimdo on vpager:
populating HostBuffer memory as it is extended and reading file slices
(issue 12, cold start). The work itself is system calls made through
ctypes (madvise, pread, memset), which drop the GIL, so Python threads run
it in parallel; what Python does per piece is a few microseconds against
milliseconds of kernel work.

threads() is how many workers a large piece of work is split over:
VPAGER_COMPAT_THREADS when set (1 = everything on the calling thread),
else the smaller of 8 and the CPUs this process may run on. set_threads()
changes it at run time (tests, benchmarks). The pool is made on first
use, grows when threads() grows, and is dropped in a forked child (whose
copy would have no threads behind it). No torch, no vpager: importable
anywhere.
"""

import itertools
import os
import threading

__all__ = ["threads", "set_threads", "run", "submit_all"]

MAX_THREADS = 64
_lock = threading.Lock()
_pool = None            # concurrent.futures.ThreadPoolExecutor
_pool_size = 0
_threads = None         # set_threads() / VPAGER_COMPAT_THREADS, once read


def _default():
    from vpager import env      # not at import: no vpager before init()
    n = env.count("VPAGER_COMPAT_THREADS")
    if n is not None:
        return n
    try:
        ncpu = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        ncpu = os.cpu_count() or 1
    return max(1, min(8, ncpu))


def threads():
    """Workers a large piece of work is split over (>= 1)."""
    global _threads
    if _threads is None:
        _threads = _default()
    return _threads


def set_threads(n=None):
    """Set threads() to n (1..64); None: back to the default (the
    environment is read again). Returns the previous value."""
    global _threads
    old = threads()
    _threads = None if n is None else max(1, min(MAX_THREADS, int(n)))
    return old


def _get_pool(n):
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            from concurrent.futures import ThreadPoolExecutor
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=n,
                                       thread_name_prefix="comfy_aimdo")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _forget_pool():
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def run(fn, items, workers=None):
    """fn(item) for every item, over up to `workers` (default threads())
    threads, the calling thread one of them, items taken in order: the
    results in order once every call has finished. The first exception
    (in item order) is raised only after all calls finished (the callers'
    work writes memory that must not be written once they return)."""
    items = list(items)
    k = len(items)
    n = min(threads() if workers is None else max(1, int(workers)), k)
    if n <= 1:
        return [fn(x) for x in items]
    results, errors = [None] * k, [None] * k
    nxt = itertools.count()             # next() is atomic under the GIL

    def worker():
        while True:
            i = next(nxt)
            if i >= k:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as e:  # noqa: BLE001
                errors[i] = e
    pool = _get_pool(n - 1)
    futs = [pool.submit(worker) for _ in range(n - 1)]
    worker()
    for f in futs:
        f.result()
    for e in errors:
        if e is not None:
            raise e
    return results


def submit_all(fn, items):
    """fn(item) for every item on the pool's threads() workers, queued in
    order: their concurrent.futures.Futures, in order (the caller waits
    for each, e.g. to pass a finished piece on while later ones run)."""
    pool = _get_pool(threads())
    return [pool.submit(fn, x) for x in items]
