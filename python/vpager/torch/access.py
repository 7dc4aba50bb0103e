"""ModelAccess: what the code that adapts a model between forwards (the
re-placement in the order of use, replace.py; the tuner and its schedule,
tuner.py) may ask of the model, and nothing more. The handle makes one
(handle.py) and keeps the state behind it; the adapters never see the
handle."""

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from .units import Unit


@dataclass(frozen=True)
class ModelAccess:
    """busy(): a unit's forward or an acquired() block runs;
    may_replace(): the weights may move now (open, its device open, not
    busy); swap(entries, offsets, sources): the weights made again at new
    offsets (Layout.swap; the model back on top of the device); scheduled():
    the VBAR's eviction order became the schedule's; hold(units): the units
    the root forward holds from now on, returns those it took (HotPath.
    set_held); held(): those units; stream(): the compute stream's handle;
    cuda_index: the CUDA device's index (0 on the simulated device)."""

    busy: Callable[[], bool]
    may_replace: Callable[[], bool]
    swap: Callable[[List, List[int], List], None]
    scheduled: Callable[[], None]
    hold: Callable[[Sequence[Unit]], Tuple[Unit, ...]]
    held: Callable[[], Tuple[Unit, ...]]
    stream: Callable[[], int]
    cuda_index: int
