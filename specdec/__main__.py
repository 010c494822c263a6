"""Command line: `python -m specdec <command> ...` (also installed as `specdec`).

Each command has one `add_<name>_parser(subparsers)` function in `COMMANDS`; it builds its parser
and sets `func` (called with the parsed args and the command's parser, returns the exit status).
Argument errors go through `parser.error`: one error line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable


def _memory(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specdec.replayssm.config import StateConfig, check_ring_len, next_pow2, resolve_dtype
    from specdec.replayssm.plan import format_plan, plan_json

    for flag, value, low in (("--layers", args.layers, 1), ("--slots", args.slots, 2), ("--heads", args.heads, 1),
                             ("--tp", args.tp, 1), ("--head-dim", args.head_dim, 1),
                             ("--conv-kernel", args.conv_kernel, 2)):
        if value < low:
            parser.error(f"argument {flag}: expected >= {low}, got {value}")
    if args.heads % args.tp:
        parser.error(f"argument --heads: {args.heads} heads are not divisible by --tp {args.tp}")
    if args.draft_tokens < 1:
        parser.error(f"argument --draft-tokens: expected D >= 1, got {args.draft_tokens}")
    max_requests = args.slots - 1
    running = max_requests if args.running is None else args.running
    if not 1 <= running <= max_requests:
        parser.error(f"argument --running: expected 1 <= running <= slots-1 = {max_requests}, got {running}")
    ring_len = next_pow2(2 * args.draft_tokens) if args.ring_len is None else args.ring_len
    try:
        check_ring_len(ring_len, args.draft_tokens)
    except ValueError as exc:
        parser.error(f"argument --ring-len: {str(exc).removeprefix('ring_len: ')}")
    try:
        ssm_dtype = resolve_dtype(args.ssm_dtype, arg="--ssm-dtype")
    except ValueError as exc:
        parser.error(f"argument {exc}")

    heads = args.heads // args.tp
    k = v = args.head_dim
    cfg = StateConfig(
        num_layers=args.layers, num_heads=heads, head_k_dim=k, head_v_dim=v, conv_kernel=args.conv_kernel,
        conv_dim=heads * (2 * k + v), gate=args.gate, max_requests=max_requests, max_running=running,
        num_verify_tokens=args.draft_tokens, ring_len=ring_len, ssm_dtype=ssm_dtype, act_dtype="bfloat16",
    )
    print(json.dumps(plan_json(cfg), indent=2) if args.json else format_plan(cfg))
    return 0


def add_memory_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "memory", help="print the memory plan of the state buffers",
        description="Shape, dtype and size (GiB) of every state buffer, in the style of SGLang's allocation "
                    "log, and the full-snapshot scheme vs ReplaySSM for the same settings.")
    p.add_argument("--layers", type=int, required=True, help="linear-attention layers")
    p.add_argument("--slots", type=int, required=True, help="pool slots, including the null slot")
    p.add_argument("--heads", type=int, required=True, help="linear-attention heads (all ranks)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; heads per rank = heads / tp")
    p.add_argument("--head-dim", type=int, default=128, help="K = V")
    p.add_argument("--conv-kernel", type=int, default=4, help="short-conv kernel width (window = kernel - 1)")
    p.add_argument("--draft-tokens", type=int, default=8, help="D: tokens per verify step")
    p.add_argument("--ring-len", type=int, default=None, help="L, a power of two >= 2*D (default next_pow2(2*D))")
    p.add_argument("--running", type=int, default=None,
                   help="running requests; spec buffers get running+1 rows (default slots-1)")
    p.add_argument("--ssm-dtype", default="float32", help="float32 | bfloat16 | float16 | float64")
    p.add_argument("--gate", choices=("kda", "gdn"), default="kda", help="kda: per-channel g; gdn: scalar g")
    p.add_argument("--json", action="store_true", help="print byte counts as JSON")
    p.set_defaults(func=_memory, parser=p)


def _check_generate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import os
    for flag, value in (("--model", args.model), ("--draft-model", args.draft_model)):
        if value is not None and not os.path.isdir(value):
            parser.error(f"argument {flag}: no such directory: {value}")
    if args.drafter is None:
        args.drafter = "model" if args.draft_model is not None else "ngram"
    if args.drafter == "model" and args.draft_model is None:
        parser.error("argument --draft-model: required with --drafter model")
    if args.drafter == "ngram" and args.draft_model is not None:
        parser.error("argument --draft-model: only used with --drafter model")
    for flag, value in (("--num-draft-tokens", args.num_draft_tokens), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            parser.error(f"argument {flag}: expected >= 1, got {value}")
    if not args.prompt:
        parser.error("argument --prompt: empty prompt")
    sampling = (("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p))
    if not args.do_sample:
        for flag, value in sampling:
            if value is not None:
                parser.error(f"argument {flag}: only used with --do-sample")
    if args.temperature is not None and not args.temperature > 0:
        parser.error(f"argument --temperature: expected > 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        parser.error(f"argument --top-k: expected >= 0 (0 = off), got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"argument --top-p: expected 0 < top_p <= 1, got {args.top_p}")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            parser.error("argument --device: CUDA is not available")


def _load(path: str, flag: str, dtype, device: str, parser: argparse.ArgumentParser, tokenizer: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
    except Exception as exc:  # no config / weights / tokenizer, unknown architecture, ...
        first = (str(exc).strip().splitlines() or [""])[0]
        parser.error(f"argument {flag}: cannot load {path}: {type(exc).__name__}: {first}")
    return model, tok


def _format_stats(stats: dict) -> str:
    per_pos = " ".join(f"{a:.2f}" for a in stats["per_position"]) or "-"
    return (f"[specdec] {stats['new_tokens']} new tokens in {stats['timings']['total']:.2f} s "
            f"({stats['tokens_per_s']:.1f} tokens/s), {stats['rounds']} rounds\n"
            f"[specdec] tau {stats['tau']:.2f} tokens/round, alpha {stats['alpha']:.3f} "
            f"({stats['accepted']}/{stats['proposed']} drafts accepted)\n"
            f"[specdec] acceptance per draft position: {per_pos}")


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_generate_args(args, parser)
    import warnings
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    import torch
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    import specdec

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, args.dtype)
    model, tokenizer = _load(args.model, "--model", dtype, args.device, parser, tokenizer=True)
    draft_model = None
    if args.draft_model is not None:
        draft_model, _ = _load(args.draft_model, "--draft-model", dtype, args.device, parser, tokenizer=False)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids[0]
    if input_ids.numel() == 0:
        parser.error("argument --prompt: the prompt tokenizes to no tokens")
    options = {"drafter": args.drafter, "num_draft_tokens": args.num_draft_tokens, "strategy": args.strategy,
               "commit": args.commit, "draft_model": draft_model}
    try:
        engine = specdec.wrap(model, **options)
    except ValueError as exc:
        parser.error(_argument_message(str(exc)))
    eos = engine.eos_token_id if engine.eos_token_id is not None else tokenizer.eos_token_id
    sampling = {}
    if args.do_sample:
        sampling = {"do_sample": True, "temperature": 1.0 if args.temperature is None else args.temperature,
                    "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}
    if args.seed is not None:
        torch.manual_seed(args.seed)
    streamer = None if args.json or args.no_stream else TextStreamer(tokenizer, skip_prompt=False,
                                                                          skip_special_tokens=True)
    try:
        out = engine.generate(input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, seed=args.seed,
                              streamer=streamer, **sampling)
    except ValueError as exc:
        parser.error(_argument_message(str(exc)))
    new = out.sequences[0, input_ids.numel():].tolist()  # one prompt: no right padding
    stats = out.stats.as_dict()
    total = stats["timings"]["total"]
    stats["new_tokens"] = len(new)
    stats["tokens_per_s"] = len(new) / total if total > 0 else 0.0
    text = tokenizer.decode(new, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "tokens": new, "stats": stats}))
        return 0
    if streamer is None:
        print(tokenizer.decode(input_ids.tolist(), skip_special_tokens=True) + text)
    print(_format_stats(stats))
    return 0


_ENGINE_ARGS = {"max_new_tokens": "--max-new-tokens", "num_draft_tokens": "--num-draft-tokens",
                "draft_model": "--draft-model", "strategy": "--strategy", "commit": "--commit",
                "drafter": "--drafter", "input_ids": "--prompt", "temperature": "--temperature",
                "top_k": "--top-k", "top_p": "--top-p"}


def _argument_message(message: str) -> str:
    """`max_new_tokens: ...` from the engine -> `argument --max-new-tokens: ...`."""
    name, sep, rest = message.partition(": ")
    return f"argument {_ENGINE_ARGS[name]}: {rest}" if sep and name in _ENGINE_ARGS else message


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate from a local model with speculative decoding",
        description="Load a local save_pretrained directory (model and tokenizer), generate with specdec.wrap and "
                    "stream the text as tokens are committed, then print tau, alpha, per-position acceptance, "
                    "rounds and tokens/s. Greedy output equals the model's own greedy decode.")
    p.add_argument("--model", required=True, metavar="DIR", help="save_pretrained directory: model and tokenizer")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--drafter", choices=("ngram", "model"), default=None,
                   help="ngram: prompt lookup (default); model: a draft model (--draft-model)")
    p.add_argument("--draft-model", metavar="DIR", default=None,
                   help="save_pretrained directory of the draft model (same vocabulary); implies --drafter model")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="draft tokens per round (gamma)")
    p.add_argument("--strategy", choices=("replay", "snapshot"), default="replay",
                   help="recurrent-state strategy: replay (ReplaySSM) or snapshot (full snapshots)")
    p.add_argument("--commit", choices=("eager", "lazy"), default="eager",
                   help="eager: fold accepted tokens after each round; lazy: fold when needed")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (stops early at EOS)")
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="top-k filter, 0 = off (default)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus filter (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32",
                   help="model dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {text, tokens, stats} (generated text and token ids only)")
    p.set_defaults(func=_generate, parser=p)


# ---- demo ------------------------------------------------------------------------------------------
DEMO_KINDS = ("dspark", "eagle", "mtp")  # trained drafters, best first: what `--drafter auto` picks
COMPARE_KINDS = ("ngram", "mtp", "eagle", "dspark")  # the side-by-side table, in this order
PROMPTS_NAME = "prompts.jsonl"  # the held-out benchmark prompts (a copy of bench/data/prompts.jsonl), package data
SMALL_MODEL = 50e6  # parameters: below this one torch thread is fastest (and steadiest) on a CPU
NOISY = 0.25  # spread between repeats above which one ratio would mislead
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
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "embedded")


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


def _spread(times: list[float]) -> float:
    """(max - min) / median of repeated timings of one run."""
    import statistics
    med = statistics.median(times)
    return (max(times) - min(times)) / med if med > 0 and len(times) > 1 else 0.0


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
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
    prompts, prompts_path = _demo_prompts(args, parser)
    kind, drafter_dir = _demo_drafter(args, parser)
    compare = [] if args.no_compare else [(k, None if k == "ngram" else _shipped(args.model, k))
                                          for k in COMPARE_KINDS if k == "ngram" or _shipped(args.model, k)]
    compare = [(kind, drafter_dir)] + [c for c in compare if c[0] != kind]  # the headline drafter first

    import statistics
    import time
    import warnings
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    import torch
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    import specdec
    from specdec.draft import DraftBlock, Drafter
    from specdec.hf_compat import torch_fallbacks

    class NoDrafts(Drafter):
        """Proposes nothing: every round verifies the anchor alone, i.e. specdec's own plain decode."""

        name = "none"

        def propose(self, rows, contexts, gamma, *, sampling=None, generator=None):
            return DraftBlock.empty(len(rows), contexts[0].device)

    hf_logging.disable_progress_bar()
    model, tokenizer = _load(args.model, "--model", torch.float32, "cpu", parser, tokenizer=True)
    n_params = sum(p.numel() for p in model.parameters())
    threads = args.threads or (1 if n_params < SMALL_MODEL else torch.get_num_threads())
    torch.set_num_threads(threads)
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
        plain = specdec.wrap(model, drafter=NoDrafts(), num_draft_tokens=1, max_batch_size=1, max_length=max_length)
    except ValueError as exc:
        parser.error(_argument_message(str(exc)))
    spec = engines[kind]
    eos = spec.eos_token_id if spec.eos_token_id is not None else tokenizer.eos_token_id

    def hf_generate(ids, n: int) -> list[int]:  # the model's own greedy decode, on transformers' pure-torch layers
        with torch_fallbacks(), torch.no_grad():
            out = model.generate(ids[None], do_sample=False, max_new_tokens=n, eos_token_id=eos,
                                 pad_token_id=spec.pad_token_id)
        return out[0, ids.numel():].tolist()

    def specdec_generate(engine, ids, n: int, streamer=None):
        out = engine.generate(ids, max_new_tokens=n, eos_token_id=eos, streamer=streamer)
        return out.sequences[0, ids.numel():].tolist(), out.stats  # one prompt: no right padding

    def timed(fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        return out, time.perf_counter() - t

    # the streamed text: the headline drafter on the first prompt, untimed (it also warms that path up)
    streamer = None if args.json or args.no_stream else TextStreamer(tokenizer, skip_prompt=False,
                                                                          skip_special_tokens=True)
    specdec_generate(spec, runs[0]["ids"], N, streamer)
    warm = min(N, 8)  # a short warmup of every other path keeps first-call costs out of the timings
    for e in (plain, *(e for k, e in engines.items() if k != kind)):
        specdec_generate(e, runs[0]["ids"], warm)
    hf_generate(runs[0]["ids"], warm)
    if not args.json:
        others = ", ".join(k for k in engines if k != kind)
        print(f"\n[demo] timing: {len(runs)} prompt(s) x {R} interleaved repeats of {kind} and plain decode (and "
              f"transformers generate on {runs[0]['id']}){f', one run per prompt of {others}' if others else ''}, "
              f"torch threads {threads} ...", flush=True)

    # timed runs, per prompt interleaved: spec, plain, spec, plain, ... (on the streamed prompt also transformers'
    # generate in every repeat; the other drafters once per prompt, in the first repeat)
    for n, run in enumerate(runs):
        ids = run["ids"]
        run["times"] = {k: [] for k in ("spec", "plain")}
        hf_times = []
        for r in range(R):
            (toks, stats), t = timed(specdec_generate, spec, ids, N)
            run["times"]["spec"].append(t)
            (ptoks, _), tp = timed(specdec_generate, plain, ids, N)
            run["times"]["plain"].append(tp)
            if n == 0:
                run["hf"], t_hf = timed(hf_generate, ids, N)
                hf_times.append(t_hf)
            if r == 0:
                run["spec"], run["stats"], run["plain"] = toks, stats, ptoks
                run["other"] = {}
                for k, e in engines.items():
                    if k != kind:
                        run["other"][k] = timed(specdec_generate, e, ids, N)
        run["t_spec"] = statistics.median(run["times"]["spec"])
        run["t_plain"] = statistics.median(run["times"]["plain"])
        run["tps_spec"], run["tps_plain"] = len(run["spec"]) / run["t_spec"], len(run["plain"]) / run["t_plain"]
        run["speedup"] = run["tps_spec"] / run["tps_plain"]
        if n == 0:
            run["times"]["transformers"] = hf_times
            run["tps_hf"] = len(run["hf"]) / statistics.median(hf_times)
        run["spread"] = max(_spread(v) for v in run["times"].values())
        run["diff"] = _first_difference(run["spec"], run["plain"])  # the plain decode: checked against transformers

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

    med = statistics.median
    head = pooled([r["stats"] for r in runs])
    speedup = med([r["speedup"] for r in runs])
    per_repeat = [med([len(r["spec"]) / r["times"]["spec"][i] / (len(r["plain"]) / r["times"]["plain"][i])
                       for r in runs]) for i in range(R)]
    spread = med([r["spread"] for r in runs])
    noisy = spread > NOISY
    drafters = {kind: {"drafter_dir": drafter_dir, **{k: head[k] for k in ("tau", "alpha")},
                       "tokens_per_s": med([r["tps_spec"] for r in runs]), "speedup": speedup,
                       "identical": all(r["spec"] == r["plain"] for r in runs), "repeats": R}}
    for k, d in compare:
        if k == kind:
            continue
        st = pooled([r["other"][k][0][1] for r in runs])
        tps = [len(r["other"][k][0][0]) / r["other"][k][1] for r in runs]
        drafters[k] = {"drafter_dir": d, "tau": st["tau"], "alpha": st["alpha"], "tokens_per_s": med(tps),
                       "speedup": med([t / r["tps_plain"] for t, r in zip(tps, runs)]),
                       "identical": all(r["other"][k][0][0] == r["plain"] for r in runs), "repeats": 1}
    first = runs[0]
    hf_diff = _first_difference(first["spec"], first["hf"])
    diffs = ([(first["id"], hf_diff, "transformers' greedy output")] if hf_diff is not None else []) + \
        [(r["id"], r["diff"], "plain decode") for r in runs if r["diff"] is not None]
    result = {
        "model": os.path.abspath(args.model), "params": n_params, "threads": threads, "drafter": kind,
        "drafter_dir": drafter_dir, "num_draft_tokens": args.num_draft_tokens, "prompts_file": prompts_path,
        "prompt_ids": [r["id"] for r in runs], "repeats": R,
        "prompt_id": first["id"], "prompt_tokens": first["P"], "new_tokens": len(first["spec"]),
        "text": tokenizer.decode(first["spec"], skip_special_tokens=True), "tokens": first["spec"], **head,
        "tokens_per_s_spec": drafters[kind]["tokens_per_s"], "tokens_per_s_plain": med([r["tps_plain"] for r in runs]),
        "tokens_per_s_transformers": first["tps_hf"], "speedup": speedup,
        "speedup_vs_transformers": first["tps_spec"] / first["tps_hf"],
        "speedup_per_repeat": per_repeat, "spread": spread, "noisy": noisy,
        "identical": not diffs, "first_difference": hf_diff, "identical_plain_specdec": first["plain"] == first["hf"],
        "drafters": drafters,
        "prompts": [{"id": r["id"], "prompt_tokens": r["P"], "new_tokens": len(r["spec"]), "tau": r["stats"].tau,
                     "speedup": r["speedup"], "spread": r["spread"], "seconds_spec": r["times"]["spec"],
                     "seconds_plain": r["times"]["plain"], "seconds_transformers": r["times"].get("transformers"),
                     "identical": r["diff"] is None} for r in runs],
    }
    if args.json:
        print(json.dumps(result))
    else:
        if streamer is None:
            print(tokenizer.decode(first["ids"].tolist() + first["spec"], skip_special_tokens=True))
        per_pos = " ".join(f"{a:.2f}" for a in head["per_position"]) or "-"
        n_new = sum(len(r["spec"]) for r in runs)
        lossless = (f"yes on {first['id']}, and equal to plain decode on all {len(runs)} prompt(s) ({n_new} tokens)"
                    if not diffs else "NO: " + ", ".join(f"{pid} differs from {what} at new token {d}"
                                                         for pid, d, what in diffs))
        over = f"median over {len(runs)} held-out prompts" if len(runs) > 1 else f"prompt {first['id']}"
        if noisy:
            lo, hi = min(per_repeat), max(per_repeat)
            verdict = (f"timing is noisy on this machine: repeats differ by {spread * 100:.0f}% (speedup "
                       f"{lo:.2f}x to {hi:.2f}x over repeats); rerun on a quiet machine or with more --repeats")
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
              f"[demo] plain, transformers generate:  {result['tokens_per_s_transformers']:7.1f} tokens/s "
              f"(prompt {first['id']}, median of {R}), speedup {result['speedup_vs_transformers']:.2f}x there\n"
              f"[demo] identical to transformers' greedy output, token for token: {lossless}")
        if len(drafters) > 1:
            print(f"[demo] drafters side by side ({over}; speedup vs plain specdec decode"
                  f"{'; timing is noisy on this machine, so the speedups are rough' if noisy else ''}):")
            print(f"[demo]   {'drafter':8s} {'tau':>5s} {'alpha':>6s} {'tokens/s':>9s} {'speedup':>8s}  identical")
            for k, d in drafters.items():
                runs_note = f"median of {d['repeats']} repeats" if d["repeats"] > 1 else "one run per prompt"
                print(f"[demo]   {k:8s} {d['tau']:5.2f} {d['alpha']:6.3f} {d['tokens_per_s']:9.1f} "
                      f"{d['speedup']:7.2f}x  {'yes' if d['identical'] else 'NO'}  ({runs_note})")
    if diffs:
        pid, d, what = diffs[0]
        print(f"{parser.prog}: error: the speculative output differs from {what} on prompt {pid} at new token {d}",
              file=sys.stderr)
        return 1
    return 0


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="speculative vs plain decode on the embedded model",
        description="Greedy generation with a drafter on the embedded model (or --model DIR): the first prompt's "
                    "text is streamed as tokens are committed; then, on each held-out code prompt shipped with the "
                    "package, the drafter and plain decode (specdec without drafts) run interleaved, --repeats "
                    "times after a warmup of each path, with transformers' own generate on the first prompt, and the "
                    "other shipped drafters once per prompt. Prints the torch thread count, tau, alpha, per-position "
                    "acceptance, tokens/s and speedup (medians over prompts and repeats; a range instead when "
                    "repeats differ by more than 25%), a table of the drafters side by side, and whether the output "
                    "equals transformers' greedy output token for token (exit status 1 if not).")
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
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens to generate per prompt (stops early at EOS)")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="draft tokens per round (gamma)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats per prompt, >= 3 (median)")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch intra-op threads (default: 1 for models under {SMALL_MODEL / 1e6:.0f}M parameters, "
                        f"else torch's default)")
    p.add_argument("--no-compare", action="store_true", help="time the chosen drafter only (no side-by-side table)")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, tokens, acceptance and speeds")
    p.set_defaults(func=_demo, parser=p)


COMMANDS: list[Callable] = [add_memory_parser, add_generate_parser, add_demo_parser]


class _Parser(argparse.ArgumentParser):
    """`error` prints one line (no usage block) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(subparsers)
    parser.set_defaults(command_names=sorted(subparsers.choices))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.error("a command is required: " + ", ".join(args.command_names))
        return int(args.func(args, args.parser) or 0)
    except SystemExit as exc:  # argparse errors and --help: return the status instead of exiting
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
