"""The first forward's work with its cold start taken out, for the plan
made from it (tuner.py, VPAGER_COLD_WORK).

A model's first forward runs cold: each new GEMM shape's heuristics, the
first attention kernel, the allocator growing. Those costs fall on the
first call of each kind of unit; a model repeats its blocks, so the same
unit of every other block runs warm. The H100's per-unit log
(bench/RESULTS.md, twenty-ninth session: the node's Flux 9.4 GiB, 138
units) shows it: the cold forward's 430-562 ms of unit work against 79-80
warm, yet the median unit cold / warm is 1.02; the excess lies on the
units the model has one of (img_in 160 ms against 0.7 warm, txt_in 80
against 1.1, the time embedding, the final layer) and on block 0's.

So each unit's work is taken as at most the median of its kind (the
units whose names match but for their numbers, double_blocks.3.img_attn
.qkv and double_blocks.5.img_attn.qkv, and whose weights have the same
shapes), and a unit of a kind of fewer than MIN_KIND as at most the
largest of those medians. Replanned offline from those logs, the plan
made from the cold forward so taken is predicted within 0.4% of the
settled one under the warm work (1.044-1.085 x with the medians alone,
where the singletons' 300 ms made every resident set look hidden). A
model with no kind of MIN_KIND units keeps its work as measured."""

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
    (kinds of MIN_KIND units or more), and each of the other units' at
    most the largest of those medians."""
    kinds = {}
    for u in work:
        kinds.setdefault(kind(u), []).append(u)
    out = dict(work)
    medians = []
    for units in kinds.values():
        if len(units) < MIN_KIND:
            continue
        mid = statistics.median(work[u] for u in units)
        medians.append(mid)
        for u in units:
            out[u] = min(work[u], mid)
    if medians:
        top = max(medians)
        for units in kinds.values():
            if len(units) < MIN_KIND:
                for u in units:
                    out[u] = min(work[u], top)
    return out
