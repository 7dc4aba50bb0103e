#!/usr/bin/env python3
"""Lay out the test clients bench/comfyui_run.py and the ComfyUI node's
bench run against, from git mirrors of their public repositories, into a
git-ignored folder (default build-clients/; nothing of them enters the
tree):

  build-clients/ComfyUI      ComfyUI's tree (yzkee/ComfyUI is 0.33.0),
                             without tests, blueprints, CI files and
                             tokenizer data
  build-clients/pydeps       comfy_kitchen (Comfy-Org/comfy-kitchen),
                             torchsde (google-research/torchsde), with
                             their licenses, and bench/clients/trampoline.py
                             (our own; torchsde imports the name)
  build-clients/pydeps/gguf  with --gguf: the `gguf` reader and writer
                             (gguf-py/gguf of ggml-org/llama.cpp, pure
                             Python over numpy; ComfyUI-GGUF imports it),
                             with its license as LICENSE.gguf
  build-clients/ComfyUI-GGUF with --comfyui-gguf: city96/ComfyUI-GGUF, the
                             custom node whose GGUF models
                             bench/bench_gguf.py loads

    python3 bench/clients/prepare.py --comfyui MIRROR.git \\
        --kitchen MIRROR.git --torchsde MIRROR.git [--out build-clients]
    python3 bench/clients/prepare.py --gguf MIRROR.git \\
        [--comfyui-gguf MIRROR.git] [--out build-clients]

Each group rewrites only its own folders.

Files are written blob by blob, so a mirror whose largest blobs are
absent (as some snapshots are) still gives a usable tree: the absent ones
are listed. The device has ComfyUI's other library-mode dependencies;
carry build-clients/ComfyUI and build-clients/pydeps with the run
(bench/clients/README.md)."""

import argparse
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DROP = ("tests/", "tests-unit/", "blueprints/", ".github/", ".ci/",
        "openapi.yaml")
BIG = 4 << 20               # blobs larger than this are left out, and in
TOKENIZERS = "_tokenizer/"  # tokenizers' folders (their vocabularies: a
TOKEN_BIG = 512 << 10       # diffusion model needs none) above this


def git(gitdir, *args):
    return subprocess.run(["git", "--git-dir", gitdir] + list(args),
                          check=True, stdout=subprocess.PIPE).stdout


def extract(gitdir, rev, prefix, out, drop=()):
    """The files of `rev` under `prefix` into out; the ones left out."""
    missing = []
    for line in git(gitdir, "ls-tree", "-r", "-l", rev, "--",
                    prefix or ".").decode().splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, sha, size = meta.split()
        rel = path[len(prefix):] if prefix else path
        if kind != "blob" or mode == "120000" or rel.startswith(drop):
            continue
        if not size.isdigit():          # the mirror lacks the blob
            missing.append(path)
            continue
        if int(size) > (TOKEN_BIG if drop and TOKENIZERS in rel else BIG):
            continue
        try:
            data = git(gitdir, "cat-file", "blob", sha)
        except subprocess.CalledProcessError:
            missing.append(path)
            continue
        dst = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
    return missing


def comfyui(a, comfy, deps):
    """ComfyUI, comfy_kitchen and torchsde; the blobs absent."""
    shutil.rmtree(comfy, ignore_errors=True)
    missing = extract(a.comfyui, a.rev, "", comfy, DROP)
    for gitdir, pkg, lic in ((a.kitchen, "comfy_kitchen", "comfy-kitchen"),
                             (a.torchsde, "torchsde", "torchsde")):
        shutil.rmtree(os.path.join(deps, pkg), ignore_errors=True)
        missing += extract(gitdir, "HEAD", pkg + "/",
                           os.path.join(deps, pkg))
        with open(os.path.join(deps, "LICENSE." + lic), "wb") as f:
            f.write(git(gitdir, "show", "HEAD:LICENSE"))
    shutil.copy(os.path.join(HERE, "trampoline.py"), deps)
    return missing


def gguf(gitdir, deps, rev="HEAD"):
    """gguf-py's package at `rev` (without its scripts); the blobs
    absent."""
    out = os.path.join(deps, "gguf")
    shutil.rmtree(out, ignore_errors=True)
    missing = extract(gitdir, rev, "gguf-py/gguf/", out, ("scripts/",))
    with open(os.path.join(deps, "LICENSE.gguf"), "wb") as f:
        f.write(git(gitdir, "show", rev + ":gguf-py/LICENSE"))
    return missing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfyui", help="ComfyUI git dir")
    ap.add_argument("--kitchen", help="comfy-kitchen git dir")
    ap.add_argument("--torchsde", help="torchsde git dir")
    ap.add_argument("--gguf", help="llama.cpp git dir (its gguf-py)")
    ap.add_argument("--gguf-rev", default="HEAD",
                    help="the --gguf repository's revision")
    ap.add_argument("--comfyui-gguf", help="ComfyUI-GGUF git dir")
    ap.add_argument("--rev", default="HEAD", help="ComfyUI revision")
    ap.add_argument("--out", default=os.path.join(ROOT, "build-clients"))
    a = ap.parse_args()
    group = (a.comfyui, a.kitchen, a.torchsde)
    if any(group) and not all(group):
        ap.error("--comfyui, --kitchen and --torchsde go together")
    if not any(group) and not a.gguf and not a.comfyui_gguf:
        ap.error("nothing to lay out: give --comfyui/--kitchen/--torchsde, "
                 "--gguf, --comfyui-gguf")
    comfy, deps = os.path.join(a.out, "ComfyUI"), os.path.join(a.out,
                                                               "pydeps")
    missing, wrote = [], []
    if all(group):
        missing += comfyui(a, comfy, deps)
        wrote += [comfy, deps]
    if a.gguf:
        missing += gguf(a.gguf, deps, a.gguf_rev)
        wrote.append(os.path.join(deps, "gguf"))
    if a.comfyui_gguf:
        node = os.path.join(a.out, "ComfyUI-GGUF")
        shutil.rmtree(node, ignore_errors=True)
        missing += extract(a.comfyui_gguf, "HEAD", "", node)
        wrote.append(node)
    for m in missing:
        print("absent in the mirror: %s" % m, file=sys.stderr)
    print("wrote %s" % ", ".join(wrote))


if __name__ == "__main__":
    main()
