"""One sampling step's timeline, module by module: where a paged run's step
spends the time a resident run's does not.

bench/comfyui_run.py, with VPAGER_BENCH_TIMELINE=N, times step N (1 is the
first) of every prompt: a mark (a CUDA event on the current stream, or the
host clock on the CPU) before and after each call of a module that holds
parameters of its own, and prints the rows as one line of TAG + JSON in the
child's log. A call's time includes what its forward waits for on the
device (a vpager unit's copies); the gap before it is what ran between
(attention, norms, the host's own stalls). Each mark also takes the host
clock: a call's "lead" is how long before the GPU reached it the host had
queued it (near 0: the GPU waited for the host, a host-bound stretch).

    python3 bench/step_timeline.py RESIDENT_LOG NODE_LOG [--top 20]

compares two such logs (e.g. run_resident.log and run_node6.log of
bench/bench_node.py): totals, and the modules whose time
grew the most.
"""
import argparse
import cProfile
import gc
import json
import statistics
import sys
import time

import benchlib

TAG = "COMFYUI_TIMELINE "


class StepTimeline:
    """Hooks on `model`'s modules with parameters of their own, marking
    calls only during step `step` (step_done() is told when each step
    ends). Rows are in call order; a call inside another such call counts
    in both (in ComfyUI's diffusion models those modules are leaf ops)."""

    def __init__(self, model, step, cuda=None, profile_start=False):
        # Marks as the benchmarks take them: CUDA events on the current
        # stream when there is a GPU (not judged by the parameters: a
        # paged model's are CPU placeholders between calls), else the clock.
        if cuda is None:
            import torch
            cuda = torch.cuda.is_available()
        self.ctx = benchlib.Ctx(dry=not cuda)
        self.step = step
        self.on = step == 1         # step 1 starts with the sampling
        self.start = None           # (mark, host clock) of the step's start
        self.calls = []             # [name, start mark, end mark, host]
        self.rows = None
        # profile_start: the host's work from the step's start to its
        # first call, under cProfile (pstats.Stats in start_profile):
        # what the host did while the GPU waited for the first call.
        # With it, the garbage collector's passes in that stretch (a
        # pass's time falls on whatever function it interrupted):
        # start_gc = [(generation, ms)].
        self.profile_start = profile_start
        self._prof = None
        self.start_profile = None
        self.start_gc = []
        self._gc_at = None
        self.hooks = []
        for name, m in model.named_modules():
            if next(m.parameters(recurse=False), None) is None:
                continue
            self.hooks.append(m.register_forward_pre_hook(
                self._before(name)))
            self.hooks.append(m.register_forward_hook(self._after))

    def _before(self, name):
        def hook(_module, _args):
            if self.on:
                if self._prof is not None:
                    self._prof.disable()
                    self.start_profile, self._prof = self._prof, None
                    gc.callbacks.remove(self._gc)
                self.calls.append([name, self.ctx.mark(), None,
                                   time.perf_counter()])
        return hook

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_at = time.perf_counter()
        elif self._gc_at is not None:
            self.start_gc.append((info.get("generation"),
                                  (time.perf_counter() - self._gc_at) * 1e3))
            self._gc_at = None

    def _after(self, _module, _args, _out):
        if self.on:
            for c in reversed(self.calls):      # the innermost open call
                if c[2] is None:
                    c[2] = self.ctx.mark()
                    break

    def step_done(self, step):
        """Step `step` (0-based, as ComfyUI's callback counts) ended."""
        if self.on:
            self.on = False
            end = (self.ctx.mark(), time.perf_counter())
            self.ctx.sync()
            self.rows = self._rows(end)
        elif step + 2 == self.step:
            self.on = True
            self.start = (self.ctx.mark(), time.perf_counter())
            if self.profile_start:
                self._prof = cProfile.Profile()
                self.start_gc = []
                gc.callbacks.append(self._gc)
                self._prof.enable()

    def _rows(self, end):
        calls = [c for c in self.calls if c[2] is not None]
        self.calls = []
        if not calls:
            return []
        first, host0 = (self.start if self.start is not None
                        else (calls[0][1], calls[0][3]))
        prev = first
        rows = []
        for name, a, b, host in calls:
            rows.append({"name": name, "gap_ms": max(self.ctx.ms(prev, a), 0.0),
                         "ms": max(self.ctx.ms(a, b), 0.0),
                         "lead_ms": self.ctx.ms(first, a) -
                         (host - host0) * 1e3})
            prev = b
        rows.append({"name": "(after the last call)",
                     "gap_ms": max(self.ctx.ms(prev, end[0]), 0.0), "ms": 0.0,
                     "lead_ms": self.ctx.ms(first, end[0]) -
                     (end[1] - host0) * 1e3})
        return rows

    def remove(self):
        if self._prof is not None:      # the step's first call never came
            self._prof.disable()
            self._prof = None
            gc.callbacks.remove(self._gc)
        for h in self.hooks:
            h.remove()
        self.hooks = []


def summary(rows):
    """(total ms, time in calls, time in gaps)."""
    calls = sum(r["ms"] for r in rows)
    gaps = sum(r["gap_ms"] for r in rows)
    return calls + gaps, calls, gaps


def host_side(rows, near=0.05):
    """(calls the GPU reached within `near` ms of the host queuing them,
    the median lead in ms, the step's end's lead): a host-bound step has
    many such calls and a small lead. None for logs from before leads."""
    leads = [r["lead_ms"] for r in rows if "lead_ms" in r]
    if not leads:
        return None
    return (sum(x < near for x in leads[:-1]), statistics.median(leads),
            leads[-1])


def by_name(rows):
    """name -> [ms, gap ms, calls] summed over the step's calls."""
    out = {}
    for r in rows:
        t = out.setdefault(r["name"], [0.0, 0.0, 0])
        t[0] += r["ms"]
        t[1] += r["gap_ms"]
        t[2] += 1
    return out


def read(path, prompt=None):
    """The last timeline a child log holds, or the last of prompt
    `prompt` (its label's first field): (label, rows)."""
    found = None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith(TAG):
                t = json.loads(line[len(TAG):])
                if prompt is None or t["label"].split(",")[0] == prompt:
                    found = t
    if found is None:
        raise SystemExit("%s: no %sline%s (run with VPAGER_BENCH_TIMELINE=N)"
                         % (path, TAG.strip(), "" if prompt is None else
                            " of prompt %r" % prompt))
    return found["label"], found["rows"]


def compare(a_rows, b_rows, top=20):
    """Lines comparing timeline b with timeline a."""
    ta, ca, ga = summary(a_rows)
    tb, cb, gb = summary(b_rows)
    out = ["step: %.2f ms -> %.2f ms (calls %.2f -> %.2f, gaps %.2f -> "
           "%.2f)" % (ta, tb, ca, cb, ga, gb)]
    for tag, rows in (("a", a_rows), ("b", b_rows)):
        h = host_side(rows)
        if h is not None:
            out.append("%s: the GPU reached %d of %d calls within 0.05 ms of "
                       "the host queuing them; median lead %.2f ms, at the "
                       "step's end %.2f ms" % (tag, h[0], len(rows) - 1,
                                               h[1], h[2]))
    a, b = by_name(a_rows), by_name(b_rows)
    deltas = []
    for name, (ms, gap, n) in b.items():
        ms0, gap0, _ = a.get(name, (0.0, 0.0, 0))
        deltas.append((ms + gap - ms0 - gap0, name, ms0, ms, gap0, gap, n))
    deltas.sort(reverse=True)
    out.append("%-48s %9s %9s %9s %9s %6s" % (
        "module (largest growth first)", "ms a", "ms b", "gap a", "gap b",
        "calls"))
    for d, name, ms0, ms, gap0, gap, n in deltas[:top]:
        out.append("%-48s %9.3f %9.3f %9.3f %9.3f %6d" % (
            name[-48:], ms0, ms, gap0, gap, n))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="the baseline's child log (resident)")
    p.add_argument("b", help="the compared child log (the node's)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--prompt", help="the prompt whose step to compare "
                   "(e.g. lora_a); default: the log's last timeline")
    a = p.parse_args(argv)
    la, ra = read(a.a, a.prompt)
    lb, rb = read(a.b, a.prompt)
    print("a: %s (%s), b: %s (%s)" % (a.a, la, a.b, lb))
    for line in compare(ra, rb, a.top):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
