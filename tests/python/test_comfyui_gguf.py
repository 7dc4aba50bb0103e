"""ComfyUI-GGUF's models (city96/ComfyUI-GGUF) and the ComfyUI node on
vpager's simulated device: stand-ins of its GGMLTensor (a torch.Tensor
subclass holding the file's quantized blocks, with tensor_type,
tensor_shape and patches), its GGMLOps layer (dequantizing at each use,
applying the patches a weight carries) and its GGUFModelPatcher (a
legacy ModelPatcher subclass its loader makes by cloning the patcher
ComfyUI gave the model), over test_comfyui_node's stand-ins of ComfyUI;
and, when build-clients/ holds ComfyUI-GGUF and the `gguf` package
(bench/clients/prepare.py --gguf), ComfyUI-GGUF's own code over the
ComfyUI stand-ins.

    make && PYTHONPATH=python:integrations python3 tests/python/test_comfyui_gguf.py

Checked: the loader's clone hands back the node's subclass of its patcher,
which pages the GGMLTensor bytes: outputs bitwise equal to ComfyUI-GGUF's
own load, with some weights streamed, without and with a LoRA, a changed
strength and its removal; mapped file bytes get no host copy; the
fallbacks (the node off for the model, a patched quantized weight outside
the ops, a ComfyUI-GGUF the node cannot adopt, a GGUF model on the node's
plain patcher) go ComfyUI-GGUF's way with one log line. With gguf laid
out, a tiny real GGUF file written and read by it (the stand-in's Q8_0
blocks are the file's) and bench_gguf's files; with ComfyUI-GGUF too,
the node over its GGMLOps, loader and GGUFModelPatcher, bitwise.
"""

import contextlib
import itertools
import os
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
REPO = _runner.add_paths("integrations", "python")

torch = _runner.require_torch(__name__)
from torch import nn  # noqa: E402

import test_comfyui_node as t  # noqa: E402  (the ComfyUI stand-ins)
from _runner import raises  # noqa: E402
from comfyui import gguf as node_gguf, patcher as glue  # noqa: E402
from comfyui import gguf_patcher  # noqa: E402

CPU = t.CPU
PYDEPS = os.path.join(REPO, "build-clients", "pydeps")


# ------------------------------------------------- ComfyUI-GGUF stand-ins

class QType:
    """A GGML quantization type as the reader gives it (an enum: .name)."""

    def __init__(self, name):
        self.name = name


Q8_0, F32 = QType("Q8_0"), QType("F32")
BLOCK = 32                  # Q8_0: 32 weights a block, an fp16 scale first


class GGMLTensor(torch.Tensor):
    """ComfyUI-GGUF's GGMLTensor as its ops and patcher use it: the file's
    bytes, with tensor_type, tensor_shape (what .shape says: the weight's
    logical shape, not its bytes') and patches; .to() keeps them;
    detach() and clone() are the tensor itself (so a Parameter of it is
    it)."""

    @staticmethod
    def __new__(cls, data, tensor_type, tensor_shape):
        t = torch.Tensor._make_subclass(cls, data, False)
        t.tensor_type = tensor_type
        t.tensor_shape = torch.Size(tensor_shape)
        t.patches = []
        return t

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        new.tensor_type = getattr(self, "tensor_type", None)
        new.tensor_shape = getattr(self, "tensor_shape", new.size())
        new.patches = list(getattr(self, "patches", []))
        return new

    def detach(self, *args, **kwargs):
        return self

    def clone(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        if not hasattr(self, "tensor_shape"):
            self.tensor_shape = self.size()
        return self.tensor_shape


def quantize_q8_0(w):
    """w (float32, rows of a multiple of 32) -> Q8_0 blocks as uint8
    [rows, blocks * 34], GGML's layout: an fp16 scale, 32 int8."""
    rows = w.reshape(-1, BLOCK)
    d = rows.abs().amax(dim=1, keepdim=True) / 127
    q = torch.where(d == 0, torch.zeros_like(rows), rows / d).round()
    q = q.clamp(-127, 127).to(torch.int8)
    d16 = d.to(torch.float16)
    blocks = torch.cat([d16.view(torch.uint8).reshape(-1, 2),
                        q.view(torch.uint8)], dim=1)
    return blocks.reshape(w.shape[0], -1).contiguous()


def dequantize_q8_0(raw, shape):
    """ComfyUI-GGUF's Q8_0 dequantization: scale (fp16 -> float32) times
    the int8 weights."""
    blocks = raw.reshape(-1, 2 + BLOCK)
    d = blocks[:, :2].contiguous().view(torch.float16).to(torch.float32)
    x = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (d * x).reshape(shape)


def ggml_quantized(t):
    """ComfyUI-GGUF's is_quantized: not a torch-compatible type."""
    return getattr(t, "tensor_type", None) not in (None, F32)


def move_patches(item, device):
    """ComfyUI-GGUF's move_patch_to_device."""
    if isinstance(item, torch.Tensor):
        return item.to(device)
    if isinstance(item, (tuple, list)):
        return type(item)(move_patches(x, device) for x in item)
    return item


def dequantize(tensor, dtype):
    raw = tensor.as_subclass(torch.Tensor)
    if getattr(tensor, "tensor_type", None) is Q8_0:
        return dequantize_q8_0(raw, tensor.tensor_shape).to(dtype)
    return raw.to(dtype)


class GGMLLinear(t.Linear):
    """GGMLOps.Linear: comfy_cast_weights; when its weight or bias is
    quantized, dequantizes both at each use on the input's device and
    applies the patches they carry (in the compute dtype)."""

    comfy_cast_weights = True

    def weight_of(self, tensor, dtype):
        patches = [p for ps, _key in getattr(tensor, "patches", [])
                   for p in move_patches(ps, tensor.device)]
        w = dequantize(tensor, dtype)
        return t.calculate_weight(patches, w, None) if patches else w

    def forward(self, x):
        if not (ggml_quantized(self.weight) or ggml_quantized(self.bias)):
            return super().forward(x)
        w = self.weight_of(self.weight.to(x.device), x.dtype)
        b = self.weight_of(self.bias.to(x.device), x.dtype)
        return torch.nn.functional.linear(x, w, b)


def ggufed(model):
    """The model as ComfyUI-GGUF's loader leaves it: its ops' weights Q8_0
    GGMLTensors, their biases F32 ones (1-D tensors are not quantized),
    each its op's Parameter (a Parameter of a GGMLTensor is the tensor)."""
    for m in model.modules():
        if not isinstance(m, GGMLLinear):
            continue
        w, b = m.weight.detach(), m.bias.detach()
        m.weight = nn.Parameter(GGMLTensor(quantize_q8_0(w), Q8_0, w.shape),
                                requires_grad=False)
        m.bias = nn.Parameter(GGMLTensor(b.clone(), F32, b.shape),
                              requires_grad=False)
    return model


def gguf_dit(seed=0):
    return ggufed(t.DiT(op=GGMLLinear, seed=seed))


class CallbacksMP:
    ON_LOAD = "on_load_after"
    ON_CLONE = "on_clone"


class ModelPatcher(t.ModelPatcher):
    """The stand-in ModelPatcher with ComfyUI's keyed callbacks: clones
    copy them and call ON_CLONE's (source, clone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.callbacks = {}

    def add_callback_with_key(self, kind, key, callback):
        self.callbacks.setdefault(kind, {}).setdefault(key, []).append(
            callback)

    def get_all_callbacks(self, kind):
        return [c for cs in self.callbacks.get(kind, {}).values()
                for c in cs]

    def clone(self):
        n = super().clone()
        n.callbacks = {k: {k1: c1[:] for k1, c1 in c.items()}
                       for k, c in self.callbacks.items()}
        for callback in self.get_all_callbacks(CallbacksMP.ON_CLONE):
            callback(self, n)
        return n

    def partially_load(self, device_to, extra_memory=0,
                       force_patch_weights=False):
        """ComfyUI's legacy partial load: load() within a budget."""
        self.load(device_to, extra_memory, force_patch_weights)
        return 0


class ModelPatcherDynamic(ModelPatcher, t.ModelPatcherDynamic):
    pass


class GGUFModelPatcher(ModelPatcher):
    """ComfyUI-GGUF's patcher: a plain (not dynamic) ModelPatcher; its
    clone() runs as its own class and hands back its own class."""

    def clone(self):
        src = self.__class__
        self.__class__ = GGUFModelPatcher
        n = super().clone()
        n.__class__ = GGUFModelPatcher
        self.__class__ = src
        return n

    def load(self, device_to=None, lowvram_model_memory=0,
             force_patch_weights=False, full_load=False):
        self.model.gguf_loaded = getattr(self.model, "gguf_loaded", 0) + 1
        for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory,
                     force_patch_weights, full_load)


def copy_to_param(obj, attr, value):
    o, n = t.resolve_attr(obj, attr)
    getattr(o, n).data.copy_(value)


class GGUFLegacy(ModelPatcher):
    """ComfyUI-GGUF's GGUFModelPatcher but its clone (gguf_module): a
    quantized weight carries its patches (moved to the load device with
    patch_on_device, else the offload device) on a .to() of it; another
    is patched in float32, rounded to its dtype (backed up first); load()
    patches every patched weight (its legacy path: no paging)."""

    patch_on_device = False

    def patch_weight_to_device(self, key, device_to=None,
                               inplace_update=False):
        if key not in self.patches:
            return
        o, n = t.resolve_attr(self.model, key)
        weight = getattr(o, n)
        patches = self.patches[key]
        if ggml_quantized(weight):
            out = weight.to(device_to)
            out.patches = [(move_patches(
                patches, self.load_device if self.patch_on_device
                else self.offload_device), key)]
        else:
            inplace_update = self.weight_inplace_update or inplace_update
            if key not in self.backup:
                self.model.gguf_backups = getattr(
                    self.model, "gguf_backups", 0) + 1
                self.backup[key] = t.Backup(weight.to(
                    device=self.offload_device, copy=inplace_update),
                    inplace_update)
            temp = weight.to(torch.float32, copy=True)
            out = t.calculate_weight(patches, temp, key).to(weight.dtype)
        if inplace_update:
            copy_to_param(self.model, key, out)
        else:
            t.set_attr_param(self.model, key, out)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            for p in self.model.parameters():
                if ggml_quantized(p):
                    p.patches = []
        return super().unpatch_model(device_to, unpatch_weights)

    def load(self, device_to=None, lowvram_model_memory=0,
             force_patch_weights=False, full_load=False):
        self.model.gguf_loaded = getattr(self.model, "gguf_loaded", 0) + 1
        for key in list(self.patches):
            self.patch_weight_to_device(key, device_to)
        for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory,
                     force_patch_weights, full_load)


MODULES = [0]


@contextlib.contextmanager
def gguf_module():
    """A fresh ComfyUI-GGUF nodes module as the node finds it in
    sys.modules: GGUFModelPatcher (GGUFLegacy with ComfyUI-GGUF's clone,
    which runs as its class and hands back its class), is_quantized and
    move_patch_to_device; removed at the end."""
    MODULES[0] += 1
    name = "stand_in_comfyui_gguf_%d.nodes" % MODULES[0]
    mod = types.ModuleType(name)

    def clone(self):
        src = self.__class__
        self.__class__ = cls
        n = ModelPatcher.clone(self)
        n.__class__ = cls
        self.__class__ = src
        n.patch_on_device = getattr(self, "patch_on_device", False)
        return n

    cls = type("GGUFModelPatcher", (GGUFLegacy,),
               {"__module__": name, "clone": clone})
    mod.GGUFModelPatcher = cls
    mod.is_quantized = ggml_quantized
    mod.move_patch_to_device = move_patches
    sys.modules[name] = mod
    try:
        yield mod
    finally:
        del sys.modules[name]


def gguf_env(adopt=False, **kw):
    """test_comfyui_node's env with the keyed-callback stand-ins; adopt:
    the node's patcher adopts ComfyUI-GGUF's (as install() sets it)."""
    e = t.env(**kw)
    inner = e.__enter__()
    inner.comfy.model_patcher = types.SimpleNamespace(
        ModelPatcher=ModelPatcher, ModelPatcherDynamic=ModelPatcherDynamic,
        CoreModelPatcher=ModelPatcherDynamic, CallbacksMP=CallbacksMP)
    inner.comfy.utils.copy_to_param = copy_to_param
    inner.cls = glue.make_class(inner.comfy, ModelPatcherDynamic)
    if adopt:
        inner.cls._adopt = gguf_patcher.Adopter(inner.comfy)
    return e, inner


class GGUFEnv:
    def __init__(self, **kw):
        self.kw = kw

    def __enter__(self):
        self.ctx, e = gguf_env(**self.kw)
        return e

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def untouched(m):
    """Every op weight still the stand-in loader's GGMLTensor, on the
    host."""
    return all(node_gguf.is_ggml(op.weight) and op.weight.device.type == "cpu"
               for op in m.modules() if isinstance(op, GGMLLinear))


# ---------------------------------------------------------------- tests

def test_recognised():
    m = gguf_dit()
    assert node_gguf.qtypes(m) == {"Q8_0": 12, "F32": 12}
    why = node_gguf.refusal(m)
    assert "GGUF" in why and "Q8_0 x12" in why and "F32 x12" in why, why
    assert node_gguf.refusal(t.DiT()) is None
    assert not node_gguf.is_ggml(t.DiT().diffusion_model.pos)


def test_loader_patcher_one_log_line():
    """ComfyUI-GGUF's loader: ComfyUI's loader gave the model the node's
    patcher; GGUFModelPatcher.clone(it) makes ComfyUI-GGUF's. One log line
    names it, however often the model is cloned and loaded; the node
    never takes it; outputs are ComfyUI-GGUF's."""
    with GGUFEnv() as e:
        m, ref = gguf_dit(), gguf_dit()
        with t.logs() as lines:
            core = e.patcher(m)
            model = GGUFModelPatcher.clone(core)
            again = model.clone()
            model.load(CPU)
            again.load(CPU)
        assert type(model) is GGUFModelPatcher and \
            type(again) is GGUFModelPatcher
        assert len(lines) == 1, lines
        assert lines[0].startswith("vpager: DiT uses ComfyUI's own loading: "
                                   "ComfyUI-GGUF's GGUFModelPatcher loads "
                                   "it"), lines
        assert "Q8_0 x12" in lines[0] and "does not page GGUF" in lines[0]
        assert m.gguf_loaded == 2 and getattr(m, "_vpager_pager", None) \
            is None and untouched(m)
        assert torch.equal(t.run(m), t.run(ref))
        # A model of the node's own clones says nothing.
        with t.logs() as lines:
            e.patcher(t.DiT()).clone()
        assert lines == [], lines


def test_gguf_model_on_the_node_patcher_falls_back():
    """A GGUF model that reaches the node's patcher (a ComfyUI-GGUF that
    keeps ComfyUI's dynamic patcher) goes ComfyUI's way, with one log line
    naming GGUF; nothing of it changed; outputs as ComfyUI-GGUF's."""
    with GGUFEnv() as e:
        m, ref = gguf_dit(), gguf_dit()
        p = e.patcher(m)
        with t.logs() as lines:
            p.partially_load(CPU)
            p.partially_load(CPU)
            q = p.clone()
            q.partially_load(CPU)
        assert not p.vpager_active() and not q.vpager_active()
        assert m.comfy_loaded == 3 and untouched(m)
        assert len(lines) == 1, lines
        assert lines[0].startswith("vpager: DiT uses ComfyUI's own loading: "
                                   "its weights are GGUF"), lines
        assert "Q8_0 x12" in lines[0], lines
        assert torch.equal(t.run(m), t.run(ref))


OPS = ["diffusion_model.blocks.%d.%s" % (i, n)
       for i in range(6) for n in ("up", "down")]


def legacy_run(mod, patches=None, seed=0, patch_on_device=False):
    """ComfyUI-GGUF's own (legacy) load of a fresh model with `patches`
    ({key: [patch tuples]}), and its outputs: the reference."""
    ref = gguf_dit(seed)
    lp = mod.GGUFModelPatcher(ref, CPU, CPU)
    lp.patch_on_device = patch_on_device
    lp.patches = {k: list(v) for k, v in (patches or {}).items()}
    lp.load(CPU)
    return t.run(ref)


def diffs(seed=5):
    """LoRA-like diffs: every op weight (quantized: carried on the
    tensor) and two biases (F32: patched over their bytes)."""
    ref = dict(t.DiT(seed=0).named_parameters())
    g = torch.Generator().manual_seed(seed)
    keys = [o + ".weight" for o in OPS] + \
        [OPS[0] + ".bias", OPS[7] + ".bias"]
    return {k: torch.randn(*ref[k].shape, generator=g) * 0.01 for k in keys}


def test_gguf_model_paged_bitwise():
    """Issue 26 point 4: ComfyUI-GGUF's loader clones the node's patcher
    into its own class and gets the node's subclass of it; vpager pages
    the GGMLTensor weights as their stored bytes (the parameter objects
    kept, with their GGML type and shape), ComfyUI-GGUF's ops dequantize
    them: outputs bitwise equal to ComfyUI-GGUF's own load, with some
    weights streamed, prompt after prompt; a LoRA (carried by quantized
    weights, computed over an F32 bias's bytes at fill), a strength
    change and its removal too; no host copy per patched weight."""
    with GGUFEnv(adopt=True, capacity=192 * t.K, staging=128 * t.K) as e, \
            gguf_module() as mod:
        m = gguf_dit()
        # Declared another dtype at the model's creation (ComfyUI's
        # archive_model_dtypes): ComfyUI-GGUF's path leaves it as stored.
        m.diffusion_model.pos_comfy_model_dtype = torch.float16
        params = {k: p for k, p in m.named_parameters()}
        with t.logs() as lines:
            core = e.patcher(m)     # ComfyUI's loader's (adopts first)
            model = mod.GGUFModelPatcher.clone(core)
            again = model.clone()
        assert type(model).__name__ == "VpagerGGUFModelPatcher", type(model)
        assert isinstance(model, mod.GGUFModelPatcher) and \
            isinstance(model, glue.VpagerPatcher)
        assert type(again) is type(model) and lines == [], lines
        model.partially_load(CPU)
        assert model.vpager_active() and not getattr(m, "gguf_loaded", 0)
        assert m.diffusion_model.pos.dtype == torch.float32
        want0 = legacy_run(mod)
        for _ in range(3):
            assert torch.equal(t.run(m), want0)
        pager = m._vpager_pager
        s = pager.stats()
        assert s["model"]["weights"] == 24, s["model"]
        assert s["model"]["weight_bytes"] == sum(
            p.numel() * p.element_size() for p in params.values()
            if node_gguf.is_ggml(p))
        assert s["model"]["host_patched_weights"] == 0
        # The same parameter objects, their GGML attributes kept, their
        # bytes on the host between forwards.
        for k, p in m.named_parameters():
            assert p is params[k] or not node_gguf.is_ggml(p), k
        op = m.diffusion_model.blocks[2].up
        assert op.weight.tensor_type is Q8_0 and \
            tuple(op.weight.shape) == (256, 64) and \
            op.weight.device.type == "cpu"
        assert s["model"]["weight_staged"] > 0, s["model"]   # some stream
        host0 = pager.host_bytes()
        # A LoRA, then its strength changed, then removed.
        d = diffs()
        f0 = s["model"]["patch_fills"]
        for strength in (1.0, 0.5):
            q = model.clone()
            q.add_patches({k: ("diff", (v,)) for k, v in d.items()},
                          strength)
            q.partially_load(CPU)
            assert q.vpager_active()
            want = legacy_run(mod, q.patches)
            assert not torch.equal(want, want0)
            for _ in range(3):
                assert torch.equal(t.run(m), want)
            w = op.weight
            assert len(w.patches) == 1 and w.patches[0][1] == \
                OPS[4] + ".weight", w.patches
            assert pager.host_bytes() == host0
            # (the fill's backup of a patched bias is its source: none)
            assert not set(q.backup) & set(d), set(q.backup) & set(d)
        fills = pager.stats()["model"]["patch_fills"] - f0
        assert fills >= 2, fills      # the biases, over their bytes
        # ... with no copy of them to the host (ComfyUI-GGUF's backup)
        assert not getattr(m, "gguf_backups", 0), m.gguf_backups
        model.partially_load(CPU)
        assert pager.patched_keys() == [] and op.weight.patches == []
        for _ in range(2):
            assert torch.equal(t.run(m), want0)


def test_gguf_carried_patches_staged_on_device():
    """A quantized weight's patches (its op applies them at each use,
    copying each tensor from the host) are copied to the device once at
    load (patch_stage.CarriedPatches), the op computing from the copy,
    bitwise as ComfyUI-GGUF's own load; another LoRA on some of the
    weights leaves the others unpatched, its removal leaves none;
    free_memory beyond the pages puts the host's back. The simulated
    device is the host: the copy here is a clone, as a copy to the GPU
    would be."""
    from comfyui import patch_stage
    copies = []

    def carried(op):
        return [x for ps, _k in op.weight.patches for p in ps
                for x in p[1][1]]

    real = patch_stage.on_device
    patch_stage.on_device = t.cloning(copies)
    try:
        with GGUFEnv(adopt=True, capacity=192 * t.K, staging=128 * t.K) \
                as e, gguf_module() as mod:
            m = gguf_dit()
            core = e.patcher(m)     # adopts ComfyUI-GGUF's class first
            model = mod.GGUFModelPatcher.clone(core)
            model.partially_load(CPU)
            assert model.vpager_active(), type(model)
            pager = m._vpager_pager
            op = m.diffusion_model.blocks[2].up
            assert ggml_quantized(op.weight)
            params = dict(m.named_parameters())
            a = diffs()
            b = {k: v for k, v in diffs(seed=9).items()
                 if k.startswith(OPS[0]) or k.startswith(OPS[7])}
            want0 = legacy_run(mod)
            bench_gguf()
            import comfyui_run as cr
            prev = model
            for d, strength in ((a, 1.0), (a, 0.5), (b, 1.0), (a, 1.0)):
                q = model.clone()
                q.add_patches({k: ("diff", (v,)) for k, v in d.items()},
                              strength)
                refills = pager.stats()["model"]["refills"]
                q.partially_load(CPU)
                # The bench's count: every changed quantized weight is
                # patched at use, none refilled.
                n, _b, _k, at_use = cr.patch_change(prev, q)
                changed = set(prev.patches) | set(q.patches)  # each differs
                assert n == len(changed), (n, changed)
                assert at_use == sum(bool(ggml_quantized(params[k]))
                                     for k in changed) > 0, at_use
                assert pager.stats()["model"]["refills"] - refills == \
                    n - at_use, (n, at_use)
                prev = q
                want = legacy_run(mod, q.patches)
                assert (carried(op) == []) == (d is b), d is b
                assert all(any(x is c for c in copies)
                           for x in carried(op)), "not the copy"
                staged = pager.stats()["model"]["patch_staged_bytes"]
                quantized = sum(v.numel() * 4 for k, v in d.items()
                                if ggml_quantized(params[k]))
                assert staged >= quantized > 0, (staged, quantized)
                for _ in range(2):
                    assert torch.equal(t.run(m), want)
            # Asked for more than its pages: the host's placed again.
            pager.free_memory(1 << 40)
            host = carried(op)
            assert len(host) == 1 and host[0] is a[OPS[4] + ".weight"]
            assert pager.stats()["model"]["patch_staged_bytes"] == 0
            for _ in range(2):
                assert torch.equal(t.run(m), want)
            # Removed, with the copies staged (a LoRA's again first).
            q.partially_load(CPU)
            model.partially_load(CPU)
            assert op.weight.patches == [] and \
                pager.stats()["model"]["patch_staged_bytes"] == 0
            assert torch.equal(t.run(m), want0)
    finally:
        patch_stage.on_device = real


def mapped(model, path):
    """Every GGMLTensor's bytes written to `path` and its data made a
    read-only mapping of them, as ComfyUI-GGUF's loader leaves them (the
    gguf reader's numpy memmap, torch.from_numpy)."""
    import warnings
    import numpy as np
    ps = [p for p in model.parameters() if node_gguf.is_ggml(p)]
    with open(path, "wb") as f:
        for p in ps:
            f.write(p.data.as_subclass(torch.Tensor).contiguous()
                    .view(torch.uint8).numpy().tobytes())
    mm = np.memmap(path, mode="r")
    at = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # a read-only array
        for p in ps:
            n = p.numel() * p.element_size()
            raw = torch.from_numpy(mm[at:at + n]).view(p.dtype)
            p.data = raw.view(tuple(p.size()))
            at += n
    return model


def test_gguf_mapped_bytes_stay_in_the_file():
    """Issue 28 for GGUF: weights whose bytes are the mapped GGUF file
    get no pinned copy (vpager.torch's host policy keeps them in the
    mapping or reads the file); outputs as ComfyUI-GGUF's own."""
    with GGUFEnv(adopt=True) as e, gguf_module() as mod, \
            tempfile.TemporaryDirectory() as d:
        m = mapped(gguf_dit(), os.path.join(d, "model.gguf"))
        core = e.patcher(m)
        model = mod.GGUFModelPatcher.clone(core)
        model.partially_load(CPU)
        assert model.vpager_active()
        kinds = m._vpager_pager.stats()["model"]["host_by_kind"]
        assert kinds["pinned copy"] == 0 and \
            kinds["in place"] + kinds["file"] > 0, kinds
        for _ in range(2):
            assert torch.equal(t.run(m), legacy_run(mod))
        del model, core, m


def test_gguf_patches_on_device():
    """ComfyUI-GGUF's patch_on_device: the node moves a quantized weight's
    patches where it says, as ComfyUI-GGUF's own load does."""
    with GGUFEnv(adopt=True) as e, gguf_module() as mod:
        m = gguf_dit()
        core = e.patcher(m)
        model = mod.GGUFModelPatcher.clone(core)
        model.patch_on_device = True
        moved = []
        real = mod.move_patch_to_device
        mod.move_patch_to_device = lambda x, dev: (moved.append(dev),
                                                   real(x, dev))[1]
        try:
            model.add_patches({k: ("diff", (v,)) for k, v in diffs().items()
                               if k.endswith("weight")})
            model.partially_load(CPU)
        finally:
            mod.move_patch_to_device = real
        assert model.vpager_active()
        assert torch.equal(t.run(m), legacy_run(mod, model.patches,
                                                patch_on_device=True))
        # (the class was made with the module's function at adoption)
        assert model._gguf_move is real or moved


def test_gguf_fallbacks_are_comfyui_ggufs():
    """A GGUF model the node does not page goes ComfyUI-GGUF's own legacy
    way, with one log line: turned off for it (VpagerSettings), and a
    patch on a quantized weight outside the ops. A ComfyUI-GGUF module
    without the functions the node calls is not adopted: its patcher
    stays its own (one log line at the clone)."""
    with GGUFEnv(adopt=True) as e, gguf_module() as mod:
        m = gguf_dit()
        core = e.patcher(m)
        model = mod.GGUFModelPatcher.clone(core)
        model.model_options[glue.OPTION] = False
        with t.logs() as lines:
            model.partially_load(CPU)
        assert not model.vpager_active() and m.gguf_loaded == 1
        assert any("turned off for this model" in x for x in lines), lines
        assert torch.equal(t.run(m), legacy_run(mod))
        # A quantized GGMLTensor on no ComfyUI op, patched.
        m2 = gguf_dit()
        dm = m2.diffusion_model
        dm.extra = nn.Parameter(GGMLTensor(
            quantize_q8_0(torch.ones(2, 32)), Q8_0, (2, 32)),
            requires_grad=False)
        core = e.patcher(m2)
        p2 = mod.GGUFModelPatcher.clone(core)
        p2.add_patches({"diffusion_model.extra": ("diff", (
            torch.zeros(2, 32),))})
        with t.logs() as lines:
            p2.partially_load(CPU)
        assert not p2.vpager_active() and m2.gguf_loaded == 1
        assert any("diffusion_model.extra, a quantized GGUF weight" in x
                   for x in lines), lines
    with GGUFEnv(adopt=True) as e:
        # The test module's GGUFModelPatcher: no is_quantized beside it.
        m = gguf_dit()
        with t.logs() as lines:
            core = e.patcher(m)
            model = GGUFModelPatcher.clone(core)
        assert type(model) is GGUFModelPatcher
        assert len(lines) == 1 and "does not page GGUF" in lines[0], lines


def bench_gguf():
    """bench/bench_gguf.py as a module."""
    bench = os.path.join(REPO, "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import bench_gguf as b
    return b


def import_gguf():
    """The `gguf` package from build-clients/pydeps (prepare.py --gguf),
    or None. Its tokenizer and progress-bar imports (sentencepiece, tqdm)
    are stubbed when missing: the reader and writer need neither."""
    if not os.path.isdir(os.path.join(PYDEPS, "gguf")):
        return None
    for name, attrs in (("sentencepiece", {"SentencePieceProcessor": None}),
                        ("tqdm", {"tqdm": lambda it=None, **kw: it})):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.SimpleNamespace(**attrs)
    if PYDEPS not in sys.path:
        sys.path.append(PYDEPS)
    try:
        import gguf
    except ImportError:
        return None
    return gguf


def test_real_gguf_file():
    """A tiny GGUF file written by the gguf package (Q8_0, Q4_0, F32) and
    read back as ComfyUI-GGUF's loader reads it: the stand-in's Q8_0
    blocks are the file's bytes (the stand-in dequantizes them bitwise as
    gguf's reference dequantization), and the node recognises the reader's
    tensors by their GGML types."""
    gguf = import_gguf()
    if gguf is None:
        _runner.skip("the gguf package is not laid out "
                     "(bench/clients/prepare.py --gguf)")
    import numpy as np
    g = torch.Generator().manual_seed(3)
    up = torch.randn(256, 64, generator=g) * 0.05
    down = torch.randn(64, 256, generator=g) * 0.05
    bias = torch.randn(64, generator=g) * 0.05
    Q = gguf.GGMLQuantizationType
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tiny.gguf")
        w = gguf.GGUFWriter(path, "flux")
        w.add_tensor("up.weight", gguf.quants.quantize(up.numpy(), Q.Q8_0),
                     raw_dtype=Q.Q8_0)
        w.add_tensor("down.weight",
                     gguf.quants.quantize(down.numpy(), Q.Q4_0),
                     raw_dtype=Q.Q4_0)
        w.add_tensor("down.bias", bias.numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        r = gguf.GGUFReader(path)
        read = {}
        for rt in r.tensors:
            shape = tuple(int(v) for v in reversed(rt.shape))
            data = torch.from_numpy(np.array(rt.data))
            read[rt.name] = GGMLTensor(data, rt.tensor_type, shape)
            ref = gguf.quants.dequantize(np.array(rt.data), rt.tensor_type)
            if rt.tensor_type == Q.Q8_0:
                ours = dequantize_q8_0(data, shape)
                assert torch.equal(ours, torch.from_numpy(ref)), rt.name
    assert torch.equal(
        read["up.weight"], quantize_q8_0(up).reshape(read["up.weight"].size()))
    holder = nn.Module()
    holder.up, holder.down = nn.Module(), nn.Module()
    holder.up._parameters["weight"] = read["up.weight"]
    holder.down._parameters["weight"] = read["down.weight"]
    holder.down._parameters["bias"] = read["down.bias"]
    assert node_gguf.qtypes(holder) == {"Q8_0": 1, "Q4_0": 1, "F32": 1}
    assert read["down.weight"].tensor_shape == (64, 256)


# ------------------------------- ComfyUI-GGUF's own code, ComfyUI stand-ins

GGUF_DIR = os.path.join(REPO, "build-clients", "ComfyUI-GGUF")


class LegacyModelPatcher(ModelPatcher):
    """ComfyUI's legacy ModelPatcher.load, as far as ComfyUI-GGUF's patcher
    needs it here: every patched weight patched, ON_LOAD called."""

    def load(self, device_to=None, lowvram_model_memory=0,
             force_patch_weights=False, full_load=False):
        for key in list(self.patches):
            self.patch_weight_to_device(key, device_to)
        for callback in self.get_all_callbacks(CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory,
                     force_patch_weights, full_load)

    def pin_weight_to_device(self, key):
        pass


def comfy_stand_in_modules():
    """The ComfyUI modules ComfyUI-GGUF imports, as stand-ins over
    test_comfyui_node's (its patcher's ModelPatcher: LegacyModelPatcher):
    {module name: module}."""
    F = torch.nn.functional

    def cast_to(w, dtype=None, device=None, non_blocking=False, copy=False):
        return w.to(device=device, dtype=dtype, copy=copy)

    class CastLinear(nn.Linear):
        comfy_cast_weights = True

        def forward(self, x):
            return self.forward_comfy_cast_weights(x)

        def forward_comfy_cast_weights(self, x):
            b = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), b)

    manual_cast = type("manual_cast", (), {
        "Linear": CastLinear, "Conv2d": nn.Conv2d,
        "Embedding": nn.Embedding, "LayerNorm": nn.LayerNorm,
        "GroupNorm": nn.GroupNorm})

    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def get_attr(obj, attr):
        o, n = t.resolve_attr(obj, attr)
        return getattr(o, n)

    utils = mod("comfy.utils", get_attr=get_attr, copy_to_param=copy_to_param,
                set_attr_param=t.set_attr_param)
    mods = {
        "comfy": mod("comfy"),
        "comfy.ops": mod("comfy.ops", manual_cast=manual_cast,
                         cast_to=cast_to),
        "comfy.lora": mod("comfy.lora", calculate_weight=t.calculate_weight),
        "comfy.model_management": mod(
            "comfy.model_management",
            device_supports_non_blocking=lambda device: False,
            cast_to_device=lambda w, device, dtype, copy=False: cast_to(
                w, dtype, device, copy=copy)),
        "comfy.float": mod("comfy.float",
                           stochastic_rounding=lambda v, dtype, seed=0:
                           v.to(dtype)),
        "comfy.utils": utils,
        "comfy.sd": mod("comfy.sd"),
        "comfy.model_patcher": mod("comfy.model_patcher",
                                   ModelPatcher=LegacyModelPatcher),
        "nodes": mod("nodes"),
        "folder_paths": mod("folder_paths", folder_names_and_paths={}),
    }
    try:            # ComfyUI-GGUF compares torch's version with it
        import packaging.version  # noqa: F401
    except ImportError:
        mods["packaging"] = mod("packaging")
        mods["packaging.version"] = mod("packaging.version",
                                        parse=_version_key)
    for name, m in mods.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, m)
    return mods


def _version_key(text):
    """packaging.version.parse's stand-in: a version's leading numbers as
    a tuple ("2.11.0+cu130" -> (2, 11, 0)), comparable with another's."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


@contextlib.contextmanager
def real_comfyui_gguf():
    """ComfyUI-GGUF's own package (build-clients/ComfyUI-GGUF, its gguf
    from build-clients/pydeps) imported as ComfyUI_GGUF over the
    stand-ins; they and it are gone again at the end. Skips the test
    when either is not laid out (bench/clients/prepare.py --gguf)."""
    gguf = import_gguf()
    if gguf is None or not os.path.isfile(os.path.join(GGUF_DIR,
                                                       "nodes.py")):
        _runner.skip("ComfyUI-GGUF and gguf are not laid out "
                     "(bench/clients/prepare.py --gguf)")
    stubs = {k: v for k, v in comfy_stand_in_modules().items()
             if k not in sys.modules}
    sys.modules.update(stubs)
    try:
        bench_gguf().comfyui_gguf(GGUF_DIR)     # as the bench imports it
        yield types.SimpleNamespace(
            gguf=gguf, nodes=sys.modules["ComfyUI_GGUF.nodes"],
            loader=sys.modules["ComfyUI_GGUF.loader"])
    finally:
        for name in list(sys.modules):
            if name in stubs or name.split(".")[0] == "ComfyUI_GGUF":
                del sys.modules[name]


def write_gguf_dit(gguf, path, seed=0):
    """test_comfyui_node's DiT's op weights as a GGUF file (Q8_0 by gguf's
    quantizer; biases F32), as ComfyUI-GGUF's loader reads them."""
    Q = gguf.GGMLQuantizationType
    w = gguf.GGUFWriter(path, "flux")
    for k, v in t.DiT(seed=seed).diffusion_model.state_dict().items():
        if k.startswith("blocks.") and (".up." in k or ".down." in k):
            if v.dim() == 2:
                w.add_tensor(k, gguf.quants.quantize(v.numpy(), Q.Q8_0),
                             raw_dtype=Q.Q8_0)
            else:
                w.add_tensor(k, v.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_gguf_dit(real, path, seed=0):
    """A DiT with ComfyUI-GGUF's GGMLOps.Linear ops whose weights its
    loader read from `path` (each op loading its own keys, as torch 2's
    load_state_dict hands them)."""
    ops = real.nodes.GGMLOps()
    ops.Linear.dequant_dtype = None
    ops.Linear.patch_dtype = None
    m = t.DiT(op=ops.Linear, seed=seed)
    sd = real.loader.gguf_sd_loader(path, handle_prefix=None)
    for name, op in m.diffusion_model.named_modules():
        if isinstance(op, ops.Linear):
            prefix = name + "."
            op._load_from_state_dict(
                {k: v for k, v in sd.items() if k.startswith(prefix)},
                prefix, {}, True, [], [], [])
    return m


def test_real_comfyui_gguf_paged_bitwise():
    """The node over ComfyUI-GGUF's own code (its GGMLTensor, GGMLOps,
    loader from a real GGUF file, GGUFModelPatcher and its clone; ComfyUI
    stand-ins below it): its loader's clone hands back the node's class,
    vpager pages the mapped Q8_0 blocks with some streamed, and outputs
    are bitwise ComfyUI-GGUF's own load's, without and with a LoRA (on
    the quantized weights and an F32 bias) and after its removal."""
    with real_comfyui_gguf() as real, \
            GGUFEnv(adopt=True, capacity=192 * t.K, staging=128 * t.K) as e, \
            tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "dit.gguf")
        write_gguf_dit(real.gguf, path)
        GGUF = real.nodes.GGUFModelPatcher

        def reference(patches=None):
            ref = load_gguf_dit(real, path)
            lp = GGUF(ref, CPU, CPU)
            lp.patches = {k: list(v) for k, v in (patches or {}).items()}
            lp.load(CPU)
            return t.run(ref)

        m = load_gguf_dit(real, path)
        up = m.diffusion_model.blocks[0].up
        assert type(up.weight).__name__ == "GGMLTensor" and \
            up.weight.tensor_type == real.gguf.GGMLQuantizationType.Q8_0
        core = e.patcher(m)
        model = GGUF.clone(core)
        model.patch_on_device = None
        assert type(model).__name__ == "VpagerGGUFModelPatcher"
        model.partially_load(CPU)
        assert model.vpager_active()
        s = m._vpager_pager.stats()["model"]
        assert s["weights"] == 24 and s["host_by_kind"]["pinned copy"] \
            == 0, s
        want0 = reference()
        for _ in range(2):
            assert torch.equal(t.run(m), want0)
        assert m._vpager_pager.stats()["model"]["weight_staged"] > 0
        q = model.clone()
        q.add_patches({k: ("diff", (v,)) for k, v in diffs().items()}, 0.7)
        q.partially_load(CPU)
        want1 = reference(q.patches)
        assert not torch.equal(want1, want0)
        for _ in range(2):
            assert torch.equal(t.run(m), want1)
        model.partially_load(CPU)
        assert torch.equal(t.run(m), want0)
        del model, q, core, m


def test_bench_gguf_worst_prompt_against_its_limit():
    """bench_gguf.worst_vs_L: the node's worst prompt after the first,
    each against resident's steady step of the same prompt or the link
    term, whichever is longer (a summary.json cell of call 10's shape)."""
    b = bench_gguf()                # (puts bench/ on the path)
    import comfyui_run as cr

    def reps(**steady):
        return {"reps": [{"label": k, "steps_ms": [900.0, v, v, v]}
                         for k, v in steady.items()]}
    cell = {"runs": {"resident": reps(base=113.5, lora_a=125.1,
                                      removed=80.0),
                     "nodehalf": reps(base=190.0, lora_a=143.2,
                                      removed=90.0)},
            "table": {"nodehalf": {"link_term_ms": 85.0}}}
    got = b.worst_vs_L(cr, cell)
    assert abs(got - 143.2 / 125.1) < 1e-9, got
    cell["runs"]["nodehalf"] = reps(base=120.0, removed=100.0)
    assert abs(b.worst_vs_L(cr, cell) - 100 / 85) < 1e-9
    del cell["runs"]["resident"]
    assert b.worst_vs_L(cr, cell) is None


def test_bench_gguf_files():
    """bench_gguf's GGUF files (the bench's checkpoint as ComfyUI-GGUF
    models): weights that fill whole blocks quantized (Q8_0 as gguf's own
    quantizer does, Q4_K as random blocks with finite scales), the rest F32;
    read back by the reader with their shapes, finite when dequantized."""
    gguf = import_gguf()
    if gguf is None:
        _runner.skip("the gguf package is not laid out "
                     "(bench/clients/prepare.py --gguf)")
    import numpy as np
    g = torch.Generator().manual_seed(5)
    tensors = {"blocks.0.up.weight": torch.randn(64, 256, generator=g),
               "blocks.0.up.bias": torch.randn(64, generator=g),
               "img_in.weight": torch.randn(32, 48, generator=g).to(
                   torch.bfloat16)}
    with tempfile.TemporaryDirectory() as d:
        for q, block in (("Q8_0", 32), ("Q4_K", 256)):
            path = os.path.join(d, q + ".gguf")
            info = bench_gguf().write_gguf(tensors, path, q)
            assert info["types"] == {q: 1, "F32": 2}, info
            r = gguf.GGUFReader(path)
            got = {rt.name: rt for rt in r.tensors}
            up = got["blocks.0.up.weight"]
            assert up.tensor_type.name == q
            assert tuple(int(v) for v in reversed(up.shape)) == (64, 256)
            w = gguf.quants.dequantize(np.array(up.data), up.tensor_type)
            assert w.shape == (64, 256) and np.isfinite(w).all()
            if q == "Q4_K":         # random blocks, small scales
                assert np.abs(w).max() < 1.0, np.abs(w).max()
            else:                   # gguf's quantizer: the tensor's values
                assert np.abs(w - tensors["blocks.0.up.weight"].numpy()
                              ).max() < 0.05
            assert got["img_in.weight"].tensor_type.name == "F32"
            assert info["bytes"] == sum(int(rt.n_bytes)
                                        for rt in r.tensors), info
        # Q8_0 by torch: gguf's own quantizer's bytes, an all-zero block
        # and a value half a step between two included.
        t = torch.randn(6, 96, generator=g) * 3
        t[0, :32] = 0
        t[1, 3] = t[1, :32].abs().max() * 63.5 / 127
        assert np.array_equal(
            bench_gguf().q8_0(t),
            gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0))
        e = raises(SystemExit, bench_gguf().write_gguf, tensors,
                   os.path.join(d, "x.gguf"), "IQ9")
        assert "--qtypes" in str(e), e
    # The node's lines picked from a child's log.
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write("2026 INFO vpager: Flux uses ComfyUI's own loading: "
                "ComfyUI-GGUF's GGUFModelPatcher loads it\n"
                "2026 INFO something else\n")
    try:
        assert bench_gguf().node_lines(f.name) == [
            "Flux uses ComfyUI's own loading: ComfyUI-GGUF's "
            "GGUFModelPatcher loads it"]
    finally:
        os.unlink(f.name)
    ours, rest = bench_gguf().split_args(
        ["--qtypes", "Q4_0", "--gguf-lora", "off", "--steps", "3"])
    assert ours["qtypes"] == "Q4_0" and ours["lora"] == "off"
    assert rest == ["--steps", "3"]


if __name__ == "__main__":
    import gc
    sys.exit(_runner.main(globals(), after_each=gc.collect))
