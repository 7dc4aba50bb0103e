"""comfy_aimdo on vpager: the comfy_aimdo Python interface (as ComfyUI
uses it) implemented on vpager, so clients of the original run unmodified.

Opt-in: installed on its own from python/compat/. Submodules: control,
model_vbar, torch, host_buffer, vram_buffer, model_mmap, malloc_graph,
storage. Importing any of them loads nothing; control.init() loads vpager.
The torch-free submodules are imported here; comfy_aimdo.torch (which
imports torch) only on first use.
"""

import importlib

from . import control, host_buffer, malloc_graph, model_mmap, model_vbar, \
    storage, vram_buffer

__version__ = "0.5.5+vpager"
IMPLEMENTATION = "vpager"

__all__ = ["control", "model_vbar", "torch", "host_buffer", "vram_buffer",
           "model_mmap", "malloc_graph", "storage"]


def __getattr__(name):
    if name == "torch":
        return importlib.import_module(__name__ + ".torch")
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
