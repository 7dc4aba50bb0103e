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
    print("forward  acquires  hits  fills  misses  resident  residency "
          "(# resident, . not, P pinned)")
    # The first forward ran above; four more, each compared bitwise.
    keys = ("acquires", "hits", "fills", "misses")
    prev = dict.fromkeys(keys, 0)
    equal = True
    extra = 0
    for i in range(1, 6):
        if i > 1:
            with torch.no_grad():
                y = model(x)
            equal &= torch.equal(y, reference(x))
        s = h.stats()["model"]
        d = {k: s[k] - prev[k] for k in keys}
        prev = {k: s[k] for k in keys}
        more = d["acquires"] - s["weights"]
        extra = extra or more
        print("%7d  %8s  %4d  %5d  %6d  %5.1f MiB  [%s]"
              % (i, "%d%s" % (s["weights"], "+%d" % more if more else ""),
                 d["hits"], d["fills"], d["misses"],
                 s["resident_bytes"] / MiB, h.residency()))
    if device == "cuda":
        torch.cuda.synchronize()
    print()
    print("outputs bitwise equal to the all-resident model: %s"
          % ("yes" if equal else "NO"))
    # Which weights stay resident: those whose pages all are.
    flags, page = h.page_flags(), info["page_size"]
    kept = [(name, size) for name, off, size, _ in h.layout()
            if all(flags[p] & vpager.PAGE_RESIDENT
                   for p in range(off // page, (off + size - 1) // page + 1))]
    mats = sum(name.endswith("weight") for name, _ in kept)
    print("counted per weight (each layer has two: a 4 MiB weight matrix and "
          "a 4 KiB bias),\nacquires = hits + fills + misses: hits were used "
          "in place, fills made resident\n(pages committed, then filled), "
          "misses streamed through the staging ring.")
    if extra:
        print("forward 1 acquires %d more: after it, the copy schedule "
              "fills the weights it\nkeeps resident." % extra)
    print("%d of the %d weights stay resident (%.1f MiB of pages):\n%d of "
          "the 12 weight matrices and %d of the 12 biases; the others "
          "stream every forward."
          % (len(kept), s["weights"], s["resident_bytes"] / MiB, mats,
             len(kept) - mats))
    h.unload()
    with torch.no_grad():
        assert torch.equal(model.to(device)(x), reference(x))
    print("unload(): ordinary tensors again, same outputs")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
