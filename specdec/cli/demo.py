"""`specdec demo`: speculative vs plain decode on the embedded model (or a given one), timed side by side."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.timing import NOISY, SMALL_MODEL

from .generate import argument_message, load_model

NAME = "demo"
HELP = "speculative vs plain decode on the embedded model"
DESCRIPTION = ("Greedy generation with a drafter on the embedded model (or --model DIR): the first prompt's "
               "text is streamed as tokens are committed; then, on each held-out code prompt shipped with the "
               "package, the drafter, plain decode (specdec without drafts) and transformers' own generate "
               "run interleaved, --repeats times after a warmup of each path, and the other shipped drafters "
               "once per prompt. Prints the torch thread count, tau, alpha, per-position "
               "acceptance, tokens/s and speedup (each prompt's median over its repeats, pooled over prompts, "
               f"as bench/accept_rate.py does; a range instead when repeats differ by more than {NOISY:.0%}), "
               "a table of the drafters side by side, and whether the output equals transformers' greedy output "
               "token for token (exit status 1 if not). Writes a picture of each drafter's acceptance per draft "
               "position and speedup to --plot (needs matplotlib).")

DEMO_KINDS = ("dspark", "eagle", "mtp")  # trained drafters, best first: what `--drafter auto` picks
COMPARE_KINDS = ("ngram", "mtp", "eagle", "dspark")  # the side-by-side table, in this order
PLOT = "specdec-demo.png"  # the picture's default path, in the working directory
PROMPTS_NAME = "prompts.jsonl"  # the held-out benchmark prompts (a copy of bench/data/prompts.jsonl), package data
# the style of the held-out benchmark code prompts: used only when the package's prompt file is missing
DEMO_PROMPT = '''    def _read_header(self, fp):
        magic = fp.read(4)
        if magic != self.MAGIC:
            raise ValueError(f"bad magic number: {magic!r}")
        version = int.from_bytes(fp.read(2), "little")
        if version > self.VERSION:
            raise ValueError(f"unsupported version: {version}")
        return version

    def read_names(self, fp):
        count = int.from_bytes(fp.read(4), "little")
        names = []
        for _ in range(count):
            size = int.from_bytes(fp.read(2), "little")
            names.append(fp.read(size).decode("utf-8"))
        return names

    def read_offsets(self, fp):
        count = int.from_bytes(fp.read(4), "little")
'''


def _embedded_dir() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "embedded")  # specdec/embedded


def _prompts_file() -> str:
    """The held-out prompts shipped with the package (the same file in a checkout and in any install)."""
    return os.path.join(_embedded_dir(), PROMPTS_NAME)


def _demo_prompts(args: argparse.Namespace,
                  parser: argparse.ArgumentParser) -> tuple[list[tuple[str, str]], str | None]:
    """-> ([(prompt id, text)], the prompt file or None): --prompt, --prompt-id, else the first --num-prompts code
    prompts of the prompt file (the package's held-out prompts unless --prompts FILE)."""
    if args.prompt is not None:
        if not args.prompt:
            parser.error("argument --prompt: empty prompt")
        return [("custom", args.prompt)], None
    path = args.prompts or _prompts_file()
    if not os.path.isfile(path):
        if args.prompts is not None:
            parser.error(f"argument --prompts: no such file: {path}")
        if args.prompt_id is not None:
            parser.error(f"argument --prompt-id: the package's {PROMPTS_NAME} is missing ({path}); pass --prompt TEXT")
        return [("built-in", DEMO_PROMPT)], None
    flag = "--prompts" if args.prompts is not None else "--prompt-id"
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [r for r in records if isinstance(r.get("id"), str) and isinstance(r.get("prompt"), str)]
    except (OSError, ValueError, AttributeError) as exc:
        parser.error(f"argument {flag}: cannot read {path}: {type(exc).__name__}: {exc}")
    if args.prompt_id is None:
        code = [r for r in records if r.get("kind") == "code"] or records
        if not code:
            parser.error(f"argument {flag}: no prompts in {path}")
        return [(r["id"], r["prompt"]) for r in code[:args.num_prompts]], path
    for r in records:
        if r["id"] == args.prompt_id:
            return [(r["id"], r["prompt"])], path
    ids = ", ".join(r["id"] for r in records[:6]) + (", ..." if len(records) > 6 else "")
    parser.error(f"argument --prompt-id: no prompt {args.prompt_id!r} in {path} (ids: {ids or 'none'})")


def _shipped(model_dir: str, kind: str) -> str | None:
    """The trained drafter directory `<model>/drafters/<kind>/` if it holds config.json + model.safetensors."""
    path = os.path.join(model_dir, "drafters", kind)
    files = ("config.json", "model.safetensors")
    return path if all(os.path.isfile(os.path.join(path, f)) for f in files) else None


def _demo_drafter(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str | None]:
    """-> (kind, trained drafter directory or None); trained drafters ship in `<model>/drafters/<kind>/`."""
    if args.drafter == "auto":
        best = os.path.join(args.model, "drafters", "best.txt")  # the measured best, written from bench results
        if os.path.isfile(best):
            with open(best) as f:
                kind = f.read().split()[0] if os.path.getsize(best) else ""
            if kind == "ngram" or (kind in DEMO_KINDS and _shipped(args.model, kind)):
                return kind, _shipped(args.model, kind) if kind != "ngram" else None
        for kind in DEMO_KINDS:
            if _shipped(args.model, kind):
                return kind, _shipped(args.model, kind)
        return "ngram", None
    if args.drafter == "ngram":
        return "ngram", None
    path = _shipped(args.model, args.drafter)
    if path is None:
        parser.error(f"argument --drafter: no trained {args.drafter} drafter is shipped with the model (no "
                     f"config.json + model.safetensors in {os.path.join(args.model, 'drafters', args.drafter)})")
    return args.drafter, path


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _picture(args: argparse.Namespace, drafters: dict, title: str) -> tuple[str | None, str]:
    """Writes the drafters' picture (`specdec.plot`) to --plot -> (its path or None, the line that says where it is
    or why there is none)."""
    from specdec import plot

    if args.no_plot:
        return None, ""
    if not plot.available():
        return None, f"[demo] no picture: {plot.MISSING}"
    path = os.path.abspath(args.plot)
    plot.write(drafters, path, title)
    return path, f"[demo] picture of the drafters (acceptance per draft position, speedup): {path}"


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    embedded = args.model is None
    if embedded:
        args.model = _embedded_dir()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        if embedded:
            parser.error(f"argument --model: the embedded model is not shipped in this install (nothing at "
                         f"{args.model}); pass --model DIR")
        what = "no model (config.json) in" if os.path.isdir(args.model) else "no such directory:"
        parser.error(f"argument --model: {what} {args.model}")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1),
                             ("--num-draft-tokens", args.num_draft_tokens, 1), ("--num-prompts", args.num_prompts, 1),
                             ("--repeats", args.repeats, 3),
                             ("--threads", args.threads if args.threads is not None else 1, 1)):
        if value < low:
            parser.error(f"argument {flag}: expected >= {low}, got {value}")
    if not args.no_plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        parser.error(f"argument --plot: no such directory: {os.path.dirname(os.path.abspath(args.plot))}")
    prompts, prompts_path = _demo_prompts(args, parser)
    kind, drafter_dir = _demo_drafter(args, parser)
    compare = [] if args.no_compare else [(k, None if k == "ngram" else _shipped(args.model, k))
                                          for k in COMPARE_KINDS if k == "ngram" or _shipped(args.model, k)]
    compare = [(kind, drafter_dir)] + [c for c in compare if c[0] != kind]  # the headline drafter first

    import warnings
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    import torch
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    import specdec
    from specdec import timing
    from specdec.draft import NoDraft
    from specdec.hf_compat import transformers_generate

    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(args.model, "--model", torch.float32, "cpu", parser, tokenizer=True)
    n_params = sum(p.numel() for p in model.parameters())
    threads = timing.torch_threads(model, args.threads)
    runs = []  # per prompt: {"id", "ids", "P"}
    for pid, text in prompts:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if ids.numel() == 0:
            parser.error(f"argument --prompt: the prompt {pid} tokenizes to no tokens")
        runs.append({"id": pid, "ids": ids, "P": ids.numel()})
    N, R = args.max_new_tokens, args.repeats
    max_length = max(r["P"] for r in runs) + N + 1
    try:
        engines = {k: specdec.wrap(model, drafter=d or k, num_draft_tokens=args.num_draft_tokens, max_batch_size=1,
                                   max_length=max_length) for k, d in compare}
        plain = specdec.wrap(model, drafter=NoDraft(), num_draft_tokens=1, max_batch_size=1, max_length=max_length)
    except ValueError as exc:
        parser.error(argument_message(str(exc)))
    spec = engines[kind]
    eos = spec.eos_token_id if spec.eos_token_id is not None else tokenizer.eos_token_id

    def hf_generate(ids, n: int) -> list[int]:  # the model's own greedy decode, on transformers' pure-torch layers
        out = transformers_generate(model, ids[None], max_new_tokens=n, eos_token_id=eos,
                                    pad_token_id=spec.pad_token_id)
        return out[0, ids.numel():].tolist()

    def specdec_generate(engine, ids, n: int, streamer=None):
        out = engine.generate(ids, max_new_tokens=n, eos_token_id=eos, streamer=streamer)
        return out.sequences[0, ids.numel():].tolist(), out.stats  # one prompt: no right padding

    # the streamed text: the headline drafter on the first prompt, untimed (it also warms that path up)
    streamer = None if args.json or args.no_stream else TextStreamer(tokenizer, skip_prompt=False,
                                                                          skip_special_tokens=True)
    specdec_generate(spec, runs[0]["ids"], N, streamer)
    timing.warm_up([*(lambda n, e=e: specdec_generate(e, runs[0]["ids"], n)
                      for e in (plain, *(e for k, e in engines.items() if k != kind))),
                    lambda n: hf_generate(runs[0]["ids"], n)], N)
    if not args.json:
        others = ", ".join(k for k in engines if k != kind)
        print(f"\n[demo] timing: {len(runs)} prompt(s) x {R} interleaved repeats of {kind}, plain decode and "
              f"transformers generate{f', one run per prompt of {others}' if others else ''}, "
              f"torch threads {threads} ...", flush=True)

    # timed runs, per prompt interleaved: spec, plain, transformers' generate, spec, plain, ...; then the other
    # drafters once per prompt
    pooled_spec, pooled_plain, pooled_hf = timing.Pooled(), timing.Pooled(), timing.Pooled()
    pooled_other = {k: timing.Pooled() for k in engines if k != kind}
    for run in runs:
        ids = run["ids"]
        paths = {"spec": lambda: specdec_generate(spec, ids, N), "plain": lambda: specdec_generate(plain, ids, N),
                 "transformers": lambda: hf_generate(ids, N)}
        timed = timing.interleave(paths, R)
        run["times"] = {path: [t for _, t in timed[path]] for path in timed}
        (run["spec"], run["stats"]), _ = timed["spec"][0]
        (run["plain"], _), _ = timed["plain"][0]
        run["other"] = {k: timing.interleave({k: lambda e=e: specdec_generate(e, ids, N)}, 1)[k][0]
                        for k, e in engines.items() if k != kind}  # {kind: ((tokens, stats), seconds)}
        one_spec = timing.Pooled().add(len(run["spec"]), run["times"]["spec"])
        one_plain = timing.Pooled().add(len(run["plain"]), run["times"]["plain"])
        run["speedup"] = timing.speedup(one_spec, one_plain)
        run["spread"] = timing.pooled_spread(one_spec, one_plain)
        run["hf"] = timed["transformers"][0][0]
        pooled_spec.add(len(run["spec"]), run["times"]["spec"])
        pooled_plain.add(len(run["plain"]), run["times"]["plain"])
        pooled_hf.add(len(run["hf"]), run["times"]["transformers"])
        for k, ((toks, _), t) in run["other"].items():
            pooled_other[k].add(len(toks), [t])
        run["diff"] = _first_difference(run["spec"], run["plain"])
        run["hf_diff"] = _first_difference(run["spec"], run["hf"])

    def pooled(stats_list) -> dict:
        rounds = sum(s.rounds for s in stats_list)
        tokens, proposed, accepted = (sum(getattr(s, a) for s in stats_list)
                                      for a in ("tokens", "proposed", "accepted"))
        width = max((len(s.reached) for s in stats_list), default=0)
        reached = [sum(s.reached[i] for s in stats_list if i < len(s.reached)) for i in range(width)]
        acc_at = [sum(s.accepted_at[i] for s in stats_list if i < len(s.accepted_at)) for i in range(width)]
        return {"tau": tokens / rounds if rounds else 0.0, "alpha": accepted / proposed if proposed else 0.0,
                "per_position": [a / r for a, r in zip(acc_at, reached) if r], "rounds": rounds,
                "proposed": proposed, "accepted": accepted}

    head = pooled([r["stats"] for r in runs])
    speedup = timing.speedup(pooled_spec, pooled_plain)
    per_repeat = timing.speedup_per_repeat(pooled_spec, pooled_plain)
    spread = timing.pooled_spread(pooled_spec, pooled_plain)
    noisy = timing.is_noisy(spread)
    drafters = {kind: {"drafter_dir": drafter_dir, **{k: head[k] for k in ("tau", "alpha", "per_position")},
                       "tokens_per_s": pooled_spec.tokens_per_s, "speedup": speedup,
                       "identical": all(r["spec"] == r["plain"] for r in runs), "repeats": R}}
    for k, d in compare:
        if k == kind:
            continue
        st = pooled([r["other"][k][0][1] for r in runs])
        drafters[k] = {"drafter_dir": d, "tau": st["tau"], "alpha": st["alpha"], "per_position": st["per_position"],
                       "tokens_per_s": pooled_other[k].tokens_per_s,
                       "speedup": timing.speedup(pooled_other[k], pooled_plain),
                       "identical": all(r["other"][k][0][0] == r["plain"] for r in runs), "repeats": 1}
    first = runs[0]
    picture, picture_line = _picture(
        args, drafters, f"{model.config.model_type} model, {n_params / 1e6:.1f}M parameters: {len(runs)} prompt(s), "
                        f"{N} new tokens each, greedy, gamma {args.num_draft_tokens}, torch threads {threads}; "
                        f"speedup over plain specdec decode, {kind} the median of {R} interleaved repeats"
                        f"{', the others one run per prompt' if len(drafters) > 1 else ''}")
    diffs = [(r["id"], r["hf_diff"], "transformers' greedy output") for r in runs if r["hf_diff"] is not None] + \
        [(r["id"], r["diff"], "plain decode") for r in runs if r["diff"] is not None]
    result = {
        "model": os.path.abspath(args.model), "params": n_params, "threads": threads, "drafter": kind,
        "drafter_dir": drafter_dir, "num_draft_tokens": args.num_draft_tokens, "prompts_file": prompts_path,
        "prompt_ids": [r["id"] for r in runs], "repeats": R,
        "prompt_id": first["id"], "prompt_tokens": first["P"], "new_tokens": len(first["spec"]),
        "text": tokenizer.decode(first["spec"], skip_special_tokens=True), "tokens": first["spec"], **head,
        "tokens_per_s_spec": drafters[kind]["tokens_per_s"], "tokens_per_s_plain": pooled_plain.tokens_per_s,
        "tokens_per_s_transformers": pooled_hf.tokens_per_s, "speedup": speedup,
        "speedup_vs_transformers": timing.speedup(pooled_spec, pooled_hf),
        "speedup_per_repeat": per_repeat, "spread": spread, "noisy": noisy,
        "identical": not diffs, "first_difference": first["hf_diff"],
        "identical_plain_specdec": all(r["plain"] == r["hf"] for r in runs),
        "drafters": drafters, "plot": picture,
        "prompts": [{"id": r["id"], "prompt_tokens": r["P"], "new_tokens": len(r["spec"]), "tau": r["stats"].tau,
                     "speedup": r["speedup"], "spread": r["spread"], "seconds_spec": r["times"]["spec"],
                     "seconds_plain": r["times"]["plain"], "seconds_transformers": r["times"].get("transformers"),
                     "identical": r["diff"] is None} for r in runs],
    }
    if args.json:
        print(json.dumps(result))
        if picture_line and picture is None:
            print(picture_line, file=sys.stderr)
    else:
        if streamer is None:
            print(tokenizer.decode(first["ids"].tolist() + first["spec"], skip_special_tokens=True))
        per_pos = " ".join(f"{a:.2f}" for a in head["per_position"]) or "-"
        n_new = sum(len(r["spec"]) for r in runs)
        lossless = (f"yes on all {len(runs)} prompt(s) ({n_new} tokens), and equal to plain decode"
                    if not diffs else "NO: " + ", ".join(f"{pid} differs from {what} at new token {d}"
                                                         for pid, d, what in diffs))
        over = f"pooled over {len(runs)} held-out prompts" if len(runs) > 1 else f"prompt {first['id']}"
        if noisy:
            verdict = f"timing is noisy on this machine: {timing.noisy_note(spread, per_repeat)}"
        else:
            verdict = f"speedup {speedup:.2f}x ({over}, each the median of {R} interleaved repeats)"
        print(f"[demo] {model.config.model_type} model, {n_params / 1e6:.1f}M parameters, from {args.model}, "
              f"torch threads {threads}\n"
              f"[demo] streamed: prompt {first['id']} ({first['P']} tokens), greedy, {len(first['spec'])} new tokens, "
              f"drafter {kind}{f' ({drafter_dir})' if drafter_dir else ''}, gamma {args.num_draft_tokens}\n"
              f"[demo] prompts: {' '.join(r['id'] for r in runs)}, {N} new tokens each, {R} interleaved repeats\n"
              f"[demo] tau {head['tau']:.2f} tokens/round, alpha {head['alpha']:.3f} "
              f"({head['accepted']}/{head['proposed']} drafts accepted, {head['rounds']} rounds)\n"
              f"[demo] acceptance per draft position: {per_pos}\n"
              f"[demo] speculative decode ({kind}):    {result['tokens_per_s_spec']:7.1f} tokens/s\n"
              f"[demo] plain, specdec without drafts: {result['tokens_per_s_plain']:7.1f} tokens/s, {verdict}\n"
              f"[demo] plain, transformers generate:  {result['tokens_per_s_transformers']:7.1f} tokens/s, "
              f"speedup {result['speedup_vs_transformers']:.2f}x ({over}, the same repeats)\n"
              f"[demo] identical to transformers' greedy output, token for token: {lossless}")
        if len(drafters) > 1:
            print(f"[demo] drafters side by side ({over}; speedup vs plain specdec decode"
                  f"{'; timing is noisy on this machine, so the speedups are rough' if noisy else ''}):")
            print(f"[demo]   {'drafter':8s} {'tau':>5s} {'alpha':>6s} {'tokens/s':>9s} {'speedup':>8s}  identical")
            for k, d in drafters.items():
                runs_note = f"median of {d['repeats']} repeats" if d["repeats"] > 1 else "one run per prompt"
                print(f"[demo]   {k:8s} {d['tau']:5.2f} {d['alpha']:6.3f} {d['tokens_per_s']:9.1f} "
                      f"{d['speedup']:7.2f}x  {'yes' if d['identical'] else 'NO'}  ({runs_note})")
        if picture_line:
            print(picture_line)
    if diffs:
        pid, d, what = diffs[0]
        print(f"{parser.prog}: error: the speculative output differs from {what} on prompt {pid} at new token {d}",
              file=sys.stderr)
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", default=None,
                   help="save_pretrained directory: model and tokenizer (default: the embedded model); its trained "
                        "drafters are DIR/drafters/{dspark,eagle,mtp}/")
    p.add_argument("--drafter", choices=("auto", "ngram") + DEMO_KINDS[::-1], default="auto",
                   help="auto (default): the drafter named in <model>/drafters/best.txt (the measured best), else the "
                        "best shipped trained drafter (dspark, then eagle, then mtp), else "
                        "ngram (prompt lookup)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text (one prompt)")
    prompt.add_argument("--prompt-id", metavar="ID", default=None,
                        help="one prompt of the prompt file, by id (default: its first --num-prompts code prompts)")
    p.add_argument("--prompts", metavar="FILE", default=None,
                   help=f"JSONL prompt file of {{id, kind, prompt}} (default: the held-out prompts shipped with the "
                        f"package, specdec/embedded/{PROMPTS_NAME})")
    p.add_argument("--num-prompts", type=int, default=5, help="code prompts timed (default 5); the first is streamed")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate per prompt (stops early at EOS; default 128)")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="draft tokens per round (gamma)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per prompt, >= 3 (median)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch intra-op threads (default: 1 for models under {SMALL_MODEL / 1e6:.0f}M parameters, "
                        f"else torch's default)")
    p.add_argument("--plot", metavar="PATH", default=PLOT,
                   help=f"where to write the picture of the drafters' acceptance per draft position and speedup "
                        f"(PNG; default {PLOT} in the working directory; needs matplotlib)")
    p.add_argument("--no-plot", action="store_true", help="write no picture")
    p.add_argument("--no-compare", action="store_true", help="time the chosen drafter only (no side-by-side table)")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, acceptance and speeds")
