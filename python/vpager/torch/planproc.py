"""The planner's processes: schedule.plan_rings() in child interpreters.

A plan is pure Python arithmetic (schedule.py): 1.4 s of host time for
SDXL's 794 units in one process on the H100, 0.14 s with a child per
ring size. On a thread of the model's own process it would take the GIL
from the forward's thread, and a host-bound forward (SDXL's) is slowed
by as much as the plan costs, wherever the plan runs. So the planner's
thread (tuner._Planner) hands the plan (schedule.plan_job) to child
Pythons, each of which loads schedule.py by its path (no torch, no
vpager: it starts in tens of milliseconds) and answers request after
request over pipes (pickle; the arguments are lists of numbers). The
thread waits on the pipes without the GIL. A child ends when this
process closes its pipe. call_each() spreads requests over up to WIDTH
children (each ring size a plan tries in one of its own).

call() and call_each() return None when no such process can be had (no
sys.executable, a sandbox without subprocesses, a child died): the
caller then computes the plan itself."""

import atexit
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, List, Optional, Tuple

_SCHEDULE = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         "schedule.py")
# The child: schedule.py by path, then one answer per pickled request
# (name, args): schedule.<name>(*args).
# SIGINT ignored: a Ctrl-C in the terminal is the parent's to handle.
# At a lower priority (NICE; Windows: below normal): a plan made while
# forwards run must not take a host-bound forward's core (on 2 cores the
# simulated device's forwards ran 1.5-2.3x while a plan job ran beside
# them, bench/first_prompt_sim.py); a plan the forward waits for has the
# cores the waiting thread leaves.
NICE = 10
_CHILD = r"""
import importlib.util, os, pickle, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
if hasattr(os, "nice"):
    try:
        os.nice(NICE)
    except OSError:
        pass
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
    """One child process, started at its first send()."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None

    def begin(self) -> None:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c",
                 _CHILD.replace("NICE", str(NICE)), _SCHEDULE],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                creationflags=getattr(subprocess, "CREATE_NO_WINDOW", 0) |
                getattr(subprocess, "BELOW_NORMAL_PRIORITY_CLASS", 0))

    def send(self, args: Tuple[Any, ...]) -> None:
        self.begin()
        pickle.dump(args, self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.flush()

    def recv(self) -> Tuple[str, Any]:
        return pickle.load(self.proc.stdout)

    def end(self) -> None:
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


class _Pool:
    """The children, started as asked for (at most WIDTH), `broken` once
    one could not be started or died (none tried again)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.children: List[_Child] = []
        self.broken = False

    def ask(self, requests: List[Tuple[Any, ...]]
            ) -> Optional[List[Tuple[str, Any]]]:
        """The answers to `requests`, run on up to WIDTH children at once
        (one request each at a time: a child's answer is read before it
        is sent another, so no pipe fills both ways)."""
        with self.lock:
            if self.broken or not sys.executable:
                return None
            width = max(1, min(len(requests), WIDTH))
            while len(self.children) < width:
                self.children.append(_Child())
            out: List[Tuple[str, Any]] = []
            try:
                for i in range(0, len(requests), width):
                    batch = requests[i:i + width]
                    for child, args in zip(self.children, batch):
                        child.send(args)
                    out += [child.recv() for child in
                            self.children[:len(batch)]]
            except (OSError, EOFError, ValueError, pickle.PickleError):
                self.broken = True
                self._end()
                return None
            return out

    def start(self) -> None:
        """The WIDTH children started now, not at the first request (a
        plan made on the forward's thread waits for none to start)."""
        with self.lock:
            if self.broken or not sys.executable:
                return
            while len(self.children) < WIDTH:
                self.children.append(_Child())
            try:
                for c in self.children:
                    c.begin()
            except OSError:
                self.broken = True
                self._end()

    def close(self) -> None:
        with self.lock:
            self._end()

    def _end(self) -> None:
        for c in self.children:
            c.end()


# Children that plan at once: one per ring size tried (schedule.
# plan_rings: SDXL's 794 units, 6 rings, 1.4 s in one child on the
# H100), at most half the cores, so the forward's own threads keep theirs.
WIDTH = max(1, min(6, (os.cpu_count() or 2) // 2))
_CHILDREN = _Pool()
atexit.register(_CHILDREN.close)


def start() -> None:
    """Start the planner's processes now (they idle until asked)."""
    _CHILDREN.start()


def call(name: str, *args: Any) -> Optional[Tuple[Any]]:
    """(schedule.<name>(*args),) computed in the planner's process, for
    functions of plain data (lists, numbers, dicts); None if the process
    cannot be had. One that raised there raises RuntimeError."""
    got = call_each(name, [args])
    return None if got is None else (got[0],)


def call_each(name: str, args_list: List[Tuple[Any, ...]]
              ) -> Optional[List[Any]]:
    """[schedule.<name>(*args) for args in args_list], computed by the
    planner's processes at once (up to WIDTH); None if they cannot be
    had. One that raised there raises RuntimeError."""
    got = _CHILDREN.ask([(name, args) for args in args_list])
    if got is None:
        return None
    for status, out in got:
        if status != "ok":
            raise RuntimeError("vpager.torch: the planner's process: %s"
                               % out)
    return [out for _, out in got]
