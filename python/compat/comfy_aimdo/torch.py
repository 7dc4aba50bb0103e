"""comfy_aimdo.torch on vpager: tensors over vpager memory (no copies).

On CUDA a tensor views the device address (__cuda_array_interface__); on
the simulated device (no GPU), whose "device" memory is host memory, the
tensor is a CPU tensor over it. The tensors never own the memory: they are
valid while the range stays pinned (or the buffer alive).
"""

import operator
import warnings

import torch as _torch

from . import control

__all__ = ["get_tensor_from_raw_ptr", "aimdo_to_tensor", "hostbuf_to_tensor",
           "get_torch_allocator"]


def _views():
    from vpager import _views as v
    return v


def _target(device, vpdev=None):
    """Where a tensor over vpager memory lives: the given device, except
    that the simulated device's memory is CPU memory."""
    dev = _torch.device(device) if device is not None else None
    if vpdev is not None and not vpdev.closed and vpdev.backend == "sim":
        return _torch.device("cpu")
    if dev is None:
        return _torch.device("cpu")
    if dev.type == "cuda":
        sim = False
        try:
            sim = control.get_devctx(dev.index or 0).backend == "sim"
        except RuntimeError:
            sim = not _torch.cuda.is_available()
        if sim:
            return _torch.device("cpu")
    return dev


def get_tensor_from_raw_ptr(ptr, size, device):
    """A writable uint8 tensor over [ptr, ptr+size) on `device`."""
    return _views().view(int(ptr), _torch.uint8, (int(size),),
                         _target(device))


def _alloc_device(owner, device):
    """Where a tensor over an allocation of `owner` (a ModelVBAR or a
    VRAMBuffer) lives: the owner's own device, whatever `device` the
    caller names (on two GPUs the caller's argument may be the other one);
    CPU on the simulated device. Objects that do not say their device get
    the caller's."""
    vpdev = getattr(owner, "device", None)
    index = getattr(owner, "device_index", None)
    backend = getattr(vpdev, "backend", None)
    if backend is None or not isinstance(index, int):
        return _target(device)
    if getattr(vpdev, "closed", False):
        raise RuntimeError("aimdo_to_tensor: the allocation's device %d is "
                           "closed (deinit() ran)" % index)
    if backend == "sim":
        return _torch.device("cpu")
    return _torch.device("cuda", index)


def aimdo_to_tensor(alloc, device=None):
    """A writable uint8 tensor over an allocation (vbar, address, size), on
    the allocation's own device (see _alloc_device)."""
    try:
        vbar, address, size = alloc
        address, size = operator.index(address), operator.index(size)
    except (TypeError, ValueError):
        raise TypeError("aimdo_to_tensor: %r is not an allocation (vbar, "
                        "address, size)" % (alloc,)) from None
    if size < 0 or address <= 0:
        raise ValueError("aimdo_to_tensor: [0x%x, +%d) is not device memory"
                         % (address, size))
    return _views().view(address, _torch.uint8, (size,),
                         _alloc_device(vbar, device))


def hostbuf_to_tensor(hostbuf):
    """A uint8 CPU tensor over the buffer's current size."""
    size = hostbuf.size
    if not size:
        return _torch.empty((0,), dtype=_torch.uint8)
    return _views().view(hostbuf.get_raw_address(), _torch.uint8, (size,),
                         "cpu")


def get_torch_allocator():
    """None: vpager does not replace torch's allocator (a warning says so;
    activations keep torch's own allocator, and vpager's budget yields to
    it through the headroom)."""
    warnings.warn("comfy_aimdo (vpager): no torch allocator is provided; "
                  "torch keeps its own", RuntimeWarning, stacklevel=2)
    return None
