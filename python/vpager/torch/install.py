"""Installation: what offload() changes in the module, and how unload()
and close() change it back. Each managed tensor gets a placeholder (or,
with outside="host", its host copy) until a forward acquires it; each
unit's forward is wrapped by the hot path (hotpath.py); the tensors
vpager leaves alone go to the target device; the modules owning managed
tensors get state_dict hooks (a host copy out, no loading in). The root's
hooks are RootHooks' (roothooks.py).

offload() is all or nothing: until commit() the tensors' own data are
kept, and undo() puts every change install() made back exactly."""

import functools
from typing import Any, Callable, List

import torch

from .layout import Layout
from .sources import host_copy, outside
from .units import unmanaged
from .views import placeholder


class Installation:
    """The module's side of one offloaded model. owner: the handle
    (each managed tensor's `_vpager_handle`); check_open() raises unless
    the model is open; unloaded() says whether unload() ran."""

    def __init__(self, module: torch.nn.Module, layout: Layout,
                 target: torch.device, outside_mode: Any, keep_rest: bool,
                 owners: list, owner: Any, check_open: Callable[[], None],
                 unloaded: Callable[[], bool]) -> None:
        self.module = module
        self.layout = layout
        self.target = target
        self.outside = outside_mode
        self.keep_rest = keep_rest    # offload(tensors=): the rest is theirs
        self.owners = owners
        self.owner = owner
        self.check_open = check_open
        self.unloaded = unloaded
        self.hooks: List[Any] = []      # the owners' state_dict hooks
        self.moved: List[tuple] = []    # unmanaged tensors moved to target
        self.wrapped: List[Any] = []    # the units whose forward is wrapped
        # (Entry, its tensor's data before its placeholder): until commit()
        self.saved: List[tuple] = []

    def install(self, wrap: Callable) -> None:
        """Placeholders in, the rest moved, each unit's forward replaced by
        wrap(unit, forward), the state_dict hooks registered. On an error
        what it did is undone (undo()) and the error raised."""
        try:
            self._install(wrap)
        except BaseException:
            self.undo()
            raise

    def _install(self, wrap: Callable) -> None:
        self._placeholders()
        self._move_unmanaged()
        for u in self.layout.units:
            fwd = u.module.forward
            u.had_forward = "forward" in u.module.__dict__
            u.saved_forward = u.module.__dict__.get("forward")
            u.module.forward = wrap(u, fwd)
            self.wrapped.append(u)
        # outside="host": the tensors hold their bytes, state_dict() needs
        # no copies (and the loader that asked for it owns loading).
        for m, items in (self.owners if self.outside != "host" else ()):
            self.hooks.append(m._register_state_dict_hook(
                functools.partial(self._state_dict_hook, items)))
            self.hooks.append(m._register_load_state_dict_pre_hook(
                functools.partial(self._load_hook, items)))

    def _placeholders(self) -> None:
        with torch.no_grad(), torch.inference_mode(False):
            for e in self.layout.entries:
                t = e.tensor
                self.saved.append((e, t.data))
                if e.is_param:
                    t.requires_grad_(False)
                e.ph = (outside(e) if self.outside == "host"
                        else placeholder(e.dtype, e.shape, self.target))
                e.ph_ptr = e.ph.data_ptr()
                t.data = e.ph
                t._vpager_handle = self.owner

    def _move_unmanaged(self) -> None:
        """The tensors vpager leaves alone go to the target device (unless
        offload(tensors=) chose them: then they are the caller's)."""
        if self.keep_rest:
            return
        managed = {id(e.tensor) for e in self.layout.entries}
        with torch.no_grad(), torch.inference_mode(False):
            for d, k, t, is_param in unmanaged(self.module, managed):
                if t.device == self.target:
                    continue
                moved = t.to(self.target)
                self.moved.append((d, k, t, is_param, t.device))
                if is_param:
                    t.data = moved
                else:
                    d[k] = moved

    def commit(self) -> None:
        """offload() succeeded: the tensors' old data are dropped (a GPU
        model's storage is vpager's now)."""
        self.saved = []
        if any(e.src_device.type == "cuda" for e in self.layout.entries):
            torch.cuda.empty_cache()

    def undo(self) -> None:
        """Before commit(): the module exactly as before install() (its
        tensors' own data, requires_grad, forwards; the rest moved back;
        no state_dict hooks). After the root's RootHooks.remove()."""
        self._unwrap(self.wrapped)
        with torch.no_grad(), torch.inference_mode(False):
            self._move_back()
            for e, data in reversed(self.saved):
                e.tensor.data = data
                if e.is_param:
                    e.tensor.requires_grad_(e.requires_grad)
        self.saved, self.moved = [], []
        self._forget()

    def uninstall(self) -> None:
        """The units' own forwards back, the state_dict hooks removed, the
        views forgotten (after the root's RootHooks.remove(): the root's
        saved forward may be a unit's wrapper)."""
        self._unwrap(self.layout.units)
        self._forget()

    def _unwrap(self, units: List[Any]) -> None:
        for u in units:
            if u.had_forward:
                u.module.forward = u.saved_forward
            else:
                u.module.__dict__.pop("forward", None)
            u.batch = None
        self.wrapped = []

    def _forget(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for e in self.layout.entries:
            e.forget_views()
            try:
                del e.tensor._vpager_handle
            except AttributeError:
                pass

    def restore(self) -> None:
        """The tensors' bytes back on their original devices (unload()).
        All or nothing: every tensor is made before any is put back, so
        a failure (no room on the GPU, a file's read) changes nothing."""
        self.layout.wait_loaded()       # the bytes are the host copy's
        with torch.no_grad(), torch.inference_mode(False):
            back = [(e, self._original(e)) for e in self.layout.entries]
            for e, data in back:
                e.tensor.data = data
                if e.is_param:
                    e.tensor.requires_grad_(e.requires_grad)
            self._move_back()

    @staticmethod
    def _original(e: Any) -> torch.Tensor:
        """A weight's bytes as a tensor on its original device."""
        if e.keep is not None and e.file_addr is None:
            return e.keep               # the caller's source's tensor
        if e.host is None:              # file-backed
            return host_copy(e).to(e.src_device)
        return (e.host.clone() if e.src_device.type == "cpu"
                else e.host.to(e.src_device))

    def _move_back(self) -> None:
        """The tensors _move_unmanaged() moved, back where they were."""
        for d, k, t, is_param, where in self.moved:
            if is_param:
                t.data = t.data.to(where)
            elif d.get(k) is not None:
                d[k] = d[k].to(where)

    def orphan(self) -> None:
        """close(): the views forgotten; with outside="host" the tensors get
        CPU placeholders (their host copy is about to be freed), except
        those over a caller's source, which keep the caller's tensor."""
        with torch.no_grad(), torch.inference_mode(False):
            for e in self.layout.entries:
                e.forget_views()
                if self.outside == "host":
                    e.tensor.data = (e.keep if e.keep is not None and
                                     e.file_addr is None else
                                     placeholder(e.dtype, e.shape, "cpu"))

    # ------------------------------------------------------ state_dict
    def _state_dict_hook(self, items, module, state_dict, prefix,
                         local_metadata):
        self.check_open()
        self.layout.wait_loaded()       # the bytes are the host copy's
        with torch.no_grad(), torch.inference_mode(False):
            for name, e in items:
                key = prefix + name
                if key in state_dict:
                    state_dict[key] = host_copy(e)

    def _load_hook(self, items, state_dict, prefix, *rest):
        for name, e in items:
            if prefix + name in state_dict and not self.unloaded():
                raise RuntimeError(
                    "vpager.torch: load_state_dict() into an offloaded "
                    "module (%s%s): load before offload(), or unload() "
                    "first" % (prefix, name))
