"""bench/bench_node.py's and bench/comfyui_run.py's workflows for issues 28
and 29 without a GPU or ComfyUI: --switch (two models in turn: the model
switch), --cgroup-gib (each sampling child in a memory cgroup,
bench/memcap.py) and the host-memory rows (RSS against the model files and
against ComfyUI's own path).

    python3 tests/python/test_bench_node.py

The cgroup tests make real cgroups (v2, else v1) and skip, saying why,
where this process may not.
"""

import contextlib
import os
import runpy
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402
from _runner import raises  # noqa: E402

REPO = _runner.REPO
sys.path.insert(0, os.path.join(REPO, "bench"))
import memcap  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def _bench():
    ns = runpy.run_path(os.path.join(REPO, "bench", "bench_node.py"),
                        run_name="bench_node")
    return ns, ns["harness"]()


@contextlib.contextmanager
def _said(fn):
    """The lines bench_node's say() prints while in the block (fn: a
    function of its module)."""
    g = fn.__globals__
    saved, lines = g["say"], []
    g["say"] = lambda *x: lines.append(" ".join(map(str, x)))
    try:
        yield lines
    finally:
        g["say"] = saved


class _Quiet:
    """argparse's error text off stderr while a bad option is tried."""

    def __enter__(self):
        self.err, sys.stderr = sys.stderr, open(os.devnull, "w")

    def __exit__(self, *exc):
        sys.stderr.close()
        sys.stderr = self.err


def test_switch_option():
    """--switch DxS: the second model's blocks; refused when malformed,
    equal to the first, for another --model or with --lora."""
    _, cr = _bench()
    a = cr.parse(["--comfyui", "x", "--switch", "19x38"])
    assert a.switch_shape == (19, 38)
    assert "two models in turn" in cr.inputs_line(a)
    assert cr.parse(["--comfyui", "x"]).switch_shape is None
    with _Quiet():
        for bad in (["--switch", "19"], ["--switch", "ax3"],
                    ["--switch", "0x0"], ["--switch", "8x16"],
                    ["--switch", "2x2", "--lora"],
                    ["--switch", "2x2", "--model", "sdxl"],
                    ["--cgroup-gib", "0"]):
            raises(SystemExit, cr.parse, ["--comfyui", "x"] + bad)
    # The second checkpoint travels to the sampling children.
    assert "--ckpt2" not in cr.common_args(a)
    a.ckpt2 = "/w/second.safetensors"
    args = cr.common_args(a)
    assert args[args.index("--ckpt2") + 1] == "/w/second.safetensors"
    a = cr.parse(["--comfyui", "x", "--cgroup-gib", "32"])
    assert a.cgroup_gib == 32.0 and "32 GiB memory cgroup" in \
        cr.inputs_line(a)


def test_the_reference_runs_outside_the_cgroup():
    """With --cgroup-gib the runs latents are compared against (resident,
    legacy) run outside the cgroup, the node's and ComfyUI's in it: in 32
    GiB ComfyUI's resident run of the 22 + 9.4 GiB models was killed, and
    the node's latents had nothing to be compared with."""
    ns, cr = _bench()
    seen = {}

    class _Cr:
        def run_child(self, a, kind, extra, log):
            seen[extra[extra.index("--tag") + 1]] = a.cgroup_gib

        def common_args(self, a):
            return []

        def child_env(self, a, more=()):
            return {}

        def spawn(self, cmd, env, log, timeout, run, cgroup):
            seen[run] = cgroup
    a = cr.parse(["--comfyui", "x", "--cgroup-gib", "32"])
    g = ns["run_set"].__globals__
    saved = g["compare"], g["say"]
    g["compare"], g["say"] = (lambda *args, **kw: 0), (lambda *args: None)
    try:
        ns["run_set"](_Cr(), a, {"timeout": 1}, ["resident", "node8", "8",
                                                 "legacy"],
                      tempfile.mkdtemp(), {"path": "ck", "bytes": 8 * GiB},
                      {"runs": {}})
    finally:
        g["compare"], g["say"] = saved
    assert seen == {"resident": None, "legacy": None, "node8": 32.0,
                    "8": 32.0}, seen
    assert a.cgroup_gib == 32.0         # the caller's left as it was


def test_first_prompts_over_comfyuis_runs_of_their_budget():
    """first_prompts: each node run's first prompt over the mean of its
    budget's ComfyUI runs (runs again named "6.2" count), and a name's
    repeats summed up."""
    ns, _ = _bench()

    class _Cr:
        @staticmethod
        def steady(steps):
            return steps[-1]

    def run(first_s, steps, last):
        return {"reps": [{"sample_s": first_s, "steps_ms": steps},
                         {"steps_ms": last}]}
    with _said(ns["first_prompts"]) as said:
        ns["first_prompts"](_Cr(), {
            "6": run(2.5, [1900, 120, 119], [1, 119]),
            "6.2": run(2.7, [1900, 120, 119], [1, 119]),
            "node6warm": run(2.4, [1900, 104, 99], [1, 96]),
            "node6warm.2": run(2.2, [1900, 100, 99], [1, 100]),
            "resident": run(2.2, [1900, 80, 80], [1, 80])})
    text = "\n".join(said)
    assert "node6warm: first prompt 2.400 s = 0.923 x ComfyUI's (2 runs)" \
        in text, text
    assert "worst step after the first 1.08 x steady" in text, text
    assert "node6warm, 2 runs: first prompt 2.300 s (2.200-2.400) = " \
        "0.885 x ComfyUI's; worst step 1.08, 1.00" in text, text
    assert "resident:" not in text, text


def test_a_late_node_run():
    """A run named node<budget>late (onestep): the node's child under that
    budget with VPAGER_PLACE_EARLY=0 (VPAGER_PLACE_STEPS=0): the first
    prompt placed after the first forward (a placement taken in one
    forward), beside the default in one run."""
    ns, _ = _bench()
    gen = {"bytes": 8 * GiB}
    assert ns["budget_of"]("node8late", gen) == ns["budget_of"]("node8", gen)
    assert ns["budget_of"]("node8late", gen) == ("8", 8 * GiB)
    seen = {}

    class _Cr:
        def common_args(self, a):
            return []

        def child_env(self, a, more=()):
            return {"X": "1"}

        def spawn(self, cmd, env, log, timeout, run, cgroup):
            seen[run] = (cmd, env)
            return {}

    class _A:
        cgroup_gib = None
    for run in ("node8", "node8late", "node8onestep", "node8steps",
                "node8warmsteps", "node8nowarm", "node8late.2"):
        ns["run_node_child"](_Cr(), _A(), run, "8", "ck", "log", 1)
    # The longest suffix a name ends with: nowarm, not warm.
    assert seen["node8nowarm"][1].get("VPAGER_COLD_WORK") == "0"
    assert ns["budget_of"]("node8nowarm", gen) == ("8", 8 * GiB)
    # A run again (".2") is the run of its name.
    assert seen["node8late.2"][1].get("VPAGER_PLACE_EARLY") == "0"
    assert ns["budget_of"]("node8late.2", gen) == ("8", 8 * GiB)
    assert ns["budget_of"]("resident.2", gen) == (None, None)
    # Suffixes combine: warm (VPAGER_COLD_WORK=1) and steps.
    assert seen["node8warmsteps"][1].get("VPAGER_COLD_WORK") == "1"
    assert seen["node8warmsteps"][1].get("VPAGER_PLACE_STEPS") == "1"
    assert ns["budget_of"]("node8warmsteps", gen) == ("8", 8 * GiB)
    assert seen["node8late"][1].get("VPAGER_PLACE_EARLY") == "0"
    assert seen["node8onestep"][1].get("VPAGER_PLACE_STEPS") == "0"
    assert seen["node8steps"][1].get("VPAGER_PLACE_STEPS") == "1"
    assert ns["budget_of"]("node8onestep", gen) == ("8", 8 * GiB)
    assert "VPAGER_PLACE_EARLY" not in seen["node8"][1]
    assert "VPAGER_PLACE_STEPS" not in seen["node8"][1]
    assert seen["node8late"][0][-4:] == ["--tag", "node8late", "--ckpt", "ck"]


def test_switch_prompts_alternate():
    """Two patchers: first0, second0, first1, second1 (--reps of each)."""
    _, cr = _bench()
    a = cr.parse(["--comfyui", "x", "--switch", "2x4", "--reps", "2"])
    got = cr.prompts(a, "A", None, {}, second="B")
    assert got == [("first0", "A"), ("second0", "B"), ("first1", "A"),
                   ("second1", "B")]
    assert [x for x, _ in cr.prompts(a, "A", None, {})] == ["rep0", "rep1"]


def test_switch_costs():
    """A prompt after one of the other model: its sample() time less its
    steps at its own steady step."""
    _, cr = _bench()
    a = cr.parse(["--comfyui", "x", "--switch", "2x4"])
    reps = [{"label": lb, "steps_ms": ms, "sample_s": s} for lb, ms, s in (
        ("first0", [900.0, 100.0, 100.0], 1.1),
        ("second0", [1500.0, 200.0, 200.0], 1.9),
        ("first1", [300.0, 100.0, 100.0], 0.5))]
    cs = cr.switch_costs(a, {"reps": reps})
    assert [(c["prompt"], c["after"]) for c in cs] == [
        ("second0", "first0"), ("first1", "second0")]
    assert abs(cs[0]["extra_s"] - (1.9 - 0.6)) < 1e-9
    assert abs(cs[1]["extra_s"] - (0.5 - 0.3)) < 1e-9
    assert cs[0]["first_ms"] == 1500.0
    # The same model twice in a row is no switch.
    same = [dict(reps[0]), dict(reps[0], label="first1")]
    assert cr.switch_costs(a, {"reps": same}) == []


def test_host_rows_and_versus():
    """Per run the largest RSS after a prompt against the model files, the
    cgroup's verdict, and each node run over ComfyUI's run of the same
    budget (RSS, model switch)."""
    ns, cr = _bench()
    with _said(ns["host_row"]) as lines:
        summary = {"checkpoint": {"file_bytes": 10 * GiB - 3 * MiB,
                                  "lora": {"a": {"bytes": MiB},
                                           "b": {"bytes": MiB}},
                                  "vae": {"file_bytes": MiB}},
                   "checkpoint2": {"file_bytes": 20 * GiB}}
        table = {}
        for run, rss in (("node12", 31 * GiB), ("12", 33 * GiB)):
            r = {"reps": [{"rss": rss - GiB, "rss_peak": rss + GiB},
                          {"rss": rss, "rss_peak": rss + GiB}]}
            if run == "node12":
                r["memcap"] = {"version": 2, "limit": 32 * GiB,
                               "peak": 31 * GiB, "oom_kills": 0}
            row = table[run] = {"switch": [
                {"prompt": "second0", "extra_s": 1.0 if run == "node12"
                 else 2.0}]}
            ns["host_row"](run, r, row, summary)
        assert table["node12"]["rss_max"] == 31 * GiB
        assert table["node12"]["model_files"] == 30 * GiB
        assert table["node12"]["memcap"]["oom_kills"] == 0
        assert any("RSS - files +1.00 GiB" in x and "OOM kills 0" in x
                   for x in lines), lines
        ns["versus"](table, "rss_max", "rss", 1.05,
                     lambda row: [row["rss_max"] / GiB])
        ns["versus"](table, "switch", "switch", 0.8,
                     lambda row: [c["extra_s"] for c in row["switch"]])
        assert any("node12 vs 12: rss 31.000 / 33.000 = 0.939" in x
                   for x in lines), lines
        assert any("switch 1.000 / 2.000 = 0.500 (target <= 0.80)" in x
                   for x in lines), lines
        # No RSS in a run's prompts: no host row.
        row = {}
        ns["host_row"]("node4", {"reps": [{}]}, row, summary)
        assert row == {}


def test_matrix_cells_count_their_checkpoint():
    """--fp8's and --quant's cells know the checkpoint the children load:
    their host rows measure RSS against its file (the H100's fp8 run
    printed "model files 0.00 GiB")."""
    ns, cr = _bench()
    cells = []
    g = ns["fp8_matrix"].__globals__
    saved = g["run_set"], g["say"]
    g["run_set"] = lambda *args, **kw: cells.append(args[6]) or 0
    g["say"] = lambda *x: None
    try:
        a = cr.parse(["--comfyui", "x"])
        gen = {"bytes": 2 * GiB, "file_bytes": 2 * GiB, "tensors": 1}
        ours = {"dtypes": "fp8_e5m2", "fp8_lora": "both",
                "fp8_budget": "1"}
        with tempfile.TemporaryDirectory() as out:
            assert ns["fp8_matrix"](cr, a, ours, out, gen, {}) == 0
    finally:
        g["run_set"], g["say"] = saved
    assert len(cells) == 2
    for cell in cells:
        assert ns["model_files"](cell) == 2 * GiB


def test_budget_use_row():
    """A node run's weights resident over budget - torch's peak - the
    ring (issue 29's whole budget); nothing for a run without vpager's
    counters (ComfyUI's own path)."""
    ns, _cr = _bench()
    with _said(ns["budget_row"]) as lines:
        reps = [{"torch_peak_reserved": GiB // 2},
                {"torch_peak_reserved": GiB,
                 "vpager": {"resident_bytes": 4 * GiB,
                            "schedule": {"staging": GiB // 2}}}]
        row = {}
        ns["budget_row"]("node6", reps, 6 * GiB, row)
        assert row["weights_room"] == 4.5 * GiB, row
        assert abs(row["budget_use"] - 4 / 4.5) < 1e-9, row
        assert any("node6: budget use: 4.00 GiB of weights resident of "
                   "4.50 GiB" in x and "= 0.889 (target >= 0.95)" in x
                   for x in lines), lines
        row = {}
        ns["budget_row"]("6", [{"torch_peak_reserved": GiB}], 6 * GiB, row)
        assert row == {}
        # A peak that leaves no room (a LoRA's fills): said, not "nan".
        del lines[:]
        ns["budget_row"]("node6", reps, GiB, row)
        assert row["weights_room"] < 0, row
        assert any("= not measured (no room left)" in x
                   for x in lines), lines


def test_prompts_row():
    """Issue 29's stable prompts: prompts 2..N's steady steps, the largest
    over the smallest (target 2%); the first prompt left out, nothing
    with fewer than two prompts after it."""
    ns, cr = _bench()
    with _said(ns["prompts_row"]) as lines:
        steps = lambda ms: {"steps_ms": [900.0] + [ms] * 5}  # noqa: E731
        row = {}
        ns["prompts_row"](cr, "node6", [steps(300.0), steps(100.0),
                                        steps(103.0), steps(101.0)], row)
        assert row["prompts_steady_ms"] == [100.0, 103.0, 101.0], row
        assert abs(row["prompts_apart"] - 0.03) < 1e-9, row
        assert any("node6: prompts 2..4 steady 100.0 103.0 101.0 ms: 3.0% "
                   "apart (target <= 2%)" in x for x in lines), lines
        row = {}
        ns["prompts_row"](cr, "6", [steps(300.0), steps(100.0)], row)
        assert row == {}


def test_l_row_from_legacy():
    """--lora runs no resident child: L's resident step is legacy's last
    prompt (the model resident, its LoRA removed), so a budget run's
    line against L is printed there too (issue 29's Flux 9.4 GiB at
    6 GiB against L); and the LoRA prompt's against legacy's with the
    LoRA baked in (issue 26's fp8 with a LoRA)."""
    import types
    ns, cr = _bench()
    a = types.SimpleNamespace(weight_dtype="default", vae=False, lora=True,
                              switch_shape=None)
    gen = {"bytes": 10 * GiB, "w_max": 126 << 20, "link_GBps": 55.0}

    def rep(label, step):
        return {"label": label, "steps_ms": [500.0, step, step, step],
                "latent_sha256": label * 8, "torch_peak_reserved": GiB}
    summary = {"runs": {
        "legacy": {"reps": [rep("base", 80.0), rep("removed", 81.0)]},
        "node6": {"reps": [rep("base", 103.0), rep("removed", 103.0)]}}}
    with _said(ns["compare"]) as lines:
        assert ns["compare"](cr, a, gen, summary) == 0
    row = [x for x in lines if x.startswith("node6: budget")]
    assert len(row) == 1 and "max(resident 81.0, link term" in row[0] \
        and "x L" in row[0], lines
    # With a LoRA: lora_b_again's step over legacy's (the LoRA baked in).
    summary["runs"]["legacy"]["reps"].insert(1, rep("lora_b_again", 82.0))
    summary["runs"]["node6"]["reps"].insert(1, rep("lora_b_again", 90.2))
    with _said(ns["compare"]) as lines:
        ns["compare"](cr, a, gen, summary)
    row = [x for x in lines if x.startswith("node6: with the LoRA")]
    assert len(row) == 1 and "max(legacy 82.0, link term" in row[0] \
        and "steady 90.2 ms (lora_b_again) = " in row[0], lines


def test_l_at_the_least_peak_of_a_budget():
    """A run whose torch peak is above another run's of the same budget
    (a loan of torch's cache made torch reserve more) is also judged
    against the L of the lesser peak; the run at that peak is not."""
    import types
    ns, cr = _bench()
    a = types.SimpleNamespace(weight_dtype="default", vae=False, lora=False,
                              switch_shape=None)
    gen = {"bytes": 10 * GiB, "w_max": 126 << 20, "link_GBps": 55.0}

    def run(step, peak):
        return {"reps": [{"label": "p", "steps_ms": [500.0, step, step],
                          "latent_sha256": "x", "torch_peak_reserved": peak}]}
    summary = {"runs": {"resident": run(80.0, GiB),
                        "node6": run(95.0, GiB),
                        "node6lend": run(92.0, GiB + 256 * MiB)}}
    with _said(ns["compare"]) as lines:
        ns["compare"](cr, a, gen, summary)
    least = [x for x in lines if "least torch peak" in x]
    assert len(least) == 1 and least[0].startswith("node6lend: ") \
        and "(1.00 GiB, another run's)" in least[0], lines
    lend = [x for x in lines if x.startswith("node6lend: budget")][0]
    l_own = float(lend.split(") = ")[1].split(" ms")[0])
    l_least = float(least[0].split("L = ")[1].split(" ms")[0])
    assert l_least < l_own, (l_least, l_own)


def test_l_beside_the_link_read_after_the_prompts():
    """A node run that read the link again after its prompts (link_after)
    gets the same limit at that link printed beside L, L itself
    unchanged; a run without it gets no such row."""
    import types
    ns, cr = _bench()
    a = types.SimpleNamespace(weight_dtype="default", vae=False, lora=False,
                              switch_shape=None)
    gen = {"bytes": 10 * GiB, "w_max": 126 << 20, "link_GBps": 55.0}

    def run(step, after=None):
        r = {"reps": [{"label": "p", "steps_ms": [500.0, step, step],
                       "latent_sha256": "x", "torch_peak_reserved": GiB}]}
        if after:
            r["link_after"] = [after, after - 1]
        return r
    summary = {"runs": {"resident": run(80.0, 55.0), "node6": run(95.0),
                        "node6.2": run(95.0, 50.0)}}
    with _said(ns["compare"]) as lines:
        ns["compare"](cr, a, gen, summary)
    after = [x for x in lines if "read after its prompts" in x]
    assert len(after) == 1 and after[0].startswith("node6.2: ") \
        and "50.0 GB/s (L's: 55.0)" in after[0], lines
    rows = {x.split(":")[0]: x for x in lines if ": budget" in x}
    assert rows["node6"].split("= ")[-1] == rows["node6.2"].split("= ")[-1]
    l_run = float(after[0].split("link term ")[1].split(" ms")[0])
    l_gen = float(rows["node6.2"].split("link term ")[1].split(")")[0])
    assert abs(l_run / l_gen - 55.0 / 50.0) < 1e-3, (l_run, l_gen)


def test_conds_on_device_hands_one_device_copy_per_tensor():
    """VPAGER_BENCH_CONDS_ON_DEVICE: ComfyUI's cond classes (a base and a
    subclass with its own process_cond) hand their tensor's copy on the
    device, made once per tensor; a tensor already there passes as is;
    patching twice wraps once."""
    import types
    _, cr = _bench()
    moved = []

    class Tensor:
        def __init__(self, device="cpu", ptr=1):
            self.device = types.SimpleNamespace(type=device)
            self.shape, self.dtype, self.ptr = (1, 4), "f32", ptr

        def data_ptr(self):
            return self.ptr

        def to(self, device):
            moved.append(self.ptr)
            return Tensor(device, self.ptr)

    class CONDRegular:
        def __init__(self, cond):
            self.cond = cond

        def _copy_with(self, cond):
            return type(self)(cond)

        def process_cond(self, batch_size, **kwargs):
            return self._copy_with(self.cond)

    class CONDCrossAttn(CONDRegular):
        def process_cond(self, batch_size, area=None, **kwargs):
            return self._copy_with(self.cond)

    class CONDConstant(CONDRegular):     # inherits process_cond
        pass

    conds = types.SimpleNamespace(CONDRegular=CONDRegular)
    cr.conds_on_device(conds, "cuda:0")
    cr.conds_on_device(conds, "cuda:0")
    a, b = CONDRegular(Tensor(ptr=1)), CONDCrossAttn(Tensor(ptr=2))
    for _ in range(3):
        assert a.process_cond(1).cond.device.type == "cuda:0"
        assert b.process_cond(1, area=None).cond.device.type == "cuda:0"
        assert CONDConstant(Tensor(ptr=3)).process_cond(1).cond.device.type \
            == "cuda:0"
    on = CONDRegular(Tensor("cuda", ptr=4))
    assert on.process_cond(1).cond is on.cond
    assert sorted(moved) == [1, 2, 3, 3, 3], moved  # 3: a new cond each time


def test_lend_alternate_is_an_ab_in_one_process():
    """VPAGER_BENCH_LEND_ALTERNATE ("ab"): no switch for the first prompt,
    then the device's loans off, on, on, off (the Lender's cache parked
    and given back, a loan still out taken back first); the prompts'
    steady steps by lending, and bench_node's row of them."""
    import types
    ns, cr = _bench()
    assert ns["_suffix_env"]("node6lend288ab") == {
        "VPAGER_LEND": "1", "VPAGER_LEND_CAP": "288M",
        "VPAGER_BENCH_LEND_ALTERNATE": "1"}
    assert ns["_suffix_env"]("node6lend288early96") == {
        "VPAGER_LEND": "1", "VPAGER_LEND_CAP": "288M",
        "VPAGER_LEND_EARLY": "96M"}

    assert ns["_suffix_env"]("node6lend288early288sm16ab") == {
        "VPAGER_LEND": "1", "VPAGER_LEND_CAP": "288M",
        "VPAGER_LEND_EARLY": "288M", "VPAGER_LEND_SM": "16",
        "VPAGER_BENCH_LEND_ALTERNATE": "1"}
    assert ns["_suffix_env"]("node6firstfit") == {
        "VPAGER_STAGING_WRAP": "0"}
    assert ns["_suffix_env"]("node6firstfitspin100") == {
        "VPAGER_STAGING_WRAP": "0", "VPAGER_BENCH_UNIT_SPIN": "100"}
    assert ns["_suffix_env"]("node6lend288early288condsab") == {
        "VPAGER_LEND": "1", "VPAGER_LEND_CAP": "288M",
        "VPAGER_LEND_EARLY": "288M", "VPAGER_BENCH_CONDS_ON_DEVICE": "1",
        "VPAGER_BENCH_LEND_ALTERNATE": "1"}

    class Lender:
        cache, taken = "torch's cache", 0

        def take_back(self):
            self.taken += 1

    ds = types.SimpleNamespace(lender=Lender())
    said, caches = [], []
    for rep in range(7):
        said.append(cr.lend_switch(rep, {"device": ds}))
        caches.append(ds.lender.cache)
    assert said == [None, "off", "on", "on", "off", "off", "on"], said
    assert caches == ["torch's cache", None, "torch's cache",
                      "torch's cache", None, None, "torch's cache"], caches
    assert ds.lender.taken == 2

    steps = lambda ms: [900.0] + [ms] * 5    # noqa: E731
    reps = [{"steps_ms": steps(300.0)},
            {"steps_ms": steps(100.0), "lending": "off"},
            {"steps_ms": steps(96.0), "lending": "on"},
            {"steps_ms": steps(98.0), "lending": "on"},
            {"steps_ms": steps(102.0), "lending": "off"}]
    with _said(ns["prompts_row"]) as lines:
        row = {}
        ns["prompts_row"](cr, "node6lend288ab", reps, row)
    assert abs(row["lend_ab_ratio"] - 97.0 / 101.0) < 1e-9, row
    assert any("node6lend288ab: lending off 100.0 102.0 ms, on 96.0 98.0 "
               "ms (one process, in turn): median on / off = 0.960" in x
               for x in lines), lines


def test_lend_trace_names_what_grew_torch_after_a_loan():
    """VPAGER_BENCH_LEND_TRACE's reading of torch's allocation history: the
    segments added after the last loan's borrows, with the frames outside
    torch that asked for them, and the allocations' peak since."""
    import io
    _, cr = _bench()

    def ev(action, size, name="forward", filename="/m/flux.py"):
        return {"action": action, "size": size, "stream": 0,
                "frames": [{"filename": "/x/torch/nn/module.py", "line": 1,
                            "name": "_call_impl"},
                           {"filename": filename, "line": 7, "name": name}]}

    def borrow(n):
        return ev("alloc", n, "borrow", "/v/vpager/torch/lend.py")
    trace = [borrow(64 * MiB),              # an earlier loan
             ev("segment_alloc", 8 * MiB, "old"),
             borrow(200 * MiB), borrow(100 * MiB),
             ev("alloc", 30 * MiB), ev("free_requested", 30 * MiB),
             ev("alloc", 50 * MiB, "attention"),
             ev("segment_alloc", 52 * MiB, "attention")]
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        cr._lend_growth({"device_traces": [trace]}, "reserved more")
        out = sys.stderr.getvalue()
    finally:
        sys.stderr = err
    assert "the loan: 209.7 104.9 MB" in out, out
    grown = [x for x in out.splitlines() if "segment +" in x]
    assert len(grown) == 1 and "+54.5 MB" in grown[0] \
        and "flux.py:7 attention" in grown[0] and "torch" not in \
        grown[0].split(": ", 1)[1], out
    assert "segments +54.5 MB, allocations' peak +52.4 MB" in out, out


def _cap_or_skip(limit):
    try:
        return memcap.open_cap(limit, "vp-test")
    except memcap.CapError as e:
        _runner.skip("no memory cgroup here: %s" % e)


def _child(code, cap):
    import subprocess
    return subprocess.run([sys.executable, "-c", code], preexec_fn=cap.enter,
                          capture_output=True, text=True, timeout=60)


def test_memcap_limits_a_child():
    """A child over the cap is OOM-killed and the report says so; one
    under it runs, its peak reported; the cgroup is removed after."""
    cap = _cap_or_skip(96 << 20)
    try:
        p = _child("b = bytearray(400 << 20); b[::4096] = b'x' * "
                   "len(b[::4096]); print('survived')", cap)
        rep = cap.report()
    finally:
        cap.close()
    assert p.returncode != 0 and "survived" not in p.stdout, p
    assert rep["oom_kills"] >= 1 and rep["limit"] == 96 << 20, rep
    assert not os.path.exists(cap.path)
    cap = _cap_or_skip(256 << 20)
    try:
        p = _child("b = bytearray(32 << 20); print('survived')", cap)
        rep = cap.report()
    finally:
        cap.close()
    assert p.returncode == 0 and "survived" in p.stdout, p
    assert rep["oom_kills"] == 0, rep
    assert rep["peak"] is None or rep["peak"] >= 32 << 20, rep


def test_memcap_refuses_a_bad_limit():
    for bad in (0, -1, 1.5, "32"):
        raises(memcap.CapError, memcap.open_cap, bad, "vp-test")


def test_spawn_in_a_cgroup():
    """comfyui_run.spawn(..., cap_gib): the child runs in the cgroup and
    its result carries the cgroup's report; a cgroup that cannot be made
    runs nothing and says why."""
    _, cr = _bench()
    cap = _cap_or_skip(64 << 20)        # may we make one at all?
    cap.close()
    g = cr.spawn.__globals__
    lines = []
    saved = g["say"]
    g["say"] = lambda *x: lines.append(" ".join(map(str, x)))
    try:
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "child.log")
            code = ("import json; print(%r + json.dumps({'ok': 1}))"
                    % cr.TAG)
            r = cr.spawn([sys.executable, "-c", code], dict(os.environ),
                         log, 60, "capped", 0.25)
            assert r is not None and r["ok"] == 1, lines
            assert r["memcap"]["limit"] == GiB // 4
            assert r["memcap"]["oom_kills"] == 0
            assert any("capped: in cgroup v" in x for x in lines), lines
            # Killed over the cap: no result, the kill said.
            code = "b = bytearray(600 << 20); b[::4096] = b'x' * " \
                "len(b[::4096])"
            r = cr.spawn([sys.executable, "-c", code], dict(os.environ),
                         log, 60, "over", 0.125)
            assert r is None
            assert any("over FAILED" in x and "'oom_kills': 1" in x
                       for x in lines), lines
    finally:
        g["say"] = saved


def test_gen_second_makes_the_second_checkpoint():
    """--switch: a gen child for the second shape, its own seed, no LoRA
    or VAE; a.ckpt2 its path."""
    _, cr = _bench()
    a = cr.parse(["--comfyui", "x", "--switch", "19x38", "--vae"])
    a.workdir = "/w"
    seen = []
    g = cr.gen_second.__globals__
    saved = (g["run_child"], g["say"])

    def run_child(b, kind, extra, log):
        seen.append((kind, b.double, b.single, b.seed, b.lora, b.vae,
                     b.ckpt2))
        return {"path": "/w/second.safetensors", "bytes": 22 * GiB,
                "tensors": 9, "make_s": 1.0}
    try:
        g["run_child"], g["say"] = run_child, lambda *x: None
        gen2 = cr.gen_second(a, "/out")
    finally:
        g["run_child"], g["say"] = saved
    assert gen2["bytes"] == 22 * GiB
    assert seen == [("gen", 19, 38, a.seed + 1000, False, False, None)]
    assert a.ckpt2 == "/w/second.safetensors"
    assert (a.double, a.single, a.vae) == (8, 16, True)   # a unchanged
    b = cr.parse(["--comfyui", "x"])
    assert cr.gen_second(b, "/out") is None


def test_device_phases_refuses_what_it_cannot_run():
    """bench/device_phases.sh (the GPU runs behind RESULTS.md) parses, and
    refuses an unknown phase, or a phase comparing trees without BEFORE,
    naming it, before it builds or runs anything."""
    import subprocess
    script = os.path.join(REPO, "bench", "device_phases.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    env = dict(os.environ, BEFORE="")
    for phases, says in (("nope", "unknown phase 'nope'"),
                         ("suites+lora_ab", "phase 'lora_ab' needs BEFORE"),
                         ("flux22_ab", "phase 'flux22_ab' needs BEFORE"),
                         ("switch_ab", "phase 'switch_ab' needs BEFORE")):
        with tempfile.TemporaryDirectory() as out:
            env["OUT"] = out
            p = subprocess.run(["bash", script, phases, "10"], env=env,
                               capture_output=True, text=True)
            assert p.returncode == 2, (p.returncode, p.stderr)
            assert says in p.stderr, p.stderr
            assert os.listdir(out) == [], os.listdir(out)


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
