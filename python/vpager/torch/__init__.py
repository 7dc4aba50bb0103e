"""vpager.torch: run a PyTorch module whose weights vpager pages in.

    import vpager.torch
    h = vpager.torch.offload(model, budget="20G")   # CUDA when torch has it
    y = model(x)                     # as before; weights stream as needed
    print(h.stats()["model"]["hits"], h.residency())
    h.unload()                       # parameters are ordinary tensors again

    # Or with the weights straight from a file, the model never in memory:
    model = build_model(device="meta")       # shapes only
    h = vpager.torch.offload(model, budget="20G",
                             weights_from="model.safetensors")

The manual (what offload() does, placement order, safetensors files,
devices and budget, activations first, the limits) is python/README.md.
The public surface is __all__; the modules of the package, one concept
each:

    api        offload(), load_safetensors(): arguments and the Plan
    handle     Offloaded, the handle, built from the collaborators below
    devices    the torch device, the vpager.Device and its staging ring,
               open_device(), activation headroom
    units      units and entries: what gets managed, checked
    sources    host copies (HostBuf) and file sources; meta placeholders
    files      a module's state_dict against a safetensors file
    layout     the VBAR, its weights and per-unit batches
    placement  offsets in the VBAR, interleaved-order groups
    replace    re-placement in execution order after the first forward
    hotpath    the wrapped forward: acquire/release, OOM retry, autograd
               aliasing, buffer write-back
    views      tensors over device and host addresses
"""

from .api import load_safetensors, offload
from .devices import open_device
from .devices import resolve_target as _resolve_target  # noqa: F401 (tests)
from .devices import torch_reserved as _torch_reserved  # noqa: F401 (seam)
from .handle import Offloaded
from .placement import ALIGN
from .units import FUSED
from .views import view

# The old module names vpager._views and vpager._torch_placement
# (comfy_aimdo, bench/ and the tests import them) are bound to vpager too.
from .. import _torch_placement, _views  # noqa: E402,F401

__all__ = ["offload", "open_device", "load_safetensors", "Offloaded", "view",
           "ALIGN", "FUSED"]
