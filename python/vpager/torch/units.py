"""What offload() manages in a module: its units (modules whose forward
acquires a group of weights) and entries (the tensors that become vpager
weights), found and checked before anything changes."""

import torch

from .placement import staging_need
from .views import nbytes

# The states of an Offloaded handle (its _state), which tensors carry
# through their _vpager_handle attribute.
OPEN, UNLOADED, CLOSED = "open", "unloaded", "closed"



def refuse_copy(*args):
    """__reduce_ex__ (so pickle and copy.deepcopy) of the handle and of
    what the module's hooks and wrappers reach: refused."""
    raise TypeError("vpager.torch: an offloaded module cannot be copied "
                    "or pickled (its weights live in vpager); copy it "
                    "before offload(), or unload() first")


# Modules whose forward may read their children's weights without calling
# the children (torch's fused fast paths): each is one unit, whole.
FUSED = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
         torch.nn.MultiheadAttention)


class Entry:
    """One managed tensor: a vpager weight."""

    __slots__ = ("index", "name", "tensor", "is_param", "dtype", "shape",
                 "size", "offset", "src_device", "requires_grad", "host",
                 "file_addr", "src", "rview", "ph", "ph_ptr", "cur", "curv",
                 "keep", "own", "alt", "hparam", "fill", "kept")

    def __init__(self, index, name, tensor, is_param):
        self.index = index
        self.name = name                  # qualified name (first place)
        self.tensor = tensor              # the Parameter / buffer object
        self.is_param = is_param
        self.dtype = tensor.dtype
        # size(), not .shape: the shape of its bytes (a subclass may say
        # another: ComfyUI-GGUF's GGMLTensor gives its weight's logical one)
        self.shape = tuple(tensor.size())
        self.size = nbytes(tensor.dtype, self.shape)
        self.offset = 0
        self.src_device = tensor.device
        self.requires_grad = bool(tensor.requires_grad)
        self.host = None                  # CPU tensor over the HostBuf
        self.file_addr = None             # or: its bytes in the mapped file
        self.src = None                   # its vpager.Source
        self.rview = None                 # view of its VBAR address
        # (views of staging slots are cached per handle: HotPath.staged)
        self.ph = None                    # placeholder
        self.ph_ptr = 0
        self.cur = 0                      # address while acquired, else 0
        self.curv = None                  # the view set while acquired
        self.keep = None                  # a caller's source: its tensor
        self.own = None                   # its own Source (set_source())
        self.alt = None                   # HostBuf of a set_source() copy
        self.hparam = None                # Parameter over rview (held)
        self.fill = None                  # set_fill(): rewrites fresh bytes
        self.kept = None                  # its fill, resting (keptfills.py)

    def forget_views(self):
        self.rview = self.curv = self.hparam = None


class Unit:
    """A module whose forward acquires a group of weights."""

    __slots__ = ("prefix", "name", "module", "entries", "slots", "buffers",
                 "batch", "depth", "saved_forward", "had_forward", "pack",
                 "window", "held", "wrapped", "bare")

    def __init__(self, prefix, module):
        self.prefix = prefix    # qualified name in the offloaded module
        self.name = prefix or "<root>"
        self.module = module
        self.entries = []       # Entry, in placement order
        self.slots = []         # (dict, key, tensor, qualified name)
        self.buffers = []       # (owner module, Entry) of managed buffers
        self.batch = None
        self.depth = 0
        self.saved_forward = None
        self.had_forward = False
        self.pack = None
        self.window = None      # its weights' prefetch window (tuner;
                                # None: the device's lookahead)
        self.held = False       # acquired with the root forward (tuner)
        self.wrapped = None     # the forward installed on module (hotpath)
        self.bare = None        # what module calls while held (hotpath)


def managed_buffer(owner, name, buf):
    return (buf is not None and (buf.is_floating_point() or buf.is_complex())
            and name not in owner._non_persistent_buffers_set
            and buf.numel() > 0)


def _check_handle(qual, t):
    h = getattr(t, "_vpager_handle", None)
    if h is None:
        return
    if h.state == CLOSED:
        raise ValueError("vpager.torch: %s belonged to an offloaded module "
                         "that was closed: its weights were freed" % qual)
    if h.state == OPEN:
        raise ValueError("vpager.torch: %s is already offloaded (%r); "
                         "unload() it first" % (qual, h))


def check_tensor(qual, t, from_file=False):
    """ValueError naming `qual` if tensor t cannot be offloaded."""
    _check_handle(qual, t)
    if t.layout != torch.strided:
        raise ValueError("vpager.torch: %s is a %s tensor; only dense "
                         "(strided) tensors can be offloaded"
                         % (qual, t.layout))
    if t.is_quantized:
        raise ValueError("vpager.torch: %s is quantized (%s); its bytes are "
                         "not a plain array" % (qual, t.dtype))
    if from_file:
        return              # its bytes come from the file: any device, strides
    if t.device.type == "meta":
        raise ValueError("vpager.torch: %s is on the meta device: it has no "
                         "bytes to offload (load the weights first, or "
                         "offload(..., weights_from=path))" % qual)
    if not t.is_contiguous():
        raise ValueError("vpager.torch: %s is not contiguous (strides %s); "
                         "make it contiguous before offload (e.g. p.data = "
                         "p.data.contiguous())" % (qual, t.stride()))


def unit_rule(units):
    """A predicate: is this module a unit of its own, whole subtree?"""
    if units is None:
        return lambda m: isinstance(m, FUSED)
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, (tuple, list, set, frozenset)):
        types = tuple(units) + FUSED
        return lambda m: isinstance(m, types)
    if callable(units):
        return lambda m: isinstance(m, FUSED) or bool(units(m))
    raise TypeError("vpager.torch.offload: units= takes module types or a "
                    "predicate, not %s" % type(units).__name__)


def _owns(m, prefix="", select=None):
    return bool(_tensors_of(m, prefix, select))


def _whole_has(m, prefix, select):
    if select is None:
        return any(True for _ in m.parameters())
    return any(select(n, p)
               for n, p in m.named_parameters(prefix=prefix.rstrip(".")))


def find_units(module, whole, select=None):
    """The units of a module, in module order: each module that owns
    tensors itself (those select(qualified name, tensor) accepts, when
    given), or is `whole` (and has such parameters), and lies below no
    other unit."""
    units = []
    seen = set()

    def visit(m, prefix):
        if id(m) in seen:
            return
        seen.add(id(m))
        if _owns(m, prefix, select) or (whole(m)
                                        and _whole_has(m, prefix, select)):
            units.append(Unit(prefix.rstrip("."), m))
            return
        for name, child in m._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return units


def _tensors_of(sub, prefix="", select=None):
    """(name, tensor, is_param) of what a module holds that vpager manages
    (of those, what select(qualified name, tensor) accepts, if given)."""
    items = [(n, p, True) for n, p in sub._parameters.items()
             if p is not None and p.numel() > 0]
    items += [(n, b, False) for n, b in sub._buffers.items()
              if managed_buffer(sub, n, b)]
    if select is not None:
        items = [it for it in items if select(prefix + it[0], it[1])]
    return items


def collect(module, whole=None, from_file=False, select=None):
    """Units, entries and owners of a module; raises ValueError (changing
    nothing) for what cannot be offloaded. whole(m): m is a unit, whole.
    from_file: the bytes will come from a file (meta tensors are fine).
    select(qualified name, tensor): which tensors to manage (None: every
    parameter and floating-point buffer).
    owners: [(module, [(name, Entry)])] of the modules holding entries."""
    units = find_units(module, whole or unit_rule(None), select)
    entries = []
    by_id = {}
    owners = {}     # id(module) -> (module, {name: Entry}) it holds
    for u in units:
        in_unit = set()
        for mname, sub in u.module.named_modules(prefix=u.prefix):
            sp = mname + "." if mname else ""
            for n, t, is_param in _tensors_of(sub, sp, select):
                qual = sp + n
                e = by_id.get(id(t))
                if e is None:
                    check_tensor(qual, t, from_file)
                    e = by_id[id(t)] = Entry(len(entries), qual, t, is_param)
                    entries.append(e)
                u.slots.append((sub._parameters if is_param else sub._buffers,
                                n, t, qual))
                owners.setdefault(id(sub), (sub, {}))[1][n] = e
                if not is_param:
                    u.buffers.append((sub, e))
                if id(t) not in in_unit:
                    in_unit.add(id(t))
                    u.entries.append(e)
    owners = [(m, sorted(held.items())) for m, held in owners.values()]
    return units, entries, owners


def largest(units):
    """(unit, bytes) of the unit needing the most staging ring at once."""
    best = max(units, key=lambda u: staging_need(u.entries))
    return best, staging_need(best.entries)


def unmanaged(module, managed):
    """(dict, key, tensor, is_param) of tensors left as they are (integer
    and non-persistent buffers, empty parameters)."""
    out = []
    seen = set()
    for m in module.modules():
        for d, is_param in ((m._parameters, True), (m._buffers, False)):
            for k, t in d.items():
                if t is None or id(t) in managed or id(t) in seen:
                    continue
                seen.add(id(t))
                out.append((d, k, t, is_param))
    return out
