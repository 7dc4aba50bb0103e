"""Weights a new placement moves, their bytes copied on the device from
where they lay (VPAGER_RELOCATE, tuner.py).

A schedule placed anew moves resident weights to close the holes the
others leave; filling them again from the host costs their bytes over
the link (H100, Flux 9.4 GiB at 6 GiB: 2.1 GB, a 200 ms step against a
96 ms one), where a copy inside the device costs a millisecond. The new
placement lies apart from the pages the moved weights occupy
(placement.place_apart), so no copy writes a page another still reads.

Two steps around the move (Layout.move). hold(), before it: each moving
weight is acquired where it lies (so its bytes are its source's: a stale
one, a source changed since its fill, is filled there first; a copy in
flight is waited for on the stream) and its pages pinned. copy_in(),
after it: each held weight, the highest old places first (eviction takes
the old pages, ranked last, from the top as the new ones commit), is
acquired at its new place as one the caller fills (its source none for
that acquire: VP_ACQUIRED_EMPTY), its old bytes copied in on the stream,
its old pages let go, and its source given back as the same bytes
(swap_source: nothing filled again). One that misses at its new place
(no room) is filled from its source later."""

import torch

from .. import ACQUIRED_EMPTY, ACQUIRED_RESIDENT
from ..weights import Source, WeightBatch
from . import views


def hold(layout, entries, stream):
    """Before Layout.move: the entries that lie resident, acquired where
    they are on `stream` (filled there if stale) and their pages pinned:
    {id(entry): its offset}. release() lets them go without copying."""
    vb = layout.vbar
    held = {}
    try:
        for e in entries:
            b = WeightBatch(layout.device, [layout.weight(e)], lookahead=0)
            b.acquire(stream)
            try:
                if b.flags[0] & ACQUIRED_RESIDENT and \
                        vb.fault(e.offset, e.size, gens=False)[0]:
                    held[id(e)] = e.offset
            finally:
                b.release(stream)
    except BaseException:
        release(layout, entries, held, stream)
        raise
    return held


def release(layout, entries, held, stream):
    """Unpin what hold() pinned (after a failed move)."""
    for e in entries:
        if id(e) in held:
            layout.vbar.unpin(held[id(e)], e.size, stream)


def copy_in(layout, entries, held, stream, device):
    """After Layout.move: the held entries' bytes copied on the device from
    their old offsets (held) to where they lie now, on `stream` (vpager's
    stream of the torch stream the copies run on; device: the weights'
    torch device). Returns the set of id()s of the entries copied (their
    bytes valid at their new place); the others fill from their sources."""
    vb = layout.vbar
    base = vb.base
    done = set()
    for e in sorted((e for e in entries if id(e) in held),
                    key=lambda e: -held[id(e)]):
        old = held[id(e)]
        src = e.src
        try:
            layout.set_source(e, Source.none())
            if _copy(layout, e, base + old, stream, device):
                done.add(id(e))
        finally:
            vb.unpin(old, e.size, stream)
            if id(e) in done:
                layout.swap_source(e, src)      # the same bytes
            else:
                layout.set_source(e, src)       # filled at its next acquire
    return done


def _copy(layout, e, addr, stream, device):
    """Acquire e (its source none) and, where it lies resident for the
    caller to fill, copy its bytes in from device address `addr` on
    `stream`; True if copied."""
    b = WeightBatch(layout.device, [layout.weight(e)], lookahead=0)
    ptr = b.acquire(stream)[0]
    try:
        if not (b.flags[0] & ACQUIRED_RESIDENT and
                b.flags[0] & ACQUIRED_EMPTY):
            return False        # staged (no room): nothing kept
        views.view(ptr, torch.uint8, (e.size,), device).copy_(
            views.view(addr, torch.uint8, (e.size,), device))
        return True
    finally:
        b.release(stream)
