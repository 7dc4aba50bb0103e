"""The time between two root forwards, as the GPU sees it: what a
forward's own marks leave out.

A sampler's step is the model's forward and what runs around it: the
sampler's kernels, the host's work before the next forward (a callback,
a synchronize, the next step's inputs, the client's wrappers). The plan
models forwards back to back; in between the copy engine copies on only
as far as the staging ring has room, and the ring is full of the next
forward's first streamed weights. Flux 9.4 GiB at 6 GiB under the
ComfyUI node on the H100 (bench/RESULTS.md, forty-second session): the
copy engine idle 5 ms at each step's start, the step 97-98 ms against a
plan's 92.3-92.6. With VPAGER_BETWEEN=1 the tuner adds the gap to the
forward's last unit (the model is cyclic: what follows it comes before
the first unit). Off by default until measured on a GPU: with the gap
the plans may favour larger rings (more copies ahead across it), and on
the H100 Flux's 378 and 512 MiB rings ran 2-3% slower than 320.

Measured from a mark at one measured forward's end (after whatever the
tuner placed there) to a mark at the next root forward's start; read
once the GPU ran both. The gap used is the least of the last SAMPLES,
at most SHARE of the forward's work: a pause between prompts (a decode,
a load) is no step's."""

from typing import Any, Callable, List, Optional, Tuple

from .. import env

BETWEEN = "VPAGER_BETWEEN"

SAMPLES = 4         # the gaps read last, the least of them used
SHARE = 0.25        # of the forward's work, at most


class Between:
    """Gaps between root forwards. mark() takes a point in time on the
    current stream, seconds(a, b) the time between two, ran(m) whether
    the GPU is past m: the tuner's own (timing events on CUDA, the host
    clock on the simulated device)."""

    def __init__(self, mark: Callable[[], Any],
                 seconds: Callable[[Any, Any], float],
                 ran: Callable[[Any], bool]):
        self.mark, self.seconds, self.ran = mark, seconds, ran
        self.end: Optional[Tuple[Any, int]] = None  # (mark, its forward)
        self.pair: Optional[Tuple[Any, Any]] = None     # marked, not read
        self.samples: List[float] = []
        self.on = env.flag(BETWEEN, False)

    def ended(self, forward: int) -> None:
        """Measured forward number `forward` ended (its placement, if it
        made one, queued)."""
        if self.on:
            self.read()
            self.end = (self.mark(), forward)

    def began(self, forward: int) -> None:
        """Root forward number `forward` begins: a gap if the one before
        it ended marked."""
        if not self.on:
            return
        self.read()
        end, self.end = self.end, None
        if end is not None and self.pair is None and end[1] == forward - 1:
            self.pair = (end[0], self.mark())

    def read(self) -> None:
        """The gap marked last into samples, once the GPU ran it."""
        pair = self.pair
        if pair is not None and self.ran(pair[1]):
            self.pair = None
            self.samples.append(self.seconds(*pair))
            del self.samples[:-SAMPLES]

    def gap(self, work: float) -> float:
        """Seconds to add to a forward of `work` seconds (0: none read)."""
        if not self.samples:
            return 0.0
        return min(min(self.samples), SHARE * work)
