"""A schedule made again for the device's new room that the device cannot
take (torch grew into the room between the plan and its placement: the
node's LoRA patches did, on the H200) keeps the forwards running on the
ring they had, with one warning; it never fails every later forward.
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
from test_torch import _scheduled_mlp, no_pins  # noqa: E402


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


if __name__ == "__main__":
    sys.exit(_runner.main(globals()))
