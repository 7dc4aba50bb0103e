#!/usr/bin/env python3
"""Per-op cost of the ComfyUI node's QuantizedTensor path against ComfyUI's
own resident op, the same ops (issue 26: scaled fp8 slower under the node).

A chain of ComfyUI 0.33 mixed-precision Linear ops (comfy.ops
mixed_precision_ops) loaded from scaled-fp8 state dicts as ComfyUI's loader
loads them (float8_e4m3fn payload, float32 per-tensor weight_scale,
comfy_quant {"format": "float8_e4m3fn"}: comfy_kitchen QuantizedTensor
weights, fp8 matmul), Flux's widths (3072 <-> 12288), run four ways:

    resident  ComfyUI's op, its weight on the GPU (the reference)
    split     the same, the node's quantized.Split installed over GPU
              parts, no vpager: what the wrapper alone adds
    rebuild   as split, the wrapper rebuilt by the parts' addresses at
              each forward (the node before 8498042)
    node      the node's path: the ops on the host, Split installed,
              vpager.torch.offload(tensors=the parts and biases,
              outside="host", schedule=True) as engine.Pager calls it,
              everything resident (--budget-half: half the weights)

Interleaved rounds (the VM's noise hits every way alike), medians:
  host us/op   16 tokens a forward: the GPU idles, the host's time is it
  device ms    --tokens (4096) a forward: CUDA events around --forwards
  enqueue ms   the host's time to queue those forwards (close to device
               ms: the host is the bound)
  sync         the host's time to queue one forward behind a 100 ms GPU
               sleep: >= 100 ms means something in the forward waited
               for the device (a synchronizing copy, .item(), a sync)
  gc2 n/ms     Python's oldest-generation collections during the way's
               timing, and their time
and the node's vpager counters during the timing (resident: no copies),
then the CUDA kernels of one forward per way (torch.profiler: names and
counts, the node's extra ones listed) and the outputs compared bitwise.

    python3 bench/bench_quant_ops.py --comfyui build-clients/ComfyUI
    ... --pairs 16 --tokens 4096 --rounds 5 [--budget-half]

Prints one TAG + JSON line with everything at the end. Exit 0; 2 when an
output differs from the resident one's.
"""

import argparse
import collections
import gc
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TAG = "QUANT_OPS "
HIDDEN, MLP = 3072, 12288


def say(*a):
    print(*a, flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", required=True, help="ComfyUI's folder")
    p.add_argument("--deps", default=None,
                   help="its Python deps (default: pydeps beside it)")
    p.add_argument("--pairs", type=int, default=16,
                   help="up/down Linear pairs (2 ops each)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--forwards", type=int, default=5,
                   help="forwards per timing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-half", action="store_true",
                   help="the node under half the weights (streams)")
    p.add_argument("--no-profile", action="store_true")
    a = p.parse_args(argv)
    if a.deps is None:
        a.deps = os.path.join(os.path.dirname(os.path.abspath(a.comfyui)),
                              "pydeps")
    return a


def setup(a):
    """sys.path as bench/comfyui_run.py's children have it, plus the
    node's package (not installed into ComfyUI: no patcher is used)."""
    os.environ.setdefault("VPAGER_COMFYUI_NO_AUTOINSTALL", "1")
    sys.argv = sys.argv[:1]         # ComfyUI's args: its defaults
    sys.path[:0] = [os.path.join(ROOT, "python"),
                    os.path.join(ROOT, "python", "compat"),
                    os.path.abspath(a.deps), os.path.abspath(a.comfyui),
                    os.path.join(ROOT, "integrations")]


def state_dicts(torch, pairs, seed=0):
    """[(up sd, down sd)]: scaled-fp8 Linear state dicts as ComfyUI's
    loader reads them after convert_old_quants (bench/comfyui_run.py's
    scaled_fp8 quantization)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    conf = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"})
                             .encode()), dtype=torch.uint8)

    def one(o, i):
        w = torch.randn(o, i, generator=g, device="cuda") * 0.01
        scale = (w.abs().amax() / fmax).clamp(min=1e-12)
        return {"weight": (w / scale).clamp(-fmax, fmax).to(fp8).cpu(),
                "weight_scale": scale.reshape(()).cpu(),
                "comfy_quant": conf.clone(),
                "bias": (torch.randn(o, generator=g, device="cuda") * 0.01
                         ).to(torch.bfloat16).cpu()}
    return [(one(MLP, HIDDEN), one(HIDDEN, MLP)) for _ in range(pairs)]


def make_model(torch, ops, sds, device):
    nn = torch.nn

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.ModuleList()
            self.down = nn.ModuleList()
            for up, down in sds:
                for lst, sd, (o, i) in ((self.up, up, (MLP, HIDDEN)),
                                        (self.down, down, (HIDDEN, MLP))):
                    op = ops.Linear(i, o, bias=True, device=device)
                    op.load_state_dict(dict(sd), strict=False)
                    lst.append(op)

        def forward(self, x):
            for up, down in zip(self.up, self.down):
                x = x + down(nn.functional.gelu(up(x), approximate="tanh"))
            return x
    m = Chain()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def install_splits(m, quantized, rebuild=False):
    splits = []
    for name, op in m.named_modules():
        w = op._parameters.get("weight")
        if w is not None and quantized.is_quantized(w):
            s = quantized.Split(name + ".weight", op, "weight", w)
            if rebuild:                 # the wrapper by addresses, always
                s.current = s.rebuild
            s.install()
            splits.append(s)
    return splits


def main(argv=None):
    a = parse(argv)
    setup(a)
    import torch
    import comfy.ops
    import comfy.quant_ops      # noqa: F401  (its layouts registered)
    import vpager.torch
    from vpager.torch import counters
    from comfyui import quantized
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ops = comfy.ops.mixed_precision_ops({}, torch.bfloat16)
    sds = state_dicts(torch, a.pairs)
    nops = 2 * a.pairs
    ways = collections.OrderedDict()
    ways["resident"] = make_model(torch, ops, sds, "cuda")
    ways["split"] = make_model(torch, ops, sds, "cuda")
    install_splits(ways["split"], quantized)
    ways["rebuild"] = make_model(torch, ops, sds, "cuda")
    install_splits(ways["rebuild"], quantized, rebuild=True)
    node = make_model(torch, ops, sds, None)
    splits = install_splits(node, quantized)
    parts = {n for s in splits for n in s.names}
    wbytes = sum(s.size for s in splits) + sum(
        op.bias.numel() * 2 for op in node.modules()
        if getattr(op, "bias", None) is not None)
    budget = (wbytes // 2 if a.budget_half else 2 * wbytes) + (512 << 20)
    h = vpager.torch.offload(
        node, device="cuda", budget=budget, outside="host",
        schedule=True, tensors=lambda name, t: name in parts
        or name.endswith(".bias"))
    ways["node"] = node
    res = {"pairs": a.pairs, "tokens": a.tokens, "ops": nops,
           "weight_bytes": wbytes, "budget": budget,
           "device": torch.cuda.get_device_name(),
           "torch": torch.__version__}
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, a.tokens, HIDDEN, generator=g, device="cuda",
                    dtype=torch.bfloat16)
    xs = x[:, :16].contiguous()
    outs = {}
    with torch.no_grad():
        for name, m in ways.items():        # warm: the node's schedule
            for _ in range(8 if name == "node" else 2):
                outs[name] = m(x)
        torch.cuda.synchronize()
        res["schedule"] = {k: v for k, v in (h.schedule() or {}).items()
                           if isinstance(v, (int, float, str))}
        before = h.stats()
        gcs = collections.defaultdict(lambda: [0, 0.0])  # way -> [n, s]
        gc_way = [None, 0.0]

        def gc_seen(phase, info):
            # Python's collections of the oldest generation during each
            # way's timing: a way whose objects make them more frequent
            # or longer pays it per step.
            if info.get("generation") != 2 or gc_way[0] is None:
                return
            if phase == "start":
                gc_way[1] = time.perf_counter()
            else:
                gcs[gc_way[0]][0] += 1
                gcs[gc_way[0]][1] += time.perf_counter() - gc_way[1]
        gc.callbacks.append(gc_seen)
        host = collections.defaultdict(list)
        dev = collections.defaultdict(list)
        enq = collections.defaultdict(list)
        sync = collections.defaultdict(list)
        names = list(ways)
        for r in range(a.rounds):
            # (each round starts with another way: no way always first)
            for name in names[r % len(names):] + names[:r % len(names)]:
                m = ways[name]
                gc_way[0] = name
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(a.forwards * 4):
                    m(xs)
                torch.cuda.synchronize()
                host[name].append((time.perf_counter() - t0) * 1e6
                                  / (a.forwards * 4 * nops))
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                e0.record()
                for _ in range(a.forwards):
                    m(x)
                e1.record()
                enq[name].append((time.perf_counter() - t0) * 1e3
                                 / a.forwards)
                torch.cuda.synchronize()
                dev[name].append(e0.elapsed_time(e1) / a.forwards)
                # The sleep's length in cycles: ~100 ms at the H200's clock.
                torch.cuda._sleep(int(1.98e8))
                t0 = time.perf_counter()
                m(xs)
                sync[name].append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
        gc_way[0] = None
        gc.callbacks.remove(gc_seen)
        after = h.stats()
        # What vpager did for the node during the timing (resident: no
        # copies, no faults; --budget-half: the streamed bytes).
        res["node_counters"] = {sec: counters.delta(after, before, sec)
                                for sec in ("model", "device")}
        say("node's counters during the timing: %s"
            % json.dumps(res["node_counters"]))
        table = {}
        say("%-9s %12s %12s %12s %12s %10s" % (
            "way", "host us/op", "device ms", "enqueue ms", "sync ms",
            "gc2 n/ms"))
        for name in ways:
            row = {"host_us_per_op": statistics.median(host[name]),
                   "device_ms": statistics.median(dev[name]),
                   "enqueue_ms": statistics.median(enq[name]),
                   "sync_probe_ms": statistics.median(sync[name]),
                   "gc2_collections": gcs[name][0],
                   "gc2_ms": gcs[name][1] * 1e3}
            table[name] = row
            say("%-9s %12.1f %12.2f %12.2f %12.1f %4d/%-5.1f" % (
                name, row["host_us_per_op"], row["device_ms"],
                row["enqueue_ms"], row["sync_probe_ms"],
                row["gc2_collections"], row["gc2_ms"]))
        ref = table["resident"]
        for name in ways:
            if name != "resident":
                say("%-9s host +%.1f us/op, device %+.2f ms/forward (%+.1f "
                    "us/op)" % (name, table[name]["host_us_per_op"]
                                - ref["host_us_per_op"],
                                table[name]["device_ms"] - ref["device_ms"],
                                (table[name]["device_ms"] - ref["device_ms"])
                                * 1e3 / nops))
        res["ways"] = table
        equal = {name: bool(torch.equal(outs[name], outs["resident"]))
                 for name in ways}
        res["bitwise_equal"] = equal
        say("outputs bitwise equal to resident: %s" % equal)
        if not a.no_profile:
            res["kernels"] = kernels(torch, ways, xs)
    say(TAG + json.dumps(res))
    h.close()
    return 0 if all(equal.values()) else 2


def kernels(torch, ways, xs):
    """{way: {kernel name: count}} of one forward, and the differences
    from the resident forward's."""
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for name, m in ways.items():
        m(xs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m(xs)
            torch.cuda.synchronize()
        c = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                c[e.name[:90]] += 1
        out[name] = dict(c)
    ref = collections.Counter(out["resident"])
    say("kernels per forward: " + ", ".join(
        "%s %d" % (n, sum(c.values())) for n, c in out.items()))
    for name in out:
        if name == "resident":
            continue
        diff = collections.Counter(out[name])
        diff.subtract(ref)
        extra = {k: v for k, v in diff.items() if v}
        say("  %s vs resident: %s" % (name, extra or "the same kernels"))
        out[name + "_vs_resident"] = extra
    return out


if __name__ == "__main__":
    sys.exit(main())
