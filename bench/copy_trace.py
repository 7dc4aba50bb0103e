"""One sampling step's copies and kernels as the GPU ran them (CUPTI,
through torch.profiler): whether a paged step's link ran slow or idle.

A step that streams B bytes over a link measured at R bytes/s cannot take
less than B / R; the schedule predicts close to that, and a step that runs
longer has either copies that ran slower than R (the link itself: the
host's memory, another tenant) or a copy engine that stood idle while
kernels ran (copies queued late, or waiting on the ring). The profiler
sees every host-to-device copy of the process, vpager's own included
(its copies are the driver's, on its copy stream).

bench/comfyui_run.py, with VPAGER_BENCH_KINETO=N, profiles step N of each
prompt and prints summarize()'s dict as one line of TAG + JSON in the
child's log.

    python3 bench/copy_trace.py TRACE.json   # a saved chrome trace
    python3 bench/copy_trace.py LOG          # the TAG lines of a log
"""
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile

TAG = "COMFYUI_COPY_TRACE "
GAP_US = 200.0      # copy-engine gaps at least this long are listed
TOP = 8


def _union(spans):
    """Microseconds covered by the (start, end) spans."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _gaps(spans, lo, hi):
    """[(start, length)] of the stretches of [lo, hi] no span covers."""
    out, at = [], lo
    for s, e in sorted(spans):
        if s > at:
            out.append((at, s - at))
        at = max(at, e)
    if hi > at:
        out.append((at, hi - at))
    return out


def summarize(events):
    """The step's figures from chrome-trace events (dicts with cat, name,
    ts, dur in us, args): host-to-device copies (count, bytes, engine busy
    ms, GB/s while busy, per-copy GB/s quartiles of copies of at least
    8 MiB), kernels' busy ms, the span from the first GPU event to the
    last, the copy engine's longest idle gaps inside it (ms from the
    span's start, ms long), and the copies the host asked for through
    the runtime (the client's; vpager's go through the driver), each as
    [ms from the span's start, bytes, ms from its call to its start]: a
    pageable one holds the host until it lands, so one queued behind
    vpager's copies stalls the step's host work."""
    htod, kern, other = [], [], 0
    calls = {ev.get("args", {}).get("correlation"): float(ev["ts"])
             for ev in events if ev.get("cat") == "cuda_runtime"
             and "ts" in ev}
    client = []
    for ev in events:
        cat = ev.get("cat", "")
        if "dur" not in ev or "ts" not in ev:
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        if cat == "gpu_memcpy" and "HtoD" in ev.get("name", ""):
            args = ev.get("args", {})
            htod.append((span, int(args.get("bytes", 0))))
            call = calls.get(args.get("correlation"))
            if call is not None:
                client.append((span[0], int(args.get("bytes", 0)),
                               span[0] - call))
        elif cat == "kernel":
            kern.append(span)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            other += 1
    spans = [s for s, _ in htod] + kern
    if not spans:
        return {"gpu_events": 0}
    lo = min(s for s, _ in spans)
    hi = max(e for _, e in spans)
    busy = _union([s for s, _ in htod])
    nbytes = sum(b for _, b in htod)
    rates = sorted(b / (e - s) / 1e3 for (s, e), b in htod
                   if b >= 8 << 20 and e > s)
    gaps = [[round((s - lo) / 1e3, 3), round(n / 1e3, 3)]
            for s, n in _gaps([s for s, _ in htod], lo, hi) if n >= GAP_US]
    gaps.sort(key=lambda g: -g[1])
    q = (statistics.quantiles(rates, n=4) if len(rates) >= 2
         else rates * 3)
    return {
        "span_ms": round((hi - lo) / 1e3, 3),
        "kernels": len(kern),
        "kernel_busy_ms": round(_union(kern) / 1e3, 3),
        "htod_copies": len(htod),
        "htod_bytes": nbytes,
        "htod_busy_ms": round(busy / 1e3, 3),
        "htod_gbps_busy": round(nbytes / busy / 1e3, 2) if busy else None,
        "htod_gbps_span": round(nbytes / (hi - lo) / 1e3, 2),
        "copy_gbps_quartiles": [round(x, 2) for x in q],
        "copy_idle_ms": round(((hi - lo) - busy) / 1e3, 3),
        "copy_gaps": gaps[:TOP],
        "other_copies": other,
        "client_htod": [[round((t - lo) / 1e3, 3), n, round(w / 1e3, 3)]
                        for t, n, w in sorted(client)][:TOP],
    }


class CopyTrace:
    """torch.profiler's CUDA activity over step `step` only (step_done()
    is told when each step ends); summary holds summarize()'s dict; keep:
    a path the chrome trace is also saved to (gzipped), or None."""

    def __init__(self, step, keep=None):
        from torch.profiler import ProfilerActivity, profile
        self.step, self.keep = step, keep
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.on = False
        self.summary = None
        if step == 1:
            self._start()

    def _start(self):
        try:
            self.prof.start()
        except Exception as e:      # the run goes on without its trace
            self.summary = {"error": "the profiler did not start: %s" % e}
            return
        self.on = True

    def step_done(self, step):
        """`step` (0-based, as ComfyUI's callback counts) has ended."""
        if self.on and step + 1 == self.step:
            self.prof.stop()
            self.on = False
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            try:
                self.prof.export_chrome_trace(path)
                with open(path) as f:
                    self.summary = summarize(json.load(f)["traceEvents"])
                if self.keep:
                    with open(path, "rb") as f, \
                            gzip.open(self.keep, "wb") as g:
                        shutil.copyfileobj(f, g)
                    self.summary["kept"] = self.keep
            except (OSError, ValueError, KeyError) as e:
                self.summary = {"error": "no trace read: %s" % e}
            finally:
                os.unlink(path)
        elif not self.on and self.summary is None and \
                step + 2 == self.step:
            self._start()

    def remove(self):
        if self.on:
            self.prof.stop()
            self.on = False


def main(argv):
    for path in argv:
        with open(path) as f:
            text = f.read()
        if text.lstrip().startswith("{"):
            print(path, json.dumps(summarize(json.loads(text)
                                             ["traceEvents"])))
            continue
        for line in text.splitlines():
            if TAG in line:
                print(path, line.split(TAG, 1)[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]) or 0)
