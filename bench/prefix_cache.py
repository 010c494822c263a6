"""Multi-turn chat with and without the prefix cache: time to first token and total time per turn.

    python bench/prefix_cache.py                                    # embedded model, 8 turns, ngram
    python bench/prefix_cache.py --turns 4 --drafter eagle --json prefix.json

Turn t sends the whole conversation so far: the held-out prompts 1..t (each cut to `--prompt-tokens`) with the
replies of turns 1..t-1 between them, as a chat client resends its history. Each repeat runs the conversation on
a fresh engine with `prefix_cache=True` and on one without, interleaved (one turn of each in turn); a turn's
replies come from the engine's own output, so the two conversations stay the same only when the cache is lossless
(`identical`). Time to first token: from the `generate` call to the streamer's first new token (prefill and the
first draw); total: the whole call. Medians over `--repeats`; ratios are no-cache / cache of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec import timing  # noqa: E402


class _FirstToken:
    """A streamer that notes when the first new token arrives (the first `put` is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, x):
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def run_turn(engine, ids: list[int], max_new: int) -> tuple[list[int], float, float, dict]:
    """-> (new tokens, seconds to the first new token, seconds in all, the call's stats)."""
    streamer = _FirstToken()
    t0 = time.perf_counter()
    out = engine.generate(torch.tensor(ids), max_new_tokens=max_new, eos_token_id=None, streamer=streamer)
    t1 = time.perf_counter()
    return out.sequences[0, len(ids):].tolist(), streamer.first - t0, t1 - t0, out.stats.as_dict()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--prompts", default=str(common.PROMPTS))
    p.add_argument("--kinds", default="code,prose")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=48,
                   help="each turn's new message: the last N tokens of its held-out prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="each reply (a chat's replies outrun its messages)")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    for flag, val in (("--turns", a.turns), ("--prompt-tokens", a.prompt_tokens),
                      ("--max-new-tokens", a.max_new_tokens)):
        if val < 1:
            p.error(f"{flag}: expected >= 1, got {val}")
    if a.repeats < 3:
        p.error(f"--repeats: expected >= 3 (a median of at least 3), got {a.repeats}")
    model_dir = common.input_args(p, a.model, a.prompts)
    drafter, why = common.resolve_drafter(model_dir, a.drafter)
    if drafter is None:
        p.error(f"--drafter: {why}")
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = timing.torch_threads(model, a.threads)
    prompts = common.load_prompts(a.prompts, common.split_list(a.kinds), a.turns)
    if len(prompts) < a.turns:
        p.error(f"--turns: {a.turns} turns need {a.turns} prompts, {a.prompts} has {len(prompts)} of {a.kinds}")
    pieces = [tokenizer(q["prompt"]).input_ids[-a.prompt_tokens:] for q in prompts]
    length = sum(len(x) for x in pieces) + a.turns * a.max_new_tokens + 16

    def make(cache: bool):
        return specdec.wrap(model, drafter=drafter, max_batch_size=1, max_length=length,
                            **(dict(prefix_cache=True) if cache else {}))

    warm = make(False), make(True)
    for e in warm:  # compile-once work and first-call allocations, outside the timings
        run_turn(e, pieces[0], 4)
    names = ("no cache", "cache")
    ttft = {n: [[] for _ in range(a.turns)] for n in names}
    total = {n: [[] for _ in range(a.turns)] for n in names}
    stats: list[dict] = []
    identical, history_tokens, cache_info = True, [], None
    for rep in range(a.repeats):
        engines = dict(zip(names, (make(False), make(True))))
        hist = {n: [] for n in names}
        for t in range(a.turns):
            order = names if (rep + t) % 2 == 0 else names[::-1]  # interleaved, alternating which goes first
            outs = {}
            for n in order:
                ids = hist[n] + pieces[t]
                new, first, whole, st = run_turn(engines[n], ids, a.max_new_tokens)
                ttft[n][t].append(first)
                total[n][t].append(whole)
                hist[n] = ids + new
                outs[n] = new
                if n == "cache" and rep == 0:
                    stats.append(st)
            identical &= outs["cache"] == outs["no cache"]
            if rep == 0:
                history_tokens.append(len(hist["no cache"]) - len(outs["no cache"]))
        if rep == 0:
            cache_info = engines["cache"].prefix_cache.describe()
    rows = []
    for t in range(a.turns):
        med = {n: (statistics.median(ttft[n][t]), statistics.median(total[n][t])) for n in names}
        rows.append(dict(turn=t + 1, prompt_tokens=history_tokens[t], cached_tokens=stats[t]["cached_tokens"],
                         ttft_s={n: med[n][0] for n in names}, total_s={n: med[n][1] for n in names},
                         ttft_ratio=med["no cache"][0] / med["cache"][0],
                         total_ratio=med["no cache"][1] / med["cache"][1],
                         spread_ttft=max(common.spread(ttft[n][t]) for n in names),
                         samples_ttft_s={n: ttft[n][t] for n in names},
                         samples_total_s={n: total[n][t] for n in names}))
    print(f"prefix cache, {a.model} ({drafter}), {a.turns} turns, new prompt <= {a.prompt_tokens} tokens, "
          f"{a.max_new_tokens} new per turn, threads {threads}, medians of {a.repeats}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT no cache':>14} {'TTFT cache':>11} {'ratio':>6} "
          f"{'total no cache':>15} {'total cache':>12} {'ratio':>6} {'spread':>7}")
    for r in rows:
        ms = {k: {n: v * 1e3 for n, v in r[k].items()} for k in ("ttft_s", "total_s")}
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {ms['ttft_s']['no cache']:>11.1f} ms"
              f" {ms['ttft_s']['cache']:>8.1f} ms {r['ttft_ratio']:>6.2f} {ms['total_s']['no cache']:>12.1f} ms"
              f" {ms['total_s']['cache']:>9.1f} ms {r['total_ratio']:>6.2f} {r['spread_ttft']:>7.2f}")
    late = [r for r in rows if r["turn"] >= 4]
    summary = dict(ttft_ratio_min_turns_4_on=min((r["ttft_ratio"] for r in late), default=None),
                   total_ratio_min_turns_4_on=min((r["total_ratio"] for r in late), default=None),
                   hit_rate=sum(s["cached_tokens"] for s in stats) / max(1, sum(s["prompt_tokens"] for s in stats)))
    late_note = "" if not late else (f"; turns 4+: TTFT ratio >= {summary['ttft_ratio_min_turns_4_on']:.2f}, total "
                                     f"ratio >= {summary['total_ratio_min_turns_4_on']:.2f}")
    print(f"identical outputs: {identical}; prompt tokens from the cache: {summary['hit_rate']:.1%}; cache after the "
          f"first repeat: {cache_info['entries']} entries, {cache_info['bytes'] / 2 ** 20:.1f} MiB" + late_note)
    if any(r["spread_ttft"] > 0.25 for r in rows):
        print("note: a turn's TTFT spread ((p90 - p10) / median over repeats) exceeds 25%: a noisy machine")
    res = dict(model=a.model, drafter=a.drafter, turns=a.turns, prompt_tokens=a.prompt_tokens,
               max_new_tokens=a.max_new_tokens, repeats=a.repeats, threads=threads, identical=identical,
               machine=common.machine_info("cpu"), cache=cache_info, rows=rows, **summary)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
