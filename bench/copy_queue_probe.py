#!/usr/bin/env python3
"""Does a client's pageable host-to-device copy wait behind pinned copies
queued on another stream, and does cutting those copies into pieces let
it through sooner?

A loan of torch's cache made at a forward's end (VPAGER_LEND) filled the
pause between two steps, and ComfyUI's 4 MB pageable copy of a step's
conditioning then waited 3.8-5.1 ms (0.12-0.14 ms without the loan;
bench/RESULTS.md, forty-ninth session). Whether the copy engine takes
queued copies from two streams in turn, copy by copy, decides whether a
fill cut into small copies would let the client's copy in after one
piece instead of after the whole fill.

    python3 bench/copy_queue_probe.py [--fill-mib 296] [--client-mib 4]
        [--pieces-mib 0,64,8,2] [--paced 8x2,16x2,64x1] [--delay-ms 0.5]
        [--reps 9]

For each piece size (0: the fill as one copy) the fill is queued on a
non-blocking stream (as the library's copy stream is made) from pinned
memory, the host spins --delay-ms, then copies --client-mib from
pageable memory on torch's current stream as a client does
(tensor.to(device)). Prints the client copy's host time (median and
range of --reps), the fill's own time, and the time the fill's copies
took to issue; the first line is the client's copy alone.

--paced PxD: the fill in P MiB copies issued by a second host thread that
keeps at most D of them queued (it waits for the copy D back before it
queues the next), as a pacer in the library would: the host sleeps
--delay-ms (the GIL free, as a pacer in C would find it) and the client's
copy then waits behind at most D pieces if the copy engine takes copies
in queue order; the fill's GB/s says what the pacing costs the link.

--sm-fill: the fill read by a kernel (torch's elementwise bitwise_or over
int64s, every SM) from the pinned memory mapped into the device's
address space, not copied by the copy engine: whether the client's copy
then goes through at once, and at what GB/s the SMs pull the link; with
Triton, also by a kernel of --sm-programs programs (a few SMs: what a
fill that overlaps the next forward's start would take from its
compute). Then a loop of bf16 matmuls (a forward's compute) is timed
alone and beside each such fill on the other stream.

--vpager 0,8,16,32: the library's own fill (vpager in this checkout,
VPAGER_LIBRARY): a VBAR of --fill-mib in 8 weights whose sources lie in
a page-locked buffer, each round's pages evicted first, then the
prefetch of 7 of them (vp_prefetch_ahead for 0, vp_prefetch_sm with that
many programs otherwise) and the client's copy after --delay-ms: the
client's wait, the fill's wall time and GB/s, the bytes its SMs copied
(stats sm_copy_bytes), and the weights' bytes checked on the device."""

import argparse
import statistics
import threading
import time

import torch

MIB = 1 << 20


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def one(dev, side, src, dst, client, piece, delay):
    """One round: (client copy's host ms, the fill's GPU ms, issue ms)."""
    torch.cuda.synchronize(dev)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    issue = 0.0
    if src is not None:
        n = src.numel()
        step = n if piece <= 0 else piece
        t = time.perf_counter()
        with torch.cuda.stream(side):
            start.record(side)
            for off in range(0, n, step):
                dst[off:off + step].copy_(src[off:off + step],
                                          non_blocking=True)
            end.record(side)
        issue = time.perf_counter() - t
    spin(delay)
    t0 = time.perf_counter()
    client.to(dev)              # pageable: the host waits for it to land
    waited = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    fill = start.elapsed_time(end) if src is not None else 0.0
    return waited * 1e3, fill, issue * 1e3


class _Mapped:
    """Pinned host bytes as a CUDA array: under unified addressing a
    kernel reads them over the link at their host address."""

    def __init__(self, t):
        self.__cuda_array_interface__ = {
            "shape": (t.numel() // 8,), "typestr": "<i8",
            "data": (t.data_ptr(), False), "version": 2, "strides": None}


def by_kernel(dev, side, client, delay, fill):
    """One round with the fill a kernel that fill() queues on `side`:
    (client copy's host ms, the fill's GPU ms, issue ms)."""
    torch.cuda.synchronize(dev)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    with torch.cuda.stream(side):
        start.record(side)
        fill()
        end.record(side)
    issue = time.perf_counter() - t
    spin(delay)
    t0 = time.perf_counter()
    client.to(dev)
    waited = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    return waited * 1e3, start.elapsed_time(end), issue * 1e3


def _pull_kernel():
    """A Triton kernel that copies int64s with a fixed number of programs
    (None without Triton)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def pull(src, dst, n, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
        for start in range(tl.program_id(0) * BLOCK, n, PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)

    def run(src, dst, programs):
        pull[(programs,)](src, dst, src.numel(), BLOCK=4096,
                          PROGRAMS=programs, num_warps=8)
    return run


def paced(dev, side, src, dst, client, piece, depth, delay):
    """One round with the fill paced by a second thread (module doc)."""
    torch.cuda.synchronize(dev)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    n = src.numel()
    issued = []

    def pace():
        with torch.cuda.stream(side):
            start.record(side)
            for off in range(0, n, piece):
                if len(issued) >= depth:
                    issued[-depth].synchronize()
                dst[off:off + piece].copy_(src[off:off + piece],
                                           non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                issued.append(done)
            end.record(side)

    th = threading.Thread(target=pace)
    th.start()
    time.sleep(delay)
    t0 = time.perf_counter()
    client.to(dev)
    waited = time.perf_counter() - t0
    th.join()
    torch.cuda.synchronize(dev)
    return waited * 1e3, start.elapsed_time(end), 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fill-mib", type=int, default=296)
    ap.add_argument("--client-mib", type=int, default=4)
    ap.add_argument("--pieces-mib", default="0,64,8,2")
    ap.add_argument("--paced", default="8x2,16x2,64x1")
    ap.add_argument("--sm-fill", action="store_true")
    ap.add_argument("--sm-programs", default="8,16,32")
    ap.add_argument("--vpager", default="")
    ap.add_argument("--delay-ms", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("copy_queue_probe: no CUDA device; nothing measured")
        return 0
    dev = torch.device("cuda", torch.cuda.current_device())
    print("gpu: %s, torch %s, cuda %s" % (
        torch.cuda.get_device_name(dev), torch.__version__,
        torch.version.cuda))
    print("fill %d MiB pinned on a non-blocking stream; client %d MiB "
          "pageable on torch's current stream %.2f ms after; %d reps" % (
              a.fill_mib, a.client_mib, a.delay_ms, a.reps))
    src = torch.empty(a.fill_mib * MIB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(a.fill_mib * MIB, dtype=torch.uint8, device=dev)
    client = torch.randn(a.client_mib * MIB // 4)
    side = torch.cuda.Stream(dev)
    delay = a.delay_ms / 1e3
    cases = [("client alone", None, 0)]
    for p in (int(x) for x in a.pieces_mib.split(",")):
        label = ("fill as one copy" if p <= 0
                 else "fill in %d MiB copies" % p)
        cases.append((label, src, p * MIB))
    for pd in filter(None, a.paced.split(",")):
        p, d = (int(x) for x in pd.lower().split("x"))
        cases.append(("fill paced %d MiB x %d" % (p, d), src,
                      (p * MIB, max(d, 1))))
    mapped = None
    if a.sm_fill:
        try:
            mapped = torch.as_tensor(_Mapped(src), device=dev)
        except (RuntimeError, TypeError, ValueError) as e:
            print("pinned memory not usable as a CUDA array (%s): the SM "
                  "fills are not run" % str(e).split("\n")[0])
    if mapped is not None:
        cases.append(("fill read by SMs", mapped, "sm"))
        dst64 = dst.view(torch.int64)
        pull = _pull_kernel()
        if pull is None:
            print("no Triton: the fills by a few programs are not run")
        for g in filter(None, a.sm_programs.split(",")):
            if pull is not None:
                pull(mapped, dst64, int(g))     # compiled before timing
                cases.append(("fill read by %s programs" % g, mapped,
                              ("pull", int(g))))
    for _ in range(2):          # warm both paths
        one(dev, side, src, dst, client, 0, delay)
    slowed = {}
    for label, s, piece in cases:
        if piece == "sm":
            src.copy_(torch.arange(src.numel() // 8).view(torch.uint8))
            rows = [by_kernel(dev, side, client, delay,
                              lambda: torch.bitwise_or(s, 0, out=dst64))
                    for _ in range(a.reps)]
            print("fill read by SMs: bytes %s" % (
                "equal" if torch.equal(dst.cpu(), src) else "DIFFER"))
        elif isinstance(piece, tuple) and piece[0] == "pull":
            dst64.zero_()
            rows = [by_kernel(dev, side, client, delay,
                              lambda: pull(s, dst64, piece[1]))
                    for _ in range(a.reps)]
            print("%s: bytes %s" % (label, "equal" if torch.equal(
                dst.cpu(), src) else "DIFFER"))
        elif isinstance(piece, tuple):
            rows = [paced(dev, side, s, dst, client, piece[0], piece[1],
                          delay) for _ in range(a.reps)]
        else:
            rows = [one(dev, side, s, dst, client, piece, delay)
                    for _ in range(a.reps)]
        w = sorted(r[0] for r in rows)
        if isinstance(piece, tuple) and piece[0] == "pull":
            slowed[piece[1]] = (s, dst64)
        fill = statistics.median(r[1] for r in rows)
        issue = statistics.median(r[2] for r in rows)
        gbps = (a.fill_mib * MIB / (fill / 1e3) / 1e9) if fill else 0.0
        print("%-24s client copy %.3f ms (%.3f-%.3f)  fill %.2f ms "
              "(%.1f GB/s), issued in %.3f ms" % (
                  label, statistics.median(w), w[0], w[-1], fill, gbps,
                  issue))
    if slowed:
        beside_compute(dev, side, pull, slowed)
    if a.vpager:
        by_vpager(a, dev, client, delay,
                  [int(x) for x in a.vpager.split(",") if x])
    return 0


def by_vpager(a, dev, client, delay, programs_list):
    """--vpager: the library's fills, by its copy engine and by SMs."""
    import vpager
    n = 8
    per = a.fill_mib * MIB // n // 4096 * 4096
    host = bytearray(per * n)
    host[:] = (bytes(range(251)) * (per * n // 251 + 1))[:per * n]
    vd = vpager.Device(backend="cuda", device_index=dev.index)
    pinned = vd.register_hostbuf(host)
    page = vd.info()["page_size"]
    vb = vd.create_vbar(-(-per * n // page) * page)
    view = memoryview(host)
    ws = vb.create_weights([i * per for i in range(n)], [per] * n,
                           [view[i * per:(i + 1) * per] for i in range(n)])
    moved = per * (n - 1)
    print("vpager: %d weights of %d MiB from page-locked memory, %d MiB "
          "prefetched a round" % (n, per // MIB, moved // MIB))
    for programs in programs_list:
        rows = []
        for _ in range(a.reps):
            vb.free_memory(1 << 62)
            vb.prioritize()
            vd.synchronize()
            torch.cuda.synchronize(dev)
            sm0 = vd.stats()["sm_copy_bytes"]
            batch = vpager.WeightBatch(vd, [ws[n - 1]], lookahead=moved)
            t = time.perf_counter()
            batch.prefetch(programs)
            spin(delay)
            t0 = time.perf_counter()
            client.to(dev)
            waited = time.perf_counter() - t0
            # The whole device: the library's copy stream is not stream 0
            # (vd.synchronize() alone returned before the kernel ended).
            torch.cuda.synchronize(dev)
            wall = time.perf_counter() - t
            rows.append((waited * 1e3, wall * 1e3,
                         vd.stats()["sm_copy_bytes"] - sm0))
        same = True
        for i in range(n - 1):
            vb.fault(i * per, per)
            same &= vd.read(vb.base + i * per, per) == \
                bytes(view[i * per:(i + 1) * per])
            vb.unpin(i * per, per)
        w = sorted(r[0] for r in rows)
        wall = statistics.median(r[1] for r in rows)
        print("vpager %-18s client copy %.3f ms (%.3f-%.3f)  fill %.2f ms "
              "wall (%.1f GB/s), by SMs %d MiB, bytes %s" % (
                  "copy engine" if not programs else
                  "%d programs" % programs, statistics.median(w), w[0],
                  w[-1], wall, moved / (wall / 1e3) / 1e9,
                  rows[-1][2] // MIB, "equal" if same else "DIFFER"))
    vb.close()
    pinned.close()
    vd.close()


def beside_compute(dev, side, pull, fills):
    """The matmul loop's GPU ms alone and beside each fill of a few
    programs (fills: programs -> (mapped source, device target))."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def loop():
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(8):
            torch.matmul(a, b)
        end.record()
        return start, end

    loop()
    torch.cuda.synchronize(dev)
    rows = []
    for programs in [0] + sorted(fills):
        times = []
        for _ in range(5):
            torch.cuda.synchronize(dev)
            if programs:
                src, dst = fills[programs]
                with torch.cuda.stream(side):
                    pull(src, dst, programs)
            start, end = loop()
            torch.cuda.synchronize(dev)
            times.append(start.elapsed_time(end))
        rows.append((programs, statistics.median(times)))
    alone = rows[0][1]
    for programs, ms in rows:
        print("matmul loop %s: %.2f ms (%.3f x alone)" % (
            "alone" if not programs else
            "beside a fill by %d programs" % programs, ms, ms / alone))


if __name__ == "__main__":
    raise SystemExit(main())
