"""Distil a drafter from a target's own outputs on a text corpus.

    python -m specdec draft-train --target DIR --drafter {mtp,eagle,dspark,native} --data FILE --out DIR \\
        [--steps 300 --lr 1e-3 --seq-len 128 --batch-size 8 --val-every 50 --val-batches 2 --seed 0 --init DIR
         --checkpoint FILE --max-minutes M --patience K --threads 1]

`--data` is a text file, or a self-distilled corpus written by `python -m specdec draft-data` (`.jsonl`).
`--init DIR` continues from a trained drafter of the same kind (a fresh warmup + cosine schedule).
Every `--val-every` steps the per-position teacher-forced greedy acceptance on the held-out windows is printed
(`per_position[i]`: draft i equals the target's argmax given drafts < i did) with its `tau` =
1 + sum_i prod_{j<=i} per_position[j]; `--out` receives the checkpoint with the best validation tau (the first
one on ties). `--checkpoint FILE` keeps a resumable training state there at every validation (a rerun with the
same arguments continues from it); `--max-minutes` and `--patience` (validations without a better tau) stop early.

Target features and next-token distributions come from specdec's own runner over the target (so this
works on CPU for the hybrid families); `train` takes the runner factory from its caller, and the command line
(`python -m specdec draft-train`) is `specdec.cli.draft_train`. Saved as `config.json` + `model.safetensors`,
loadable with `specdec.wrap(model, drafter=DIR)`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch

from .registry import TargetBatch, build_drafter_net, load_plain, own_state_dict, target_batch


def windows(ids: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows `[batch_size, seq_len]` of the token stream `ids [N]`."""
    starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def cached_batches(runner, ids: torch.Tensor, num: int, *, seq_len: int, batch_size: int, seed: int,
                   num_layers: int, path: str | None = None, progress: bool = False) -> list[TargetBatch]:
    """`num` target batches of random windows of `ids [N]`, every decoder layer's features captured (so one cache
    serves every drafter kind), stored in float16 (the target's logits `[B, S, V]` are 8 MB a batch that way).
    Loaded from `path` when it holds the same windows' batches, else computed (the target forward dominates a
    training step on CPU) and saved there."""
    key = {"num": num, "seq_len": seq_len, "batch_size": batch_size, "seed": seed, "tokens": int(ids.numel()),
           "checksum": int((ids[: 1 << 20].double() * torch.arange(min(ids.numel(), 1 << 20))).sum())}
    if path and os.path.exists(path):
        try:
            state = load_plain(path, what="cache")
        except ValueError as e:  # a cache is derived data: one that does not load safely is computed again
            print(f"# {e}; computing the batches again", file=sys.stderr)
            state = None
        if isinstance(state, dict) and state.get("key") == key:
            return [TargetBatch(b["tokens"], b["logits"], b["hidden"], b["features"]) for b in state["batches"]]
    gen = torch.Generator().manual_seed(seed + 2)
    layers = tuple(range(num_layers))
    half = lambda t: t.to(torch.float16)  # noqa: E731
    out = []
    it = range(num)
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(it, desc="target batches", file=sys.stderr)
    for _ in it:
        b = target_batch(runner, windows(ids, seq_len, batch_size, gen), layers)
        out.append(TargetBatch(b.tokens, half(b.logits), half(b.hidden), {i: half(f) for i, f in b.features.items()}))
    if path:
        # plain dicts, not TargetBatch objects: the file then loads with `weights_only=True`
        batches = [{"tokens": b.tokens, "logits": b.logits, "hidden": b.hidden, "features": b.features} for b in out]
        torch.save({"key": key, "batches": batches}, path + ".tmp")
        os.replace(path + ".tmp", path)
    return out


def acceptance_tau(per_position: list[float]) -> float:
    """Expected tokens per verify round under greedy acceptance: 1 + sum_i prod_{j<=i} per_position[j]."""
    tau, run = 1.0, 1.0
    for a in per_position:
        run *= a
        tau += run
    return tau


def train(target, ids: torch.Tensor, kind: str, *, runner_factory: Callable, steps: int = 300, lr: float = 1e-3,
          seq_len: int = 128, batch_size: int = 8, val_every: int = 50, val_batches: int = 2, seed: int = 0, net=None,
          progress: bool = True, log=None, on_best: Callable | None = None, checkpoint: str | None = None,
          max_minutes: float | None = None, patience: int | None = None, cache_batches: int = 0,
          cache: str | None = None, stop_at: int | None = None, **net_overrides):
    """Train (or continue training `net`) on the token stream `ids [N]` (last 5% held out for validation).

    `runner_factory`: builds the target's runner, a callable with `specdec.runner.make_runner`'s signature
    (`specdec.cli.draft_train.train` passes specdec's own). Every `val_every` steps (and at 0 and the end) the
    held-out windows are evaluated; `on_best(net, entry)` is called whenever the validation tau beats every earlier
    one. `checkpoint`: a file for the resumable training state (written at each validation, resumed from when it
    exists). `max_minutes` / `patience` (validations without a better tau) stop before `steps`; so does `stop_at`
    (after that step, validated and checkpointed there), with the learning-rate schedule still spanning `steps`, so a
    run stopped there and resumed from its checkpoint is the uninterrupted run.
    `cache_batches` > 0: train on that many target batches computed once (`cached_batches`, saved to / loaded
    from `cache`), visited in a fresh seeded order each epoch, instead of a new target forward every step.
    -> (net, history): history has `train_loss` per step, `val` entries {step, loss, per_position, tau} and
    `best` (the best entry).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    n_val = max(seq_len + 1, ids.numel() // 20)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if train_ids.numel() <= seq_len:
        raise ValueError(f"data: {ids.numel()} tokens is too little for --seq-len {seq_len}")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise ValueError(f"patience: expected an int >= 1 or None, got {patience!r}")
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or not 1 <= stop_at <= steps):
        raise ValueError(f"stop_at: expected an int in [1, steps={steps}] or None, got {stop_at!r}")
    net = net if net is not None else build_drafter_net(kind, target, **net_overrides)
    runner = runner_factory(target, max_batch_size=1, max_length=seq_len + 8, num_verify_tokens=1,
                         prefill_chunk=seq_len)
    layers = tuple(net.config.feature_layers)
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_data = [target_batch(runner, windows(val_ids, min(seq_len, val_ids.numel() - 1), batch_size, val_gen),
                             layers) for _ in range(val_batches)]
    pool = []
    if cache_batches > 0:
        pool = cached_batches(runner, train_ids, cache_batches, seq_len=seq_len, batch_size=batch_size, seed=seed,
                              num_layers=target.config.get_text_config().num_hidden_layers, path=cache,
                              progress=progress)
    dtype = next(p for n, p in net.named_parameters() if not n.startswith("target_")).dtype

    def next_batch(step):
        if not pool:
            return target_batch(runner, windows(train_ids, seq_len, batch_size, gen), layers)
        epoch, i = divmod(step - 1, len(pool))
        b = pool[int(torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed * 7919 + epoch))[i])]
        return TargetBatch(b.tokens, b.logits.to(dtype), b.hidden.to(dtype),
                           {j: b.features[j].to(dtype) for j in layers})

    params = [p for n, p in net.named_parameters() if not n.split(".")[0].startswith("target_")]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 *
                                              (1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    history = {"train_loss": [], "val": [], "best": None}
    start = 1
    if checkpoint and os.path.exists(checkpoint):
        state = load_plain(checkpoint, what="checkpoint")
        if state["kind"] != kind or state["steps"] != steps:
            raise ValueError(f"checkpoint: {checkpoint!r} is a {state['kind']} run of {state['steps']} steps, not "
                             f"{kind} with {steps}")
        net.load_state_dict(state["net"], strict=False)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        torch.set_rng_state(state["rng"])
        history = state["history"]
        start = state["step"] + 1
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start - 1, desc=f"train {kind}", file=sys.stderr)

    def validate(step):
        net.eval()
        with torch.no_grad():
            evals = [net.evaluate(b) for b in val_data]
        net.train()
        per_position = [sum(x) / len(evals) for x in zip(*(e["per_position"] for e in evals))]
        entry = {"step": step, "loss": sum(e["loss"] for e in evals) / len(evals),
                 "per_position": per_position, "tau": acceptance_tau(per_position)}
        history["val"].append(entry)
        best = history["best"]
        if best is None or entry["tau"] > best["tau"]:
            history["best"] = entry
            if on_best is not None:
                on_best(net, entry)
        if log:
            log(json.dumps(entry))
        return entry

    def save_state(step):
        if not checkpoint:
            return
        tmp = checkpoint + ".tmp"
        torch.save({"kind": kind, "steps": steps, "step": step, "net": own_state_dict(net), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "gen": gen.get_state(), "rng": torch.get_rng_state(),
                    "history": history}, tmp)
        os.replace(tmp, checkpoint)  # never a torn checkpoint

    if start == 1:
        validate(0)
    t0 = time.time()
    net.train()
    for step in range(start, steps + 1):
        loss = net.loss(next_batch(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        history["train_loss"].append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
        out_of_time = max_minutes is not None and time.time() - t0 > 60 * max_minutes
        stop_here = step == stop_at
        if step % val_every == 0 or step == steps or out_of_time or stop_here:
            validate(step)
            save_state(step)
            since = [e["step"] for e in history["val"]].index(history["best"]["step"])
            stale = patience is not None and len(history["val"]) - 1 - since >= patience
            if out_of_time or stale or stop_here:
                if log:
                    reason = "max_minutes" if out_of_time else "patience" if stale else "stop_at"
                    log(json.dumps({"stopped": step, "reason": reason}))
                break
    if bar is not None:
        bar.close()
    net.eval()
    return net, history

