"""vpager for ComfyUI: a custom-node package in which vpager, not ComfyUI's
per-weight comfy_aimdo cycle, fills, stages and prefetches the weights of
the models ComfyUI's dynamic VRAM loads.

Install: copy or link this folder into ComfyUI's custom_nodes/ (as
custom_nodes/vpager), with vpager importable by ComfyUI's Python. When
ComfyUI loads it, ModelPatcherDynamic (ComfyUI's CoreModelPatcher) is
replaced by VpagerModelPatcher (patcher.py). README.md says what it does,
the flags, and what falls back to ComfyUI's own path.
"""

import logging
import sys
import types

log = logging.getLogger("vpager.comfyui")

try:
    from . import patcher as _patcher
    from . import gguf_patcher as _gguf_patcher
except Exception as e:      # vpager or torch not importable
    _patcher = None
    _IMPORT_ERROR = e
else:
    _IMPORT_ERROR = None

INSTALLED = [None]          # the class installed, once install() ran


def _namespace():
    """The parts of ComfyUI the patcher uses."""
    import comfy.cli_args
    import comfy.lora
    import comfy.model_management
    import comfy.model_patcher
    import comfy.utils
    try:
        import comfy_aimdo.model_vbar as model_vbar
    except Exception:       # pragma: no cover - ComfyUI always has it
        model_vbar = None
    try:                    # its wrappers: a sampling's end (_sampled)
        import comfy.patcher_extension as patcher_extension
    except ImportError:     # pragma: no cover - an older ComfyUI
        patcher_extension = None
    return types.SimpleNamespace(
        model_patcher=comfy.model_patcher,
        model_management=comfy.model_management,
        utils=comfy.utils, lora=comfy.lora, args=comfy.cli_args.args,
        model_vbar=model_vbar, patcher_extension=patcher_extension)


def install(comfy=None):
    """Make ComfyUI's dynamic VRAM models page through vpager: its
    CoreModelPatcher (ModelPatcherDynamic once main.py found a working
    comfy_aimdo) becomes VpagerModelPatcher. Returns the class, or None
    (with one log line saying why) when the node stays off: VPAGER_COMFYUI=0,
    --disable-dynamic-vram or anything else that keeps ComfyUI on its
    legacy ModelPatcher, vpager not importable or its library missing."""
    if INSTALLED[0] is not None:
        return INSTALLED[0]
    if _patcher is None:
        log.warning("vpager: the ComfyUI node is off: %s", _IMPORT_ERROR)
        return None
    if _patcher.env_off():
        log.info("vpager: the ComfyUI node is off (%s=0)", _patcher.ENV)
        return None
    comfy = comfy or _namespace()
    mp = comfy.model_patcher
    if getattr(comfy.args, "disable_dynamic_vram", False):
        log.info("vpager: the ComfyUI node is off: --disable-dynamic-vram")
        return None
    base = mp.CoreModelPatcher
    dynamic = getattr(mp, "ModelPatcherDynamic", None)
    if dynamic is None or not (isinstance(base, type)
                               and issubclass(base, dynamic)):
        log.info("vpager: the ComfyUI node is off: ComfyUI's dynamic VRAM is "
                 "not on (--disable-dynamic-vram, --highvram, --gpu-only, "
                 "--novram, --cpu, or no working comfy_aimdo)")
        return None
    try:
        import vpager
        vpager.library_path()           # loads libvpager, or says why not
    except Exception as e:
        log.warning("vpager: the ComfyUI node is off: libvpager: %s", e)
        return None
    cls = _patcher.make_class(comfy, base)
    # ComfyUI-GGUF's models, whose loader clones them into its own
    # patcher class: that clone hands back the node's subclass of it.
    cls._adopt = _gguf_patcher.Adopter(comfy)
    mp.CoreModelPatcher = cls
    INSTALLED[0] = cls
    r = getattr(comfy.args, "reserve_vram", None)
    log.info("vpager: ComfyUI's dynamic VRAM models page through vpager "
             "(%s, headroom %s%s)",
             "weights and activations within the device's total less "
             "--reserve-vram %.2f GB" % r if r is not None else "no budget",
             _patcher.headroom_text(comfy.args),
             ", file sources (--fast-disk)"
             if getattr(comfy.args, "fast_disk", False) else "")
    return cls


class VpagerSettings:
    """A node: the model, with vpager's path on or off for it (off: this
    model goes ComfyUI's own dynamic way; the environment variable
    VPAGER_COMFYUI=0 turns the node off for every model)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "enabled": ("BOOLEAN", {"default": True})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"
    CATEGORY = "advanced/model"
    DESCRIPTION = ("vpager pages this model's weights (on) or ComfyUI's own "
                   "dynamic VRAM does (off).")

    def apply(self, model, enabled=True):
        m = model.clone()
        m.model_options[_patcher.OPTION if _patcher else "vpager"] = \
            bool(enabled)
        return (m,)


NODE_CLASS_MAPPINGS = {"VpagerSettings": VpagerSettings}
NODE_DISPLAY_NAME_MAPPINGS = {"VpagerSettings": "vpager settings"}
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "install"]

def _autoinstall_off():
    """VPAGER_COMFYUI_NO_AUTOINSTALL=1 (vpager.env; without vpager the
    node installs nothing anyway)."""
    try:
        from vpager import env
    except ImportError:
        return False
    return env.flag("VPAGER_COMFYUI_NO_AUTOINSTALL", False)


# Loaded by ComfyUI (which imported comfy.model_patcher long before its
# custom nodes): install now. Imported elsewhere (tests): install() is
# called by hand.
if "comfy.model_patcher" in sys.modules and \
        not _autoinstall_off():
    try:
        install()
    except Exception as e:  # never take ComfyUI down with the node
        log.warning("vpager: the ComfyUI node is off: %s: %s",
                    type(e).__name__, e)
