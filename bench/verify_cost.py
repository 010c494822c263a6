"""Verify cost: a T-token chain or tree verify forward as a multiple of one 1-token decode step.

    python bench/verify_cost.py                                   # embedded model, 1 torch thread
    python bench/verify_cost.py --repeats 31 --json verify_cost.json

On one `HybridRunner` (replay strategy, eager commit, batch 1, sized for the largest verify), after the prefill
of a real prompt (the first code prompt of bench/data/prompts.jsonl), each of these is one
`runner.forward(slots, ids, parent=...)` from the committed state, followed by `runner.abort()` (untimed), so
every forward starts from the same state:

    step_1   one token (what plain decode runs per token)
    chain_8  an 8-token chain (anchor + 7 drafts: a gamma-7 round)
    tree_13, tree_25, tree_49   trees of 13, 25 and 49 nodes (anchor included)

The trees have the shape of EAGLE's top-k trees (topk `--topk`, default 8, as the eagle drafter): the anchor's
`topk` children, then at every further depth the best half of the previous depth (its first nodes) expanded
into two children each, `topk` nodes per depth, until the node count is reached; node order is topological.

All kinds run in one process, interleaved (each repeat runs every kind once, in a rotated order) after
`--warmup` untimed rounds; each figure is the median over `--repeats`. Ratios are median(kind) / median(step_1).
The spread of a kind is (p90 - p10) / median over its repeats; above 25% the run is reported as noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    from accept_rate import load_prompts, machine_info, resolve_model_dir  # noqa: E402
finally:
    sys.path.pop(0)

import specdec  # noqa: E402,F401  (accept_rate made `specdec` importable in a bare checkout)

TREE_SIZES = (13, 25, 49)
NOISY = 0.25


def tree_parents(n: int, topk: int = 8) -> list[int]:
    """Parent list of an `n`-node EAGLE-like top-k tree: [-1, 0, 0, ...], topological (parent[i] < i)."""
    if n < 1 or topk < 1:
        raise ValueError(f"tree_parents: expected n >= 1 and topk >= 1, got n={n}, topk={topk}")
    parent, prev = [-1], [0]
    while len(parent) < n:
        level = []
        for j in range(topk):
            if len(parent) >= n:
                break
            # depth 1: all children of the anchor; deeper: the first half of the previous depth, 2 children each
            p = prev[0] if prev == [0] else prev[min(j // 2, len(prev) - 1)]
            parent.append(p)
            level.append(len(parent) - 1)
        prev = level
    return parent


def kinds(chain: int, trees, topk: int) -> dict[str, list[int] | None]:
    """name -> parent list (None: chain)."""
    out: dict[str, list[int] | None] = {"step_1": None, f"chain_{chain}": None}
    for n in trees:
        out[f"tree_{n}"] = tree_parents(n, topk)
    return out


def spread(times: list[float]) -> float:
    """(p90 - p10) / median."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=10, method="inclusive")
    med = statistics.median(times)
    return (q[-1] - q[0]) / med if med > 0 else 0.0


def measure(runner, slots: list[int], ids: torch.Tensor, shapes: dict, repeats: int, warmup: int) -> dict:
    """-> name -> list of seconds per forward; interleaved, rotated order per repeat."""
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    names = list(shapes)
    inputs = {}
    for name, parent in shapes.items():
        T = 1 if name == "step_1" else (len(parent) if parent is not None else int(name.split("_")[1]))
        x = ids[torch.arange(T) % ids.numel()][None].to(runner.device)  # token values do not change the cost
        p = None if parent is None else torch.tensor(parent, dtype=torch.long, device=runner.device)
        inputs[name] = (x, p)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            x, p = inputs[name]
            sync()
            t = time.perf_counter()
            runner.forward(slots, x, parent=p)
            sync()
            dt = time.perf_counter() - t
            runner.abort()
            if r >= warmup:
                times[name].append(dt)
    return times


def format_table(res: dict) -> str:
    head = f"{'verify':10s} {'tokens':>6s} {'depth':>5s} {'median ms':>10s} {'spread':>7s} {'x 1-token':>10s}"
    lines = [head, "-" * len(head)]
    for name, r in res["kinds"].items():
        lines.append(f"{name:10s} {r['tokens']:6d} {r['depth']:5d} {r['median_s'] * 1e3:10.2f} "
                     f"{r['spread'] * 100:6.0f}% {r['ratio']:9.2f}x")
    return "\n".join(lines)


def depth(parent: list[int] | None, T: int) -> int:
    if parent is None:
        return T
    d = [0] * len(parent)
    for i, p in enumerate(parent):
        d[i] = 1 if p < 0 else d[p] + 1
    return max(d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory (model + tokenizer) or 'embedded'")
    p.add_argument("--prompts", default=str(ROOT / "bench" / "data" / "prompts.jsonl"), help="JSONL prompt file")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prompt is cut to its last N tokens")
    p.add_argument("--chain", type=int, default=8, help="chain verify tokens (anchor + drafts)")
    p.add_argument("--trees", default=",".join(map(str, TREE_SIZES)), help="tree node counts, comma-separated")
    p.add_argument("--topk", type=int, default=8, help="tree width per depth (EAGLE's topk)")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats of every kind (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds of every kind first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        trees = [int(t) for t in a.trees.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--trees: expected comma-separated integers, got {a.trees!r}")
    for flag, val, low in (("--chain", a.chain, 1), ("--topk", a.topk, 1), ("--repeats", a.repeats, 1),
                           ("--warmup", a.warmup, 0), ("--threads", a.threads, 1), ("--prompt-tokens", a.prompt_tokens, 1),
                           *(("--trees", t, 2) for t in trees)):
        if val < low:
            parser.error(f"{flag}: expected >= {low}, got {val}")
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    try:
        model_dir = resolve_model_dir(a.model)
    except FileNotFoundError as e:
        parser.error(f"--model: {e}")
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specdec.runner import HybridRunner

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(a.prompts, ["code"], 1) or load_prompts(a.prompts, ["prose"], 1)
    if not prompts:
        parser.error(f"--prompts: no code or prose prompt in {a.prompts}")
    ids = tok(prompts[0]["prompt"], return_tensors="pt").input_ids[0][-a.prompt_tokens:]
    shapes = kinds(a.chain, trees, a.topk)
    T_max = max([a.chain, *trees])
    runner = HybridRunner(model, max_batch_size=1, max_length=ids.numel() + T_max + 1, num_verify_tokens=T_max)
    slots = runner.alloc(1)
    runner.prefill(slots[0], ids.to(a.device))
    times = measure(runner, slots, ids, shapes, a.repeats, a.warmup)

    base = statistics.median(times["step_1"])
    res_kinds = {}
    for name, parent in shapes.items():
        T = len(parent) if parent is not None else (1 if name == "step_1" else a.chain)
        med = statistics.median(times[name])
        res_kinds[name] = {"tokens": T, "depth": depth(parent, T), "parent": parent, "median_s": med,
                           "spread": spread(times[name]), "ratio": med / base if base > 0 else 0.0,
                           "times_s": times[name]}
    noisy = {n: r["spread"] for n, r in res_kinds.items() if r["spread"] > NOISY}
    n_params = sum(p.numel() for p in model.parameters())
    out = {
        "ratios": {n: r["ratio"] for n, r in res_kinds.items() if n != "step_1"},
        "kinds": res_kinds,
        "noisy": bool(noisy),
        "machine": machine_info(a.device),
        "model": {"path": str(model_dir), "model_type": model.config.model_type, "params": n_params},
        "settings": {"prompt_id": prompts[0]["id"], "prompt_tokens": int(ids.numel()), "chain": a.chain,
                     "trees": trees, "topk": a.topk, "repeats": a.repeats, "warmup": a.warmup,
                     "threads": torch.get_num_threads(), "device": a.device, "strategy": "replay",
                     "commit": "eager", "num_verify_tokens": T_max},
    }
    print(f"# bench/verify_cost.py: {a.model} ({model.config.model_type}, {n_params / 1e6:.1f}M params, float32, "
          f"{a.device}), torch threads {torch.get_num_threads()}, prompt {prompts[0]['id']} ({ids.numel()} tokens), "
          f"median of {a.repeats} interleaved repeats after {a.warmup} warmup rounds")
    print(format_table(out))
    if noisy:
        worst = ", ".join(f"{n} {s * 100:.0f}%" for n, s in noisy.items())
        print(f"timing is noisy on this machine: spread (p90-p10)/median above {NOISY * 100:.0f}% ({worst}); "
              f"rerun on a quiet machine or with more --repeats")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
