"""The node's patcher for ComfyUI-GGUF's models: VpagerGGUFModelPatcher,
the node's VpagerPatcher over ComfyUI-GGUF's own GGUFModelPatcher (what
its loader's clone hands back once gguf.wrap_clone adopted the class).

Paged: each GGMLTensor weight of a ComfyUI op as its stored bytes (the
file's quantized blocks, or its F32/F16 values), the parameter object
kept (its .data points at the VRAM bytes during the op's forward, so its
tensor_type, tensor_shape and patches stay), so ComfyUI-GGUF's ops
dequantize them on the GPU at each use exactly as they do when resident.
LoRA the way ComfyUI-GGUF applies it: a quantized weight carries its
patches, applied by its op at each use (their tensors copied to the
device once, where ComfyUI-GGUF's op would copy them from the host at
each use, whatever its patch_on_device says); an unquantized one is
patched by ComfyUI-GGUF's own patch_weight_to_device over its bytes in
VRAM each time they are filled. Everything else (the fallback included: the
node off, a model vpager refuses) is ComfyUI-GGUF's own legacy path.

ComfyUI treats the model as ComfyUI-GGUF's, not as a dynamic one: before
loading it, it frees room for the whole model from other models."""

import collections
import sys
from typing import Any, Callable, Optional, Tuple

from . import gguf
from .patcher import VpagerPatcher

# ComfyUI's backup record (ModelPatcher.backup's values).
Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


class GGUFPaging:
    """What differs for ComfyUI-GGUF's models (see the module)."""

    _vp_declared = False    # the rest as stored, as its legacy path
    _gguf_move = None       # its move_patch_to_device(patches, device)

    def _vp_why_not(self):
        why = super()._vp_why_not()
        if why is not None:
            return why
        # A patched quantized weight outside the units would be a device
        # copy carrying patches, which no load undoes.
        for key, m, k in self._vp_plan().forced:
            p = m._parameters.get(k)
            if self.patches.get(key) and p is not None and self._ggml(p):
                return ("a patch applies to %s, a quantized GGUF weight "
                        "outside ComfyUI's ops" % key)
        return None

    def _vp_patch(self, pager, e, patches, device_to):
        if not self._ggml(e.param):
            return super()._vp_patch(pager, e, patches, device_to)
        # As ComfyUI-GGUF patches it: the patches on the tensor, moved
        # where patch_on_device says; its op applies them at each use.
        # Then copied to the device whichever it said (its op would copy
        # them from the host at every use: CarriedPatches).
        param, key = e.param, e.key
        if not patches:
            param.patches = []
            pager.carry_patch(key, None)
            return
        where = self.load_device if getattr(self, "patch_on_device", False) \
            else self.offload_device
        pager.carry_patch(key, list(patches),
                          self._gguf_move(list(patches), where),
                          lambda p: setattr(param, "patches", [(p, key)]))

    def _vp_patched(self, key, device_to):
        # ComfyUI-GGUF's own math (float32, then its rounding), written
        # into the parameter's bytes (its tensor is the VRAM view now).
        # A backup in place while it runs: it would copy the weight to
        # the host at every fill (a blocking copy), and the fill's source
        # is the backup already.
        had = key in self.backup
        if not had:
            self.backup[key] = Backup(None, True)
        try:
            self.patch_weight_to_device(key, device_to=device_to,
                                        inplace_update=True)
        finally:
            if not had:
                self.backup.pop(key, None)
        return None

    def _vp_force(self, key, device_to):
        if key in self.patches:     # unquantized (_vp_why_not)
            self.patch_weight_to_device(key, device_to=device_to)
            return
        # .to() as ComfyUI-GGUF's loading moves it (a GGMLTensor keeps
        # its type and attributes), the original kept as the backup.
        o, n = self._comfy.utils.resolve_attr(self.model, key)
        w = getattr(o, n)
        if key not in self.backup:
            self.backup[key] = Backup(w, False)
        self._comfy.utils.set_attr_param(self.model, key, w.to(device_to))


def functions(loader_cls: type) -> Optional[Tuple[Callable, Callable]]:
    """(is_quantized, move_patch_to_device): what the node calls of
    ComfyUI-GGUF, from the module that defines loader_cls; None when it
    lacks them."""
    mod = sys.modules.get(loader_cls.__module__)
    ggml = getattr(mod, "is_quantized", None)
    move = getattr(mod, "move_patch_to_device", None)
    return (ggml, move) if callable(ggml) and callable(move) else None


def make_class(comfy: Any, loader_cls: type) -> type:
    """VpagerGGUFModelPatcher over ComfyUI-GGUF's class loader_cls (whose
    module has functions())."""
    ggml, move = functions(loader_cls)
    dynamic = comfy.model_patcher.ModelPatcherDynamic
    return type("VpagerGGUFModelPatcher",
                (GGUFPaging, VpagerPatcher, loader_cls),
                {"_comfy": comfy, "_base": loader_cls,
                 "_ggml": staticmethod(ggml),
                 "_gguf_move": staticmethod(move),
                 # ComfyUI's, for the backups of a vpager load (the
                 # legacy class restores them in unpatch_model).
                 "restore_loaded_backups": dynamic.restore_loaded_backups,
                 "__module__": __name__,
                 "__qualname__": "VpagerGGUFModelPatcher",
                 "__doc__": __doc__})


class Adopter:
    """VpagerPatcher._adopt: ComfyUI-GGUF's patcher classes, once imported,
    adopted (gguf.wrap_clone) with make_class. Looks again only when
    modules were imported since its last look."""

    def __init__(self, comfy: Any):
        self.comfy = comfy
        self.seen = 0

    def __call__(self) -> None:
        if len(sys.modules) == self.seen:
            return
        self.seen = len(sys.modules)
        for cls in gguf.loader_patchers(self.comfy.model_patcher.ModelPatcher):
            if functions(cls) is not None:
                gguf.wrap_clone(cls, lambda c: make_class(self.comfy, c))
