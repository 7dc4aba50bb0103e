"""Forwards of one offloaded model run one at a time.

A unit's weights are pointed at by its module's own tensors while it
runs (`e.tensor.data`, the held Parameters): state of the module, not of
the calling thread. Two threads in one model would point the same
tensors at each other's acquires and release what the other still
reads. So every way into the model takes the model's lock: the root's
call (its hooks included: the tuner, the recorder and the headroom
learner run under it), each unit's forward (a thread may call a
submodule directly), and the handle's methods that change the model
between forwards. The lock is re-entrant: a forward calls its units on
the same thread. Different models run concurrently.
"""

import functools
import threading

from .units import refuse_copy

# The locked subclass of each root class, made once.
_LOCKED = {}


def locked_class(cls):
    """A subclass of the nn.Module class `cls` whose calls take the
    instance's `_vpager_lock` around everything nn.Module.__call__ does
    (forward pre-hooks, forward, forward hooks). Named as `cls`, so that
    code reading type(module).__name__ sees no difference."""
    sub = _LOCKED.get(cls)
    if sub is None:
        def __call__(self, *args, **kwargs):
            with self.__dict__["_vpager_lock"]:
                return cls.__call__(self, *args, **kwargs)
        sub = type(cls.__name__, (cls,), {
            "__call__": __call__, "__reduce_ex__": refuse_copy,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "_vpager_locked_of": cls})
        _LOCKED[cls] = sub
    return sub


def lock_root(module, lock):
    """Calls of `module` take `lock` from now on (unlock_root undoes it)."""
    module.__dict__["_vpager_lock"] = lock
    module.__class__ = locked_class(type(module))


def unlock_root(module):
    cls = type(module).__dict__.get("_vpager_locked_of")
    if cls is not None:
        module.__class__ = cls
    module.__dict__.pop("_vpager_lock", None)


def new_lock():
    return threading.RLock()


def serialized(method):
    """A method of an object with a `hot_path` (the handle) that changes
    the model: it waits for a forward running on another thread."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.hot_path.lock:
            return method(self, *args, **kwargs)
    return locked
