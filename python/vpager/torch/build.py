"""What offload() builds for a Plan (plan.py), once: the device opened
for it (or a shared one set up for it), the Layout (the VBAR, the weights,
their sources: layout.py; all or nothing: a device opened here is closed
again if the layout cannot be built), then the model's parts (Parts:
what runs each forward and what adapts between forwards), wired to each
other and installed in the module (all or nothing too: assemble() undoes
what it installed when a step fails, and the handle frees the layout)."""

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from .. import env
from ..errors import Error
from .access import Lifecycle, ModelAccess
from .devices import attach, DEVSTATES, leave, open_for, SIZED_RINGS
from .hotpath import HotPath
from .install import Installation
from .keptfills import KeptFills
from .layout import Layout
from .patches import drop_alt
from .replace import Recorder
from .roothooks import RootHooks
from .sources import release_host
from . import tuner


def _open_device(plan: Any, dev: Any) -> Tuple[Any, bool]:
    """(device, owned): dev set up for the plan, or one opened for it."""
    s = plan.settings
    if dev is None:
        return open_for(plan.target, s.budget, s.lookahead, s.options,
                        plan.largest, scheduled=s.scheduled), True
    attach(dev, s.budget, s.lookahead, plan.largest)
    return dev, False


def build_layout(plan: Any, dev: Any = None) -> Tuple[Layout, Any, bool]:
    """(Layout, device, owned): whether the plan is scheduled decided
    (plan.settings.scheduled), the device opened or set up, the layout
    built on it."""
    s = plan.settings
    s.scheduled = tuner.enabled(s, dev is not None)
    dev, owned = _open_device(plan, dev)
    try:
        return Layout.build(dev, plan), dev, owned
    except BaseException:
        if owned:
            DEVSTATES.pop(dev, None)
            dev.close()
        raise


def tuner_freedom(settings: Any, dev: Any, owned: bool) -> Tuple[bool, bool]:
    """(windows, resize): the tuner may set each unit's prefetch window
    (not when lookahead= or VPAGER_LOOKAHEAD was given) and resize the
    staging ring (when vpager.torch sized it and neither staging_size=
    nor VPAGER_STAGING was given)."""
    s = settings
    windows = (s.lookahead is None and "lookahead" not in s.options
               and not env.given("VPAGER_LOOKAHEAD"))
    resize = ((owned or dev in SIZED_RINGS)
              and "staging_size" not in s.options
              and not env.given("VPAGER_STAGING"))
    return windows, resize


@dataclass
class Parts:
    """One offloaded model's parts: its layout (built once), the
    Installation in its module, the root's RootHooks, the HotPath (every
    forward), the Recorder and the Tuner (None: not scheduled) that adapt
    it between forwards; kept, the fills kept on the host for the
    weights the schedule streams (None: not scheduled); ds, its device's
    DevState."""

    layout: Layout
    ds: Any
    install: Installation
    hooks: RootHooks
    hot_path: HotPath
    recorder: Recorder
    tuner: Optional[tuner.Tuner]
    kept: Optional[KeptFills] = None

    def remove(self) -> None:
        """Everything taken out of the module (unload(), after restore)."""
        self.hot_path.set_held(())
        self.hooks.remove()     # first: the units' forwards may be under
        self.install.uninstall()
        self.recorder.remove()
        if self.tuner is not None:
            self.tuner.remove()
        self.hot_path.staged.clear()

    def undo(self) -> None:
        """Everything assemble() installed taken out, the module's tensors
        their own again (an offload() that failed before its end)."""
        self.hooks.remove()
        self.recorder.remove()
        if self.tuner is not None:
            self.tuner.remove()
        self.install.undo()

    def free(self, device: Any, owner: Any) -> None:
        """free(): unload(), close(); torch's blocks lent by the model's
        last forward given back first (lend.py)."""
        self.hot_path.give_back()
        if self.kept is not None:
            self.kept.close()
        free(self.layout, self.ds, device, owner)


def free(lay: Layout, ds: Any, device: Any, owner: Any) -> None:
    """The vpager objects freed (unload(), close(), a failed offload()):
    the sources, the VBAR and its weights, the patches; the device left
    by `owner` (and closed if it was opened for it and nobody else uses
    it)."""
    for e in lay.entries:
        e.host = e.file_addr = e.src = e.keep = e.own = None
    errors = lay.close()
    for e in lay.entries:
        drop_alt(e)
    errors += leave(device, ds, owner)
    if errors:
        raise errors[0]


def assemble(plan: Any, lay: Layout, ds: Any, owned: bool,
             life: Lifecycle, track: Callable[[RootHooks], None]) -> Parts:
    """The parts of the model `plan` describes, laid out in `lay`, wired
    and installed: placeholders and the units' wrappers in the module, the
    root's hooks in their order (roothooks.py); then track(root hooks)
    (the ledger's). All or nothing: when a step fails, what was installed
    is undone (Parts.undo()), tensors over their host copy get their own
    (as when Layout.build() fails), the layout is freed and the device
    left by life.owner (free()), and the step's error raised. A host copy
    filled behind offload() (hostload.py) starts at the end."""
    parts = None
    try:
        parts = _parts(plan, lay, ds, owned, life)
        _install(parts, plan)
        track(parts.hooks)
    except BaseException:
        if parts is not None:
            parts.undo()
        release_host(lay.entries)   # the host copy is about to go
        try:
            free(lay, ds, lay.device, life.owner)
        except Error:
            pass                # the step's error is the one to see
        raise
    parts.install.commit()
    if lay.loading is not None:     # the host copy behind offload(), now
        lay.loading.start()         # (after the guess measured the link)
    return parts


def _parts(plan: Any, lay: Layout, ds: Any, owned: bool,
           life: Lifecycle) -> Parts:
    """The parts, wired to each other; nothing installed yet."""
    s = plan.settings
    # The submodule whose forward is one step (offload(root=)): the
    # hooks that learn, record and measure go there.
    hooks = RootHooks(s.root or plan.module)
    recorder = Recorder(lay, life.may_replace, life.swap, hooks,
                        keep_offsets=s.scheduled)
    hot = HotPath(life.owner, lay, ds, plan.target, recorder,
                  life.check_open, life.is_open)
    tune = kept = None
    if s.scheduled:
        def hold(units):
            hot.set_held(units)
            return hot.held_units
        access = ModelAccess(
            busy=hot.busy, may_replace=life.may_replace, swap=life.swap,
            scheduled=life.scheduled, hold=hold,
            held=lambda: hot.held_units, lend_at=hot.lend_at,
            stream=hot.stream,
            cuda_index=hot.index)
        windows, resize = tuner_freedom(s, lay.device, owned)
        tune = hot.tuner = tuner.Tuner(access, hooks, lay, ds, plan.target,
                                       windows, resize)
        kept = hot.keeper = KeptFills(lay, hooks, tune.streamed)
    install = Installation(plan.module, lay, plan.target, s.outside,
                           s.tensors is not None, plan.owners, life.owner,
                           life.check_open, life.unloaded)
    return Parts(lay, ds, install, hooks, hot, recorder, tune, kept)


def _install(parts: Parts, plan: Any) -> None:
    """The parts installed in the module and on its root."""
    s, hot, hooks = plan.settings, parts.hot_path, parts.hooks
    parts.install.install(hot.wrap)
    hooks.install(hot.lock, hot.wrap_root)
    if plan.target.type == "cuda":     # activations first
        hooks.set("learn", pre=hot.learn_hook)
    if s.reorder and len(parts.layout.units) > 1:
        parts.recorder.install()
    if parts.tuner is not None:
        parts.tuner.install()
        parts.tuner.guess()
