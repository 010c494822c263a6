"""Aggregate throughput at several batch sizes: speculative decoding vs plain decoding, in one run.

    python bench/throughput.py                                  # embedded model, batch 1 / 8 / 32, mtp + ngram
    python bench/throughput.py --batch-sizes 1,2 --drafters ngram --max-new-tokens 8 --repeats 1 --json out.json

Every batch size serves the same workload: the first `--requests` prompts of `--prompts` (default: twice the
largest batch size; round-robin over `--kinds`, as in bench/accept_rate.py; cycling when there are fewer), cut to their
first `--prompt-tokens` tokens and generated greedily for `--max-new-tokens` tokens (no early stop at EOS). At
batch size B the specdec modes serve them in one `generate` call with `max_batch_size=B`: B requests in flight,
a finished request's lane refilled from the queue before the next round (continuous batching, as a server
would; `--batching calls`: `generate` calls of B prompts one after the other, where a batch runs until its
slowest request ends). Batch 1 is one request at a time either way, so `xB1` compares serving the same requests
batched and one by one. The modes:

- each drafter of `--drafters`: `specdec.wrap(model, drafter=D, max_batch_size=B)` (`ngram` is prompt lookup;
  other names are trained drafters in MODEL/drafters/NAME, reported as skipped when missing);
- `plain`: the same engine without a drafter (`drafter=None`), so every round verifies the anchor alone: plain
  decoding through the same runner, the baseline of `speedup`;
- `hf`: transformers' own `model.generate` (greedy, left-padded batch with its attention mask, the model's
  pure-torch layers), a second baseline; reported as not run, with the reason, when it fails.

tokens/s = new tokens of the whole workload / wall time of its calls. Every configuration (batch size and mode) is
built and warmed up once first, then all of them run `--repeats` times, interleaved across batch sizes and modes
(round-robin, the starting configuration rotating per repeat), so a change in the machine's load during the run
reaches every configuration alike; the table shows the median, the spread (max / min over the repeats), tau
(tokens per verify round, from the engine's stats), `busy` (rows per verify round / B: below 1 while a batch
drains at the end of the workload, when no request waits to refill a finished lane; spec decode's requests end in
different rounds, plain decoding's all in the same one, so the drain weighs on spec decode alone and less the more
requests the workload has), the speedup over `plain` at the same batch and the scaling `xB1` over batch 1 (same
mode), both the median of the ratios within each repeat.
The model runs on `--device` (cpu by default; on cuda in `--dtype`). `--cuda-graph` wraps every specdec mode, plain
decoding included, with `static_shapes=True, cuda_graph=True` (on a CPU, where `wrap` refuses CUDA graphs, with
`static_shapes=True` alone: the padded rounds a graph replays, run eagerly; `graph_mode` in the JSON's settings
says which); `speedup_vs_plain` is then over plain decoding with graphs, and each row also carries it as
`speedup_vs_plain_graph` (None without the flag). `speedup_vs_hf` is over transformers' generate.
Greedy speculative decoding is lossless: every spec run's output must equal the plain output token for token, or
the script exits with status 1, as it does when a specdec mode fails to run (the `hf` output is compared too, and
a difference or failure there is only reported).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import (PROMPTS, input_args, left_padded, load_prompts, machine_info, max_over_min,  # noqa: E402
                        resolve_drafter, split_list, sync)
finally:
    sys.path.pop(0)

import specdec  # noqa: E402
from specdec.hf_compat import transformers_generate  # noqa: E402

PLAIN, HF = "plain", "hf"


def digest(rows: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(row, new-token index) of the first difference between two batches of outputs, or None."""
    for r, (x, y) in enumerate(zip(a, b)):
        for i, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return r, i
        if len(x) != len(y):
            return r, min(len(x), len(y))
    return None if len(a) == len(b) else (min(len(a), len(b)), 0)


class Runner:
    """One mode at one batch size: `run()` -> (new tokens per row, seconds, tau or None)."""

    def __init__(self, mode, model, prompts, max_new, drafter=None, pad_token_id=None, engine_opts=None,
                 max_batch_size=None):
        self.mode, self.model, self.prompts, self.max_new = mode, model, prompts, max_new
        if mode == HF:
            ids, mask = left_padded(prompts, pad_token_id)
            self.width = ids.shape[1]
            self.device = next(model.parameters()).device
            self.ids, self.mask = ids.to(self.device), mask.to(self.device)
            self.pad = pad_token_id
        else:
            self.engine = specdec.wrap(model, drafter=drafter, max_batch_size=max_batch_size or len(prompts),
                                       **(engine_opts or {}))

    def run(self) -> tuple[list[list[int]], float, float | None]:
        if self.mode == HF:
            sync(self.device)
            t = time.perf_counter()
            out = transformers_generate(self.model, self.ids, attention_mask=self.mask, max_new_tokens=self.max_new,
                                        min_new_tokens=self.max_new, pad_token_id=self.pad)
            sync(self.device)
            dt = time.perf_counter() - t
            return out[:, self.width:].tolist(), dt, None
        t = time.perf_counter()
        out = self.engine.generate(self.prompts, max_new_tokens=self.max_new, eos_token_id=None)
        dt = time.perf_counter() - t
        self.last_stats = out.stats
        new = [out.sequences[i, len(p):len(p) + self.max_new].tolist() for i, p in enumerate(self.prompts)]
        return new, dt, out.stats.tau


class Workload:
    """One mode serving every prompt at batch B: `run()` as `Runner.run`, over all the calls (tau: tokens per
    verify round over all of them). specdec modes: one `generate` call of every prompt with max_batch_size B
    (continuous batching), or with `calls=True` calls of B prompts one after the other; transformers' generate
    always in calls of B (each call left-padded on its own)."""

    def __init__(self, mode, model, prompts, B, max_new, drafter=None, pad_token_id=None, engine_opts=None,
                 calls=False):
        chunks = [prompts[i:i + B] for i in range(0, len(prompts), B)]
        if mode != HF and not calls:
            chunks = [prompts]
        # one engine (and drafter) serves every call
        self.runners = [Runner(mode, model, c, max_new, drafter=drafter, pad_token_id=pad_token_id,
                               engine_opts=engine_opts, max_batch_size=B)
                        for c in (chunks if mode == HF else chunks[:1])]
        self.chunks, self.mode, self.max_new, self.B = chunks, mode, max_new, B
        self.busy = None  # lanes busy per verify round over the last run (specdec modes): rows / (rounds x B)

    def run(self) -> tuple[list[list[int]], float, float | None]:
        new, dt, tokens, rounds, steps = [], 0.0, 0, 0, 0
        for i, chunk in enumerate(self.chunks):
            r = self.runners[i if self.mode == HF else 0]
            r.prompts = chunk
            rows, t, tau = r.run()
            new, dt = new + rows, dt + t
            if tau is not None:
                st = r.last_stats
                tokens, rounds, steps = tokens + st.tokens, rounds + st.rounds, steps + st.steps
        self.busy = rounds / (steps * self.B) if steps else None
        return new, dt, (tokens / rounds if rounds else None) if self.mode != HF else None


def prepare_batch(B, modes, model, texts, tok, a, pad, engine_opts=None) -> tuple[dict, dict, dict, list[str]]:
    """-> ({mode: result}, {mode: workload}, {mode: warmup output}, errors): every mode at batch B built and run
    once untimed (first-call costs stay out of the timings)."""
    prompts = [tok(texts[i % len(texts)])["input_ids"][:a.prompt_tokens] for i in range(a.requests)]
    res: dict[str, dict] = {}
    runners: dict[str, Workload] = {}
    outputs: dict[str, list[list[int]]] = {}
    errors: list[str] = []
    for mode, drafter in modes.items():
        try:
            r = Workload(mode, model, prompts, B, a.max_new_tokens, drafter=drafter, pad_token_id=pad,
                         engine_opts=(engine_opts or {}).get(mode), calls=a.batching == "calls")
            new, _, _ = r.run()
        except Exception as e:  # noqa: BLE001 - a mode that does not run is reported, the rest go on
            first = (str(e).strip().splitlines() or [""])[0]
            res[mode] = {"skipped": f"failed: {type(e).__name__}: {first}"}
            print(f"# batch {B}, {mode}: not run ({res[mode]['skipped']})", file=sys.stderr)
            if mode != HF:  # only the transformers baseline may be missing
                errors.append(f"batch {B}, {mode}: {res[mode]['skipped']}")
            continue
        runners[mode], outputs[mode] = r, new
        res[mode] = {"tokens_per_s": [], "seconds": [], "new_tokens": sum(map(len, new)), "tau": None, "busy": None}
    return res, runners, outputs, errors


def run_interleaved(configs: dict, a) -> list[str]:
    """`a.repeats` timed runs of every (batch, mode) of `configs` ({key: (result, workload, warmup output)}),
    interleaved across batch sizes and modes (each repeat in a rotated order), so that a change in the machine's
    load over the run reaches every configuration alike. -> errors (an output that changed)."""
    errors: list[str] = []
    order = list(configs)
    for rep in range(a.repeats):
        k = rep % len(order) if order else 0
        for key in order[k:] + order[:k]:
            r, runner, ref = configs[key]
            new, dt, tau = runner.run()
            r["seconds"].append(dt)
            r["tokens_per_s"].append(sum(map(len, new)) / dt)
            r["tau"] = tau
            r["busy"] = runner.busy
            if new != ref:
                errors.append(f"batch {key[0]}, {key[1]}: repeat {rep} output differs from its warmup output")
    return errors


def finish_batch(B, res: dict, outputs: dict) -> list[str]:
    """Medians and spreads of batch B's timed runs, and each mode's output against plain decoding -> errors."""
    errors: list[str] = []
    for mode in outputs:
        r = res[mode]
        tps = r["tokens_per_s"]
        r["tokens_per_s_median"] = statistics.median(tps)
        r["spread"] = max_over_min(tps)
        r["output_sha256"] = digest(outputs[mode])
        r["new_tokens_per_row"] = sorted({len(o) for o in outputs[mode]})
    if PLAIN in outputs:
        ref = outputs[PLAIN]
        for mode in outputs:
            diff = first_difference(outputs[mode], ref)
            res[mode]["identical_to_plain"] = diff is None
            if diff is not None:
                msg = (f"batch {B}, {mode}: output differs from plain decoding (row {diff[0]}, first difference "
                       f"at new token {diff[1]})")
                if mode == HF:
                    print(f"WARNING: {msg}", file=sys.stderr)
                else:
                    errors.append(msg)
    return errors


def paired_ratio(r: dict, base: dict | None) -> float | None:
    """Median over the repeats of r's tokens/s over base's in the same repeat (the two ran minutes apart at
    most, under the same load)."""
    if base is None:
        return None
    return statistics.median(x / y for x, y in zip(r["tokens_per_s"], base["tokens_per_s"]))


def format_table(rows: list[dict]) -> str:
    head = (f"{'batch':>5s} {'mode':10s} {'tok/s':>9s} {'spread':>7s} {'tau':>5s} {'busy':>5s} {'vs plain':>9s} "
            f"{'xB1':>6s} {'same':>5s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"{r['batch']:5d} {r['mode']:10s} not run: {r['skipped']}")
            continue

        def f(v, spec, unit=""):
            return "-" if v is None else format(v, spec) + unit
        same = {True: "yes", False: "NO", None: "-"}[r.get("identical_to_plain")]
        lines.append(f"{r['batch']:5d} {r['mode']:10s} {r['tokens_per_s_median']:9.1f} {r['spread']:7.3f} "
                     f"{f(r['tau'], '5.2f'):>5s} {f(r.get('busy'), '5.2f'):>5s} "
                     f"{f(r['speedup_vs_plain'], '.2f', 'x'):>9s} "
                     f"{f(r['scaling_vs_batch1'], '.2f', 'x'):>6s} {same:>5s}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory (model + tokenizer) or 'embedded'")
    p.add_argument("--drafters", default="mtp,ngram",
                   help="comma-separated: ngram, or names of trained drafters under MODEL/drafters/")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompts", default=str(PROMPTS), help="JSONL prompt file")
    p.add_argument("--kinds", default="code,prose", help="comma-separated prompt kinds, taken round-robin")
    p.add_argument("--requests", type=int, default=None,
                   help="prompts every batch size serves (default: twice the largest batch size)")
    p.add_argument("--batching", choices=("continuous", "calls"), default="continuous",
                   help="specdec modes at batch B: one generate call, B in flight (continuous), or calls of B")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompts are cut to their first N tokens")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of every configuration (after one warmup)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)")
    p.add_argument("--draft-schedule", default=None, metavar="B:G[,B:G]",
                   help="also run every drafter with this draft-length schedule (wrap's draft_tokens_by_batch: from "
                        "batch B on, G drafts a round), as the mode DRAFTER@SCHEDULE")
    p.add_argument("--no-hf", action="store_true", help="leave out transformers' generate baseline")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="wrap every specdec mode (plain decoding too) with static_shapes=True, cuda_graph=True; on a "
                        "CPU static shapes alone")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    drafters, kinds = split_list(a.drafters), split_list(a.kinds)
    try:
        sizes = [int(x) for x in split_list(a.batch_sizes)]
    except ValueError:
        parser.error(f"--batch-sizes: expected comma-separated integers, got {a.batch_sizes!r}")
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        parser.error(f"--batch-sizes: expected distinct integers >= 1, got {a.batch_sizes!r}")
    if len(set(drafters)) != len(drafters) or {PLAIN, HF} & set(drafters):
        parser.error(f"--drafters: a drafter is named twice or is named {PLAIN!r} / {HF!r}: {a.drafters}")
    if not kinds:
        parser.error("--kinds: no kind named")
    schedule = None
    if a.draft_schedule:
        try:
            schedule = {int(b): int(g) for b, g in (x.split(":") for x in split_list(a.draft_schedule))}
            specdec.SpecConfig(draft_tokens_by_batch=schedule)
        except ValueError as e:
            parser.error(f"--draft-schedule: expected B:G[,B:G...], got {a.draft_schedule!r} ({e})")
    a.requests = 2 * max(sizes) if a.requests is None else a.requests
    for flag, val in (("--requests", a.requests), ("--prompt-tokens", a.prompt_tokens),
                      ("--max-new-tokens", a.max_new_tokens),
                      ("--repeats", a.repeats), ("--threads", a.threads)):
        if val < 1:
            parser.error(f"{flag}: expected >= 1, got {val}")
    model_dir = input_args(parser, a.model, a.prompts)
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    torch.set_num_threads(a.threads)

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        texts = [r["prompt"] for r in load_prompts(a.prompts, kinds, None)]
    except ValueError as e:
        parser.error(f"--prompts: {e}")
    if not texts:
        parser.error(f"--prompts: no prompt of kinds {kinds} in {a.prompts}")
    pad = specdec.wrap(model, drafter=None, max_batch_size=1).pad_token_id
    graph_mode = ("graph" if a.device == "cuda" else "static") if a.cuda_graph else None
    graph = {"static_shapes": True, "cuda_graph": graph_mode == "graph"} if graph_mode else {}

    modes: dict = {}
    skipped: dict[str, str] = {}
    for name in drafters:
        arg, why = resolve_drafter(model_dir, name)
        if arg is None:
            skipped[name] = why
        else:
            modes[name] = arg
    engine_opts = {name: dict(graph) for name in modes}
    if schedule:
        for name in list(modes):
            sched_mode = f"{name}@{a.draft_schedule}"
            modes[sched_mode] = modes[name]
            engine_opts[sched_mode] = {"draft_tokens_by_batch": schedule, **graph}
    modes[PLAIN] = None  # drafter=None: plain decoding
    engine_opts[PLAIN] = dict(graph)
    if not a.no_hf:
        modes[HF] = None

    print(f"# bench/throughput.py: {a.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"{a.dtype}, {a.device}), greedy, {a.requests} requests at every batch size ({a.batching} batching), prompts "
          f"cut to {a.prompt_tokens} "
          f"tokens, {a.max_new_tokens} new tokens, "
          f"{a.repeats} repeats (medians), torch threads {torch.get_num_threads()}"
          + (f", draft schedule {schedule} in the DRAFTER@ modes" if schedule else "")
          + {None: "", "graph": ", every specdec mode with CUDA graphs (plain decoding too)",
             "static": ", every specdec mode with static shapes (plain decoding too; no CUDA graphs on a CPU)"}[
              graph_mode], flush=True)
    rows: list[dict] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    prepared = {}
    for B in sizes:
        prepared[B] = prepare_batch(B, modes, model, texts, tok, a, pad, engine_opts)
        errors += prepared[B][3]
        print(f"# batch {B} ready ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    configs = {(B, mode): (res[mode], runners[mode], outputs[mode])
               for B, (res, runners, outputs, _) in prepared.items() for mode in runners}
    errors += run_interleaved(configs, a)
    for B, (res, _, outputs, _) in prepared.items():
        errors += finish_batch(B, res, outputs)
        for mode, r in res.items():
            rows.append({"batch": B, "mode": mode, **r})
    for r in rows:
        if r.get("skipped"):
            continue
        base = next((x for x in rows if x["batch"] == r["batch"] and x["mode"] == PLAIN and not x.get("skipped")),
                    None)
        hf = next((x for x in rows if x["batch"] == r["batch"] and x["mode"] == HF and not x.get("skipped")), None)
        one = next((x for x in rows if x["batch"] == 1 and x["mode"] == r["mode"] and not x.get("skipped")), None)
        r["speedup_vs_plain"] = paired_ratio(r, base)
        r["speedup_vs_plain_graph"] = r["speedup_vs_plain"] if graph_mode else None
        r["speedup_vs_hf"] = paired_ratio(r, hf)
        r["scaling_vs_batch1"] = paired_ratio(r, one)
    elapsed = time.perf_counter() - t0

    print(format_table(rows))
    for name, why in skipped.items():
        print(f"# {name}: skipped ({why})")
    for r in rows:
        if r["mode"] == HF and r.get("skipped"):
            print(f"# transformers' generate does not run for this model on {a.device} (batch {r['batch']}): "
                  f"{r['skipped']}")
    for e in errors:
        print(f"ERROR: {e}", file=sys.stderr)
    if a.json:
        out = {"machine": machine_info(a.device),
               "settings": {"model": str(model_dir), "drafters": drafters, "skipped_drafters": skipped,
                            "batch_sizes": sizes, "requests": a.requests, "batching": a.batching,
                            "prompts_file": str(a.prompts),
                            "kinds": kinds,
                            "prompt_tokens": a.prompt_tokens, "max_new_tokens": a.max_new_tokens,
                            "repeats": a.repeats, "threads": torch.get_num_threads(), "greedy": True,
                            "hf_baseline": not a.no_hf, "draft_schedule": schedule, "device": a.device,
                            "dtype": a.dtype, "cuda_graph": a.cuda_graph, "graph_mode": graph_mode,
                            "elapsed_s": elapsed},
               "rows": rows, "errors": errors, "lossless": not errors}
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
