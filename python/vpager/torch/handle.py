"""Offloaded: the handle offload() returns. It is built from a Plan
(api.py: what offload() found and was asked) and small collaborators: the
vpager.Device (devices.py), the Layout of the weights in the VBAR
(layout.py), the HotPath that wraps each unit's forward (hotpath.py) and
the Recorder that re-places the weights in execution order (replace.py).
It installs them into the module (placeholders, wrappers, state_dict
hooks) and takes them out again at unload()."""

import contextlib
import functools

import torch

from .. import env
from ..weights import Source, WeightBatch
from .devices import (attach, devstate, DEVSTATES, leave, open_for,
                      SIZED_RINGS)
from . import counters
from . import ledger as _ledger
from .hotpath import HotPath
from .layout import Layout
from .replace import Recorder
from .serial import lock_root, unlock_root
from . import tuner as _tuner
from .sources import host_copy, host_memory, outside
from .units import CLOSED, OPEN, UNLOADED, Unit, refuse_copy, unmanaged
from .views import placeholder


def _serial(method):
    """The method changes the model: it waits for a forward running on
    another thread (serial.py)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._hot.lock:
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


class Offloaded:
    """The handle offload() returns: module, device (the vpager.Device),
    vbar, target (the torch device it computes on), order (the VBAR's
    eviction order: "interleaved", "tail", or "scheduled" once the copy
    schedule ranks its pages: tuner.py); stats(), schedule(), residency(),
    page_flags(),
    layout(), units(), prioritize(), acquired(), load_safetensors(),
    unload(), close(). See python/README.md."""

    def __init__(self, plan, dev=None):
        self.module = plan.module
        # The submodule whose forward is one step (offload(root=)): the
        # hooks that learn, record and measure go there.
        self._root = plan.settings.root or plan.module
        self._outside = plan.settings.outside
        self._keep_rest = plan.settings.tensors is not None
        self.target = plan.target
        self._owners = plan.owners
        self._state = OPEN
        self._hooks = []
        self._moved = []
        self._held = 0              # acquired() blocks open
        s = plan.settings
        s.scheduled = _tuner.enabled(s, dev is not None)
        dev, owned = _open_device(plan, dev)
        try:
            lay = Layout.build(dev, plan)
        except BaseException:
            if owned:
                DEVSTATES.pop(dev, None)
                dev.close()
            raise
        self.device = dev
        # Staging bytes the largest unit needs at once: a shared ring the
        # tuner shrinks stays this large for this model.
        self.staging_need = plan.largest[1] if plan.largest else 0
        self.vbar = lay.vbar
        self.order = "tail" if lay.groups is None else "interleaved"
        self._layout = lay
        self._ds = devstate(dev, owned)
        self._ds.users.add(self)
        self._recorder = Recorder(lay, self._may_replace, self._swap)
        self._hot = HotPath(self, lay, self._ds, self.target, self._recorder)
        self._tuner = None
        if s.scheduled:
            self._tuner = _tuner.Tuner(
                self, lay, self._ds, self.target,
                windows=(s.lookahead is None and "lookahead" not in s.options
                         and not env.given("VPAGER_LOOKAHEAD")),
                resize=((owned or dev in SIZED_RINGS)
                        and "staging_size" not in s.options
                        and not env.given("VPAGER_STAGING")))
            self._hot.tuner = self._tuner
        self._install(plan.settings.reorder)
        _ledger.track(self, budget=plan.settings.budget)

    # ------------------------------------------------------ installing
    def _install(self, reorder=True):
        self._placeholders()
        self._move_unmanaged()
        if any(e.src_device.type == "cuda" for e in self._layout.entries):
            torch.cuda.empty_cache()    # the old storage is vpager's now
        for u in self._layout.units:
            fwd = u.module.forward
            u.had_forward = "forward" in u.module.__dict__
            u.saved_forward = u.module.__dict__.get("forward")
            u.module.forward = self._hot.wrap(u, fwd)
        # Outermost, so the held units' weights are held around all of it.
        r = self._root
        self._root_forward = ("forward" in r.__dict__,
                              r.__dict__.get("forward"))
        r.forward = self._hot.wrap_root(r.forward)
        lock_root(r, self._hot.lock)    # around its hooks too
        # outside="host": the tensors hold their bytes, state_dict() needs
        # no copies (and the loader that asked for it owns loading).
        for m, items in (self._owners if self._outside != "host" else ()):
            self._hooks.append(m._register_state_dict_hook(
                functools.partial(self._state_dict_hook, items)))
            self._hooks.append(m._register_load_state_dict_pre_hook(
                functools.partial(self._load_hook, items)))
        if self.target.type == "cuda":     # activations first
            self._hooks.append(self._root.register_forward_pre_hook(
                self._hot.learn_hook))
        if reorder and len(self._layout.units) > 1:
            self._recorder.install(self._root)
        if self._tuner is not None:     # after the Recorder's hooks
            self._tuner.install(self._root)

    def _placeholders(self):
        with torch.no_grad(), torch.inference_mode(False):
            for e in self._layout.entries:
                t = e.tensor
                if e.is_param:
                    t.requires_grad_(False)
                e.ph = (outside(e) if self._outside == "host"
                        else placeholder(e.dtype, e.shape, self.target))
                e.ph_ptr = e.ph.data_ptr()
                t.data = e.ph
                t._vpager_handle = self

    def _move_unmanaged(self):
        """The tensors vpager leaves alone go to the target device (unless
        offload(tensors=) chose them: then they are the caller's)."""
        if self._keep_rest:
            return
        managed = {id(e.tensor) for e in self._layout.entries}
        with torch.no_grad(), torch.inference_mode(False):
            for d, k, t, is_param in unmanaged(self.module, managed):
                if t.device == self.target:
                    continue
                moved = t.to(self.target)
                self._moved.append((d, k, t, is_param, t.device))
                if is_param:
                    t.data = moved
                else:
                    d[k] = moved

    def _uninstall(self):
        self._hot.set_held(())
        unlock_root(self._root)
        had, saved = self._root_forward    # first: the units' may be under
        if had:
            self._root.forward = saved
        else:
            self._root.__dict__.pop("forward", None)
        for u in self._layout.units:
            if u.had_forward:
                u.module.forward = u.saved_forward
            else:
                u.module.__dict__.pop("forward", None)
            u.batch = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._recorder.remove()
        if self._tuner is not None:
            self._tuner.remove()
        self._hot.staged.clear()
        for e in self._layout.entries:
            e.forget_views()
            try:
                del e.tensor._vpager_handle
            except AttributeError:
                pass

    def _learn(self):
        """What a CUDA root forward does first: devices.learn_headroom()."""
        self._hot.learn()

    # --------------------------------------------------- re-placement
    def _may_replace(self):
        return (self._state is OPEN and not self.device.closed
                and not self._busy())

    def _swap(self, entries, offsets, sources):
        """Layout.swap(), then this model on top again (eviction lowered
        its watermark); if the old weights cannot be made again either,
        the handle is closed."""
        self._layout.swap(entries, offsets, sources, self.close)
        self.vbar.prioritize()
        self._ds.top = self

    # ------------------------------------------------------ state_dict
    def _check_open(self):
        if self._state is not OPEN:
            raise RuntimeError(
                "vpager.torch: this module's offload was %s%s" % (
                    self._state, "; its weights were freed (close())"
                    if self._state is CLOSED else ""))
        if self.device.closed:
            raise RuntimeError("vpager.torch: the vpager.Device of this "
                               "offloaded module was closed")

    def _state_dict_hook(self, items, module, state_dict, prefix,
                         local_metadata):
        self._check_open()
        with torch.no_grad(), torch.inference_mode(False):
            for name, e in items:
                key = prefix + name
                if key in state_dict:
                    state_dict[key] = host_copy(e)

    def _load_hook(self, items, state_dict, prefix, *rest):
        for name, e in items:
            if prefix + name in state_dict and self._state is not UNLOADED:
                raise RuntimeError(
                    "vpager.torch: load_state_dict() into an offloaded "
                    "module (%s%s): load before offload(), or unload() "
                    "first" % (prefix, name))

    # ------------------------------------------------------------ public
    def __repr__(self):
        return ("<vpager.torch.Offloaded %s of %s: %d weights, %d bytes on "
                "%s>" % (self._state, type(self.module).__name__,
                         len(self._layout.entries), self.weight_bytes,
                         self.target))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._state is OPEN:
            self.unload()
        return False

    __deepcopy__ = __reduce_ex__ = refuse_copy

    @property
    def closed(self):
        """True once unload() or close() ran."""
        return self._state is not OPEN

    @property
    def weight_bytes(self):
        return sum(e.size for e in self._layout.entries)

    def units(self):
        """[(qualified name, module, [weight names])] in placement order."""
        return [(u.name, u.module, [e.name for e in u.entries])
                for u in self._layout.units]

    def layout(self):
        """[(weight name, VBAR offset, bytes, "host", "file" or "source")]
        in VBAR order: where each weight lives and where its bytes come
        from (its host copy, the safetensors file, or offload(sources=))."""
        self._check_open()
        return self._layout.describe()

    @_serial
    def load_safetensors(self, path):
        """vpager.torch.load_safetensors(self, path): see there (sources
        set by set_source() are dropped: every weight is the file's)."""
        self._check_open()
        self._idle("load_safetensors")
        self._layout.reload(self.module, path, self._swap)
        for e in self._layout.entries:
            e.own = None
            self._drop_alt(e)
            if self._outside == "host":
                self._repoint(e, outside(e))
        return self

    def _entry(self, name):
        for e in self._layout.entries:
            if e.name == name:
                return e
        raise KeyError("vpager.torch: %r is not a weight of this offloaded "
                       "%s (names: layout())" % (name,
                                                 type(self.module).__name__))

    @staticmethod
    def _drop_alt(e):
        if e.alt is not None:
            if not e.alt.closed:
                e.alt.close()
            e.alt = None

    @staticmethod
    def _repoint(e, t):
        e.ph = t
        e.ph_ptr = t.data_ptr()
        if not e.cur:
            with torch.no_grad(), torch.inference_mode(False):
                e.tensor.data = t

    @_serial
    def set_source(self, name, tensor=None):
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
        e = self._entry(name)
        if e.cur:
            raise RuntimeError("vpager.torch: set_source(%r) while the "
                               "weight is acquired" % name)
        if tensor is None:
            if e.own is None:
                return
            self._layout.set_source(e, e.own)
            e.own = None
            self._drop_alt(e)
            return
        if tensor.dtype != e.dtype or tuple(tensor.shape) != e.shape:
            raise ValueError("vpager.torch: set_source(%r): a %s %s tensor, "
                             "the weight is %s %s"
                             % (name, tensor.dtype, tuple(tensor.shape),
                                e.dtype, e.shape))
        # Filled, then page-locked (as offload()'s host copy): a weight
        # patched on the GPU is copied straight in.
        host, buf = host_memory(e.size)
        with torch.no_grad(), torch.inference_mode(False):
            if e.size:
                host.view(e.dtype).view(e.shape).copy_(tensor.detach())
        hb = self.device.register_hostbuf(buf, max(e.size, 1))
        try:
            own = e.own if e.own is not None else e.src
            self._layout.set_source(e, Source.from_host(hb.ptr))
        except BaseException:
            hb.close()
            raise
        e.own = own
        self._drop_alt(e)
        e.alt = hb

    @_serial
    def place_by_use(self):
        """Re-place the weights in the order their units were first used
        since offload(), as the first forward of the root does; for models
        whose root forward never runs (a VAE's decode). Once; returns True
        if the weights moved (each then fills anew at its next acquire).
        Not inside a forward (returns False)."""
        return self._recorder.finish()

    def stats(self):
        """{"model": this model's counters and sizes, "device": the
        device's counters (all models on it), "schedule": schedule(),
        "governor": the device's Governor}: counters.py, and
        python/README.md's "stats()" for every key."""
        self._check_open()
        return counters.handle_stats(self, self._layout, self._ds.gov)

    def schedule(self):
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
        t = self._tuner
        if t is None or t.schedule is None:
            return None
        sch = t.schedule
        return {"predicted_ms": sch.predicted * 1e3,
                "all_resident_ms": sch.all_resident * 1e3,
                "streamed_bytes": sch.streamed,
                "resident_bytes": sch.resident_bytes,
                "resident_weights": sum(sch.resident),
                "held_units": len(self._hot.held_units),
                "staging": t.ring, "link": t.link,
                "planned_for": t.planned_for, "replans": t.replans,
                "measured": t.rounds,
                "rings": [{"staging": r, "predicted_ms": c.predicted * 1e3,
                           "streamed_bytes": c.streamed}
                          for r, c in t.rings],
                "windows": list(sch.window) if t.windows else None}

    def residency(self):
        """The VBAR's pages as a map: "#" resident, "P" pinned, "." not."""
        return counters.residency_map(self.page_flags())

    def page_flags(self):
        """One byte per VBAR page: vpager.PAGE_RESIDENT | PAGE_PINNED."""
        self._check_open()
        return self.vbar.residency()

    def report(self, json=False):
        """The device's report (all models on it): text, or parsed JSON."""
        self._check_open()
        return self.device.report(json=json)

    @_serial
    def prioritize(self):
        """Move this model's VBAR to the top of the device's priority list
        (done automatically when its forward starts after another model's)."""
        self._check_open()
        self.vbar.prioritize()
        self._ds.top = self

    def _whole(self, modules):
        """A Unit holding the weights of `modules` (all if none), and the
        units it covers."""
        lay = self._layout
        entries = lay.entries
        if modules:
            ids = {id(t) for m in modules
                   for t in list(m.parameters()) + list(m.buffers())}
            entries = [e for e in entries if id(e.tensor) in ids]
        whole = Unit("acquired()", self.module)
        whole.entries = entries
        whole.batch = WeightBatch(self.device,
                                  [lay.weight(e) for e in entries])
        held = {id(e) for e in entries}
        covered = [u for u in lay.units
                   if all(id(e) in held for e in u.entries)]
        return whole, covered

    @contextlib.contextmanager
    def acquired(self, *modules):
        """Acquire weights for the block: those of the given submodules
        (their subtrees), or every weight of the model (then the staging
        ring must hold all that is not resident). For code that reads
        parameters outside the forward of the unit holding them; forwards
        inside the block use the same tensors."""
        self._check_open()
        with self._hot.lock:     # the block is a forward's (serial.py)
            yield from self._acquired(modules)

    def _acquired(self, modules):
        whole, covered = self._whole(modules)
        stream, prev = self._hot.enter(whole)
        for u in covered:
            u.depth += 1
        self._held += 1
        ok = False
        try:
            yield self.module
            ok = True
        finally:
            self._held -= 1
            for u in covered:
                u.depth -= 1
            self._hot.leave(whole, stream, prev, ok)

    def _busy(self):
        return (self._held or self._hot.holding is not None
                or any(u.depth for u in self._layout.units))

    @property
    def busy(self):
        """True inside a unit's forward or an acquired() block."""
        return bool(self._busy())

    @property
    def recording(self):
        """True until the weights were placed in the order of use (the
        first forward of the root, or place_by_use())."""
        return self._recorder.recording

    @property
    def replaced(self):
        """How many times the weights were re-placed in the order of use
        (0 or 1: at the first forward of the root, or place_by_use())."""
        return self._recorder.replaced

    @property
    def oom_margin(self):
        """Bytes the out-of-memory retries on its device added to the
        headroom learned from torch (0 before any retry)."""
        return self._ds.gov.oom_margin

    @_serial
    def free_memory(self, nbytes):
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

    def _idle(self, what):
        if self._busy():
            raise RuntimeError("vpager.torch: %s() inside the module's "
                               "forward" % what)

    @_serial
    def unload(self):
        """Parameters back as ordinary tensors on their original device
        (from the host copy), requires_grad restored, wrappers and hooks
        removed, vpager objects freed. The module works as before offload().
        A second call does nothing; after close() it raises."""
        if self._state is UNLOADED:
            return self.module
        if self._state is CLOSED:
            raise RuntimeError("vpager.torch: unload() after close(): the "
                               "weights were freed")
        self._check_open()          # the device (and host copy) still there
        self._idle("unload")
        # Device memory first: a GPU model needs the room to come back.
        self.vbar.close()
        self._restore()
        self._state = UNLOADED
        self._uninstall()
        self._free()
        return self.module

    def _restore(self):
        with torch.no_grad(), torch.inference_mode(False):
            for e in self._layout.entries:
                t = e.tensor
                if e.keep is not None and e.file_addr is None:
                    t.data = e.keep         # the caller's source's tensor
                elif e.host is None:        # file-backed
                    t.data = host_copy(e).to(e.src_device)
                else:
                    t.data = (e.host.clone() if e.src_device.type == "cpu"
                              else e.host.to(e.src_device))
                if e.is_param:
                    t.requires_grad_(e.requires_grad)
            for d, k, t, is_param, where in self._moved:
                if is_param:
                    t.data = t.data.to(where)
                elif d.get(k) is not None:
                    d[k] = d[k].to(where)

    @_serial
    def close(self):
        """Free the vpager objects without restoring the weights; the module
        is left unusable (its forward and state_dict() raise RuntimeError).
        A second call, or close() after unload(), does nothing. With
        outside="host" the tensors get CPU placeholders (their host copy
        is freed), except those over a caller's source (sources=), which
        keep the caller's tensor."""
        if self._state is not OPEN:
            return
        self._idle("close")
        self._state = CLOSED
        self._hot.set_held(())
        with torch.no_grad(), torch.inference_mode(False):
            self._hot.staged.clear()
            for e in self._layout.entries:
                e.forget_views()
                if self._outside == "host":
                    e.tensor.data = (e.keep if e.keep is not None and
                                     e.file_addr is None else
                                     placeholder(e.dtype, e.shape, "cpu"))
        self._free()

    def _free(self):
        for e in self._layout.entries:
            e.host = e.file_addr = e.src = e.keep = e.own = None
        errors = self._layout.close()
        for e in self._layout.entries:
            self._drop_alt(e)
        errors += leave(self.device, self._ds, self)
        if errors:
            raise errors[0]
