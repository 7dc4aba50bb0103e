"""Where an offloaded module's weight bytes live, in one place each
(hostpolicy.py chooses): a file's bytes where they lie (the weights_from=
file or a mapped CPU tensor: in place, registered, or read as a FILE
source), or a pinned HostBuf holding the only full copy (from the
module's tensors, or from a file for buffers); and the CPU placeholders
that stand in for meta tensors whose bytes come from a file."""

import concurrent.futures
import ctypes
import mmap
import os
import time
import warnings

import torch

from ..errors import Error
from ..weights import Source
from . import hostpolicy
from .hostload import HostLoad, batches
from .placement import place
from .progress import Progress
from .views import placeholder, view


class HostBytes:
    """What sources() made besides the HostBuf of copies (hostpolicy.py):
    HostBufs registering memory used in place, the tensors they register
    (held until those are unregistered), fds opened for FILE sources of
    mapped tensors, each entry's kind (hostpolicy.KINDS, or "source": a
    caller's) and the policy's log line."""

    def __init__(self):
        self.registered = []
        self.hold = []
        self.fds = []
        self.kinds = {}
        self.line = ""
        self.span = self.pinned = 0     # bytes registered, pinned of them
        self.maps = []                  # read-only mappings of our own
        self.copied_from = set()        # Entries copied out of read-only
        #                                 mappings (dropped from RSS after)
        self.fd_of = {}                 # file id -> fd (FILE sources)

    def by_kind(self, entries):
        """{kind: host bytes} over entries (every kind, 0 if none)."""
        out = dict.fromkeys(hostpolicy.KINDS, 0)
        for e in entries:
            k = self.kinds.get(e)
            if k in out:
                out[k] += e.size
        return out

    def close(self):
        """Unregister, then let go of the memory and the fds; returns the
        errors met."""
        errors = []
        for hb in self.registered:
            try:
                hb.close()
            except Error as err:
                errors.append(err)
        self.registered, self.hold = [], []
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:     # still viewed: goes with its views
                pass
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.maps, self.fds, self.fd_of = [], [], {}
        return errors


def _mapped(e, maps):
    """(address, Mapping) of a parameter whose CPU tensor lies whole in a
    file mapping (safetensors' mmap, torch.load(mmap=True), ComfyUI's
    loader), else None. Buffers are copied: training updates them."""
    t = e.tensor
    if not e.is_param or e.size == 0 or t.device.type != "cpu" or \
            not t.is_contiguous():
        return None
    addr = t.data_ptr()
    m = maps.find(addr, e.size)
    return (addr, m) if m is not None else None


def _page_span(lo, hi, bound_lo, bound_hi):
    page = mmap.PAGESIZE
    lo = max(lo // page * page, bound_lo)
    hi = min((hi + page - 1) // page * page, bound_hi)
    return lo, hi - lo


def pins_mappings(dev):
    """Whether the device pins a read-only file mapping in place: the
    simulated device pins anything; the GPUs refuse read-only memory
    (src/backend/vmm.c says why)."""
    return dev.backend == "sim"


def _register(dev, lo, size, hb_out):
    """A HostBuf registering [lo, lo+size) in place, or None where the
    device pinned none of it (budget spent, or refused)."""
    try:
        hb = dev.register_hostbuf(lo, size)
    except Error:
        return None
    if hb.pinned_bytes == 0:
        hb.close()
        return None
    hb_out.registered.append(hb)
    hb_out.span += size
    hb_out.pinned += hb.pinned_bytes
    return hb


def _open_same(m, hbytes):
    """An fd of m's file (the same file id; one a file), or None."""
    fd = hbytes.fd_of.get(m.file_id)
    if fd is not None:
        return fd
    try:
        fd = os.open(m.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) |
                     getattr(os, "O_BINARY", 0))    # Windows has no CLOEXEC
    except OSError:
        return None
    if os.fstat(fd).st_ino != m.file_id:
        os.close(fd)
        return None
    hbytes.fds.append(fd)
    hbytes.fd_of[m.file_id] = fd
    return fd


def _file_source(m, addr, hbytes):
    """A FILE source for a mapped tensor at addr, or None."""
    fd = _open_same(m, hbytes)
    if fd is None:
        return None
    return Source.from_file(fd, m.file_offset + addr - m.start)


def _own_mapping(m, lo, hi, hbytes):
    """A read-only shared mapping of our own of the file bytes the
    caller's private writable mapping m shows at [lo, hi): the same page
    cache pages, but pinning it copies nothing (pinning the caller's for
    write would copy its pages), and the caller's later writes to theirs
    do not reach it. (shift: our address of caller address a is
    a + shift; our mapping's first and end address), or None."""
    fd = _open_same(m, hbytes)
    if fd is None:
        return None
    gran = mmap.ALLOCATIONGRANULARITY
    flo = (m.file_offset + lo - m.start) // gran * gran
    try:
        mm = mmap.mmap(fd, m.file_offset + hi - m.start - flo,
                       access=mmap.ACCESS_READ, offset=flo)   # shared
    except (OSError, ValueError):
        return None
    hbytes.maps.append(mm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a read-only buffer
        t = torch.frombuffer(mm, dtype=torch.uint8)
    hbytes.hold.append(t)
    base = t.data_ptr()
    return base + m.file_offset - m.start - flo, base, base + len(mm)


def _file_slots(dev, entries, st, plan, custom, streamed, hbytes):
    """[(host, file_addr, Source) or None], [indices needing a host copy],
    the policy's Choice (None: nothing file-backed). Entries with a
    source of the caller's (custom[i], offload(sources=)) get none of
    ours; file-backed parameters (st: weights_from=; or a mapped CPU
    tensor) stay where they are, in place (HOST, registered) or FILE, as
    hostpolicy.choose() says; the rest need a host copy."""
    base = st.mmap()[0] if st is not None else 0
    maps = hostpolicy.Mappings() if st is None else None
    slots = [None] * len(entries)
    hosted, backed = [], []
    for i, e in enumerate(entries):
        if custom is not None and custom[i] is not None:
            slots[i] = (None, None, custom[i])
            hbytes.kinds[e] = "source"
        elif st is not None and e.is_param:
            backed.append((i, base + plan[e].offset, None))
        else:
            found = _mapped(e, maps) if st is None else None
            if found is not None:
                backed.append((i,) + found)
            else:
                hosted.append(i)
    if not backed:
        return slots, hosted, None
    path = st.path if st is not None else backed[0][2].path
    choice = hostpolicy.choose(sum(entries[i].size for i, _, _ in backed),
                               streamed, path, pins_mappings(dev))
    groups = {}
    for i, addr, m in backed:
        groups.setdefault(None if m is None else m.start, []).append(
            (i, addr, m))
    for group in groups.values():
        m = group[0][2]
        if m is not None and hostpolicy.writable_private(m) and \
                maps.modified(m):
            hosted.extend(i for i, _, _ in group)   # not the file's bytes
            continue
        if choice.kind == hostpolicy.PINNED_COPY:
            hosted.extend(i for i, _, _ in group)
            if m is None or not m.writable:     # nobody wrote to it
                hbytes.copied_from.update(entries[i] for i, _, _ in group)
            continue
        lo = min(a for _, a, _ in group)
        hi = max(a + entries[i].size for i, a, _ in group)
        in_place = choice.kind == hostpolicy.IN_PLACE
        shift, bound = 0, ((m.start, m.end) if m is not None
                           else (base, base + st.mmap()[1]))
        if in_place and m is not None and hostpolicy.writable_private(m):
            own = _own_mapping(m, lo, hi, hbytes)
            if own is None:
                in_place = False
            else:
                shift, bound = own[0], own[1:]
        if in_place and _register(dev, *_page_span(lo + shift, hi + shift,
                                                   *bound),
                                  hb_out=hbytes) is None:
            in_place = False
        for i, addr, mp in group:
            e = entries[i]
            if in_place:
                src = Source.from_host(addr + shift)
                hbytes.kinds[e] = hostpolicy.IN_PLACE
            elif mp is None:
                src = st.source(plan[e].index)
                hbytes.kinds[e] = hostpolicy.FILE
            else:
                src = _file_source(mp, addr, hbytes)
                if src is None:         # the file is gone: copy it
                    hosted.append(i)
                    continue
                hbytes.kinds[e] = hostpolicy.FILE
            if mp is not None:
                hbytes.hold.append(e.tensor.data)
                e.keep = e.tensor.data      # the caller's, in place
                slots[i] = (None, None, src)
            else:
                slots[i] = (None, addr, src)
    hosted.sort()
    return slots, hosted, choice


COPY_THREADS = 8            # threads making a host copy
COPY_CHUNK = 64 << 20       # bytes a thread copies at a time
_COPY_BATCH = 1 << 30       # bytes copied before old storage is let go


def copy_all(pairs, advance=None, pool=None, chunk=COPY_CHUNK):
    """dst.copy_(src) for each (dst, src) of CPU tensors, over a few
    threads in chunks of `chunk` bytes (torch's copies release the GIL): a
    model read out of a file mapping (ComfyUI's safetensors loader) or RAM
    is copied at memory speed, not one core's. advance(bytes) after each
    chunk. pool: an executor of the caller's (else one for this call)."""
    jobs = []
    for dst, src in pairs:
        n = dst.numel()
        if n == 0:
            continue
        step = max(chunk // max(dst.element_size(), 1), 1)
        d, s = dst.view(-1), src.reshape(-1)
        for i in range(0, n, step):
            jobs.append((d[i:i + step], s[i:i + step]))
    threads = min(COPY_THREADS, len(jobs), os.cpu_count() or 1)
    if threads <= 1:
        for d, s in jobs:
            d.copy_(s)
            if advance is not None:
                advance(d.numel() * d.element_size())
        return

    def one(job):
        with torch.no_grad(), torch.inference_mode(False):
            job[0].copy_(job[1])
        if advance is not None:
            advance(job[0].numel() * job[0].element_size())
    if pool is not None:
        list(pool.map(one, jobs))
        return
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))


HUGE_PAGE = 2 << 20         # a transparent huge page (x86-64, arm64)


def host_memory(total):
    """Plain memory for a host copy of `total` bytes, page-locked once it
    is filled (HostBuf.register): an anonymous private mapping of whole
    huge pages, transparent huge pages asked for. The copy threads fault
    it in as they fill it and registering touched memory is cheap; making
    it page-locked first costs about twice as much (bench/bench_load.py).
    Less than a huge page (a patched bias) gets small pages: a huge page
    would be faulted in whole. (a uint8 tensor over the mapping, which it
    keeps alive; the mapping)."""
    huge = total >= HUGE_PAGE
    unit = HUGE_PAGE if huge else mmap.PAGESIZE
    n = (max(total, 1) + unit - 1) // unit * unit
    # Windows' anonymous mappings (the paging file's) take no flags.
    buf = (mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
           if hasattr(mmap, "MAP_ANONYMOUS") else mmap.mmap(-1, n))
    if huge:
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):   # no THP here: small pages
            pass
    return torch.frombuffer(buf, dtype=torch.uint8)[:total], buf


def _copy_jobs(host, entries, hosted, offsets, slots, st, plan):
    """[(entry, (its slot in `host`, its bytes: a file address or a
    tensor))] in `host`'s order; each hosted entry's slot filled (its
    host view and a HOST source over it; the bytes not copied yet)."""
    base = st.mmap()[0] if st is not None else 0
    ptr = host.data_ptr()
    jobs = []
    for i, off in zip(hosted, offsets):
        e = entries[i]
        h = host[off:off + e.size].view(e.dtype).view(e.shape)
        jobs.append((e, (h, base + plan[e].offset if st is not None
                         else e.tensor.detach())))
        slots[i] = (h, None, Source.from_host(ptr + off))
    return jobs


def copy_jobs(jobs, drop, advance, moved=None, pool=None,
              chunk=COPY_CHUNK):
    """Copy a batch of _copy_jobs' jobs: a file's bytes by memmove, tensors
    over copy_all's threads; advance(bytes) as they land. Entries in
    `drop` were copied out of a read-only file mapping: its pages they
    touched leave the process's RSS once copied (hostpolicy.drop_copied),
    so the copy is the one copy RSS counts. moved (a list, or None): CPU
    tensors are pointed at their copy, appended to it (offload()'s own
    copy: their old storage can go now, peak host memory one model and a
    batch, not two models). pool, chunk: copy_all's."""
    pairs, copied = [], []
    for e, (h, src) in jobs:
        if isinstance(src, int):
            ctypes.memmove(h.data_ptr(), src, e.size)
            if e in drop:
                copied.append((src, e.size))
            advance(e.size)
        else:
            pairs.append((e, h, src))
    if pairs:
        copy_all([(h, src) for _e, h, src in pairs], advance, pool, chunk)
    for e, h, src in pairs:
        if e in drop:
            copied.append((src.data_ptr(), e.size))
        if moved is not None and e.src_device.type == "cpu":
            e.tensor.data = h
            moved.append(e)
    if copied:
        hostpolicy.drop_copied(copied)


def _fill_host(jobs, drop, advance, moved):
    """The jobs copied now, a batch of up to _COPY_BATCH at a time, each
    job's source let go once copied (jobs[k] becomes (entry, None)): with
    the tensors pointed at their copy, peak host memory is one model and
    a batch."""
    for i, j in batches(jobs, _COPY_BATCH):
        copy_jobs(jobs[i:j], drop, advance, moved)
        for k in range(i, j):
            jobs[k] = (jobs[k][0], None)


# A host copy at least this large is filled behind offload() (hostload.py)
# when it may be: smaller ones take less than a forward's first units.
BEHIND_MIN = 256 << 20
BEHIND_CHUNK = 8 << 20      # bytes a copier thread copies at a time


def sources(dev, entries, align, st=None, plan=None, custom=None, times=None,
            streamed=0, model="model", behind=False):
    """Where each entry's bytes live: ([(host, file_addr, Source)], the
    HostBuf holding the host copies (None if no entry has one), HostBytes).
    A weight's host bytes live in one place (hostpolicy.py):

    - file-backed parameters (st, plan from files.match_file: the
      weights_from= file; or a CPU tensor over a mapped file) stay in the
      file: in place (a HOST source over the mapping, registered; for a
      caller's writable private mapping a read-only one of our own over
      the same page-cache pages: _own_mapping) or read from it (FILE), as
      hostpolicy.choose() says; a mapped tensor's entry keeps it (e.keep)
      for restore and outside="host". A private mapping the caller wrote
      to holds other bytes than the file: a pinned copy;
    - entries with a source of the caller's (custom[i], offload(sources=))
      get nothing of ours;
    - the rest (buffers, which training updates in place; tensors in
      anonymous memory, which their caller may change in place) get a slot
      of one new HostBuf, a pinned copy (in entries' order, align-aligned),
      filled from the file or their tensor; a CPU tensor is pointed at its
      slot at once, so its old storage can go (still one copy).

    One line says what was chosen and why (logger "vpager"; HostBytes.line).
    times (a dict, or None): gets host_fill_s (mapping the memory and
    copying the bytes in) and host_alloc_s (page-locking it). behind: a
    pinned copy of at least BEHIND_MIN bytes from CPU tensors or a file is
    filled behind the caller (a hostload.HostLoad in the HostBuf's place:
    the slots' bytes are not there until it says so)."""
    hbytes = HostBytes()
    try:
        hb, slots = _sources(dev, entries, align, st, plan, custom, times,
                             streamed, model, hbytes, behind)
    except BaseException:
        hbytes.close()
        raise
    return hb, slots, hbytes


def _behind(dev, jobs, ends, drop, host, buf, total):
    """A HostLoad filling the copy (`host` over the mapping `buf`) from
    `jobs` on a thread of its own, page-locking it piece by piece."""
    progress = Progress(total, "vpager.torch.offload: copying the weights "
                        "to pinned host memory (behind the first forward)")
    base = host.data_ptr()
    # Small batches (a unit waits for its weights' batch), so their copies
    # in small chunks on threads kept for the whole copy.
    pool = concurrent.futures.ThreadPoolExecutor(
        max(min(COPY_THREADS, os.cpu_count() or 1), 1),
        thread_name_prefix="vpager-host-copy")

    def copy(batch):
        with torch.no_grad(), torch.inference_mode(False):
            copy_jobs(batch, drop, progress.advance, pool=pool,
                      chunk=BEHIND_CHUNK)

    def end():
        pool.shutdown(wait=True)
        progress.close()

    def register(lo, hi):
        # (buf: the mapping stays alive as long as a piece of it does)
        hb = dev.register_hostbuf(base + lo, hi - lo)
        hb.mapping = buf
        return hb

    return HostLoad(jobs, ends, copy, register, total, base, len(buf),
                    end=end)


def _sources(dev, entries, align, st, plan, custom, times, streamed, model,
             hbytes, behind):
    slots, hosted, choice = _file_slots(dev, entries, st, plan, custom,
                                        streamed, hbytes)
    for i in hosted:
        hbytes.kinds[entries[i]] = hostpolicy.PINNED_COPY
    hbytes.line = hostpolicy.report(
        model, hbytes.by_kind(entries), choice,
        (hbytes.pinned, hbytes.span) if hbytes.registered else None)
    if not hosted:
        return None, slots
    offsets, total = place([entries[i] for i in hosted], align)
    drop = hbytes.copied_from
    t0 = time.perf_counter()
    host, buf = host_memory(total)
    moved = []
    jobs = _copy_jobs(host, entries, hosted, offsets, slots, st, plan)
    # (a file's bytes or a CPU tensor's: a GPU model's copy frees VRAM)
    if behind and total >= BEHIND_MIN and all(
            isinstance(src, int) or e.src_device.type == "cpu"
            for e, (_h, src) in jobs):
        ends = [off + entries[i].size for i, off in zip(hosted, offsets)]
        return _behind(dev, jobs, ends, drop, host, buf, total), slots
    progress = Progress(total, "vpager.torch.offload: copying the weights "
                        "to pinned host memory")
    try:
        with torch.no_grad(), torch.inference_mode(False):
            _fill_host(jobs, drop, progress.advance, moved)
        del jobs
        t1 = time.perf_counter()
        hb = dev.register_hostbuf(buf, total)
        if times is not None:
            times["host_fill_s"] = t1 - t0
            times["host_alloc_s"] = time.perf_counter() - t1
        progress.close()
    except BaseException:
        with torch.no_grad(), torch.inference_mode(False):
            for e in moved:
                e.tensor.data = e.tensor.data.clone()
        raise
    return hb, slots


def release_host(entries):
    """After a failed offload: tensors pointed at their host copy get a
    copy of their own (the HostBuf is about to go); sources forgotten."""
    with torch.no_grad(), torch.inference_mode(False):
        for e in entries:
            if e.host is not None and \
                    e.tensor.data_ptr() == e.host.data_ptr():
                e.tensor.data = e.host.clone()
            e.host = e.src = e.file_addr = e.keep = None


def outside(e):
    """What a managed tensor holds outside its forward with
    offload(outside="host"): a CPU tensor with its bytes (its host copy,
    its region of the mapped file, or the tensor its caller's source was
    given for)."""
    if e.host is not None:
        return e.host
    if e.file_addr is not None:
        return view(e.file_addr, e.dtype, e.shape, "cpu")
    return e.keep


def host_copy(e):
    """A new CPU tensor with the weight's bytes (host copy or file)."""
    if e.host is not None:
        return e.host.clone()
    if e.file_addr is None and e.keep is not None:     # a caller's source
        with torch.inference_mode(False):
            return e.keep.detach().clone()
    with torch.inference_mode(False):
        out = torch.empty(e.shape, dtype=e.dtype)
    if e.size:
        ctypes.memmove(out.data_ptr(), e.file_addr, e.size)
    return out


def _check_meta_buffers(module):
    for m in module.modules():
        for k in m._non_persistent_buffers_set:
            b = m._buffers.get(k)
            if b is not None and b.device.type == "meta":
                raise ValueError(
                    "vpager.torch.offload: buffer %r of %s is on the meta "
                    "device and is not persistent, so no file holds it: "
                    "make it a real tensor first" % (k, type(m).__name__))


def unmeta(module):
    """With weights_from, meta tensors are replaced by CPU placeholders (a
    meta tensor's .data cannot be set to a real one): new Parameter objects
    (the same one wherever one was shared), or buffers. Returns [(dict,
    key, old tensor)] to put them back on failure. A meta buffer that is not
    persistent (so no file holds it): ValueError, nothing changed."""
    _check_meta_buffers(module)
    swapped, new = [], {}
    with torch.no_grad(), torch.inference_mode(False):
        for m in module.modules():
            for d, is_param in ((m._parameters, True), (m._buffers, False)):
                for k, t in list(d.items()):
                    if t is None or t.device.type != "meta":
                        continue
                    r = new.get(id(t))
                    if r is None:
                        ph = placeholder(t.dtype, t.shape, "cpu")
                        r = (torch.nn.Parameter(ph, t.requires_grad)
                             if is_param else ph)
                        new[id(t)] = r
                    swapped.append((d, k, t))
                    d[k] = r
    return swapped


def put_back(swapped):
    """Undo unmeta()."""
    for d, k, old in swapped:
        d[k] = old
