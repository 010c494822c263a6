"""Training-step benchmark on CPU: transformers' Kimi-Linear (the embedded model's shape) forward + backward
with transformers' own pure-torch chunked KDA vs `kernels.chunk_delta_rule` at several chunk sizes.

    python bench/train_step.py --batch-size 8 --seq-len 256 --threads 2 --json train_step.json   # after pip install -e .

Each path runs the same random model on the same random tokens; the table gives seconds per step
(forward, backward, total, median of `--reps` after one warmup) and the loss difference to the first path.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from specdec.hf_compat import torch_fallbacks
from specdec.train_embedded import model_config


def step_times(model, ids: torch.Tensor, reps: int) -> tuple[float, float, float]:
    """-> (median forward s, median backward s, loss of the last step)."""
    fwd, bwd, loss = [], [], None
    for i in range(reps + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = model(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i:  # the first step is warmup
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd), loss.item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/train_step.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--chunks", default="8,16,32", help="chunk sizes of chunk_delta_rule to time")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, metavar="OUT")
    a = p.parse_args(argv)
    try:
        chunks = [int(c) for c in a.chunks.split(",") if c.strip()]
    except ValueError:
        p.error(f"--chunks: expected comma-separated ints, got {a.chunks!r}")
    for flag, val in (("--batch-size", a.batch_size), ("--seq-len", a.seq_len), ("--reps", a.reps),
                      ("--chunks", min(chunks, default=0))):
        if val < 1:
            p.error(f"{flag}: expected >= 1, got {val}")
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(model_config(4096, 0, 1))
    model.config._experts_implementation = "eager"
    model.train()
    ids = torch.randint(2, 4096, (a.batch_size, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    paths = [("transformers chunk (pure torch)", dict())] + [(f"chunk_delta_rule C={c}", dict(chunked=True, chunk_size=c))
                                                             for c in chunks]
    rows = []
    for name, kw in paths:
        with torch_fallbacks("kimi_linear", **kw):
            f, b, loss = step_times(model, ids, a.reps)
        rows.append({"path": name, "forward_s": f, "backward_s": b, "step_s": f + b, "loss": loss})
    base = rows[0]
    print(f"# Kimi-Linear {sum(x.numel() for x in model.parameters()) / 1e6:.2f}M params, "
          f"{a.batch_size} x {a.seq_len} tokens, {torch.get_num_threads()} threads")
    print(f"{'path':34s} {'fwd s':>7s} {'bwd s':>7s} {'step s':>7s} {'vs base':>8s} {'|dloss|':>9s}")
    for r in rows:
        r["speedup"] = base["step_s"] / r["step_s"]
        r["loss_diff"] = abs(r["loss"] - base["loss"])
        print(f"{r['path']:34s} {r['forward_s']:7.2f} {r['backward_s']:7.2f} {r['step_s']:7.2f} "
              f"{r['speedup']:7.2f}x {r['loss_diff']:9.2e}")
    if a.json:
        out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                           "torch": torch.__version__},
               "settings": {"batch_size": a.batch_size, "seq_len": a.seq_len, "reps": a.reps}, "paths": rows}
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
