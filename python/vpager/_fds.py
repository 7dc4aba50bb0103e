"""File descriptors handed to the C library: of vpager's own C runtime.

On Windows a process holds several C runtimes, each with its own table of
fds: Python's (the UCRT) is not vpager.dll's, so a Python fd means nothing
there, or another file. NativeFd gives the library an fd of its own for a
Python one (vp_file_descriptor over the fd's HANDLE, a duplicate that is
closed with the NativeFd); elsewhere it is the fd itself."""

import ctypes
import sys
from typing import Any

from ._lib import C
from .errors import check

# Whether fds are translated (Windows); tests set it on other systems.
TRANSLATE = [sys.platform == "win32"]


def os_handle(fd: int) -> int:
    """The OS handle of Python's fd (msvcrt.get_osfhandle)."""
    import msvcrt       # Windows' own module
    return msvcrt.get_osfhandle(fd)


class NativeFd:
    """fd: the library's fd for Python's fd `pyfd`, while this lives (or
    until close())."""

    def __init__(self, pyfd: int):
        self._own = False
        self.fd = pyfd
        if not TRANSLATE[0]:
            return
        out = ctypes.c_int(-1)
        check(C.vp_file_descriptor(os_handle(pyfd), ctypes.byref(out)))
        self.fd, self._own = out.value, True

    def close(self) -> None:
        if self._own:
            self._own = False
            check(C.vp_file_descriptor_close(self.fd))
            self.fd = -1

    def __enter__(self) -> "NativeFd":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:       # pragma: no cover - interpreter teardown
            pass
