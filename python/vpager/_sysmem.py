"""The host's memory as the operating system tells it: RAM available, the
room left under this process's cgroup memory limit, and RAM in all.

The one Python reader of /proc/meminfo and /proc/self/cgroup (the C
library has its own, behind src/os.h). Those exist on Linux only:
elsewhere (Windows, macOS) nothing is read and every answer is
"unknown" (None, or 0 for no limit); docs/windows.md says what the
callers do then. No torch, no library: importable anywhere, at any time.
"""

import os
import sys
from typing import Optional

__all__ = ["ram_available", "cgroup_room", "ram_total", "read_text"]


def _linux() -> bool:
    # Read at each call, so a test may pretend to be another platform.
    return sys.platform.startswith("linux")


def read_text(path: str) -> str:
    """The text of the file at `path`; "" when it cannot be read (or
    does not exist: /proc off Linux)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _number(path: str) -> int:
    s = read_text(path).strip()
    return int(s) if s.isdigit() else 0


def ram_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes; None when unknown."""
    if not _linux():
        return None
    for line in read_text("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def cgroup_room() -> int:
    """Bytes our cgroup may still charge (its limit less its usage; the
    lowest over its ancestors, as the C library's walk does); 0: no limit
    or unknown. v2 memory.max/memory.current, v1
    memory.limit_in_bytes/memory.usage_in_bytes."""
    if not _linux():
        return 0
    low = 0
    for line in read_text("/proc/self/cgroup").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        if parts[0] == "0" and parts[1] == "":
            root, lim_f, use_f = "/sys/fs/cgroup", "memory.max", \
                "memory.current"
        elif "memory" in parts[1].split(","):
            root, lim_f, use_f = "/sys/fs/cgroup/memory", \
                "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        path = parts[2].rstrip("/")
        while True:
            d = root + path
            lim = _number(d + "/" + lim_f)
            if lim and lim < 1 << 60:       # v1 says "none" with a huge one
                room = max(lim - _number(d + "/" + use_f), 0)
                low = room if not low else min(low, room)
            if not path:
                break
            path = path[:path.rfind("/")]
    return low


def ram_total() -> Optional[int]:
    """Bytes of RAM in all (sysconf, where the system has it); None when
    unknown (Windows has no os.sysconf)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
