"""A schedule made again for the device's new room that the device cannot
take (torch grew into the room between the plan and its placement: the
node's LoRA patches did, on the H200) keeps the forwards running on the
ring they had, with one warning; it never fails every later forward.
Weights given a fill (a LoRA patch computed on the device) are planned
again at once, resident.
    make && PYTHONPATH=python python3 tests/python/test_replan.py
"""
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _runner  # noqa: E402

_runner.add_paths("python")

torch = _runner.require_torch(__name__)

from vpager.errors import OutOfMemory  # noqa: E402
from vpager.torch import tuner  # noqa: E402
from test_torch import (  # noqa: E402
    _scheduled_mlp, _scheduled_offload, frozen_copy, mlp, no_pins)


def test_replan_failure_keeps_the_ring():
    m, x, want, h = _scheduled_mlp()
    old_every, old_warm = tuner.WATCH_EVERY, tuner.Tuner.warm
    tuner.WATCH_EVERY = 0.0
    try:
        for _ in range(3):
            assert torch.equal(m(x), want)
        ring = h.device.options["staging_size"]

        def warm(self, *a, **kw):
            # What the device said on the H200: the new ring did not fit.
            self.layout.device.set_staging_size(512 << 20)
            raise OutOfMemory(-1, "vp_acquire", "no device memory for the "
                              "512 MiB staging ring (test)")
        tuner.Tuner.warm = warm
        h.device.set_limit(600 << 10)       # the room moved: a replan
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                assert torch.equal(m(x), want)
        said = [str(w.message) for w in seen
                if "schedule was not made again" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in seen]
        assert "OutOfMemory" in said[0], said
        assert h.device.options["staging_size"] == ring, (
            h.device.options["staging_size"], ring)
    finally:
        tuner.WATCH_EVERY, tuner.Tuner.warm = old_every, old_warm
    assert torch.equal(m(x), want)
    assert no_pins(h)
    h.unload()


def _planned(h):
    """{weight name: resident in the schedule applied}."""
    t = h.tuner
    flat = t._costs({})[3]
    return {e.name: r for e, r in zip(flat, t.schedule.resident)}


def test_a_weight_given_a_fill_is_planned_resident():
    """A weight the schedule streams is given a fill (the node's LoRA
    patch, computed on the device at every fill: on the H200 +28% a
    step): the next forward's start plans again keeping it resident, so
    its fill runs once, not every forward; outputs stay those of the
    patched model. Rid of the fill, the plan is made again without it."""
    m = mlp(depth=8)
    x = torch.randn(8, 64)
    ref = frozen_copy(m)
    want = ref(x)
    h = _scheduled_offload(m)
    for _ in range(5):
        assert torch.equal(m(x), want)
    t = h.tuner
    assert t.done and t.schedule is not None
    planned = _planned(h)
    streamed = [n for n, r in planned.items() if not r]
    assert streamed, planned
    name = streamed[0]
    h.set_fill(name, lambda v: v.mul_(2))
    patched = frozen_copy(ref)
    patched.get_parameter(name).data.mul_(2)
    want2 = patched(x)
    replans = t.replans
    assert torch.equal(m(x), want2)
    assert t.replans == replans + 1 and _planned(h)[name], _planned(h)
    fills = h.hot_path.fills
    for _ in range(3):
        assert torch.equal(m(x), want2)
    assert h.hot_path.fills == fills, (h.hot_path.fills, fills)
    # The same fill set again: no new plan.
    h.set_fill(name, lambda v: v.mul_(2))
    assert torch.equal(m(x), want2) and t.replans == replans + 1
    h.set_fill(name, None)
    assert torch.equal(m(x), want) and t.replans == replans + 2
    for _ in range(2):
        assert torch.equal(m(x), want)
    assert no_pins(h)
    h.unload()


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
