"""Where an offloaded module's weights lie in its VBAR (vpager.torch): in
order, aligned, and for the interleaved eviction order in page-aligned
groups, so that evicting one group leaves its neighbours whole."""

from . import _lib
from .vbar import _order


def round_up(x, a):
    return (x + a - 1) // a * a


def place(entries, align, grouping=None):
    """Offsets of entries laid out in this order, each at an `align`
    boundary; returns (offsets, end). grouping: (page, size) for the
    interleaved order, whose eviction takes whole groups of pages joined
    by weights: once the current group holds `size` bytes, the next entry
    that starts within page/16 of a page boundary (or any, at twice
    `size`) starts a new group at that boundary, so few bytes of VRAM are
    padding and evicting one group leaves its neighbours whole."""
    offsets = []
    off = start = 0
    for e in entries:
        off = round_up(off, align)
        if grouping is not None:
            page, size = grouping
            pad = round_up(off, page) - off
            if off - start >= 2 * size or (off - start >= size and
                                           pad <= page // 16):
                off = start = off + pad
        offsets.append(off)
        off += e.size
    return offsets, off


_GROUPS = 32            # interleaved order: at least this many groups


def groups(dev, order, entries):
    """place()'s grouping for the VBAR's order (None: tail-first)."""
    if order is None:
        order = dev.options["evict_order"]
    if _order(order) != _lib.VP_ORDER_INTERLEAVED:
        return None
    page = dev.page_size
    total = sum(e.size for e in entries)
    # At most half the staging ring: the ring then holds the next streamed
    # group while the current one computes (H200, 32-layer decoder, 0.5 GB
    # groups in a 0.5 GB ring: prefill 114 ms; 0.27 GB groups: 106 ms).
    ring = dev.options["staging_size"]
    return page, max(4 * page, min(total // _GROUPS, ring // 2))


def group_room(grouping, vbar_size):
    """VBAR bytes the group boundaries may add: under a page each, and
    groups start at least `size` (>= 4 pages) apart, so n groups over
    vbar_size + n pages: n <= (vbar_size / size + 1) * 4 / 3."""
    if grouping is None:
        return 0
    page, size = grouping
    return ((vbar_size // size + 1) * 4 // 3 + 1) * page
