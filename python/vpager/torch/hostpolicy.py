"""Where a model's file-backed weights live in host memory (issue 28,
shared/DESIGN.md §10), chosen once per model and said in one log line.

A weight's host bytes live in exactly one place. Weights whose bytes are
already in a file (offload(weights_from=), or CPU tensors over a mapped
file: safetensors' mmap, torch.load(mmap=True), ComfyUI's loader) stay
there: either "in place" (the mapping itself is the HOST source,
registered for DMA where the device allows it) or "file" (a FILE
source: read through the C file reader's small pinned bounce slots, so
the page cache may drop what is not read again). Every other CPU tensor
gets a "pinned copy" vpager owns (the caller may change their tensor in
place later; the copy replaces it, so there is still one copy).

The choice between "in place" and "file" weighs RAM available (the
cgroup's room where lower), the file system's read speed (measured once
per file system) and the bytes the schedule streams each step. A GPU
pins no read-only file mapping (src/backend/vmm.c: CUDA's read-only
registration did not return on the H200 VM), so there "in place" becomes
a pinned copy. Its inputs can be fixed for tests (override())."""

import contextlib
import logging
import mmap
import os
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

from .. import _sysmem
from ..errors import Error
from ..hostbuf import (HostMapping, host_drop_resident, host_mappings,
                       host_memory)

IN_PLACE, PINNED_COPY, FILE = "in place", "pinned copy", "file"
KINDS = (IN_PLACE, PINNED_COPY, FILE)

FIT = 0.9           # in place only if the weights fit in this much RAM
ROOMY = 0.5         # ... and, with a fast disk, in this much
FAST_DISK = 1.5e9   # bytes/s: a disk that feeds the steps itself (NVMe)
PROBE_BYTES = 32 << 20  # read once per file system to time it

log = logging.getLogger("vpager")

_OVERRIDE: Dict[str, float] = {}   # override()'s inputs
_DISK: Dict[int, float] = {}       # st_dev -> measured bytes/s


@contextlib.contextmanager
def override(ram_available: Optional[int] = None,
             disk_bytes_per_s: Optional[float] = None):
    """Within the block the policy sees these inputs instead of the
    machine's (tests: a fake small RAM, a slow disk)."""
    old = dict(_OVERRIDE)
    if ram_available is not None:
        _OVERRIDE["ram"] = ram_available
    if disk_bytes_per_s is not None:
        _OVERRIDE["disk"] = disk_bytes_per_s
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(old)


def ram_available() -> int:
    """Bytes of RAM we may still use: MemAvailable, or the cgroup's room
    when lower (vpager._sysmem; override() in tests); off Linux the
    library's figure (vpager.host_memory(): Windows' available physical
    memory). 0: unknown, which choose() takes as no room: weights are read
    from their file, never kept in place."""
    if "ram" in _OVERRIDE:
        return int(_OVERRIDE["ram"])
    avail = _sysmem.ram_available()
    if avail is None:
        avail = _library_ram("available")
    room = _sysmem.cgroup_room()
    return min(avail, room) if room and avail else (room or avail)


def ram_total() -> int:
    """Bytes of RAM in all (vpager._sysmem, else the library's); 0:
    unknown."""
    return _sysmem.ram_total() or _library_ram("total")


def _library_ram(key: str) -> int:
    """vpager.host_memory()[key]; 0 if the library cannot say."""
    try:
        return int(host_memory()[key])
    except Exception:       # noqa: BLE001 (an old library: unknown)
        return 0


def disk_speed(path: Optional[str]) -> Optional[float]:
    """Read speed (bytes/s) of the file system holding `path`: measured
    once per file system (a direct read past the page cache where the file
    system allows it, else a buffered one), then cached; None: no file."""
    if "disk" in _OVERRIDE:
        return float(_OVERRIDE["disk"])
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_dev in _DISK:
        return _DISK[st.st_dev]
    n = min(PROBE_BYTES, st.st_size) // mmap.PAGESIZE * mmap.PAGESIZE
    if n == 0:
        return None
    buf = mmap.mmap(-1, n)          # page-aligned, as O_DIRECT wants
    speed = None
    for flags in (getattr(os, "O_DIRECT", 0), 0):
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except OSError:
            continue
        try:
            at = (st.st_size - n) // 2 // mmap.PAGESIZE * mmap.PAGESIZE
            t0 = time.perf_counter()
            got = _read_at(fd, buf, at)
            dt = time.perf_counter() - t0
            if got > 0:
                speed = got / max(dt, 1e-6)
                break
        except OSError:
            pass
        finally:
            os.close(fd)
    buf.close()
    if speed is not None:
        _DISK[st.st_dev] = speed
    return speed


def _read_at(fd: int, buf: mmap.mmap, at: int) -> int:
    """Read len(buf) bytes of fd at offset `at` into buf; the count read
    (os.preadv where the system has it; Windows has not)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], at)
    os.lseek(fd, at, os.SEEK_SET)
    data = os.read(fd, len(buf))
    buf[:len(data)] = data
    return len(data)


def writable_private(m: HostMapping) -> bool:
    """Pinning it for write would copy its pages (copy on write)."""
    return m.writable and m.private


class Mappings:
    """This process's file mappings (vpager.host_mappings(): Linux's
    /proc/self/smaps, Windows' views of files), read once (offload() builds
    one)."""

    def __init__(self) -> None:
        try:
            self.maps = host_mappings()
        except Error:       # unreadable: no mapping is known
            self.maps = []
        self.starts = [m.start for m in self.maps]

    def modified(self, m: HostMapping) -> bool:
        """Whether the caller wrote to a private mapping (pages copied on
        write; the library reads /proc/self/smaps' Anonymous on Linux, a
        view's read-write pages on Windows): then its bytes are not the
        file's."""
        return m.written

    def find(self, addr: int, size: int) -> Optional[HostMapping]:
        """The file mapping holding [addr, addr+size) whole, or None."""
        i = bisect_right(self.starts, addr) - 1
        if i < 0 or size <= 0:
            return None
        m = self.maps[i]
        return m if addr + size <= m.end else None


def drop_copied(spans: Iterable[Tuple[int, int]]) -> int:
    """Host bytes [(address, size)] a copy was just made of: those lying
    whole in a file mapping this process may not write leave its resident
    set (vpager.host_drop_resident; the page cache keeps them), so the copy
    is the one copy RSS counts. Anything else is left alone. Returns the
    bytes dropped (0 where the mappings cannot be read)."""
    try:
        return host_drop_resident(spans)
    except Error:
        return 0


@dataclass
class Choice:
    kind: str       # IN_PLACE or FILE
    reason: str


def gib(n: float) -> str:
    if n >= 1 << 30:
        return "%.1f GiB" % (n / (1 << 30))
    return "%d MiB" % round(n / (1 << 20))


def choose(nbytes: int, streamed: int, path: Optional[str],
           pins_mappings: bool = True) -> Choice:
    """Where `nbytes` of file-backed weights stay (IN_PLACE or FILE) when
    the schedule streams `streamed` bytes a step, the file at `path`: in
    place when they fit in FIT of the RAM available, except when they take
    over ROOMY of it and either the disk feeds the steps itself (FAST_DISK)
    or nothing streams (they fit the budget: read once); else the file.
    On a device that pins no read-only file mapping (pins_mappings False:
    a GPU) what would stay in place gets a PINNED_COPY instead: in place
    its copies would be pageable, and the file reader's one thread reads
    the page cache at ~5 GB/s against a link of 55."""
    ram = ram_available()
    disk = disk_speed(path)
    said = "RAM available %s" % gib(ram)
    if disk is not None:
        said += ", disk %.2f GB/s" % (disk / 1e9)
        if streamed:
            said += ", %s streamed a step = %d ms of reads" % (
                gib(streamed), round(streamed / disk * 1e3))
    if nbytes > FIT * ram:
        return Choice(FILE, "they do not fit in RAM (%s)" % said)
    if nbytes > ROOMY * ram:
        if disk is not None and disk >= FAST_DISK:
            return Choice(FILE, "RAM is tight and the disk is fast (%s)"
                          % said)
        if streamed == 0:
            return Choice(FILE, "RAM is tight and they fit the device's "
                          "budget: read once, nothing to keep (%s)" % said)
    if not pins_mappings:
        return Choice(PINNED_COPY, "they fit in RAM (%s), and the device "
                      "pins no read-only file mapping: copied into pinned "
                      "memory" % said)
    return Choice(IN_PLACE, "they fit in RAM (%s)" % said)


def say(model: str, by_kind: Dict[str, int], choice: Optional[Choice],
        registered: Optional[Tuple[int, int]]) -> str:
    """The one line a model's offload() logs (logger "vpager");
    registered: (bytes pinned, bytes registered) of the mappings used in
    place, None if none was."""
    parts = []
    if by_kind.get(IN_PLACE):
        how = "pageable"
        if registered is not None:
            pinned, span = registered
            how = "registered" if pinned >= span else (
                "registered: %s of it pinned, the rest pageable (the pin "
                "budget)" % gib(pinned))
        parts.append("%s of weights stay in the mapped file (in place, %s)"
                     % (gib(by_kind[IN_PLACE]), how))
    if by_kind.get(FILE):
        parts.append("%s are read from the file" % gib(by_kind[FILE]))
    if by_kind.get(PINNED_COPY):
        copied = choice is not None and choice.kind == PINNED_COPY
        parts.append("%s are in a pinned copy%s" % (
            gib(by_kind[PINNED_COPY]), "" if copied else " (not file-backed)"))
    line = "vpager: %s: %s" % (model, "; ".join(parts) or "no host bytes")
    if choice is not None:
        line += ": " + choice.reason
        if choice.kind == IN_PLACE and by_kind.get(FILE):
            line += ("; in place was chosen, but the device pinned none of "
                     "the file's mapping (the pin budget spent): read "
                     "from the file instead")
    return line


def report(model: str, by_kind: Dict[str, int], choice: Optional[Choice],
           registered: Optional[Tuple[int, int]]) -> str:
    """say()'s line, logged at info; returns it."""
    line = say(model, by_kind, choice, registered)
    log.info("%s", line)
    return line
