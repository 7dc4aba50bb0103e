"""ComfyUI-GGUF's models (city96/ComfyUI-GGUF) and the ComfyUI node, without
ComfyUI or ComfyUI-GGUF: stand-ins of its GGMLTensor (a torch.Tensor
subclass holding the file's quantized blocks, with tensor_type and
tensor_shape), its GGMLOps layer (dequantizing at each use) and its
GGUFModelPatcher (a ModelPatcher subclass its loader makes by cloning the
patcher ComfyUI gave the model), over test_comfyui_node's stand-ins of
ComfyUI, on vpager's simulated device.

    make && PYTHONPATH=python:integrations python3 tests/python/test_comfyui_gguf.py

Checked: such a model stays on ComfyUI-GGUF's path (the node's patcher
never takes it), with one log line naming GGUF, when ComfyUI-GGUF's loader
makes its patcher or when a GGUF model reaches the node's patcher; its
outputs are ComfyUI-GGUF's. With the `gguf` package laid out
(bench/clients/prepare.py --gguf: build-clients/pydeps/gguf), a tiny real
GGUF file (Q8_0, Q4_0, F32) written and read by it: the stand-in's
Q8_0 blocks are the file's, and the node recognises the reader's tensors.
"""

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
    """ComfyUI-GGUF's GGMLTensor: the file's bytes, with tensor_type and
    tensor_shape."""

    @staticmethod
    def __new__(cls, data, tensor_type, tensor_shape):
        t = torch.Tensor._make_subclass(cls, data, False)
        t.tensor_type = tensor_type
        t.tensor_shape = torch.Size(tensor_shape)
        t.patches = []
        return t


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


def dequantize(tensor, dtype):
    raw = tensor.as_subclass(torch.Tensor)
    if tensor.tensor_type is Q8_0:
        return dequantize_q8_0(raw, tensor.tensor_shape).to(dtype)
    return raw.to(dtype)


class GGMLLinear(t.Linear):
    """GGMLOps.Linear: comfy_cast_weights; dequantizes its GGMLTensor
    weight and bias at each use, on the input's device."""

    comfy_cast_weights = True

    def forward(self, x):
        if not node_gguf.is_ggml(self.weight):
            return super().forward(x)
        w = dequantize(self.weight.to(x.device), x.dtype)
        b = dequantize(self.bias.to(x.device), x.dtype)
        return torch.nn.functional.linear(x, w, b)


def ggufed(model):
    """The model as ComfyUI-GGUF's loader leaves it: its ops' weights Q8_0
    GGMLTensors, their biases F32 ones (1-D tensors are not quantized)."""
    for m in model.modules():
        if not isinstance(m, GGMLLinear):
            continue
        w, b = m.weight.detach(), m.bias.detach()
        m._parameters["weight"] = GGMLTensor(quantize_q8_0(w), Q8_0, w.shape)
        m._parameters["bias"] = GGMLTensor(b.clone(), F32, b.shape)
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


def gguf_env(**kw):
    """test_comfyui_node's env with the keyed-callback stand-ins."""
    e = t.env(**kw)
    inner = e.__enter__()
    inner.comfy.model_patcher = types.SimpleNamespace(
        ModelPatcher=ModelPatcher, ModelPatcherDynamic=ModelPatcherDynamic,
        CoreModelPatcher=ModelPatcherDynamic, CallbacksMP=CallbacksMP)
    inner.cls = glue.make_class(inner.comfy, ModelPatcherDynamic)
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
        read["up.weight"], quantize_q8_0(up).reshape(read["up.weight"].shape))
    holder = nn.Module()
    holder.up, holder.down = nn.Module(), nn.Module()
    holder.up._parameters["weight"] = read["up.weight"]
    holder.down._parameters["weight"] = read["down.weight"]
    holder.down._parameters["bias"] = read["down.bias"]
    assert node_gguf.qtypes(holder) == {"Q8_0": 1, "Q4_0": 1, "F32": 1}
    assert read["down.weight"].tensor_shape == (64, 256)


def test_bench_gguf_files():
    """bench_gguf's GGUF files (the bench's checkpoint as ComfyUI-GGUF
    models): weights that fill whole blocks quantized (Q8_0 by gguf's own
    quantizer, Q4_K as random blocks with finite scales), the rest F32;
    read back by the reader with their shapes, finite when dequantized."""
    gguf = import_gguf()
    if gguf is None:
        _runner.skip("the gguf package is not laid out "
                     "(bench/clients/prepare.py --gguf)")
    import numpy as np
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import bench_gguf
    g = torch.Generator().manual_seed(5)
    tensors = {"blocks.0.up.weight": torch.randn(64, 256, generator=g),
               "blocks.0.up.bias": torch.randn(64, generator=g),
               "img_in.weight": torch.randn(32, 48, generator=g).to(
                   torch.bfloat16)}
    with tempfile.TemporaryDirectory() as d:
        for q, block in (("Q8_0", 32), ("Q4_K", 256)):
            path = os.path.join(d, q + ".gguf")
            info = bench_gguf.write_gguf(tensors, path, q)
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
        e = raises(SystemExit, bench_gguf.write_gguf, tensors,
                   os.path.join(d, "x.gguf"), "IQ9")
        assert "--qtypes" in str(e), e
    # The node's lines picked from a child's log.
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write("2026 INFO vpager: Flux uses ComfyUI's own loading: "
                "ComfyUI-GGUF's GGUFModelPatcher loads it\n"
                "2026 INFO something else\n")
    try:
        assert bench_gguf.node_lines(f.name) == [
            "Flux uses ComfyUI's own loading: ComfyUI-GGUF's "
            "GGUFModelPatcher loads it"]
    finally:
        os.unlink(f.name)
    ours, rest = bench_gguf.split_args(
        ["--qtypes", "Q4_0", "--gguf-lora", "off", "--steps", "3"])
    assert ours["qtypes"] == "Q4_0" and ours["lora"] == "off"
    assert rest == ["--steps", "3"]


if __name__ == "__main__":
    import gc
    sys.exit(_runner.main(globals(), after_each=gc.collect))
