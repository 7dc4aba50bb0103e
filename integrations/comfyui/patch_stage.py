"""A weight's patch set staged on the device: a streamed weight's
(PatchStage), and one its op applies at each use (CarriedPatches).

A weight patched at fill (engine.Pager.set_patched with a fill) runs
ComfyUI's patch math each time its bytes come from their source: once per
patch set when it stays resident, at every step when it streams. That math
copies each patch tensor (a LoRA's up and down) from the host where ComfyUI
loaded it, a pageable copy: the host waits until the copy ran in stream
order, so the forward's launches stop behind every patched unit until the
GPU drained. From a weight's second fill of one patch set (it streams, or
it was evicted and came back: likely to be again) its patch tensors are
copied to the device once, and its later fills compute from those. They
are torch's memory: the device's Governor counts them as torch's (the
weights' room shrinks by them), and they go when the patch set changes or
the model is unloaded (the engine drops the stage).

Imports nothing of ComfyUI: a patch set is ComfyUI's list of tuples whose
tensors, tuples, lists and weight adapters (an object with `loaded_keys`
and a tuple `weights`, rebuilt as type(a)(loaded_keys, weights)) are
copied; anything else is kept as it is."""

import logging

import torch

log = logging.getLogger("vpager.comfyui")


def on_device(value, device):
    """value (a patch set or part of one) with its tensors on `device`;
    (copy, bytes copied)."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value, 0
        out = value.to(device)
        return out, out.numel() * out.element_size()
    if isinstance(value, (tuple, list)):
        items, n = [], 0
        for v in value:
            c, b = on_device(v, device)
            items.append(c)
            n += b
        return (tuple(items) if isinstance(value, tuple) else items), n
    weights = getattr(value, "weights", None)
    if isinstance(weights, tuple) and hasattr(value, "loaded_keys"):
        w, n = on_device(weights, device)
        return (type(value)(value.loaded_keys, w) if n else value), n
    return value, 0


class PatchStage:
    """One weight's patch set, for its fills: the host one (ComfyUI's)
    until its second fill, then its copy on the device (bytes: its size)."""

    __slots__ = ("fills", "staged", "bytes", "failed")

    def __init__(self):
        self.fills = 0
        self.staged = None
        self.bytes = 0
        self.failed = False

    def patches(self, patches, device):
        """The patch set this fill is to compute from: `patches` (ComfyUI's,
        checked to be the one the weight was loaded with) or its copy on
        `device`. A copy that fails (out of memory, an adapter that cannot
        be rebuilt) leaves the fills on the host's, said once."""
        self.fills += 1
        if self.staged is None and self.fills >= 2 and not self.failed:
            try:
                self.staged, self.bytes = on_device(patches, device)
            except Exception as x:   # the host's patches still compute it
                self.failed = True
                log.warning("vpager: a patch set stays on the host (its "
                            "copy to %s failed: %s); its weight's fills "
                            "wait for a host copy each", device, x)
        return self.staged if self.staged is not None else patches


class CarriedPatches:
    """A patch set that a weight's op applies at each use (ComfyUI-GGUF's
    quantized weights carry theirs on the tensor; its op copies each patch
    tensor to the weight's device at every use, from the host: the same
    pageable copies PatchStage spares the fills). Copied to `device` at
    once, resident or streamed alike, and placed where the op reads it
    (place(patch set)); drop() places the host's again. A copy that fails
    leaves the host's, said once."""

    __slots__ = ("host", "place", "bytes")

    def __init__(self, host, place, device):
        self.host = host
        self.place = place
        self.bytes = 0
        try:
            staged, self.bytes = on_device(host, device)
        except Exception as x:      # the host's patches still compute it
            log.warning("vpager: a patch set stays on the host (its copy "
                        "to %s failed: %s); its op copies it at each use",
                        device, x)
            staged = host
        place(staged)

    def drop(self):
        """The host's patch set placed again; returns the bytes let go."""
        n, self.bytes = self.bytes, 0
        if n:
            self.place(self.host)
        return n
