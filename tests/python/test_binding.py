"""Tests of the Python binding (python/vpager) on the simulated device.

    make && PYTHONPATH=python python3 -m pytest -q tests/python
    make && PYTHONPATH=python python3 tests/python/test_binding.py   # no pytest

Needs only the standard library (no numpy, no torch).
"""

import array
import ctypes
import gc
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

import vpager  # noqa: E402
from vpager import _lib  # noqa: E402

from _runner import raises, skip  # noqa: E402,F401

MiB = 1 << 20
PAGE = 2 * MiB


def sim(**kw):
    """A small simulated device: 2 MiB pages, 64 MiB, small staging ring."""
    opts = dict(backend="sim", page_size=PAGE, sim_granularity=PAGE,
                sim_capacity=64 * MiB, staging_size=8 * MiB,
                lookahead=0, sim_shared="", file_slots=2,
                file_slot_size=MiB)
    opts.update(kw)
    return vpager.Device(**opts)


def pattern(n, seed):
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


# ------------------------------------------------------- header consistency

def _header():
    with open(os.path.join(REPO, "include", "vpager.h")) as f:
        return f.read()


def test_prototypes_cover_header():
    names = set(re.findall(r"VP_API\s[^;(]*?\b(vp_\w+)\s*\(", _header()))
    assert names, "no VP_API function found in the header"
    assert names == set(_lib.PROTOTYPES), (
        "header has, binding lacks: %s; binding has, header lacks: %s"
        % (sorted(names - set(_lib.PROTOTYPES)),
           sorted(set(_lib.PROTOTYPES) - names)))



def test_host_memory():
    """vpager.host_memory(): the machine's RAM with no device, as
    /proc/meminfo says on Linux (MemTotal exactly; MemAvailable moves)."""
    m = vpager.host_memory()
    assert set(m) == {"total", "available", "limit"}, m
    assert 0 < m["available"] <= m["total"], m
    assert m["limit"] < 1 << 60, m
    if sys.platform.startswith("linux"):
        with open("/proc/meminfo") as f:
            kb = dict(ln.split(":", 1) for ln in f.read().splitlines())
        assert m["total"] == int(kb["MemTotal"].split()[0]) * 1024, m


def test_host_mappings():
    """vpager.host_mappings(): a file mapped read-only (as safetensors'
    safe_open maps one) is found, with its path, size, file offset and
    file id, not writable; host_drop_resident() drops its pages only;
    gone once closed."""
    import mmap
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.safetensors")
        with open(path, "wb") as f:
            f.write(bytes(range(256)) * 64)
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        found = [m for m in vpager.host_mappings()
                 if os.path.basename(m.path) == "w.safetensors"]
        assert len(found) == 1, found
        m = found[0]
        assert m.end - m.start >= len(mm) and m.file_offset == 0, m
        assert not m.writable and m.file_id == os.stat(path).st_ino, m
        # Its pages leave the resident set (the bytes stay); memory no
        # file backs is left alone.
        anon = ctypes.create_string_buffer(1 << 16)
        got = vpager.host_drop_resident([(m.start, len(mm)),
                                         (ctypes.addressof(anon), len(anon))])
        assert got == len(mm) // mmap.PAGESIZE * mmap.PAGESIZE, got
        assert mm[:256] == bytes(range(256))
        assert vpager.host_drop_resident([]) == 0
        mm.close()
        assert not [m for m in vpager.host_mappings()
                    if os.path.basename(m.path) == "w.safetensors"]

def test_hostspace():
    """vpager.hostspace: a reservation at a 2 MiB boundary, pages
    committed (zeros), written, faulted in, discarded (zeros, still
    writable), decommitted, released; a file mapped read-only and read at
    offsets from threads; bad ranges refused naming the call."""
    from concurrent.futures import ThreadPoolExecutor
    from vpager import hostspace
    pg = hostspace.page_size()
    base = hostspace.reserve(8 * pg + 1, 2 << 20)
    assert base % (2 << 20) == 0
    hostspace.commit(base, 4 * pg)
    hostspace.advise_huge(base, 4 * pg)
    hostspace.populate(base, 4 * pg)
    assert ctypes.string_at(base, 4 * pg) == bytes(4 * pg)
    ctypes.memset(base, 3, 4 * pg)
    hostspace.discard(base + pg, pg)
    assert ctypes.string_at(base + pg, pg) == bytes(pg)
    assert ctypes.string_at(base, pg) == b"\x03" * pg
    ctypes.memset(base + pg, 4, 1)          # still writable
    hostspace.decommit(base + 2 * pg, 2 * pg)
    e = raises(vpager.InvalidArgument, hostspace.commit, base + 1, pg)
    assert "vp_host_commit" in str(e), e
    raises(vpager.InvalidArgument, hostspace.reserve, pg, 3)
    hostspace.release(base, 9 * pg)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.bin")
        data = bytes(range(256)) * 1000
        with open(path, "wb") as f:
            f.write(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            m = hostspace.map_file(fd, len(data))
            assert ctypes.string_at(m, len(data)) == data
            hostspace.unmap_file(m, len(data))
            e = raises(vpager.InvalidArgument, hostspace.map_file, fd,
                       len(data) + 1)
            assert "vp_file_map" in str(e), e
            buf = ctypes.create_string_buffer(len(data))
            at = ctypes.addressof(buf)
            with hostspace.FileReader(fd) as r:
                with ThreadPoolExecutor(4) as ex:
                    got = list(ex.map(lambda k: r.read_at(
                        at + k * 64000, 64000, k * 64000), range(4)))
                assert got == [64000, 64000, 64000, len(data) - 192000]
                assert r.read_at(at, 10, len(data)) == 0
            assert buf.raw == data
        finally:
            os.close(fd)


def test_stat_fields_match_header():
    h = _header()
    block = h[h.index("#define VP_STAT_FIELDS"):h.index("typedef struct vp_stats")]
    names = tuple(re.findall(r"X\((\w+),", block))
    assert names == _lib.STAT_FIELDS, names
    assert vpager.STAT_NAMES == _lib.STAT_FIELDS + (
        "committed_bytes", "pinned_bytes", "machine_pinned_bytes",
        "sm_copy_bytes")


def test_errno_map_matches_header():
    h = _header()
    got = tuple((n, int(c), t) for n, c, t in re.findall(
        r'XX\((\w+),\s*(-?\d+),\s*"([^"]*)"\)', h))
    assert got == _lib.ERRNO_MAP, got
    for name, code, text in _lib.ERRNO_MAP:
        assert vpager.err_name(code) == "VP_" + name
        assert vpager.strerror(code) == text


def _struct_fields(name):
    h = _header()
    body = re.search(r"typedef struct %s \{(.*?)\} %s_t;" % (name, name), h,
                     re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    body = re.sub(r"#define.*?\n|#undef.*?\n|VP_STAT_FIELDS\(\w+\)", "", body)
    return re.findall(r"(\w+)(?:\[\d+\])?\s*;", body)


def test_struct_fields_match_header():
    for cname, ctype in [("vp_options", _lib.vp_options_t),
                         ("vp_device_info", _lib.vp_device_info_t),
                         ("vp_hostbuf_info", _lib.vp_hostbuf_info_t),
                         ("vp_source", _lib.vp_source_t),
                         ("vp_st_tensor", _lib.vp_st_tensor_t)]:
        assert _struct_fields(cname) == [n for n, _ in ctype._fields_], cname


def test_struct_layout_matches_c_compiler():
    """sizeof and offsetof of every field, by the C compiler, against
    ctypes (skipped without a C compiler)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        print("skipped: no C compiler")
        return
    structs = [_lib.vp_options_t, _lib.vp_device_info_t, _lib.vp_stats_t,
               _lib.vp_hostbuf_info_t, _lib.vp_source_t, _lib.vp_st_tensor_t,
               _lib.vp_device_t, _lib.vp_weight_t]
    lines = ["#include <stdio.h>", "#include <stddef.h>",
             '#include "vpager.h"', "int main(void) {"]
    expect = []
    for t in structs:
        lines.append('printf("%%zu\\n", sizeof(%s));' % t.__name__)
        expect.append(ctypes.sizeof(t))
        for name, _ in t._fields_:
            lines.append('printf("%%zu\\n", offsetof(%s, %s));'
                         % (t.__name__, name))
            expect.append(getattr(t, name).offset)
    lines += ["return 0; }"]
    d = tempfile.mkdtemp()
    try:
        src = os.path.join(d, "layout.c")
        with open(src, "w") as f:
            f.write("\n".join(lines))
        exe = os.path.join(d, "layout")
        subprocess.check_call([cc, "-std=c11", "-I",
                               os.path.join(REPO, "include"), src, "-o", exe])
        got = [int(x) for x in subprocess.check_output([exe]).split()]
    finally:
        shutil.rmtree(d)
    assert got == expect


def test_library_exports_every_prototype():
    lib = _lib.load()
    for name in _lib.PROTOTYPES:
        assert getattr(lib, name).argtypes is not None, name


def test_missing_library_fails_on_first_use_only():
    code = ("import vpager\n"
            "try:\n"
            "    vpager.Device(backend='sim')\n"
            "except vpager.LibraryError as e:\n"
            "    print('LIBERR', e)\n")
    env = dict(os.environ, VPAGER_LIBRARY="/nonexistent/libvpager.so",
               PYTHONPATH=os.path.join(REPO, "python"))
    out = subprocess.run([sys.executable, "-c", code], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("LIBERR"), out
    assert "make" in out and "/nonexistent/libvpager.so" in out, out


# ------------------------------------------------------------ device basics

def test_open_close_and_context_manager():
    dev = sim()
    assert dev.backend == "sim"
    assert not dev.closed
    info = dev.info()
    assert info["page_size"] == PAGE and info["total_memory"] == 64 * MiB
    assert dev.options["sim_capacity"] == 64 * MiB
    dev.close()
    assert dev.closed
    dev.close()                                     # harmless
    raises(vpager.HandleError, dev.info)
    with sim() as d2:
        assert d2.backend == "sim"
    assert d2.closed
    e = raises(vpager.HandleError, lambda: d2.backend)
    assert e.code == vpager.EHANDLE and e.name == "VP_EHANDLE"


def test_options_errors():
    e = raises(vpager.Error, sim, page_size=3 * MiB)
    assert e.code == vpager.EINVAL and e.name == "VP_EINVAL"
    assert isinstance(e, vpager.InvalidArgument) and isinstance(e, ValueError)
    assert "page" in e.message and e.message in str(e)
    assert "page" in vpager.last_error()
    raises(TypeError, sim, no_such_option=1)
    e = raises(vpager.InvalidArgument, sim, evict_order="sideways")
    assert e.code == vpager.EINVAL
    raises(vpager.InvalidArgument, sim, sim_shared="x" * 64)
    raises(vpager.InvalidArgument, sim, sim_capacity="lots")
    raises(vpager.InvalidArgument, sim, file_slots=-1)
    raises(vpager.InvalidArgument, sim, page_size=1.5)
    e = raises(vpager.InvalidArgument, sim, staging_wrap=2)
    assert "staging_wrap" in e.message


def test_options_and_helpers():
    opts = vpager.default_options()
    assert set(opts) == set(vpager.OPTION_NAMES)
    assert vpager.parse_size("32M") == 32 * MiB
    assert vpager.parse_size("3") == 3
    raises(vpager.InvalidArgument, vpager.parse_size, "3Q")
    with sim(evict_order="interleaved", sim_streams="sync",
             headroom="2M") as dev:
        assert dev.options["evict_order"] == vpager.ORDER_INTERLEAVED
        assert dev.info()["headroom"] == 2 * MiB
    with sim(staging_wrap=False) as dev:
        assert dev.options["staging_wrap"] == 0
        assert dev.info()["staging_wraps"] == 0
        dev.set_headroom(0)
        assert dev.info()["headroom"] == 0
    old = vpager.get_log_level()
    try:
        vpager.set_log_level("error")
        assert vpager.get_log_level() == vpager.LOG_ERROR
        raises(vpager.InvalidArgument, vpager.set_log_level, "loud")
        raises(vpager.InvalidArgument, vpager.set_log_level, 99)
    finally:
        vpager.set_log_level(old)


def test_size_strings_decimal_and_binary():
    """K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers
    of 1000 (accelerate's max_memory spelling), wherever sizes are read."""
    G = 1 << 30
    for text, want in (("20GB", 20 * 10 ** 9), ("20GiB", 20 * G),
                       ("20G", 20 * G), ("64KB", 64000), ("64KiB", 64 << 10),
                       ("3MB", 3 * 10 ** 6), ("3MiB", 3 * MiB),
                       ("1TB", 10 ** 12), ("1TiB", 1 << 40)):
        assert vpager.parse_size(text) == want, text
    with sim(sim_capacity="1GB") as dev:
        assert dev.info()["total_memory"] == 10 ** 9
    with sim(sim_capacity="1GiB") as dev:
        assert dev.info()["total_memory"] == G


def test_check():
    assert vpager.check(0) == 0
    assert vpager.check(vpager.MISS) == vpager.MISS     # not an error
    e = raises(vpager.BusyError, vpager.check, vpager.EBUSY)
    assert e.code == vpager.EBUSY
    for name, code, _ in _lib.ERRNO_MAP:
        e = raises(vpager.Error, vpager.check, code)
        assert e.name == "VP_" + name and e.code == code


# ------------------------------------------------------------------- VBARs

def test_vbar_fault_unpin_residency_gens():
    with sim() as dev:
        vb = dev.create_vbar(10 * PAGE + 1)
        assert vb.page_count == 11 and vb.size == 11 * PAGE
        assert vb.base != 0
        assert vb.device_handle() == dev.id
        assert vb.residency() == bytes(11)
        ok, gens = vb.fault(PAGE // 2, 2 * PAGE)        # pages 0..2
        assert ok and len(gens) == 3 and len(set(gens)) == 3
        flags = vb.residency()
        assert flags[:3] == bytes([vpager.PAGE_RESIDENT |
                                   vpager.PAGE_PINNED] * 3)
        assert flags[3:] == bytes(8)
        assert vb.loaded_size() == 3 * PAGE
        assert vb.stats()["pinned_bytes"] == 3 * PAGE
        ok2, gens2 = vb.fault(0, PAGE, gens=False)      # a hit, pinned twice
        assert ok2 and gens2 is None
        vb.unpin(0, PAGE)
        raises(vpager.BusyError, vb.close)             # still pinned
        assert not vb.closed
        vb.unpin(PAGE // 2, 2 * PAGE)
        assert vb.residency(3) == bytes([vpager.PAGE_RESIDENT] * 3)
        e = raises(vpager.NotPinnedError, vb.unpin, 0, PAGE)
        assert e.code == vpager.ENOTPINNED
        # Same generations while resident; new ones after eviction.
        assert vb.fault(0, 3 * PAGE) == (True, gens)
        vb.unpin(0, 3 * PAGE)
        assert dev.reclaimable() == 3 * PAGE
        assert vb.free_memory(3 * PAGE) == 3 * PAGE
        assert vb.loaded_size() == 0
        vb.prioritize()
        ok, gens3 = vb.fault(0, 3 * PAGE)
        assert ok and all(a != b for a, b in zip(gens, gens3))
        vb.unpin(0, 3 * PAGE)
        st = vb.stats()
        assert st["faults"] == 4 and st["hits"] == 2 and st["fills"] == 2
        assert st["unpins"] == 4 and st["pages_evicted"] == 3
        raises(vpager.RangeError, vb.fault, 11 * PAGE, 1)
        raises(vpager.RangeError, vb.residency, 12)
        assert dev.free_memory(1 << 40) == 3 * PAGE
        vb.close()
        assert vb.closed
        vb.close()
        raises(vpager.HandleError, vb.fault, 0, 1)


def test_vbar_miss_watermarks_priority():
    with sim(sim_capacity=8 * PAGE) as dev:
        a = dev.create_vbar(8 * PAGE)
        b = dev.create_vbar(8 * PAGE)
        assert a.watermarks == (8, 8)
        assert a.fault(0, 8 * PAGE)[0]
        a.unpin(0, 8 * PAGE)
        b.prioritize()
        # b needs room: a (lower priority) is evicted from its tail.
        ok, _ = b.fault(0, 2 * PAGE)
        assert ok
        b.unpin(0, 2 * PAGE)
        assert a.loaded_size() == 6 * PAGE
        assert a.get_watermark() == 6
        # A page ranked above a's watermark is a miss at once.
        assert a.fault(7 * PAGE, PAGE) == (False, None)
        assert a.stats()["watermark_misses"] == 1
        a.set_watermark_limit(2 * PAGE)
        assert a.get_watermark_limit() == 2
        a.set_watermark_limit(None)
        assert a.get_watermark_limit() == 8
        a.set_watermark(8 * PAGE)
        assert a.get_watermark() == 8
        raises(vpager.RangeError, a.set_watermark, 9 * PAGE)
        dev.reset_limits()
        a.deprioritize()
        raises(vpager.BusyError, a.set_order, "interleaved")
        b.free_memory(1 << 40)          # lowers b's watermark to 0
        assert b.fault(0, PAGE) == (False, None)
        b.prioritize()                  # lifts it
        b.set_order(vpager.ORDER_INTERLEAVED)
        raises(vpager.InvalidArgument, b.set_order, "sideways")
        # Device full of pinned pages: a miss, nothing pinned.
        assert a.fault(0, 6 * PAGE)[0]
        assert b.fault(0, 2 * PAGE)[0]
        assert b.fault(2 * PAGE, PAGE) == (False, None)
        assert b.stats()["misses"] == 2
        a.unpin(0, 6 * PAGE)
        b.unpin(0, 2 * PAGE)


def test_sim_inject():
    with sim() as dev:
        vb = dev.create_vbar(4 * PAGE)
        dev.sim_inject(vpager.SIM_FAIL_COMMIT, 1)
        assert vb.fault(0, PAGE) == (False, None)
        assert vb.fault(0, PAGE)[0]
        vb.unpin(0, PAGE)
        old = vpager.get_log_level()
        vpager.set_log_level("none")    # the broken device logs errors
        try:
            dev.sim_inject(vpager.SIM_BREAK)
            raises(vpager.DeviceError, vb.fault, PAGE, PAGE)
        finally:
            vpager.set_log_level(old)


# ------------------------------------------------------------------ copies

def test_copy_round_trip():
    with sim() as dev:
        vb = dev.create_vbar(4 * PAGE)
        assert vb.fault(0, 2 * PAGE)[0]
        base = vb.base
        data = pattern(PAGE + 123, 5)
        dev.copy_to_device(base + 7, data)
        dev.synchronize()
        assert dev.read(base + 7, len(data)) == data
        # On the simulated device, device addresses are host addresses.
        assert ctypes.string_at(base + 7, 64) == data[:64]
        # Other buffer kinds, both ways.
        dev.copy_to_device(base, bytearray(b"abc"))
        dev.copy_to_device(base + 3, memoryview(b"xxdefxx")[2:5])
        dev.copy_to_device(base + 6, array.array("B", b"ghi"))
        dev.copy_to_device(base + 9, (ctypes.c_char * 3)(*b"jkl"))
        dev.copy_to_device(base + 12, b"mnopqr", size=3)
        dst = bytearray(15)
        dev.copy_to_host(dst, base)
        dev.synchronize()
        assert bytes(dst) == b"abcdefghijklmno"
        mv = memoryview(bytearray(8))
        dev.copy_to_host(mv[2:5], base)
        out = (ctypes.c_char * 3)()
        dev.copy_to_host(out, base + 3)
        dev.synchronize()
        assert mv.tobytes() == b"\0\0abc\0\0\0" and out.raw == b"def"
        raises(vpager.InvalidArgument, dev.copy_to_host, b"readonly", base)
        raises(vpager.InvalidArgument, dev.copy_to_device, base, b"ab", 3)
        raises(vpager.InvalidArgument, dev.copy_to_device, base, object())
        e = raises(vpager.NotPinnedError, dev.copy_to_device,
                   base + 3 * PAGE, b"x")
        assert "not pinned" in e.message
        raises(vpager.RangeError, dev.copy_to_device, 16, b"x")
        st = dev.stats()
        assert st["bytes_copied"] >= len(data) * 2
        vb.unpin(0, 2 * PAGE)


def test_streams_worker_mode():
    with sim(sim_streams="worker") as dev:
        assert dev.info()["async_copies"] == 1
        vb = dev.create_vbar(2 * PAGE)
        assert vb.fault(0, PAGE)[0]
        s = dev.create_stream()
        assert s != 0
        data = pattern(PAGE, 9)
        src = bytearray(data)
        dev.copy_to_device(vb.base, src, stream=s)
        del src                     # held by the device until synchronized
        gc.collect()
        dst = bytearray(PAGE)
        dev.copy_to_host(dst, vb.base, stream=s)
        dev.synchronize(s)
        assert bytes(dst) == data
        vb.unpin(0, PAGE, stream=s)
        dev.destroy_stream(s)
        raises(vpager.InvalidArgument, dev.destroy_stream, 0)


def test_sim_launch():
    for mode in ("sync", "worker"):
        with sim(sim_streams=mode) as dev:
            vb = dev.create_vbar(PAGE)
            assert vb.fault(0, PAGE)[0]
            base = vb.base
            s = dev.create_stream()
            dev.copy_to_device(base, b"\x01" * 16, stream=s)

            def kernel():   # runs "on the device": doubles 16 bytes
                buf = (ctypes.c_uint8 * 16).from_address(base)
                for i in range(16):
                    buf[i] *= 2

            dev.sim_launch(kernel, stream=s)
            del kernel
            gc.collect()
            dev.synchronize(s)
            assert dev.read(base, 16) == b"\x02" * 16

            def bad():
                raise KeyError("from the kernel")

            try:
                dev.sim_launch(bad, stream=s)
                dev.synchronize(s)
            except KeyError as e:
                assert "from the kernel" in str(e)
            else:
                raise AssertionError("kernel exception lost (%s)" % mode)
            dev.synchronize(s)          # raised once only
            vb.unpin(0, PAGE, stream=s)
            dev.destroy_stream(s)


# ----------------------------------------------------------------- stats

def test_stats_names_and_report():
    with sim() as dev:
        vb = dev.create_vbar(4 * PAGE)
        assert vb.fault(0, PAGE)[0]
        st = dev.stats()
        assert tuple(st) == vpager.STAT_NAMES
        assert st["faults"] == 1 and st["committed_bytes"] == PAGE
        assert st["pinned_bytes"] == PAGE
        assert tuple(vb.stats()) == vpager.STAT_NAMES
        text = dev.report()
        assert text.startswith("vpager device [sim]")
        assert "P..." in text
        rep = dev.report(json=True)
        assert rep["backend"] == "sim" and rep["page_size"] == PAGE
        assert tuple(rep["stats"]) == _lib.STAT_FIELDS
        assert rep["stats"]["faults"] == 1
        assert len(rep["vbars"]) == 1
        assert rep["vbars"][0]["id"] == vb.id
        assert rep["vbars"][0]["map"] == "P..."
        # A report longer than the first buffer (4 KiB).
        big = dev.create_vbar(10000 * PAGE)
        assert len(dev.report(json=True)["vbars"][0]["map"]) == 10000
        assert len(dev.report()) > 10000
        big.close()
        vb.unpin(0, PAGE)


# ---------------------------------------------------------------- hostbufs

def test_hostbuf_alloc_grow_register():
    with sim(pin_budget=16 * MiB) as dev:
        hb = dev.alloc_hostbuf(MiB, 4 * MiB)
        info = hb.info()
        assert info["size"] == MiB and info["max_size"] >= 4 * MiB
        ptr = hb.ptr
        assert ptr != 0
        assert ctypes.string_at(ptr, 16) == bytes(16)   # zeroed
        v = hb.view()
        assert len(v) == MiB
        v[0:4] = b"abcd"
        hb.grow(3 * MiB)
        assert hb.ptr == ptr and hb.size == 3 * MiB
        assert ctypes.string_at(ptr, 4) == b"abcd"
        hb.view(3 * MiB - 4, 4)[:] = b"tail"
        raises(vpager.RangeError, hb.view, 3 * MiB - 3, 4)
        raises(vpager.Error, hb.grow, 64 * MiB)
        assert hb.pinned_bytes <= 3 * MiB
        hb.close()
        hb.close()
        raises(vpager.HandleError, hb.info)
        raises(vpager.InvalidArgument, dev.alloc_hostbuf, 2 * MiB, MiB)
        mem = bytearray(2 * MiB)
        rb = dev.register_hostbuf(mem)
        assert rb.ptr == ctypes.addressof(ctypes.c_char.from_buffer(mem))
        assert rb.size == 2 * MiB
        raises(BufferError, mem.extend, b"x")   # held while registered
        rb.close()
        mem.extend(b"x")                        # let go
        dev.set_pin_budget(0)


# ---------------------------------------------------------------- weights

def test_weights_acquire_release_host_sources():
    for mode in ("sync", "worker"):
        _weights_round(mode)


def _weights_round(mode):
    # 12 weights of 1.5 pages (in 2-page slots: 24 pages) over a 16-page
    # device, 5 pages of which are the staging ring: some must be staged.
    nw, wsize = 12, 3 * PAGE // 2
    with sim(sim_capacity=16 * PAGE, staging_size=5 * PAGE,
             sim_streams=mode) as dev:
        vb = dev.create_vbar(nw * 2 * PAGE)
        offsets = [i * 2 * PAGE for i in range(nw)]
        datas = [pattern(wsize, i) for i in range(nw)]
        hb = dev.alloc_hostbuf(nw * wsize)
        for i, d in enumerate(datas):
            hb.view(i * wsize, wsize)[:] = d
        sources = [vpager.Source.from_host(hb.view(i * wsize, wsize))
                   if i % 2 else datas[i] for i in range(nw)]
        ws = vb.create_weights(offsets, [wsize] * nw, sources)
        assert len(ws) == nw and len(set(ws.ids)) == nw
        s = dev.create_stream()
        layers = [ws.batch(range(i, i + 3)) for i in range(0, nw, 3)]
        seen = 0
        for rnd in range(3):
            for li, batch in enumerate(layers):
                ptrs = batch.acquire(s)
                dev.synchronize(s)
                for j in range(3):
                    i = li * 3 + j
                    f = batch.flags[j]
                    assert f & (vpager.ACQUIRED_RESIDENT |
                                vpager.ACQUIRED_STAGED), f
                    seen |= f
                    if f & vpager.ACQUIRED_RESIDENT:
                        assert ptrs[j] == vb.base + offsets[i]
                    assert ctypes.string_at(ptrs[j], wsize) == datas[i], \
                        (rnd, i, f)
                raises(vpager.BusyError, ws.destroy, li * 3)
                batch.release(s)
        dev.synchronize(s)
        assert seen & vpager.ACQUIRED_STAGED and seen & vpager.ACQUIRED_RESIDENT
        st = dev.stats()
        assert st["acquires"] == 3 * nw
        assert st["weight_staged"] > 0 and st["weight_fills"] > 0
        e = raises(vpager.NotPinnedError, layers[0].release, s)
        assert "not acquired" in e.message
        # The one-off forms.
        ptrs, flags = dev.acquire([ws[0], ws[-1]], s)
        assert len(ptrs) == 2 and all(flags)
        dev.release(ws[0:1] + [ws[-1]], s)
        dev.synchronize(s)
        ws.destroy(0)
        raises(vpager.HandleError, ws.destroy, 0)
        raises(vpager.HandleError, layers[0].acquire, s)   # C says EHANDLE
        ws.close()
        assert ws.closed
        raises(vpager.HandleError, lambda: ws[1].handle)
        raises(vpager.HandleError, layers[1].acquire, s)
        dev.destroy_stream(s)


def test_weights_empty_source_and_errors():
    with sim() as dev:
        vb = dev.create_vbar(8 * PAGE)
        ws = vb.create_weights([0, PAGE], [PAGE, PAGE])   # sources NONE
        b = ws.batch()
        b.acquire()
        assert all(f & vpager.ACQUIRED_EMPTY for f in b.flags)
        assert all(f & vpager.ACQUIRED_RESIDENT for f in b.flags)
        b.release()
        raises(vpager.InvalidArgument, vb.create_weights, [0], [PAGE],
               [b"too small"])
        raises(vpager.InvalidArgument, vb.create_weights, [0], [1, 2])
        raises(vpager.Error, vb.create_weights, [0], [PAGE])   # overlap
        raises(TypeError, vpager.WeightBatch, dev, [1, 2])
        # Closing the VBAR destroys its weights (in C): the Python objects
        # follow, and the batch's handles are stale for C.
        vb.close()
        assert ws.closed
        ws.close()
        raises(vpager.HandleError, b.acquire)


def test_weight_set_source():
    """Weights.set_source: the next acquire fills the weight from the new
    source (the other keeps its fill); too small a source, a held weight
    and a destroyed one are errors."""
    with sim() as dev:
        vb = dev.create_vbar(4 * PAGE)
        a, b, c = pattern(PAGE, 1), pattern(PAGE, 2), pattern(PAGE, 3)
        ws = vb.create_weights([0, PAGE], [PAGE, PAGE], [a, b])
        batch = ws.batch()
        batch.acquire()
        batch.release()
        fills = dev.stats()["weight_fills"]
        ws.set_source(1, c)
        ptrs = batch.acquire()
        assert dev.stats()["weight_fills"] == fills + 1     # only weight 1
        out = bytearray(PAGE)
        dev.copy_to_host(out, ptrs[1], PAGE)
        dev.synchronize(0)
        assert bytes(out) == bytes(c)
        raises(vpager.BusyError, ws.set_source, 1, b)
        batch.release()
        raises(vpager.InvalidArgument, ws.set_source, 0, b"too small")
        ws.destroy(0)
        raises(vpager.Error, ws.set_source, 0, a)


def test_weights_move():
    """Weights.move: a weight left in place keeps its fill, a moved one is
    filled anew at its new place (its offset reads back); a held weight
    and unequal lists are errors."""
    with sim() as dev:
        vb = dev.create_vbar(6 * PAGE)
        a, b = pattern(PAGE, 4), pattern(PAGE, 5)
        ws = vb.create_weights([0, PAGE], [PAGE, PAGE], [a, b])
        batch = ws.batch()
        batch.acquire()
        batch.release()
        fills = dev.stats()["weight_fills"]
        raises(vpager.InvalidArgument, ws.move, [1], [])
        ws.move([1, 0], [4 * PAGE, 0])
        assert ws.offsets == (0, 4 * PAGE) and ws[1].offset == 4 * PAGE
        ptrs = batch.acquire()
        assert dev.stats()["weight_fills"] == fills + 1     # only weight 1
        assert ptrs[1] == vb.base + 4 * PAGE
        out = bytearray(PAGE)
        dev.copy_to_host(out, ptrs[1], PAGE)
        dev.synchronize(0)
        assert bytes(out) == bytes(b)
        raises(vpager.BusyError, ws.move, [1], [2 * PAGE])
        batch.release()
        assert ws.offsets == (0, 4 * PAGE)


def test_weight_batch_streams():
    # WeightBatch calls C without argtypes: the stream is converted (and
    # checked) by the batch, the last one kept for the next call.
    with sim() as dev:
        vb = dev.create_vbar(8 * PAGE)
        ws = vb.create_weights([0, PAGE], [PAGE, PAGE],
                               [bytes(PAGE), bytes(PAGE)])
        b = ws.batch()
        s = dev.create_stream()
        for st in (0, s, s, 0, s):
            b.acquire(st)
            assert all(f & vpager.ACQUIRED_RESIDENT for f in b.flags)
            b.release(st)
        b.acquire(s)
        raises(vpager.NotPinnedError, b.release, 0)    # held on s, not 0
        b.release(s)
        raises(TypeError, b.acquire, "0")
        raises(TypeError, b.acquire, 1.0)
        raises(OverflowError, b.acquire, -1)
        raises(OverflowError, b.release, 1 << 64)
        b.acquire()
        b.release()
        dev.synchronize(s)
        dev.destroy_stream(s)


def test_weight_windows_and_acquire_ahead():
    """Weights.set_window (vp_weight_set_lookahead): the prefetch after a
    weight runs its window, None the device's (0 here); WeightBatch(
    lookahead=) (vp_acquire_ahead) the batch's own, whatever the weight's,
    and its prefetch() too (vp_prefetch_ahead); bad values are
    InvalidArgument."""
    with sim() as dev:
        vb = dev.create_vbar(8 * PAGE)
        ws = vb.create_weights([i * PAGE for i in range(8)], [PAGE] * 8,
                               [pattern(PAGE, i) for i in range(8)])

        def resident_after(batch, prefetch=False, programs=0):
            vb.free_memory(8 * PAGE)
            vb.prioritize()
            if prefetch:
                batch.prefetch(programs)
            else:
                batch.acquire()
                batch.release()
            dev.synchronize(0)
            return sum(1 for f in vb.residency(8)
                       if f & vpager.PAGE_RESIDENT)

        assert ws.window(0) is None
        assert resident_after(ws.batch([0])) == 1           # the device's 0
        ws.set_window(0, 3 * PAGE)
        assert ws.window(0) == 3 * PAGE
        assert resident_after(ws.batch([0])) == 4
        assert resident_after(vpager.WeightBatch(dev, [ws[0]],
                                                 lookahead=0)) == 1
        assert resident_after(vpager.WeightBatch(dev, [ws[0]],
                                                 lookahead=PAGE)) == 2
        # prefetch(): the prefetch the batch's acquire runs, acquiring
        # nothing (vp_prefetch_ahead with the batch's own window).
        assert resident_after(ws.batch([0]), prefetch=True) == 3
        assert resident_after(vpager.WeightBatch(dev, [ws[0]],
                                                 lookahead=PAGE),
                              prefetch=True) == 1
        # prefetch(programs): the same prefetch by SMs where they can copy
        # (vp_prefetch_sm; these sources are not page-locked: the copy
        # engine's, sm_copy_bytes stays 0); programs past the most refused.
        assert resident_after(ws.batch([0]), True, 8) == 3
        assert resident_after(vpager.WeightBatch(dev, [ws[0]],
                                                 lookahead=PAGE),
                              True, 8) == 1
        assert dev.stats()["sm_copy_bytes"] == 0
        raises(vpager.InvalidArgument, ws.batch([0]).prefetch, 1 << 11)
        ws.set_window(0, None)
        assert ws.window(0) is None
        assert resident_after(ws.batch([0])) == 1
        raises(vpager.InvalidArgument, ws.set_window, 0, -1)
        raises(vpager.InvalidArgument, ws.set_window, 0, 1 << 64)
        raises(TypeError, ws.set_window, 0, "1M")
        raises(vpager.InvalidArgument, vpager.WeightBatch, dev, [ws[0]],
               lookahead=-1)
        ws.destroy(1)
        raises(vpager.Error, ws.set_window, 1, PAGE)


def test_weights_staging_too_small():
    with sim(sim_capacity=4 * PAGE, staging_size=PAGE) as dev:
        vb = dev.create_vbar(16 * PAGE)
        ws = vb.create_weights([0, 8 * PAGE], [8 * PAGE, 2 * PAGE],
                               [bytes(8 * PAGE), bytes(2 * PAGE)])
        e = raises(vpager.LimitError, ws.batch([0]).acquire)
        assert e.code == vpager.ELIMIT


def test_weight_batch_hot_path_speed():
    n = 64
    with sim() as dev:
        vb = dev.create_vbar(n * 4096)
        ws = vb.create_weights([i * 4096 for i in range(n)], [4096] * n,
                               [bytes(4096)] * n)
        b = ws.batch()
        b.acquire()
        b.release()
        reps = 2000
        t = time.perf_counter()
        for _ in range(reps):
            b.acquire()
            b.release()
        dt = time.perf_counter() - t
        per_weight = dt / reps / n * 1e6
        print("hot path: %.3f us per weight (acquire+release, %d weights a "
              "batch)" % (per_weight, n))
        # A figure, not a check: timing belongs to bench/, not to tests.


# ------------------------------------------------------------- safetensors

def write_safetensors(path, tensors):
    """tensors: [(name, dtype, shape, bytes)]."""
    header, off, blobs = {}, 0, []
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_safetensors():
    d = tempfile.mkdtemp()
    try:
        path = os.path.join(d, "m.safetensors")
        a = pattern(4 * 1000, 1)
        b = pattern(2 * 3 * 2, 2)
        write_safetensors(path, [("a.weight", "F32", (10, 100), a),
                                 ("b.bias", "F16", (2, 3), b)])
        with sim() as dev:
            st = dev.open_safetensors(path)
            assert len(st) == 2
            t0 = st[0]
            assert (t0.name, t0.dtype, t0.shape, t0.size) == \
                ("a.weight", "F32", (10, 100), len(a))
            assert st["b.bias"].shape == (2, 3)
            assert st.find("b.bias") == 1 and "b.bias" in st
            assert "nope" not in st
            raises(vpager.InvalidArgument, st.find, "nope")
            raises(vpager.RangeError, st.tensor, 2)
            buf = st.buffer()
            assert bytes(buf[t0.offset:t0.offset + 8]) == a[:8]
            addr, size = st.mmap()
            assert size == os.path.getsize(path) and addr
            # Load straight into a VBAR.
            vb = dev.create_vbar(4 * PAGE)
            assert st.load([0, 1], vb, [0, PAGE])
            dev.synchronize()
            assert vb.fault(0, 2 * PAGE)[0]
            assert dev.read(vb.base, len(a)) == a
            assert dev.read(vb.base + PAGE, len(b)) == b
            vb.unpin(0, 2 * PAGE)
            assert dev.stats()["file_bytes_read"] >= len(a) + len(b)
            # File sources for weights.
            vb2 = dev.create_vbar(4 * PAGE)
            ws = vb2.create_weights([0, PAGE], [t0.size, len(b)],
                                    [st.source(0), st.source(1)])
            batch = ws.batch()
            ptrs = batch.acquire()
            dev.synchronize()
            assert ctypes.string_at(ptrs[0], len(a)) == a
            assert ctypes.string_at(ptrs[1], len(b)) == b
            batch.release()
            st.drop_pages()
            st.close()
            st.close()
            raises(vpager.HandleError, len, st)
            # A bad file names itself.
            bad = os.path.join(d, "bad.safetensors")
            with open(bad, "wb") as f:
                f.write(struct.pack("<Q", 4) + b"{no}")
            e = raises(vpager.InvalidArgument, dev.open_safetensors, bad)
            assert "bad.safetensors" in e.message
    finally:
        shutil.rmtree(d)


def test_file_read_to_device():
    d = tempfile.mkdtemp()
    try:
        path = os.path.join(d, "blob")
        data = pattern(3 * MiB + 5, 3)
        with open(path, "wb") as f:
            f.write(data)
        with sim() as dev, open(path, "rb") as f:
            vb = dev.create_vbar(4 * PAGE)
            assert vb.fault(0, 4 * PAGE)[0]
            dev.file_read_to_device(f, 5, len(data) - 5, vb.base + 1)
            dev.synchronize()
            assert dev.read(vb.base + 1, len(data) - 5) == data[5:]
            vb.unpin(0, 4 * PAGE)
    finally:
        shutil.rmtree(d)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_fds_of_the_librarys_own_runtime():
    """On Windows the library takes fds of its own C runtime, not Python's
    (vpager._fds). With that translation on (here over a stand-in msvcrt
    whose handles are the fds themselves, as vp_file_descriptor takes them
    on POSIX), a read goes through an fd of the library's own, closed when
    the read is done, and a file source holds one for as long as it
    lives; bytes as read through Python's fd."""
    from vpager import _fds
    from vpager.weights import Source
    if not os.path.isdir("/proc/self/fd"):
        skip("no /proc/self/fd to count open files")
    d = tempfile.mkdtemp()
    old = sys.modules.get("msvcrt")
    sys.modules["msvcrt"] = types.SimpleNamespace(get_osfhandle=lambda fd: fd)
    _fds.TRANSLATE[0] = True
    try:
        path = os.path.join(d, "blob")
        data = pattern(MiB + 5, 6)
        with open(path, "wb") as f:
            f.write(data)
        with sim() as dev, open(path, "rb") as f:
            out = ctypes.create_string_buffer(len(data))
            n0 = open_fds()
            dev.file_read_to_address(f, 0, len(data), ctypes.addressof(out))
            dev.synchronize()
            assert out.raw == data and open_fds() == n0
            src = Source.from_file(f, 5)
            assert src.fd != f.fileno() and open_fds() == n0 + 1
            assert os.pread(src.fd, 8, 5) == data[5:13]
            assert f in src.keep
            del src
            gc.collect()
            assert open_fds() == n0
    finally:
        _fds.TRANSLATE[0] = sys.platform == "win32"
        if old is None:
            sys.modules.pop("msvcrt", None)
        else:
            sys.modules["msvcrt"] = old
        shutil.rmtree(d)


def test_file_read_to_address_and_driver_queries():
    """file_read_to_address into memory no VBAR holds (on the simulated
    device, host memory) over several threads; release_file_reader;
    device_count and host_unregister, which compat asks instead of the
    driver."""
    d = tempfile.mkdtemp()
    try:
        path = os.path.join(d, "blob")
        data = pattern(5 * MiB + 7, 4)
        with open(path, "wb") as f:
            f.write(data)
        with sim() as dev, open(path, "rb") as f:
            out = ctypes.create_string_buffer(len(data))
            for threads in (1, 4):
                dev.file_read_to_address(f, 3, len(data) - 3,
                                         ctypes.addressof(out), 0, threads)
                dev.synchronize()
                assert out.raw[:len(data) - 3] == data[3:]
            raises(vpager.InvalidArgument, dev.file_read_to_address, f, 0,
                   10, ctypes.addressof(out), 0, 0)
            dev.release_file_reader()
            assert dev.host_unregister(ctypes.addressof(out)) is True
            assert dev.host_unregister(0) is False
    finally:
        shutil.rmtree(d)
    assert vpager.device_count("sim") == 1
    assert vpager.device_count("cuda") >= 0
    raises(vpager.InvalidArgument, vpager.device_count, "auto")
    assert vpager.device_count("hip") >= 0
    with sim() as dev:                  # the platform's soft limit
        assert dev.soft_limit() is None
        dev.sim_inject(vpager.SIM_SET_SOFT_LIMIT, 3 << 30)
        assert dev.soft_limit() == 3 << 30
        dev.sim_inject(vpager.SIM_SET_SOFT_LIMIT, 0)
        assert dev.soft_limit() is None


def test_gpu_backend_follows_the_torch_build():
    """vpager.gpu_backend(): "hip" under a ROCm build of torch
    (torch.version.hip set), else "cuda", and "cuda" without torch loaded;
    backend="hip" where no AMD GPU is usable is a NoDeviceError that
    names HIP."""
    import types
    saved = sys.modules.get("torch")
    fake = types.ModuleType("torch")
    try:
        sys.modules["torch"] = fake
        fake.version = types.SimpleNamespace(hip="6.2.41133", cuda=None)
        assert vpager.gpu_backend() == "hip"
        fake.version = types.SimpleNamespace(hip=None, cuda="12.4")
        assert vpager.gpu_backend() == "cuda"
        del sys.modules["torch"]
        assert vpager.gpu_backend() == "cuda"
    finally:
        if saved is not None:
            sys.modules["torch"] = saved
        else:
            sys.modules.pop("torch", None)
    assert vpager.BACKEND_HIP == 3
    if vpager.device_count("hip") == 0:
        e = raises(vpager.NoDeviceError, vpager.Device, backend="hip",
                   page_size="2M")
        assert "HIP" in str(e), str(e)


# ------------------------------------------------------- handle lifetimes

def test_device_close_closes_children():
    dev = sim()
    vb = dev.create_vbar(4 * PAGE)
    ws = vb.create_weights([0], [PAGE])
    hb = dev.alloc_hostbuf(4096)
    assert vb.fault(0, PAGE)[0]         # pinned: the device closes anyway
    dev.close()
    for h in (vb, ws, hb):
        assert h.closed
        h.close()                       # no second free, no error
    raises(vpager.HandleError, vb.fault, 0, 1)
    raises(vpager.HandleError, hb.info)
    raises(vpager.HandleError, dev.create_vbar, PAGE)


def test_stale_c_handles_are_errors():
    dev = sim()
    vb = dev.create_vbar(PAGE)
    raw = _lib.vp_vbar_t(vb.id)
    dev.close()
    assert _lib.C.vp_vbar_destroy(raw) == vpager.EHANDLE
    assert _lib.C.vp_device_close(_lib.vp_device_t(dev._h.id)) == \
        vpager.EHANDLE
    e = raises(vpager.HandleError, vpager.check, vpager.EHANDLE)
    assert e.code == vpager.EHANDLE


def test_del_frees():
    dev = sim()
    vb = dev.create_vbar(4 * PAGE)
    assert vb.fault(0, PAGE)[0]
    vb.unpin(0, PAGE)
    vid = vb.id
    del vb
    gc.collect()
    assert dev.report(json=True)["vbars"] == []
    assert _lib.C.vp_vbar_destroy(_lib.vp_vbar_t(vid)) == vpager.EHANDLE
    hb = dev.alloc_hostbuf(4096)
    hid = hb.id
    del hb
    gc.collect()
    assert _lib.C.vp_hostbuf_free(_lib.vp_hostbuf_t(hid)) == vpager.EHANDLE
    # A pinned VBAR cannot be destroyed: __del__ swallows the error, and the
    # device frees it at close.
    vb2 = dev.create_vbar(PAGE)
    assert vb2.fault(0, PAGE)[0]
    del vb2
    gc.collect()
    assert len(dev.report(json=True)["vbars"]) == 1
    did = dev.id
    del dev
    gc.collect()
    assert _lib.C.vp_device_close(_lib.vp_device_t(did)) == vpager.EHANDLE


def test_failed_open_leaves_nothing():
    before = gc.collect()
    e = raises(vpager.InvalidArgument, sim, page_size=12345)
    del e
    assert gc.collect() >= 0 and before >= 0      # __del__ did not raise


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
