"""vpager.SafeTensors: safetensors files through vp_st_*."""

import ctypes
import os
from collections import namedtuple

from . import _lib
from ._handle import Handle
from ._lib import C, vp_source_t, vp_st_t, vp_st_tensor_t
from .errors import InvalidArgument, check
from .weights import Source

__all__ = ["SafeTensors", "TensorInfo"]

_byref = ctypes.byref

TensorInfo = namedtuple("TensorInfo", "index name dtype shape offset size")
TensorInfo.__doc__ = ("vp_st_tensor_t: name, dtype (\"F16\", ...), shape "
                      "(a tuple), offset (absolute file offset of the data) "
                      "and size (bytes), plus its index in the file.")


class SafeTensors(Handle):
    """vp_st_open(device, path): a validated safetensors file. Tensors are
    in file order (of their data offsets); len(), [i] and iteration give
    TensorInfo; find(name) gives an index."""

    _kind = "safetensors"

    def __init__(self, device, path):
        h = vp_st_t()
        check(C.vp_st_open(device._handle(), os.fsencode(path), _byref(h)))
        self._init_handle(h, device)
        self.device = device
        self.path = os.fspath(path)

    def _free(self):
        check(C.vp_st_close(self._h))

    def count(self):
        n = ctypes.c_size_t()
        check(C.vp_st_count(self._handle(), _byref(n)))
        return n.value

    __len__ = count

    def tensor(self, index):
        """vp_st_tensor() as a TensorInfo."""
        t = vp_st_tensor_t()
        check(C.vp_st_tensor(self._handle(), index, _byref(t)))
        return TensorInfo(index, t.name.decode(), t.dtype.decode(),
                          tuple(t.shape[:t.ndim]), t.offset, t.size)

    def __getitem__(self, index):
        if isinstance(index, str):
            return self.tensor(self.find(index))
        n = self.count()
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("tensor index out of range")
        return self.tensor(index)

    def __iter__(self):
        return (self.tensor(i) for i in range(self.count()))

    def tensors(self):
        return list(self)

    def find(self, name):
        """vp_st_find(): the index of tensor `name` (InvalidArgument if the
        file has none of that name)."""
        index = ctypes.c_size_t()
        check(C.vp_st_find(self._handle(), name.encode(), _byref(index)))
        return index.value

    def __contains__(self, name):
        try:
            self.find(name)
        except InvalidArgument:
            return False
        return True

    def source(self, index):
        """vp_st_source(): a FILE Source for tensor `index`. The file stays
        open until this SafeTensors is closed; the Source holds it."""
        s = vp_source_t()
        check(C.vp_st_source(self._handle(), index, _byref(s)))
        return Source(s.kind, None, s.fd, s.file_offset, keep=self)

    def load(self, indices, vbar, offsets, stream=0):
        """vp_st_load(): load tensors straight into VBAR offsets. True when
        loaded, False on VP_MISS (the ranges cannot all be made resident);
        errors raise."""
        indices = list(indices)
        offsets = list(offsets)
        n = len(indices)
        if len(offsets) != n:
            raise InvalidArgument(_lib.VP_EINVAL, "VP_EINVAL", "vp_st_load: "
                                  "%d indices but %d offsets"
                                  % (n, len(offsets)))
        c_idx = (ctypes.c_size_t * n)(*indices)
        c_off = (ctypes.c_uint64 * n)(*offsets)
        rc = C.vp_st_load(self._handle(), n, c_idx, vbar._handle(), c_off,
                          stream)
        if rc == _lib.VP_MISS:
            return False
        check(rc)
        return True

    def mmap(self):
        """vp_st_mmap(): (address, size) of the whole file mapped read-only
        (valid until close)."""
        base = ctypes.c_void_p()
        size = ctypes.c_uint64()
        check(C.vp_st_mmap(self._handle(), _byref(base), _byref(size)))
        return base.value or 0, size.value

    def buffer(self):
        """A read-only memoryview of the mapped file (vp_st_mmap). Invalid
        once this SafeTensors is closed."""
        base, size = self.mmap()
        arr = (ctypes.c_char * size).from_address(base)
        arr._vpager_owner = self
        return memoryview(arr).cast("B").toreadonly()

    def drop_pages(self):
        """vp_st_drop_pages(): drop the file's pages from memory."""
        check(C.vp_st_drop_pages(self._handle()))
