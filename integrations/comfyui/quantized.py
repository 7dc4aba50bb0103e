"""QuantizedTensor weights (ComfyUI's mixed-precision ops: scaled fp8 and
the other comfy_kitchen layouts) paged by vpager as their stored parts.

A QuantizedTensor is a wrapper: no bytes of its own, its payload (`_qdata`)
and its layout's tensors (scales) held as plain tensors inside it, named by
torch's flatten protocol (`__tensor_flatten__` -> inner attribute names and
a context; `__tensor_unflatten__` builds the wrapper again over other inner
tensors), the way ComfyUI's own dynamic path rebuilds one over its VBAR
bytes (comfy/memory_management.py interpret_gathered_like). Here each part
becomes a plain Parameter of the op (a "part", `_vpager_q_<param>_<attr>`)
that vpager.torch pages like any weight, and the op's forward is wrapped:
inside it the op's parameter is the same wrapper class over the parts
as vpager.torch set them (views of the VBAR or of staging), so ComfyUI's
op code dequantizes and casts exactly as it does on its own resident
copy. Outside the forward the op keeps its own QuantizedTensor (what
ComfyUI's LoRA patching reads).

The wrapper is built once, over the part Parameters themselves: vpager's
per-unit path points their .data at each acquire's memory, resident or
staged, so that one wrapper always sees the current bytes and a forward
costs a dict store, not a rebuild (building one runs the layout's Params
dataclass and torch's wrapper constructor: tens of microseconds of host
time, and ComfyUI's QuantizedTensor ops are host-bound). Only where the
parts are other tensors (vpager holding the units for the whole forward
puts its own Parameters in their place) is the wrapper rebuilt over them,
cached by their addresses.

Free of ComfyUI: a quantized weight is recognised by the flatten protocol
and its layout's name (`_layout_cls`)."""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

PART = "_vpager_q_"         # prefix of the parts' parameter names

# The layouts ComfyUI 0.33's ops load (comfy/quant_ops.py QUANT_ALGOS and
# its registered layouts, comfy_kitchen's classes): every one is its
# payload plus the tensor fields of its Params and non-tensor fields, so a
# wrapper rebuilt over the same bytes computes what the original does.
LAYOUTS = frozenset((
    "TensorCoreFP8Layout", "TensorCoreFP8E4M3Layout",
    "TensorCoreFP8E5M2Layout", "TensorCoreNVFP4Layout",
    "TensorCoreMXFP8Layout", "TensorWiseINT8Layout",
    "TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"))

_CACHED = 16                # rebuilt wrappers kept per op (by addresses)
OWN_KEPT = 1 << 20          # own_on(): parts kept on the device, at most


def is_quantized(t: Any) -> bool:
    """True for a tensor subclass that says how to take it apart (torch's
    flatten protocol): ComfyUI's QuantizedTensor."""
    return (isinstance(t, torch.Tensor)
            and type(t) not in (torch.Tensor, torch.nn.Parameter)
            and callable(getattr(type(t), "__tensor_flatten__", None))
            and callable(getattr(type(t), "__tensor_unflatten__", None)))


def layout_name(t: torch.Tensor) -> str:
    """The layout a QuantizedTensor names (comfy_kitchen's _layout_cls)."""
    name = getattr(t, "_layout_cls", None)
    return name if isinstance(name, str) else type(t).__name__


def _inner(t: torch.Tensor) -> Tuple[List[Tuple[str, torch.Tensor]], Any]:
    """[(attribute, tensor)] of a quantized tensor's parts, and the
    unflatten context."""
    names, ctx = t.__tensor_flatten__()
    return [(n, getattr(t, n)) for n in names], ctx


def refuse(key: str, module: torch.nn.Module,
           t: torch.Tensor) -> Optional[str]:
    """Why quantized weight `key` of `module` cannot be paged as its parts,
    or None."""
    layout = layout_name(t)
    if layout not in LAYOUTS:
        return ("%s is a QuantizedTensor of layout %s, which the node does "
                "not page" % (key, layout))
    if hasattr(module, "expert_weight"):
        return ("%s is a quantized expert bank (%s): its weights are read "
                "outside the op's forward" % (key, type(module).__name__))
    try:
        parts, _ctx = _inner(t)
    except Exception as e:      # pragma: no cover - a broken subclass
        return "%s (%s) cannot be taken apart: %s" % (key, layout, e)
    for name, x in parts:
        what = "%s's %s (%s)" % (key, name, layout)
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            return "%s is a %s, not a plain tensor" % (what, type(x).__name__)
        if x.layout != torch.strided or x.is_quantized:
            return "%s is not a dense tensor" % what
        if x.device.type != "cpu":
            return "%s is on %s, not in host memory" % (what, x.device)
        if not x.is_contiguous():
            return "%s is not contiguous" % what
        if x.numel() == 0:
            return "%s is empty" % what
    return None


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Split:
    """One op's QuantizedTensor parameter paged as its parts. parts:
    [(parameter name on the op, Parameter, inner attribute)], installed on
    the op by install() with the forward wrapper, removed by remove()."""

    def __init__(self, key: str, module: torch.nn.Module, pname: str,
                 weight: torch.Tensor) -> None:
        self.key = key
        self.module = module
        self.pname = pname
        self.weight = weight            # the op's own QuantizedTensor
        inner, self.ctx = _inner(weight)
        self.cls = type(weight)
        self.layout = layout_name(weight)
        self.outer = (weight.size(), weight.stride())
        self.is_param = bool(getattr(weight, "_is_param", False))
        prefix = key[:len(key) - len(pname)]
        self.parts: List[Tuple[str, torch.nn.Parameter, str]] = []
        self.names: List[str] = []      # qualified names (vpager.torch's)
        for attr, x in inner:
            name = "%s%s_%s" % (PART, pname, attr.lstrip("_"))
            self.parts.append((name, torch.nn.Parameter(
                x.detach(), requires_grad=False), attr))
            self.names.append(prefix + name)
        self.size = sum(nbytes(p) for _n, p, _a in self.parts)
        self.cache: Dict[Tuple[int, ...], torch.Tensor] = {}
        # (device, attribute) -> the op's own small part there (own_on)
        self.own_kept: Dict[Tuple[str, str], torch.Tensor] = {}
        # The wrapper over the part Parameters themselves (current()),
        # made at the first forward, on the device the parts are acquired
        # on; keeps_parts: whether the layout's wrapper holds the tensors
        # it is built over (None: not known before the first build).
        self.live: Optional[torch.Tensor] = None
        self.live_device: Optional[torch.device] = None
        self.keeps_parts: Optional[bool] = None
        self.installed = False
        self.saved = None               # (had a forward of its own, it)

    def install(self) -> None:
        """The parts become the op's parameters, its forward wrapped."""
        d = self.module._parameters
        for name, p, _a in self.parts:
            if name in d:
                raise ValueError("%s: the op already has a parameter %s"
                                 % (self.key, name))
        for name, p, _a in self.parts:
            d[name] = p
        m = self.module
        self.saved = ("forward" in m.__dict__, m.__dict__.get("forward"))
        m.forward = self._wrap(m.forward)
        self.installed = True

    def remove(self) -> None:
        """The op as it was: parts and wrapper out."""
        if not self.installed:
            return
        self.installed = False
        d = self.module._parameters
        for name, _p, _a in self.parts:
            d.pop(name, None)
        had, fwd = self.saved
        if had:
            self.module.forward = fwd
        else:
            self.module.__dict__.pop("forward", None)
        self.cache.clear()
        self.own_kept.clear()
        self.live = self.live_device = None

    def _wrap(self, fwd: Callable[..., Any]) -> Callable[..., Any]:
        module, pname, current = self.module, self.pname, self.current

        def forward(*args, **kwargs):
            d = module._parameters
            own = d[pname]
            d[pname] = current(d)
            try:
                return fwd(*args, **kwargs)
            finally:
                d[pname] = own

        forward._vpager_split = self
        return forward

    def current(self, d: Dict[str, Any]) -> torch.Tensor:
        """The wrapper the op computes with now (d: the op's _parameters,
        inside the forward): the live one while the parts are the Split's
        own Parameters on the device it was made on, else rebuilt."""
        for name, p, _a in self.parts:
            if d[name] is not p:
                return self.rebuild(d)
        live = self.live
        if live is not None:
            if self.parts[0][1].device == self.live_device:
                return live
            return self.rebuild(d)
        qt = self._build({attr: p for _n, p, attr in self.parts})
        if self.keeps_parts:
            self.live = qt
            self.live_device = self.parts[0][1].device
        return qt

    def rebuild(self, d: Dict[str, Any]) -> torch.Tensor:
        """The op's wrapper class over the parts in d now (the Parameters
        vpager holds the units with, over the VBAR), cached by their
        addresses when the wrapper holds the parts themselves."""
        now = [d[name] for name, _p, _a in self.parts]
        k = tuple(t.data_ptr() for t in now)
        qt = self.cache.get(k)
        if qt is None:
            qt = self._build({attr: t.detach() for (_n, _p, attr), t
                              in zip(self.parts, now)})
            if self.keeps_parts:
                if len(self.cache) >= _CACHED:
                    self.cache.clear()
                self.cache[k] = qt
        return qt

    def _build(self, inner: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The op's wrapper class over `inner` ({attribute: tensor}).
        Sets keeps_parts: False when the layout's wrapper holds a copy of
        a part instead of it (its Params converting a tensor): such a
        wrapper is made anew for each forward, since neither vpager's
        .data swaps nor new bytes at the same address reach a copy."""
        # (Not an inference tensor: it is kept for later forwards, which
        # may run outside inference mode.)
        with torch.inference_mode(False):
            qt = self.cls.__tensor_unflatten__(inner, self.ctx, *self.outer)
        if self.keeps_parts is None:
            got, _ctx = _inner(qt)
            self.keeps_parts = len(got) == len(inner) and all(
                inner.get(attr) is x for attr, x in got)
        if self.is_param:
            qt._is_param = True
        return qt

    @property
    def payload(self) -> int:
        """The index of the payload part (`_qdata`; else the largest):
        the one patched at fill, the others taking host copies."""
        for i, (_n, _p, attr) in enumerate(self.parts):
            if attr == "_qdata":
                return i
        sizes = [nbytes(p) for _n, p, _a in self.parts]
        return sizes.index(max(sizes))

    def own_on(self, device: torch.device,
               payload: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The op's own QuantizedTensor (as loaded) over its parts on
        `device`: `payload` in the payload's place (the payload's own
        bytes already there: a fill's view), the others copied there. A
        part of at most OWN_KEPT bytes is copied there once and kept, each
        call taking a copy on the device (scales: a fill at each step
        would otherwise copy from pageable memory, which waits for the
        stream's queued work). Without `payload` (outside the forward)
        each part is read from its Parameter: vpager's host copy of its
        own bytes (outside="host"); inside a fill the Parameters hold the
        patched parts, so those come from the op's own QuantizedTensor,
        whose parts may lie in the checkpoint's mapping: reading the
        payload there would fault the file's pages into the process."""
        if payload is None:
            inner = [(attr, p.data) for _n, p, attr in self.parts]
        else:
            inner, _ctx = _inner(self.weight)
        want = self.parts[self.payload][2]
        got = {}
        with torch.no_grad(), torch.inference_mode(False):
            for attr, x in inner:
                if attr == want and payload is not None:
                    got[attr] = payload.detach()
                    continue
                k = (str(device), attr)
                t = self.own_kept.get(k)
                if t is not None:       # a copy of its own (a layout may
                    got[attr] = t.clone()   # write its inputs in place)
                    continue
                t = x.detach().to(device, copy=True)
                if attr != want and nbytes(t) <= OWN_KEPT:
                    self.own_kept[k] = t.clone()
                got[attr] = t
        return self._build(got)

    def sources(self, qt: Optional[torch.Tensor]
                ) -> List[Optional[torch.Tensor]]:
        """[tensor or None] per part: the parts of `qt` (the op's weight
        patched: the same layout, parts of the same dtypes and shapes), or
        Nones (its own bytes) for None. ValueError if they differ."""
        if qt is None:
            return [None] * len(self.parts)
        if not is_quantized(qt) or layout_name(qt) != self.layout:
            raise ValueError(
                "a patch of %s gives a %s, not a QuantizedTensor of layout "
                "%s" % (self.key, layout_name(qt) if is_quantized(qt)
                        else type(qt).__name__, self.layout))
        inner, _ctx = _inner(qt)
        got = dict(inner)
        out = []
        for _n, p, attr in self.parts:
            x = got.get(attr)
            # (A per-tensor scale the file stored as [1] comes back from
            # requantizing as []: the same bytes.)
            if x is None or x.dtype != p.dtype or x.numel() != p.numel():
                raise ValueError(
                    "a patch of %s changes its %s (%s): the node pages the "
                    "parts it loaded" % (self.key, attr, self.layout))
            out.append(x.detach().reshape(p.shape).contiguous())
        return out
