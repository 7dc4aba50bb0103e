#!/usr/bin/env python3
"""How much VBAR space (and so, for resident groups, VRAM) vpager.torch's
interleaved placement spends on padding, for the Llama-shaped decoder of
bench_torch.py (hidden 4096, FFN 14336, 8 kv heads of 128, vocab 32000,
bf16, module order), 32 MiB pages, a 512 MiB staging ring. No GPU and no
torch needed: placement only looks at sizes. Baseline: the same weights
placed without groups (the tail-first order), which pads only to 512 B.

    python3 bench/placement_padding.py [layers ...]     # default 16 32
"""

import os
import sys

import benchlib
from benchlib import MiB

sys.path.insert(0, os.path.join(benchlib.ROOT, "python"))

from vpager._torch_placement import _GROUPS, place  # noqa: E402

PAGE, RING, ALIGN = 32 * MiB, 512 * MiB, 512


class Entry:
    def __init__(self, size):
        self.size = size


def decoder(layers, h=4096, ffn=14336, kv=1024, vocab=32000, b=2):
    sizes = [vocab * h * b]
    for _ in range(layers):
        sizes += [h * b, h * h * b, kv * h * b, kv * h * b, h * h * b,
                  h * b, ffn * h * b, ffn * h * b, h * ffn * b]
    sizes += [h * b, vocab * h * b]
    return [Entry(n) for n in sizes]


def main():
    print(benchlib.host_line())
    print(benchlib.software_line(library=False))
    print("inputs: page %d MiB, staging ring %d MiB, align %d B, groups "
          "of 1/%d of the weights, none over half the ring"
          % (PAGE // MiB, RING // MiB, ALIGN, _GROUPS))
    for layers in [int(a) for a in sys.argv[1:]] or [16, 32]:
        entries = decoder(layers)
        total = sum(e.size for e in entries)
        size = max(4 * PAGE, min(total // _GROUPS, RING // 2))
        offsets, end = place(entries, ALIGN, (PAGE, size))
        _, flat = place(entries, ALIGN)
        groups = 1 + sum(1 for o in offsets[1:] if o % PAGE == 0)
        print("%2d layers, %d weights, %.3f GB: groups of >= %d MiB: %d "
              "groups, padding %.1f MiB (%.2f%% of the weights; %.1f MiB a "
              "group) | baseline no groups: padding %.1f MiB" % (
                  layers, len(entries), total / 1e9, size // MiB, groups,
                  (end - total) / MiB, 100 * (end - total) / total,
                  (end - total) / MiB / groups, (flat - total) / MiB))


if __name__ == "__main__":
    main()
