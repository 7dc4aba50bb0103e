"""OffloadConfig: what offload() was asked, each value checked once, where
it enters (OffloadConfig.from_arguments), with errors naming the argument
the user gave. Nothing past this module re-checks or re-parses them."""

import dataclasses
import math
import os
import warnings
from typing import Any, Callable, Dict, Optional, Union

import torch

from .. import EINVAL, ENODEV, ORDER_NAMES, env
from ..errors import InvalidArgument, NoDeviceError
from ..options import OPTION_NAMES, parse_size
from .placement import ALIGN

__all__ = ["OffloadConfig", "size_argument", "torch_device"]

Size = Union[int, float, str, None]
ORDERS = ORDER_NAMES                # "tail", "interleaved"
OUTSIDE = ("placeholder", "host")
_SIZE_HINT = ("an int of bytes, or a string such as \"20G\" or \"20GiB\" "
              "(20 * 2**30) or \"20GB\" (20 * 10**9)")


def _einval(msg: str) -> InvalidArgument:
    return InvalidArgument(EINVAL, "VP_EINVAL", msg)


def size_argument(fn: str, name: str, value: Size, minimum: int = 0
                  ) -> Optional[int]:
    """Bytes from offload()'s `name` argument: an int, a float (rounded
    down: budget=0.5 * total), a size string or None. InvalidArgument
    (a ValueError) naming fn(name=value) otherwise, or below minimum."""
    if value is None:
        return None
    what = "vpager.torch.%s: %s=%r" % (fn, name, value)
    if isinstance(value, bool):
        raise _einval("%s is not a size: %s" % (what, _SIZE_HINT))
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _einval("%s is not a size: %s" % (what, _SIZE_HINT))
        value = int(value)
    elif isinstance(value, str):
        try:
            value = parse_size(value.strip())
        except InvalidArgument:
            raise _einval("%s is not a size: %s" % (what, _SIZE_HINT)) \
                from None
    elif hasattr(value, "__index__"):     # int, numpy's integers
        value = value.__index__()
    else:
        raise _einval("%s is not a size: %s" % (what, _SIZE_HINT))
    if value < minimum:
        raise _einval("%s is not %s" % (what, "a size above zero"
                                         if minimum == 1 else
                                         "a size of at least %d bytes"
                                         % minimum))
    return value


def torch_device(value: Any, fn: str = "offload", name: str = "device",
                 present: bool = True) -> torch.device:
    """The torch device `value` names: "cuda", "cuda:N", N, a torch.device,
    or "cpu"/"sim" for the simulated device. ValueError naming the
    argument for anything else; with `present`, NoDeviceError when it
    names CUDA and torch has none (saying what to do instead)."""
    if isinstance(value, torch.device):
        dev = value
    elif isinstance(value, bool):
        dev = None
    elif isinstance(value, int):
        dev = torch.device("cuda", value) if value >= 0 else None
    elif isinstance(value, str):
        try:
            dev = torch.device("cpu" if value.strip() == "sim"
                               else value.strip())
        except RuntimeError:
            dev = None
    else:
        dev = None
    if dev is None:
        raise ValueError("vpager.torch.%s: %s=%r is not a device: \"cuda\", "
                         "\"cuda:N\", N, or \"sim\"/\"cpu\" for vpager's "
                         "simulated device" % (fn, name, value))
    if present and dev.type == "cuda" and not torch.cuda.is_available():
        raise NoDeviceError(
            ENODEV, "VP_ENODEV",
            "vpager.torch.%s: %s=%r but torch has no CUDA device (this torch "
            "is built without CUDA, or no GPU is visible): pass %s=\"sim\" "
            "to run on vpager's simulated device (host memory, for tests), "
            "or install a CUDA build of torch" % (fn, name, value, name))
    return dev


def _options(options: Dict[str, Any]) -> Dict[str, Any]:
    """vp_options_t fields: names checked; page_size parsed (a power of
    two of at least 4 KiB) so that a bad one is named now."""
    for name in options:
        if name not in OPTION_NAMES:
            raise TypeError("vpager.torch.offload: unknown option %s= "
                            "(vp_options_t fields: %s)"
                            % (name, ", ".join(OPTION_NAMES)))
    out = dict(options)
    if out.get("page_size") is not None:
        page = size_argument("offload", "page_size", out["page_size"], 1)
        if page < 4096 or page & (page - 1):
            raise _einval("vpager.torch.offload: page_size=%r is not a power "
                          "of two of at least 4 KiB" % (out["page_size"],))
        out["page_size"] = page
    return out


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return "%.4g %s" % (n / (1 << shift), unit)
    return "%d bytes" % n


@dataclasses.dataclass
class OffloadConfig:
    """What offload() was asked, checked (python/README.md, "offload()'s
    arguments"). budget, lookahead: bytes or None; order: the VBAR's
    eviction order ("tail", "interleaved"; None: the device's);
    order_asked: whether the caller chose it (order=, VPAGER_ORDER or the
    evict_order option: then no schedule); device: the torch device asked
    for, or None; options: vp_options_t fields for a device offload()
    opens; align; weights_from: a safetensors path or None; reorder; units
    (offload()'s units=); for a loader that embeds offload(): tensors,
    sources (callables or None), outside ("placeholder" or "host"), root
    (a submodule or None), schedule (True/False/None). scheduled: whether
    the copy schedule runs (set by the handle: tuner.enabled())."""

    budget: Optional[int] = None
    lookahead: Optional[int] = None
    order: Optional[str] = None
    order_asked: bool = False
    device: Optional[torch.device] = None
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)
    align: int = ALIGN
    weights_from: Optional[str] = None
    reorder: bool = True
    units: Any = None
    tensors: Optional[Callable] = None
    sources: Optional[Callable] = None
    outside: str = "placeholder"
    root: Optional[torch.nn.Module] = None
    schedule: Optional[bool] = None
    scheduled: bool = False

    @classmethod
    def from_arguments(cls, budget: Size = None, lookahead: Size = None,
                       order: Optional[str] = None, device: Any = None,
                       options: Optional[Dict[str, Any]] = None,
                       align: int = ALIGN, weights_from: Optional[str] = None,
                       reorder: bool = True, units: Any = None,
                       tensors: Optional[Callable] = None,
                       sources: Optional[Callable] = None,
                       outside: str = "placeholder",
                       root: Optional[torch.nn.Module] = None,
                       schedule: Optional[bool] = None) -> "OffloadConfig":
        """Check offload()'s arguments (device: not a vpager.Device, which
        api.py takes as dev=)."""
        options = _options(options or {})
        if order is not None and order not in ORDERS:
            raise _einval("vpager.torch.offload: order=%r is not one of %s"
                          % (order, ", ".join(ORDERS)))
        # An order asked for is kept; otherwise the first forward runs
        # interleaved and the schedule (tuner.py) then ranks the pages.
        order_asked = (order is not None or env.given("VPAGER_ORDER")
                       or "evict_order" in options)
        if isinstance(align, bool) or not isinstance(align, int) or \
                align < 1 or align & (align - 1):
            raise ValueError("vpager.torch.offload: align=%r is not a power "
                             "of two" % (align,))
        if weights_from is not None and not os.path.isfile(weights_from):
            raise ValueError("vpager.torch.offload: weights_from=%r is not a "
                             "file" % (weights_from,))
        if outside not in OUTSIDE:
            raise ValueError("vpager.torch.offload: outside= is "
                             "\"placeholder\" or \"host\", not %r"
                             % (outside,))
        for name, f in (("tensors", tensors), ("sources", sources)):
            if f is not None and not callable(f):
                raise TypeError("vpager.torch.offload: %s= takes a callable "
                                "(qualified name, tensor), not %s"
                                % (name, type(f).__name__))
        if root is not None and not isinstance(root, torch.nn.Module):
            raise TypeError("vpager.torch.offload: root= is a submodule, "
                            "not %s" % type(root).__name__)
        if schedule not in (None, True, False):
            raise ValueError("vpager.torch.offload: schedule= is True, "
                             "False or None, not %r" % (schedule,))
        return cls(
            budget=size_argument("offload", "budget", budget, 1),
            lookahead=size_argument("offload", "lookahead", lookahead),
            order=order if order_asked else "interleaved",
            order_asked=bool(order_asked),
            device=torch_device(device) if device is not None else None,
            options=options, align=align, weights_from=weights_from,
            reorder=bool(reorder), units=units, tensors=tensors,
            sources=sources, outside=outside, root=root, schedule=schedule)

    def check_simulated(self, page: Optional[int]) -> None:
        """On a simulated device offload() opens, the budget is the
        device's memory (sim_capacity, unless given): a page (`page`: the
        page size it opens with, None: the library's) larger than it is
        the page size's fault or the budget's; say both."""
        if self.budget is None or "sim_capacity" in self.options:
            return
        if page is None:
            page = env.size("VPAGER_PAGE_SIZE") or 32 << 20
        if page <= self.budget:
            return
        asked = ("page_size" if "page_size" in self.options else
                 "VPAGER_PAGE_SIZE" if env.given("VPAGER_PAGE_SIZE") else
                 "the default page size")
        raise _einval("vpager.torch.offload: %s (%s) is larger than "
                      "budget (%s), the simulated device's memory: "
                      "give a smaller page size or a larger budget"
                      % (asked, _human(page), _human(self.budget)))


_WARNED = set()


def warn_once(key: Any, message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning, once per process for `key`."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def warn_budget_over(dev: Any, budget: Optional[int], fn: str) -> None:
    """A budget above the device's memory is clamped by the library (a
    limit caps vpager's commits; the device has no more): say so, once
    per budget and device size."""
    if budget is None:
        return
    total = dev.info()["total_memory"]
    if budget > total:
        warn_once(("budget", budget, total),
                  "vpager.torch.%s: budget=%d bytes (%s) is more than the "
                  "device's %d bytes (%s) of memory: vpager uses at most "
                  "what the device has" % (fn, budget, _human(budget), total,
                                           _human(total)), stacklevel=4)
