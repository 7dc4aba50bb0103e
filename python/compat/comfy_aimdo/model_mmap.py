"""comfy_aimdo.model_mmap on vpager: a read-only mapping of a whole model
file (vpager.hostspace.map_file; no device involved)."""

import os

from . import _hostio

__all__ = ["ModelMMAP"]


class ModelMMAP:
    def __init__(self, path):
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC",
                                                            0))
        try:
            self.size = os.fstat(self._fd).st_size
            self._base = _hostio.map_file(self._fd, self.size) if self.size \
                else 0
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise

    def get(self):
        """The mapping's base address (0 for an empty file)."""
        self._check()
        return self._base

    def get_file_handle(self):
        """The OS file descriptor (owned by this object)."""
        self._check()
        return self._fd

    def bounce(self):
        """Drop the resident pages: the mapping's and the page cache's.
        Cheap and idempotent; the mapping stays valid (pages come back from
        the file when touched)."""
        self._check()
        if self._base:
            _hostio.drop_resident(self._base, self.size)
        _hostio.drop_cache(self._fd)

    def _check(self):
        if self._fd < 0:
            raise ValueError("ModelMMAP of %s is closed" % self.path)

    def close(self):
        if getattr(self, "_fd", -1) < 0:
            return
        if self._base:
            _hostio.unmap_file(self._base, self.size)
            self._base = 0
        os.close(self._fd)
        self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
