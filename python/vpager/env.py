"""Every VPAGER_* environment variable the Python layer reads, read here
and nowhere else (the C library reads the vp_options_t ones itself, at
each vp_options_init: src/options.c).

Each variable is declared once in VARIABLES (its kind and what it does:
python/README.md's table is this one). A value that does not parse warns
once per process (naming the variable and the value) and counts as unset:
the default is kept, never a feature turned off. The variables are read
when asked, not at import, so that a test or a launcher may set them
later."""

import os
import threading
import warnings
from typing import Dict, NamedTuple, Optional, Tuple

__all__ = ["VARIABLES", "flag", "size", "word", "count", "text", "given",
           "reset_warnings"]


class Variable(NamedTuple):
    kind: str           # "flag", "size", "word", "count", "text"
    doc: str            # what it does (python/README.md's table)
    words: Tuple[str, ...] = ()     # kind "word": the accepted values
    low: int = 0        # kind "count": the bounds
    high: int = 0
    by_c: bool = False  # vp_options_init reads it too (and warns itself)


_SIZE = "a size such as 32M (K/M/G/T: powers of 1024)"

VARIABLES: Dict[str, Variable] = {
    # Read by the C library (vp_options_init); the Python layer asks only
    # whether a valid value was given (the user's choice wins over its own).
    "VPAGER_BACKEND": Variable("word", "auto, cuda, hip or sim: the backend "
                               "a device opens with",
                               ("auto", "cuda", "hip", "sim"),
                               by_c=True),
    "VPAGER_PAGE_SIZE": Variable("size", "page size (a power of two, at "
                                 "least 4K)", by_c=True),
    "VPAGER_ORDER": Variable("word", "eviction order of new VBARs; "
                             "vpager.torch then does not schedule",
                             ("tail", "interleaved"), by_c=True),
    "VPAGER_STAGING": Variable("size", "staging ring bytes (vpager.torch "
                               "then keeps the ring's size)", by_c=True),
    "VPAGER_STAGING_WRAP": Variable("word", "1: the staging ring's slots "
                                    "wrap past its end", ("0", "1"),
                                    by_c=True),
    "VPAGER_LOOKAHEAD": Variable("size", "prefetch bytes past each acquire "
                                 "(vpager.torch then sets no windows)",
                                 by_c=True),
    # The Python layer's own.
    "VPAGER_LIBRARY": Variable("text", "path of the libvpager.so (vpager.dll) to load"),
    "VPAGER_SCHEDULE": Variable("flag", "0: offload() does not schedule "
                                "the copies (default 1)"),
    "VPAGER_PLAN_THREAD": Variable("flag", "0: a schedule is planned on "
                                   "the forward's thread, at the measured "
                                   "forward's end (default 1: on a worker "
                                   "thread, applied at a forward's "
                                   "start)"),
    "VPAGER_HOLD": Variable("flag", "0: a schedule holds no units for the "
                            "whole forward (default 1)"),
    "VPAGER_BETWEEN": Variable("flag", "1: a schedule plans for the "
                               "GPU's time measured between two forwards "
                               "(default 0: forwards back to back)"),
    "VPAGER_LEND": Variable("flag", "1: torch's free cache is lent to "
                            "the staging ring at a forward's start, "
                            "until its first streamed weights are used "
                            "(default 0)"),
    "VPAGER_LEND_CAP": Variable("size", "with VPAGER_LEND=1, a loan's most "
                                "bytes (default: the staging ring's)"),
    "VPAGER_LEND_EARLY": Variable("size", "with VPAGER_LEND=1, a loan is "
                                  "borrowed at a root forward's end and "
                                  "its first this many bytes lent to the "
                                  "ring then, filled in the pause before "
                                  "the next forward, the rest at its "
                                  "start (default 0: all at the start)"),
    "VPAGER_LEND_SM": Variable("count", "with VPAGER_LEND_EARLY, the "
                               "copies into a loan lent at a forward's "
                               "end read by this many blocks of SMs "
                               "(vp_prefetch_sm), not the copy engine, "
                               "which holds the client's own copies "
                               "behind them (default 0: the copy "
                               "engine)", low=0, high=1024),
    "VPAGER_SPARE_PAGES": Variable("count", "pages of the budget a plan "
                                   "leaves free beside the resident set "
                                   "and the ring (default 1)",
                                   low=0, high=64),
    "VPAGER_PLACE_EARLY": Variable("flag", "0: no placement for a schedule "
                                   "guessed from the weights' sizes before "
                                   "the first forward (default 1)"),
    "VPAGER_PLACE_STEPS": Variable("flag", "1: a placement far from the "
                                   "one in place is taken in steps, each "
                                   "forward copying at most a tenth more "
                                   "(default 0: in one forward, its "
                                   "resident set filled as it streams)"),
    "VPAGER_COLD_PLAN": Variable("flag", "0: while a placement guessed "
                                 "from the weights' sizes is in place, no "
                                 "plan from the cold first forward: the "
                                 "first is the second's (default 1)"),
    "VPAGER_COLD_WORK": Variable("flag", "1: the cold first forward is "
                                 "planned for and placed at its own end, "
                                 "each unit's work at most its kind's "
                                 "median (the same unit of the other "
                                 "blocks), a singleton's at most the "
                                 "largest median; later plans keep it "
                                 "unless 2% faster (default 1; 0: the "
                                 "first plan made on the planner and "
                                 "taken at a later forward)"),
    "VPAGER_PLAN_CACHE": Variable("text", "a folder: each unit's work "
                                  "measured once a schedule settles is "
                                  "remembered there, and a later process "
                                  "running the same model on the same GPU "
                                  "with inputs of the same shapes plans "
                                  "its first forward from it, measuring "
                                  "no later forward (default: "
                                  "vpager/plans in the user's cache "
                                  "folder; 0 or off: none)"),
    "VPAGER_MARK_CALLS": Variable("count", "unit calls a measured "
                                  "forward marks, at most about: a model "
                                  "with more is measured a span of its "
                                  "calls a forward (default 300; 0: every "
                                  "call)", low=0, high=1 << 30),
    "VPAGER_RELOCATE": Variable("flag", "1: a placement made anew copies "
                                "the resident weights it moves on the "
                                "device, not again from the host "
                                "(default 0)"),
    "VPAGER_KEEP_FILLS": Variable("flag", "0: a streamed weight's fill "
                                  "(set_fill) runs at each of its fills; "
                                  "1: its result is kept in a pinned host "
                                  "copy once the schedule settles "
                                  "(default 1)"),
    "VPAGER_COPY_BEHIND": Variable("flag", "0: offload() makes a large "
                                   "model's pinned host copy before it "
                                   "returns; 1: behind it, each unit of "
                                   "the first forward waiting for its own "
                                   "weights (default 0: slower on the "
                                   "H100 measured)"),
    "VPAGER_SCHEDULE_LOG": Variable("flag", "1: print each schedule made "
                                    "(default 0)"),
    "VPAGER_PROGRESS": Variable("flag", "0: no progress bar or log line "
                                "while offload() copies a large model; 1: "
                                "always (default: only when long)"),
    "VPAGER_COMPAT_THREADS": Variable("count", "comfy_aimdo drop-in: worker "
                                      "threads (default min(8, CPUs))",
                                      low=1, high=64),
    "VPAGER_COMPAT_THP": Variable("flag", "comfy_aimdo drop-in: 0 leaves "
                                  "out the huge page advice (default 1)"),
    "VPAGER_COMFYUI": Variable("flag", "0/off/false/no: the ComfyUI node is "
                               "off (default on)"),
    "VPAGER_COMFYUI_NO_AUTOINSTALL": Variable(
        "flag", "1: the ComfyUI node does not install itself at import "
        "(tests)"),
}

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")

_lock = threading.Lock()
_warned = set()         # (name, value) already warned about


def reset_warnings() -> None:
    """Warn again about values already warned about (tests)."""
    with _lock:
        _warned.clear()


def _warn(name: str, raw: str, expected: str) -> None:
    with _lock:
        if (name, raw) in _warned:
            return
        _warned.add((name, raw))
    warnings.warn("vpager: %s=%r is not %s; keeping the default"
                  % (name, raw, expected), RuntimeWarning, stacklevel=4)


def _raw(name: str, kind: str) -> Optional[str]:
    var = VARIABLES.get(name)
    if var is None or var.kind != kind:
        raise KeyError("vpager.env: %s is not a declared %s variable"
                       % (name, kind))
    return os.environ.get(name)


def flag(name: str, default: bool) -> bool:
    """A yes/no variable: 1/on/true/yes or 0/off/false/no (any case);
    unset, empty or anything else (warned about): `default`."""
    raw = _raw(name, "flag")
    if raw is None or not raw.strip():
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    _warn(name, raw, "1 or 0 (on/off, true/false, yes/no)")
    return default


def _parse_size(raw: str) -> Optional[int]:
    from .options import parse_size     # the library's parser
    try:
        return parse_size(raw)      # as vp_options_init reads it
    except Exception:   # the library's InvalidArgument, or none loaded
        return None


def size(name: str) -> Optional[int]:
    """A size variable in bytes; None when unset or not a size (warned
    about, unless the C library reads it and warns itself)."""
    raw = _raw(name, "size")
    if raw is None:
        return None
    v = _parse_size(raw)
    if v is not None and name == "VPAGER_PAGE_SIZE" and \
            (v < 4096 or v & (v - 1)):
        v = None
    if v is None and not VARIABLES[name].by_c:
        _warn(name, raw, _SIZE)
    return v


def word(name: str) -> Optional[str]:
    """One of the variable's words (lower case); None when unset or not
    one of them (warned about, unless the C library warns)."""
    raw = _raw(name, "word")
    if raw is None:
        return None
    var = VARIABLES[name]
    # The C library's words: any case, no spaces (strcasecmp).
    v = raw.lower() if var.by_c else raw.strip().lower()
    if v in var.words:
        return v
    if not var.by_c:
        _warn(name, raw, "one of " + ", ".join(var.words))
    return None


def count(name: str) -> Optional[int]:
    """An integer within the variable's bounds; None when unset, empty or
    out of them (warned about)."""
    raw = _raw(name, "count")
    if raw is None or not raw.strip():
        return None
    var = VARIABLES[name]
    try:
        v = int(raw.strip())
    except ValueError:
        v = None
    if v is None or not var.low <= v <= var.high:
        _warn(name, raw, "an integer from %d to %d" % (var.low, var.high))
        return None
    return v


def text(name: str) -> Optional[str]:
    """A text variable; None when unset or empty."""
    raw = _raw(name, "text")
    return raw if raw else None


def given(name: str) -> bool:
    """Whether the variable holds a valid value: the user chose it (a bad
    value is not a choice: the default stays, and so does what vpager
    does by default, say the schedule)."""
    kind = VARIABLES[name].kind
    read = {"flag": lambda n: flag(n, None), "size": size, "word": word,
            "count": count, "text": text}[kind]
    return read(name) is not None
