"""`python -m specdec native-export`: write a fine-tuned native drafter back into a checkpoint's MTP tensors
(`specdec.draft.native_export.write_mtp`), so the checkpoint's own `drafter="native"` is the fine-tuned one."""

from __future__ import annotations

import argparse
import json
import os
import shutil

NAME = "native-export"
HELP = "write a native drafter into a checkpoint's MTP tensors"
DESCRIPTION = ("Write a native drafter fine-tuned with `python -m specdec draft-train --drafter native` into a "
               "checkpoint's MTP tensors (a copy at --out, or the target itself), under the checkpoint's own "
               "names: its `drafter=\"native\"` is then the fine-tuned one.")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.draft.native import Net
    from specdec.draft.native_export import write_mtp
    from specdec.draft.registry import load_drafter
    try:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    except (OSError, ValueError) as e:
        p.error(f"argument --target: cannot load {args.target!r} ({e})")
    try:
        net = load_drafter(args.drafter, target)
    except ValueError as e:
        p.error(f"argument --drafter: {e}")
    if not isinstance(net, Net):
        p.error(f"argument --drafter: {args.drafter!r} holds a {net.config.kind} drafter, not native")
    dest = args.target
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        for name in os.listdir(args.target):
            if os.path.isfile(os.path.join(args.target, name)):
                shutil.copy2(os.path.join(args.target, name), os.path.join(args.out, name))
        dest = args.out
    try:
        files = write_mtp(net, target, dest)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps({"written": files}))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="checkpoint directory whose MTP tensors are replaced")
    p.add_argument("--drafter", required=True, help="a trained native drafter directory")
    p.add_argument("--out", default=None, help="write a copy of --target here instead of replacing in place")
