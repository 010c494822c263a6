"""`specdec draft-data`: write a self-distilled corpus (see `specdec.draft.data`).

draft/ does not import the engine; this module builds it (`specdec.wrap`, speculative and lossless) and passes
it to `specdec.draft.data.write_corpus`.
"""

from __future__ import annotations

import argparse
import json
import time

from .draft_train import load_target

NAME = "draft-data"
HELP = "write a self-distilled corpus for draft-train"
DESCRIPTION = ("A self-distilled training corpus: the target's own continuations of prompts drawn from the "
               "training text, written as JSON lines (a rerun appends the prompts not yet written).")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    import torch

    from specdec.draft import data as _data
    from specdec.draft.base import NoDraft
    try:
        temps = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        p.error(f"argument --temperatures: expected comma-separated numbers, got {args.temperatures!r}")
    tok, target = load_target(p, args)
    import specdec
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        p.error(f"argument --text: {e}")
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    t0 = time.time()
    try:
        prompts = _data.draw_prompts(ids, args.num_prompts, args.prompt_len, seed=args.seed)
        drafter = NoDraft() if args.drafter == "none" else args.drafter
        engine = specdec.wrap(target, drafter=drafter, max_batch_size=args.batch_size,
                              max_length=args.prompt_len + args.new_tokens + 1)
        n = _data.write_corpus(engine, prompts, args.out, new_tokens=args.new_tokens, temperatures=temps,
                               batch_size=args.batch_size, seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps({"out": args.out, "written": n, "records": len(_data.done_ids(args.out)),
                      "seconds": round(time.time() - t0, 1)}))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory (save_pretrained, with tokenizer)")
    p.add_argument("--text", required=True, help="the training text the prompts are drawn from (a text file)")
    p.add_argument("--out", required=True, help="corpus file (JSON lines; appended to, done prompts skipped)")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=224)
    p.add_argument("--temperatures", default="0,0.8", help="comma-separated; prompt i uses entry i mod count")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--drafter", default="ngram",
                   help="the drafter that speeds generation up (any wrap drafter), or 'none': plain decoding, the "
                        "faster choice at large batches on a CPU, where a verify is compute-bound")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
