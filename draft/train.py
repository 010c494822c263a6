"""Distil a drafter from a target's own outputs on a text corpus.

    python -m specdec.draft.train --target DIR --drafter {mtp,eagle,dspark} --data FILE --out DIR \\
        [--steps 300 --lr 1e-3 --seq-len 128 --batch-size 8 --val-every 50 --seed 0 --init DIR]

`--init DIR` continues from a trained drafter of the same kind (a fresh warmup + cosine schedule).

Target features and next-token distributions come from specdec's own runner over the target (so this
works on CPU for the hybrid families). Saved as `config.json` + `model.safetensors`, loadable with
`specdec.wrap(model, drafter=DIR)`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from .common import build_drafter_net, load_drafter, save_drafter, target_batch


def windows(ids: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows `[batch_size, seq_len]` of the token stream `ids [N]`."""
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def train(target, ids: torch.Tensor, kind: str, *, steps: int = 300, lr: float = 1e-3, seq_len: int = 128,
          batch_size: int = 8, val_every: int = 50, val_batches: int = 2, seed: int = 0, net=None,
          progress: bool = True, log=None, **net_overrides):
    """Train (or continue training `net`) on the token stream `ids [N]` (last 5% held out for validation).

    -> (net, history): history has `train_loss` per step and `val` entries {step, loss, per_position}.
    """
    from specdec.runner import make_runner
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    n_val = max(seq_len + 1, ids.numel() // 20)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if train_ids.numel() <= seq_len:
        raise ValueError(f"data: {ids.numel()} tokens is too little for --seq-len {seq_len}")
    net = net if net is not None else build_drafter_net(kind, target, **net_overrides)
    runner = make_runner(target, max_batch_size=1, max_length=seq_len + 8, num_verify_tokens=1,
                         prefill_chunk=seq_len)
    layers = tuple(net.config.feature_layers)
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_data = [target_batch(runner, windows(val_ids, min(seq_len, val_ids.numel() - 1), batch_size, val_gen),
                             layers) for _ in range(val_batches)]
    params = [p for n, p in net.named_parameters() if not n.split(".")[0].startswith("target_")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 *
                                              (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    history = {"train_loss": [], "val": []}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc=f"train {kind}", file=sys.stderr)

    def validate(step):
        net.eval()
        with torch.no_grad():
            evals = [net.evaluate(b) for b in val_data]
        net.train()
        entry = {"step": step, "loss": sum(e["loss"] for e in evals) / len(evals),
                 "per_position": [sum(x) / len(evals) for x in zip(*(e["per_position"] for e in evals))]}
        history["val"].append(entry)
        if log:
            log(json.dumps(entry))
        return entry

    validate(0)
    net.train()
    for step in range(1, steps + 1):
        batch = target_batch(runner, windows(train_ids, seq_len, batch_size, gen), layers)
        loss = net.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history["train_loss"].append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % val_every == 0 or step == steps:
            validate(step)
    if bar is not None:
        bar.close()
    net.eval()
    return net, history


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.draft.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (save_pretrained, with tokenizer)")
    p.add_argument("--drafter", required=True, choices=["mtp", "eagle", "dspark"])
    p.add_argument("--data", required=True, help="a text file")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--init", default=None, metavar="DIR", help="continue from this trained drafter (same kind)")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(args.target)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).eval()
    except (OSError, ValueError) as e:
        p.error(f"argument --target: cannot load {args.target!r} ({e})")
    try:
        with open(args.data, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        p.error(f"argument --data: {e}")
    init = None
    if args.init:
        try:
            init = load_drafter(args.init, target)
        except ValueError as e:
            p.error(f"argument --init: {e}")
        if init.config.kind != args.drafter:
            p.error(f"argument --init: {args.init!r} holds a {init.config.kind} drafter, not {args.drafter}")
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    t0 = time.time()
    try:
        net, hist = train(target, ids, args.drafter, steps=args.steps, lr=args.lr, seq_len=args.seq_len,
                          batch_size=args.batch_size, val_every=args.val_every, seed=args.seed, net=init, log=print)
    except ValueError as e:
        p.error(str(e))
    save_drafter(net, args.out)
    first, last = hist["val"][0], hist["val"][-1]
    print(json.dumps({"out": args.out, "seconds": round(time.time() - t0, 1), "val_loss_start": first["loss"],
                      "val_loss_end": last["loss"], "per_position_end": last["per_position"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
