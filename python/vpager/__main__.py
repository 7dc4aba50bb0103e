"""python -m vpager top: every vpager ledger on this machine, live.

    python -m vpager top                  # refresh twice a second; Ctrl-C ends
    python -m vpager top --json           # one snapshot as JSON, for scripts
    python -m vpager top --ledger NAME    # only that ledger ("GPU-...", "sim-...")
    python -m vpager top --count 3        # three frames, then exit

It only reads the ledgers (vp_ledger_list, vp_ledger_read): it opens no
device and joins nothing. For each ledger: device memory as a participant
last measured it, each participating process (pid, command, committed
bytes, the framework allocator's reservation) with its VBARs (label, size,
resident, pinned, reclaimable, priority, idle time, hits and misses per
second), and pending release requests.
"""

import argparse
import json
import sys
import time

from . import ledger

_UNITS = ("B", "K", "M", "G", "T")


def _size(n):
    n = float(n)
    for unit in _UNITS:
        if n < 1024 or unit == _UNITS[-1]:
            return ("%d%s" % (n, unit)) if unit == "B" else \
                ("%.1f%s" % (n, unit))
        n /= 1024
    return str(n)


def snapshot(only=None):
    """{"ledgers": [...]}: each ledger as vp_ledger_read gives it, or
    {"ledger": name, "error": message} when it cannot be read."""
    out = []
    for name in ledger.names():
        if only and name != only:
            continue
        try:
            out.append(ledger.read(name))
        except Exception as e:  # a ledger that vanished or is corrupt
            out.append({"ledger": name, "error": str(e)})
    return {"ledgers": out, "time": time.time()}


def _rates(snap, prev, dt):
    """Hits and misses per second per VBAR since the previous frame."""
    rates = {}
    for led in snap["ledgers"]:
        for p in led.get("processes", []):
            for v in p["vbars"]:
                key = (led["ledger"], p["serial"], v["id"])
                old = prev.get(key)
                if old and dt > 0:
                    rates[key] = ((v["hits"] - old[0]) / dt,
                                  (v["misses"] - old[1]) / dt)
    return rates


def _counts(snap):
    return {(led["ledger"], p["serial"], v["id"]): (v["hits"], v["misses"])
            for led in snap["ledgers"] for p in led.get("processes", [])
            for v in p["vbars"]}


def _command(text):
    """The command line with its program's directory left out."""
    prog, _, rest = text.partition(" ")
    return (prog.rsplit("/", 1)[-1] + " " + rest).strip()


def _process_lines(led, p, rates):
    yield ("  pid %-7d %-32.32s committed %-8s framework %-8s (floor %s) "
           "headroom %s served %d (%s)%s" % (
               p["pid"], _command(p["command"]), _size(p["committed"]),
               _size(p["external_reserved"]),
               _size(p.get("external_floor", 0)),
               _size(p.get("headroom", 0)), p["served"],
               _size(p["released"]), "" if p["alive"] else "  DEAD"))
    for v in sorted(p["vbars"], key=lambda v: v["priority"]):
        hit, miss = rates.get((led["ledger"], p["serial"], v["id"]),
                              (0.0, 0.0))
        yield ("    %-24.24s %8s %8s %8s %8s %4d %8.1fs %8.0f %8.0f"
               % (v["label"] or "#%d" % v["id"], _size(v["size"]),
                  _size(v["resident"]), _size(v["pinned"]),
                  _size(v["reclaimable"]), v["priority"],
                  v["last_use_ms_ago"] / 1000.0, hit, miss))


def render(snap, rates):
    """The text of one frame."""
    lines = ["vpager top  %s  (%d ledger%s)" % (
        time.strftime("%H:%M:%S", time.localtime(snap["time"])),
        len(snap["ledgers"]), "" if len(snap["ledgers"]) == 1 else "s")]
    for led in snap["ledgers"]:
        lines.append("")
        if "error" in led:
            lines.append("ledger %s: %s" % (led["ledger"], led["error"]))
            continue
        d = led["device"]
        age = d["measured_ms_ago"]
        lines.append("ledger %s: device %s total, %s free (%s), %d process%s"
                     % (led["ledger"], _size(d["total"]), _size(d["free"]),
                        "not measured yet" if age is None else
                        "measured %d ms ago" % age, len(led["processes"]),
                        "" if len(led["processes"]) == 1 else "es"))
        lines.append("    %-24s %8s %8s %8s %8s %4s %9s %8s %8s" % (
            "VBAR", "size", "resident", "pinned", "reclaim", "prio", "idle",
            "hits/s", "misses/s"))
        for p in led["processes"]:
            lines.extend(_process_lines(led, p, rates))
        for r in led["requests"]:
            lines.append("  request: pid %d asks pid %d for %s (%s, %d ms)"
                         % (r["from_pid"], r["to_pid"], _size(r["bytes"]),
                            r["state"], r["age_ms"]))
    return "\n".join(lines)


def top(args):
    if args.json:
        json.dump(snapshot(args.ledger), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    live = sys.stdout.isatty()
    prev, prev_t, frames = {}, None, 0
    try:
        while args.count is None or frames < args.count:
            snap = snapshot(args.ledger)
            dt = snap["time"] - prev_t if prev_t is not None else 0
            text = render(snap, _rates(snap, prev, dt))
            sys.stdout.write(("\x1b[H\x1b[2J" if live else
                              ("\n" if frames else "")) + text + "\n")
            sys.stdout.flush()
            prev, prev_t, frames = _counts(snap), snap["time"], frames + 1
            if args.count is None or frames < args.count:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m vpager")
    sub = ap.add_subparsers(dest="command")
    t = sub.add_parser("top", help="show the ledgers of this machine live")
    t.add_argument("--json", action="store_true",
                   help="print one snapshot as JSON and exit")
    t.add_argument("--ledger", metavar="NAME", help="only this ledger")
    t.add_argument("--interval", type=float, default=0.5,
                   help="seconds between frames (default 0.5)")
    t.add_argument("--count", type=int, help="frames to show, then exit")
    args = ap.parse_args(argv)
    if args.command != "top":
        ap.print_help()
        return 2
    return top(args)


if __name__ == "__main__":
    sys.exit(main())
