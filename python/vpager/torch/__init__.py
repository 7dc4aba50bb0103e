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
each, by lifetime:

    api        offload(), load_safetensors(): the entry points
    config     offload()'s arguments (OffloadConfig), checked once
    handle     Offloaded: the model's lifecycle (open, unloaded, closed)
  built once, at offload():
    plan       what offload() finds in the module (no device writes)
    units      units and entries: what gets managed, checked
    placement  offsets in the VBAR, interleaved-order groups (pure)
    sources    each weight's host bytes in one place: the file (in place
               or read) or a pinned copy (HostBuf); meta placeholders
    hostpolicy in place or file, from RAM, disk speed and bytes streamed;
               the one line a model saying why
    files      a module's state_dict against a safetensors file
    devices    the torch device, the vpager.Device and its staging ring,
               open_device(), activation headroom
    layout     the VBAR, its weights and per-unit batches
    build      the device and layout for a plan; the parts wired (Parts)
    install    what changes in the module, and back at unload()/close()
  run every forward:
    hotpath    the wrapped forward: acquire/release, OOM retry, autograd
               aliasing, buffer write-back, held units, acquired()
    roothooks  the root's hooks, in one declared order (RootHooks)
    serial     one forward of a model at a time (its lock)
    views      tensors over device and host addresses
  adapted between forwards:
    access     what the parts may ask of the model (ModelAccess,
               Lifecycle): never the handle itself
    replace    re-placement in execution order after the first forward
    tuner      the measured forwards and the schedule applied
    schedule   the copy schedule from measured costs (pure)
    planproc   the planner's process: plans off the forward's GIL
    patches    a weight's bytes from another tensor (set_source)
    ledger     the models in the GPU's shared ledger
  read out:
    counters   stats() and residency()
    progress   the progress shown while offload() copies
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
