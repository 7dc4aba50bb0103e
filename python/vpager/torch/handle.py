"""Offloaded: the handle offload() returns; it owns the model's lifecycle
(open, unloaded, closed). Its parts, by lifetime: built once (layout.py,
placement.py, install.py), run every forward (hotpath.py, roothooks.py)
and adapted between forwards (replace.py, tuner.py: through the
access.ModelAccess it gives them). python/README.md says what each
method does."""

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..device import Device
from .access import Lifecycle
from .build import assemble, build_layout
from .devices import devstate
from . import counters
from . import ledger as _ledger
from . import patches
from .hotpath import HotPath
from .layout import Layout
from .plan import Plan
from .roothooks import RootHooks
from .serial import serialized as _serial
from .tuner import Tuner
from .units import CLOSED, OPEN, UNLOADED, refuse_copy


class Offloaded:
    """module, device (a vpager.Device), vbar, target (the torch device it
    computes on), order (the VBAR's eviction order: "interleaved", "tail",
    "scheduled": tuner.py), state; hot_path, tuner (None: not scheduled),
    vbar_layout, root_hooks: its parts, for tests and benchmarks."""

    def __init__(self, plan: Plan, dev: Optional[Device] = None) -> None:
        s = plan.settings
        lay, dev, owned = build_layout(plan, dev)
        self.module: torch.nn.Module = plan.module
        self.target: torch.device = plan.target
        self.device = dev
        self.vbar = lay.vbar
        self.vbar_layout: Layout = lay
        self.order: str = "tail" if lay.groups is None else "interleaved"
        # Staging bytes the largest unit needs at once: a shared ring the
        # tuner shrinks stays this large for this model.
        self.staging_need: int = plan.largest[1] if plan.largest else 0
        self._state = OPEN
        self._ds = devstate(dev, owned)
        self._ds.users.add(self)
        self._parts = assemble(plan, lay, self._ds, owned, Lifecycle(
            owner=self, check_open=self._check_open, is_open=self._is_open,
            unloaded=lambda: self._state is UNLOADED,
            may_replace=self._may_replace, swap=self._swap,
            scheduled=self._scheduled), lambda hooks: _ledger.track(
                self, self._ds, hooks, budget=s.budget))
        self.hot_path: HotPath = self._parts.hot_path
        self.tuner: Optional[Tuner] = self._parts.tuner
        self.root_hooks: RootHooks = self._parts.hooks

    # ------------------------------- what the parts may ask (Lifecycle)
    def _is_open(self) -> bool:
        return self._state is OPEN and not self.device.closed

    def _may_replace(self) -> bool:
        return self._is_open() and not self.hot_path.busy()

    def _swap(self, entries: list, offsets: List[int], sources: Optional[list]
              ) -> None:
        """Layout.swap(), then this model on top again (eviction lowered
        its watermark); if the old weights cannot be made again either,
        the handle is closed."""
        self.vbar_layout.swap(entries, offsets, sources, self.close)
        self.vbar_layout.on_top()
        self._ds.top = self

    def _scheduled(self) -> None:
        self.order = "scheduled"

    def _check_open(self) -> None:
        if self._state is not OPEN:
            raise RuntimeError(
                "vpager.torch: this module's offload was %s%s" % (
                    self._state, "; its weights were freed (close())"
                    if self._state is CLOSED else ""))
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
                "%s>" % (self._state, type(self.module).__name__,
                         len(self.vbar_layout.entries), self.weight_bytes,
                         self.target))

    def __enter__(self) -> "Offloaded":
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._state is OPEN:
            self.unload()
        return False

    __deepcopy__ = __reduce_ex__ = refuse_copy

    @property
    def state(self) -> str:
        """"open", "unloaded" (unload() ran) or "closed" (close() ran)."""
        return self._state

    @property
    def closed(self) -> bool:
        """True once unload() or close() ran."""
        return self._state is not OPEN

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
        from (its host copy, a file in place or read, or sources=)."""
        self._check_open()
        return self.vbar_layout.describe()

    @_serial
    def load_safetensors(self, path: str) -> "Offloaded":
        """vpager.torch.load_safetensors(self, path): see there (sources
        set by set_source() are dropped: every weight is the file's)."""
        self._check_open()
        self._idle("load_safetensors")
        patches.load_file(self.vbar_layout, self.module, path, self._swap,
                          self._parts.install.outside)
        return self

    @_serial
    def set_source(self, name: str, tensor: Optional[torch.Tensor] = None
                   ) -> None:
        """Weight `name` (as layout() names it) takes its bytes from
        `tensor` (its dtype and shape, any device) from now on; None: its
        own bytes again. Only it refills, at its next acquire. For weights
        a loader patches (ComfyUI's LoRA): patches.set_source."""
        self._check_open()
        patches.set_source(self.vbar_layout, name, tensor,
                           type(self.module).__name__)

    @_serial
    def set_fill(self, name: str, fill: Optional[Callable] = None) -> None:
        """fill(view) rewrites weight `name`'s bytes on the device each
        time they come from its source (None: no more): patches.set_fill."""
        self._check_open()
        patches.set_fill(self.vbar_layout, name, fill,
                         type(self.module).__name__)

    @_serial
    def place_by_use(self) -> bool:
        """Re-place the weights in the order their units were first used,
        for models whose root forward never runs (a VAE's decode); once.
        True if they moved; not inside a forward (python/README.md)."""
        return self._parts.recorder.finish()

    @_serial
    def refine(self) -> bool:
        """At a pause between runs: a placement the schedule kept over a
        faster plan while it measured is placed now (tuner.Tuner.refine;
        python/README.md). True if that plan was asked for."""
        self._check_open()
        return self.tuner is not None and self.tuner.refine()

    def stats(self) -> Dict[str, Any]:
        """{"model": this model's counters and sizes, "device": the
        device's counters (all models on it), "schedule": schedule(),
        "governor": the device's Governor}: counters.py, and
        python/README.md's "stats()" for every key."""
        self._check_open()
        ds = self._ds
        return counters.handle_stats(self, self.vbar_layout, ds.gov, ds.lender)

    def schedule(self) -> Optional[Dict[str, Any]]:
        """What the schedule chose after the first forward, or None (not
        scheduled, or before that forward): tuner.Tuner.describe()."""
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
        self.vbar_layout.on_top()
        self._ds.top = self

    @_serial
    def pause(self) -> None:
        """Its forwards pause longer than between two of a run: torch's
        blocks its last forward's end lent go back now (python/README.md)."""
        self._check_open()
        self.hot_path.give_back()

    @contextlib.contextmanager
    def acquired(self, *modules: torch.nn.Module
                 ) -> Iterator[torch.nn.Module]:
        """Acquire weights for the block: those of the given submodules
        (their subtrees), or every weight of the model (the staging ring
        then holds all that is not resident; python/README.md)."""
        self._check_open()
        yield from self.hot_path.acquired(self.module, modules)

    @property
    def busy(self) -> bool:
        """True inside a unit's forward or an acquired() block."""
        return self.hot_path.busy()

    @property
    def recording(self) -> bool:
        """True until the weights were placed in their order of use."""
        return self._parts.recorder.recording

    @property
    def replaced(self) -> int:
        """Re-placements in the order of use (0 or 1: place_by_use())."""
        return self._parts.recorder.replaced

    @property
    def oom_margin(self) -> int:
        """Bytes its device's out-of-memory retries added to the headroom."""
        return self._ds.gov.oom_margin

    @_serial
    def free_memory(self, nbytes: int) -> int:
        """Evict at least `nbytes` of this model's unpinned pages (as many
        as it has if fewer); returns the bytes freed (python/README.md)."""
        self._check_open()
        if nbytes <= 0:
            return 0
        freed = self.vbar.free_memory(min(int(nbytes), 1 << 62))
        if self._ds.top is self:
            self._ds.top = None
        return freed

    @_serial
    def unload(self) -> torch.nn.Module:
        """Parameters back as ordinary tensors on their device (from the
        host copy), wrappers and hooks removed, vpager objects freed: the
        module as before offload(). Again: nothing; after close(): raises."""
        if self._state is UNLOADED:
            return self.module
        if self._state is CLOSED:
            raise RuntimeError("vpager.torch: unload() after close(): the "
                               "weights were freed")
        self._check_open()          # the device (and host copy) still there
        self._idle("unload")
        # Pages evicted (room for a GPU model), tensors back, then the VBAR
        # closed: a failed restore leaves the model offloaded and working.
        self.vbar.free_memory(1 << 62)
        self._parts.install.restore()
        self._state = UNLOADED
        self._parts.remove()
        self._parts.free(self.device, self)
        return self.module

    @_serial
    def close(self) -> None:
        """Free the vpager objects without restoring the weights: the
        module's forward and state_dict() raise RuntimeError; a second
        call, or one after unload(), does nothing (outside="host": the
        tensors' CPU placeholders, python/README.md)."""
        if self._state is not OPEN:
            return
        self._idle("close")
        self._state = CLOSED
        self.hot_path.set_held(())
        self.hot_path.staged.clear()
        self._parts.install.orphan()
        self._parts.free(self.device, self)
