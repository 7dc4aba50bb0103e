"""Tensors over device addresses vpager hands out (VBAR pages, staging
slots) and over host memory (HostBuf), without copying.

    view(ptr, dtype, shape, device)
    Region(device, reach).view(ptr, dtype, shape)   # cut from one base

On CUDA the tensor is made from an object exposing __cuda_array_interface__
(version 3, no stream: the caller orders work itself); on the CPU (the
simulated device keeps its "device" memory in host memory) it is
torch.frombuffer over a ctypes array at the address. Either way torch does
not own the memory: the tensor is valid exactly as long as vpager keeps the
address mapped and holding these bytes.
"""

import ctypes
from typing import Sequence, Union

import torch

__all__ = ["view", "Region", "placeholder", "nbytes"]

# __cuda_array_interface__ typestrs for an integer of each element size;
# the tensor is then reinterpreted (.view(dtype)), so any dtype works,
# bfloat16 and the float8 types included (they have no typestr).
_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def nbytes(dtype, shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n * _itemsize(dtype)


_ITEMSIZE = {}


def _itemsize(dtype):
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


class _CudaMemory:
    """A minimal __cuda_array_interface__ exporter (torch.as_tensor keeps a
    reference to it for the tensor's life; it owns nothing)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
            "strides": None, "version": 3}


def view(ptr: int, dtype: torch.dtype, shape: Sequence[int],
         device: Union[str, torch.device]) -> torch.Tensor:
    """A contiguous tensor of `dtype` and `shape` over memory at `ptr` on
    `device` (a torch.device: "cuda:N" for a GPU address, "cpu" for a host
    one, such as the simulated device's memory). Not a copy; never frees."""
    device = torch.device(device)
    shape = tuple(int(d) for d in shape)
    size = nbytes(dtype, shape)
    # A view built inside inference_mode would be an inference tensor, and
    # views are cached and reused outside it.
    with torch.inference_mode(False):
        if size == 0:
            return torch.empty(shape, dtype=dtype, device=device)
        if device.type == "cpu":
            arr = (ctypes.c_uint8 * size).from_address(ptr)
            flat = torch.frombuffer(arr, dtype=torch.uint8)
            return flat.view(dtype).view(shape)
        if device.type == "cuda":
            item = _itemsize(dtype)
            if item in _INT_TYPESTR:
                n = size // item
                t = torch.as_tensor(_CudaMemory(ptr, (n,), _INT_TYPESTR[item]),
                                    device=device)
            else:
                t = torch.as_tensor(_CudaMemory(ptr, (size,), "|u1"),
                                    device=device)
            if t.data_ptr() != ptr:
                raise RuntimeError("vpager.torch: torch copied the device "
                                   "memory at 0x%x instead of viewing it "
                                   "(is it on %s?)" % (ptr, device))
            return t.view(dtype).view(shape)
    raise ValueError("vpager.torch: no tensor views on %s devices" % device)


_BASE_ALIGN = 16            # the largest element size (complex128)


class Region:
    """Views into one device range (a VBAR, the staging ring) cut from one
    byte tensor over it: a slice costs a few us where view() builds a
    tensor from an interface (10-30 us; on the node's SDXL, host-bound,
    each forward after a placement made ~700 of them). The base starts at
    the lowest address asked for so far (mapped then: an acquired
    weight's) and reaches reach(ptr), where the range ends; an address
    outside it makes a new base (the views cut before keep theirs). Only
    the bytes of each view are ever touched."""

    __slots__ = ("device", "reach", "base", "lo", "hi")

    def __init__(self, device, reach):
        self.device = torch.device(device)
        self.reach = reach
        self.base = None
        self.lo = self.hi = 0

    def view(self, ptr: int, dtype: torch.dtype,
             shape: Sequence[int]) -> torch.Tensor:
        item, size = _itemsize(dtype), nbytes(dtype, shape)
        if not size or ptr % item:
            return view(ptr, dtype, shape, self.device)
        if self.base is None or not self.lo <= ptr <= self.hi - size:
            # The base aligned for every dtype (a slice's offset from it
            # must be a multiple of its element size; offload(align=) may
            # place weights at any even address), within ptr's own page.
            lo = ptr - ptr % _BASE_ALIGN
            hi = max(int(self.reach(ptr)), ptr + size)
            self.base = view(lo, torch.uint8, (hi - lo,), self.device)
            self.lo, self.hi = lo, hi
        off = ptr - self.lo
        if torch.is_inference_mode_enabled():   # as view(): not an
            with torch.inference_mode(False):   # inference tensor
                return self.base[off:off + size].view(dtype).view(shape)
        return self.base[off:off + size].view(dtype).view(shape)


_PLACEHOLDERS = {}


def placeholder(dtype, shape, device):
    """What a parameter holds while it is not acquired: one element (NaN
    for floating and complex dtypes, else 0) expanded to the parameter's
    shape, so .shape, .dtype, .device and numel() stay right but the
    values are useless (and loudly so for floats) and no memory is held."""
    device = torch.device(device)
    key = (dtype, device)
    base = _PLACEHOLDERS.get(key)
    if base is None:
        with torch.inference_mode(False):
            fill = (float("nan") if dtype.is_floating_point or dtype.is_complex
                    else 0)
            base = torch.full((), fill, dtype=dtype, device=device)
        _PLACEHOLDERS[key] = base
    return base.expand(tuple(shape))
