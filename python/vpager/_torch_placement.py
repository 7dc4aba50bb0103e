"""The old name of vpager.torch.placement (bench/placement_padding.py
imports it)."""

from .torch.placement import GROUPS as _GROUPS  # noqa: F401
from .torch.placement import group_room, groups, place, round_up  # noqa: F401
