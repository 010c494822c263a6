"""Memory against the workload: prefix-cache bytes against a conversation's length, requests at once under one
budget, and the decode cost of reading KV through pages.

    python bench/memory_scale.py                                     # (a), (b), (c) on the embedded model
    python bench/memory_scale.py --parts c --json c.json             # (c) alone
    python bench/ab.py --old 19bfdf4 --rounds 3 --metric 'decode.*.ms_per_token' -- memory_scale.py --parts c

(a) One conversation grows turn by turn (each turn resends the whole history plus a new message of
    `--message-tokens`, as a chat client does) with `prefix_cache=True`; at each length of `--conv-lengths` the
    cache's bytes, its entries, and the bytes of the distinct KV the conversation holds (tokens x a token's KV
    bytes): the cache copies its prefix's KV into every entry, so its bytes grow as tokens x entries.
(b) `--requests` requests, `--long-share` of them `--long` tokens and the rest `--short`, `--max-new-tokens` each,
    under one budget of `--budget-mib`: with `memory=` (pages, a request admitted when its worst case fits) against
    a static reservation of `max_length` per lane in the same KV bytes (the lanes that fit). Requests running at
    once (most and mean rows per round), wall time and new tokens per second; the outputs must be identical.
(c) Plain decoding (`drafter=None`) at contexts of `--contexts` tokens: ms per new token, the prefill excluded
    (the call's draft + verify time over its new tokens), median of `--repeats`. Against the contiguous KV
    buffers of an older revision through bench/ab.py (the command above; 19bfdf4 is the last before pages).
"""

from __future__ import annotations

import argparse
import inspect
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

MiB = 1 << 20


def text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of standard-library source (modules concatenated until there are enough), from `offset`."""
    import argparse as a1, collections as a2, inspect as a3, json.decoder as a4, tarfile as a5, typing as a6
    ids: list[int] = []
    for mod in (a1, a2, a3, a4, a5, a6) * 8:
        ids += tokenizer(inspect.getsource(mod))["input_ids"]
        if len(ids) >= n + offset:
            break
    if len(ids) < n + offset:
        raise ValueError(f"only {len(ids)} tokens of source text, {n + offset} asked")
    return ids[offset:offset + n]


def rows_per_round(engine) -> list[int]:
    """The rows of every round `engine` runs, recorded as it runs them."""
    rows, inner = [], engine._round
    engine._round = lambda active, *a, **k: (rows.append(len(active)), inner(active, *a, **k))[1]
    return rows


def part_a(model, tokenizer, a) -> dict:
    lengths = [int(x) for x in common.split_list(a.conv_lengths)]
    engine = specdec.wrap(model, drafter=a.drafter, max_batch_size=1, max_length=max(lengths) + 1024,
                          prefix_cache=4 << 30)  # no eviction up to 32k tokens
    from specdec.kv_cache import token_bytes
    per_token = token_bytes(engine.memory_plan.parts["KV cache"])
    hist, out, offset = [], [], 0
    for target in lengths:
        while len(hist) < target:
            msg = text_ids(tokenizer, a.message_tokens, offset)
            offset += a.message_tokens
            res = engine.generate(torch.tensor(hist + msg), max_new_tokens=a.reply_tokens, eos_token_id=None)
            hist = res.sequences[0].tolist()
        d = engine.prefix_cache.describe()
        out.append(dict(tokens=len(hist), entries=d["entries"], cache_bytes=d["bytes"],
                        distinct_kv_bytes=len(hist) * per_token, kv_copies=sum(
                            e.length for _, e in engine.prefix_cache.entries()) * per_token))
    print(f"(a) prefix cache against a conversation's length ({a.drafter}, messages of {a.message_tokens} tokens, "
          f"replies of {a.reply_tokens})")
    print(f"{'tokens':>7} {'entries':>8} {'cache MiB':>10} {'KV copies MiB':>14} {'distinct KV MiB':>16} {'ratio':>6}")
    for r in out:
        print(f"{r['tokens']:>7} {r['entries']:>8} {r['cache_bytes'] / MiB:>10.1f} {r['kv_copies'] / MiB:>14.1f} "
              f"{r['distinct_kv_bytes'] / MiB:>16.2f} {r['kv_copies'] / r['distinct_kv_bytes']:>6.1f}")
    return {"rows": out, "kv_bytes_per_token": per_token}


def part_b(model, tokenizer, a) -> dict:
    n_long = max(1, round(a.requests * a.long_share))
    sizes = [a.long if i % max(1, a.requests // n_long) == 0 and i // max(1, a.requests // n_long) < n_long
             else a.short for i in range(a.requests)]
    prompts = [text_ids(tokenizer, s, 97 * i) for i, s in enumerate(sizes)]
    cap = a.long + a.max_new_tokens
    budget = int(a.budget_mib * MiB)
    paged = specdec.wrap(model, drafter=a.drafter, max_batch_size=a.requests, max_length=cap, memory=budget)
    plan = paged.memory_plan
    kv = plan.parts["KV cache"]
    pages_bytes = sum(s.nbytes for s in kv.values() if len(s.shape) == 4)
    per_lane = None
    lanes = 0
    for lanes_try in range(a.requests, 0, -1):  # the most lanes whose static reservation fits the same bytes
        probe = specdec.wrap(model, drafter=a.drafter, max_batch_size=lanes_try, max_length=cap, cpu_linear="aten")
        held = sum(s.nbytes for s in probe.memory_plan.parts["KV cache"].values() if len(s.shape) == 4)
        other = probe.memory_plan.total - held
        if held + other <= budget:
            lanes, per_lane = lanes_try, held / lanes_try
            break
        del probe
    if lanes == 0:
        raise SystemExit(f"(b): a budget of {a.budget_mib} MiB holds no lane of max_length {cap} reserved")
    static = specdec.wrap(model, drafter=a.drafter, max_batch_size=lanes, max_length=cap)
    res = {}
    outs = {}
    for name, eng in (("paged", paged), ("static", static)):
        rows = rows_per_round(eng)
        t0 = time.perf_counter()
        out = eng.generate([torch.tensor(p) for p in prompts], max_new_tokens=a.max_new_tokens, eos_token_id=None)
        wall = time.perf_counter() - t0
        new = sum(out.new_token_counts)
        outs[name] = out.sequences
        res[name] = dict(lanes=eng.config.max_batch_size, most_at_once=max(rows), mean_at_once=statistics.mean(rows),
                         wall_s=wall, tokens_per_s=new / wall, rounds=len(rows))
    identical = torch.equal(outs["paged"], outs["static"])
    print(f"(b) {a.requests} requests ({n_long} of {a.long} tokens, the rest {a.short}), {a.max_new_tokens} new each, "
          f"{a.budget_mib} MiB: pages ({pages_bytes / MiB:.1f} MiB of KV pages) against a static reservation of "
          f"{cap} tokens per lane ({per_lane / MiB:.1f} MiB a lane)")
    print(f"{'':>7} {'lanes':>6} {'most at once':>13} {'mean at once':>13} {'wall s':>8} {'tokens/s':>9}")
    for name, r in res.items():
        print(f"{name:>7} {r['lanes']:>6} {r['most_at_once']:>13} {r['mean_at_once']:>13.2f} {r['wall_s']:>8.1f} "
              f"{r['tokens_per_s']:>9.1f}")
    print(f"identical outputs: {identical}")
    return {"budget_bytes": budget, "kv_page_bytes": pages_bytes, "reservation_per_lane_bytes": per_lane,
            "sizes": sizes, "identical": identical, **res}


def part_c(model, tokenizer, a) -> dict:
    contexts = [int(x) for x in common.split_list(a.contexts)]
    engine = specdec.wrap(model, drafter=None, max_batch_size=1, max_length=max(contexts) + a.decode_tokens + 8)
    engine.generate(torch.tensor(text_ids(tokenizer, 64)), max_new_tokens=4, eos_token_id=None)  # warm
    out = {}
    for c in contexts:
        ids = torch.tensor(text_ids(tokenizer, c))
        per = []
        for _ in range(a.repeats):
            res = engine.generate(ids, max_new_tokens=a.decode_tokens, eos_token_id=None)
            t = res.stats.timings
            per.append((t["draft"] + t["verify"]) / a.decode_tokens * 1e3)
        out[str(c)] = dict(ms_per_token=statistics.median(per), spread=common.spread(per), samples_ms=per)
    print(f"(c) plain decoding, ms per new token ({a.decode_tokens} new, prefill excluded, median of {a.repeats})")
    for c, r in out.items():
        print(f"{c:>7} tokens: {r['ms_per_token']:7.2f} ms/token (spread {r['spread']:.2f})")
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--parts", default="a,b,c")
    p.add_argument("--drafter", default="ngram", help="(a) and (b): ngram, or none")
    p.add_argument("--conv-lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--message-tokens", type=int, default=512)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--long", type=int, default=16384)
    p.add_argument("--short", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget-mib", type=float, default=160)
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    parts = common.split_list(a.parts)
    if not parts or set(parts) - {"a", "b", "c"}:
        p.error(f"--parts: expected a comma list of a, b, c, got {a.parts!r}")
    if a.repeats < 3:
        p.error(f"--repeats: expected >= 3 (a median of at least 3), got {a.repeats}")
    a.drafter = None if a.drafter == "none" else a.drafter
    model_dir = common.input_args(p, a.model)
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = timing.torch_threads(model, a.threads)
    print(f"memory_scale, {a.model}, threads {threads}")
    result = {"machine": common.machine_info("cpu"), "threads": threads, "args": vars(a)}
    for part, fn, key in (("a", part_a, "conversation"), ("b", part_b, "workload"), ("c", part_c, "decode")):
        if part in parts:
            result[key] = fn(model, tokenizer, a)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
