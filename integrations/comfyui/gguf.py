"""ComfyUI-GGUF's models (city96/ComfyUI-GGUF): how the node knows them.

Its loaders put GGMLTensor weights (torch.Tensor subclasses whose bytes
are the file's quantized blocks, with the attributes tensor_type, the
GGML quantization type, and tensor_shape, the weight's logical shape) in
GGMLOps layers that dequantize them at each use (applying LoRA patches
carried on the tensor), and wrap the model in GGUFModelPatcher, a
ModelPatcher subclass of its own: ComfyUI's legacy loading, not its
dynamic VRAM. The node pages neither kind of weight: such a model stays
on ComfyUI-GGUF's own path, and the node says so in one log line, when
ComfyUI-GGUF's loader makes its patcher (a clone of the node's) or when
a GGUF model reaches the node's patcher."""

from typing import Dict, Optional

import torch

PATCHER = "GGUFModelPatcher"    # ComfyUI-GGUF's ModelPatcher subclass
WHAT = ("the node does not page GGUF weights: they stay on ComfyUI-GGUF's "
        "path")


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
