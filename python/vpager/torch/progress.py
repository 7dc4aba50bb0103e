"""Progress while offload() copies a large model into its host copy
(seconds to tens of seconds): a bar on a terminal (stderr is a tty), one
line when it ends otherwise; nothing when the copy is short (under
LARGE bytes and SLOW seconds). VPAGER_PROGRESS=0: never; 1: always."""

import sys
import threading
import time
from typing import Callable, Optional, TextIO

from .. import env
from .hostpolicy import gib as _gib

__all__ = ["Progress", "LARGE", "SLOW"]

LARGE = 1 << 30         # bytes: a copy this large is shown from its start
SLOW = 2.0              # seconds: a smaller one once it has taken this long
_EVERY = 0.1            # seconds between two redraws of the bar
_WIDTH = 30             # the bar's characters


class Progress:
    """advance(n) as n more of `total` bytes are done (from any thread);
    close() at the end. `what`: the line's subject."""

    def __init__(self, total: int, what: str,
                 stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.what = total, what
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        mode = env.flag("VPAGER_PROGRESS", None)
        self.on = mode is not False and total > 0
        self.always = mode is True
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self.done = 0
        self.start = clock()
        self.drawn = float("-inf")     # when the bar was last drawn
        self.lock = threading.Lock()

    def _long(self, now: float) -> bool:
        return (self.always or self.total >= LARGE
                or now - self.start >= SLOW)

    def _bar(self, now: float) -> str:
        frac = min(self.done / self.total, 1.0)
        fill = int(frac * _WIDTH)
        rate = self.done / max(now - self.start, 1e-9)
        return ("\r%s: [%s%s] %3d%% %s/%s %s/s" % (
            self.what, "#" * fill, " " * (_WIDTH - fill), frac * 100,
            _gib(self.done), _gib(self.total), _gib(rate)))

    def advance(self, n: int) -> None:
        if not self.on:
            return
        with self.lock:
            self.done += n
            now = self.clock()
            if self.tty and now - self.drawn >= _EVERY and self._long(now):
                self.drawn = now
                self.stream.write(self._bar(now))
                self.stream.flush()

    def close(self) -> None:
        if not self.on:
            return
        with self.lock:
            self.on = False
            now = self.clock()
            if not self._long(now):
                return
            secs = now - self.start
            if self.tty:
                self.stream.write(self._bar(now) + " %.1f s\n" % secs)
            else:
                self.stream.write("%s: %s in %.1f s (%s/s)\n" % (
                    self.what, _gib(self.total), secs,
                    _gib(self.total / max(secs, 1e-9))))
            self.stream.flush()
