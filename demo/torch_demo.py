"""vpager.torch in one line: a model whose weights exceed the budget runs
unchanged, its weights paged in as each layer runs, with outputs bitwise
equal to the same model run with all its weights resident.

    make demo                     # after the C demo, when torch imports
    PYTHONPATH=python python3 demo/torch_demo.py

Uses the GPU when torch has CUDA, else vpager's simulated device (device
"cpu": CPU tensors over vpager's own memory, paged exactly like VRAM).
"""

import copy
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402

import vpager  # noqa: E402
import vpager.torch  # noqa: E402

MiB = 1 << 20


def residency_map(h):
    """One character a page: # resident, P pinned, . not."""
    return "".join("P" if f & vpager.PAGE_PINNED else
                   "#" if f & vpager.PAGE_RESIDENT else "."
                   for f in h.residency())


def main():
    # --- the example README.md shows ---------------------------------
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(1024, 1024) for _ in range(12)]).eval()  # 48 MiB
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: simulated
    reference = copy.deepcopy(model).to(device)        # all weights resident
    h = vpager.torch.offload(model, device=device, budget="24M",
                             page_size="2M", lookahead=0)  # 0: no prefetch
    x = torch.randn(8, 1024, device=device)
    with torch.no_grad():
        y = model(x)                    # weights stream in as layers run
        assert torch.equal(y, reference(x))            # bitwise
    # ------------------------------------------------------------------

    info = h.device.info()
    if device == "cuda":
        where = "GPU %s (%s)" % (torch.cuda.get_device_name(h.target),
                                 h.target)
    else:
        where = "the simulated device (no GPU: CPU tensors over vpager's " \
                "memory)"
    print("vpager.torch demo on %s" % where)
    print("model: 12 x Linear(1024, 1024), %.1f MiB of weights; vpager "
          "budget 24 MiB (%d MiB of it the staging ring), page %d MiB"
          % (h.weight_bytes / MiB, h.device.options["staging_size"] // MiB,
             info["page_size"] // MiB))
    print()
    print("forward  hits  fills  misses  resident  residency "
          "(# resident, . not, P pinned)")
    # The first forward ran above; four more, each compared bitwise.
    prev = dict.fromkeys(("hits", "fills", "misses"), 0)
    equal = True
    for i in range(1, 6):
        if i > 1:
            with torch.no_grad():
                y = model(x)
            equal &= torch.equal(y, reference(x))
        s = h.stats()
        d = {k: s[k] - prev[k] for k in prev}
        prev = {k: s[k] for k in prev}
        print("%7d  %4d  %5d  %6d  %5.1f MiB  [%s]"
              % (i, d["hits"], d["fills"], d["misses"],
                 s["resident_bytes"] / MiB, residency_map(h)))
    if device == "cuda":
        torch.cuda.synchronize()
    print()
    print("outputs bitwise equal to the all-resident model: %s"
          % ("yes" if equal else "NO"))
    print("counted per weight (a layer is a weight and a bias): hits were "
          "used in place,\nfills made resident (pages committed, then "
          "filled), misses streamed through the\nstaging ring: %d of the 12 "
          "layers stay resident" % (d["hits"] // 2))
    h.unload()
    with torch.no_grad():
        assert torch.equal(model.to(device)(x), reference(x))
    print("unload(): ordinary tensors again, same outputs")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
