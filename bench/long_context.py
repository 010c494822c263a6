"""Long contexts: time to first token, decode ms per token, tau and the drafter's share of a round against the
context length, for plain decoding and every drafter.

    python bench/long_context.py --json bench/results/long_context_cpu.json --plot bench/results/long_context_cpu.png
    python bench/long_context.py --clock cpu --json lc.json --plot lc.png   # a shared machine: CPU times shown
    python bench/long_context.py --contexts 1024,16384 --drafters none,dspark --repeats 5
    python bench/long_context.py --contexts 1024,4096,16384 --prompts code-2,code-7,code-12   # a steadier tau
    python bench/long_context.py --contexts 65536 --drafters none,dspark --long-from 0
    python bench/long_context.py --contexts 16384 --drafters none,eagle --drafter-options '{"context_window": 0}'

Contexts (`--contexts`, tokens): the embedded model's held-out standard-library sources (`train_embedded.corpus`'s
held-out files: never trained on, real code), concatenated in name order, followed by a held-out benchmark prompt
(an id of the model's prompts.jsonl: the lines before a `def`, whose continuation the model writes). A context is
the last `n` tokens of that text, so it ends with the prompt; the prompt's own source file is left out of the
filler, so no drafter finds its continuation verbatim earlier in the context. Real held-out code gives tau as
drafters meet it (random ids would give none), without the copy-from-context a repeated prompt would hand to prompt
lookup. tau depends on the text the model writes: `--prompts` takes several ids, each context then measured once
ending with each prompt, pooled (more prompts: a steadier tau, a prefill each).

For each context and drafter (`--drafters`; `none` is plain decoding, `drafter=None`): an engine of one lane whose
`max_length` is the context + `--new-tokens` + a verify window, one short untimed generate (a warm-up), then
`--repeats` rounds of greedy generates of the whole context per prompt, `--new-tokens` each (no early stop), each
from a fresh prefill; a repeat pools its prompts (times, tokens and rounds summed; time to first token their mean).
The drafters' repeats at one context interleave (repeat i of every drafter, then repeat i + 1, the order rotated
each time), so a machine whose speed drifts during the run moves plain decoding's times with the drafters'.
A streamer notes the wall clock and the process's CPU time (`time.process_time`: user + system, every thread of
the process) at every token the engine emits:
    - time to first token (`ttft_s`, `ttft_cpu_s`): from the call to the first new token: the fresh prefill of the
      context, the drafter's read of it, the first token's draw (what a user waits for);
    - decode (`ms_per_token`, `cpu_ms_per_token`): from the first new token to the last, over the tokens in between:
      the rounds alone (draft, verify, accept, commit, the drafter's observe, bookkeeping), no prefill in it (the
      clock excludes the prefill, where a prefix cache would add its own work to every round);
    - `tau`: tokens per round (`stats.tokens / stats.rounds`); per round `round_ms` / `round_cpu_ms` (decode time
      / rounds), and by the engine's own timers (wall clock, `stats.timings` over `stats.rounds`) `draft_ms` and
      `verify_ms` (verify with accept and commit), `rest_ms` = round_ms - draft - verify (the drafter's observe,
      bookkeeping) and `draft_share` = draft / (draft + verify);
    - against plain decoding at the same context: `speedup` (`speedup_cpu`) = plain ms/token / this ms/token,
      `speedup_all` (`speedup_cpu_all`) the same of each repeat (plain's repeat i against this one's: they ran in
      turn),
      `round_vs_plain_step` (`_cpu`) = round ms / plain ms per token.
With one torch thread the CPU time is the work itself: on a machine whose cores other processes share it leaves out
the time spent waiting for a core, which the wall clock counts (`--clock` picks which the table and the plot show;
the JSON holds both). Figures are medians over the repeats (`*_all`: every repeat); `spread` (`cpu_spread`) is
(p90 - p10) / median of ms/token. `tokens`: the new tokens of the first repeat, per prompt; `identical` says every
repeat gave them and `identical_to_plain` that they equal plain decoding's at that context (greedy is lossless:
they must).

Contexts of `--long-from` tokens and more run only the drafters of `--long-drafters` (default 65536 and up: plain
and dspark, the best drafter of drafters/best.txt); `--long-from 0` runs every drafter everywhere.
One torch thread unless `--threads` says otherwise. `--plot` draws ms/token (and time to first token) against the
context on a log axis, one line per drafter (needs matplotlib: pip install 'specdec[bench]').
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
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

DRAFTERS = "none,ngram,mtp,eagle,dspark"
CONTEXTS = "1024,4096,16384,65536"


# ---- the context -------------------------------------------------------------------------------------
def find_prompt(model_dir: Path, prompt_id: str) -> dict:
    """The record `prompt_id` of the model's held-out prompts (`prompts.jsonl` beside the weights, else
    bench/data's); ValueError naming the ids there when it is not one of them."""
    path = model_dir / "prompts.jsonl"
    recs = common.load_prompts(path if path.is_file() else common.PROMPTS, ["code", "prose"], None)
    for rec in recs:
        if rec["id"] == prompt_id:
            return rec
    raise ValueError(f"no prompt {prompt_id!r} (there are {', '.join(r['id'] for r in recs)})")


def context_ids(tokenizer, n: int, prompt: dict) -> tuple[list[int], list[str]]:
    """-> (the last `n` token ids of: held-out standard-library files in name order, then `prompt`'s text; the files
    whose tokens are in it). The prompt's own file is left out. ValueError when the files hold too few tokens."""
    tail = tokenizer(prompt["prompt"])["input_ids"]
    ids: list[int] = []
    parts: list[tuple[str, int]] = []  # (file, its tokens)
    for name, text in held_out_code(prompt.get("source")):
        if len(ids) + len(tail) >= n:
            break
        x = tokenizer(text + "\n\n")["input_ids"]
        ids += x
        parts.append((name, len(x)))
    ids += tail
    if len(ids) < n:
        raise ValueError(f"the held-out sources hold {len(ids)} tokens, {n} asked")
    cut, files = len(ids) - n, []  # files wholly before the window are not in the context
    for name, m in parts:
        if cut < m:
            files.append(name)
        cut = max(0, cut - m)
    return ids[-n:], files


@functools.lru_cache(maxsize=None)
def held_out_code(leave_out: str | None) -> tuple[tuple[str, str], ...]:
    """(name, text) of the embedded model's held-out standard-library files (`train_embedded.corpus`), in name
    order, without `leave_out`."""
    from specdec.train_embedded import corpus

    _, held = corpus()
    return tuple((k, held[k]) for k in sorted(held) if not k.startswith("topic:") and k != leave_out)


def ids_hash(ids: list[int]) -> str:
    """A context's fingerprint in the JSON (the ids themselves would be long)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


# ---- the measurement ---------------------------------------------------------------------------------
class Clock:
    """A streamer that notes the wall clock and the process's CPU time at every put: the prompt first (after the
    prefill), then each round's new tokens."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def put(self, x) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self) -> None:
        pass


def measure_once(engine, contexts: dict[str, torch.Tensor], new_tokens: int, tokens: dict[str, list[int]]) -> dict:
    """One repeat: one greedy generate of each context `{prompt id: ids [n]}`, `new_tokens` new tokens each, each from
    a fresh prefill, pooled (times and tokens summed, time to first token their mean): time to first token, decode ms
    per token, tau and per-round parts, on the wall clock and in CPU time (see the module's docstring). Each
    context's new tokens go to `tokens` (the first repeat's kept); `identical` says this repeat's equal them."""
    tot = dict.fromkeys(("ttft", "ttft_cpu", "decode", "decode_cpu", "steps", "rounds", "tokens", "draft", "verify"),
                        0.0)
    identical = True
    for pid, ids in contexts.items():
        clock = Clock()
        t0, c0 = time.perf_counter(), time.process_time()
        res = engine.generate(ids, max_new_tokens=new_tokens, eos_token_id=None, do_sample=False, streamer=clock)
        out = res.sequences[0, ids.numel():].tolist()
        identical &= tokens.setdefault(pid, out) == out
        st = res.stats
        # [0]: the prompt, put after the prefill; [1]: the first new token; [-1]: the last round's tokens
        for k, v in (("ttft", clock.wall[1] - t0), ("ttft_cpu", clock.cpu[1] - c0),
                     ("decode", clock.wall[-1] - clock.wall[1]), ("decode_cpu", clock.cpu[-1] - clock.cpu[1]),
                     ("steps", len(out) - 1), ("rounds", st.rounds), ("tokens", st.tokens),
                     ("draft", st.timings["draft"]), ("verify", st.timings["verify"])):
            tot[k] += v
    rounds, steps, n = max(tot["rounds"], 1), max(tot["steps"], 1), len(contexts)
    round_ms = tot["decode"] / rounds * 1e3
    d_v = tot["draft"] + tot["verify"]
    return dict(ttft_s=tot["ttft"] / n, ttft_cpu_s=tot["ttft_cpu"] / n, ms_per_token=tot["decode"] / steps * 1e3,
                cpu_ms_per_token=tot["decode_cpu"] / steps * 1e3, tau=tot["tokens"] / rounds, rounds=int(tot["rounds"]),
                round_ms=round_ms, round_cpu_ms=tot["decode_cpu"] / rounds * 1e3, draft_ms=tot["draft"] / rounds * 1e3,
                verify_ms=tot["verify"] / rounds * 1e3, rest_ms=round_ms - d_v / rounds * 1e3,
                draft_share=tot["draft"] / d_v if d_v else 0.0, identical=identical)


def summarize(rows: list[dict], tokens: dict[str, list[int]]) -> dict:
    """Medians over the repeats `rows` (`measure_once`'s), every repeat's ms/token, time to first token and tau
    beside them (`*_all`), the spreads, the first repeat's tokens, and whether every repeat's equal them."""
    keys = [k for k in rows[0] if k != "identical"]
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    every = {f"{k}_all": [r[k] for r in rows] for k in ("ms_per_token", "cpu_ms_per_token", "ttft_s", "ttft_cpu_s",
                                                          "tau")}
    return dict(med, **every, spread=common.spread(every["ms_per_token_all"]),
                cpu_spread=common.spread(every["cpu_ms_per_token_all"]), tokens=tokens,
                identical=all(r["identical"] for r in rows))


def run_context(model, drafters: dict[str, str | None], contexts: dict[str, torch.Tensor], a) -> dict:
    """Every drafter of `drafters` `{name: drafter argument}` at one context length: an engine each (one lane,
    max_length the longest context + new tokens + a verify window), warmed up once, then `--repeats` repeats
    interleaved: repeat i runs every engine once (`measure_once`), in turn, the order rotated by one each repeat,
    so a machine whose speed drifts shifts every drafter's repeats alike, not one drafter's. -> `{name:
    summarize(...)}`."""
    longest = max(ids.numel() for ids in contexts.values())
    engines = {}
    for name, drafter in drafters.items():
        options = a.options if drafter is not None else {}  # `--drafter-options`: the drafters', not plain decoding's
        engines[name] = engine = specdec.wrap(model, drafter=drafter, max_batch_size=1,
                                              max_length=longest + a.new_tokens + 64, **options)
        ids = next(iter(contexts.values()))
        engine.generate(ids[-min(ids.numel(), 64):], max_new_tokens=min(8, a.new_tokens), eos_token_id=None,
                        do_sample=False)  # warm-up: lazily built buffers and kernels
    names = list(engines)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in names}
    for i in range(a.repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            rows[name].append(measure_once(engines[name], contexts, a.new_tokens, tokens[name]))
    engines.clear()
    return {name: summarize(rows[name], tokens[name]) for name in names}


def compare(rows: dict) -> None:
    """Set each drafter against plain decoding at the same context: speedups, round cost, identical output."""
    plain = rows.get("none")
    for r in rows.values():
        if plain is None:
            r.update(speedup=None, speedup_cpu=None, speedup_all=None, speedup_cpu_all=None, round_vs_plain_step=None,
                     round_vs_plain_step_cpu=None, identical_to_plain=None)
            continue
        r["speedup"] = plain["ms_per_token"] / r["ms_per_token"]
        r["speedup_cpu"] = plain["cpu_ms_per_token"] / r["cpu_ms_per_token"]
        for key, ms in (("speedup_all", "ms_per_token_all"), ("speedup_cpu_all", "cpu_ms_per_token_all")):
            r[key] = [p / m for p, m in zip(plain[ms], r[ms])]
        r["round_vs_plain_step"] = r["round_ms"] / plain["ms_per_token"]
        r["round_vs_plain_step_cpu"] = r["round_cpu_ms"] / plain["cpu_ms_per_token"]
        r["identical_to_plain"] = r["tokens"] == plain["tokens"]


# ---- output ------------------------------------------------------------------------------------------
CLOCK_KEYS = {"wall": dict(ttft="ttft_s", ms="ms_per_token", spread="spread", speedup="speedup", round="round_ms"),
              "cpu": dict(ttft="ttft_cpu_s", ms="cpu_ms_per_token", spread="cpu_spread", speedup="speedup_cpu",
                          round="round_cpu_ms")}


def table(result: dict, clock: str) -> str:
    """The measured rows, their times on `clock` ("wall" or "cpu"). The drafter's part of a round is the engine's
    own timers' (wall clock) draft / (draft + verify); their milliseconds are shown on the wall clock only."""
    k = CLOCK_KEYS[clock]
    wall = clock == "wall"
    head = (f"{'context':>8} {'drafter':8s} {'TTFT s':>8} {'ms/token':>9} {'spread':>7} {'speedup':>8} {'tau':>6} "
            f"{'round ms':>9} " + (f"{'draft':>7} {'verify':>7} " if wall else "") +
            f"{'draft/(d+v)':>11} {'identical':>9}")
    lines = [f"times: {'wall clock' if wall else 'CPU time of the process'}", head]
    for c, ctx in result["contexts"].items():
        for name, r in ctx["drafters"].items():
            sp = "" if r[k["speedup"]] is None else f"{r[k['speedup']]:.2f}x"
            same = "" if r["identical_to_plain"] is None else str(r["identical_to_plain"] and r["identical"])
            parts = f"{r['draft_ms']:7.2f} {r['verify_ms']:7.2f} " if wall else ""
            lines.append(f"{c:>8} {name:8s} {r[k['ttft']]:8.2f} {r[k['ms']]:9.2f} {r[k['spread']]:7.2f} {sp:>8} "
                         f"{r['tau']:6.2f} {r[k['round']]:9.2f} {parts}{r['draft_share']:11.2f} {same:>9}")
    return "\n".join(lines)


def plot(result: dict, path: str, clock: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, float]]] = {}
    for c, ctx in result["contexts"].items():
        for name, r in ctx["drafters"].items():
            series.setdefault(name, []).append((int(c), r[CLOCK_KEYS[clock]["ms"]], r[CLOCK_KEYS[clock]["ttft"]]))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, pts in series.items():
        pts.sort()
        xs = [p[0] for p in pts]
        label = "plain" if name == "none" else name
        ax.plot(xs, [p[1] for p in pts], marker="o", label=label)
        bx.plot(xs, [p[2] for p in pts], marker="o", label=label)
    m = result["machine"]
    ticks = sorted({int(c) for c in result["contexts"]})
    which = "CPU time" if clock == "cpu" else "wall clock"
    for axis, what in ((ax, f"decode ms per token ({which})"), (bx, f"time to first token, s ({which})")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in ticks])
        axis.minorticks_off()
        axis.set_xlabel("context tokens")
        axis.set_ylabel(what)
        axis.grid(True, which="both", alpha=0.3)
    bx.set_yscale("log")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.suptitle(f"long contexts, {result['model_name']}, {result['new_tokens']} new tokens, median of "
                 f"{result['repeats']}, {m['cpu']}, {result['threads']} thread(s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory or 'embedded'")
    p.add_argument("--contexts", default=CONTEXTS, help="context lengths in tokens (comma list)")
    p.add_argument("--drafters", default=DRAFTERS, help="none (plain), ngram, or trained drafters (comma list)")
    p.add_argument("--long-from", type=int, default=65536, help="contexts of this many tokens and more run only "
                                                                "--long-drafters (0: every drafter everywhere)")
    p.add_argument("--long-drafters", default="none,dspark")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", default="code-2", help="held-out prompts (ids, comma list): each context is measured "
                                                       "once ending with each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="the times the table and the plot show (the JSON holds both)")
    p.add_argument("--drafter-options", default="{}", metavar="JSON",
                   help="options for every drafter but plain decoding (specdec.wrap's drafter options), a JSON object")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, metavar="OUT.png", help="ms/token against the context (needs matplotlib)")
    a = p.parse_args(argv)
    try:
        a.options = json.loads(a.drafter_options)
    except ValueError:
        a.options = None
    if not isinstance(a.options, dict):
        p.error(f"--drafter-options: expected a JSON object, got {a.drafter_options!r}")
    try:
        contexts = sorted({int(x) for x in common.split_list(a.contexts)})
    except ValueError:
        p.error(f"--contexts: expected a comma list of ints, got {a.contexts!r}")
    if not contexts or contexts[0] < 2:
        p.error(f"--contexts: expected lengths >= 2, got {a.contexts!r}")
    if a.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {a.repeats}")
    if a.new_tokens < 2:
        p.error(f"--new-tokens: expected >= 2 (decode is timed between the first new token and the last), "
                f"got {a.new_tokens}")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed: pip install 'specdec[bench]' (or pip install "
                "matplotlib), or leave out --plot")
    model_dir = common.input_args(p, a.model)
    names = common.split_list(a.drafters)
    long_names = common.split_list(a.long_drafters)
    if not names:
        p.error("--drafters: expected at least one name")
    args: dict[str, str | None] = {}
    skipped: dict[str, str] = {}
    for name in dict.fromkeys(names):
        if name == "none":
            args[name] = None
            continue
        path, why = common.resolve_drafter(model_dir, name)
        if path is None:
            skipped[name] = why
        else:
            args[name] = path
    try:
        prompts = [find_prompt(model_dir, pid) for pid in dict.fromkeys(common.split_list(a.prompts))]
    except ValueError as e:
        p.error(f"--prompts: {e}")
    if not prompts:
        p.error("--prompts: expected at least one id")

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = timing.torch_threads(model, a.threads)
    result = {"machine": common.machine_info("cpu"), "threads": threads, "args": vars(a), "model": str(model_dir),
              "model_name": a.model, "new_tokens": a.new_tokens, "repeats": a.repeats,
              "prompts": [{k: pr.get(k) for k in ("id", "kind", "source")} for pr in prompts], "skipped": skipped,
              "contexts": {}}
    ends = ", ".join(f"{pr['id']} ({pr.get('source')})" for pr in prompts)
    print(f"long_context, {a.model}, threads {threads}, {a.new_tokens} new tokens, median of {a.repeats}, contexts "
          f"ending with the prompts {ends}", flush=True)
    for why in skipped.values():
        print(f"skipped: {why}")
    for c in contexts:
        built = {pr["id"]: context_ids(tokenizer, c, pr) for pr in prompts}
        ctx = result["contexts"][str(c)] = {"prompts": {pid: {"ids_sha256": ids_hash(ids), "files": files}
                                                        for pid, (ids, files) in built.items()}, "drafters": {}}
        ids_t = {pid: torch.tensor(ids) for pid, (ids, _) in built.items()}
        here = {name: arg for name, arg in args.items() if c < a.long_from or name in long_names}
        for name, r in run_context(model, here, ids_t, a).items():
            ctx["drafters"][name] = r
            print(f"{c:>7} {name:8s} TTFT {r['ttft_s']:8.2f} s (CPU {r['ttft_cpu_s']:.2f} s), {r['ms_per_token']:8.2f} "
                  f"ms/token (CPU {r['cpu_ms_per_token']:.2f}, spread {r['spread']:.2f}), tau {r['tau']:.2f}, round "
                  f"{r['round_ms']:.2f} ms (draft {r['draft_ms']:.2f}, verify {r['verify_ms']:.2f})", flush=True)
        compare(ctx["drafters"])
        if a.json:  # what is measured so far, in case a later context does not finish
            Path(a.json).write_text(json.dumps(result, indent=1))
    print()
    print(table(result, a.clock))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    if a.plot:
        plot(result, a.plot, a.clock)
    return result


if __name__ == "__main__":
    main()
