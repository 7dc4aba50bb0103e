"""Tests of the ComfyUI node (integrations/comfyui/) without ComfyUI: stand-in
modules mimic the parts of ComfyUI 0.33 the node meets (ModelPatcher and
ModelPatcherDynamic's methods and attributes, comfy.ops-style layers with
comfy_cast_weights and weight_function, comfy.lora's calculate_weight /
calculate_shape, the LoadedModel / free_memory ledger calls), on vpager's
simulated device (CPU tensors over its memory).

    make && PYTHONPATH=python:integrations python3 tests/python/test_comfyui_node.py

Checked: the node's unit collection, outputs bitwise equal to the same
model with resident weights, the ledger's answers (loaded_size,
partially_unload, detach, get_free_memory, the model_unload escalation),
patch identity (only weights whose patch set changed refill), stored dtype
other than compute dtype, file sources, two models on one device, and the
fallback decisions with their one log line.
"""

import contextlib
import collections
import copy
import gc
import json
import importlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import threading
import types
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("integrations", "python")

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

from _runner import raises  # noqa: E402,F401  (the runner's helpers)

if torch is not None:
    import vpager  # noqa: E402
    import vpager.torch as vt  # noqa: E402
    import comfyui as node  # noqa: E402  (integrations/comfyui)
    from comfyui import engine, patch_stage, patcher as glue  # noqa: E402
    from vpager.torch import tuner  # noqa: E402
    # Measuring stops at the second forward: these tests count forwards,
    # and whether a later one's work settled is the host clock's call
    # (test_torch.py's test_measuring_goes_on_until_the_work_settles).
    tuner.ROUNDS_MAX = tuner.ROUNDS

K = 1 << 10
GiB_ = 1 << 30
PAGE = 64 * K
CPU = torch.device("cpu") if torch is not None else None


# ----------------------------------------------------------- stand-ins

class Args:
    reserve_vram = None
    vram_headroom = 0
    fast_disk = False
    disable_dynamic_vram = False
    disable_smart_memory = False


def calculate_shape(patches, weight, key):
    shape = tuple(weight.shape)
    for p in patches:
        kind, data = p[1]
        if kind == "resize":
            shape = tuple(data[0].shape)
    return shape


def calculate_weight(patches, weight, key, intermediate_dtype=None):
    """ComfyUI's merge, reduced to its "diff" kind: w*sm + sp*diff."""
    for strength, (kind, data), strength_model, offset, function in patches:
        if strength_model != 1.0:
            weight = weight * strength_model
        weight = weight + strength * data[0].to(weight.dtype)
    return weight


def resolve_attr(obj, attr):
    names = attr.split(".")
    for n in names[:-1]:
        obj = getattr(obj, n)
    return obj, names[-1]


def set_attr_param(obj, attr, value):
    o, n = resolve_attr(obj, attr)
    prev = getattr(o, n)
    setattr(o, n, nn.Parameter(value, requires_grad=False))
    return prev


def set_attr_buffer(obj, attr, value):
    o, n = resolve_attr(obj, attr)
    prev = getattr(o, n)
    o.register_buffer(n, value)
    return prev


class Backup:
    def __init__(self, weight, inplace_update=False):
        self.weight, self.inplace_update = weight, inplace_update


class CallbacksMP:
    ON_LOAD = "on_load"


class ModelPatcher:
    """ComfyUI's ModelPatcher, the attributes and methods the node uses."""

    def __init__(self, model, load_device, offload_device, size=0,
                 weight_inplace_update=False):
        self.model, self.size = model, size
        self.load_device, self.offload_device = load_device, offload_device
        self.patches, self.backup, self.backup_buffers = {}, {}, {}
        self.object_patches, self.weight_wrapper_patches = {}, {}
        self.model_options = {"transformer_options": {}}
        self.weight_inplace_update = weight_inplace_update
        self.force_cast_weights = False
        self.patches_uuid = uuid.uuid4()
        self.hook_patches, self.forced_hooks = {}, None
        self.callbacks = {CallbacksMP.ON_LOAD: []}
        for k, v in (("model_loaded_weight_memory", 0), ("device", None),
                     ("current_weight_patches_uuid", None)):
            if not hasattr(model, k):
                setattr(model, k, v)

    def is_dynamic(self):
        return False

    def model_size(self):
        if not self.size:
            self.size = sum(t.numel() * t.element_size()
                            for t in self.model.state_dict().values())
        return self.size

    def loaded_size(self):
        return self.model.model_loaded_weight_memory

    def get_free_memory(self, device):
        return MM.free

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device,
                           self.model_size())
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.model_options = copy.deepcopy(self.model_options)
        n.backup, n.backup_buffers = self.backup, self.backup_buffers
        return n

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        for key, data in patches.items():
            self.patches.setdefault(key, []).append(
                (strength_patch, data, strength_model, None, None))
        self.patches_uuid = uuid.uuid4()

    @contextlib.contextmanager
    def use_ejected(self, skip_and_inject_on_exit_only=False):
        yield

    def patch_model(self, device_to=None, lowvram_model_memory=0,
                    load_weights=True, force_patch_weights=False):
        return self.model

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        self.unpatched = getattr(self, "unpatched", 0) + 1

    def unpatch_hooks(self):
        pass

    def apply_hooks(self, hooks, force_apply=False):
        pass

    def get_all_callbacks(self, kind):
        return self.callbacks.get(kind, [])

    def detach(self, unpatch_all=True):
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=True)
        return self.model

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False,
                               return_weight=False, force_cast=False):
        o, n = resolve_attr(self.model, key)
        weight = getattr(o, n)
        if key not in self.patches and not force_cast:
            return weight
        if key not in self.backup and not return_weight:
            self.backup[key] = Backup(weight)
        if key in self.patches:
            out = calculate_weight(self.patches[key],
                                   weight.to(torch.float32, copy=True), key)
            out = out.to(weight.dtype)
        else:
            out = weight.to(device_to, copy=True)
        if return_weight:
            return out
        set_attr_param(self.model, key, out)


class ModelPatcherDynamic(ModelPatcher):
    """ComfyUI's own dynamic path: here it just marks what it did."""

    def is_dynamic(self):
        return True

    def restore_loaded_backups(self):
        restored = self.model.model_loaded_weight_memory
        for key in list(self.backup):
            set_attr_param(self.model, key, self.backup.pop(key).weight)
        for key in list(self.backup_buffers):
            set_attr_buffer(self.model, key, self.backup_buffers.pop(key))
        self.model.model_loaded_weight_memory = 0
        return restored

    def partially_load(self, device_to, extra_memory=0,
                       force_patch_weights=False):
        self.load(device_to)

    def load(self, device_to=None, lowvram_model_memory=0,
             force_patch_weights=False, full_load=False, dirty=False):
        self.model.comfy_loaded = getattr(self.model, "comfy_loaded", 0) + 1
        self.model.aimdo_vbar = object()        # its comfy_aimdo VBAR

    def _vbar_get(self, create=False):
        return getattr(self.model, "aimdo_vbar", None)

    def partially_unload(self, device_to, memory_to_free=0,
                         force_patch_weights=False):
        self.model.aimdo_freed = memory_to_free
        return 0

    def loaded_ram_size(self):
        return 0

    def pinned_memory_size(self):
        return 0


class MMState:
    free = 1000


MM = MMState()


def comfy_ns(args=None):
    mp = types.SimpleNamespace(ModelPatcher=ModelPatcher,
                               ModelPatcherDynamic=ModelPatcherDynamic,
                               CoreModelPatcher=ModelPatcherDynamic,
                               CallbacksMP=CallbacksMP)
    return types.SimpleNamespace(
        model_patcher=mp, model_management=MM,
        utils=types.SimpleNamespace(resolve_attr=resolve_attr,
                                    set_attr_buffer=set_attr_buffer,
                                    set_attr_param=set_attr_param),
        lora=types.SimpleNamespace(calculate_shape=calculate_shape,
                                   calculate_weight=calculate_weight),
        args=args or Args(), model_vbar=None)


def model_unload(model, memory_to_free=None):
    """ComfyUI's LoadedModel.model_unload: partially_unload first, detach
    when that freed less than asked. True if the model was detached."""
    if memory_to_free is not None and memory_to_free < model.loaded_size():
        if model.partially_unload(model.offload_device,
                                  memory_to_free) >= memory_to_free:
            return False
    model.detach(True)
    return True


# ------------------------------------------------------ stand-in ops

class CastOp:
    comfy_cast_weights = False
    weight_function = []
    bias_function = []


class Linear(nn.Linear, CastOp):
    """comfy.ops' Linear: casts the weight to the input's dtype (on the
    device the weight is on) when comfy_cast_weights or functions ask."""

    fails = 0           # the tests make it run out of memory this often

    def forward(self, x):
        if self.fails:
            self.fails -= 1
            raise RuntimeError("CUDA out of memory (a stand-in)")
        if self.comfy_cast_weights or self.weight_function:
            w = self.weight.to(x.dtype)
            for f in self.weight_function:
                w = f(w)
            b = self.bias.to(x.dtype) if self.bias is not None else None
            return torch.nn.functional.linear(x, w, b)
        return super().forward(x)


class CastLinear(Linear):
    comfy_cast_weights = True       # manual_cast: stored dtype != compute


class LayerNorm(nn.LayerNorm, CastOp):
    pass


class Packed(torch.Tensor if torch is not None else object):
    """A tensor subclass that does not say how to take it apart (no
    flatten protocol: not a QuantizedTensor)."""


class Block(nn.Module):
    def __init__(self, d, h, op=Linear, dtype=torch.float32):
        super().__init__()
        self.norm = LayerNorm(d)
        self.up = op(d, h, dtype=dtype)
        self.down = op(h, d, dtype=dtype)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class DiT(nn.Module):
    """A DiT-shaped stand-in: ComfyUI's BaseModel holds diffusion_model."""

    def __init__(self, n=6, d=64, h=256, op=Linear, dtype=torch.float32,
                 seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.diffusion_model = nn.Module()
        dm = self.diffusion_model
        dm.pos = nn.Parameter(torch.randn(d) * 0.1, requires_grad=False)
        dm.blocks = nn.ModuleList(Block(d, h, op, dtype) for _ in range(n))
        dm.register_buffer("scale", torch.full((d,), 0.5))
        for p in self.parameters():
            p.requires_grad_(False)
            p.data = (torch.randn(p.shape) * 0.05).to(p.dtype)

    def forward(self, x):
        dm = self.diffusion_model
        x = x + dm.pos
        for b in dm.blocks:
            x = b(x)
        return x * dm.scale


def sim_factory(capacity=640 * K, staging=256 * K):
    def factory(target):
        return vt.open_device("sim", sim_capacity=capacity, page_size=PAGE,
                              sim_granularity=PAGE, staging_size=staging,
                              lookahead=0, sim_shared="", sim_streams="sync")
    return factory


class Env:
    """The node wired to the stand-ins on a fresh simulated device."""

    def __init__(self, capacity=640 * K, staging=256 * K, args=None):
        self.comfy = comfy_ns(args)
        glue.DEVICE_FACTORY = sim_factory(capacity, staging)
        glue.ALLOW_SIM = True
        glue._DEVICES.clear()
        glue._LOGGED.clear()
        self.cls = glue.make_class(self.comfy, ModelPatcherDynamic)

    def patcher(self, model):
        return self.cls(model, CPU, CPU)

    def close(self):
        for dev, _budget in glue._DEVICES.values():
            if not dev.closed:
                dev.close()
        glue._DEVICES.clear()
        glue.DEVICE_FACTORY = None
        glue.ALLOW_SIM = False


@contextlib.contextmanager
def env(**kw):
    e = Env(**kw)
    try:
        yield e
    finally:
        gc.collect()
        e.close()


class Logs(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def logs():
    h = Logs()
    lg = logging.getLogger("vpager.comfyui")
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def frozen(model):
    ref = copy.deepcopy(model)
    return ref


X = None


def inputs():
    global X
    if X is None:
        g = torch.Generator().manual_seed(1)
        X = torch.randn(4, 64, generator=g)
    return X


def run(model):
    with torch.inference_mode():
        return model(inputs())


# ---------------------------------------------------------------- tests

def test_unit_collection():
    m = DiT()
    plan = glue.plan_model(m, comfy_ns())
    assert plan.why is None
    names = [n for n, _, _ in plan.units]
    assert names == ["diffusion_model.blocks.%d.%s" % (i, k)
                     for i in range(6) for k in ("up", "down")], names
    keys = [key for _, _, ps in plan.units for key, _ in ps]
    assert "diffusion_model.blocks.0.up.weight" in keys
    assert "diffusion_model.blocks.0.up.bias" in keys
    forced = sorted(key for key, _, _ in plan.forced)
    # The root's own parameter and the tiny norms go ComfyUI's way.
    assert "diffusion_model.pos" in forced
    assert "diffusion_model.blocks.3.norm.weight" in forced
    assert not any(k.endswith("up.weight") for k in forced)


def test_outputs_bitwise_and_paging():
    with env() as e:
        m = DiT()
        ref = frozen(m)
        want = run(ref)
        p = e.patcher(m)
        assert p.partially_load(CPU) == 0
        assert p.vpager_active()
        for _ in range(3):
            assert torch.equal(run(m), want)
        s = p.vpager_stats()["model"]
        # 12 units of ~64 KiB in a 640 KiB device with a 256 KiB ring:
        # weights are paged, and some stay resident.
        assert s["weights"] == 24 and s["units"] == 12
        assert s["misses"] > 0 and s["hits"] > 0, s
        # Outside the forward the weights are real CPU tensors.
        w = m.diffusion_model.blocks[0].up.weight
        assert w.device.type == "cpu"
        assert torch.equal(w, ref.diffusion_model.blocks[0].up.weight)
        assert "forward" in m.diffusion_model.blocks[0].up.__dict__


def test_a_sampling_end_pauses_the_model():
    """ComfyUI's OUTER_SAMPLE wrapper, registered on the node's patchers
    where ComfyUI has wrappers: the sampling's result passes through,
    then the paged model's pause() runs (torch's blocks its last forward
    lent go back before the VAE decodes: VPAGER_LEND_EARLY); a pause
    that fails is logged, the sampling's result stands."""
    class Wrapping(ModelPatcherDynamic):
        def __init__(self, *args, **kwargs):
            self.wrappers = {}
            super().__init__(*args, **kwargs)

        def add_wrapper_with_key(self, kind, key, fn):
            self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    class Executor:         # ComfyUI's WrapperExecutor around outer_sample
        def __init__(self, guider, model):
            self.class_obj, self.model = guider, model

        def __call__(self, *args, **kwargs):
            return run(self.model)

    with env() as e:
        e.comfy.patcher_extension = types.SimpleNamespace(
            WrappersMP=types.SimpleNamespace(OUTER_SAMPLE="outer_sample"))
        m = DiT()
        want = run(frozen(m))
        p = glue.make_class(e.comfy, Wrapping)(m, CPU, CPU)
        assert p.partially_load(CPU) == 0 and p.vpager_active()
        [sampled] = p.wrappers["outer_sample"][glue.OPTION]
        guider = types.SimpleNamespace(model_patcher=p)
        paused, pause = [], engine.Pager.pause
        try:
            engine.Pager.pause = lambda self: paused.append(self)
            assert torch.equal(sampled(Executor(guider, m)), want)
            assert paused == [p._vp()], paused

            def fails(self):
                raise RuntimeError("no device")
            engine.Pager.pause = fails
            with logs() as lines:
                assert torch.equal(sampled(Executor(guider, m)), want)
            assert any("no device" in x for x in lines), lines
        finally:
            engine.Pager.pause = pause
        assert torch.equal(sampled(Executor(guider, m)), want)  # the real


def bench_module(name):
    sys.path.insert(0, os.path.join(REPO, "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_bench_node_loads_its_harness():
    """bench/bench_node.py loads bench/comfyui_run.py by path
    in a fresh interpreter whose sys.path does not hold bench/ (the device
    run of the seventh session's tree failed there at import)."""
    script = ("import runpy, sys; sys.path = [p for p in sys.path if "
              "not p.endswith('bench')]; ns = runpy.run_path(%r, "
              "run_name='bench_node'); cr = ns['harness'](); "
              "print(cr.TAG, cr.step_timeline.TAG)"
              % os.path.join(REPO, "bench", "bench_node.py"))
    out = subprocess.run([sys.executable, "-c", script],
                         cwd=tempfile.gettempdir(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "COMFYUI_RUN" in out.stdout and "COMFYUI_TIMELINE" in out.stdout


def test_bench_fp8_matrix():
    """bench_node.py --fp8: UNETLoader's weight_dtype options as ComfyUI's
    model options, budgets of half the weights as held (fp8: a byte a
    value, float32 tensors kept), each cell's runs, and the verdict: the
    node's latents equal to resident's or legacy's prompt by prompt
    (ComfyUI's dynamic path under the budget printed, not judged). The
    children are stand-ins here (no GPU, no ComfyUI)."""
    import runpy
    ns = runpy.run_path(os.path.join(REPO, "bench", "bench_node.py"), run_name="bench_node")
    cr = ns["harness"]()
    t = types.SimpleNamespace(float8_e4m3fn="e4m3", float8_e5m2="e5m2")
    assert cr.unet_options("default", t) == {}
    assert cr.unet_options("fp8_e4m3fn_fast", t) == {
        "dtype": "e4m3", "fp8_optimizations": True}
    assert cr.unet_options("fp8_e5m2", t) == {"dtype": "e5m2"}
    a = cr.parse(["--comfyui", "x", "--weight-dtype", "fp8_e5m2"])
    assert "fp8_e5m2" in cr.common_args(a)
    gen = {"bytes": 4 * GiB_, "w_max": 2 << 20, "path": "ck",
           "link_GBps": 50.0,
           "held": {"default": {"bytes": 4 * GiB_, "w_max": 2 << 20},
                    "fp8": {"bytes": 2 * GiB_ + 4096, "w_max": 1 << 20}}}
    assert ns["budget_of"]("nodehalf", gen, "fp8_e4m3fn") == \
        ("%.3f" % ((2 * GiB_ + 4096) / 2 / GiB_), GiB_ + 2048)
    assert ns["budget_of"]("half", gen)[1] == 2 * GiB_
    assert cr.budget_arg("half", gen, a) == "%.3f" % (
        (2 * GiB_ + 4096) / 2 / GiB_)
    ours = ns["split_args"](["--fp8", "--fp8-lora", "both"])[0]
    assert ns["fp8_configs"](ours) == [
        (d, lo) for d in ns["FP8_DTYPES"] for lo in (False, True)]
    assert ns["fp8_runs"]("fp8_e4m3fn", False) == [
        "resident", "nodehalf", "half"]
    assert ns["fp8_runs"]("fp8_e4m3fn_fast", False)[-1] == "legacy"
    assert ns["fp8_runs"]("fp8_e5m2", True)[-1] == "legacy"

    # One cell with stand-in children: the node equals resident on the
    # LoRA-free prompts and legacy on the LoRA ones; ComfyUI's dynamic
    # path under the budget equals neither on one prompt (not judged).
    labels = ["base", "lora_a", "removed"]
    lat = {"resident": "RRR", "legacy": "LLL", "nodehalf": "RLR",
           "half": "RXR"}
    seen = []

    def child(run):
        seen.append(run)
        return {"reps": [{"label": lb, "steps_ms": [90.0, 10.0, 10.0],
                          "latent_sha256": lat[run][i] * 64,
                          "torch_peak_reserved": 1 << 28,
                          "torch_reserved": 1 << 28, "device_used": 1 << 30}
                         for i, lb in enumerate(labels)]}
    g = ns["fp8_matrix"].__globals__
    saved = (cr.run_child, g["run_node_child"], g["say"], g["report"])
    lines = []
    try:
        cr.run_child = lambda a, kind, extra, log: child(
            extra[extra.index("--tag") + 1])
        g["run_node_child"] = lambda cr_, a, run, *rest: child(run)
        g["say"] = lambda *x: lines.append(" ".join(map(str, x)))
        g["report"] = lambda *x: None
        ours = ns["split_args"](["--fp8", "--dtypes", "fp8_e4m3fn",
                                 "--fp8-lora", "on"])[0]
        with tempfile.TemporaryDirectory() as out:
            summary = {"runs": {}}
            rc = ns["fp8_matrix"](cr, a, ours, out, gen, summary)
            assert rc == 0, lines
            assert seen == ["resident", "nodehalf", "half", "legacy"]
            lat["nodehalf"] = "RXR"
            seen[:] = []
            assert ns["fp8_matrix"](cr, a, ours, out, gen, summary) == 2
    finally:
        (cr.run_child, g["run_node_child"], g["say"], g["report"]) = saved
    table = lines[lines.index(next(x for x in lines
                                   if x.startswith("fp8 matrix"))):]
    assert any("fp8_e4m3fn" in x and "RLR" in x for x in table), table
    assert any("nodehalf: budget" in x and "x L" in x for x in lines)


def test_bench_step_stats():
    """bench/comfyui_run.py's VPAGER_BENCH_STEP_STATS lines: one per step
    whose counters were read before and after it (the pager is made in the
    first step: None before), from counters vpager_stats() has."""
    comfyui_run = bench_module("comfyui_run")
    with env() as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        snaps = [None]
        for _ in range(2):
            run(m)
            snaps.append(p.vpager_stats())
    missing = [k for k in comfyui_run.STEP_KEYS
               if comfyui_run.step_counter(snaps[1], k) is None]
    assert not missing, missing
    lines = []
    real = comfyui_run.say
    comfyui_run.say = lines.append
    try:
        comfyui_run.say_step_stats("rep0", [5.0, 2.0], snaps)
    finally:
        comfyui_run.say = real
    assert len(lines) == 1 and lines[0].startswith("    step 2 (rep0): "
                                                   "2.0 ms; misses "), lines
    assert "misses %d " % (snaps[2]["model"]["misses"]
                           - snaps[1]["model"]["misses"]) in lines[0]


def test_bench_lora_change():
    """bench_node.py --lora's line for issue 29's "LoRA change" rows: each
    LoRA prompt's time less lora_b_again's, the step with the LoRA over
    the one without, the targets, the node's patch fills a step and the
    patch sets it staged."""
    bn = bench_module("bench_node")
    cr = types.SimpleNamespace(steady=lambda ms: sorted(ms[1:])[
        len(ms[1:]) // 2])

    def rep(label, sample_s, step):
        return {"label": label, "sample_s": sample_s,
                "steps_ms": [step * 3, step, step]}
    reps = [rep("base", 9.0, 100), rep("lora_a", 2.4, 104),
            rep("lora_a@0.5", 1.6, 104), rep("lora_b", 2.3, 104),
            rep("lora_b_again", 1.5, 103), rep("removed", 1.8, 100)]
    reps[3]["vpager"] = {"patch_fill_bytes": 10 << 20}
    reps[4]["vpager"] = {"patch_fill_bytes": 40 << 20,   # 30 MiB, 3 steps
                         "patch_staged_bytes": 3 << 19}
    lines, row = [], {}
    real = bn.say
    bn.say = lines.append
    try:
        bn.lora_change(cr, "node6", reps, row)
    finally:
        bn.say = real
    c = row["lora_change_s"]
    assert abs(c["lora_a"] - 0.9) < 1e-9 and abs(c["lora_a@0.5"] - 0.1) \
        < 1e-9 and abs(row["lora_step_ratio"] - 1.03) < 1e-9, row
    assert len(lines) == 1 and "first application 0.90 s (target <= 1.0)" \
        in lines[0] and "strength change 0.10 s (target <= 0.3)" in \
        lines[0] and "step with LoRA / without 1.030" in lines[0] and \
        "patched at fill 10 MiB a step, its patches staged on the device " \
        "1.5 MiB" in lines[0], lines


def test_bench_step_timeline():
    """bench/step_timeline.py (VPAGER_BENCH_TIMELINE) on the node's units:
    only the step asked for is marked, every call of a module with weights
    of its own in call order, and compare() ranks the growth."""
    st = bench_module("step_timeline")
    with env() as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        tl = st.StepTimeline(m.diffusion_model, 2, cuda=False,
                             profile_start=True)
        for step in range(3):
            run(m)
            tl.step_done(step)
            assert (tl.rows is not None) == (step >= 1), step
        tl.remove()
        run(m)
    # The host's work from step 2's start to its first call, profiled
    # (VPAGER_BENCH_START_PROFILE): the root's forward is in it; the
    # collector's callback is gone once that call came.
    import pstats
    called = {f[2] for f in pstats.Stats(tl.start_profile).stats}
    assert "forward" in called, sorted(called)
    assert isinstance(tl.start_gc, list) and tl._gc not in gc.callbacks
    names = [r["name"] for r in tl.rows]
    want = ["blocks.%d.%s" % (i, k) for i in range(6)
            for k in ("norm", "up", "down")]
    assert names == want + ["(after the last call)"], names
    assert all(r["ms"] >= 0 and r["gap_ms"] >= 0 for r in tl.rows)
    # The CPU's marks are the host clock: every call's lead is ~0 (the
    # "GPU" reaches a call as the host queues it, a host-bound step).
    assert all(abs(r["lead_ms"]) < 1.0 for r in tl.rows), tl.rows
    slower = [dict(r) for r in tl.rows]
    slower[3]["ms"] += 50.0
    lines = st.compare(tl.rows, slower, top=3)
    assert lines[0].startswith("step: ") and len(lines) == 7, lines
    assert lines[1].startswith("a: the GPU reached "), lines
    assert lines[4].split()[0] == "blocks.1.norm", lines
    # A log from before leads were kept compares without the host lines.
    old = [{k: v for k, v in r.items() if k != "lead_ms"} for r in tl.rows]
    assert len(st.compare(old, old, top=3)) == 5
    # A child log with a timeline per prompt: the last, or a prompt's.
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "run.log")
        with open(log, "w") as f:
            for label in ("base, rep 0, step 2", "lora_a, rep 1, step 2",
                          "lora_a@0.5, rep 2, step 2"):
                f.write(st.TAG + json.dumps({"label": label,
                                             "rows": tl.rows}) + "\n")
        assert st.read(log)[0].startswith("lora_a@0.5,")
        assert st.read(log, "lora_a")[0] == "lora_a, rep 1, step 2"
        try:
            st.read(log, "removed")
            raise AssertionError("a prompt without a timeline was read")
        except SystemExit as e:
            assert "of prompt 'removed'" in str(e), e


def test_bench_copy_trace():
    """bench/copy_trace.py (VPAGER_BENCH_KINETO) sums a step's trace: the
    copy engine's busy time (overlapping copies once), its rate while
    busy, its idle gaps within the span of the GPU's events, and how long
    each copy the client asked for (a runtime call) waited to start."""
    ct = bench_module("copy_trace")
    mib = 1 << 20

    def ev(cat, name, ts, dur, nbytes=None):
        e = {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {}}
        if nbytes is not None:
            e["args"]["bytes"] = nbytes
        return e
    h2d = "Memcpy HtoD (Pinned -> Device)"
    # 50 MB in 1000 us = 50 GB/s; two copies overlap by 500 us.
    events = [ev("kernel", "k0", 0.0, 3000.0),
              ev("gpu_memcpy", h2d, 100.0, 1000.0, 50 * 10**6),
              ev("gpu_memcpy", h2d, 600.0, 1000.0, 50 * 10**6),
              ev("gpu_memcpy", h2d, 2500.0, 1000.0, 50 * 10**6),
              ev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 3500.0,
                 10.0, mib),
              {"ph": "M", "name": "process_name"},     # no ts: skipped
              ev("cpu_op", "aten::mm", 0.0, 5000.0)]
    s = ct.summarize(events)
    assert s["span_ms"] == 3.5 and s["kernels"] == 1, s
    assert s["kernel_busy_ms"] == 3.0 and s["htod_copies"] == 3, s
    assert s["htod_busy_ms"] == 2.5 and s["htod_bytes"] == 150 * 10**6, s
    assert s["htod_gbps_busy"] == 60.0 and s["other_copies"] == 1, s
    assert s["copy_gbps_quartiles"] == [50.0, 50.0, 50.0], s
    # Idle: 0-100 us (under GAP_US, not listed) and 1600-2500 us.
    assert s["copy_idle_ms"] == 1.0 and s["copy_gaps"] == [[1.6, 0.9]], s
    assert s["client_htod"] == [], s      # no runtime call: vpager's
    # A client's pageable copy asked for at 200 us, run at 2500 us.
    events[3]["args"]["correlation"] = 7
    events.append({"cat": "cuda_runtime", "name": "cudaMemcpyAsync",
                   "ts": 200.0, "dur": 5.0, "args": {"correlation": 7}})
    assert ct.summarize(events)["client_htod"] == [[2.5, 50 * 10**6, 2.3]]
    del events[-1], events[3]["args"]["correlation"]
    assert ct.summarize([ev("cpu_op", "x", 0.0, 1.0)]) == {"gpu_events": 0}
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "run.log")
        with open(log, "w") as f:
            f.write("noise\n" + ct.TAG + json.dumps(s) + "\n")
        trace = os.path.join(d, "t.json")
        with open(trace, "w") as f:
            json.dump({"traceEvents": events}, f)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ct.main([log, trace])
        lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(json.loads(ln.split(" ", 1)[1]) == s
                                   for ln in lines), lines


def test_bench_idle_cache():
    """bench/idle_cache.py (VPAGER_BENCH_IDLE_CACHE) finds the ranges of
    torch's large segments no block alive between two marks covers: a
    block live when the history began, one allocated and freed before
    the window (idle in it), one allocated inside it (used)."""
    ic = bench_module("idle_cache")
    M = 1 << 20
    base = 1 << 32
    segs = [{"address": base, "total_size": 100 * M,
             "segment_type": "large"},
            {"address": 7 << 32, "total_size": 2 * M,
             "segment_type": "small"}]

    def ev(action, addr, size):
        return {"action": action, "addr": addr, "size": size}
    trace = [ev("alloc", base + 20 * M, 10 * M),            # before
             ev("free_requested", base + 20 * M, 10 * M),
             ev("free_completed", base + 20 * M, 10 * M),
             ev("alloc", base + 90 * M, 10 * M),            # live across
             ev("alloc", 7 << 32, ic.MARKS["end"]),         # the window
             ev("alloc", base + 40 * M, 30 * M),            # inside it
             ev("free_completed", base + 40 * M, 30 * M),
             ev("alloc", (7 << 32) + 4096, ic.MARKS["head"]),
             ev("alloc", base + 20 * M, 10 * M)]            # after it
    live = [(base, 5 * M)]          # allocated before the history began
    got = ic.summarize({"segments": segs, "device_traces": [trace]}, live)
    # Idle in the window: 5-40 and 70-90 MiB of the large segment.
    w = got["end_to_head"]
    assert got["marks"] == ["end", "head"] and "tail_to_head" not in got
    assert w["idle_mb"] == round(55 * M / 1e6, 1), got
    assert w["largest_mb"] == [round(35 * M / 1e6, 1),
                               round(20 * M / 1e6, 1)], got
    assert w["idle_in_ranges_of_8mib_mb"] == w["idle_mb"], got
    assert w["largest_at"] == ["0x%x" % (base + 5 * M),
                               "0x%x" % (base + 70 * M)], got
    assert ic.summarize({"segments": segs, "device_traces": [[]]}, []) == \
        {"error": "no allocation history recorded"}
    snap = [{"blocks": [
        {"address": 1, "size": 2, "state": "active_allocated"},
        {"address": 3, "size": 4, "state": "inactive"}]}]
    assert ic.live_blocks(snap) == [(1, 2)]


def test_ledger():
    with env(capacity=4 << 20) as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        run(m)
        pager = m._vpager_pager
        forced = m.model_loaded_weight_memory
        assert forced > 0           # pos, norms and the buffer
        resident = pager.loaded_size()
        assert resident >= pager.weight_bytes    # everything fits here
        assert p.loaded_size() == resident + forced
        # get_free_memory: ComfyUI's free plus what vpager could reclaim.
        MM.free = 1000
        assert p.get_free_memory(CPU) == 1000 + pager.dev.reclaimable()
        assert pager.dev.reclaimable() >= resident
        # partially_unload: evict that many bytes, report what was freed.
        freed = p.partially_unload(CPU, 3 * PAGE)
        assert freed >= 3 * PAGE and freed < resident, (freed, resident)
        assert pager.loaded_size() == resident - freed
        assert m.model_loaded_weight_memory == forced
        # Still right afterwards, and the model takes its pages back.
        want = run(frozen_unpaged(m))
        assert torch.equal(run(m), want)
        assert pager.loaded_size() == resident
        # model_unload asking for less than is loaded: a partial unload.
        assert model_unload(p, PAGE) is False
        # Asking for more than vpager holds: the backups go too and
        # ComfyUI's escalation to detach happens.
        assert model_unload(p, 1e30) is True
        assert pager.loaded_size() == 0
        assert m.model_loaded_weight_memory == 0
        assert p.loaded_size() == 0
        # unload_all_models / --disable-smart-memory detach the same way;
        # the next load brings it back.
        p.partially_load(CPU)
        assert torch.equal(run(m), want)
        p.detach(True)
        assert p.loaded_size() == 0
        p.partially_load(CPU)
        assert torch.equal(run(m), want)


def frozen_unpaged(m):
    """A resident copy of an offloaded stand-in model (its CPU tensors)."""
    ref = DiT()
    sd = {}
    for name, t in m.state_dict().items():
        sd[name] = t.detach().cpu().clone()
    ref.load_state_dict(sd)
    return ref


def test_patches_identity_and_refill():
    with env(capacity=4 << 20) as e:
        m = DiT()
        base = frozen(m)
        p = e.patcher(m)
        p.partially_load(CPU)
        want0 = run(base)
        assert torch.equal(run(m), want0)
        pager = m._vpager_pager
        k1 = "diffusion_model.blocks.1.up.weight"
        k2 = "diffusion_model.blocks.4.down.weight"
        d1 = torch.randn(256, 64) * 0.01
        d2 = torch.randn(64, 256) * 0.01
        # A LoRA: a clone with two patched weights (ComfyUI's way).
        q = p.clone()
        q.add_patches({k1: ("diff", (d1,)), k2: ("diff", (d2,))}, 0.8)
        fills0 = pager.vbar.stats()["weight_fills"]
        q.partially_load(CPU)
        assert q._vp_refilled == 2 and sorted(pager.patched_keys()) == \
            sorted([k1, k2])
        ref = frozen(base)
        sd = ref.state_dict()
        ref.diffusion_model.blocks[1].up.weight.data = sd[k1] + 0.8 * d1
        ref.diffusion_model.blocks[4].down.weight.data = sd[k2] + 0.8 * d2
        want1 = run(ref)
        assert torch.equal(run(m), want1)
        # Only the two patched weights were filled again.
        assert pager.vbar.stats()["weight_fills"] - fills0 == 2
        # The same patch set again (another clone): nothing refills.
        q2 = q.clone()
        fills1 = pager.vbar.stats()["weight_fills"]
        q2.partially_load(CPU)
        assert q2._vp_refilled == 0
        assert torch.equal(run(m), want1)
        assert pager.vbar.stats()["weight_fills"] == fills1
        # Changed: one patch's strength; only that weight refills.
        q3 = p.clone()
        q3.add_patches({k1: ("diff", (d1,))}, 0.8)
        q3.add_patches({k2: ("diff", (d2,))}, 0.5)
        assert not engine.same_patch(q3.patches[k2], q2.patches[k2])
        # ... k1's patch tuple is equal (same data object, same strength)
        q3.partially_load(CPU)
        assert q3._vp_refilled == 1, q3._vp_refilled
        ref.diffusion_model.blocks[4].down.weight.data = sd[k2] + 0.5 * d2
        assert torch.equal(run(m), run(ref))
        # Removed: the base model again; both refill from their sources.
        p.partially_load(CPU)
        assert p._vp_refilled == 2 and pager.patched_keys() == []
        assert torch.equal(run(m), want0)
        # The weights outside the forward stayed the unpatched ones.
        assert torch.equal(m.diffusion_model.blocks[1].up.weight,
                           base.diffusion_model.blocks[1].up.weight)


def diffs_for(base, keys, seed):
    """{key: a small random diff of its weight's shape} (a LoRA's patch
    data as the tests give it), from generator seed `seed`."""
    g = torch.Generator().manual_seed(seed)
    shapes = {k: p.shape for k, p in base.named_parameters()}
    return {k: torch.randn(*shapes[k], generator=g) * 0.01 for k in keys}


def lora_ref(base, patches):
    """The legacy bake: a copy of `base` whose weights are patched once
    by ComfyUI's math (the stand-ins' calculate_weight in float32, back
    to the weight's dtype), {key: [patch tuples]}."""
    ref = frozen(base)
    for key, ps in patches.items():
        o, n = resolve_attr(ref, key)
        w = getattr(o, n)
        w.data = calculate_weight(ps, w.to(torch.float32), key).to(w.dtype)
    return ref


def fill_counter(p, keys):
    """Counts ComfyUI's patch_weight_to_device per key of `keys` on
    patcher p."""
    calls = collections.Counter()
    real = p.patch_weight_to_device

    def counted(key, *a, **k):
        if key in keys:
            calls[key] += 1
        return real(key, *a, **k)

    p.patch_weight_to_device = counted
    return calls


def test_patch_at_fill():
    """Issue 29 point 1: a patched weight's bytes are computed on the
    device when it is filled, from its own bytes (no host copy per
    patched weight): outputs bitwise equal to the legacy bake for
    resident and streamed weights, prompt after prompt; a changed
    strength recomputes only that weight (a resident one once, a
    streamed one at its fills); removed, the base bytes again."""
    for dtype, room in ((torch.float32, 1), (torch.bfloat16, 2)):
        # (room: the budget and ring shrunk as the weights: some stream)
        with env(capacity=640 * K // room, staging=256 * K // room) as e:
            m = DiT(op=CastLinear, dtype=dtype)
            base = frozen(m)
            p = e.patcher(m)
            p.partially_load(CPU)
            want0 = run(base)
            for _ in range(3):
                assert torch.equal(run(m), want0)
            pager = m._vpager_pager
            host0 = pager.host_bytes()
            keys = ["diffusion_model.blocks.%d.%s.weight" % (i, n)
                    for i in range(6) for n in ("up", "down")]
            diffs = diffs_for(base, keys, 5)
            sources = []
            real_set_source = pager.h.set_source
            pager.h.set_source = lambda *a: (sources.append(a[0]),
                                             real_set_source(*a))
            q = p.clone()
            calls = fill_counter(q, keys)
            q.add_patches({k: ("diff", (d,)) for k, d in diffs.items()},
                          0.8)
            q.partially_load(CPU)
            assert q._vp_refilled == len(keys)
            assert not calls, calls         # nothing computed at load
            want1 = run(lora_ref(base, q.patches))
            assert not torch.equal(want1, want0)
            for _ in range(3):
                assert torch.equal(run(m), want1)
            # No host copy per patched weight.
            assert sources == [] and pager.host_bytes() == host0
            s = pager.stats()["model"]
            assert s["patched_weights"] == len(keys)
            assert s["host_patched_weights"] == 0
            # Steady: the streamed patched weights are computed at each
            # of their fills, the resident ones not again.
            calls.clear()
            f0 = pager.stats()["model"]["patch_fills"]
            assert torch.equal(run(m), want1)
            streamed = set(calls)
            assert all(n == 1 for n in calls.values()), calls
            assert pager.stats()["model"]["patch_fills"] - f0 == \
                len(streamed)
            resident = [k for k in keys if k not in streamed]
            assert streamed and resident, (streamed, resident)
            # A changed strength: a resident weight and a streamed one.
            kr, ks = resident[0], sorted(streamed)[0]
            q2 = p.clone()
            calls2 = fill_counter(q2, keys)
            q2.add_patches({k: ("diff", (d,)) for k, d in diffs.items()
                            if k not in (kr, ks)}, 0.8)
            q2.add_patches({kr: ("diff", (diffs[kr],)),
                            ks: ("diff", (diffs[ks],))}, 0.5)
            q2.partially_load(CPU)
            assert q2._vp_refilled == 2, q2._vp_refilled
            want2 = run(lora_ref(base, q2.patches))
            calls.clear()
            assert torch.equal(run(m), want2)
            # Recomputed: the changed resident weight, and the streamed
            # ones (at their fills, through the new patcher only where
            # it changed); no other resident weight.
            done = set(calls) | set(calls2)
            assert done == streamed | {kr}, (done, streamed, kr)
            assert set(calls2) == {kr, ks}, calls2
            for _ in range(2):
                assert torch.equal(run(m), want2)
            assert sources == [] and pager.host_bytes() == host0
            # Removed: the base bytes again, nothing computed.
            calls.clear()
            calls2.clear()
            p.partially_load(CPU)
            assert p._vp_refilled == len(keys)
            for _ in range(2):
                assert torch.equal(run(m), want0)
            assert not calls and not calls2
            assert pager.patched_keys() == []
            assert torch.equal(m.diffusion_model.blocks[1].up.weight,
                               base.diffusion_model.blocks[1].up.weight)


def test_streamed_patches_kept_on_the_host():
    """A LoRA patched at fill on weights the settled schedule streams:
    after a few steps their patched bytes are kept in a pinned host copy
    (vpager.torch's keptfills.py) and their patch is computed no more;
    every step's output bitwise the legacy bake's; a strength change
    computes the patch again from the weights' own bytes at the next step
    only (bitwise the new bake) and keeps it in turn; removed, the base
    bytes and nothing kept."""
    with env(capacity=512 * K, staging=128 * K) as e:
        m, base, want0, p, pager = loaded_twisted(e)
        keys = ["diffusion_model.%s.%d.weight" % (n, i)
                for i in range(6) for n in ("ups", "downs")]
        diffs = diffs_for(base, keys, 11)
        host0 = pager.host_bytes()
        fills = []
        for strength in (0.8, 0.5):
            q = p.clone()
            q.add_patches({k: ("diff", (d,)) for k, d in diffs.items()},
                          strength)
            q.partially_load(CPU)
            want = run(lora_ref(base, q.patches))
            counts = []
            for _ in range(10):
                f0 = pager.stats()["model"]["patch_fills"]
                assert torch.equal(run(m), want)
                counts.append(pager.stats()["model"]["patch_fills"] - f0)
            s = pager.stats()["model"]
            assert s["kept_fills"] > 0 and counts[-1] == 0, (counts, s)
            assert pager.host_bytes() == host0 + s["kept_fill_bytes"]
            fills.append(counts)
        # The change: computed again once, kept from the next step on.
        assert fills[1][0] > 0 and fills[1][1:] == [0] * 9, fills
        p.partially_load(CPU)
        for _ in range(2):
            assert torch.equal(run(m), want0)
        assert pager.stats()["model"]["kept_fills"] == 0
        assert pager.host_bytes() == host0


def cloning(copies):
    """patch_stage.on_device for the simulated device, whose memory is
    the host's: each tensor of a patch set cloned (and added to
    `copies`), as a copy to the GPU would be."""
    def on_device(value, device):
        if isinstance(value, torch.Tensor):
            c = value.clone()
            copies.append(c)
            return c, c.numel() * c.element_size()
        if isinstance(value, (tuple, list)):
            out = [on_device(v, device) for v in value]
            items = [c for c, _n in out]
            return (type(value)(items), sum(n for _c, n in out))
        return value, 0
    return on_device


def test_streamed_patches_staged_on_device():
    """A streamed weight's patch set is copied to the device at its second
    fill (patch_stage: ComfyUI's math would otherwise copy each LoRA
    tensor from the host at every fill, the host waiting for the stream)
    and its later fills compute from the copy, bitwise the same; a
    weight that stays resident fills once and never has one; ComfyUI's patches are its own again after
    each fill; free_memory beyond the pages and a new patch set drop the
    copies. The simulated device is the host: the copy here is a clone,
    as a copy to the GPU would be."""
    real = patch_stage.on_device
    patch_stage.on_device = cloning([])
    try:
        with env(capacity=320 * K, staging=128 * K) as e:
            m = DiT(op=CastLinear, dtype=torch.bfloat16)
            base = frozen(m)
            p = e.patcher(m)
            p.partially_load(CPU)
            pager = m._vpager_pager
            keys = ["diffusion_model.blocks.%d.%s.weight" % (i, n)
                    for i in range(6) for n in ("up", "down")]
            diffs = diffs_for(base, keys, 7)
            q = p.clone()
            q.add_patches({k: ("diff", (d,)) for k, d in diffs.items()},
                          0.8)
            own = {k: q.patches[k] for k in keys}
            seen = collections.defaultdict(list)
            real_ptd = q.patch_weight_to_device

            def watched(key, *a, **k):
                if key in keys:
                    seen[key].append(q.patches[key][0][1][1][0])
                return real_ptd(key, *a, **k)

            q.patch_weight_to_device = watched
            q.partially_load(CPU)
            want = run(lora_ref(base, q.patches))
            for _ in range(4):
                assert torch.equal(run(m), want)
            streamed = {k for k, v in seen.items() if len(v) > 1}
            assert streamed and streamed != set(keys), seen.keys()
            for k, used in seen.items():
                # The first fill: ComfyUI's tensor; from the third on
                # the copy made at the second.
                assert used[0] is diffs[k], k
                assert all(u is not diffs[k] for u in used[2:]), k
                assert len({id(u) for u in used[2:]}) <= 1, k
            # ComfyUI's patches untouched outside the fills.
            assert all(q.patches[k] is own[k] for k in keys)
            s = pager.stats()["model"]
            staged = sum(diffs[k].numel() * 4 for k in streamed)
            assert s["patch_staged_bytes"] == staged, (s, staged)
            # Asked for more than its pages: the copies go too.
            freed = pager.free_memory(1 << 40)
            assert freed >= staged
            assert pager.stats()["model"]["patch_staged_bytes"] == 0
            for _ in range(3):
                assert torch.equal(run(m), want)
            # Staged again: the streamed ones, and those evicted that
            # came back (a second fill of their patch set too).
            assert pager.stats()["model"]["patch_staged_bytes"] >= staged
            # A new patch set starts from ComfyUI's tensors again.
            q2 = p.clone()
            q2.add_patches({k: ("diff", (d,)) for k, d in diffs.items()},
                           0.5)
            q2.partially_load(CPU)
            assert pager.stats()["model"]["patch_staged_bytes"] == 0
            want2 = run(lora_ref(base, q2.patches))
            for _ in range(3):
                assert torch.equal(run(m), want2)
    finally:
        patch_stage.on_device = real


def test_patch_stage_copies():
    """patch_stage.on_device: a patch set's tensors to the device (here
    torch's meta device), tuples, lists and weight adapters rebuilt, the
    rest kept, the bytes counted; PatchStage: the host's set for the first
    fill, the copy from the second, the host's for good (said once) when
    the copy fails."""
    class Adapter:                          # ComfyUI's WeightAdapterBase
        def __init__(self, loaded_keys, weights):
            self.loaded_keys, self.weights = loaded_keys, weights

    up, down = torch.ones(4, 2), torch.ones(2, 3, dtype=torch.bfloat16)
    a = Adapter({"k"}, (up, down, 0.5, None))
    ps = [(1.0, a, 1.0, None, None), (0.5, ("diff", (up,)), 1.0, None, None)]
    meta = torch.device("meta")
    out, n = patch_stage.on_device(ps, meta)
    assert n == 2 * 32 + 12 and isinstance(out, list) and len(out) == 2
    b = out[0][1]
    assert type(b) is Adapter and b.loaded_keys is a.loaded_keys
    assert b.weights[0].device == meta and b.weights[1].dtype == \
        torch.bfloat16 and b.weights[2:] == (0.5, None)
    assert out[1][1][0] == "diff" and out[1][1][1][0].device == meta
    assert a.weights[0] is up               # the host's set untouched
    kept, n0 = patch_stage.on_device(ps, torch.device("cpu"))
    assert n0 == 0 and kept[0][1] is a and kept[1][1][1][0] is up
    st = patch_stage.PatchStage()
    assert st.patches(ps, meta) is ps and st.bytes == 0
    second = st.patches(ps, meta)
    assert second is not ps and st.bytes == n
    assert st.patches(ps, meta) is second

    class Stubborn(Adapter):
        def __init__(self, loaded_keys, weights):
            if weights[0].device.type == "meta":
                raise TypeError("no")
            super().__init__(loaded_keys, weights)

    bad = [(1.0, Stubborn({"k"}, (up,)), 1.0, None, None)]
    st = patch_stage.PatchStage()
    with logs() as said:
        for _ in range(4):
            assert st.patches(bad, meta) is bad
    assert st.failed and st.bytes == 0
    assert len([x for x in said if "stays on the host" in x]) == 1


def loaded_dit(e):
    """A DiT loaded on the node in env e: (model, its frozen copy, the
    patcher, vpager.torch's handle)."""
    m = DiT()
    base = frozen(m)
    p = e.patcher(m)
    p.partially_load(CPU)
    return m, base, p, m._vpager_pager.h


def test_set_fill():
    """vpager.torch's set_fill: fill(view) rewrites a weight's bytes each
    time they come from its source, on the device; None: its own bytes;
    set_source drops it; not while acquired."""
    with env() as e:
        m, base, p, h = loaded_dit(e)
        name = "diffusion_model.blocks.2.up.weight"
        seen = []

        def fill(view):
            seen.append(view.data_ptr())
            view.mul_(2)

        want0 = run(base)
        h.set_fill(name, fill)
        ref = frozen(base)
        ref.diffusion_model.blocks[2].up.weight.data *= 2
        want = run(ref)
        for _ in range(3):
            assert torch.equal(run(m), want)
        assert seen
        with h.acquired(m.diffusion_model.blocks[2]):
            try:
                h.set_fill(name, None)
                raise AssertionError("set_fill while acquired")
            except RuntimeError:
                pass
        try:
            h.set_fill(name, 3)
            raise AssertionError("not callable")
        except TypeError:
            pass
        try:
            h.set_fill("nope", fill)
            raise AssertionError("no such weight")
        except KeyError:
            pass
        h.set_source(name, None)      # its own bytes: the fill dropped
        assert torch.equal(run(m), want0)
        h.set_fill(name, fill)
        assert torch.equal(run(m), want)
        h.set_fill(name, None)
        assert torch.equal(run(m), want0)
        # Out of memory in a fill: once more after vpager evicted.
        ooms = [1]

        def tight(view):
            if ooms[0]:
                ooms[0] -= 1
                raise RuntimeError("CUDA out of memory (a stand-in)")
            view.mul_(2)
        h.set_fill(name, tight)
        assert torch.equal(run(m), want) and ooms == [0]
        # Another error: the forward raises, and the weight is filled
        # (and rewritten) anew at its next acquire, not left unrewritten.
        broken = [True]

        def flaky(view):
            if broken[0]:
                raise ValueError("a stand-in failure")
            view.mul_(2)
        h.set_fill(name, flaky)
        try:
            run(m)
            raise AssertionError("the fill's error")
        except ValueError:
            pass
        broken[0] = False
        for _ in range(2):
            assert torch.equal(run(m), want)
        p.detach()


def test_fill_after_a_failed_acquire():
    """An acquire that fails part way (here: the whole model held at once,
    more than the device and ring hold) may leave bytes it copied in
    resident without their fill: they are filled anew at the next
    acquire, so every later forward computes on the rewritten weight."""
    for name in ("diffusion_model.blocks.0.up.weight",
                 "diffusion_model.blocks.2.down.weight"):
        with env() as e:
            m, base, p, h = loaded_dit(e)
            for _ in range(3):
                run(m)
            ref = frozen(base)
            o, n = resolve_attr(ref, name)
            getattr(o, n).data *= 2
            want = run(ref)
            h.set_fill(name, lambda v: v.mul_(2))

            def hold_all():
                with h.acquired():
                    pass
            raises(vpager.LimitError, hold_all)
            for _ in range(2):
                assert torch.equal(run(m), want), name
            p.detach()


def test_set_source_refused_keeps_the_fill():
    """set_source() refusing its tensor (another dtype) leaves a weight's
    fill in place: the bytes refilled after an eviction are rewritten as
    the resident ones were (dropping it there mixed patched and unpatched
    bytes by residency)."""
    with env() as e:
        m, base, p, h = loaded_dit(e)
        name = "diffusion_model.blocks.2.up.weight"

        def fill(view):
            view.mul_(2)

        h.set_fill(name, fill)
        ref = frozen(base)
        ref.diffusion_model.blocks[2].up.weight.data *= 2
        want = run(ref)
        assert torch.equal(run(m), want)
        w = ref.diffusion_model.blocks[2].up.weight
        try:
            h.set_source(name, w.detach().double())
            raise AssertionError("a float64 tensor for a float32 weight")
        except ValueError:
            pass
        h.free_memory(1 << 40)        # every page refilled at next use
        assert torch.equal(run(m), want)
        p.detach()


def test_load_again_as_before():
    """ComfyUI loads the model before every prompt: a load by the same
    patch set with nothing moved since puts nothing in place again (no
    ComfyUI's-way weight copied anew); a detach (backups restored) or a
    clone with other patches loads in full. Outputs bitwise each time."""
    with env() as e:
        m = DiT()
        base = frozen(m)
        want = run(base)
        p = e.patcher(m)
        calls = []
        orig = p.patch_weight_to_device

        def counted(*a, **k):
            calls.append(a[0] if a else k.get("key"))
            return orig(*a, **k)
        p.patch_weight_to_device = counted
        p.partially_load(CPU)
        assert calls and torch.equal(run(m), want)
        n = len(calls)
        p.partially_load(CPU)
        assert len(calls) == n and p._vp_refilled == 0
        assert torch.equal(run(m), want)
        p.restore_loaded_backups()          # what a detach does first
        p.partially_load(CPU)
        assert len(calls) == 2 * n
        assert torch.equal(run(m), want)
        key = "diffusion_model.blocks.1.up.weight"
        d = torch.randn(256, 64) * 0.01
        q = p.clone()
        q.add_patches({key: ("diff", (d,))})
        q.partially_load(CPU)
        assert q._vp_refilled == 1
        ref = frozen(base)
        ref.diffusion_model.blocks[1].up.weight.data += d
        assert torch.equal(run(m), run(ref))


def test_tied_weight():
    """A parameter two ops share (tied embeddings): one vpager weight, in
    both ops' units."""
    with env() as e:
        m = DiT()
        blocks = m.diffusion_model.blocks
        blocks[1].up.weight = blocks[0].up.weight
        ref = frozen(m)
        p = e.patcher(m)
        p.partially_load(CPU)
        pager = m._vpager_pager
        assert p.vpager_active() and len(pager.entries) == 24
        assert len(pager.layout()) == 23            # one weight for both
        for _ in range(2):
            assert torch.equal(run(m), run(ref))
        assert blocks[1].up.weight is blocks[0].up.weight


def test_dropped_model_frees_its_pages():
    """A model ComfyUI drops (another checkpoint loaded) is collected with
    its pager: its VBAR is closed, its pages given back."""
    with env(capacity=4 << 20) as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        run(m)
        dev = m._vpager_pager.dev
        assert dev.stats()["committed_bytes"] > 0
        ref = __import__("weakref").ref(m)
        del m, p
        gc.collect()
        assert ref() is None
        # What stays committed is the staging ring (256 KiB here).
        assert dev.stats()["committed_bytes"] == 256 * K, dev.stats()


def test_patched_forced_weight():
    """A patch on a weight loaded ComfyUI's way (a tiny norm) is applied by
    ComfyUI's patch_weight_to_device, as ComfyUI does."""
    with env() as e:
        m = DiT()
        ref = frozen(m)
        key = "diffusion_model.blocks.2.norm.weight"
        d = torch.randn(64) * 0.1
        p = e.patcher(m)
        p.add_patches({key: ("diff", (d,))})
        p.partially_load(CPU)
        ref.diffusion_model.blocks[2].norm.weight.data += d
        assert torch.equal(run(m), run(ref))
        assert m._vpager_pager.patched_keys() == []


def test_stored_dtype_not_compute_dtype():
    """fp16 stored, fp32 compute (manual_cast ops): vpager pages the fp16
    bytes, the op casts on the device."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m = DiT(op=CastLinear, dtype=torch.float16)
        assert m.diffusion_model.blocks[0].up.weight.dtype == torch.float16
        ref = frozen(m)
        p = e.patcher(m)
        p.partially_load(CPU)
        pager = m._vpager_pager
        assert all(en.dtype == torch.float16 for en in pager.entries)
        per_block = (64 * 256 + 256) + (256 * 64 + 64)     # up + down
        assert pager.weight_bytes == 6 * per_block * 2, pager.weight_bytes
        assert torch.equal(run(m), run(ref))
        assert torch.equal(run(m), run(ref))


def test_declared_dtype_not_stored_dtype():
    """Ops of a class that does not cast, whose weights are stored in
    another dtype than the model declares for them (Wan's float32
    patch_embedding from an fp16 file; ComfyUI's dynamic path holds it in
    float32 in VRAM): the node converts them at load (an exact upcast
    here), outputs as ComfyUI's."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m = DiT(dtype=torch.float16)
        for mod in m.modules():
            if type(mod) is Linear:
                mod.weight_comfy_model_dtype = torch.float32
                mod.bias_comfy_model_dtype = torch.float32
        ref = frozen(m)
        for mod in ref.modules():
            if type(mod) is Linear:
                mod.comfy_cast_weights = True     # what ComfyUI's path does
        p = e.patcher(m)
        p.partially_load(CPU)
        pager = m._vpager_pager
        assert all(en.dtype == torch.float32 for en in pager.entries)
        assert torch.equal(run(m), run(ref))
        assert torch.equal(run(m), run(ref))


def declare(model, dtype, op=CastLinear, names=None):
    """What ComfyUI's ops do for a UNet loaded with weight_dtype fp8 from a
    bf16 file under dynamic VRAM: the parameters stay the file's tensors,
    the op declares the dtype the weights are held in on the GPU
    (<param>_comfy_model_dtype); so does the model for the parameters of
    modules that are no ops (archive_model_dtypes: here the DiT's pos)."""
    for n, mod in model.named_modules():
        if type(mod) is op and (names is None or n.split(".")[-1] in names):
            mod.weight_comfy_model_dtype = dtype
            mod.bias_comfy_model_dtype = dtype
    if names is None:
        model.diffusion_model.pos_comfy_model_dtype = dtype


def comfy_resident(model, names=None):
    """ComfyUI's all-resident result for a model whose ops declare another
    dtype than their weights are stored in: in VRAM each weight is the
    stored one cast to the declared dtype (a plain cast, comfy.ops), and
    the op casts that to the compute dtype at use."""
    ref = frozen(model)
    for n, mod in ref.named_modules():
        if names is not None and n.split(".")[-1] not in names:
            continue
        for k, t in mod._parameters.items():
            want = getattr(mod, k + "_comfy_model_dtype", None)
            if t is not None and want is not None:
                t.data = t.data.to(want)
    return ref


def test_stored_dtype_converted_as_comfyui():
    """Issue 26 point 1 (weight_dtype fp8 from a bf16 file), with the
    dtypes torch 1.13 has: the file's float32 weights, ops declaring float16
    (or bfloat16) and computing in float32. ComfyUI holds each weight cast
    to the declared dtype in VRAM; the node pages those bytes (converted
    once at load), not the file's: outputs bitwise ComfyUI's, and not the
    unconverted model's. Outside the forward a parameter holds the
    converted bytes; the model falling back gets the file's tensors
    back."""
    for held in (torch.float16, torch.bfloat16):
        with env(capacity=1 << 20, staging=128 * K) as e:
            m = DiT(op=CastLinear, dtype=torch.float32)
            declare(m, held)
            unconverted = frozen(m)
            ref = comfy_resident(m)
            up = m.diffusion_model.blocks[0].up
            orig = up.weight.data
            p = e.patcher(m)
            with logs() as lines:
                p.partially_load(CPU)
            assert p.vpager_active()
            pager = m._vpager_pager
            assert all(en.dtype == held for en in pager.entries)
            per_block = (64 * 256 + 256) + (256 * 64 + 64)
            assert pager.weight_bytes == 6 * per_block * 2
            assert pager.stats()["model"]["converted_weights"] == 24
            assert "24 converted" in " ".join(lines), lines
            for _ in range(2):
                out = run(m)
                assert torch.equal(out, run(ref))
            assert not torch.equal(out, run(unconverted))
            # Outside the forward: the bytes vpager pages (host copy).
            assert up.weight.dtype == held
            assert torch.equal(up.weight.data, orig.to(held))
            # Back to ComfyUI's path: the file's tensors again.
            q = node.VpagerSettings().apply(p, enabled=False)[0]
            q.partially_load(CPU)
            assert not p.vpager_active() and m._vpager_pager is None
            assert up.weight.dtype == torch.float32
            assert up.weight.data_ptr() == orig.data_ptr()
            # ... and to the node again: converted again.
            p.partially_load(CPU)
            assert p.vpager_active() and up.weight.dtype == held
            assert torch.equal(run(m), run(ref))


def test_converted_weight_patched():
    """A LoRA on a converted weight: ComfyUI's patch_weight_to_device
    computes it from the weight in its declared dtype (what the node's
    parameter holds) and rounds to that dtype, as ComfyUI's ModelPatcher
    does on its fp8 parameters; removing the patch refills the converted
    bytes."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m = DiT(op=CastLinear, dtype=torch.float32)
        declare(m, torch.float16)
        base = comfy_resident(m)
        want = run(base)
        p = e.patcher(m)
        p.partially_load(CPU)
        key = "diffusion_model.blocks.3.down.weight"
        d = torch.randn(64, 256) * 0.01
        q = p.clone()
        q.add_patches({key: ("diff", (d,))})
        q.partially_load(CPU)
        assert q._vp_refilled == 1
        ref = frozen(base)
        w = ref.diffusion_model.blocks[3].down.weight
        w.data = (w.data.to(torch.float32) + d).to(torch.float16)
        assert torch.equal(run(m), run(ref))
        p.partially_load(CPU)
        assert p._vp_refilled == 1
        assert torch.equal(run(m), want)



def weights_file(plan, fd):
    """The plan's unit weights written one after another to file fd, as
    a checkpoint holds them: {data_ptr: file offset}."""
    where, off = {}, 0
    with os.fdopen(os.dup(fd), "wb") as f:
        for _, mod, params in plan.units:
            for _key, k in params:
                t = mod._parameters[k].data
                b = t.numpy().tobytes()
                f.write(b)
                where[t.data_ptr()] = off
                off += len(b)
    return where

def map_weights(plan, fd):
    """File fd (weights_file's) mapped read-only, as ComfyUI's loader maps
    a checkpoint, and the plan's unit parameters pointed at their bytes
    there: (the mmap, the uint8 tensor over it, {(name, id(op)): data_ptr},
    the bytes mapped)."""
    import mmap
    import warnings
    where = weights_file(plan, fd)
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # a read-only buffer
        flat = torch.frombuffer(mm, dtype=torch.uint8)
    mapped, ptrs = 0, {}
    for _, mod, params in plan.units:
        for _key, k in params:
            p = mod._parameters[k]
            off, n = where[p.data_ptr()], p.numel() * p.element_size()
            p.data = flat[off:off + n].view(p.dtype).view(p.shape)
            mapped += n
            ptrs[k, id(mod)] = p.data_ptr()
    return mm, flat, ptrs, mapped


def test_converted_weights_and_file_sources():
    """--fast-disk: a converted weight is never read from the file (which
    holds its unconverted bytes): it gets a host copy; the others keep
    their file sources."""
    with env(capacity=4 << 20) as e:
        m = DiT(op=CastLinear)
        declare(m, torch.float16, names=("up",))
        ref = comfy_resident(m, names=("up",))
        plan = glue.plan_model(m, e.comfy)
        assert plan.why is None
        fd, path = tempfile.mkstemp()
        try:
            where, asked = weights_file(plan, fd), []

            def file_slice(t):
                asked.append(t.dtype)
                return (fd, where[t.data_ptr()])
            dev, _ = glue.vp_device(CPU, e.comfy.args)
            pager = engine.Pager(dev, CPU, m, plan.units, prefer_file=True,
                                 file_slice=file_slice, dtypes=plan.dtypes)
            s = pager.stats()["model"]
            assert s["file_weights"] == 12 and s["converted_weights"] == 12
            assert asked == [torch.float32] * 12
            assert pager.host_bytes() == 6 * (256 * 64 + 256) * 2
            with torch.inference_mode():
                assert torch.equal(m(inputs()), ref(inputs()))
            pager.close()
        finally:
            os.close(fd)
            os.unlink(path)


def test_mapped_weights_stay_in_place():
    """Weights ComfyUI's loader mapped from a file stay in the mapping
    (issue 28): no host copy of them, the mapped tensors between
    forwards (outside="host"), outputs bitwise."""
    with env(capacity=4 << 20) as e:
        m = DiT(op=CastLinear)
        ref = comfy_resident(m)
        plan = glue.plan_model(m, e.comfy)
        fd, path = tempfile.mkstemp()
        try:
            _mm, flat, ptrs, mapped = map_weights(plan, fd)
            dev, _ = glue.vp_device(CPU, e.comfy.args)
            pager = engine.Pager(dev, CPU, m, plan.units, dtypes=plan.dtypes)
            s = pager.stats()["model"]
            assert s["host_by_kind"]["in place"] == mapped, s
            assert s["host_by_kind"]["pinned copy"] == 0, s
            for _, mod, params in plan.units:
                for _key, k in params:
                    assert mod._parameters[k].data_ptr() == ptrs[k, id(mod)]
            with torch.inference_mode():
                for _ in range(2):
                    assert torch.equal(m(inputs()), ref(inputs()))
            pager.close()
            del flat
        finally:
            os.close(fd)
            os.unlink(path)


def mapped_rss(addr):
    """Bytes of the file mapping holding addr resident in this process
    (/proc/self/smaps' Rss), None where there is no smaps."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) * 1024
    return None


def test_converted_mapped_weights_leave_the_rss():
    """Weights ComfyUI's loader mapped from a file and converted to their
    ops' dtype (weight_dtype fp8 from a bf16 file): the pages the
    conversion read leave the process's RSS (the H100's fp8 run held the
    whole 9.4 GiB file mapped beside the 4.7 GiB pinned copy), the
    outputs stay bitwise and close() gives the mapped tensors back."""
    import mmap
    if not os.path.exists("/proc/self/smaps"):
        print("skip: no /proc/self/smaps")
        return
    with env(capacity=4 << 20) as e:
        m = DiT(op=CastLinear)
        declare(m, torch.float16, names=("up",))
        ref = comfy_resident(m, names=("up",))
        plan = glue.plan_model(m, e.comfy)
        fd, path = tempfile.mkstemp()
        try:
            mm, flat, ptrs, _mapped = map_weights(plan, fd)
            float(flat.sum())           # every page of the mapping read
            assert mapped_rss(flat.data_ptr()) >= len(mm) // 2
            dev, _ = glue.vp_device(CPU, e.comfy.args)
            pager = engine.Pager(dev, CPU, m, plan.units, dtypes=plan.dtypes)
            assert pager.stats()["model"]["converted_weights"] == 12
            # Left: the weights not converted (in place, their pages read
            # by the copy to the device) and partial pages at the ends.
            up = sum(mod._parameters[k].numel() * 4
                     for _, mod, params in plan.units for _key, k in params
                     if mod._parameters[k].dtype == torch.float16)
            assert up == 6 * (256 * 64 + 256) * 4     # their file bytes
            assert mapped_rss(flat.data_ptr()) <= \
                len(mm) - up + 2 * 12 * mmap.PAGESIZE
            with torch.inference_mode():
                for _ in range(2):
                    assert torch.equal(m(inputs()), ref(inputs()))
            pager.close()
            for _, mod, params in plan.units:
                for _key, k in params:
                    assert mod._parameters[k].data_ptr() == ptrs[k, id(mod)]
            del flat
        finally:
            os.close(fd)
            os.unlink(path)


class ScaledLinear(CastLinear):
    """An op whose int8 weight its own forward scales (a quantized format
    the node does not know), declaring float16."""

    def __init__(self, d_in, d_out, dtype=None):
        super().__init__(d_in, d_out)
        self.weight = nn.Parameter(torch.randint(
            -127, 128, (d_out, d_in), dtype=torch.int8), requires_grad=False)
        self.scale = nn.Parameter(torch.tensor(0.01), requires_grad=False)
        self.weight_comfy_model_dtype = torch.float16

    def forward(self, x):
        w = self.weight.to(torch.float16).to(x.dtype) * self.scale
        return torch.nn.functional.linear(x, w, self.bias.to(x.dtype))


def test_unreproducible_bytes_fall_back():
    """A weight whose bytes the node cannot reproduce bitwise (stored as
    int8 with a scale while its op declares float16; a declared dtype that
    is not a torch dtype; float32 declared as int8; a tied weight two ops
    declare differently) keeps the model on ComfyUI's path, with one log
    line naming it; nothing of the model changed."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m = DiT(op=ScaledLinear)
        ref = frozen(m)
        p = e.patcher(m)
        with logs() as lines:
            p.partially_load(CPU)
            p.partially_load(CPU)
        assert not p.vpager_active() and m.comfy_loaded == 2
        assert len(lines) == 1, lines
        assert "stored as int8" in lines[0] and "float16" in lines[0], lines
        assert m.diffusion_model.blocks[0].up.weight.dtype == torch.int8
        assert torch.equal(run(m), run(ref))

        m = DiT(op=CastLinear)
        declare(m, "fp8 (some packed format)", names=("down",))
        with logs() as lines:
            e.patcher(m).partially_load(CPU)
        assert "fp8 (some packed format)" in lines[0], lines
        m = DiT(op=CastLinear)
        declare(m, torch.int8)
        with logs() as lines:
            e.patcher(m).partially_load(CPU)
        assert "float32 but its op declares int8" in lines[0], lines

        m = DiT(op=CastLinear)
        blocks = m.diffusion_model.blocks
        blocks[1].up.weight = blocks[0].up.weight
        declare(m, torch.float16)
        blocks[1].up.weight_comfy_model_dtype = torch.bfloat16
        ref = frozen(m)
        p = e.patcher(m)
        with logs() as lines:
            p.partially_load(CPU)
        assert not p.vpager_active() and m.comfy_loaded == 1
        assert len(lines) == 1 and "tied" in lines[0], lines
        assert all(t.dtype == torch.float32 for t in m.parameters())
        assert torch.equal(run(m), run(ref))


def test_weight_wrappers_kept():
    with env() as e:
        m = DiT()
        ref = frozen(m)
        key = "diffusion_model.blocks.0.up.weight"
        p = e.patcher(m)
        p.weight_wrapper_patches[key] = [lambda w: w * 2]
        p.partially_load(CPU)
        ref.diffusion_model.blocks[0].up.weight.data *= 2
        assert torch.allclose(run(m), run(ref))
        assert m.diffusion_model.blocks[0].up.weight_function


def test_file_sources():
    """--fast-disk: weights that are slices of an open file are read from
    it (vpager's file reader), with no host copy."""
    with env(capacity=4 << 20) as e:
        m = DiT()
        ref = frozen(m)
        plan = glue.plan_model(m, e.comfy)
        fd, path = tempfile.mkstemp()
        try:
            where = weights_file(plan, fd)
            dev, _ = glue.vp_device(CPU, e.comfy.args)
            pager = engine.Pager(
                dev, CPU, m, plan.units, prefer_file=True,
                file_slice=lambda t: (fd, where[t.data_ptr()]))
            assert pager.host_bytes() == 0
            assert pager.stats()["model"]["file_weights"] == 24
            for _, mod, params in plan.units:
                pass
            with torch.inference_mode():
                x = inputs()
                # Forced params ComfyUI's way: here they are on the CPU.
                assert torch.equal(m(x), ref(x))
            assert pager.vbar.stats()["file_bytes_read"] > 0 or \
                dev.stats()["file_bytes_read"] > 0
            pager.close()
        finally:
            os.close(fd)
            os.unlink(path)


def test_two_models_last_used_on_top():
    with env(capacity=1 << 20, staging=128 * K) as e:
        a, b = DiT(seed=1), DiT(n=3, seed=2)   # 776 + 388 KiB of weights
        ra, rb = frozen(a), frozen(b)
        pa, pb = e.patcher(a), e.patcher(b)
        pa.partially_load(CPU)
        pb.partially_load(CPU)
        assert a._vpager_pager.dev is b._vpager_pager.dev
        for _ in range(2):          # the UNet, then the VAE, each prompt
            assert torch.equal(run(a), run(ra))
            assert torch.equal(run(b), run(rb))
        # b ran last: its pages survive pressure, a's go first.
        dev = a._vpager_pager.dev
        before_a = a._vpager_pager.loaded_size()
        before_b = b._vpager_pager.loaded_size()
        assert before_a > 0 and before_b > 0
        assert dev.free_memory(before_a) >= before_a
        assert a._vpager_pager.loaded_size() == 0
        assert b._vpager_pager.loaded_size() == before_b
        # a runs again: it goes on top, and its pressure takes b's pages.
        assert torch.equal(run(a), run(ra))
        assert b._vpager_pager.loaded_size() < before_b


def test_fallbacks_with_one_log_line():
    with env() as e:
        # The environment variable, read at load time.
        m = DiT()
        p = e.patcher(m)
        os.environ["VPAGER_COMFYUI"] = "0"
        try:
            with logs() as lines:
                p.partially_load(CPU)
                p.partially_load(CPU)
        finally:
            del os.environ["VPAGER_COMFYUI"]
        assert m.comfy_loaded == 2 and not p.vpager_active()
        assert len(lines) == 1 and "VPAGER_COMFYUI=0" in lines[0], lines
        # On again: vpager takes it, once ComfyUI's VBAR gave its pages back.
        p.partially_load(CPU)
        assert p.vpager_active() and m.aimdo_freed >= 1e30
        ref = frozen_unpaged(m)
        assert torch.equal(run(m), run(ref))
        # The node setting, per model: a clone with it off. The model goes
        # back to ComfyUI (real CPU tensors, wrappers out).
        q = node.VpagerSettings().apply(p, enabled=False)[0]
        assert q.model_options["vpager"] is False
        with logs() as lines:
            q.partially_load(CPU)
        assert not q.vpager_active() and m._vpager_pager is None
        assert not p.vpager_active()        # the model's path, every clone
        assert "VpagerSettings" in lines[0]
        assert "forward" not in m.diffusion_model.blocks[0].up.__dict__
        assert torch.equal(run(m), run(ref))
        # A patch that changes a weight's shape.
        r = p.clone()
        key = "diffusion_model.blocks.0.up.weight"
        r.add_patches({key: ("resize", (torch.zeros(300, 64),))})
        with logs() as lines:
            r.partially_load(CPU)
        assert not r.vpager_active()
        assert len(lines) == 1 and key in lines[0] and "shape" in lines[0]
        # Weight hooks.
        h = p.clone()
        h.hook_patches = {"hook": {}}
        with logs() as lines:
            h.partially_load(CPU)
        assert not h.vpager_active() and "hook" in lines[0]
        # A CUDA-less load device (the simulated device not allowed).
        glue.ALLOW_SIM = False
        try:
            with logs() as lines:
                e.patcher(DiT()).partially_load(CPU)
            assert "not a CUDA device" in lines[0]
        finally:
            glue.ALLOW_SIM = True


def test_refused_model_falls_back_with_one_log_line():
    """A model vpager.torch refuses (here a unit the device's fixed
    staging ring cannot hold) goes ComfyUI's own way, with one log line
    naming why; outputs as ComfyUI's."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m = DiT(h=512)          # 64 x 512 fp32 + bias: 130 KiB a unit
        ref = frozen(m)
        p = e.patcher(m)
        with logs() as lines:
            p.partially_load(CPU)
        assert not p.vpager_active() and m.comfy_loaded == 1
        assert len(lines) == 1 and "staging" in lines[0], lines
        assert torch.equal(run(m), run(ref))


def test_fallback_model_types():
    with env() as e:
        q = DiT()
        op = q.diffusion_model.blocks[0].up
        op.weight = nn.Parameter(op.weight.data.as_subclass(Packed),
                                 requires_grad=False)
        with logs() as lines:
            p = e.patcher(q)
            p.partially_load(CPU)
        assert not p.vpager_active() and q.comfy_loaded == 1
        assert "is a Packed, not a plain tensor" in lines[0], lines
        # A model without ComfyUI ops holding weights.
        plain = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
        plain.device = None
        with logs() as lines:
            p = e.patcher(plain)
            p.partially_load(CPU)
        assert not p.vpager_active()
        assert "no ComfyUI op" in lines[0], lines
        # A meta weight.
        mm = DiT()
        mm.diffusion_model.blocks[0].up.weight = nn.Parameter(
            torch.empty(256, 64, device="meta"), requires_grad=False)
        plan = glue.plan_model(mm, e.comfy)
        assert "meta" in plan.why


def test_replaced_parameter_rebuilds():
    """A parameter replaced behind vpager's back (another path's backup
    restored): the next load builds the pager anew around the new one."""
    with env() as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        old = m._vpager_pager
        up = m.diffusion_model.blocks[0].up
        up.weight = nn.Parameter(up.weight.data.clone() * 3,
                                 requires_grad=False)
        p.partially_load(CPU)
        assert m._vpager_pager is not old and old.closed
        ref = frozen_unpaged(m)
        assert torch.equal(run(m), run(ref))


class Twisted(nn.Module):
    """A diffusion model that declares its layers in another order than it
    calls them (as Flux's double blocks do)."""

    def __init__(self, n=6, d=64, h=256, seed=3):
        super().__init__()
        torch.manual_seed(seed)
        self.ups = nn.ModuleList(Linear(d, h) for _ in range(n))
        self.downs = nn.ModuleList(Linear(h, d) for _ in range(n))
        for p in self.parameters():
            p.requires_grad_(False)
            p.data = torch.randn(p.shape) * 0.05

    def forward(self, x):
        for i in reversed(range(len(self.ups))):
            x = x + self.downs[i](torch.relu(self.ups[i](x)))
        return x


class Holder(nn.Module):
    """ComfyUI's BaseModel: the diffusion model inside, called through it."""

    def __init__(self, dm):
        super().__init__()
        self.diffusion_model = dm

    def forward(self, x):
        return self.diffusion_model(x)


def exec_order_keys(m):
    keys = []
    for i in reversed(range(len(m.diffusion_model.ups))):
        keys += ["diffusion_model.ups.%d.weight" % i,
                 "diffusion_model.ups.%d.bias" % i,
                 "diffusion_model.downs.%d.weight" % i,
                 "diffusion_model.downs.%d.bias" % i]
    return keys


def loaded_twisted(e):
    """A Twisted diffusion model in a Holder, loaded through the node on
    env e: (model, a resident copy, its output, patcher, pager)."""
    m = Holder(Twisted())
    ref = frozen(m)
    want = run(ref)
    p = e.patcher(m)
    p.partially_load(CPU)
    return m, ref, want, p, m._vpager_pager


def test_replaced_in_execution_order():
    """After the first forward the weights lie in the order the units ran:
    at the end of the diffusion model's forward (its forward hook), and
    for a model whose root forward does not run, at its next load."""
    with env(capacity=1 << 20, staging=128 * K) as e:
        m, ref, want, p, pager = loaded_twisted(e)
        before = [k for k, _, _ in pager.layout()]
        assert before[0] == "diffusion_model.ups.0.weight"
        assert torch.equal(run(m), want)        # records, then re-places
        assert pager.replaced == 1 and not pager.recording
        assert [k for k, _, _ in pager.layout()] == exec_order_keys(m)
        # vpager.torch's copy schedule measured that forward and placed
        # the weights for it (same order), filling the resident set at
        # once: later forwards fill nothing, the rest is staged.
        assert pager.h.order == "scheduled" and pager.h.schedule()
        assert pager.loaded_size() > 0
        assert torch.equal(run(m), want)        # measured once more
        fills = pager.vbar.stats()["weight_fills"]
        for _ in range(2):
            assert torch.equal(run(m), want)
        assert [k for k, _, _ in pager.layout()] == exec_order_keys(m)
        assert pager.vbar.stats()["weight_fills"] == fills   # steady
        # Once only; patches still swap the right weights afterwards.
        p.partially_load(CPU)
        assert pager.replaced == 1
        key = "diffusion_model.downs.2.weight"
        d = torch.randn(64, 256) * 0.01
        q = p.clone()
        q.add_patches({key: ("diff", (d,))})
        q.partially_load(CPU)
        ref.diffusion_model.downs[2].weight.data += d
        assert torch.equal(run(m), run(ref))
    with env(capacity=1 << 20, staging=128 * K) as e:
        tw = Twisted()
        m = Holder(tw)
        want = run(frozen(m))
        p = e.patcher(m)
        p.partially_load(CPU)
        pager = m._vpager_pager
        with torch.inference_mode():        # the units, not the root
            x = inputs()
            for i in reversed(range(len(tw.ups))):
                x = x + tw.downs[i](torch.relu(tw.ups[i](x)))
            assert torch.equal(x, want)
        assert pager.recording and pager.replaced == 0
        p.partially_load(CPU)               # the next load re-places
        assert pager.replaced == 1
        assert [k for k, _, _ in pager.layout()] == exec_order_keys(m)
        assert torch.equal(run(m), want)


def test_held_units_in_the_node():
    """The schedule's held units (tuner.HOLD_SHARE 0 here: hold whatever
    qualifies) under the node: bitwise, steady, and a patch between
    prompts refills the patched weight, held or not."""
    real = tuner.HOLD_SHARE
    tuner.HOLD_SHARE = 0.0
    try:
        with env(capacity=1 << 20, staging=128 * K) as e:
            m, ref, want, p, pager = loaded_twisted(e)
            for _ in range(3):
                assert torch.equal(run(m), want)
            hot = pager.h.hot_path
            assert pager.h.schedule()["held_units"] == len(hot.held_units)
            assert hot.held_units, pager.h.schedule()
            fills = pager.vbar.stats()["weight_fills"]
            for _ in range(2):
                assert torch.equal(run(m), want)
            assert pager.vbar.stats()["weight_fills"] == fills   # steady
            assert hot.holding is None
            u = hot.held_units[0]
            key = u.entries[0].name     # named from the model
            w = dict(ref.named_parameters())[key]
            d = torch.randn(w.shape) * 0.01
            q = p.clone()
            q.add_patches({key: ("diff", (d,))})
            q.partially_load(CPU)
            w.data += d
            assert torch.equal(run(m), run(ref))
    finally:
        tuner.HOLD_SHARE = real


def test_oom_retry():
    """An out-of-memory error inside a unit: vpager's unpinned pages are
    evicted and the op runs once more."""
    with env(capacity=4 << 20) as e:
        m = DiT()
        want = run(frozen(m))
        p = e.patcher(m)
        p.partially_load(CPU)
        run(m)
        pager = m._vpager_pager
        assert pager.loaded_size() > 0
        op = m.diffusion_model.blocks[2].up
        op.fails = 1
        assert torch.equal(run(m), want)
        assert op.fails == 0                # it failed, then ran again
        assert pager.oom_margin > 0
        assert pager.loaded_size() > 0      # back on top after the eviction
        # A second failure, in the retry, is raised; nothing stays acquired.
        op.fails = 2
        e = raises(RuntimeError, run, m)
        assert "out of memory" in str(e)
        assert not pager.h.busy
        assert torch.equal(run(m), want)


def test_install():
    ns = comfy_ns()
    cls = node.install(ns)
    try:
        assert cls is not None and ns.model_patcher.CoreModelPatcher is cls
        assert issubclass(cls, ModelPatcherDynamic)
        assert node.install(ns) is cls           # once
    finally:
        node.INSTALLED[0] = None
    # ComfyUI's dynamic VRAM off: CoreModelPatcher stays the legacy one.
    ns = comfy_ns()
    ns.model_patcher.CoreModelPatcher = ModelPatcher
    with logs() as lines:
        assert node.install(ns) is None
    assert ns.model_patcher.CoreModelPatcher is ModelPatcher
    assert "dynamic VRAM is not on" in lines[0]
    args = Args()
    args.disable_dynamic_vram = True
    ns = comfy_ns(args)
    with logs() as lines:
        assert node.install(ns) is None
    assert "--disable-dynamic-vram" in lines[0]
    os.environ["VPAGER_COMFYUI"] = "off"
    try:
        assert node.install(comfy_ns()) is None
    finally:
        del os.environ["VPAGER_COMFYUI"]
    assert node.INSTALLED[0] is None
    assert "VpagerSettings" in node.NODE_CLASS_MAPPINGS
    assert node.NODE_DISPLAY_NAME_MAPPINGS["VpagerSettings"]


def test_flags():
    """No flags: the device's default headroom (vpager's, room for the
    display: `default` here); --vram-headroom adds to it, as ComfyUI adds
    it to its own default; --reserve-vram replaces it (it says what other
    programs get, and is what the device shares) and gives the budget."""
    a = Args()
    default = 512 << 20
    assert glue.headroom_bytes(a, default) == default
    assert glue.reserve_bytes(a) is None
    assert glue.budget_bytes(a, 80 << 30) is None
    assert glue.headroom_text(a) == "vpager's default"
    a.vram_headroom = 1
    assert glue.headroom_bytes(a, default) == default + (1 << 30)
    assert glue.headroom_text(a) == "vpager's default + 1024 MB"
    a.reserve_vram = 74
    assert glue.headroom_bytes(a, default) == 1 << 30
    assert glue.reserve_bytes(a) == 74 << 30
    assert glue.budget_bytes(a, 80 << 30) == 6 << 30
    assert glue.headroom_text(a) == "1024 MB"
    a.vram_headroom = 0
    a.reserve_vram = 0                      # everything: no headroom at all
    assert glue.headroom_bytes(a, default) == 0
    assert glue.reserve_bytes(a) == 0
    a.reserve_vram = 74
    a.vram_headroom = 1
    a.fast_disk = True
    with env(args=a, capacity=4 << 20) as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        # No file slices here: the host copy serves (file sources only
        # where the tensor is a slice of ComfyUI's mapped file).
        assert m._vpager_pager.stats()["model"]["file_weights"] == 0
        assert torch.equal(run(m), run(frozen_unpaged(m)))


def test_flags_declared_at_open():
    """The node opens a device with its default headroom and declares
    ComfyUI's flags to its Governor at once: no flags, the default is
    kept and shared (the simulated device's default is 0; a GPU's is
    vpager's figure); --vram-headroom adds to it; --reserve-vram is what
    the device shares, the budget the device's total less it."""
    from vpager.governor import governor
    saved = glue.DEVICE_FACTORY, dict(glue._DEVICES)
    glue.DEVICE_FACTORY = None
    try:
        for extra, reserve in ((0, None), (0.5, None), (0.25, 1.0)):
            glue._DEVICES.clear()
            a = Args()
            a.vram_headroom, a.reserve_vram = extra, reserve
            dev, budget = glue.vp_device(CPU, a)
            try:
                gov = governor(dev)
                want = int(extra * (1 << 30))
                assert gov.flags.headroom == want
                assert gov.flags.reserve == (
                    None if reserve is None else int(reserve * (1 << 30)))
                st = gov.stats()
                assert st["shared_headroom"] == (
                    want if reserve is None else 1 << 30)
                assert dev.info()["shared_headroom"] == st["shared_headroom"]
                assert budget is None        # CPU: no total to reserve from
            finally:
                dev.close()
    finally:
        glue.DEVICE_FACTORY = saved[0]
        glue._DEVICES.clear()
        glue._DEVICES.update(saved[1])


class FakeDev:
    """A device the Governor writes to, recording each write."""

    options = {"lookahead": 0}
    closed = False

    def __init__(self):
        self.calls = []

    def info(self):
        return {"headroom": 256 << 20}

    def set_headroom(self, n):
        self.calls.append(("headroom", n))

    def set_shared_headroom(self, n):
        self.calls.append(("shared", n))

    def set_limit(self, n):
        self.calls.append(("limit", n))

    def set_lookahead(self, n):
        self.calls.append(("lookahead", n))

    def stats(self):
        return {"committed_bytes": 5500 << 20}

    def free_memory(self, n):
        self.calls.append(("free", n))
        return n


def test_activations_first():
    """Torch's growth stays free beyond the flags' headroom; with a budget
    (--reserve-vram) vpager may commit the budget less torch's peak: the
    node declares ComfyUI's flags to the device's Governor, which derives
    both and writes only what changed."""
    from vpager.governor import Governor
    M = 1 << 20
    dev = FakeDev()
    gov = Governor(dev)
    gov.declare_flags(256 * M, 6144 * M)
    assert dev.calls == [("shared", 256 * M)]   # nothing learned yet
    dev.calls = []
    gov.declare_torch(600 * M, 900 * M)
    assert gov.learned == 300 * M + 45 * M
    limit = 6144 * M - 900 * M - 45 * M
    assert dev.calls == [("headroom", 256 * M + 345 * M),
                         ("limit", limit),
                         ("free", 5500 * M - limit)]   # the excess
    dev.calls = []
    gov.declare_torch(600 * M, 900 * M)     # nothing changed
    assert dev.calls == []
    # torch's peak statistics reset (bench/comfyui_run.py does, per
    # prompt): the activations' room and the limit stay
    dev.calls = []
    assert gov.declare_torch(64 * M, 64 * M) == 256 * M + 881 * M
    assert gov.learned == 836 * M + 45 * M
    assert dev.calls == [("headroom", 256 * M + 881 * M)]
    # Without --reserve-vram only the headroom follows torch.
    dev = FakeDev()
    gov = Governor(dev)
    gov.declare_flags(256 * M, None)
    gov.declare_torch(600 * M, 900 * M)
    assert [c[0] for c in dev.calls] == ["shared", "headroom"]


def test_threads_share_a_node_model():
    """Four threads x 50 forwards of one model the node loaded, under a
    budget that streams part of it: every output bitwise the
    single-threaded one (vpager.torch runs one model's forwards one at a
    time: python/README, Threads)."""
    with env(capacity=6 * PAGE) as e:
        m = DiT()
        p = e.patcher(m)
        p.partially_load(CPU)
        want = run(m)
        same, errors = [], []

        def work():
            try:
                for _ in range(50):
                    same.append(torch.equal(run(m), want))
            except BaseException as ex:     # noqa: BLE001 (reported below)
                errors.append(ex)
        threads = [threading.Thread(target=work) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert len(same) == 200 and all(same), same.count(False)
        assert m._vpager_pager.stats()["model"]["misses"] > 0  # streamed


def test_host_copy_threads():
    """The host copy (vpager.torch's, which the node's weights get) is
    made by several threads."""
    from vpager.torch import sources
    saved = sources.COPY_CHUNK
    try:
        sources.COPY_CHUNK = 1000           # many chunks, several threads
        srcs = [torch.randn(37, 91), torch.randn(5000).half(),
                torch.zeros(0), torch.randn(3, 4, 5)]
        dsts = [torch.empty_like(s) for s in srcs]
        sources.copy_all(list(zip(dsts, srcs)))
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    finally:
        sources.COPY_CHUNK = saved


def test_same_patch():
    d = torch.zeros(2)
    a = [(1.0, ("diff", (d,)), 1.0, None, None)]
    assert engine.same_patch(a, list(a))
    assert engine.same_patch(None, None)
    assert not engine.same_patch(a, None)
    assert not engine.same_patch(a, [(1.0, ("diff", (d.clone(),)), 1.0,
                                      None, None)])
    assert not engine.same_patch(a, [(0.5, a[0][1], 1.0, None, None)])
    assert not engine.same_patch(a, a + a)


if __name__ == "__main__":
    sys.exit(_runner.main(
        globals(), after_each=gc.collect,
        unavailable=None if torch is not None else "torch is not importable"))
