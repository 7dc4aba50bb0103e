"""comfy_aimdo.control on vpager: init, devices, budget and logging.

Importing this module loads nothing (neither vpager's library nor torch);
init() does. One vpager Device per device index, opened by init_device(s):
the GPU backend when a GPU is usable (vpager.device_count, not torch;
HIP under a ROCm build of torch: vpager.gpu_backend),
else vpager's simulated device (capacity: VPAGER_SIM_CAPACITY, default 4G),
so that CPU-only machines and CI run everything. VPAGER_BACKEND=sim forces
the simulated device.

Budget: set_simple_vram_headroom(b) caps what vpager commits on each device
at total - b (vp_device_set_limit, live); a device's extra headroom is kept
free device-wide, every process counted (vp_device_set_headroom: vpager's
default headroom plus the extra).
"""

import math
import numbers
import sys
import threading
import warnings

__all__ = [
    "init", "init_devices", "init_device", "get_devctx", "deinit",
    "analyze", "get_total_vram_usage", "set_simple_vram_headroom",
    "get_simple_vram_headroom",
    "set_log_none", "set_log_critical", "set_log_error", "set_log_warning",
    "set_log_info", "set_log_detail", "set_log_debug", "set_log_verbose",
    "set_log_vverbose", "lib", "PAGE_SIZE",
]

PAGE_SIZE = 32 << 20        # the signature rule counts 32 MiB pages
MAX_HEADROOM = 1 << 60      # set_simple_vram_headroom's largest value

lib = None                  # None before init(); then a _Lib
_vpager = None              # the vpager module once loaded
_devices = {}               # index -> vpager.Device
_default_headroom = {}      # index -> vpager's own headroom at open
_simple_headroom = None     # bytes, or None: no cap
_devices_inited = False     # init_devices ran since init()
_nvml_pressure = False
_log_level = None           # vpager level set before init, applied at init
_lock = threading.RLock()
_cuda_count = None          # cached probe


class _Lib:
    """control.lib after init(): what clients call on the loaded library."""

    def __init__(self, vp):
        self.vpager = vp

    def set_simple_vram_headroom(self, nbytes):
        set_simple_vram_headroom(nbytes)

    def get_simple_vram_headroom(self):
        return get_simple_vram_headroom()

    def get_total_vram_usage(self):
        return get_total_vram_usage()

    def library_path(self):
        return self.vpager.library_path()


def _probe_cuda():
    """Number of GPUs of vpager.gpu_backend() (vp_device_count asks the
    driver; 0 without one, or with VPAGER_BACKEND=sim)."""
    global _cuda_count
    if _cuda_count is not None:
        return _cuda_count
    import vpager               # not at import: no vpager before init()
    from vpager import env
    n = 0
    if env.word("VPAGER_BACKEND") != "sim":
        try:
            n = vpager.device_count(vpager.gpu_backend())
        except (vpager.Error, OSError):     # OSError: no libvpager
            n = 0
    _cuda_count = n
    return n


def _is_inited():
    return lib is not None


def init(implementation=None, simple_vram_headroom=None, nvml_pressure=False):
    """Load vpager (True on success, False when it cannot be loaded). A
    second call only updates the headroom and pressure settings.
    `implementation` is accepted and ignored (there is one: vpager)."""
    global lib, _vpager, _nvml_pressure
    with _lock:
        simple_vram_headroom = _headroom_bytes(simple_vram_headroom)
        _nvml_pressure = bool(nvml_pressure)
        if lib is None:
            try:
                import vpager
                vpager.get_log_level()          # loads libvpager.so
                if _log_level is not None:
                    vpager.set_log_level(_log_level)
            except Exception as e:  # LibraryError, OSError
                sys.stderr.write("comfy_aimdo (vpager): cannot load vpager: "
                                 "%s\n" % e)
                return False
            _vpager = vpager
            lib = _Lib(vpager)
        if simple_vram_headroom is not None:
            set_simple_vram_headroom(simple_vram_headroom)
        return True


def _parse_item(item):
    if isinstance(item, (tuple, list)):
        if len(item) != 2:
            raise ValueError("init_devices: %r is not (index, headroom)"
                             % (item,))
        index, extra = item
    else:
        index, extra = item, 0
    index = _index(index)
    extra = int(extra or 0)
    if extra < 0:
        raise ValueError("init_devices: negative headroom %d for device %d"
                         % (extra, index))
    return index, extra


def init_devices(devices):
    """Open each device of the iterable (may be a generator): items are an
    index or (index, extra_headroom_bytes). False (no exception) when
    init() never ran or a device is unusable; ValueError for a negative
    headroom. Once per init(): a second call before deinit() changes
    nothing and returns False with a RuntimeWarning (init_device() still
    retunes one device)."""
    global _devices_inited
    items = [_parse_item(d) for d in devices]     # validate all first
    with _lock:
        if not _is_inited():
            return False
        if _devices_inited:
            warnings.warn("comfy_aimdo (vpager): init_devices() was called "
                          "already; the devices stay as they are (deinit() "
                          "first to open them again)", RuntimeWarning,
                          stacklevel=2)
            return False
        _devices_inited = True
        ok = True
        for index, extra in items:
            ok = init_device(index, extra) and ok
        return ok


def _index(device):
    """A device index from an int, "cuda:N", or a torch.device-like."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    idx = getattr(device, "index", None)
    if idx is not None or hasattr(device, "type"):
        return int(idx or 0)
    if isinstance(device, str):
        tail = device.rpartition(":")[2]
        return int(tail) if tail.isdigit() else 0
    return int(device)


def init_device(index, extra_vram_headroom=0):
    """Open (or retune) the vpager device for `index`; True on success,
    False when init() never ran or the device is unusable."""
    index = _index(index)
    extra = int(extra_vram_headroom or 0)
    if extra < 0:
        raise ValueError("init_device: negative headroom %d" % extra)
    with _lock:
        if not _is_inited():
            return False
        vp = _vpager
        dev = _devices.get(index)
        if dev is None:
            ncuda = _probe_cuda()
            try:
                opts = dict(page_size=PAGE_SIZE)
                if ncuda:
                    if index < 0 or index >= ncuda:
                        return False
                    opts.update(backend=vp.gpu_backend(),
                                device_index=index)
                else:
                    if index < 0:
                        return False
                    opts.update(backend="sim")
                dev = vp.Device(**opts)
            except vp.Error as e:
                sys.stderr.write("comfy_aimdo (vpager): device %d unusable: "
                                 "%s\n" % (index, e))
                return False
            _devices[index] = dev
            _default_headroom[index] = max(dev.info()["headroom"], 0)
        _governor(dev).declare_headroom(_default_headroom[index] + extra)
        _apply_limit(index, dev)
        return True


def _governor(dev):
    """dev's Governor (vpager.governor: the one writer of its limit and
    headroom); vpager is imported at init(), never before."""
    from vpager.governor import governor
    return governor(dev)


def _apply_limit(index, dev):
    """The user's budget, set_simple_vram_headroom's, declared to the
    device's Governor (vpager.governor): the device's total less it."""
    if _simple_headroom is None:
        _governor(dev).declare_budget(None)
    else:
        total = dev.info()["total_memory"]
        _governor(dev).declare_budget(max(total - _simple_headroom, 0))


def get_devctx(index):
    """The vpager.Device of an index (RuntimeError if not initialised)."""
    index = _index(index)
    dev = _devices.get(index)
    if dev is None or dev.closed:
        raise RuntimeError("comfy_aimdo: device %d is not initialised "
                           "(init() then init_device(%d))" % (index, index))
    return dev


def _device_for(device):
    """The Device for a client's device argument, opening it on first use
    when init() ran."""
    index = _index(device)
    if index not in _devices and _is_inited():
        init_device(index)
    return get_devctx(index), index


def devices():
    """{index: vpager.Device} of the open devices (a copy)."""
    return dict(_devices)


def deinit():
    """Close every device (their VBARs, buffers) and unload."""
    global lib, _vpager, _simple_headroom, _nvml_pressure, _devices_inited
    with _lock:
        _simple_headroom = None
        _devices_inited = False
        _nvml_pressure = False
        for index in sorted(_devices):
            try:
                _devices[index].close()
            except Exception as e:
                sys.stderr.write("comfy_aimdo (vpager): closing device %d: "
                                 "%s\n" % (index, e))
        _devices.clear()
        _default_headroom.clear()
        lib = None
        _vpager = None


def _set_log(level):
    global _log_level
    _log_level = level
    if _vpager is not None:
        _vpager.set_log_level(level)


# vpager has six levels (none, error, warn, info, debug, trace).
def set_log_none(): _set_log(0)
def set_log_critical(): _set_log(1)
def set_log_error(): _set_log(1)
def set_log_warning(): _set_log(2)
def set_log_info(): _set_log(3)
def set_log_detail(): _set_log(4)
def set_log_debug(): _set_log(4)
def set_log_verbose(): _set_log(5)
def set_log_vverbose(): _set_log(5)


def analyze():
    """Print each device's vpager report (no-op before init)."""
    if not _is_inited():
        return
    for index in sorted(_devices):
        dev = _devices[index]
        if not dev.closed:
            g = _governor(dev).stats()
            print("comfy_aimdo (vpager) device %d:\n%sgovernor: limit %s, "
                  "headroom %d, lookahead %d; inputs %s"
                  % (index, dev.report(), g["limit"], g["headroom"],
                     g["lookahead"], g["inputs"]))


def get_total_vram_usage():
    """Bytes vpager has committed, summed over devices (0 before init)."""
    return sum(d.info()["committed"] for d in list(_devices.values())
               if not d.closed)


def _headroom_bytes(nbytes):
    """An int in 0..MAX_HEADROOM from an int or an integral-valued float
    (None: no cap); TypeError for other types, ValueError out of range."""
    if nbytes is None:
        return None
    if isinstance(nbytes, numbers.Integral):
        n = int(nbytes)
    elif isinstance(nbytes, numbers.Real):
        f = float(nbytes)
        if not math.isfinite(f):
            raise ValueError("headroom must be a number of bytes in 0..2**60,"
                             " not %r" % (nbytes,))
        n = int(f)
    else:
        raise TypeError("headroom must be a number of bytes (an int), not %s"
                        % type(nbytes).__name__)
    if n < 0 or n > MAX_HEADROOM:
        raise ValueError("headroom must be in 0..2**60 bytes, not %d" % n)
    return n


def get_simple_vram_headroom():
    """The headroom set_simple_vram_headroom() (or init()) set, in bytes; 0
    when none is set (also before init())."""
    h = _simple_headroom
    return 0 if h is None else h


def set_simple_vram_headroom(nbytes):
    """Keep what vpager holds on every device at or below its total memory
    minus `nbytes` (live: the next fault obeys it; None removes the cap).
    ValueError outside 0..2**60 (checked first), RuntimeError before
    init()."""
    global _simple_headroom
    nbytes = _headroom_bytes(nbytes)
    with _lock:
        if not _is_inited():
            raise RuntimeError("comfy_aimdo: set_simple_vram_headroom before "
                               "init()")
        _simple_headroom = nbytes
        for index, dev in list(_devices.items()):
            if not dev.closed:
                _apply_limit(index, dev)
