"""The old name of vpager.torch.placement (bench/placement_padding.py and
the tests import it)."""

from .torch.placement import GROUPS as _GROUPS
from .torch.placement import group_room, groups, place, round_up

__all__ = ["place", "groups", "group_room", "round_up", "_GROUPS"]
