"""`specdec draft-train`: distil a drafter from a target (see `specdec.draft.train`).

The training loop lives in draft/, which does not import the runner; this module passes it specdec's own
`make_runner`, for the command line and for callers that train in-process (`train`).
"""

from __future__ import annotations

import argparse
import json
import time

NAME = "draft-train"
HELP = "distil an eagle, mtp, dspark or native drafter"
DESCRIPTION = ("Distil a drafter from a target's own outputs on a text corpus; --out keeps the checkpoint with "
               "the best validation tau.")

# `specdec.draft.registry.KINDS` (importing it loads torch, which `specdec --help` does without);
# tests/test_cli.py checks that the two agree
DRAFTER_KINDS = ("dspark", "eagle", "mtp", "native")


def train(target, ids, kind: str, **options):
    """`specdec.draft.train.train` (same arguments: `ids [N]` token stream) over specdec's own runner."""
    from specdec.draft import train as _train
    from specdec.runner import make_runner
    return _train.train(target, ids, kind, runner_factory=make_runner, **options)


def _reconfigured(net, target, overrides: dict, p):
    """`net` rebuilt with config fields `overrides` and its own weights: the same weights when they still fit,
    grown (`grown_state_dict`: more blocks, wider MLPs, the same function to start from) when the fields ask for
    more; an argument error otherwise."""
    import dataclasses

    from specdec.draft.registry import grown_state_dict, kind_module, own_state_dict, to_target
    mod = kind_module(net.config.kind)
    try:
        cfg = dataclasses.replace(net.config, **overrides)
        new = to_target(mod.Net.from_target(target, cfg), target)
        new.load_state_dict(grown_state_dict(own_state_dict(net), new), strict=False)
    except (TypeError, ValueError, RuntimeError) as e:
        p.error(f"argument --config: with --init the weights must still fit or grow ({e})")
    return new


def load_target(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """`--threads`, then the tokenizer and model of `--target` in `--dtype` -> (tokenizer, model); an unloadable
    directory is a usage error naming `--target`."""
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(args.target)
        return tok, AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    except (OSError, ValueError) as e:
        parser.error(f"argument --target: cannot load {args.target!r} ({e})")


def run(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    import torch
    tok, target = load_target(p, args)
    from specdec.draft.registry import load_drafter, save_drafter
    from specdec.draft.data import corpus_tokens
    try:
        if args.data.endswith(".jsonl"):
            ids = corpus_tokens(args.data)
        else:
            with open(args.data, encoding="utf-8") as f:
                ids = torch.tensor(tok(f.read())["input_ids"], dtype=torch.long)
    except (OSError, ValueError) as e:
        p.error(f"argument --data: {e}")
    overrides = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"argument --config: expected KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            overrides[key] = value
    import dataclasses

    from specdec.draft.registry import kind_module
    known = {f.name for f in dataclasses.fields(kind_module(args.drafter).Config)}
    if set(overrides) - known:
        p.error(f"argument --config: {sorted(set(overrides) - known)[0]!r} is not a {args.drafter} config field")
    init = None
    if args.init:
        try:
            init = load_drafter(args.init, target)
        except ValueError as e:
            p.error(f"argument --init: {e}")
        if init.config.kind != args.drafter:
            p.error(f"argument --init: {args.init!r} holds a {init.config.kind} drafter, not {args.drafter}")
        if overrides:
            init = _reconfigured(init, target, overrides, p)
    t0 = time.time()
    try:
        net, hist = train(target, ids, args.drafter, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                          batch_size=args.batch_size, val_every=args.val_every, val_batches=args.val_batches,
                          seed=args.seed, net=init, log=lambda line: print(line, flush=True),
                          on_best=lambda n, entry: save_drafter(n, args.out), checkpoint=args.checkpoint,
                          max_minutes=args.max_minutes, patience=args.patience, cache_batches=args.cache_batches,
                          cache=args.cache, stop_at=args.stop_at, **({} if init is not None else overrides))
    except ValueError as e:
        p.error(str(e))
    if args.last:
        save_drafter(net, args.last)
    first, last, best = hist["val"][0], hist["val"][-1], hist["best"]
    print(json.dumps({"out": args.out, "seconds": round(time.time() - t0, 1), "val_loss_start": first["loss"],
                      "val_loss_end": last["loss"], "per_position_end": last["per_position"],
                      "best_step": best["step"], "val_loss_best": best["loss"], "tau_best": best["tau"],
                      "per_position_best": best["per_position"]}))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="target model directory (save_pretrained, with tokenizer)")
    p.add_argument("--drafter", required=True, choices=DRAFTER_KINDS)
    p.add_argument("--data", required=True, help="a text file, or a corpus from specdec draft-data (.jsonl)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=2, help="held-out batches of --batch-size windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--init", default=None, metavar="DIR", help="continue from this trained drafter (same kind)")
    p.add_argument("--checkpoint", default=None, metavar="FILE", help="resumable training state (resumed if present)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after this much training time")
    p.add_argument("--patience", type=int, default=None, help="stop after this many validations without a better tau")
    p.add_argument("--stop-at", type=int, default=None, metavar="N",
                   help="stop after step N, the learning-rate schedule still spanning --steps (resumable)")
    p.add_argument("--last", default=None, metavar="DIR",
                   help="also save the weights at the end of the run here (--out keeps the best validation's)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--cache-batches", type=int, default=0,
                   help="train on this many target batches computed once (0: a new target forward each step)")
    p.add_argument("--cache", default=None, metavar="FILE", help="with --cache-batches: where they are kept")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="a drafter config field (JSON value), e.g. ttt_steps=6; with --init, fields that keep the "
                        "weights' shapes (training depth, loss weights) or grow them (num_layers, intermediate_size: "
                        "new blocks and MLP units start with zero output weights, so training starts from the "
                        "--init drafter's function)")
