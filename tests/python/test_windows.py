"""The Python side on Windows, pretended on Linux (issue 30; docs/windows.md).

Each test runs a child Python that imports the platform's own modules
(and torch, when there is one) as they are, then makes the interpreter
look like Windows' to what is imported after: the POSIX-only modules
cannot be imported (sys.modules[name] = None), os lacks its POSIX-only
functions, ctypes.CDLL(None) (no process-wide libc handle there) raises,
/proc and /sys do not exist (and each attempt to open them is noted),
and sys.platform is "win32". Then it imports vpager, vpager.torch, the
ComfyUI node (integrations/comfyui) and the drop-in (python/compat's
comfy_aimdo) and says which library the binding chose; where one loads,
the drop-in's host buffer and model mapping run on it.

    make && PYTHONPATH=python:integrations:python/compat \\
        python3 tests/python/test_windows.py

torch is optional: without it the torch-only modules are left out.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("python")

import vpager  # noqa: E402
from vpager import _lib  # noqa: E402

from _runner import raises, skip  # noqa: E402,F401

# Modules Windows' Python does not have.
POSIX_MODULES = ("fcntl", "resource", "posix", "pwd", "grp", "termios",
                 "tty", "pty", "syslog", "_posixsubprocess", "_posixshmem",
                 "crypt", "spwd", "nis", "readline")
# Functions of os that Windows' os lacks.
POSIX_OS = ("sysconf", "sysconf_names", "uname", "getuid", "geteuid",
            "getgid", "fork", "pread", "pwrite", "preadv", "pwritev",
            "readv", "writev", "posix_fadvise", "posix_fallocate",
            "sched_getaffinity", "getloadavg", "statvfs", "fstatvfs",
            "register_at_fork", "O_DIRECT", "O_CLOEXEC", "mkfifo")

CHILD = r'''
import builtins, json, os, sys
args = json.loads(sys.argv[1])
# The platform's own modules first, as they are (not ours to check).
import ctypes, ctypes.util, mmap, logging, threading, weakref, time, stat
import errno, array, itertools, contextlib, dataclasses, typing, bisect
import importlib, importlib.util, gc, numbers, math, operator, types
import warnings, concurrent.futures, struct, collections, functools
import pickle, signal, tempfile, subprocess, inspect, copy, enum, uuid
try:
    import torch, torch.nn, torch.nn.functional, torch.utils.hooks
except ImportError:
    torch = None
for name in args["modules"]:
    sys.modules[name] = None
for name in args["os"]:
    if hasattr(os, name):
        delattr(os, name)
_cdll_init = ctypes.CDLL.__init__
def _cdll(self, name, *a, **kw):
    if name is None:
        raise TypeError("CDLL(None): no process-wide handle on Windows")
    _cdll_init(self, name, *a, **kw)
ctypes.CDLL.__init__ = _cdll
opens = []
_open = builtins.open
def _no_proc(path, *a, **kw):
    if isinstance(path, str) and path.startswith(("/proc/", "/sys/")):
        opens.append(path)
        raise FileNotFoundError(2, "No such file or directory", path)
    return _open(path, *a, **kw)
builtins.open = _no_proc
sys.platform = "win32"
# Windows' msvcrt: an fd's HANDLE (the library's vp_file_descriptor takes
# an fd for one here, as it does off Windows).
sys.modules["msvcrt"] = types.SimpleNamespace(get_osfhandle=lambda fd: fd)
try:
    import fcntl
except ImportError:
    pass
else:
    raise AssertionError("fcntl is still importable")

names = ["vpager", "vpager.governor", "vpager.ledger", "vpager._sysmem",
         "comfy_aimdo", "comfy_aimdo.control", "comfy_aimdo.model_vbar",
         "comfy_aimdo.host_buffer", "comfy_aimdo.vram_buffer",
         "comfy_aimdo.model_mmap", "comfy_aimdo.malloc_graph",
         "comfy_aimdo.storage"]
if torch is not None:
    names += ["vpager.torch", "vpager.torch.ledger", "comfyui",
              "comfyui.patcher", "comfyui.engine", "comfy_aimdo.torch"]
for name in names:
    importlib.import_module(name)
out = {"imported": names, "torch": torch is not None,
       "opens_at_import": list(opens)}
if torch is not None:
    import comfyui
    out["node_error"] = repr(comfyui._IMPORT_ERROR) \
        if comfyui._IMPORT_ERROR is not None else None

import vpager
from vpager import _lib, _sysmem
out["name"] = _lib.library_name()
out["candidates"] = _lib._candidates()
out["ram"] = [_sysmem.ram_available(), _sysmem.cgroup_room(),
              _sysmem.ram_total()]
try:
    out["loaded"] = vpager.library_path()
    out["log_level"] = vpager.get_log_level()
    out["host_memory"] = vpager.host_memory()
    if torch is not None:       # the library's figure, off Linux
        from vpager.torch import hostpolicy
        out["policy_ram"] = hostpolicy.ram_available()
except vpager.LibraryError as e:
    out["error"] = str(e)
# The drop-in's host buffer and model mapping through the library: no
# libc, no os.pread here.
from comfy_aimdo import _hostio, host_buffer, model_mmap
try:
    hb = host_buffer.HostBuffer(0, 0, 0)
    p = hb.extend(3 << 20, register=False)
    ctypes.memset(p, 7, 3 << 20)
    hb.truncate(1 << 20)
    ok = ctypes.string_at(p, 1 << 20) == b"\x07" * (1 << 20)
    hb.close()
    path = os.path.join(tempfile.mkdtemp(), "m.bin")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * 400)
    mm = model_mmap.ModelMMAP(path)
    ok = ok and ctypes.string_at(mm.get(), 102400) == bytes(range(256)) * 400
    buf = ctypes.create_string_buffer(50000)
    _hostio.pread_par(mm.get_file_handle(), ctypes.addressof(buf), 50000, 256)
    mm.bounce()
    ok = ok and buf.raw == (bytes(range(256)) * 400)[256:50256]
    mm.close()
    out["drop_in"] = "ok" if ok else "wrong bytes"
except Exception as e:
    out["drop_in"] = "%s: %s" % (type(e).__name__, e)
out["opens"] = opens
print("RESULT " + json.dumps(out))
'''


def run_child(pythonpath, library=None):
    """The child's RESULT: a dict (the module doc says what it does)."""
    env = dict(os.environ)
    env.pop("VPAGER_LIBRARY", None)
    if library is not None:
        env["VPAGER_LIBRARY"] = library
    ours = [os.path.join(REPO, p) for p in ("python", "integrations",
                                            "python/compat")]
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + given + ours)
    args = json.dumps({"modules": POSIX_MODULES, "os": POSIX_OS})
    p = subprocess.run([sys.executable, "-c", CHILD, args], env=env,
                       cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, universal_newlines=True,
                       timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def check_imports(out):
    """Everything imported, nothing of /proc or /sys read at import; the
    node imported its patcher (not off for an import error)."""
    assert out["opens_at_import"] == [], out["opens_at_import"]
    if out["torch"]:
        assert out["node_error"] is None, out["node_error"]
    assert out["name"] == "vpager.dll"
    assert out["ram"][:2] == [None, 0]      # unknown off Linux
    # The drop-in's host memory works where the library loads.
    if "loaded" in out:
        assert out["drop_in"] == "ok", out["drop_in"]
    else:
        assert "vpager.dll not found" in out["drop_in"], out["drop_in"]
    assert out["opens"] == [], out["opens"]


def test_library_from_VPAGER_LIBRARY():
    """VPAGER_LIBRARY is the one candidate when set; a file that does not
    load, or none there, is an error naming VPAGER_LIBRARY and the path."""
    tmp = tempfile.mkdtemp(prefix="vpager-win-")
    try:
        fake = os.path.join(tmp, "vpager.dll")
        with open(fake, "wb") as f:
            f.write(b"MZ not a library")
        out = run_child([], library=fake)
        check_imports(out)
        assert out["candidates"] == [["VPAGER_LIBRARY", fake]], out
        assert "loaded" not in out
        assert "vpager.dll not found" in out["error"], out["error"]
        assert "%s (VPAGER_LIBRARY: " % fake in out["error"], out["error"]
        assert "set VPAGER_LIBRARY to the path of a vpager.dll" in \
            out["error"]
        gone = os.path.join(tmp, "nothing", "vpager.dll")
        out = run_child([], library=gone)
        assert "%s (VPAGER_LIBRARY: not there)" % gone in out["error"], out
    finally:
        shutil.rmtree(tmp)


def test_library_next_to_the_package():
    """Without VPAGER_LIBRARY: vpager.dll inside the package is found and
    loaded (here the built library, copied under that name into a copy of
    the package)."""
    built = _lib.library_path()
    tmp = tempfile.mkdtemp(prefix="vpager-win-")
    try:
        pkg = os.path.join(tmp, "vpager")
        shutil.copytree(os.path.join(REPO, "python", "vpager"), pkg,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        shutil.copy2(built, os.path.join(pkg, "vpager.dll"))
        out = run_child([tmp])
        check_imports(out)
        dll = os.path.join(pkg, "vpager.dll")
        assert out["candidates"] == [["package", dll]], out["candidates"]
        assert out["loaded"] == dll, out      # and it answers:
        assert out["log_level"] == vpager.get_log_level()
        # RAM from the library where _sysmem reads nothing (Windows).
        assert out["host_memory"]["total"] > 0, out["host_memory"]
        if out["torch"]:
            assert out["policy_ram"] > 0, out["policy_ram"]
    finally:
        shutil.rmtree(tmp)


def test_library_in_the_tree():
    """From the repository: the package's vpager.dll, then build/vpager.dll;
    neither there: one error naming both and VPAGER_LIBRARY."""
    if os.path.exists(os.path.join(REPO, "python", "vpager", "vpager.dll")) \
            or os.path.exists(os.path.join(REPO, "build", "vpager.dll")):
        skip("a vpager.dll lies in the tree")
    out = run_child([])
    check_imports(out)
    pkg = os.path.join(REPO, "python", "vpager", "vpager.dll")
    tree = os.path.join(REPO, "build", "vpager.dll")
    assert out["candidates"] == [["package", pkg], ["tree", tree]], out
    assert "%s (package: not there); %s (tree: not there)" % (pkg, tree) \
        in out["error"], out["error"]
    assert "VPAGER_LIBRARY" in out["error"]


def test_library_name_here():
    assert _lib.library_name() == ("vpager.dll" if sys.platform == "win32"
                                   else "libvpager.so")


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
