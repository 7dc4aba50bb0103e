"""The ComfyUI side: VpagerModelPatcher, a subclass of ComfyUI's
ModelPatcherDynamic in which vpager.torch (through engine.Pager), not ComfyUI's
per-weight comfy_aimdo cycle, fills, stages and prefetches the weights of
a model, while ComfyUI's ledger keeps working: loaded_size(),
partially_unload(), detach(), get_free_memory(), unload_all_models() and
--disable-smart-memory go through the same methods ComfyUI calls.

Everything ComfyUI is reached through the `comfy` namespace passed to
make_class() (the real one, or the tests' stand-ins), so this module
imports nothing of ComfyUI itself."""

import contextlib
import logging
import time
import weakref

import torch

from vpager import env
from vpager.governor import governor

from . import engine, gguf
from . import quantized

log = logging.getLogger("vpager.comfyui")

SMALL = 16 * 1024           # ComfyUI force-loads modules this small
ENV = "VPAGER_COMFYUI"      # "0"/"off"/"false"/"no": the node is off
OPTION = "vpager"           # model_options[OPTION] = False: off for a model

# Seams (the tests set them): open the vpager.Device serving a torch
# device, and whether a CPU load device means the simulated device.
DEVICE_FACTORY = None
ALLOW_SIM = False

_DEVICES = {}               # torch device -> (vpager.Device, budget)
_LOGGED = set()             # (model class, reason) already logged


def env_off():
    return not env.flag(ENV, True)


def note(model, why):
    """One log line per model class and reason."""
    key = (type(model).__name__, why)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    log.info("vpager: %s uses ComfyUI's own loading: %s",
             type(model).__name__, why)


def headroom_bytes(args, default):
    """What vpager keeps free on the GPU beyond torch's growth: the
    device's default headroom (`default`: vpager's, room for the display
    and other programs) plus --vram-headroom, as ComfyUI adds it to its
    own default; with --reserve-vram, which says itself what other
    programs get, --vram-headroom alone."""
    extra = int((getattr(args, "vram_headroom", 0) or 0) * (1 << 30))
    if reserve_bytes(args) is not None:
        return extra
    return int(default) + extra


def headroom_text(args):
    """headroom_bytes() in words, before a device gives its default."""
    extra = int((getattr(args, "vram_headroom", 0) or 0) * 1024)
    if reserve_bytes(args) is not None:
        return "%d MB" % extra
    return "vpager's default" + (" + %d MB" % extra if extra else "")


def reserve_bytes(args):
    """--reserve-vram in bytes (None without it): what the user keeps for
    other programs, which the device asks every vpager process on the
    GPU to keep free instead of its default headroom."""
    r = getattr(args, "reserve_vram", None)
    return None if r is None else max(int(r * (1 << 30)), 0)


def budget_bytes(args, total):
    """The GPU memory this process may use, weights and activations
    together: the device's total less --reserve-vram; None without it."""
    r = reserve_bytes(args)
    if r is None or total is None:
        return None
    return max(int(total - r), 0)


def _total(target):
    if target.type != "cuda":
        return None
    return torch.cuda.get_device_properties(target).total_memory


def vp_device(target, args):
    """(the vpager.Device every model on torch device `target` shares, the
    budget of weights and activations on it or None)."""
    dev = _DEVICES.get(target)
    if dev is not None and not dev[0].closed:
        return dev
    if DEVICE_FACTORY is not None:
        dev, budget = DEVICE_FACTORY(target), None
    else:
        import vpager.torch
        from vpager.torch.devices import scheduled_page
        budget = budget_bytes(args, _total(target))
        opts = {}
        page = scheduled_page(target, opts)   # as offload() opens them
        if page is not None:
            opts["page_size"] = page
        # The device's default headroom stays (issue 29 point 4): the
        # flags add to it or, --reserve-vram given, replace it.
        dev = vpager.torch.open_device(str(target), budget=budget, **opts)
        gov = governor(dev)
        gov.declare_flags(headroom_bytes(args, gov.user_headroom), budget,
                          reserve_bytes(args))
    _DEVICES[target] = (dev, budget)
    return dev, budget


def reclaimable(device):
    """Bytes vpager could give back on `device` now (its unpinned pages)."""
    total = 0
    for target, (dev, _budget) in list(_DEVICES.items()):
        if dev.closed:
            continue
        if device is None or _same_device(target, device):
            total += dev.reclaimable()
    return total


def _same_device(a, b):
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return (a.index or 0) == (b.index or 0)


# ------------------------------------------------------------ planning

class Plan:
    """What a model's load would hand to vpager: units [(name, module,
    [(key, pname)])], dtypes {key: dtype} (the dtype each unit weight is
    held in on the GPU: ComfyUI's, see vram_dtype), forced [(key,
    module, pname)] (params ComfyUI's way: straight to the device), or
    why (a reason to fall back)."""

    def __init__(self):
        self.units = []
        self.dtypes = {}
        self.forced = []
        self.why = None


def plan_model(model, comfy, ggml=None):
    """Unit collection: every ComfyUI op (a module with comfy_cast_weights)
    above SMALL bytes whose parameters are all its own is a unit of its
    weight and bias; other parameters (tiny ops, a parent's own
    parameters, an op's extra ones) are loaded ComfyUI's way. ggml:
    ComfyUI-GGUF's is_quantized(tensor) for its models (gguf_patcher),
    whose GGMLTensor weights are paged as their stored bytes; None: a
    GGUF model is refused. Returns a Plan; plan.why is set for what
    vpager cannot take."""
    plan = Plan()
    if ggml is None:
        plan.why = gguf.refusal(model)
        if plan.why is not None:
            return plan
    for n, m in model.named_modules():
        own = [(k, p) for k, p in m._parameters.items() if p is not None
               and not k.startswith(quantized.PART)]
        if not own:
            continue
        leaf = not any(True for c in m.children() for _ in c.parameters())
        is_op = hasattr(m, "comfy_cast_weights")
        size = sum(engine.nbytes(p) for _, p in own)
        # A quantized op of any size is a unit: ComfyUI's way (force_cast)
        # would requantize its weight, other bytes than it stores (and a
        # GGUF one carries its patches: gguf_patcher).
        quant = any(quantized.is_quantized(p) or (
            ggml is not None and gguf.is_ggml(p) and ggml(p))
            for _, p in own)
        params = []
        for k, p in own:
            key = "%s.%s" % (n, k) if n else k
            if is_op and leaf and k in ("weight", "bias") and (
                    size > SMALL or quant):
                if ggml is not None and gguf.is_ggml(p):
                    # Paged as its stored bytes, whatever its op declares.
                    want = p.dtype
                    why = gguf.refuse(key, p)
                elif quantized.is_quantized(p):
                    # Paged as its stored parts (quantized.Split).
                    want = p.dtype
                    why = quantized.refuse(key, m, p)
                else:
                    want = vram_dtype(m, k, p)
                    why = _refuse(key, m, k, p, want)
                if why is not None:
                    plan.why = why
                    return plan
                params.append((key, k))
                plan.dtypes[key] = want
            elif quantized.is_quantized(p):
                plan.why = ("%s is a QuantizedTensor that is not a ComfyUI "
                            "op's weight or bias" % key)
                return plan
            else:
                plan.forced.append((key, m, k))
        if params:
            plan.units.append((n, m, params))
    if not plan.units:
        plan.why = "no ComfyUI op holds weights above %d bytes" % SMALL
    return plan


def vram_dtype(m, k, p):
    """The dtype ComfyUI's dynamic path holds op m's parameter k in on the
    GPU: the dtype the op declares for it (<k>_comfy_model_dtype: a UNet
    loaded with weight_dtype fp8 declares fp8 while its parameters are the
    file's bf16 tensors; ComfyUI casts them on the GPU at fill time), else
    the parameter's own."""
    return getattr(m, k + "_comfy_model_dtype", None) or p.dtype


# What the node converts: a plain cast between these kinds (ComfyUI's own
# conversion into VRAM, on the same device: engine.convert_host).
def _convertible(dtype):
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


def _refuse(key, m, k, p, want=None):
    """Why weight `key` cannot be a vpager weight, or None. want: the dtype
    it is to be held in on the GPU (vram_dtype)."""
    t = p.data
    # (An op's set_<k>/convert_<k>, mixed-precision ops' own, only take
    # part in patching: patch_weight_to_device calls them, the node too.)
    if type(t) is not torch.Tensor:
        return "%s is a %s, not a plain tensor" % (key, type(t).__name__)
    if t.device.type == "meta":
        return "%s is on the meta device" % key
    if t.device.type != "cpu":
        return "%s is on %s, not in host memory" % (key, t.device)
    if t.layout != torch.strided or t.is_quantized:
        return "%s is not a dense tensor" % key
    if not t.is_contiguous():
        return "%s is not contiguous" % key
    if want is not None and want != t.dtype and not (
            _convertible(t.dtype) and _convertible(want)):
        # Bytes the node would not reproduce bitwise (an integer or
        # packed format, a dtype it does not know): ComfyUI casts them.
        return ("%s is stored as %s but its op declares %s: the node "
                "converts only between floating-point dtypes"
                % (key, str(t.dtype).replace("torch.", ""),
                   str(want).replace("torch.", "")))
    return None


def patch_refusal(patcher, plan, comfy):
    """Why the patcher's patches keep it off vpager, or None: weight hooks,
    or a patch that changes a managed weight's shape."""
    if getattr(patcher, "hook_patches", None):
        return "weight hooks (hook patches) are applied"
    managed = {key: (m, k) for _, m, params in plan.units for key, k in params}
    for key, patches in patcher.patches.items():
        if key not in managed or not patches:
            continue
        m, k = managed[key]
        w = m._parameters[k]
        shape = comfy.lora.calculate_shape(patches, w, key)
        if tuple(shape) != tuple(w.shape):
            return "a patch changes the shape of %s" % key
    return None


# ------------------------------------------------------------- the class

class VpagerPatcher:
    """ComfyUI's ModelPatcherDynamic with vpager paging the weights of
    the models it can take (see the package README); the others, and
    all when the node is off, go ComfyUI's own way. A mixin:
    make_class() puts it before ComfyUI's class and binds it to ComfyUI
    (_comfy: the namespace of its modules; _base: ModelPatcherDynamic)."""

    _comfy = None
    _base = None
    _adopt = None           # (): makes ComfyUI-GGUF's clones the node's
    _ggml = None            # ComfyUI-GGUF's is_quantized, for its models
    # What is not paged goes to the device in the dtype the model declares
    # for it (ComfyUI's dynamic path), or as stored (its legacy one).
    _vp_declared = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # ComfyUI-GGUF's loader, which calls this before it clones the
        # model into its own patcher class, is imported by now.
        if self._adopt is not None:
            self._adopt()
        # A clone of another class (ComfyUI-GGUF's loader turns the
        # node's patcher into its GGUFModelPatcher) never reaches the
        # node: it says so when the clone is made.
        add = getattr(self, "add_callback_with_key", None)
        kind = getattr(self._comfy.model_patcher.CallbacksMP, "ON_CLONE",
                       None)
        if add is not None and kind is not None:
            add(kind, OPTION, _cloned)
        # A sampling's end pauses the model's forwards (_sampled).
        wrap = getattr(self, "add_wrapper_with_key", None)
        ext = getattr(self._comfy, "patcher_extension", None)
        outer = getattr(getattr(ext, "WrappersMP", None), "OUTER_SAMPLE",
                        None)
        if wrap is not None and outer is not None:
            wrap(outer, OPTION, _sampled)

    # -------------------------------------------------- which path
    def _vp(self):
        p = getattr(self.model, "_vpager_pager", None)
        return p if p is not None and not p.closed else None

    # The path is the model's (clones share it): the last load chose.
    @property
    def _vp_mode(self):
        return getattr(self.model, "_vpager_mode", None)

    @_vp_mode.setter
    def _vp_mode(self, mode):
        self.model._vpager_mode = mode

    def vpager_active(self):
        """True while this model's weights are vpager's (for every
        clone of it: the last load decided)."""
        return self._vp_mode == "vpager" and self._vp() is not None

    def _vp_why_not(self):
        if env_off():
            return "turned off (%s=0)" % ENV
        if self.model_options.get(OPTION, True) is False:
            return "turned off for this model (VpagerSettings node)"
        dev = self.load_device
        if not (getattr(dev, "type", None) == "cuda"
                or (ALLOW_SIM and getattr(dev, "type", None) == "cpu")):
            return "load device %s is not a CUDA device" % (dev,)
        if getattr(self, "force_cast_weights", False):
            return "force_cast_weights is set"
        plan = self._vp_plan()
        if plan.why is not None:
            return plan.why
        return patch_refusal(self, plan, self._comfy)

    def _vp_plan(self):
        plan = getattr(self.model, "_vpager_plan", None)
        if plan is None:
            plan = plan_model(self.model, self._comfy, self._ggml)
            self.model._vpager_plan = plan
        return plan

    def _vp_leave(self):
        """Hand the model back to ComfyUI's own path."""
        pager = getattr(self.model, "_vpager_pager", None)
        if pager is not None:
            pager.close()
            self.model._vpager_pager = None
            hook = getattr(pager, "hook", None)
            if hook is not None:
                hook.remove()
        self.model._vpager_plan = None

    # ------------------------------------------------------ loading
    def partially_load(self, device_to, extra_memory=0,
                       force_patch_weights=False):
        why = self._vp_why_not()
        if why is not None:
            if self._vp() is not None:
                self._vp_leave()
            note(self.model, why)
            self._vp_mode = "comfy"
            return super().partially_load(device_to, extra_memory,
                                          force_patch_weights)
        if self._vp_mode == "comfy":
            self._vp_from_comfy()
        self._vp_mode = "vpager"
        assert not force_patch_weights
        refused = None
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            self.unpatch_model(self.offload_device, unpatch_weights=False)
            self.patch_model(load_weights=False)
            try:
                self._vp_load(device_to)
            except ValueError as e:
                # vpager.torch refused the model before changing it
                # (a unit the shared staging ring cannot hold within
                # the budget): ComfyUI's own path takes it.
                self.detach()
                refused = str(e)
            except Exception:
                self.detach()
                raise
        if refused is not None:
            self._vp_leave()
            note(self.model, refused)
            self._vp_mode = "comfy"
            return super().partially_load(device_to, extra_memory,
                                          force_patch_weights)
        return 0

    def _vp_from_comfy(self):
        """The model was on ComfyUI's own dynamic path: its comfy_aimdo
        VBAR's pages and ComfyUI-way weights go before vpager takes it."""
        vbar_get = getattr(self, "_vbar_get", None)
        vbar = vbar_get() if vbar_get is not None else None
        if vbar is not None:
            try:
                self._base.partially_unload(self, self.offload_device, 1e32)
            except Exception as e:     # never worse than not freeing
                log.warning("vpager: freeing %s's comfy_aimdo pages: %s",
                            type(self.model).__name__, e)

    def load(self, *args, **kwargs):
        # (passed on as given: ComfyUI-GGUF's load takes them so, and the
        # legacy ModelPatcher's has no `dirty`)
        if getattr(self, "_vp_mode", None) != "vpager":
            return super().load(*args, **kwargs)
        device_to = args[0] if args else kwargs.get("device_to")
        with self.use_ejected():
            self._vp_load(device_to)

    def _vp_pager(self, device_to):
        pager = self._vp()
        plan = self._vp_plan()
        if pager is not None and any(
                e.module._parameters.get(e.pname) is not e.param
                for e in pager.entries):
            # A parameter was replaced behind vpager's back.
            self._vp_leave()
            pager, plan = None, self._vp_plan()
        if pager is None:
            target = torch.device(device_to)
            if target.type == "cuda" and target.index is None:
                target = torch.device("cuda", torch.cuda.current_device())
            dev, budget = vp_device(target, self._comfy.args)
            root = getattr(self.model, "diffusion_model", None)
            root = root if isinstance(root, torch.nn.Module) else \
                self.model
            pager = engine.Pager(
                dev, target, self.model, plan.units,
                prefer_file=bool(getattr(self._comfy.args, "fast_disk",
                                           False)),
                label="comfyui:%s" % type(self.model).__name__,
                budget=budget, root=root, dtypes=plan.dtypes)
            self.model._vpager_pager = pager
            # The root's forwards learn torch's headroom through
            # vpager.torch's own hooks on it (roothooks.py: its "learn"
            # slot on CUDA); the node adds none. No finalizer of ours:
            # the model and its pager form a cycle (vpager.torch's handle
            # holds the model); when ComfyUI drops the model the collector
            # takes both, and vpager.torch.ledger's finalizer closes the
            # VBAR.
        return pager, plan

    def _vp_placed(self, plan):
        """The tensors a load puts in place ComfyUI's way: the forced
        weights and the buffers, in order (None for a missing one)."""
        return [m._parameters.get(k) for _key, m, k in plan.forced] + \
            [b for _k, b in self.model.named_buffers(recurse=True)]

    @staticmethod
    def _vp_refs(tensors):
        """Weak references (a replaced tensor is not kept alive)."""
        return [weakref.ref(t) if t is not None else None
                for t in tensors]

    def _vp_as_before(self, device_to):
        """True when the model's last load was by this patch set onto
        device_to, with this pager, its managed parameters are vpager's
        and every tensor that load put in place ComfyUI's way is still
        there (a detach or a clone with other patches since: False).
        Then nothing needs loading again (ComfyUI loads the model
        before every prompt)."""
        last = getattr(self.model, "_vp_last_load", None)
        pager = self._vp()
        if last is None or pager is None or last[0] is not pager or \
                last[1] != self.patches_uuid or last[2] != device_to or \
                self.model.current_weight_patches_uuid != \
                self.patches_uuid:
            return False
        if any(e.module._parameters.get(e.pname) is not e.param
               for e in pager.entries):
            return False        # replaced behind vpager's back
        now = self._vp_placed(self._vp_plan())
        return len(now) == len(last[3]) and all(
            (t is None and r is None) or (r is not None and r() is t)
            for t, r in zip(now, last[3]))

    def _vp_load(self, device_to):
        assert device_to == self.load_device
        t0 = time.perf_counter()
        if self._vp_as_before(device_to):
            pager = self._vp()
            pager.finish_recording()
            pager.prioritize(force=True)
            pager.learn(force=True)
            # Between prompts: the first prompt's plan kept a placement
            # no step stopped for; a faster one is placed now, once.
            pager.refine()
            self._vp_refilled = 0
            log.info("vpager: %s on vpager as loaded before (%.1f ms)",
                     type(self.model).__name__,
                     (time.perf_counter() - t0) * 1e3)
            self._vp_loaded_callbacks(device_to)
            return
        self.restore_loaded_backups()
        self.unpatch_hooks()
        pager, plan = self._vp_pager(device_to)
        # Models whose root forward never runs (a VAE's decode): the
        # order recorded since the last load places the weights now.
        pager.finish_recording()
        for name, m, _params in plan.units:
            self._vp_prepare_op(name, m)
        # Patched weights: only those whose patch set changed refill.
        refilled = computed = 0
        before = pager.torch_peak()
        for e in pager.entries:
            patches = self.patches.get(e.key) or None
            if engine.same_patch(e.patch, patches):
                continue
            self._vp_patch(pager, e, patches, device_to)
            refilled += 1
            computed += e.split is not None and patches is not None
        if computed and device_to.type == "cuda":
            # ComfyUI computed patched QuantizedTensors on the device here:
            # torch's cache would keep those blocks reserved, room the
            # budget's weights and the staging ring then lack. (Weights
            # patched at fill compute in the forward: nothing to give.)
            # Nor is the peak they raised the activations': learned below.
            torch.cuda.empty_cache()
        else:
            before = None
        # The rest ComfyUI's way: straight to the device; a parameter
        # of a module that is no ComfyUI op in the dtype the model
        # declares for it, as ComfyUI's dynamic path puts it there
        # (Wan's modulation of a UNet loaded as fp8 from a bf16 file:
        # fp8, cast on the device).
        for key, m, k in plan.forced:
            if m._parameters.get(k) is None:
                continue
            self._vp_force(key, device_to)
            w = m._parameters[k]
            want = getattr(m, k + "_comfy_model_dtype", None) \
                if self._vp_declared else None
            if not hasattr(m, "comfy_cast_weights") and \
                    want is not None and w.dtype != want:
                self._comfy.utils.set_attr_param(self.model, key, w.to(want))
                w = m._parameters[k]
            self.model.model_loaded_weight_memory += engine.nbytes(w)
        for key, buf in self.model.named_buffers(recurse=True):
            if key not in self.backup_buffers:
                self.backup_buffers[key] = buf
            module, name = self._comfy.utils.resolve_attr(self.model, key)
            dtype = getattr(module, name + "_comfy_model_dtype", None) \
                if self._vp_declared else None
            moved = buf.to(dtype=dtype, device=device_to)
            self._comfy.utils.set_attr_buffer(self.model, key, moved)
            self.model.model_loaded_weight_memory += engine.nbytes(moved)
        pager.prioritize(force=True)
        pager.learn(force=True, before=before)
        pager.refine()
        self.model.device = device_to
        self.model.current_weight_patches_uuid = self.patches_uuid
        self._vp_refilled = refilled
        self.model._vp_last_load = (pager, self.patches_uuid, device_to,
                                    self._vp_refs(self._vp_placed(plan)))
        log.info("vpager: %s on vpager: %d weights (%d MB) in %d units, "
                 "%d converted to their ops' dtype (%.0f ms), %d "
                 "patched (%d refilled), %d loaded ComfyUI's way "
                 "(%.1f ms)", type(self.model).__name__,
                 len(pager.entries), pager.weight_bytes >> 20,
                 len(pager.units), len(pager.converted),
                 pager.convert_s * 1e3, len(pager.patched_keys()),
                 refilled, len(plan.forced),
                 (time.perf_counter() - t0) * 1e3)
        self._vp_loaded_callbacks(device_to)

    def _vp_patch(self, pager, e, patches, device_to):
        """Weight e (an engine.Entry) is to hold its patch set `patches`
        (None: its own bytes), which differs from the one it holds."""
        key = e.key
        if e.split is None:
            make = lambda: self._vp_patched(key, device_to)  # noqa: E731
            fill = self._vp_fill(e, device_to) if patches else None
        else:
            # A QuantizedTensor: its small parts (scales) host copies of
            # the patched weight's, its payload patched at fill from its
            # own bytes the same way.
            make = lambda: self._vp_split_patched(e, device_to)  # noqa
            fill = self._vp_split_fill(e, device_to) if patches else None
        pager.set_patched(key, list(patches) if patches else None, make,
                          fill=fill)

    def _vp_patched(self, key, device_to):
        """The patched weight `key`, computed on device_to from the
        parameter's tensor (ComfyUI's own patch_weight_to_device); None
        when it was written into that tensor in place."""
        return self.patch_weight_to_device(key, device_to=device_to,
                                           return_weight=True)

    def _vp_split_patched(self, e, device_to, payload=None):
        """QuantizedTensor weight e patched, computed on device_to from
        its own parts there (payload: its payload's own bytes already on
        the device, a fill's view; else every part copied there, as
        ComfyUI's legacy load copies the weight before patching it):
        the op's parameter is its own QuantizedTensor over them while
        ComfyUI's patch_weight_to_device runs (dequantize, patch,
        requantize with the key's seed)."""
        qt = e.split.own_on(device_to, payload)
        d = e.module._parameters
        own = d[e.pname]
        d[e.pname] = qt
        try:
            return self._vp_patched(e.key, device_to)
        finally:
            d[e.pname] = own

    @contextlib.contextmanager
    def _vp_fill_patches(self, e, device):
        """A fill's patch set: weight e's now must be the one it was last
        loaded with (e.patch; RuntimeError if not); while the fill runs,
        ComfyUI's patches[key] is its copy on `device` once the weight
        streams (e.stage: patch_stage)."""
        own = self.patches.get(e.key) or None
        if not engine.same_patch(own, e.patch):
            raise RuntimeError(
                "vpager ComfyUI node: %s's patches changed after its "
                "load; load the model again" % e.key)
        use = own if e.stage is None else e.stage.patches(own, device)
        if use is own:
            yield
            return
        self.patches[e.key] = use
        try:
            yield
        finally:
            self.patches[e.key] = own

    def _vp_split_fill(self, e, device_to):
        """QuantizedTensor weight e's payload patched at fill: fill(view)
        computes the patched weight over the payload's own bytes in
        `view` (_vp_split_patched, as its make() did from a copy of the
        same bytes, so the small parts' host copies match) and writes the
        patched payload back into `view`."""
        split = e.split

        def fill(view):
            with self._vp_fill_patches(e, view.device), torch.no_grad(), \
                    torch.inference_mode(False):
                out = self._vp_split_patched(e, device_to, view)
                view.copy_(split.sources(out)[split.payload])

        return fill

    def _vp_force(self, key, device_to):
        """A parameter outside the units straight to device_to, patched,
        ComfyUI's way (its backup restored at the next load)."""
        self.patch_weight_to_device(key, device_to=device_to,
                                    force_cast=True)

    def _vp_fill(self, e, device_to):
        """Weight e (an engine.Entry) patched at fill: fill(view) computes
        the patched weight on the device from its own bytes in `view`
        with ComfyUI's own patch_weight_to_device (the parameter over
        `view` while it runs: as ComfyUI's legacy path patches it, so the
        bytes are the same) and writes it back into `view`. Runs each
        time the weight is filled from its source: a resident weight once
        per patch set, a streamed one at every fill."""
        key, param = e.key, e.param

        def fill(view):
            with self._vp_fill_patches(e, view.device), torch.no_grad(), \
                    torch.inference_mode(False):
                old = param.data
                swap = old.data_ptr() != view.data_ptr()
                if swap:
                    param.data = view
                try:
                    out = self._vp_patched(key, device_to)
                finally:
                    if swap:
                        param.data = old
                if out is not None:
                    view.copy_(out)

        return fill

    def _vp_loaded_callbacks(self, device_to):
        for callback in self.get_all_callbacks(
                self._comfy.model_patcher.CallbacksMP.ON_LOAD):
            callback(self, device_to, 0, False, False)
        self.apply_hooks(self.forced_hooks, force_apply=True)

    def _vp_prepare_op(self, n, m):
        """The op computes on what vpager hands it (its weights in the
        dtype the op declares, as ComfyUI's VRAM copy: converted at
        load when stored in another, engine.convert_host): no aimdo
        state, its class's comfy_cast_weights, ComfyUI's weight
        wrappers kept."""
        for attr in ("_v", "_v_signature", "_v_weight", "_v_bias",
                     "weight_lowvram_function", "bias_lowvram_function",
                     "comfy_cast_weights", "prev_comfy_cast_weights"):
            if attr in m.__dict__:
                vbar = getattr(self._comfy, "model_vbar", None)
                if attr == "_v" and vbar is not None:
                    try:
                        vbar.vbar_unpin(m._v)
                    except Exception:
                        pass
                delattr(m, attr)
        m.seed_key = n
        for k in ("weight", "bias"):
            fns = []
            key = "%s.%s" % (n, k) if n else k
            if key in self.weight_wrapper_patches:
                fns.extend(self.weight_wrapper_patches[key])
            setattr(m, k + "_function", fns)

    # ------------------------------------------------------- ledger
    def loaded_size(self):
        if not self.vpager_active():
            return super().loaded_size()
        return (self._vp().loaded_size()
                + self.model.model_loaded_weight_memory)

    def partially_unload(self, device_to, memory_to_free=0,
                         force_patch_weights=False):
        if not self.vpager_active():
            return super().partially_unload(device_to, memory_to_free,
                                            force_patch_weights)
        freed = self._vp().free_memory(memory_to_free)
        if freed < memory_to_free:
            freed += self.restore_loaded_backups()
        return freed

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if not self.vpager_active():
            return super().unpatch_model(device_to, unpatch_weights)
        self._comfy.model_patcher.ModelPatcher.unpatch_model(
            self, device_to=None, unpatch_weights=False)
        if unpatch_weights:
            self._vp().free_memory(engine.ALL)
            self.restore_loaded_backups()

    def get_free_memory(self, device):
        return super().get_free_memory(device) + reclaimable(device)

    def loaded_ram_size(self):
        n = super().loaded_ram_size()
        p = self._vp()
        return n + (p.host_bytes() if p is not None else 0)

    def pinned_memory_size(self):
        n = super().pinned_memory_size()
        p = self._vp()
        return n + (p.host_bytes() if p is not None else 0)

    def vpager_stats(self):
        """The pager's counters (engine.Pager.stats()), or None."""
        p = self._vp()
        return p.stats() if p is not None else None


def _sampled(executor, *args, **kwargs):
    """ComfyUI's OUTER_SAMPLE wrapper: once a sampling is done (the VAE
    decodes next, the next prompt's sampling comes later), the paged
    model's forwards pause: torch's blocks its last forward lent to the
    staging ring go back to torch for the work in between (Pager.pause;
    VPAGER_LEND_EARLY). A failure there is logged, never the sampling's."""
    try:
        return executor(*args, **kwargs)
    finally:
        guider = getattr(executor, "class_obj", None)
        patcher = getattr(guider, "model_patcher", None)
        vp = getattr(patcher, "_vp", None)
        pager = vp() if callable(vp) else None
        if pager is not None:
            try:
                pager.pause()
            except Exception as e:      # the sampling's result stands
                log.warning("vpager node: giving torch's lent blocks "
                            "back after a sampling failed: %s", e)


def _cloned(_src, clone):
    """ComfyUI's ON_CLONE callback: a clone of another class (ComfyUI-GGUF's
    loader's, when the node could not adopt it: gguf_patcher) never
    reaches the node; say so."""
    if isinstance(clone, VpagerPatcher) or gguf.adopted(type(clone)):
        return
    why = gguf.clone_refusal(clone)
    if why is not None:
        note(clone.model, why)


def make_class(comfy, base):
    """VpagerModelPatcher: VpagerPatcher over ComfyUI's
    ModelPatcherDynamic `base`. comfy: a namespace with model_patcher,
    model_management, utils, lora and cli_args.args."""
    return type("VpagerModelPatcher", (VpagerPatcher, base),
                {"_comfy": comfy, "_base": base, "__module__": __name__,
                 "__qualname__": "VpagerModelPatcher",
                 "__doc__": VpagerPatcher.__doc__})
