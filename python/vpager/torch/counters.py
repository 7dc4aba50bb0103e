"""What Offloaded.stats() and residency() return: one documented shape
(python/README.md, "stats()"), read by dashboards, benches and tests.

    {"model":    this model's counters (its VBAR's) and sizes,
     "device":   the device's counters (every model on it, those gone too),
     "schedule": the copy schedule (Offloaded.schedule()) or None,
     "governor": the device's Governor: its inputs and the settings
                 derived from them (vpager.governor)}

A counter has one meaning wherever its name appears: "fills" under
"model" counts this model's faults that committed pages, under "device"
every VBAR's on the device: every model's, those closed, and the staging
ring's own pages (so "device" fills, faults, pages_committed and
committed_bytes exceed the models' sum by the ring's). Counters only the
device keeps (copies, host memory, the ring's and the streams' waits,
budget polls) are under "device" alone."""

from typing import Any, Dict

from .. import PAGE_PINNED, PAGE_RESIDENT, STAT_NAMES

__all__ = ["DEVICE_ONLY", "MODEL_SIZES", "handle_stats", "residency_map",
           "delta"]

# vp_stats_t counters that a VBAR never counts (0 in vp_vbar_stats).
DEVICE_ONLY = ("budget_polls", "copies", "host_pinned_bytes",
               "machine_pinned_bytes", "pin_fallback_bytes", "ring_waits",
               "sm_copy_bytes", "stream_waits")

# The model's sizes beside its counters, and what each is.
MODEL_SIZES = {
    "weights": "weights vpager manages",
    "weight_bytes": "their bytes",
    "vbar_bytes": "the VBAR's size (weights, alignment, room to re-place)",
    "resident_bytes": "bytes of the VBAR resident on the device now",
    "units": "units (modules acquired as one)",
    "host_bytes": "the pinned host copy's bytes (0: from a file/sources)",
    "file_weights": "weights without a pinned copy of vpager's: a "
                    "file's (in place or read) or a caller's sources=",
    "replaced": "times the weights were re-placed in the order of use",
    "set_sources": "weights whose bytes come from set_source()",
    "kept_fills": "weights with a fill (set_fill) that stream, their "
                  "bytes as it left them kept in a pinned host copy of "
                  "their own (keptfills.py): the fill runs no more",
    "kept_fill_bytes": "those copies' bytes",
    "load_seconds": "offload()'s host copy: host_fill_s, host_alloc_s",
    "host_by_kind": "host bytes of its weights by where they live: \"in "
                    "place\" (the mapped file), \"pinned copy\" (vpager's), "
                    "\"file\" (read from it)",
    "host_policy": "the line offload() logged saying what it chose and why",
    "unheld_forwards": "forwards whose held units (a schedule's) took the "
                       "per-unit path, by why: changed, evicted, failed, "
                       "staged",
}


def handle_stats(handle, layout, gov, lender) -> Dict[str, Any]:
    """stats() of an open Offloaded handle (its Layout, its device's
    Governor and Lender)."""
    model = {k: v for k, v in handle.vbar.stats().items()
             if k not in DEVICE_ONLY}
    entries = layout.entries
    model.update(
        weights=len(entries), weight_bytes=handle.weight_bytes,
        vbar_bytes=handle.vbar.size,
        resident_bytes=handle.vbar.loaded_size(), units=len(layout.units),
        host_bytes=layout.host_bytes,
        file_weights=sum(e.host is None for e in entries),
        replaced=handle.replaced,
        set_sources=sum(e.own is not None and e.kept is None
                        for e in entries),
        kept_fills=sum(e.kept is not None for e in entries),
        kept_fill_bytes=sum(e.size for e in entries if e.kept is not None),
        load_seconds=dict(layout.load_times),
        host_by_kind=(layout.hbytes.by_kind(entries)
                      if layout.hbytes is not None else {}),
        host_policy=layout.hbytes.line if layout.hbytes is not None else "",
        unheld_forwards=dict(handle.hot_path.unheld))
    device = handle.device.stats()
    # CUDA: what the last forward learned torch may still grab (margin
    # included); 0 before a forward and on the simulated device.
    device["activation_headroom"] = gov.learned
    return {"model": model, "device": device,
            "schedule": handle.schedule(), "governor": gov.stats(),
            "lend": lender.stats()}


def residency_map(flags: bytes) -> str:
    """One character a VBAR page: "#" resident, "P" resident and pinned,
    "." not resident (the C demo's map)."""
    return "".join("P" if f & PAGE_PINNED else "#" if f & PAGE_RESIDENT
                   else "." for f in flags)


def delta(after: Dict[str, Any], before: Dict[str, Any],
          section: str = "model") -> Dict[str, int]:
    """The counters of one section ("model" or "device") that changed
    between two stats() dicts: {name: after - before}."""
    a, b = after[section], before[section]
    return {k: a[k] - b[k] for k in STAT_NAMES
            if k in a and k in b and a[k] != b[k]}
