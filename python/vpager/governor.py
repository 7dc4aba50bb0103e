"""vpager.governor: one Governor per vpager.Device, the only code that
writes the device's limit, headroom, shared headroom and lookahead.

Every layer that has a say declares its input here (a small record each)
instead of writing the device itself; the Governor derives the three
settings from all of them, writes a setting only when it changes, logs
each change at debug (logger "vpager.governor") with its reason, and
stats() shows the inputs and the result:

    limit     = min(the user's budget,
                    a shared budget less torch's peak and the margin,
                    the platform's soft limit less torch's reservation
                    and its margin)               (none: no cap)
    headroom  = max(the user's headroom, learned)        (vpager.torch)
              = the flags' headroom + learned    (ComfyUI's flags given)
    shared    = the user's headroom, or the flags' reserve (--reserve-vram)
                else their headroom: what every vpager process on the GPU
                is asked to keep free (the ledger), learned left out (it
                is this process's own growth)
    lookahead = the device's own (the user's lookahead=): what weights
                without a window of their own prefetch with (a model's
                prefetch windows are its weights', vp_weight_set_lookahead,
                set by the model: no device-wide write per acquire)

    pin budget = the user's (declare_pin_budget): host bytes vpager may
                page-lock on the machine, every vpager process together
                (the C library's pin ledger; none declared: the library's,
                VPAGER_PIN_BUDGET or half of RAM)

learned is what torch may still grab in the forward about to run: its
peak reservation (the largest read) less what it holds now, plus the OOM
margin (5% of the peak, at most 256 MiB; 1% once the peak held for
STEADY_READS reads; raised by each out-of-memory retry). Torch is never
imported here: its numbers are declared (TorchMemory) by vpager.torch,
which reads them.

The user's headroom is the device's own until declared: a device opened
without one keeps the C library's default free (on a GPU the larger of
512 MiB and 2% of its memory, more under WDDM/WSL2: room for the display
and other programs), and shares it, so two processes with no flags leave
it free together; any headroom, budget flags or reserve the user gives
overrides it."""

import functools
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["Governor", "governor", "UserBudget", "HostFlags",
           "PlatformLimit", "TorchMemory", "NO_LIMIT", "MARGIN_MAX",
           "OOM_MARGIN_MAX"]

_log = logging.getLogger("vpager.governor")

NO_LIMIT = (1 << 64) - 1        # vp_device_set_limit: no cap
_MARGIN_FRAC = 20               # the margin: 1/20 (5%) of torch's peak ...
MARGIN_MAX = 256 << 20          # ... but at most 256 MiB
# ... until STEADY_READS reads in a row found torch's peak where it was:
# then 1/100 (1%) of it. A peak that held that long is what the workflow
# needs (the node's Flux step reads it every forward); the 5% beside it
# was link time every step (Flux 9.4 GiB at 6 GiB: a 0.95 GB peak kept
# 47 MB more streamed, 0.9 ms of a 95 ms step on the H100). A peak that
# rises again (another resolution, a batch) takes the 5% back.
STEADY_READS = 8
_SETTLED_FRAC = 100
OOM_MARGIN_MAX = 4 << 30        # what OOM retries may raise it to


def _one_at_a_time(method: Any) -> Any:
    """A declaration applied whole under the Governor's lock: models on
    one device run their forwards on threads of their own (each under its
    own lock only), and two writes interleaved would leave the setting
    recorded here other than the device's (then never written again)."""
    @functools.wraps(method)
    def locked(self: "Governor", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass(frozen=True)
class UserBudget:
    """Bytes vpager may commit on the device, given by its user
    (offload(budget=), open_device(budget=), the drop-in's
    set_vram_headroom); None: no cap."""
    limit: Optional[int] = None


@dataclass(frozen=True)
class HostFlags:
    """The host application's memory flags (ComfyUI's --vram-headroom
    and --reserve-vram): headroom, bytes kept free beyond torch's growth
    (added to what is learned); shared_budget, bytes weights and torch's
    activations share (None: no such cap); reserve, bytes the user keeps
    for other programs (--reserve-vram; None: not given), what the
    device shares through the ledger instead of the headroom."""
    headroom: int
    shared_budget: Optional[int] = None
    reserve: Optional[int] = None


@dataclass(frozen=True)
class PlatformLimit:
    """The platform's soft limit on this process's device memory (NVML:
    MPS v3 / cgroup dmem) and the margin kept under it; soft None: none."""
    soft: Optional[int]
    margin: int


@dataclass(frozen=True)
class TorchMemory:
    """Torch's caching allocator on the device: what it holds now and the
    most it has held (the largest read: a client may reset torch's)."""
    reserved: int
    peak: int


class Governor:
    """The device's limit, headroom and lookahead, derived from the inputs
    declared to it. One per device: governor(dev)."""

    def __init__(self, dev: Any) -> None:
        self._dev = weakref.ref(dev)
        self._lock = threading.RLock()
        info = dev.info()
        # The device's own settings when it was first governed: the
        # user's headroom and lookahead until declared otherwise.
        self.user_headroom: int = int(info["headroom"])
        self.base_lookahead: int = int(dev.options["lookahead"])
        self.user = UserBudget()
        self.flags: Optional[HostFlags] = None
        self.platform = PlatformLimit(None, 0)
        self.torch: Optional[TorchMemory] = None
        # (torch's peak counter, the peak it stands for): vpager's own
        # work raised the counter (mask_torch_peak), until it moves.
        self.torch_mask: Optional[Tuple[int, int]] = None
        self.oom_margin: int = 0
        self.steady_reads: int = 0  # torch reads since its peak last rose
        self.learned: int = 0
        self.learned_at: float = float("-inf")
        # What is on the device: written here, or its own at first use.
        self.limit: int = NO_LIMIT
        self.headroom: int = self.user_headroom
        self.shared_headroom: int = -1  # -1: the device shares its headroom
        self.lookahead: int = self.base_lookahead
        self.user_pin_budget: Optional[int] = None  # None: the library's
        self.changes: int = 0

    @property
    def device(self) -> Any:
        return self._dev()

    # ---------------------------------------------------------- inputs
    @_one_at_a_time
    def declare_budget(self, limit: Optional[int]) -> None:
        """The user's budget (None: no cap)."""
        self.user = UserBudget(limit)
        self._apply_limit("user budget %s" % _b(limit))

    @_one_at_a_time
    def declare_flags(self, headroom: int,
                      shared_budget: Optional[int] = None,
                      reserve: Optional[int] = None) -> None:
        """The host application's flags: headroom then adds to what is
        learned, a shared budget caps weights and activations, and a
        reserve (else the headroom) is what the device shares."""
        self.flags = HostFlags(int(headroom), shared_budget,
                               None if reserve is None else int(reserve))
        why = "host flags headroom %s shared budget %s reserve %s" % (
            _b(headroom), _b(shared_budget), _b(reserve))
        self._apply_headroom(why)
        self._apply_limit(why)

    @_one_at_a_time
    def declare_headroom(self, headroom: int) -> None:
        """The user's headroom (the drop-in's init_device): what stays free
        when nothing is learned."""
        self.user_headroom = int(headroom)
        self._apply_headroom("user headroom %s" % _b(headroom))

    @_one_at_a_time
    def declare_platform(self, soft: Optional[int], margin: int,
                         reserved: Optional[int] = None) -> None:
        """The platform's soft limit (None: none) and torch's reservation
        now (reserved: when there is a limit)."""
        if soft is None and self.platform.soft is None:
            return
        self.platform = PlatformLimit(soft, int(margin))
        if reserved is not None:
            peak = self.torch.peak if self.torch is not None else reserved
            self.torch = TorchMemory(int(reserved), max(peak, reserved))
        self._apply_limit("platform soft limit %s" % _b(soft))

    @_one_at_a_time
    def declare_torch(self, reserved: int, peak: int) -> int:
        """Torch's memory before a forward: the learned headroom (and a
        shared budget's limit) follow; returns the headroom."""
        if self.torch_mask is not None and peak != self.torch_mask[0]:
            self.torch_mask = None  # a higher peak since, or a client's reset
        peak = max(self.peak_seen(peak), reserved)
        rose = self.torch is None or peak > self.torch.peak
        self.steady_reads = 0 if rose else self.steady_reads + 1
        self.torch = TorchMemory(int(reserved), int(peak))
        self.learned = max(peak - reserved, 0) + self.margin()
        why = "torch reserved %s peak %s" % (_b(reserved), _b(peak))
        self._apply_headroom(why)
        if self.flags is not None and self.flags.shared_budget is not None:
            self._apply_limit(why)
        return self.headroom

    @_one_at_a_time
    def peak_seen(self, counter: int) -> int:
        """torch's peak as this Governor reads torch's counter `counter`:
        a masked counter as the peak before it (mask_torch_peak), never
        below the largest peak read."""
        m = self.torch_mask
        if m is not None and counter == m[0]:
            counter = m[1]
        return counter if self.torch is None else max(counter,
                                                       self.torch.peak)

    @_one_at_a_time
    def mask_torch_peak(self, counter: int, before: int) -> None:
        """vpager's own work on the device, done once (a LoRA's patch
        computed at the fill of a resident weight, or at a node's load)
        raised torch's peak counter from `before` to `counter`; its
        temporaries are gone since. The forwards' activations never
        needed that room: until the counter moves, it reads as `before`
        (with what torch holds at each read), so the weights keep their
        room. Flux 9.4 GiB at 6 GiB with a LoRA read 1394 MiB against
        906 and kept 0.54 GB fewer weights resident, LoRA steps 7-18%
        slower than the tree before issue 28.

        A peak above `before` was read since that work began (`before`
        was the largest read then), even if the counter reads lower now:
        a client's reset of it since (bench/comfyui_run.py at each
        prompt; fp8 Flux with a LoRA kept its fills' 1.98 GB peak over
        the 0.92 GB of the forwards after them, and no weight resident)."""
        self.torch_mask = (int(counter), int(before))
        t = self.torch
        if t is not None and t.peak > before:
            self.torch = TorchMemory(t.reserved, int(before))

    @_one_at_a_time
    def torch_peak(self) -> int:
        """The most torch's allocator is known to have held (the largest
        peak read, masked peaks as their before): 0 before any read."""
        return self.torch.peak if self.torch is not None else 0

    @_one_at_a_time
    def forget_torch_peak(self) -> None:
        """A fresh torch (tests): the largest peak read is forgotten."""
        self.torch_mask = None
        self.steady_reads = 0
        if self.torch is not None:
            self.torch = TorchMemory(self.torch.reserved, 0)

    @_one_at_a_time
    def raise_oom_margin(self) -> None:
        """The learned headroom was too small (torch ran out of memory):
        its margin doubles from twice the usual cap, up to OOM_MARGIN_MAX.
        Applied at the next learn."""
        self.oom_margin = min(max(2 * self.oom_margin, 2 * MARGIN_MAX),
                              OOM_MARGIN_MAX)
        _log.debug("device %s: oom margin %s", self._name(),
                   _b(self.oom_margin))

    @_one_at_a_time
    def forget_learned(self) -> None:
        """No model uses the device any more: the user's headroom again."""
        if self.learned:
            self.learned = 0
            self._apply_headroom("no model left")

    @_one_at_a_time
    def declare_lookahead(self, nbytes: int) -> None:
        """The device's own lookahead (attach's lookahead=): what a model
        without windows prefetches with."""
        self.base_lookahead = int(nbytes)
        self._set_lookahead(self.base_lookahead, "device lookahead")

    @_one_at_a_time
    def declare_pin_budget(self, nbytes: int) -> None:
        """The user's pinned-host budget: bytes vpager may page-lock on the
        machine, every vpager process together (the last one set wins; 0
        pins nothing more). What does not fit stays pageable: slower
        copies, never an error."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError("pin budget: %d bytes is negative" % nbytes)
        old, self.user_pin_budget = self.user_pin_budget, nbytes
        if old == nbytes:
            return
        dev = self._dev()
        if dev is None or getattr(dev, "closed", False):
            return
        dev.set_pin_budget(nbytes)
        self._changed("pin budget", -1 if old is None else old, nbytes,
                      "user pin budget")

    # --------------------------------------------------------- derived
    def margin(self) -> int:
        peak = self.torch.peak if self.torch is not None else 0
        frac = _SETTLED_FRAC if self.steady_reads >= STEADY_READS \
            else _MARGIN_FRAC
        return max(min(peak // frac, MARGIN_MAX), self.oom_margin)

    def derived_headroom(self) -> int:
        if self.flags is not None:
            return self.flags.headroom + self.learned
        return max(self.user_headroom, self.learned)

    def derived_shared_headroom(self) -> int:
        if self.flags is not None:
            if self.flags.reserve is not None:
                return self.flags.reserve
            return self.flags.headroom
        return self.user_headroom

    def derived_limit(self) -> int:
        limit = self.user.limit if self.user.limit is not None else NO_LIMIT
        t = self.torch
        if self.flags is not None and self.flags.shared_budget is not None \
                and t is not None:
            limit = min(limit, max(self.flags.shared_budget - t.peak -
                                   self.margin(), 0))
        soft = self.platform.soft
        if soft is not None:
            reserved = t.reserved if t is not None else 0
            limit = min(limit, max(soft - reserved - self.platform.margin,
                                   0))
        return limit

    # ---------------------------------------------------------- writes
    def _name(self) -> str:
        dev = self._dev()
        return repr(dev) if dev is not None else "(gone)"

    def _write(self, what: str, attr: str, setter: str, new: int,
               why: str) -> Any:
        """Setting self.<attr> (on the device: its method `setter`) to
        `new` when it differs and the device is open; returns the device
        if written, else None."""
        old = getattr(self, attr)
        if new == old:
            return None
        dev = self._dev()
        if dev is None or getattr(dev, "closed", False):
            return None
        getattr(dev, setter)(new)
        setattr(self, attr, new)
        self._changed(what, old, new, why)
        return dev

    def _apply_headroom(self, why: str) -> None:
        self._apply_shared_headroom(why)
        self._write("headroom", "headroom", "set_headroom",
                    self.derived_headroom(), why)

    def _apply_shared_headroom(self, why: str) -> None:
        self._write("shared headroom", "shared_headroom",
                    "set_shared_headroom", self.derived_shared_headroom(),
                    why)

    def _apply_limit(self, why: str) -> None:
        old, limit = self.limit, self.derived_limit()
        dev = self._write("limit", "limit", "set_limit", limit, why)
        # Under a shared budget a lower cap gives back the pages resident
        # over it now (it binds only at the next commit otherwise), so
        # the activations find their room.
        if dev is not None and self.flags is not None \
                and self.flags.shared_budget is not None and limit < old:
            over = dev.stats()["committed_bytes"] - limit
            if over > 0:
                dev.free_memory(over)

    def _set_lookahead(self, nbytes: int, why: str) -> None:
        self._write("lookahead", "lookahead", "set_lookahead", nbytes, why)

    def _changed(self, what: str, old: int, new: int, why: str) -> None:
        self.changes += 1
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("device %s: %s %s -> %s (%s)", self._name(), what,
                       _b(old), _b(new), why)

    # ----------------------------------------------------------- stats
    def stats(self) -> Dict[str, Any]:
        """The inputs and the settings derived from them."""
        t = self.torch
        return {
            "inputs": {
                "user_budget": self.user.limit,
                "user_headroom": self.user_headroom,
                "host_headroom": (self.flags.headroom
                                  if self.flags is not None else None),
                "shared_budget": (self.flags.shared_budget
                                  if self.flags is not None else None),
                "host_reserve": (self.flags.reserve
                                 if self.flags is not None else None),
                "platform_soft_limit": self.platform.soft,
                "platform_margin": self.platform.margin,
                "torch_reserved": t.reserved if t is not None else None,
                "torch_peak": t.peak if t is not None else None,
                "oom_margin": self.oom_margin,
                "torch_steady_reads": self.steady_reads,
                "base_lookahead": self.base_lookahead,
                "user_pin_budget": self.user_pin_budget,
            },
            "learned": self.learned,
            "margin": self.margin(),
            "limit": None if self.limit == NO_LIMIT else self.limit,
            "headroom": self.headroom,
            "shared_headroom": (None if self.shared_headroom < 0
                                else self.shared_headroom),
            "lookahead": self.lookahead,
            "pin_budget": self.user_pin_budget,
            "changes": self.changes,
        }


def _b(n: Optional[int]) -> str:
    if n is None or n == NO_LIMIT or n < 0:
        return "none"
    return "%d MiB" % (n >> 20) if n >= 1 << 20 and not n % (1 << 20) \
        else "%d B" % n


_GOVERNORS: "weakref.WeakKeyDictionary[Any, Governor]" = \
    weakref.WeakKeyDictionary()


def governor(dev: Any) -> Governor:
    """The Governor of a vpager.Device (made at its first use)."""
    gov = _GOVERNORS.get(dev)
    if gov is None:
        gov = _GOVERNORS[dev] = Governor(dev)
    return gov
