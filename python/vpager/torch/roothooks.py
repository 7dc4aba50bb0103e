"""The root module's hooks, in one declared order.

Everything vpager.torch installs on the root (the module whose forward
is one step: offload(root=), else the module) goes through one RootHooks
per model, the only code that registers forward hooks on the root: the
model's lock around the root's calls (serial.py), the root's forward
wrapper (the hot path's held units), and one forward pre-hook and one
forward hook that run the named slots below in their declared order.
A slot is filled or emptied at any time (the recorder empties its own
after the re-placement, the tuner swaps measuring for watching); its
place in the order stays. A forward runs the slots that were filled when
it started each list (as torch runs the hooks it had)."""

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .serial import lock_root, unlock_root
from .units import refuse_copy

PreHook = Callable[[torch.nn.Module, Tuple[Any, ...]], None]
PostHook = Callable[[torch.nn.Module, Tuple[Any, ...], Any], None]

# Before the root's forward: torch's headroom learned first (activations
# first, on CUDA), the fills kept on the host taken as sources (filled
# only while fills run or are kept: keptfills.py; before the tuner, whose
# measured forward starts after it), then the order of use starts
# recording, the tuner's
# measured forward starts, the ledger publishes and may send the model
# back on top, and last the tuner's watch of the budget (after the
# learner and the ledger, so it reads the budget they left).
PRE_ORDER = ("learn", "keep", "record", "measure", "ledger", "watch")
# After it: the re-placement in the order of use first, then the tuner's
# schedule (made from the re-placed layout), then the ledger.
POST_ORDER = ("record", "measure", "ledger")


class RootHooks:
    """The root's lock, forward wrapper and hook slots (module doc).
    install() puts them on the root, remove() takes them all off."""

    __reduce_ex__ = refuse_copy   # reached from the module's hooks

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self._pre: Dict[str, PreHook] = {}
        self._post: Dict[str, PostHook] = {}
        self._run_pre: Tuple[PreHook, ...] = ()
        self._run_post: Tuple[PostHook, ...] = ()
        self._handles: list = []
        self._forward: Optional[Tuple[bool, Any]] = None

    def install(self, lock: Any,
                wrap_forward: Callable[[Callable], Callable]) -> None:
        """The root's forward wrapped (outermost, so the held units'
        weights are held around all of it), its calls under `lock`
        (its hooks too), the two dispatching hooks registered."""
        r = self.root
        self._forward = ("forward" in r.__dict__, r.__dict__.get("forward"))
        r.forward = wrap_forward(r.forward)
        lock_root(r, lock)
        self._handles = [r.register_forward_pre_hook(self._before),
                         r.register_forward_hook(self._after)]

    def set(self, slot: str, pre: Optional[PreHook] = None,
            post: Optional[PostHook] = None) -> None:
        """Fill `slot` with these hooks (None: that side empty)."""
        if slot not in PRE_ORDER and slot not in POST_ORDER:
            raise ValueError("vpager.torch: no root hook slot %r (slots: %s)"
                             % (slot, ", ".join(PRE_ORDER)))
        if pre is not None and slot not in PRE_ORDER:
            raise ValueError("vpager.torch: slot %r runs after the forward "
                             "only" % slot)
        if post is not None and slot not in POST_ORDER:
            raise ValueError("vpager.torch: slot %r runs before the forward "
                             "only" % slot)
        self._put(self._pre, slot, pre)
        self._put(self._post, slot, post)
        self._order()

    def clear(self, slot: str) -> None:
        """Empty `slot` (both sides)."""
        self._pre.pop(slot, None)
        self._post.pop(slot, None)
        self._order()

    def filled(self, slot: str) -> bool:
        return slot in self._pre or slot in self._post

    def names(self) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
        """(pre, post): the filled slots, in the order they run."""
        return (tuple(s for s in PRE_ORDER if s in self._pre),
                tuple(s for s in POST_ORDER if s in self._post))

    def remove(self) -> None:
        """Every slot emptied, the hooks, lock and forward wrapper taken
        off the root."""
        self._pre.clear()
        self._post.clear()
        self._order()
        for h in self._handles:
            h.remove()
        self._handles = []
        r = self.root
        unlock_root(r)
        if self._forward is not None:
            had, saved = self._forward
            if had:
                r.forward = saved
            else:
                r.__dict__.pop("forward", None)
            self._forward = None

    # ------------------------------------------------------------ inside
    @staticmethod
    def _put(slots: dict, slot: str, hook: Any) -> None:
        if hook is None:
            slots.pop(slot, None)
        else:
            slots[slot] = hook

    def _order(self) -> None:
        # A new tuple: a forward already iterating the old one goes on.
        self._run_pre = tuple(self._pre[s] for s in PRE_ORDER
                              if s in self._pre)
        self._run_post = tuple(self._post[s] for s in POST_ORDER
                               if s in self._post)

    def _before(self, module: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        for hook in self._run_pre:
            hook(module, args)

    def _after(self, module: torch.nn.Module, args: Tuple[Any, ...],
               out: Any) -> None:
        for hook in self._run_post:
            hook(module, args, out)
