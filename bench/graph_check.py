"""CUDA graphs against eager rounds, token for token, on the embedded model, and their speed against plain decoding.

    python bench/graph_check.py --device cuda --json graphs.json     # on a GPU: dynamic, static, graph
    python bench/graph_check.py                                      # on CPU: dynamic and static only

For each batch size, the first B held-out prompts (cut to `--prompt-tokens`) are generated greedily for
`--max-new-tokens` tokens (no early stop) by the plain baseline (`plain`: `drafter=None`, one token per forward
through the same engine), by each drafter of `--drafters` (default: ngram, drafted on the host before the device
step, and the shipped mtp, dspark and eagle drafters, whose drafting is part of the captured step) and last by
transformers' own `model.generate` (`hf`, the decode a user runs without specdec; `--reference none` leaves it
out). Every engine runs in three modes: `dynamic` (shapes follow the round), `static` (`static_shapes=True`, the
padded path, run eagerly) and `graph` (`cuda_graph=True`: CUDA only, on by default there; `--no-cuda-graph`
leaves it out). Every output must equal plain decoding's dynamic output token for token, or the script exits with
status 1 (transformers' output is compared too, and a difference there is only reported). After a warm-up call
each mode runs `--repeats` times, interleaved; the table shows the median tokens/s, the speedup over plain
decoding in the same mode and how many step shapes were captured as graphs (and how many fell back to eager),
and a line per drafter closes each batch size with its summary.

The JSON's `summary[drafter][B]` holds, per drafter (plain included) and batch size: `identical` (every mode's
output equals plain decoding's), `eager_fallbacks` (step shapes whose capture failed, so their rounds ran eagerly),
`speedup_vs_plain_graph` (tokens/s over plain decoding's, both in `mode`), `speedup_vs_transformers` (tokens/s in
`mode` over transformers' generate's) and `mode`: "graph", or "static" where no graph mode ran (a CPU), whose
padded rounds are what a graph replays. `--budget-s`: once that many seconds have passed no new row (a drafter at a
batch size) starts; what was measured is printed and written, and the exit status is 0 unless an output differed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import left_padded, max_over_min, resolve_model_dir, sync  # noqa: E402
finally:
    sys.path.pop(0)

PLAIN, HF = "plain", "hf"


def _timed_runs(calls: dict, repeats: int, device: str) -> tuple[dict, dict]:
    """One untimed call of each of `calls` ({mode: () -> new tokens per row}), then `repeats` timed ones,
    interleaved (the first mode rotating per repeat). -> ({mode: new tokens of its last call}, {mode: [seconds]})."""
    outs, times = {}, {m: [] for m in calls}
    order = list(calls)
    for r in range(repeats + 1):  # the first pass warms up (and, for graphs, captures)
        for m in order[r % len(order):] + order[:r % len(order)]:
            sync(device)
            t = time.perf_counter()
            outs[m] = calls[m]()
            sync(device)
            if r:
                times[m].append(time.perf_counter() - t)
    return outs, times


def _rate(B: int, new: int, seconds: list[float]) -> tuple[float, float]:
    """(median tokens/s, spread: max / min over the repeats)."""
    rate = [B * new / t for t in seconds]
    return statistics.median(rate), max_over_min(rate)


def _transformers_row(model, prompts, tok, a, transformers_generate) -> dict:
    """transformers' greedy `generate` on the B prompts (left-padded with a mask where their lengths differ), timed
    as the engines are. -> {tokens_per_s, spread, new: new tokens per row}, or {skipped: why} when it fails."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids, mask = left_padded(prompts, pad)
    B, width = ids.shape
    ids, mask = ids.to(a.device), mask.to(a.device)

    def call():
        out = transformers_generate(model, ids, attention_mask=mask, max_new_tokens=a.max_new_tokens,
                                    min_new_tokens=a.max_new_tokens, pad_token_id=pad)
        return out[:, width:].tolist()
    try:
        outs, times = _timed_runs({HF: call}, a.repeats, a.device)
    except Exception as e:  # noqa: BLE001 - the reference may not run here; the engines' rows stand
        first = (str(e).strip().splitlines() or [""])[0]
        return dict(skipped=f"failed: {type(e).__name__}: {first}")
    med, spread = _rate(B, a.max_new_tokens, times[HF])
    return dict(tokens_per_s=med, spread=spread, new=outs[HF])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,4")
    p.add_argument("--drafters", default="ngram,mtp,dspark,eagle",
                   help="ngram, or trained drafters of the embedded model")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="also run every engine with cuda_graph=True (default: on CUDA)")
    p.add_argument("--reference", choices=("transformers", "none"), default="transformers",
                   help="time transformers' own generate on the same prompts (none: leave it out)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new row after this many seconds; print and write what was measured")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    graph = cuda if a.cuda_graph is None else a.cuda_graph
    if graph and not cuda:
        p.error("--cuda-graph: CUDA graphs need --device cuda")
    drafters = [d for d in a.drafters.split(",") if d]
    if PLAIN in drafters or HF in drafters:
        p.error(f"--drafters: {PLAIN!r} and {HF!r} are the baselines' rows")
    if a.budget_s is not None and a.budget_s <= 0:
        p.error(f"--budget-s: expected > 0, got {a.budget_s}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specdec
    from specdec.hf_compat import transformers_generate

    t0 = time.perf_counter()
    model_dir = resolve_model_dir("embedded")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [json.loads(line)["prompt"] for line in (model_dir / "prompts.jsonl").read_text().splitlines() if line]
    modes = {"dynamic": {}, "static": {"static_shapes": True}}
    if graph:
        modes["graph"] = {"cuda_graph": True}
    speed_mode = "graph" if graph else "static"  # the mode the summary's speedups compare
    print(f"# device {a.device} ({torch.cuda.get_device_name() if cuda else 'cpu'}), dtype {a.dtype}, torch threads "
          f"{torch.get_num_threads()}; speedups in the summary: {speed_mode} mode"
          + ("" if graph else " (no CUDA graphs: the padded rounds a graph would replay, run eagerly)"), flush=True)
    print(f"{'drafter':>8} {'batch':>5} {'mode':>8} {'tok/s':>9} {'spread':>7} {'identical':>9} {'vs plain':>8} "
          f"{'graphs':>7} {'eager':>6}", flush=True)
    results, summary, reference, failed, not_run = {}, {}, {}, False, []
    sizes = [int(b) for b in a.batch_sizes.split(",")]

    def out_of_budget() -> bool:
        return a.budget_s is not None and time.perf_counter() - t0 > a.budget_s

    for B in sizes:
        prompts = [tok(texts[i % len(texts)])["input_ids"][:a.prompt_tokens] for i in range(B)]
        plain = None  # plain decoding's rates and dynamic output at this batch size
        for name in [PLAIN] + drafters:
            if out_of_budget() or (name != PLAIN and plain is None):
                not_run.append(f"{name}@{B}")
                continue
            drafter = None if name == PLAIN else name if name == "ngram" else str(model_dir / "drafters" / name)
            engines = {m: specdec.wrap(model, drafter=drafter, max_batch_size=B, **o) for m, o in modes.items()}

            def call(e):
                out = e.generate(prompts, max_new_tokens=a.max_new_tokens, eos_token_id=None)
                return [out.sequences[i, len(q):len(q) + a.max_new_tokens].tolist() for i, q in enumerate(prompts)]
            outs, times = _timed_runs({m: (lambda e=e: call(e)) for m, e in engines.items()}, a.repeats, a.device)
            if plain is None:
                plain = dict(new=outs["dynamic"], rates={})
            row = results.setdefault(name, {}).setdefault(str(B), {})
            for m in modes:
                same = outs[m] == plain["new"]
                failed |= not same
                counts = engines[m].graph_counts
                med, spread = _rate(B, a.max_new_tokens, times[m])
                if name == PLAIN:
                    plain["rates"][m] = med
                row[m] = dict(tokens_per_s=med, spread=spread, identical=same, graphs=counts["captured"],
                              eager_fallbacks=counts["eager"], speedup_vs_plain=med / plain["rates"][m],
                              speedup_vs_transformers=None)
                print(f"{name:>8} {B:>5} {m:>8} {med:>9.1f} {spread:>7.2f} {str(same):>9} "
                      f"{row[m]['speedup_vs_plain']:>7.2f}x {counts['captured']:>7} {counts['eager']:>6}", flush=True)
            summary.setdefault(name, {})[str(B)] = dict(
                identical=all(r["identical"] for r in row.values()),
                eager_fallbacks=sum(r["eager_fallbacks"] for r in row.values()),
                speedup_vs_plain_graph=row[speed_mode]["speedup_vs_plain"], speedup_vs_transformers=None,
                mode=speed_mode)
            del engines
            if cuda:
                torch.cuda.empty_cache()
        # transformers' generate last: its first call (kernel compiles on a GPU) never holds back the engines' rows
        hf = None
        if a.reference == "transformers" and (plain is None or out_of_budget()):
            not_run.append(f"{HF}@{B}")
        elif a.reference == "transformers":
            hf = reference[str(B)] = _transformers_row(model, prompts, tok, a, transformers_generate)
            if "skipped" in hf:
                print(f"{HF:>8} {B:>5} not run: {hf['skipped']}", flush=True)
                hf = None
        if hf is not None:
            hf["identical"] = hf.pop("new") == plain["new"]
            if not hf["identical"]:
                print(f"WARNING: batch {B}: transformers' generate differs from plain decoding", file=sys.stderr)
            print(f"{HF:>8} {B:>5} {'-':>8} {hf['tokens_per_s']:>9.1f} {hf['spread']:>7.2f} "
                  f"{str(hf['identical']):>9}", flush=True)
            for name in summary:
                if str(B) in results.get(name, {}):
                    for m, r in results[name][str(B)].items():
                        r["speedup_vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
                    summary[name][str(B)]["speedup_vs_transformers"] = \
                        results[name][str(B)][speed_mode]["speedup_vs_transformers"]
        for name in summary:  # this batch size's speedups, as the JSON's summary holds them
            if str(B) in summary[name]:
                x = summary[name][str(B)]
                vs_hf = x["speedup_vs_transformers"]
                print(f"# {name} {B}: identical {x['identical']}, eager fallbacks {x['eager_fallbacks']}, "
                      f"{x['speedup_vs_plain_graph']:.2f}x plain ({speed_mode}), "
                      f"{'-' if vs_hf is None else f'{vs_hf:.2f}x'} transformers", flush=True)
    if not_run:
        print(f"# budget of {a.budget_s:g} s spent: not run: {', '.join(not_run)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"device": a.device, "dtype": a.dtype, "cuda_graph": graph, "mode": speed_mode, "results": results,
             "transformers": reference, "summary": summary, "not_run": not_run,
             "elapsed_s": time.perf_counter() - t0}, indent=1))
    if failed:
        print("FAIL: an output differs from plain decoding's", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
