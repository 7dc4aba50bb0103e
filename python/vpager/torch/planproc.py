"""The planner's process: schedule.plan_rings() in a child interpreter.

A plan is pure Python arithmetic (schedule.py): ~1 s of host time for
SDXL's 794 units. On a thread of the model's own process it would take
the GIL from the forward's thread, and a host-bound forward (SDXL's) is
slowed by as much as the plan costs, wherever the plan runs. So the
planner's thread (tuner._Planner) hands the plan (schedule.plan_job) to
one child Python per process, which loads schedule.py by its path (no torch, no vpager: it
starts in tens of milliseconds) and answers plan after plan over pipes
(pickle; the arguments are lists of numbers). The thread waits on the
pipe without the GIL. The child ends when this process closes the pipe.

call() returns None when no such process can be had (no
sys.executable, a sandbox without subprocesses, the child died): the
caller then computes the plan itself."""

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Optional, Tuple

_SCHEDULE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "schedule.py")
# The child: schedule.py by path, then one answer per pickled request
# (name, args): schedule.<name>(*args).
# SIGINT ignored: a Ctrl-C in the terminal is the parent's to handle.
_CHILD = r"""
import importlib.util, pickle, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
spec = importlib.util.spec_from_file_location("vpager_schedule", sys.argv[1])
s = importlib.util.module_from_spec(spec)
spec.loader.exec_module(s)
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    try:
        args = pickle.load(inp)
    except EOFError:
        break
    try:
        name, args = args
        msg = ("ok", getattr(s, name)(*args))
    except Exception as e:
        msg = ("error", "%s: %s" % (type(e).__name__, e))
    pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.flush()
"""


class _Child:
    """The one child process; None until first asked for, `broken` once
    it could not be started or died (never tried again)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: Optional[subprocess.Popen] = None
        self.broken = False
        self.started = 0            # children started (tests)

    def ask(self, args: Tuple[Any, ...]) -> Optional[Tuple[str, Any]]:
        with self.lock:
            if self.broken or not sys.executable:
                return None
            try:
                if self.proc is None:
                    self.proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-c", _CHILD, _SCHEDULE],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        creationflags=getattr(subprocess,
                                              "CREATE_NO_WINDOW", 0))
                    self.started += 1
                pickle.dump(args, self.proc.stdin,
                            protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.flush()
                return pickle.load(self.proc.stdout)
            except (OSError, EOFError, ValueError, pickle.PickleError):
                self.broken = True
                self._end()
                return None

    def close(self) -> None:
        with self.lock:
            self._end()

    def _end(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            p.stdin.close()         # the child's EOF: it ends
            p.wait(timeout=2.0)
        except Exception:           # noqa: BLE001 (ending anyway)
            p.kill()
        finally:
            if p.stdout is not None:
                p.stdout.close()


_CHILD_PROCESS = _Child()
atexit.register(_CHILD_PROCESS.close)


def call(name: str, *args: Any) -> Optional[Tuple[Any]]:
    """(schedule.<name>(*args),) computed in the planner's process, for
    functions of plain data (lists, numbers, dicts); None if the process
    cannot be had. One that raised there raises RuntimeError."""
    got = _CHILD_PROCESS.ask((name, args))
    if got is None:
        return None
    status, out = got
    if status != "ok":
        raise RuntimeError("vpager.torch: the planner's process: %s" % out)
    return (out,)
