"""Offloaded: the handle offload() returns; it owns the model's lifecycle
(open, unloaded, closed) and answers for it. What it is made of, by
lifetime: built once (layout.py: the VBAR, the weights and their sources,
placed by placement.py; install.py: what changes in the module), run
every forward (hotpath.py; roothooks.py: the root's hooks in one declared
order) and adapted between forwards (replace.py, tuner.py: through the
access.ModelAccess the handle gives them, never the handle)."""

import contextlib
import functools
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from .. import env
from .devices import (attach, devstate, DEVSTATES, leave, open_for,
                      SIZED_RINGS)
from . import counters
from . import ledger as _ledger
from . import patches
from .access import ModelAccess
from .hotpath import HotPath
from .install import Installation
from .layout import Layout
from .replace import Recorder
from .roothooks import RootHooks
from . import tuner as _tuner
from .units import CLOSED, OPEN, UNLOADED, refuse_copy


def _serial(method):
    """The method changes the model: it waits for a forward running on
    another thread (serial.py)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.hot_path.lock:
            return method(self, *args, **kwargs)
    return locked


def _open_device(plan, dev):
    """(device, owned): dev set up for the plan, or one opened for it."""
    s = plan.settings
    if dev is None:
        return open_for(plan.target, s.budget, s.lookahead, s.options,
                        plan.largest, scheduled=s.scheduled), True
    attach(dev, s.budget, s.lookahead, plan.largest)
    return dev, False


def _build_layout(plan, dev):
    """(Layout, device, owned): the device opened (or set up) and the
    layout built on it; a device opened here is closed on failure."""
    s = plan.settings
    s.scheduled = _tuner.enabled(s, dev is not None)
    dev, owned = _open_device(plan, dev)
    try:
        return Layout.build(dev, plan), dev, owned
    except BaseException:
        if owned:
            DEVSTATES.pop(dev, None)
            dev.close()
        raise


class Offloaded:
    """The handle offload() returns: module, device (the vpager.Device),
    vbar, target (the torch device it computes on), order (the VBAR's
    eviction order: "interleaved", "tail", or "scheduled" once the copy
    schedule ranks its pages: tuner.py), state ("open", "unloaded",
    "closed"); hot_path, tuner (None when not scheduled) and vbar_layout,
    its parts, for tests and benchmarks. See python/README.md."""

    def __init__(self, plan: Any, dev: Any = None) -> None:
        s = plan.settings
        lay, dev, owned = _build_layout(plan, dev)
        self.module: torch.nn.Module = plan.module
        self.target: torch.device = plan.target
        self.device = dev
        self.vbar = lay.vbar
        self.vbar_layout: Layout = lay
        self.order: str = "tail" if lay.groups is None else "interleaved"
        # Staging bytes the largest unit needs at once: a shared ring the
        # tuner shrinks stays this large for this model.
        self.staging_need: int = plan.largest[1] if plan.largest else 0
        self.state: str = OPEN
        self._ds = devstate(dev, owned)
        self._ds.users.add(self)
        # The submodule whose forward is one step (offload(root=)): the
        # hooks that learn, record and measure go there.
        self._root_hooks = RootHooks(s.root or plan.module)
        self._recorder = Recorder(lay, self._may_replace, self._swap,
                                  self._root_hooks)
        self.hot_path = HotPath(self, lay, self._ds, self.target,
                                self._recorder, self._check_open,
                                self._is_open)
        access = ModelAccess(
            busy=self.hot_path.busy, may_replace=self._may_replace,
            swap=self._swap, scheduled=self._scheduled,
            hold=self._hold, held=lambda: self.hot_path.held_units,
            stream=self.hot_path.stream, cuda_index=self.hot_path.index)
        self.tuner: Optional[_tuner.Tuner] = None
        if s.scheduled:
            self.tuner = _tuner.Tuner(
                access, self._root_hooks, lay, self._ds, self.target,
                windows=(s.lookahead is None and "lookahead" not in s.options
                         and not env.given("VPAGER_LOOKAHEAD")),
                resize=((owned or dev in SIZED_RINGS)
                        and "staging_size" not in s.options
                        and not env.given("VPAGER_STAGING")))
            self.hot_path.tuner = self.tuner
        self._install = Installation(
            self.module, lay, self.target, s.outside, s.tensors is not None,
            plan.owners, self, self._check_open,
            lambda: self.state is UNLOADED)
        self._install.install(self.hot_path.wrap)
        self._root_hooks.install(self.hot_path.lock, self.hot_path.wrap_root)
        if self.target.type == "cuda":     # activations first
            self._root_hooks.set("learn", pre=self.hot_path.learn_hook)
        if s.reorder and len(lay.units) > 1:
            self._recorder.install()
        if self.tuner is not None:
            self.tuner.install()
        _ledger.track(self, self._ds, self._root_hooks, budget=s.budget)

    # ------------------------------------------- what adapting may do
    def _is_open(self) -> bool:
        return self.state is OPEN and not self.device.closed

    def _may_replace(self) -> bool:
        return self._is_open() and not self.hot_path.busy()

    def _swap(self, entries: list, offsets: List[int], sources: list
              ) -> None:
        """Layout.swap(), then this model on top again (eviction lowered
        its watermark); if the old weights cannot be made again either,
        the handle is closed."""
        self.vbar_layout.swap(entries, offsets, sources, self.close)
        self.vbar.prioritize()
        self._ds.top = self

    def _scheduled(self) -> None:
        self.order = "scheduled"

    def _hold(self, units: Any) -> Tuple[Any, ...]:
        self.hot_path.set_held(units)
        return self.hot_path.held_units

    def _check_open(self) -> None:
        if self.state is not OPEN:
            raise RuntimeError(
                "vpager.torch: this module's offload was %s%s" % (
                    self.state, "; its weights were freed (close())"
                    if self.state is CLOSED else ""))
        if self.device.closed:
            raise RuntimeError("vpager.torch: the vpager.Device of this "
                               "offloaded module was closed")

    def _idle(self, what: str) -> None:
        if self.hot_path.busy():
            raise RuntimeError("vpager.torch: %s() inside the module's "
                               "forward" % what)

    # ------------------------------------------------------------ public
    def __repr__(self) -> str:
        return ("<vpager.torch.Offloaded %s of %s: %d weights, %d bytes on "
                "%s>" % (self.state, type(self.module).__name__,
                         len(self.vbar_layout.entries), self.weight_bytes,
                         self.target))

    def __enter__(self) -> "Offloaded":
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self.state is OPEN:
            self.unload()
        return False

    __deepcopy__ = __reduce_ex__ = refuse_copy

    @property
    def closed(self) -> bool:
        """True once unload() or close() ran."""
        return self.state is not OPEN

    @property
    def weight_bytes(self) -> int:
        return sum(e.size for e in self.vbar_layout.entries)

    def units(self) -> List[Tuple[str, torch.nn.Module, List[str]]]:
        """[(qualified name, module, [weight names])] in placement order."""
        return [(u.name, u.module, [e.name for e in u.entries])
                for u in self.vbar_layout.units]

    def layout(self) -> List[Tuple[str, int, int, str]]:
        """[(weight name, VBAR offset, bytes, "host", "file" or "source")]
        in VBAR order: where each weight lives and where its bytes come
        from (its host copy, the safetensors file, or offload(sources=))."""
        self._check_open()
        return self.vbar_layout.describe()

    @_serial
    def load_safetensors(self, path: str) -> "Offloaded":
        """vpager.torch.load_safetensors(self, path): see there (sources
        set by set_source() are dropped: every weight is the file's)."""
        self._check_open()
        self._idle("load_safetensors")
        patches.load_file(self.vbar_layout, self.module, path, self._swap,
                          self._install.outside)
        return self

    @_serial
    def set_source(self, name: str, tensor: Optional[torch.Tensor] = None
                   ) -> None:
        """Weight `name` (its qualified name, as layout() gives it) takes
        its bytes from `tensor` from now on: a tensor of its dtype and
        shape (any device), copied once into a pinned host buffer of its
        own. tensor None: its own bytes again (host copy or file). Only
        that weight is filled anew, at its next acquire; the others keep
        their pages. What the module's tensor holds outside the forward
        (its placeholder, or with outside="host" its own bytes) does not
        change. For weights a loader patches (ComfyUI's LoRA). Not inside
        the weight's forward (RuntimeError)."""
        self._check_open()
        for e in self.vbar_layout.entries:
            if e.name == name:
                return patches.set_source(self.vbar_layout, e, tensor)
        raise KeyError("vpager.torch: %r is not a weight of this offloaded "
                       "%s (names: layout())" % (name,
                                                 type(self.module).__name__))

    @_serial
    def place_by_use(self) -> bool:
        """Re-place the weights in the order their units were first used
        since offload(), as the first forward of the root does; for models
        whose root forward never runs (a VAE's decode). Once; returns True
        if the weights moved (each then fills anew at its next acquire).
        Not inside a forward (returns False)."""
        return self._recorder.finish()

    def stats(self) -> Dict[str, Any]:
        """{"model": this model's counters and sizes, "device": the
        device's counters (all models on it), "schedule": schedule(),
        "governor": the device's Governor}: counters.py, and
        python/README.md's "stats()" for every key."""
        self._check_open()
        return counters.handle_stats(self, self.vbar_layout, self._ds.gov)

    def schedule(self) -> Optional[Dict[str, Any]]:
        """What the schedule chose after the first forward (tuner.py), or
        None (not scheduled, or before that forward): predicted_ms and
        all_resident_ms (the forward, predicted; its measured compute),
        streamed_bytes (copied per forward), resident_bytes,
        resident_weights, staging (the ring), link (bytes/s),
        planned_for (the device budget it was made for), replans (times
        made again since, for another budget), measured (forwards
        measured: two, or more until their work settles), windows
        (lookahead bytes per unit, placement order, or None), held_units
        (units acquired once per inference forward: HotPath.hold), rings
        (the ring sizes the last plan tried: staging, predicted_ms,
        streamed_bytes)."""
        return None if self.tuner is None else self.tuner.describe()

    def residency(self) -> str:
        """The VBAR's pages as a map: "#" resident, "P" pinned, "." not."""
        return counters.residency_map(self.page_flags())

    def page_flags(self) -> bytes:
        """One byte per VBAR page: vpager.PAGE_RESIDENT | PAGE_PINNED."""
        self._check_open()
        return self.vbar.residency()

    def report(self, json: bool = False) -> Any:
        """The device's report (all models on it): text, or parsed JSON."""
        self._check_open()
        return self.device.report(json=json)

    @_serial
    def prioritize(self) -> None:
        """Move this model's VBAR to the top of the device's priority list
        (done automatically when its forward starts after another model's)."""
        self._check_open()
        self.vbar.prioritize()
        self._ds.top = self

    @contextlib.contextmanager
    def acquired(self, *modules: torch.nn.Module
                 ) -> Iterator[torch.nn.Module]:
        """Acquire weights for the block: those of the given submodules
        (their subtrees), or every weight of the model (then the staging
        ring must hold all that is not resident). For code that reads
        parameters outside the forward of the unit holding them; forwards
        inside the block use the same tensors."""
        self._check_open()
        yield from self.hot_path.acquired(self.module, modules)

    @property
    def busy(self) -> bool:
        """True inside a unit's forward or an acquired() block."""
        return self.hot_path.busy()

    @property
    def recording(self) -> bool:
        """True until the weights were placed in the order of use (the
        first forward of the root, or place_by_use())."""
        return self._recorder.recording

    @property
    def replaced(self) -> int:
        """How many times the weights were re-placed in the order of use
        (0 or 1: at the first forward of the root, or place_by_use())."""
        return self._recorder.replaced

    @property
    def oom_margin(self) -> int:
        """Bytes the out-of-memory retries on its device added to the
        headroom learned from torch (0 before any retry)."""
        return self._ds.gov.oom_margin

    @_serial
    def free_memory(self, nbytes: int) -> int:
        """Evict at least `nbytes` of this model's unpinned pages (as many
        as it has if fewer); returns the bytes freed. Its next forward puts
        it on top of the device's priority list again, so it fills its
        weights anew (a loader's "unload this much of this model")."""
        self._check_open()
        if nbytes <= 0:
            return 0
        freed = self.vbar.free_memory(min(int(nbytes), 1 << 62))
        if self._ds.top is self:
            self._ds.top = None
        return freed

    @_serial
    def unload(self) -> torch.nn.Module:
        """Parameters back as ordinary tensors on their original device
        (from the host copy), requires_grad restored, wrappers and hooks
        removed, vpager objects freed. The module works as before offload().
        A second call does nothing; after close() it raises."""
        if self.state is UNLOADED:
            return self.module
        if self.state is CLOSED:
            raise RuntimeError("vpager.torch: unload() after close(): the "
                               "weights were freed")
        self._check_open()          # the device (and host copy) still there
        self._idle("unload")
        # Device memory first: a GPU model needs the room to come back.
        self.vbar.close()
        self._install.restore()
        self.state = UNLOADED
        self.hot_path.set_held(())
        self._root_hooks.remove()   # first: the units' may be under
        self._install.uninstall()
        self._recorder.remove()
        if self.tuner is not None:
            self.tuner.remove()
        self.hot_path.staged.clear()
        self._free()
        return self.module

    @_serial
    def close(self) -> None:
        """Free the vpager objects without restoring the weights; the module
        is left unusable (its forward and state_dict() raise RuntimeError).
        A second call, or close() after unload(), does nothing. With
        outside="host" the tensors get CPU placeholders (their host copy
        is freed), except those over a caller's source (sources=), which
        keep the caller's tensor."""
        if self.state is not OPEN:
            return
        self._idle("close")
        self.state = CLOSED
        self.hot_path.set_held(())
        self.hot_path.staged.clear()
        self._install.orphan()
        self._free()

    def _free(self) -> None:
        lay = self.vbar_layout
        for e in lay.entries:
            e.host = e.file_addr = e.src = e.keep = e.own = None
        errors = lay.close()
        for e in lay.entries:
            patches.drop_alt(e)
        errors += leave(self.device, self._ds, self)
        if errors:
            raise errors[0]
