"""offload() and load_safetensors(): the arguments checked
(config.OffloadConfig), the module examined before anything changes
(plan.Plan), then the handle built (handle.Offloaded)."""

from typing import Any, Callable, Optional, Union

import torch

from ..device import Device
from .config import OffloadConfig, Size, warn_budget_over, warn_once
from .devices import note_simulated
from .handle import Offloaded
from .placement import ALIGN
from .plan import Plan
from .sources import put_back, unmeta


def _warn_after(h, plan):
    """What offload() did that the user may not expect, said once."""
    settings = plan.settings
    warn_budget_over(h.device, settings.budget, "offload")
    if plan.module.training and torch.is_grad_enabled() and \
            any(e.requires_grad for e in plan.entries):
        warn_once("requires_grad",
                  "vpager.torch.offload: the %s is in training mode, but its "
                  "offloaded parameters no longer require grad (vpager "
                  "pages weights for inference; unload() restores "
                  "requires_grad): a backward through them fails with "
                  "\"element 0 of tensors does not require grad\". Call "
                  ".eval() before offload() for inference"
                  % type(plan.module).__name__)


def _which_device(device, dev, options):
    """(dev, device): a vpager.Device passed as device= is dev=."""
    if isinstance(device, Device):
        if dev is not None and dev is not device:
            raise ValueError("vpager.torch.offload: two different "
                             "vpager.Device objects given")
        dev, device = device, None
    if dev is not None and options:
        raise TypeError("vpager.torch.offload: options (%s) apply only to a "
                        "device offload() opens, not to dev="
                        % ", ".join(sorted(options)))
    return dev, device


def offload(module: torch.nn.Module, device: Any = None, budget: Size = None,
            lookahead: Size = None, order: Optional[str] = None,
            dev: Optional[Device] = None, units: Any = None,
            align: int = ALIGN, weights_from: Optional[str] = None,
            reorder: bool = True, tensors: Optional[Callable] = None,
            sources: Optional[Callable] = None, outside: str = "placeholder",
            root: Optional[torch.nn.Module] = None,
            schedule: Optional[bool] = None,
            **options: Union[int, str]) -> Offloaded:
    """Page `module`'s weights through vpager; returns an Offloaded handle.

    device: where it computes ("cuda", "cuda:N", N, or "cpu"/"sim" for the
        simulated device); default: a CUDA module stays on its GPU, a CPU
        one goes to CUDA when torch has it, else to the simulated device
        (with a warning, once per process). A vpager.Device may be passed
        here too (same as dev=).
    budget: bytes of device memory vpager may use: an int, or a string
        ("20G" or "20GiB": 20 * 2**30; "20GB": 20 * 10**9). It must hold
        the staging ring, which must hold the largest unit's weights:
        ValueError, naming that unit, if not. Without a budget the ring is
        sized to what the device can give.
    lookahead: bytes prefetched past each acquire (vp_device_set_lookahead;
        default for a device offload() opens: the staging ring's size,
        unless VPAGER_LOOKAHEAD is set).
    order: the VBAR's eviction order: "interleaved" (the default unless
        VPAGER_ORDER or the evict_order option says otherwise: the weights
        that do not fit are spread through the model, so their copies
        overlap the resident weights' compute) or "tail" (the last weights
        are the ones streamed).
    dev: a vpager.Device to use (from open_device(), shared with other
        models); budget and lookahead then change that device.
    units: module types (or a predicate on modules) whose forward reads
        their children's weights directly, so that each is acquired whole
        (added to vpager.torch.FUSED: torch's transformer layers and
        attention).
    weights_from: a safetensors file (keys: the module's state_dict names)
        to take the weights from instead of the module's tensors, which may
        then be on the meta device or uninitialised: parameters are read
        from the file when needed (no host copy), the rest is loaded from
        it now.
    reorder: re-place the weights in the order the first forward uses them
        (default True).
    For a loader that embeds offload() (ComfyUI's node:
    integrations/comfyui/):
    tensors: a predicate (qualified name, tensor) -> bool choosing the
        parameters and buffers vpager manages (default: every parameter
        and floating-point buffer); the others are the caller's and stay
        where they are (not moved to the device).
    sources: a callable (qualified name, tensor) -> vpager.Source or None:
        a weight's bytes come from that source (say a region of a file
        the tensor maps) instead of a host copy; None: a host copy.
    outside: what a managed tensor holds outside its unit's forward:
        "placeholder" (the default: NaN placeholders on the device) or
        "host" (a CPU tensor with its bytes: its host copy, the file
        mapping, or the tensor a source= was given for), for code that
        reads weights outside the forward.
    root: the submodule whose forward is one step of the model (default:
        the module): the first forwards are recorded and measured there.
    schedule: True: the copy schedule (tuner.py) also on a shared device
        (dev=); False: never; None: offload()'s rule.
    options: vp_options_t fields for the device offload opens (page_size,
        staging_size, sim_capacity, ...); not allowed with dev.

    python/README.md has the details and the limits."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError("vpager.torch.offload: a torch.nn.Module, not %s"
                        % type(module).__name__)
    dev, device = _which_device(device, dev, options)
    settings = OffloadConfig.from_arguments(
        budget, lookahead, order, device, options, align, weights_from,
        reorder, units, tensors, sources, outside, root, schedule)
    swapped = unmeta(module) if weights_from is not None else []
    try:
        # vpager's own tensors (host copies, VBAR views, placeholders)
        # are never inference tensors, whatever mode the caller is in:
        # under torch.inference_mode() the host copy's threads could not
        # fill them, nor could a later refill or patch outside it.
        with torch.inference_mode(False):
            plan = Plan(module, dev, settings,
                        {id(d[k]) for d, k, _ in swapped})
            h = Offloaded(plan, dev)
    except BaseException:
        put_back(swapped)
        raise
    if dev is None and plan.target.type == "cpu":
        note_simulated(device)
    _warn_after(h, plan)
    return h


def _handle_of(module):
    """The Offloaded handle of a whole offloaded module."""
    h = None
    for t in list(module.parameters()) + list(module.buffers()):
        h = getattr(t, "_vpager_handle", None)
        if h is not None:
            break
    if h is None:
        raise ValueError("vpager.torch.load_safetensors: %s is not "
                         "offloaded: offload(module, ..., weights_from="
                         "path) pages its weights from the file"
                         % type(module).__name__)
    if h.module is not module:
        raise ValueError("vpager.torch.load_safetensors: this %s is part "
                         "of an offloaded %s: load the whole module's "
                         "file into it" % (type(module).__name__,
                                           type(h.module).__name__))
    return h


def load_safetensors(module_or_handle: Union[torch.nn.Module, Offloaded],
                     path: str) -> Offloaded:
    """Fill an offloaded module's weights from the safetensors file `path`
    (keys: the module's state_dict names); returns its Offloaded handle.
    The parameters' sources become the file (read through vpager's file
    reader when a unit needs them; the host copy is freed), the buffers
    and the tensors vpager does not manage are loaded from it now. Tensors
    missing from the file or the module, or of another dtype or shape:
    ValueError naming them, and nothing changes. To start from a module
    that holds no weights (meta device), use offload(..., weights_from=)."""
    h = module_or_handle
    if not isinstance(h, Offloaded):
        if not isinstance(h, torch.nn.Module):
            raise TypeError("vpager.torch.load_safetensors: an offloaded "
                            "module or its Offloaded handle, not %s"
                            % type(h).__name__)
        h = _handle_of(h)
    return h.load_safetensors(path)
