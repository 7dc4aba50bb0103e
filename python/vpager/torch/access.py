"""What a model's parts may ask of it, and nothing more: Lifecycle, what
the handle (handle.py) tells the parts it is made of (build.py) about its
state; ModelAccess, what the code that adapts the model between forwards
(the re-placement in the order of use, replace.py; the tuner and its
schedule, tuner.py) may do to it. The handle keeps the state behind both;
no part sees the handle's fields."""

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .units import Unit


@dataclass(frozen=True)
class ModelAccess:
    """busy(): a unit's forward or an acquired() block runs;
    may_replace(): the weights may move now (open, its device open, not
    busy); swap(entries, offsets, sources): the weights made again at new
    offsets (Layout.swap; sources None: moved, Layout.move; the model back
    on top of the device); scheduled():
    the VBAR's eviction order became the schedule's; hold(units): the units
    the root forward holds from now on, returns those it took (HotPath.
    set_held); held(): those units; lend_at(unit): the forward's last unit
    with a streamed weight, whose prefetch goes on into the loan of
    torch's free cache made at the next forward's start (lend.py; None:
    none);
    stream(): the compute stream's handle; cuda_index: the CUDA device's
    index (0 on the simulated device)."""

    busy: Callable[[], bool]
    may_replace: Callable[[], bool]
    swap: Callable[[List, List[int], List], None]
    scheduled: Callable[[], None]
    hold: Callable[[Sequence[Unit]], Tuple[Unit, ...]]
    held: Callable[[], Tuple[Unit, ...]]
    lend_at: Callable[[Optional[Unit]], None]
    stream: Callable[[], int]
    cuda_index: int


@dataclass(frozen=True)
class Lifecycle:
    """owner: the handle, as the device's priority list and the managed
    tensors' `_vpager_handle` name it; check_open() raises unless the
    model may run; is_open(): open and its device too; unloaded(): unload()
    ran; may_replace, swap, scheduled: as ModelAccess's."""

    owner: Any
    check_open: Callable[[], None]
    is_open: Callable[[], bool]
    unloaded: Callable[[], bool]
    may_replace: Callable[[], bool]
    swap: Callable[[List, List[int], List], None]
    scheduled: Callable[[], None]
