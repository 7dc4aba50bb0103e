"""The first forward's work with its cold start taken out, for the plan
made from it (tuner.py, VPAGER_COLD_WORK).

A model's first forward runs cold: each new GEMM shape's heuristics, the
first attention kernel, the allocator growing. The H100's Flux 9.4 GiB
under ComfyUI measured 389 ms of unit work in its first forward, 79 ms in
the next, and the plan made from the first placed 2.7 GB of weights that
the settled plan streams (a 163 ms and a 203 ms step where 95 is steady).
Where those costs fall on the first call of each kind of unit (a model
repeats its blocks, so the same unit of every other block ran warm),
each unit's work taken as at most the median of its kind removes them:
the units whose names match but for their numbers
(double_blocks.3.img_attn.qkv and double_blocks.5.img_attn.qkv) and
whose weights have the same shapes. Kinds of fewer than MIN_KIND units
are left as measured. On that H100 the cold start lay on every unit
(3.6 x): the median took 389 ms of work to 283, not to 79."""

import re
import statistics

MIN_KIND = 3
_NUMBER = re.compile(r"\d+")


def kind(unit):
    """Units of one kind do the same work: the name with its numbers
    masked, the module's class, the weights' shapes and dtypes."""
    return (_NUMBER.sub("#", unit.name), type(unit.module).__name__,
            tuple((tuple(e.shape), str(e.dtype)) for e in unit.entries))


def warm_work(work):
    """{unit: seconds} with each unit's at most the median of its kind
    (kinds of MIN_KIND units or more)."""
    kinds = {}
    for u in work:
        kinds.setdefault(kind(u), []).append(u)
    out = dict(work)
    for units in kinds.values():
        if len(units) < MIN_KIND:
            continue
        mid = statistics.median(work[u] for u in units)
        for u in units:
            out[u] = min(work[u], mid)
    return out
