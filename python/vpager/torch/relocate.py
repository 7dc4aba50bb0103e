"""Weights a new placement moves, their bytes copied on the device from
where they lay (VPAGER_RELOCATE, tuner.py).

A schedule placed anew moves resident weights to close the holes the
others leave; filling them again from the host costs their bytes over
the link (H100, Flux 9.4 GiB at 6 GiB: 2.1 GB, a 200 ms step against a
96 ms one), where a copy inside the device costs a millisecond. The new
placement lies apart from the pages the moved weights occupy
(placement.place_apart), so no copy writes a page another still reads.
Each moved weight (its old pages still resident, pinned while read) is
acquired at its new place as one the caller fills (its source set to
none for that acquire: VP_ACQUIRED_EMPTY), its old bytes copied in on
the acquiring stream, and its source given back as the same bytes
(swap_source: nothing filled again). The highest old places go first:
eviction takes the old pages, ranked last, from the top as the new ones
commit, so a weight not yet copied is rarely evicted first; one that is
(or misses at its new place) is simply filled from its source later."""

import torch

from .. import ACQUIRED_EMPTY, ACQUIRED_RESIDENT
from ..weights import Source, WeightBatch
from . import views


def relocate(layout, entries, old, stream, device):
    """Copy on the device the bytes of entries[i] (placed anew by
    Layout.move) from VBAR offset old[i], where they lay resident; stream:
    vpager's stream of the torch stream the copies run on; device: the
    weights' torch device. Returns the set of the entries copied (their
    bytes valid at their new place); the others fill from their sources."""
    vb = layout.vbar
    base = vb.base
    done = set()
    for i in sorted(range(len(entries)), key=lambda i: -old[i]):
        e = entries[i]
        ok, _ = vb.fault(old[i], e.size, gens=False)
        if not ok:
            continue            # its old pages went: filled from its source
        src = e.src
        try:
            layout.set_source(e, Source.none())
            b = WeightBatch(layout.device, [layout.weight(e)], lookahead=0)
            ptr = b.acquire(stream)[0]
            try:
                if b.flags[0] & ACQUIRED_RESIDENT and \
                        b.flags[0] & ACQUIRED_EMPTY:
                    dst = views.view(ptr, torch.uint8, (e.size,), device)
                    dst.copy_(views.view(base + old[i], torch.uint8,
                                         (e.size,), device))
                    done.add(id(e))
            finally:
                b.release(stream)
        finally:
            vb.unpin(old[i], e.size, stream)
            layout.swap_source(e, src) if id(e) in done else \
                layout.set_source(e, src)
    return done
