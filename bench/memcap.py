"""A host memory cap for a benchmark's child process (issue 28 point 4:
"memory pressure is survived"): a cgroup with a memory limit the child
is started in, and afterwards what the kernel says happened in it.

    cap = memcap.open_cap(32 << 30, "vp-bench")   # or raises CapError
    subprocess.run(cmd, preexec_fn=cap.enter)     # the child joins it
    print(cap.describe(), cap.report())           # peak, OOM kills
    cap.close()

Tried in this order: cgroup v2 (memory.max, in a child of our own cgroup
whose subtree has the memory controller, or of the root), then cgroup v1
(memory.limit_in_bytes under the memory hierarchy, swap capped too when
memsw exists, so the limit is not a swap-out). A child charges its page
cache to the cgroup too: a mapped checkpoint counts against the cap, as
on a desktop. Needs the right to make a cgroup (root, or a delegated
subtree); open_cap says why it cannot. Linux only; no vpager, no torch.
"""

import os

__all__ = ["CapError", "MemCap", "open_cap"]

V2_ROOT = "/sys/fs/cgroup"
V1_ROOT = "/sys/fs/cgroup/memory"


class CapError(Exception):
    """No cgroup could be made or limited; the message says why (each
    way tried)."""


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _own_cgroup(version, proc="/proc/self/cgroup"):
    """This process's cgroup path for v2 ("0::/x") or v1's memory
    controller; None when it has none."""
    for line in _read(proc).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if version == 2 and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if version == 1 and "memory" in parts[1].split(","):
            return parts[2]
    return None


class MemCap:
    """A cgroup made for one child: `path` its folder, `version` 1 or 2,
    `limit` its bytes."""

    def __init__(self, path, version, limit):
        self.path, self.version, self.limit = path, version, limit

    def enter(self):
        """Move the calling process into the cgroup (a preexec_fn: the
        child joins before it execs, so all it maps is charged here)."""
        _write(os.path.join(self.path, "cgroup.procs"), str(os.getpid()))

    def describe(self):
        return "cgroup v%d %s, memory limit %.2f GiB" % (
            self.version, self.path, self.limit / (1 << 30))

    def report(self):
        """{peak, oom_kills, limit, version}: the most the cgroup held
        (bytes; None where the kernel does not keep it) and how many of
        its processes the OOM killer took."""
        p = self.path
        if self.version == 2:
            peak = _read(os.path.join(p, "memory.peak")).strip()
            events = _read(os.path.join(p, "memory.events"))
        else:
            peak = _read(os.path.join(p, "memory.max_usage_in_bytes")).strip()
            events = _read(os.path.join(p, "memory.oom_control"))
        kills = 0
        for line in events.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill" and v.strip().isdigit():
                kills = int(v)
        return {"version": self.version, "limit": self.limit,
                "peak": int(peak) if peak.isdigit() else None,
                "oom_kills": kills}

    def close(self):
        """Remove the cgroup (its processes have exited); quiet if the
        kernel still holds it."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def _make(parent, name):
    path = os.path.join(parent, name)
    os.mkdir(path)
    return path


def _v2(limit, name, root=V2_ROOT):
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        raise CapError("no cgroup v2 hierarchy at %s" % root)
    own = _own_cgroup(2)
    tried = []
    # Our own cgroup first (a delegated subtree), then the root's.
    for rel in ([own] if own not in (None, "/") else []) + ["/"]:
        parent = root + rel.rstrip("/") if rel != "/" else root
        sub = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        if "memory" not in sub:
            try:
                _write(os.path.join(parent, "cgroup.subtree_control"),
                       "+memory")
            except OSError as e:
                tried.append("%s: +memory in cgroup.subtree_control: %s"
                             % (parent, e.strerror))
                continue
        try:
            path = _make(parent, name)
        except OSError as e:
            tried.append("%s: mkdir: %s" % (parent, e.strerror))
            continue
        try:
            _write(os.path.join(path, "memory.max"), str(limit))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
        except OSError as e:
            os.rmdir(path)
            tried.append("%s: memory.max: %s" % (path, e.strerror))
            continue
        return MemCap(path, 2, limit)
    raise CapError("cgroup v2: " + "; ".join(tried))


def _v1(limit, name, root=V1_ROOT):
    if not os.path.exists(os.path.join(root, "memory.limit_in_bytes")):
        raise CapError("no cgroup v1 memory hierarchy at %s" % root)
    own = _own_cgroup(1) or "/"
    parent = root + own.rstrip("/") if own != "/" else root
    try:
        path = _make(parent, name)
    except OSError as e:
        raise CapError("cgroup v1: %s: mkdir: %s" % (parent, e.strerror))
    try:
        _write(os.path.join(path, "memory.limit_in_bytes"), str(limit))
        sw = os.path.join(path, "memory.memsw.limit_in_bytes")
        if os.path.exists(sw):
            _write(sw, str(limit))
    except OSError as e:
        os.rmdir(path)
        raise CapError("cgroup v1: %s: limit: %s" % (path, e.strerror))
    return MemCap(path, 1, limit)


def open_cap(limit, name):
    """A new cgroup named `name` (made unique with our pid) limited to
    `limit` bytes: v2, else v1. CapError says why neither could be."""
    if not isinstance(limit, int) or limit <= 0:
        raise CapError("memory cap: %r is no positive number of bytes"
                       % (limit,))
    name = "%s-%d" % (name, os.getpid())
    why = []
    for way in (_v2, _v1):
        try:
            return way(limit, name)
        except CapError as e:
            why.append(str(e))
    raise CapError("no memory cgroup could be made (%s)" % "; ".join(why))
