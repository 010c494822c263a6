"""Acceptance benchmark: tau, alpha, per-position acceptance and speedup of each drafter on real prompts.

    python bench/accept_rate.py --model embedded --drafters ngram,mtp,eagle,dspark --json accept.json --plot accept.png
    python bench/accept_rate.py --model DIR --device cuda --dtype bfloat16 --max-prompts 20 --kinds code

`--model embedded` is the package's own small Kimi-Linear (`specdec/embedded`, made by
`python -m specdec train-embedded`). `ngram` is prompt lookup, `native` the MTP layers the model's checkpoint
ships (Qwen3-Next / Qwen3.5 / Bailing, `specdec.draft.native`); any other drafter name is a trained drafter
loaded from `MODEL/drafters/NAME` and reported as skipped (with the reason) when that directory is
missing or does not load: an untrained drafter is never used in its place.

For each drafter and prompt the same generation runs `--repeats` times (default 3) in each of two ways,
interleaved (spec, plain, spec, plain, ...), after a short warmup of both: with the drafter
(`specdec.wrap(model, drafter=..., num_draft_tokens=gamma)`) and without one (`drafter=None`: plain decoding,
one token per forward through the same runner); the comparison is `specdec.timing`, the same as `specdec demo`'s.
Each prompt's time is the median of its repeats, and `speedup = tokens/s spec / tokens/s plain` over the pooled
medians compares like with like on this machine. `--cuda-graph` wraps every engine, the plain one included, with
`static_shapes=True, cuda_graph=True` (on a CPU, where `wrap` refuses CUDA graphs, with `static_shapes=True` alone:
the padded rounds a graph replays, run eagerly; `graph_mode` in the JSON's settings says which); the baseline and
the speedup are then also `tokens_per_s_plain_graph` and `speedup_vs_plain_graph` (None without the flag).
transformers' own `generate` (`specdec.hf_compat.transformers_generate`: what a user runs without specdec; on a CPU
through transformers' pure-torch code) runs in the same interleave unless `--reference none`: `tok/s hf` and
`vs hf` (tokens/s spec over its tokens/s), so the speedup is also stated against the decode a user has today.
`spread` is the median over prompts of (max - min) / median of a prompt's repeats (the larger of the two paths);
above 25% the table shows the range of the per-repeat speedups instead of one figure and a line says that timing
is noisy on this machine. Models under 50M parameters run on one torch thread unless `--threads` says otherwise.
Greedy runs (`--temperature 0`) are also checked for losslessness: the speculative
output must equal the plain output token for token (`identical`; and transformers' greedy output,
`identical_transformers`). The counts behind tau, alpha and the
per-position acceptance (`per_position[i]`: draft i accepted given drafts < i were; for trees, depth i)
are pooled over all prompts. Spec-state memory is the memory plan of the run's own state config
(`specdec.replayssm.plan.plan_json`): the replay strategy's spec state (rings + conv windows, plus one
layer's tree node states for tree drafters) vs full per-token snapshots for the same settings.

A second table says where a `generate` goes, by the engine's own timers (`SpecStats.timings`, mean over every
timed run): the prefill (with the drafter's read of the prompt), the rounds, and per round the draft, the verify
(with acceptance and commit) and the rest (the drafter's observe, bookkeeping), beside plain decoding's step. Its
last column is the round budget of `--target-speedup` (default 2.5): the longest round at which this drafter's
generate, with the same prefill and rounds, would take plain decoding's time over that speedup.

Prompts: a JSONL file of `{"id", "kind", "source", "prompt"}`; `--kinds` filters them and `--max-prompts`
takes that many, round-robin over the kinds in `--kinds` order (file order within a kind). `--budget-s`: once that
many seconds have passed since the start no further drafter starts (each left is reported as skipped, with the
reason); what was measured is printed and written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import (PROMPTS, input_args, load_prompts, machine_info, parse_drafter,  # noqa: E402
                        resolve_drafter, split_list)
finally:
    sys.path.pop(0)

import specdec  # noqa: E402
from specdec import hf_compat, plot, timing  # noqa: E402

PARTS = ("prefill", "draft", "verify", "total", "rounds", "runs")
KEYS = ("tau", "alpha", "per_position", "tokens_per_s_spec", "tokens_per_s_plain", "speedup",
        "spec_state_bytes_replay", "spec_state_bytes_snapshot", "identical", "speedup_per_repeat", "spread", "noisy",
        "tokens_per_s_transformers", "speedup_vs_transformers", "identical_transformers", "time_parts",
        "tokens_per_s_plain_graph", "speedup_vs_plain_graph")


class NoBar:
    """Stands in for a tqdm bar when tqdm is missing."""

    def update(self, n=1):
        pass

    def set_description(self, desc):
        pass

    def write(self, s, file=None):
        print(s, file=file)

    def close(self):
        pass


def spec_state_bytes(engine) -> tuple[int | None, int | None]:
    """(replay, snapshot) spec-state bytes of this engine's state config; (None, None) without recurrent state."""
    state = getattr(engine.runner, "state", None)
    if state is None:
        return None, None
    from specdec.replayssm.plan import plan_json
    plan = plan_json(state.cfg, layout=engine.config.commit)  # the ring layout follows the commit mode
    tree = bool(getattr(engine.drafter, "tree", False))
    return int(plan["spec_state_replay_tree" if tree else "spec_state_replay"]), int(plan["spec_state_snapshot"])


# ---- measurement ----------------------------------------------------------------------------------
class Pool:
    """Acceptance counts and timings pooled over prompts."""

    def __init__(self):
        self.rounds = self.tokens = self.proposed = self.accepted = self.failures = 0
        self.reached: list[int] = []
        self.accepted_at: list[int] = []
        self.spec, self.plain, self.ref = timing.Pooled(), timing.Pooled(), timing.Pooled()
        self.mismatches: list[str] = []
        self.ref_mismatches: list[str] = []
        # the engine's own timers (`SpecStats.timings`) and rounds, summed over every timed run of each path
        self.parts = {k: dict.fromkeys(PARTS, 0.0) for k in ("spec", "plain")}

    def add_parts(self, path: str, stats) -> None:
        """One timed `generate` of `path` ("spec" or "plain"): its timers and rounds."""
        acc = self.parts[path]
        for k in ("prefill", "draft", "verify", "total"):
            acc[k] += stats.timings[k]
        acc["rounds"] += stats.rounds
        acc["runs"] += 1

    def add(self, stats) -> None:
        self.rounds += stats.rounds
        self.tokens += stats.tokens
        self.proposed += stats.proposed
        self.accepted += stats.accepted
        self.failures += stats.drafter_failures
        for i, (r, a) in enumerate(zip(stats.reached, stats.accepted_at)):
            if i == len(self.reached):
                self.reached.append(0)
                self.accepted_at.append(0)
            self.reached[i] += r
            self.accepted_at[i] += a

    def result(self) -> dict:
        spread = timing.pooled_spread(self.spec, self.plain)
        return {"tau": self.tokens / self.rounds if self.rounds else 0.0,
                "alpha": self.accepted / self.proposed if self.proposed else 0.0,
                "per_position": [a / r for a, r in zip(self.accepted_at, self.reached)],
                "tokens_per_s_spec": self.spec.tokens_per_s, "tokens_per_s_plain": self.plain.tokens_per_s,
                "speedup": timing.speedup(self.spec, self.plain),
                "speedup_per_repeat": timing.speedup_per_repeat(self.spec, self.plain),
                "spread": spread, "noisy": timing.is_noisy(spread),
                "tokens_per_s_transformers": self.ref.tokens_per_s if self.ref.seconds else None,
                "speedup_vs_transformers": timing.speedup(self.spec, self.ref) if self.ref.seconds else None}

    def time_parts(self, target: float) -> dict:
        """Where a `generate` goes, by the engine's timers, as means over the timed runs: per generate the prefill
        (with the drafter's read of the prompt) and the rounds; per round the draft, the verify (with acceptance
        and commit) and the rest (the drafter's observe, the engine's bookkeeping); plain decode's prefill and
        step. `round_budget_ms`: the longest round at which this drafter's generate (same prefill, same rounds)
        would take plain decode's time / `target`; <= 0: its prefill alone is over that time."""
        s, p = self.parts["spec"], self.parts["plain"]
        if not s["runs"] or not p["runs"] or not s["rounds"] or not p["rounds"]:
            return {}
        per_round = {k: 1e3 * s[k] / s["rounds"] for k in ("draft", "verify")}
        round_ms = 1e3 * (s["total"] - s["prefill"]) / s["rounds"]
        rounds = s["rounds"] / s["runs"]
        prefill = 1e3 * s["prefill"] / s["runs"]
        plain_ms = 1e3 * p["total"] / p["runs"]
        return {"prefill_ms": prefill, "rounds_per_generate": rounds, "round_ms": round_ms,
                "draft_ms": per_round["draft"], "verify_ms": per_round["verify"],
                "other_ms": round_ms - per_round["draft"] - per_round["verify"],
                "plain_prefill_ms": 1e3 * p["prefill"] / p["runs"],
                "plain_step_ms": 1e3 * (p["total"] - p["prefill"]) / p["rounds"], "plain_generate_ms": plain_ms,
                "target_speedup": target, "round_budget_ms": (plain_ms / target - prefill) / rounds}


def graph_options(args) -> dict:
    """`wrap`'s options for `--cuda-graph` (every engine, plain decoding's too): CUDA graphs on a GPU, on a CPU the
    static shapes they replay; none without it."""
    if not args.cuda_graph:
        return {}
    return {"static_shapes": True, "cuda_graph": args.device == "cuda"}


def bench_drafter(name, drafter_arg, model, prompts, plain, args, sampling, eos, bar, options=None) -> dict:
    engine = specdec.wrap(model, drafter=drafter_arg, num_draft_tokens=args.gamma, max_batch_size=1,
                          **graph_options(args), **(options or {}))
    replay, snapshot = spec_state_bytes(engine)
    kw = dict(eos_token_id=eos, **sampling)
    with_ref = args.reference == "transformers"

    def reference(ids, n, seed):  # transformers' own generate (`--reference transformers`)
        return hf_compat.transformers_generate(model, ids[None], max_new_tokens=n, eos_token_id=eos, seed=seed,
                                               **sampling)

    timing.warm_up([lambda n, e=e: e.generate(prompts[0]["ids"], max_new_tokens=n, seed=args.seed, **kw)
                    for e in (plain, engine)]
                   + ([lambda n: reference(prompts[0]["ids"], n, args.seed)] if with_ref else []),
                   args.max_new_tokens)
    pool = Pool()
    for i, p in enumerate(prompts):
        seed = args.seed + i
        paths = {k: lambda e=e: e.generate(p["ids"], max_new_tokens=args.max_new_tokens, seed=seed, **kw)
                 for k, e in (("spec", engine), ("plain", plain))}
        if with_ref:
            paths["transformers"] = lambda: reference(p["ids"], args.max_new_tokens, seed)
        runs = timing.interleave(paths, args.repeats)
        out, ref = runs["spec"][0][0], runs["plain"][0][0]
        n = p["ids"].numel()  # one prompt per call: no right padding
        ref_new, out_new = ref.sequences[0, n:].tolist(), out.sequences[0, n:].tolist()
        pool.add(out.stats)
        for k in ("spec", "plain"):
            for o, _ in runs[k]:
                pool.add_parts(k, o.stats)
        pool.spec.add(len(out_new), [t for _, t in runs["spec"]])
        pool.plain.add(len(ref_new), [t for _, t in runs["plain"]])
        hf_new = None
        if with_ref:
            hf_new = runs["transformers"][0][0][0, n:].tolist()
            pool.ref.add(len(hf_new), [t for _, t in runs["transformers"]])
        for want, where in ((ref_new, pool.mismatches), (hf_new, pool.ref_mismatches)):
            if not sampling["do_sample"] and want is not None and out_new != want:
                at = next((j for j, (a, b) in enumerate(zip(out_new, want)) if a != b), min(len(out_new), len(want)))
                where.append(f"{p['id']} (first difference at new token {at})")
        bar.update(1)
    res = pool.result()
    graphed = bool(args.cuda_graph)  # then the plain baseline is plain decoding with graphs (or static shapes)
    res["tokens_per_s_plain_graph"] = res["tokens_per_s_plain"] if graphed else None
    res["speedup_vs_plain_graph"] = res["speedup"] if graphed else None
    res["time_parts"] = pool.time_parts(args.target_speedup)
    res["spec_state_bytes_replay"], res["spec_state_bytes_snapshot"] = replay, snapshot
    res["identical"] = None if sampling["do_sample"] else not pool.mismatches
    res["identical_transformers"] = None if sampling["do_sample"] or not with_ref else not pool.ref_mismatches
    for what, miss in (("plain greedy decoding", pool.mismatches), ("transformers' greedy generate",
                                                                    pool.ref_mismatches)):
        if miss:
            bar.write(f"WARNING: drafter {name}: speculative output differs from {what} on "
                      f"{len(miss)}/{len(prompts)} prompts: {', '.join(miss[:5])}", file=sys.stderr)
    if pool.failures:
        bar.write(f"WARNING: drafter {name}: failed in {pool.failures} rounds (plain decode there)", file=sys.stderr)
    del engine
    return res


# ---- output ---------------------------------------------------------------------------------------
def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def format_table(results: dict) -> str:
    w = max([10] + [len(n) for n in results])
    head = (f"{'drafter':{w}s} {'tau':>6s} {'alpha':>6s} {'tok/s spec':>11s} {'tok/s plain':>11s} {'speedup':>8s} "
            f"{'tok/s hf':>9s} {'vs hf':>6s} {'replay state':>13s} {'snapshot state':>15s} {'identical':>9s}  "
            f"per-position acceptance")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        if r.get("skipped"):
            lines.append(f"{name:{w}s} skipped: {r['skipped']}")
            continue
        ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        if r["identical"] and r.get("identical_transformers") is False:
            ident = "NO (hf)"
        hf_tps, vs_hf = r.get("tokens_per_s_transformers"), r.get("speedup_vs_transformers")
        hf_tps, vs_hf = ("-", "-") if hf_tps is None else (f"{hf_tps:.1f}", f"{vs_hf:.2f}x")
        pos = " ".join(f"{a:.2f}" for a in r["per_position"]) or "-"
        speed = f"{r['speedup']:.2f}x"
        if r.get("noisy"):  # a range, not one misleading figure
            speed = f"{min(r['speedup_per_repeat']):.1f}-{max(r['speedup_per_repeat']):.1f}x"
        lines.append(f"{name:{w}s} {r['tau']:6.2f} {r['alpha']:6.3f} {r['tokens_per_s_spec']:11.1f} "
                     f"{r['tokens_per_s_plain']:11.1f} {speed:>8s} {hf_tps:>9s} {vs_hf:>6s} "
                     f"{fmt_bytes(r['spec_state_bytes_replay']):>13s} "
                     f"{fmt_bytes(r['spec_state_bytes_snapshot']):>15s} {ident:>9s}  {pos}")
    for name, r in results.items():
        if r.get("noisy"):
            lines.append(f"timing is noisy on this machine: {name}: "
                         f"{timing.noisy_note(r['spread'], r['speedup_per_repeat'])}")
    return "\n".join(lines)


def format_parts(results: dict) -> str:
    """Where each drafter's `generate` goes (`Pool.time_parts`), and the round budget of the target speedup."""
    rows = {n: r["time_parts"] for n, r in results.items() if not r.get("skipped") and r.get("time_parts")}
    if not rows:
        return ""
    target = next(iter(rows.values()))["target_speedup"]
    w = max([10] + [len(n) for n in rows])
    head = (f"{'drafter':{w}s} {'prefill ms':>10s} {'rounds':>6s} {'round ms':>8s} {'draft':>6s} {'verify':>6s} "
            f"{'other':>6s} {'plain step ms':>13s} {f'round budget at {target:g}x':>23s}")
    lines = [f"where a generate goes (the engine's timers, mean of the timed runs; verify: with acceptance and "
             f"commit; other: the drafter's observe, bookkeeping)", head, "-" * len(head)]
    for name, t in rows.items():
        budget = f"{t['round_budget_ms']:.1f} ms" if t["round_budget_ms"] > 0 else "none (prefill over it)"
        lines.append(f"{name:{w}s} {t['prefill_ms']:10.1f} {t['rounds_per_generate']:6.1f} {t['round_ms']:8.1f} "
                     f"{t['draft_ms']:6.1f} {t['verify_ms']:6.1f} {t['other_ms']:6.1f} {t['plain_step_ms']:13.2f} "
                     f"{budget:>23s}")
    return "\n".join(lines)


def plot_records(results: dict) -> dict:
    """The drafters that ran, for `specdec.plot`."""
    return {name: r for name, r in results.items() if not r.get("skipped")}


# ---- main -----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory (model + tokenizer) or 'embedded'")
    p.add_argument("--drafters", default="ngram,mtp,eagle,dspark",
                   help="comma-separated: ngram, or names of trained drafters under MODEL/drafters/; each may "
                        "carry drafter options as NAME:key=value[:key=value], e.g. eagle:num_nodes=16:topk=4")
    p.add_argument("--prompts", default=str(PROMPTS), help="JSONL prompt file")
    p.add_argument("--gamma", type=int, default=7, help="draft tokens per round (num_draft_tokens)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (checked lossless); > 0: sampling")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts (round-robin over kinds)")
    p.add_argument("--kinds", default="code,prose", help="comma-separated prompt kinds to use")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (prompt i: seed + i)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: 1 for models under 50M parameters, else torch's)")
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed repeats of each prompt, spec and plain, >= 3 (median)")
    p.add_argument("--reference", choices=("transformers", "none"), default="transformers",
                   help="also time transformers' own generate, interleaved with the two (`tok/s hf`, `vs hf`), "
                        "and check the greedy output against it; none: skip it")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=False,
                   help="wrap every engine (plain decoding's too) with static_shapes=True, cuda_graph=True; on a "
                        "CPU static shapes alone")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no further drafter after this many seconds; print and write what was measured")
    p.add_argument("--target-speedup", type=float, default=2.5,
                   help="the speedup whose round budget the time table shows (the longest round that reaches it)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="picture of acceptance per draft position and speedup per drafter (needs matplotlib)")
    return p


def main(argv=None) -> int:
    start = time.perf_counter()
    parser = build_parser()
    a = parser.parse_args(argv)
    drafters, kinds = split_list(a.drafters), split_list(a.kinds)
    if not drafters:
        parser.error("--drafters: no drafter named")
    if len(set(drafters)) != len(drafters):
        parser.error(f"--drafters: a drafter is named twice: {a.drafters}")
    if not kinds:
        parser.error("--kinds: no kind named")
    for flag, val in (("--gamma", a.gamma), ("--max-new-tokens", a.max_new_tokens)):
        if val < 1:
            parser.error(f"{flag}: expected >= 1, got {val}")
    if a.max_prompts is not None and a.max_prompts < 1:
        parser.error(f"--max-prompts: expected >= 1, got {a.max_prompts}")
    if a.temperature < 0:
        parser.error(f"--temperature: expected >= 0, got {a.temperature}")
    if a.threads is not None and a.threads < 1:
        parser.error(f"--threads: expected >= 1, got {a.threads}")
    if a.budget_s is not None and not a.budget_s > 0:
        parser.error(f"--budget-s: expected > 0, got {a.budget_s}")
    if not a.target_speedup > 0:
        parser.error(f"--target-speedup: expected > 0, got {a.target_speedup}")
    if a.repeats < 3:
        parser.error(f"--repeats: expected >= 3 (a median of at least 3), got {a.repeats}")
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if a.plot:
        if not plot.available():
            parser.error(f"--plot: {plot.MISSING}; or leave out --plot")
    model_dir = input_args(parser, a.model, a.prompts)
    dtype = getattr(torch, a.dtype or ("bfloat16" if a.device == "cuda" else "float32"))

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # no progress bar
        tqdm = None

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(a.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    threads = timing.torch_threads(model, a.threads, device=a.device)
    try:
        prompts = load_prompts(a.prompts, kinds, a.max_prompts)
    except ValueError as e:
        parser.error(f"--prompts: {e}")
    plain = specdec.wrap(model, drafter=None, max_batch_size=1, **graph_options(a))
    budget = plain.max_length - a.max_new_tokens
    if budget < 1:
        parser.error(f"--max-new-tokens: {a.max_new_tokens} leaves no room for a prompt (max length "
                     f"{plain.max_length})")
    truncated = 0
    for p in prompts:
        ids = tokenizer(p["prompt"], return_tensors="pt").input_ids[0]
        if ids.numel() > budget:  # keep the end: the continuation point
            ids, truncated = ids[-budget:], truncated + 1
        p["ids"] = ids
    prompts = [p for p in prompts if p["ids"].numel() > 0]
    if not prompts:
        parser.error(f"--prompts: no non-empty prompt of kinds {kinds} in {a.prompts}")
    eos = plain.eos_token_id if plain.eos_token_id is not None else tokenizer.eos_token_id
    sampling = ({"do_sample": True, "temperature": a.temperature} if a.temperature > 0 else {"do_sample": False})

    try:
        specs = {name: parse_drafter(name) for name in drafters}
    except ValueError as e:
        parser.error(f"--drafters: {e}")
    plan = [(name, *resolve_drafter(model_dir, specs[name][0])) for name in drafters]
    results: dict[str, dict] = {}
    runnable = sum(1 for _, arg, _ in plan if arg is not None)
    bar = (tqdm(total=runnable * len(prompts), file=sys.stderr, unit="prompt", dynamic_ncols=True)
           if tqdm is not None else NoBar())
    for name, arg, reason in plan:
        if arg is None:
            print(f"# {name}: skipped ({reason})", file=sys.stderr)
    t0 = time.perf_counter()
    budget_spent = False
    for name, arg, reason in plan:
        if arg is not None and a.budget_s is not None and time.perf_counter() - start > a.budget_s:
            arg, reason, budget_spent = None, f"budget of {a.budget_s:g} s spent", True
            bar.write(f"# {name}: skipped ({reason})", file=sys.stderr)
        if arg is None:
            results[name] = {**dict.fromkeys(KEYS), "skipped": reason}
            continue
        bar.set_description(name)
        try:
            results[name] = bench_drafter(name, arg, model, prompts, plain, a, sampling, eos, bar, specs[name][1])
        except Exception as e:  # noqa: BLE001 - a drafter that does not load or run is reported, the rest go on
            first = (str(e).strip().splitlines() or [""])[0]
            results[name] = {**dict.fromkeys(KEYS), "skipped": f"failed: {type(e).__name__}: {first}"}
            bar.write(f"# {name}: skipped ({results[name]['skipped']})", file=sys.stderr)
        if a.device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    elapsed = time.perf_counter() - t0

    graph_mode = ("graph" if a.device == "cuda" else "static") if a.cuda_graph else None
    tc = model.config.get_text_config()
    out = {
        "machine": machine_info(a.device),
        "model": {"path": str(model_dir), "name": "embedded" if a.model == "embedded" else model_dir.name,
                  "architecture": type(model).__name__, "model_type": model.config.model_type, "params": n_params,
                  "dtype": str(dtype).removeprefix("torch."), "device": a.device, "vocab_size": tc.vocab_size,
                  "num_layers": tc.num_hidden_layers},
        "settings": {"drafters": drafters, "prompts_file": str(a.prompts), "num_prompts": len(prompts),
                     "prompt_ids": [p["id"] for p in prompts], "kinds": kinds,
                     "prompt_tokens_mean": sum(p["ids"].numel() for p in prompts) / len(prompts),
                     "prompts_truncated": truncated, "gamma": a.gamma, "temperature": a.temperature,
                     "greedy": not sampling["do_sample"], "max_new_tokens": a.max_new_tokens, "seed": a.seed,
                     "repeats": a.repeats, "threads": threads, "cuda_graph": a.cuda_graph,
                     "graph_mode": graph_mode, "budget_s": a.budget_s,
                     "reference": None if a.reference == "none" else a.reference,
                     "strategy": "replay", "commit": "eager", "max_batch_size": 1, "device": a.device,
                     "dtype": str(dtype).removeprefix("torch."), "elapsed_s": elapsed},
        "drafters": results,
    }
    title = (f"{out['model']['name']} ({n_params / 1e6:.1f}M params, {out['model']['dtype']}, {a.device}): "
             f"{len(prompts)} prompts [{','.join(kinds)}], gamma={a.gamma}, T={a.temperature}, "
             f"{a.max_new_tokens} new tokens, median of {a.repeats} interleaved repeats, torch threads {threads}"
             + {None: "", "graph": ", every engine with CUDA graphs (plain decoding too)",
                "static": ", every engine with static shapes (plain decoding too; no CUDA graphs on a CPU)"}[
                 graph_mode])
    print(f"# {title}")
    print(format_table(results))
    parts = format_parts(results)
    if parts:
        print(parts)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        plot.write(plot_records(results), a.plot, title)
    return 0 if budget_spent or any(not r.get("skipped") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
