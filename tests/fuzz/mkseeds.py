#!/usr/bin/env python3
"""Writes the seed corpora in tests/fuzz/corpus/ (run from anywhere).

fuzz_api seeds are op sequences in the harness's encoding (see fuzz_api.c:
cfg_read, the OP_* list and op_decode; keep the two in step). Among them
are the three sequences of issue 11's bugs and the refills of issue 31
(vp_weight_set_source, destroy + create), so every run replays them.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# ------------------------------------------------------------ fuzz_api
(OP_VBAR_CREATE, OP_WEIGHTS_CREATE, OP_ACQUIRE, OP_RELEASE, OP_RELEASE_HELD,
 OP_FAULT, OP_UNPIN, OP_SCRATCH_WRITE, OP_SCRATCH_CHECK, OP_FREE_VBAR,
 OP_FREE_DEVICE, OP_PRIORITIZE, OP_DEPRIORITIZE, OP_SET_WATERMARK,
 OP_SET_WM_LIMIT, OP_SET_LIMIT, OP_SET_HEADROOM, OP_SET_LOOKAHEAD,
 OP_STREAM_CREATE, OP_STREAM_DESTROY, OP_STREAM_DESTROY_FAKE, OP_STREAM_SYNC,
 OP_WEIGHT_DESTROY, OP_VBAR_DESTROY, OP_INJECT, OP_CHECK_HELD, OP_STATS,
 OP_SET_ORDER, OP_RESET_LIMITS, OP_BREAK, OP_ACQUIRE_EACH) = range(31)
# Added since: opcode bytes 31.. (see op_decode in fuzz_api.c; the bytes of
# the ops above are unchanged, so older inputs decode as they did).
OP_SET_SOURCE, OP_RECREATE = 31, 32
OP_SWAP_SOURCE = 35  # the fifth op added: 31 + 4
# their `var` byte: the new source's kind (bits 0-1), a held weight (bit 2),
# a slow kernel in OP_CHECK_HELD / half the range in OP_RECREATE (bit 3)
K_HOST, K_FILE, K_NONE = 0, 1, 2
HELD, HALF = 0x04, 0x08
SRC_NULL, SRC_BAD = 0xe0, 0xc0  # invalid sources (VP_EINVAL)
# OP_CHECK_HELD's var: a kernel on the hold's stream, then the release;
# with SLOW it still runs after the next ops (worker streams)
LAUNCH_RELEASE, SLOW = 2, 0x08

LIVE = 0x80  # pick_weight / pick_vbar: the k-th live one


def header(wild=False, worker=False, geometry=0, interleaved=False,
           hostbuf=False, tidy=False, fail=False, cap_pages=8, staging=1,
           lookahead=0, fail_nth=0, file_slots=0, poll0=True, second=False,
           streams=0):
    b0 = (wild | worker << 1 | geometry << 2 | interleaved << 4 |
          hostbuf << 5 | tidy << 6 | fail << 7)
    return bytes([b0, cap_pages - 3, staging, lookahead, fail_nth,
                  file_slots, 1 if poll0 else 0,
                  (1 if second else 0) | streams << 1])


class Seq:
    def __init__(self, **hdr):
        self.b = bytearray(header(**hdr))

    def op(self, code, *args):
        self.b.append(code)
        for a in args:
            if isinstance(a, (bytes, bytearray)):
                self.b += a
            else:
                self.b.append(a & 0xff)
        return self

    # helpers in the harness's argument order
    def vbar(self, pages):
        return self.op(OP_VBAR_CREATE, pages - 1)

    def weights(self, v, sizes, kinds=None, contiguous=False, gap=0):
        """sizes: bytes (1 + sz); kinds: 0 host, 1 file, 2 none."""
        kinds = kinds or [0] * len(sizes)
        self.op(OP_WEIGHTS_CREATE, LIVE | v, len(sizes) - 1)
        for i, (s, k) in enumerate(zip(sizes, kinds)):
            kb = k | (0x20 if contiguous else 0)
            sz = s - 1
            if sz > 0xffff:  # 1 + sz * 16 bytes
                kb |= 0x40
                sz //= 16
            self.b += struct.pack("<HHBH", gap * 4 + (1 if gap else 0),
                                  sz, kb, 100 * (i + 1))
        return self

    def acquire(self, s, ws):
        return self.op(OP_ACQUIRE, s, len(ws) - 1, *[LIVE | w for w in ws])

    def release(self, s, ws):
        return self.op(OP_RELEASE, s, len(ws) - 1, *[LIVE | w for w in ws])

    def set_source(self, w, var, ab=0x1234):
        """w: the k-th live weight (var & HELD: the k-th hold)."""
        k = w if var & HELD else LIVE | w
        return self.op(OP_SET_SOURCE, k, var, struct.pack("<H", ab))

    def recreate(self, w, var, ab=0x4321):
        k = w if var & HELD else LIVE | w
        return self.op(OP_RECREATE, k, var, struct.pack("<H", ab))

    def swap_source(self, w, var=0):
        k = w if var & HELD else LIVE | w
        return self.op(OP_SWAP_SOURCE, k, var)


def refill_seeds():
    """The refills of tests/test_refill.c: w1 (a page of its own) is read by
    a slow kernel queued on s1 before its release, then gets new bytes in
    place; the kernel must still see the old ones (the copy waits for the
    pages' release fence) and the next acquire the new ones."""
    seeds = {}

    def start(lookahead=0):
        s = Seq(worker=True, geometry=2, tidy=True, cap_pages=8, staging=1,
                lookahead=lookahead)
        s.vbar(3).weights(0, [65536, 65536])  # 64 KiB pages: w0, w1
        s.op(OP_STREAM_CREATE).op(OP_STREAM_CREATE)  # s1, s2
        s.acquire(1, [0, 1]).release(1, [0, 1])
        s.acquire(1, [1])
        s.op(OP_CHECK_HELD, 0, LAUNCH_RELEASE | SLOW)  # kernel; release
        return s

    s = start().set_source(1, K_HOST)
    s.acquire(2, [1]).op(OP_CHECK_HELD, 0, 0).release(2, [1])
    seeds["refill-set-source-other-stream"] = s

    s = start().set_source(1, K_FILE)
    s.acquire(1, [1]).release(1, [1])
    seeds["refill-set-source-same-stream"] = s

    # acquiring w0 prefetches w1 in place from its new source
    s = start(lookahead=80).set_source(1, K_HOST)
    s.acquire(2, [0]).release(2, [0])
    s.acquire(2, [1]).release(2, [1])
    seeds["refill-set-source-prefetch"] = s

    s = start().recreate(1, K_HOST)  # w1 goes, w2 over its range
    s.acquire(2, [1]).release(2, [1])
    seeds["refill-destroy-create"] = s

    s = start().recreate(1, K_NONE)  # EMPTY: the harness writes it on s2
    s.acquire(2, [1]).op(OP_CHECK_HELD, 0, 0).release(2, [1])
    s.acquire(1, [1]).release(1, [1])
    seeds["refill-made-anew-empty"] = s

    # The same bytes from a copy (kept, no refill), then from another copy
    # (the first freed at once), and refused while held.
    s = start().swap_source(1).acquire(2, [1]).op(OP_CHECK_HELD, 0, 0)
    s.swap_source(0, HELD).release(2, [1])
    s.swap_source(1).acquire(1, [1]).release(1, [1])
    seeds["swap-source-same-bytes"] = s

    # acquiring w0 prefetches w1; its new source drops what was prefetched
    s = start(lookahead=80).acquire(2, [0]).swap_source(1)
    s.release(2, [0]).acquire(2, [1]).release(2, [1])
    seeds["swap-source-prefetched"] = s

    # Sync streams, pressure (some weights staged): new sources of every
    # kind, while held (VP_EBUSY, and a weight made anew over a held one
    # overlaps it), invalid ones, on a destroyed weight, half a range.
    s = Seq(cap_pages=4, staging=3, geometry=2, tidy=True)
    s.vbar(6).weights(0, [65536, 30000, 65536, 4000, 65536],
                      [0, 1, 2, 0, 1])
    s.op(OP_STREAM_CREATE)
    s.acquire(0, [0, 1, 2, 3]).acquire(1, [4])
    s.set_source(0, HELD | K_FILE).recreate(1, HELD | K_NONE)
    s.set_source(2, SRC_NULL).set_source(2, SRC_BAD)
    s.set_source(2, SRC_BAD | 0x08)
    s.op(OP_RELEASE_HELD, 0, 3).op(OP_RELEASE_HELD, 0, 3)
    s.op(OP_RELEASE_HELD, 0, 3).op(OP_RELEASE_HELD, 0, 3)
    s.op(OP_RELEASE_HELD, 0, 3)
    for w, kind in ((0, K_NONE), (1, K_HOST), (2, K_FILE), (3, K_NONE),
                    (4, K_HOST)):
        s.set_source(w, kind, 0x100 * (w + 1))
    s.acquire(1, [0, 1, 2]).acquire(0, [3, 4])
    s.op(OP_CHECK_HELD, 0, 1).op(OP_CHECK_HELD, 3, 0)
    s.op(OP_RELEASE_HELD, 0, 3).op(OP_RELEASE_HELD, 0, 3)
    s.op(OP_RELEASE_HELD, 0, 3).op(OP_RELEASE_HELD, 0, 3)
    s.op(OP_RELEASE_HELD, 0, 3)
    s.recreate(2, K_HOST | HALF).recreate(0, K_FILE)
    s.op(OP_WEIGHT_DESTROY, 4)  # w4 (made w0..w6)
    s.op(OP_SET_SOURCE, 4, K_HOST, b"\0\0")  # w4: destroyed
    s.acquire(0, [0, 1, 2, 3]).op(OP_FREE_DEVICE, 5)
    s.acquire(1, [0, 1, 2, 3])
    seeds["set-source-busy-staged"] = s
    return seeds


def api_seeds():
    seeds = {}

    # Issue 11 bug 1: S1 staged, S2 staged, prioritize, S3 in place,
    # release on S1: the page must stay pinned for S3.
    s = Seq(cap_pages=8, staging=1)
    s.vbar(2).weights(0, [4096])
    s.op(OP_STREAM_CREATE).op(OP_STREAM_CREATE).op(OP_STREAM_CREATE)
    s.op(OP_SET_WATERMARK, LIVE, 0, 0)  # page 0 is above the watermark
    s.acquire(1, [0]).acquire(2, [0])
    s.op(OP_PRIORITIZE, LIVE)
    s.acquire(3, [0])
    s.release(1, [0])
    s.op(OP_FREE_VBAR, LIVE, 5)  # UINT64_MAX
    s.op(OP_CHECK_HELD, 0, 0)
    seeds["bug1-release-ends-other-streams-hold"] = s

    # Bug 2: one acquire, then a release listing the weight 3 times.
    s = Seq(cap_pages=8, staging=1)
    s.vbar(2).weights(0, [4096])
    s.acquire(0, [0])
    s.release(0, [0, 0, 0])
    s.op(OP_RELEASE_HELD, 0, 1)
    s.release(0, [0])
    s.op(OP_WEIGHT_DESTROY, LIVE)
    s.op(OP_VBAR_DESTROY, LIVE)
    seeds["bug2-release-repeats"] = s

    # Bug 3: vp_stream_destroy(dev, s1 - 1), then the default stream.
    s = Seq(cap_pages=8, staging=1)
    s.op(OP_STREAM_CREATE)
    s.op(OP_STREAM_DESTROY_FAKE, 0, 0, bytes(8))
    s.vbar(1).weights(0, [4096])
    s.acquire(0, [0]).release(0, [0])
    seeds["bug3-destroy-made-up-stream"] = s

    # A model of two VBARs, sources of every kind, several streams,
    # pressure (free_memory, watermark, capacity), kernels, tidy end.
    for worker, geo, name in ((False, 0, "stream-sync"),
                              (True, 2, "stream-worker-64k")):
        s = Seq(worker=worker, geometry=geo, tidy=True, cap_pages=10,
                staging=2, lookahead=80)
        s.vbar(3).vbar(2)
        s.weights(0, [3000, 5000, 70000, 1000], [0, 0, 1, 2], contiguous=True)
        s.weights(1, [20000, 400, 9000], [1, 2, 0], gap=3)
        s.op(OP_STREAM_CREATE).op(OP_STREAM_CREATE)
        s.acquire(0, [0, 1]).acquire(1, [2, 3]).acquire(2, [4, 5, 6])
        s.op(OP_CHECK_HELD, 0, 1).op(OP_CHECK_HELD, 1, 2)
        s.release(0, [0, 1]).release(1, [2, 3])
        s.op(OP_FREE_DEVICE, 5)
        s.acquire(1, [0, 1, 2]).op(OP_CHECK_HELD, 2, 3)
        s.op(OP_SCRATCH_WRITE, LIVE, 0, bytes(4), bytes(2), 0, bytes(4))
        s.op(OP_SCRATCH_WRITE, LIVE | 1, 1, b"\x10\0\0\0", b"\0\1", 1,
             b"\0\1\0\0")
        s.op(OP_SCRATCH_CHECK, 0, 0).op(OP_SCRATCH_CHECK, 1, 2)
        s.op(OP_FAULT, LIVE, bytes(4), b"\xff\xff\0\0")
        s.op(OP_SET_WATERMARK, LIVE, 1, 0)
        s.op(OP_FREE_VBAR, LIVE, 2)
        s.acquire(2, [0, 3]).op(OP_CHECK_HELD, 3, 2)
        s.op(OP_INJECT, 2, 4)  # capacity: 4 pages
        s.acquire(0, [4, 5])
        s.op(OP_INJECT, 3, 0)  # capacity back
        s.op(OP_STATS, 1).op(OP_STATS, 2)
        s.op(OP_RELEASE_HELD, 0, 0).op(OP_RELEASE_HELD, 1, 3)
        s.op(OP_UNPIN, 0, 0, bytes(4), bytes(4))
        s.op(OP_DEPRIORITIZE, LIVE).op(OP_FREE_DEVICE, 2)
        s.op(OP_STREAM_SYNC, 1).op(OP_STREAM_SYNC, 2)
        seeds[name] = s

    # Injected failures (sim_fail_nth) under the model.
    s = Seq(fail=True, fail_nth=40, cap_pages=6, staging=1, lookahead=70,
            interleaved=True, hostbuf=True)
    s.vbar(4).weights(0, [50000, 50000, 90000, 2000], [0, 1, 0, 2])
    for _ in range(4):
        s.acquire(0, [0, 1]).release(0, [0, 1]).acquire(0, [2, 3])
        s.release(0, [2, 3]).op(OP_FREE_DEVICE, 1)
    seeds["inject-fail-nth"] = s

    # Wild mode: a few ops of each kind (arguments mostly garbage).
    w = bytearray(header(wild=True, worker=True, geometry=2, second=True))
    for op in range(16):
        w += bytes([op, 0, 1, 2, 3, 0x80, 5, 6, 7, 8, 9, 10, 11])
    seeds["wild-mix"] = w
    seeds.update(refill_seeds())
    return seeds


# ------------------------------------------------------- fuzz_safetensors
def st_file(tensors, metadata=None, data=b""):
    import json
    hdr = dict(tensors)
    if metadata is not None:
        hdr["__metadata__"] = metadata
    h = json.dumps(hdr, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + data


def st_seeds():
    # The harness's first input byte chooses what it does with a file that
    # opens (see fuzz_safetensors.c); the file follows it.
    return {
        "two-tensors": b"\x07" + st_file(
            {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
             "b.weight": {"dtype": "BF16", "shape": [3],
                          "data_offsets": [16, 22]}},
            {"format": "pt"}, bytes(range(22))),
        "empty-and-f4": b"\x03" + st_file(
            {"e": {"dtype": "F16", "shape": [0], "data_offsets": [4, 4]},
             "f4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
             "u": {"dtype": "U8", "shape": [], "data_offsets": [3, 4]}},
            None, b"\x12\x34\x56\x78"),
        "no-tensors": b"\x00" + st_file({}, {"k": "v"}),
        "bad-overlap": b"\x01" + st_file(
            {"x": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]},
             "y": {"dtype": "I8", "shape": [4], "data_offsets": [2, 6]}},
            None, bytes(6)),
    }


# ---------------------------------------------------------- fuzz_options
def opt_seeds():
    # name=value lines of VPAGER_* variables, then a NUL and size strings
    # (see fuzz_options.c).
    return {
        "env-good": b"VPAGER_BACKEND=sim\nVPAGER_PAGE_SIZE=2M\n"
                    b"VPAGER_SIM_CAPACITY=64MiB\nVPAGER_SIM_STREAMS=worker\n"
                    b"VPAGER_ORDER=interleaved\nVPAGER_STAGING=4M\n"
                    b"VPAGER_FILE_SLOTS=2\nVPAGER_HEADROOM=0\n\x00"
                    b"20GB\n20GiB\n 16k\n18446744073709551615\n",
        "env-bad": b"VPAGER_PAGE_SIZE=3M\nVPAGER_SIM_GRANULARITY=1K\n"
                   b"VPAGER_DEVICE=-1\nVPAGER_POLL_US=5000000000\n"
                   b"VPAGER_SIM_SHARED=a/b\n\x00"
                   b"1Ki\n1GiBB\n1BG\n18446744073709551615KB\n-1\n0x10\n",
        "sizes": b"\x00" + b"\n".join(
            [b"0", b"1K", b"1kb", b"2m", b"3MiB", b"4G", b"5gB", b"6T",
             b"7TiB", b"16383T", b"16384T", b"99999999999999999999", b"1KK",
             b"  12", b"12 ", b""]),
    }


def main():
    for harness, seeds in (("api", api_seeds()), ("safetensors", st_seeds()),
                           ("options", opt_seeds())):
        d = os.path.join(HERE, "corpus", harness)
        os.makedirs(d, exist_ok=True)
        for name, data in seeds.items():
            data = bytes(data.b if isinstance(data, Seq) else data)
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print(f"{d}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
