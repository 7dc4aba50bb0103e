"""Each unit's measured work remembered from one process to the next
(VPAGER_PLAN_CACHE), so that a model run again plans its first
forward from warm work.

On by default (the user's cache folder, default_folder()); "0" or
"off" turns it off. Measured (H100, bench/RESULTS.md, twenty-ninth
session): the node's Flux 9.4 GiB at 6 GiB run again, its first prompt's
worst step after the first 1.05 x a steady one (1.73 x without), the
first prompt 2.30 s against 2.39 (ComfyUI's path 2.68).

A model's first forward runs cold (tuner.py, coldwork.py): on the H100
the node's Flux 9.4 GiB measured 389 ms of unit work where the next
forwards measured 79, on every unit, so the plan made from it is not the
settled one, and the settled plan's placement later costs a step of the
first prompt what its moved and leaving weights take over the link
(1.5-2.1 x a steady step). The work a unit does depends on the model's
shapes, the inputs' shapes and the GPU, not on the budget: a process
that runs the same model on the same GPU with inputs of the same shapes
(a ComfyUI user restarting it, a server's next start) may plan its first
forward from the work the last one settled on, placing the settled plan
at once.

One JSON file per key (a hash of the GPU's name, each unit's name, class
and weight shapes, and the root forward's tensor arguments' shapes and
dtypes), written whole (a temporary file renamed over it) from the second
measured forward on and once measuring settles (then marked settled); a
file that does not read or does not match is ignored (said once), never
trusted. A settled file's work is planned for without measuring again:
each measured forward's marks cost a host-bound model's step (the node's
SDXL on the H100: 94.8-100.6 ms against 81.5 unmeasured, 1.16-1.23 x)."""

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .. import env
from . import coldwork

VARIABLE = "VPAGER_PLAN_CACHE"
OFF = ("0", "off", "no", "none")      # its values that turn it off
VERSION = 2                             # 2: "settled"; 1's work may hold
                                        # 0 ms units (a mark event reused twice)
_warned = set()                         # what _say() said already


def folder() -> Optional[str]:
    """The folder VPAGER_PLAN_CACHE names, the user's cache folder when it
    is unset (default_folder()), or None: turned off ("0", "off")."""
    raw = env.text(VARIABLE)
    if raw is None:
        return default_folder()
    return None if raw.strip().lower() in OFF else raw


def default_folder() -> Optional[str]:
    """vpager/plans in the user's cache folder: %LOCALAPPDATA% on
    Windows, else $XDG_CACHE_HOME or ~/.cache; None if there is none."""
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or (
            os.path.join(os.path.expanduser("~"), ".cache")
            if os.path.expanduser("~") != "~" else None)
    return os.path.join(base, "vpager", "plans") if base else None


def _shape_of(v: Any, depth: int = 0) -> Any:
    """What of an argument the work depends on: a tensor's shape and
    dtype, a sequence's items (two levels), else its type's name."""
    if isinstance(v, torch.Tensor):
        return [list(v.shape), str(v.dtype)]
    if isinstance(v, (list, tuple)) and depth < 2:
        return [_shape_of(x, depth + 1) for x in v]
    return type(v).__name__


def key(device_name: str, units: Iterable[Any], args: tuple) -> str:
    """The cache key of a model's units on a device for a forward called
    with `args`."""
    parts = [VERSION, device_name,
             [list(map(str, coldwork.kind(u))) + [u.name] for u in units],
             _shape_of(tuple(args))]
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def device_name(target: torch.device, index: int) -> str:
    """The GPU's name (the simulated device: "sim")."""
    if target.type != "cuda":
        return "sim"
    return torch.cuda.get_device_name(index)


def _path(where: str, k: str) -> str:
    return os.path.join(where, "plan-%s.json" % k)


def _say(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn("vpager.torch plan cache (%s): %s" % (VARIABLE, what),
                      RuntimeWarning)


def exists(k: Optional[str]) -> bool:
    """Whether a file is remembered under key k (None: no key)."""
    where = folder()
    return k is not None and where is not None and \
        os.path.isfile(_path(where, k))


def load(k: str, units: List[Any]
         ) -> Optional[Tuple[Dict[Any, float], bool]]:
    """({unit: seconds}, settled) remembered for key k, or None: no cache,
    no file, or one that does not read or does not name these units.
    settled: written once measuring settled (a file without the field
    was not)."""
    where = folder()
    if where is None:
        return None
    path = _path(where, k)
    try:
        with open(path, encoding="utf-8") as f:
            got = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _say("%s does not read (%s); planned as without it" % (path, e))
        return None
    names = [u.name for u in units]
    work = got.get("work") if isinstance(got, dict) else None
    if got.get("version") != VERSION or got.get("units") != names or \
            not isinstance(work, list) or len(work) != len(names) or \
            not all(isinstance(t, (int, float)) and 0 <= t < 1e3
                    for t in work):
        _say("%s does not match this model; planned as without it" % path)
        return None
    return ({u: float(t) for u, t in zip(units, work)},
            got.get("settled") is True)


def save(k: str, work: Dict[Any, float], settled: bool = False) -> bool:
    """Remember work ({unit: seconds}) under key k, settled or not; True
    if written. A folder that cannot be written is said once, nothing
    raised."""
    where = folder()
    if where is None or not work:
        return False
    units = list(work)
    blob = json.dumps({"version": VERSION, "units": [u.name for u in units],
                       "work": [work[u] for u in units],
                       "settled": bool(settled)})
    tmp = None
    try:
        os.makedirs(where, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".plan-", dir=where)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(blob)
        os.replace(tmp, _path(where, k))
        return True
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        _say("%s cannot be written (%s); nothing remembered" % (where, e))
        return False
