"""ComfyUI-GGUF's models (city96/ComfyUI-GGUF): how the node knows them,
and how their patcher becomes the node's.

Its loaders put GGMLTensor weights (torch.Tensor subclasses whose bytes
are the file's quantized blocks, with the attributes tensor_type, the
GGML quantization type, and tensor_shape, the weight's logical shape) in
GGMLOps layers that dequantize them at each use (applying LoRA patches
carried on the tensor), and wrap the model in GGUFModelPatcher, a
ModelPatcher subclass of its own (ComfyUI's legacy loading, not its
dynamic VRAM), by a clone that hands back that class whatever it cloned.
When the node is on, that clone hands back the node's subclass of it
instead (wrap_clone; the class: gguf_patcher), which pages the weights
through vpager and falls back to ComfyUI-GGUF's own path. Where the node
cannot adopt the patcher (a ComfyUI-GGUF without the functions it calls),
the model stays on ComfyUI-GGUF's path with one log line, as does a GGUF
model that reaches the node's plain patcher."""

import sys
from typing import Callable, Dict, List, Optional

import torch

PATCHER = "GGUFModelPatcher"    # ComfyUI-GGUF's ModelPatcher subclass
WHAT = ("the node does not page GGUF weights: they stay on ComfyUI-GGUF's "
        "path")
ADOPTED = "_vpager_adopted"     # on ComfyUI-GGUF's class: the node's subclass


def is_ggml(t: object) -> bool:
    """True for a ComfyUI-GGUF weight: a tensor carrying tensor_type and
    tensor_shape (its GGMLTensor, a torch.Tensor subclass)."""
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and \
        hasattr(t, "tensor_type") and hasattr(t, "tensor_shape")


def qtypes(model: torch.nn.Module) -> Dict[str, int]:
    """{GGML type name: count} over the model's GGMLTensor parameters
    ({} for a model without any)."""
    counts: Dict[str, int] = {}
    for m in model.modules():
        for t in m._parameters.values():
            if t is None or not is_ggml(t):
                continue
            q = getattr(t, "tensor_type", None)
            name = getattr(q, "name", None) or \
                ("unquantized" if q is None else str(q))
            counts[name] = counts.get(name, 0) + 1
    return counts


def _types(counts: Dict[str, int]) -> str:
    return ", ".join("%s x%d" % (k, v) for k, v in
                     sorted(counts.items(), key=lambda kv: -kv[1]))


def refusal(model: torch.nn.Module) -> Optional[str]:
    """Why the node's patcher leaves `model` to ComfyUI's way, when it
    holds ComfyUI-GGUF's weights; else None."""
    counts = qtypes(model)
    if not counts:
        return None
    return "its weights are GGUF (ComfyUI-GGUF's GGMLTensor: %s); %s" % (
        _types(counts), WHAT)


def is_gguf_patcher(patcher: object) -> bool:
    return any(c.__name__ == PATCHER for c in type(patcher).__mro__)


def clone_refusal(patcher: object) -> Optional[str]:
    """For a clone of the node's patcher that is not the node's class
    (ComfyUI-GGUF's loader makes its patcher so): why the model goes
    ComfyUI-GGUF's way, or None when it is no GGUF model."""
    model = getattr(patcher, "model", None)
    counts = qtypes(model) if isinstance(model, torch.nn.Module) else {}
    if not counts and not is_gguf_patcher(patcher):
        return None
    held = " (GGMLTensor weights: %s)" % _types(counts) if counts else ""
    return "ComfyUI-GGUF's %s loads it%s; %s" % (
        type(patcher).__name__, held, WHAT)


def refuse(key: str, p: torch.Tensor) -> Optional[str]:
    """Why GGMLTensor `key` cannot be paged as its stored bytes, or None."""
    if p.device.type == "meta":
        return "%s is on the meta device" % key
    if p.device.type != "cpu":
        return "%s is on %s, not in host memory" % (key, p.device)
    if p.layout != torch.strided or not p.is_contiguous():
        return "%s (a GGMLTensor) is not a dense contiguous tensor" % key
    return None


def loader_patchers(model_patcher: type) -> List[type]:
    """ComfyUI-GGUF's patcher classes among the imported modules: classes
    named GGUFModelPatcher, defined where found, subclassing ComfyUI's
    ModelPatcher and defining their own clone."""
    found = []
    for name, mod in list(sys.modules.items()):
        cls = (getattr(mod, "__dict__", None) or {}).get(PATCHER)
        if isinstance(cls, type) and cls.__module__ == name and \
                issubclass(cls, model_patcher) and "clone" in cls.__dict__:
            found.append(cls)
    return found


def adopted(cls: type) -> bool:
    """True for a ComfyUI-GGUF patcher class whose clones the node adopts."""
    return ADOPTED in cls.__dict__


def wrap_clone(cls: type, make: Callable[[type], type]) -> None:
    """ComfyUI-GGUF's cls.clone() hands back make(cls) (made at its first
    clone; a subclass of cls) where it handed back cls itself. Once per
    class."""
    if adopted(cls):
        return
    clone = cls.__dict__["clone"]
    made: List[type] = []

    def adopting_clone(self, *args, **kwargs):
        n = clone(self, *args, **kwargs)
        if type(n) is cls:
            if not made:
                made.append(make(cls))
            n.__class__ = made[0]
        return n

    adopting_clone.__doc__ = clone.__doc__
    adopting_clone.__wrapped__ = clone
    cls.clone = adopting_clone
    setattr(cls, ADOPTED, made)
