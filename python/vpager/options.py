"""vp_options_t from keyword arguments: vp_options_init(), then the fields
named by the caller."""

import ctypes

from . import _lib
from ._lib import C, vp_options_t
from .errors import InvalidArgument, check

__all__ = ["make_options", "default_options", "options_dict", "parse_size",
           "OPTION_NAMES"]

# Every field but `size` (which vp_options_init sets), in header order.
OPTION_NAMES = tuple(name for name, _ in vp_options_t._fields_
                     if name != "size")

# Fields holding bytes: an int, or a string with a K/M/G/T suffix.
_SIZE_FIELDS = {"page_size", "headroom", "sim_capacity", "sim_granularity",
                "staging_size", "lookahead", "pin_budget", "file_slot_size"}
# Flag fields: a bool, 0 or 1.
_FLAG_FIELDS = {"staging_wrap"}
# Enum fields: an int, or one of these names.
_ENUM_FIELDS = {"backend": _lib.BACKENDS, "evict_order": _lib.ORDERS,
                "sim_streams": _lib.SIM_STREAMS}


def parse_size(text):
    """vp_parse_size(): "32M" -> 33554432 (K/M/G/T are powers of 1024)."""
    out = ctypes.c_uint64()
    check(C.vp_parse_size(str(text).encode(), ctypes.byref(out)))
    return out.value


def _einval(msg):
    return InvalidArgument(_lib.VP_EINVAL, "VP_EINVAL", msg)


def _convert(name, value):
    if name in _ENUM_FIELDS:
        names = _ENUM_FIELDS[name]
        if isinstance(value, str):
            if value not in names:
                raise _einval("option %s: %r is not one of %s"
                              % (name, value, ", ".join(names)))
            return names[value]
        return int(value)
    if name in ("sim_shared", "ledger"):
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if len(raw) >= 64 or b"\0" in raw:
            raise _einval("option %s: %r must be under 64 bytes, "
                          "without NUL" % (name, value))
        return raw
    if name in _SIZE_FIELDS and isinstance(value, str):
        return parse_size(value)
    if name in _FLAG_FIELDS:
        if value not in (0, 1) or isinstance(value, float):
            raise _einval("option %s: %r is not a bool, 0 or 1"
                          % (name, value))
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _einval("option %s: %r is not an integer" % (name, value))
    return value


def make_options(**kwargs):
    """A vp_options_t: vp_options_init() (defaults, then VPAGER_*), then the
    given fields. Unknown names raise TypeError; values a field cannot hold
    raise InvalidArgument (the library checks the rest at open)."""
    opts = vp_options_t()
    check(C.vp_options_init(ctypes.byref(opts)))
    for name, value in kwargs.items():
        if name not in OPTION_NAMES:
            raise TypeError("unknown vpager option %r (options: %s)"
                            % (name, ", ".join(OPTION_NAMES)))
        if value is None:
            continue
        value = _convert(name, value)
        try:
            setattr(opts, name, value)
        except (TypeError, ValueError) as e:
            raise _einval("option %s: %r: %s" % (name, value, e)) from None
        if name not in ("sim_shared", "ledger") and \
                getattr(opts, name) != value:
            raise _einval("option %s: %r does not fit the field"
                          % (name, value))
    return opts


def options_dict(opts):
    """The fields of a vp_options_t as a dict (sim_shared, ledger as str)."""
    out = {}
    for name in OPTION_NAMES:
        value = getattr(opts, name)
        out[name] = value.decode() if isinstance(value, bytes) else value
    return out


def default_options():
    """What vp_options_init() gives here (defaults and VPAGER_* variables)."""
    return options_dict(make_options())
