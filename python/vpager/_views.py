"""The old name of vpager.torch.views (comfy_aimdo imports it)."""

from .torch.views import nbytes, placeholder, view

__all__ = ["view", "placeholder", "nbytes"]
