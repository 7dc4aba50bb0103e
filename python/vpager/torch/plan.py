"""Plan: what offload() finds in the module before anything changes (no
device writes): its units and weights, who owns them, the torch device it
will compute on, the largest unit. The first thing built (then the
Layout on the device, build.py)."""

from .devices import resolve_target, scheduled_page
from .units import collect, largest, unit_rule


class Plan:
    """What offload() found in the module before changing anything: its
    units and entries (units.collect), the modules owning entries, the
    torch device it will compute on, the largest unit ((unit, staging
    bytes)), the ids of the placeholders that stand in for meta tensors
    (fresh) and the OffloadConfig (settings)."""

    __slots__ = ("module", "units", "entries", "owners", "target", "largest",
                 "fresh", "settings")

    def __init__(self, module, dev, settings, fresh=()):
        from_file = settings.weights_from is not None
        units, entries, owners = collect(module, unit_rule(settings.units),
                                         from_file, settings.tensors)
        if not entries:
            raise ValueError("vpager.torch.offload: %s has no parameters or "
                             "floating-point buffers to offload"
                             % type(module).__name__)
        srcs = {e.src_device for e in entries}
        if len(srcs) > 1:
            raise ValueError("vpager.torch.offload: parameters are on several "
                             "devices (%s); move the module to one first"
                             % ", ".join(sorted(str(s) for s in srcs)))
        root = settings.root
        if root is not None and root is not module and \
                not any(m is root for m in module.modules()):
            raise ValueError("vpager.torch.offload: root= (%s) is not a "
                             "submodule of the %s" % (type(root).__name__,
                                                      type(module).__name__))
        self.module = module
        self.units, self.entries, self.owners = units, entries, owners
        self.target = resolve_target(srcs.pop(), settings.device, dev,
                                     settings.options)
        if dev is None and self.target.type == "cpu":
            _simulated_pages(self.target, settings)
        self.largest = largest(units)
        self.fresh = set(fresh)
        self.settings = settings


def _simulated_pages(target, settings):
    """A simulated device offload() opens has small pages (2 MiB, or its
    granularity) whatever the order, unless page_size= or
    VPAGER_PAGE_SIZE says otherwise; its budget is its memory, which
    must hold a page."""
    page = scheduled_page(target, settings.options)
    if page is not None:
        settings.options["page_size"] = page
    settings.check_simulated(settings.options.get("page_size"))
