#!/usr/bin/env python3
"""How a CUDA driver pins a read-only private file mapping (what comfy_aimdo's
ModelMMAP gives ComfyUI), piece by piece, against anonymous memory: the
evidence behind src/backend/vmm.c asking for no READ_ONLY registration.

    python3 bench/host_register_probe.py FILE     # FILE: >= 1.5 GiB, cached

Run it under `timeout`: on the H200 VM (2026-12-05) the READ_ONLY
registration of 64 MiB did not return. Each line: what was registered,
the flags (1 PORTABLE, 8 READ_ONLY), the result and its time."""

import ctypes
import mmap
import os
import sys
import time

import torch

M = 1 << 20


def main():
    path = sys.argv[1]
    size = os.path.getsize(path)
    if size < 1536 * M:
        raise SystemExit("%s: %d bytes, want 1.5 GiB or more" % (path, size))
    torch.cuda.init()
    rt = torch.cuda.cudart()
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    base = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)

    def reg(addr, n, flags, what):
        t = time.perf_counter()
        r = rt.cudaHostRegister(addr, n, flags)
        dt = time.perf_counter() - t
        print("%-30s %4d MiB flags %d -> %s in %.3f s" % (
            what, n // M, flags, r, dt), flush=True)
        if int(r) == 0:
            rt.cudaHostUnregister(addr)

    reg(base, 64 * M, 1, "file r--p, writable")
    reg(base + 64 * M, 64 * M, 1 | 8, "file r--p, read-only")
    reg(base + 512 * M, 512 * M, 1 | 8, "file r--p, read-only")
    a = torch.empty(512 * M, dtype=torch.uint8)
    a.fill_(1)
    reg(a.data_ptr(), 512 * M, 1, "anonymous touched, writable")


if __name__ == "__main__":
    main()
