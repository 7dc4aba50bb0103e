"""A weight's bytes taken from another tensor (Offloaded.set_source: the
patched bytes live in a pinned host buffer of the weight's own, e.alt;
e.own keeps the source it had before), or rewritten on the device each
time they are filled from their source (Offloaded.set_fill: a patch
computed at fill, e.fill; no host copy: unless it streams, keptfills.py),
and every weight's own bytes again when a safetensors file replaces them
(load_safetensors)."""

from typing import Any, Callable, Iterable, Optional

import torch

from ..weights import Source
from .keptfills import restore
from .layout import Layout
from .sources import host_memory, outside


def drop_alt(e: Any) -> None:
    """The weight's patch buffer, if any, freed."""
    if e.alt is not None:
        if not e.alt.closed:
            e.alt.close()
        e.alt = None


def _set_fill_of(layout: Layout, e: Any,
                 fill: Optional[Callable[[torch.Tensor], None]]) -> None:
    """e.fill = fill, counting a weight's fill coming or going in
    layout.fill_changes (the tuner keeps weights with a fill resident)."""
    if (fill is None) != (e.fill is None):
        layout.fill_changes += 1
    e.fill = fill


def _repoint(e: Any, t: torch.Tensor) -> None:
    e.ph = t
    e.ph_ptr = t.data_ptr()
    if not e.cur:
        with torch.no_grad(), torch.inference_mode(False):
            e.tensor.data = t


def set_source(layout: Layout, name: str, tensor: Optional[torch.Tensor],
               model: str) -> None:
    """Offloaded.set_source() on the model (`model`: its class name, for
    errors): weight `name` (its qualified name, as layout() gives it)
    takes its bytes from `tensor` from now on: a tensor of its dtype and
    shape (any device), copied once into a pinned host buffer of its own.
    tensor None: its own bytes again (host copy or file). Only that weight
    is filled anew, at its next acquire; the others keep their pages. What
    the module's tensor holds outside the forward (its placeholder, or
    with outside="host" its own bytes) does not change. Not inside the
    weight's forward (RuntimeError)."""
    _set_source(layout, _entry(layout, name, model), tensor)


def _entry(layout: Layout, name: str, model: str) -> Any:
    """The Entry of weight `name`; KeyError naming the model if none."""
    for e in layout.entries:
        if e.name == name:
            return e
    raise KeyError("vpager.torch: %r is not a weight of this offloaded %s "
                   "(names: layout())" % (name, model))


def _set_source(layout: Layout, e: Any, tensor: Optional[torch.Tensor]
                ) -> None:
    # A fill (set_fill) goes with the bytes it rewrites: dropped only once
    # the new source is set (an error before leaves the weight as it was).
    if e.cur:
        raise RuntimeError("vpager.torch: set_source(%r) while the "
                           "weight is acquired" % e.name)
    restore(e)
    if tensor is None:
        if e.own is not None:
            layout.set_source(e, e.own)
            e.own = None
            drop_alt(e)
        elif e.fill is not None:
            layout.set_source(e, e.src)     # its own bytes, unrewritten
        _set_fill_of(layout, e, None)
        return
    if tensor.dtype != e.dtype or tuple(tensor.size()) != e.shape:
        raise ValueError("vpager.torch: set_source(%r): a %s %s tensor, "
                         "the weight is %s %s"
                         % (e.name, tensor.dtype, tuple(tensor.size()),
                            e.dtype, e.shape))
    # Filled, then page-locked (as offload()'s host copy): a weight
    # patched on the GPU is copied straight in.
    host, buf = host_memory(e.size)
    with torch.no_grad(), torch.inference_mode(False):
        if e.size:
            host.view(e.dtype).view(e.shape).copy_(tensor.detach())
    hb = layout.device.register_hostbuf(buf, max(e.size, 1))
    try:
        own = e.own if e.own is not None else e.src
        layout.set_source(e, Source.from_host(hb.ptr))
    except BaseException:
        hb.close()
        raise
    e.own = own
    _set_fill_of(layout, e, None)   # other bytes: the fill is not theirs
    drop_alt(e)
    e.alt = hb


def set_fill(layout: Layout, name: str,
             fill: Optional[Callable[[torch.Tensor], None]],
             model: str) -> None:
    """Offloaded.set_fill() on the model (`model`: its class name, for
    errors): each time weight `name` is filled from its own source (in
    place, staged, prefetched), fill(view) runs at its acquire, on the
    acquiring stream, before any use: `view` is a device tensor of the
    weight's dtype and shape over the fresh bytes, which fill rewrites in
    place (a LoRA patch computed on the device: no host copy). Bytes that
    stayed resident since are not filled, nor rewritten again. A fill
    that raises leaves the bytes as they were (after an out-of-memory
    error it runs once more: HotPath.fill). fill None:
    the weight's own bytes. Either way only that weight is filled anew,
    at its next acquire. A source set by set_source() is dropped (its own
    bytes again). Not inside the weight's forward (RuntimeError)."""
    if fill is not None and not callable(fill):
        raise TypeError("vpager.torch: set_fill(%r): a callable or None, "
                        "not %s" % (name, type(fill).__name__))
    e = _entry(layout, name, model)
    if e.cur:
        raise RuntimeError("vpager.torch: set_fill(%r) while the weight is "
                           "acquired" % e.name)
    restore(e)
    if e.own is not None:       # a set_source() copy: its own bytes again
        layout.set_source(e, e.own)
        e.own = None
        drop_alt(e)
    elif fill is None and e.fill is None:
        return
    else:
        layout.set_source(e, e.src)     # the same source: filled anew
    _set_fill_of(layout, e, fill)


def refill(layout: Layout, entries: Iterable[Any]) -> None:
    """The weights with a fill that are not acquired are filled anew at
    their next acquire: after an acquire whose fills did not all run (an
    error), so no unrewritten bytes stay resident."""
    for e in entries:
        if e.fill is not None and not e.cur:
            try:
                layout.set_source(e, e.src)
            except Exception:   # pragma: no cover - the first error wins
                pass


def load_file(layout: Layout, module: torch.nn.Module, path: str,
              swap: Callable, outside_mode: Any) -> None:
    """Every weight's bytes from the safetensors file at `path` (its
    patches dropped; with outside="host" the tensors hold the new bytes)."""
    layout.reload(module, path, swap)
    for e in layout.entries:
        restore(e)
        e.own = None
        _set_fill_of(layout, e, None)
        drop_alt(e)
        if outside_mode == "host":
            _repoint(e, outside(e))
