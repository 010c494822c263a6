"""Distil a drafter from a target's own outputs on a text corpus.

    python -m specdec.draft.train --target DIR --drafter {mtp,eagle,dspark} --data FILE --out DIR \\
        [--steps 300 --lr 1e-3 --seq-len 128 --batch-size 8 --val-every 50 --seed 0 --init DIR]

`--init DIR` continues from a trained drafter of the same kind (a fresh warmup + cosine schedule).

Target features and next-token distributions come from specdec's own runner over the target (so this
works on CPU for the hybrid families); `train` takes the runner factory from its caller, and the command line
is `specdec.cli.draft_train`. Saved as `config.json` + `model.safetensors`, loadable with
`specdec.wrap(model, drafter=DIR)`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable

import torch

from .registry import build_drafter_net, target_batch


def windows(ids: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows `[batch_size, seq_len]` of the token stream `ids [N]`."""
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def train(target, ids: torch.Tensor, kind: str, *, runner_factory: Callable, steps: int = 300, lr: float = 1e-3,
          seq_len: int = 128, batch_size: int = 8, val_every: int = 50, val_batches: int = 2, seed: int = 0, net=None,
          progress: bool = True, log=None, **net_overrides):
    """Train (or continue training `net`) on the token stream `ids [N]` (last 5% held out for validation).

    `runner_factory`: builds the target's runner, a callable with `specdec.runner.make_runner`'s signature
    (`specdec.cli.draft_train.train` passes specdec's own).
    -> (net, history): history has `train_loss` per step and `val` entries {step, loss, per_position}.
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    n_val = max(seq_len + 1, ids.numel() // 20)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if train_ids.numel() <= seq_len:
        raise ValueError(f"data: {ids.numel()} tokens is too little for --seq-len {seq_len}")
    net = net if net is not None else build_drafter_net(kind, target, **net_overrides)
    runner = runner_factory(target, max_batch_size=1, max_length=seq_len + 8, num_verify_tokens=1,
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


if __name__ == "__main__":  # the command line lives outside draft/, which does not import the runner
    from specdec.cli.draft_train import main

    raise SystemExit(main())
