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
        num_draft_tokens=args.draft_tokens, ring_len=ring_len, ssm_dtype=ssm_dtype, act_dtype="bfloat16",
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
DEMO_PROMPTS = os.path.join("bench", "data", "prompts.jsonl")
# the style of the held-out benchmark code prompts: the lines before a `def`, the `def` and its first line
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

    def read_sizes(self, fp):
        count = int.from_bytes(fp.read(4), "little")
        sizes = []
        for _ in range(count):
            size = int.from_bytes(fp.read(4), "little")
            sizes.append(size)
        return sizes

    def read_offsets(self, fp):
        count = int.from_bytes(fp.read(4), "little")
'''


def _embedded_dir() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "embedded")


def _prompts_file() -> str | None:
    """bench/data/prompts.jsonl under the working directory or the source checkout, if present."""
    for root in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        path = os.path.join(root, DEMO_PROMPTS)
        if os.path.isfile(path):
            return path
    return None


def _demo_prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str]:
    """-> (prompt id, text): --prompt, --prompt-id, else the benchmark's first code prompt (or the built-in one)."""
    if args.prompt is not None:
        if not args.prompt:
            parser.error("argument --prompt: empty prompt")
        return "custom", args.prompt
    path = _prompts_file()
    if path is None:
        if args.prompt_id is not None:
            parser.error(f"argument --prompt-id: no {DEMO_PROMPTS} in this checkout; pass --prompt TEXT")
        return "built-in", DEMO_PROMPT
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [r for r in records if isinstance(r.get("id"), str) and isinstance(r.get("prompt"), str)]
    except (OSError, ValueError, AttributeError) as exc:
        parser.error(f"argument --prompt-id: cannot read {path}: {type(exc).__name__}: {exc}")
    if args.prompt_id is None:
        code = [r for r in records if r.get("kind") == "code"] or records
        return (code[0]["id"], code[0]["prompt"]) if code else ("built-in", DEMO_PROMPT)
    for r in records:
        if r["id"] == args.prompt_id:
            return r["id"], r["prompt"]
    ids = ", ".join(r["id"] for r in records[:6]) + (", ..." if len(records) > 6 else "")
    parser.error(f"argument --prompt-id: no prompt {args.prompt_id!r} in {path} (ids: {ids or 'none'})")


def _demo_drafter(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, str | None]:
    """-> (kind, trained drafter directory or None); trained drafters ship in `<model>/drafters/<kind>/`."""
    def shipped(kind: str) -> str | None:
        path = os.path.join(args.model, "drafters", kind)
        files = ("config.json", "model.safetensors")
        return path if all(os.path.isfile(os.path.join(path, f)) for f in files) else None

    if args.drafter == "auto":
        best = os.path.join(args.model, "drafters", "best.txt")  # the measured best, written from bench results
        if os.path.isfile(best):
            with open(best) as f:
                kind = f.read().split()[0] if os.path.getsize(best) else ""
            if kind == "ngram" or (kind in DEMO_KINDS and shipped(kind)):
                return kind, shipped(kind) if kind != "ngram" else None
        for kind in DEMO_KINDS:
            if shipped(kind):
                return kind, shipped(kind)
        return "ngram", None
    if args.drafter == "ngram":
        return "ngram", None
    path = shipped(args.drafter)
    if path is None:
        parser.error(f"argument --drafter: no trained {args.drafter} drafter is shipped with the model (no "
                     f"config.json + model.safetensors in {os.path.join(args.model, 'drafters', args.drafter)})")
    return args.drafter, path


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


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
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--num-draft-tokens", args.num_draft_tokens)):
        if value < 1:
            parser.error(f"argument {flag}: expected >= 1, got {value}")
    prompt_id, prompt = _demo_prompt(args, parser)
    kind, drafter_dir = _demo_drafter(args, parser)

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
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    if input_ids.numel() == 0:
        parser.error("argument --prompt: the prompt tokenizes to no tokens")
    P, N = input_ids.numel(), args.max_new_tokens
    try:
        spec = specdec.wrap(model, drafter=drafter_dir or kind, num_draft_tokens=args.num_draft_tokens,
                            max_batch_size=1, max_length=P + N + 1)
        plain = specdec.wrap(model, drafter=NoDrafts(), num_draft_tokens=1, max_batch_size=1, max_length=P + N + 1)
    except ValueError as exc:
        parser.error(_argument_message(str(exc)))
    eos = spec.eos_token_id if spec.eos_token_id is not None else tokenizer.eos_token_id

    def hf_generate(n: int) -> list[int]:  # the model's own greedy decode, on transformers' pure-torch layers
        with torch_fallbacks(), torch.no_grad():
            out = model.generate(input_ids[None], do_sample=False, max_new_tokens=n, eos_token_id=eos,
                                 pad_token_id=spec.pad_token_id)
        return out[0, P:].tolist()

    def specdec_generate(engine, n: int, streamer=None):
        out = engine.generate(input_ids, max_new_tokens=n, eos_token_id=eos, streamer=streamer)
        return out.sequences[0, P:].tolist(), out.stats.as_dict()  # one prompt: no right padding

    def timed(fn, *a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        return out, time.perf_counter() - t

    warm = min(N, 8)  # a short warmup of each path keeps first-call costs out of the timings
    specdec_generate(spec, warm)
    specdec_generate(plain, warm)
    hf_generate(warm)

    streamer = None if args.json or args.no_stream else TextStreamer(tokenizer, skip_prompt=False,
                                                                          skip_special_tokens=True)
    (spec_new, stats), t_spec = timed(specdec_generate, spec, N, streamer)
    hf_new, t_hf = timed(hf_generate, N)
    (plain_new, _), t_plain = timed(specdec_generate, plain, N)

    def ratio(a, b):
        return a / b if b > 0 else 0.0

    tps_spec, tps_hf, tps_plain = ratio(len(spec_new), t_spec), ratio(len(hf_new), t_hf), ratio(len(plain_new), t_plain)
    diff = _first_difference(spec_new, hf_new)
    result = {
        "model": os.path.abspath(args.model), "drafter": kind, "drafter_dir": drafter_dir,
        "num_draft_tokens": args.num_draft_tokens, "prompt_id": prompt_id, "prompt_tokens": P,
        "new_tokens": len(spec_new), "text": tokenizer.decode(spec_new, skip_special_tokens=True), "tokens": spec_new,
        "tau": stats["tau"], "alpha": stats["alpha"], "per_position": stats["per_position"], "rounds": stats["rounds"],
        "proposed": stats["proposed"], "accepted": stats["accepted"],
        "tokens_per_s_spec": tps_spec, "tokens_per_s_plain": tps_hf, "tokens_per_s_plain_specdec": tps_plain,
        "speedup": ratio(tps_spec, tps_hf), "speedup_vs_plain_specdec": ratio(tps_spec, tps_plain),
        "identical": diff is None, "first_difference": diff, "identical_plain_specdec": plain_new == hf_new,
        "seconds": {"spec": t_spec, "plain": t_hf, "plain_specdec": t_plain},
    }
    if args.json:
        print(json.dumps(result))
    else:
        if streamer is None:
            print(tokenizer.decode(input_ids.tolist() + spec_new, skip_special_tokens=True))
        per_pos = " ".join(f"{a:.2f}" for a in stats["per_position"]) or "-"
        n_params = sum(p.numel() for p in model.parameters())
        lossless = f"yes, all {len(spec_new)} tokens" if diff is None else f"NO, first difference at new token {diff}"
        print(f"[demo] {model.config.model_type} model, {n_params / 1e6:.1f}M parameters, from {args.model}\n"
              f"[demo] prompt {prompt_id} ({P} tokens), greedy, {len(spec_new)} new tokens, drafter {kind}"
              f"{f' ({drafter_dir})' if drafter_dir else ''}, gamma {args.num_draft_tokens}\n"
              f"[demo] tau {stats['tau']:.2f} tokens/round, alpha {stats['alpha']:.3f} "
              f"({stats['accepted']}/{stats['proposed']} drafts accepted, {stats['rounds']} rounds)\n"
              f"[demo] acceptance per draft position: {per_pos}\n"
              f"[demo] speculative decode ({kind}):    {tps_spec:7.1f} tokens/s ({t_spec:.2f} s)\n"
              f"[demo] plain, transformers generate:  {tps_hf:7.1f} tokens/s ({t_hf:.2f} s), "
              f"speedup {result['speedup']:.2f}x\n"
              f"[demo] plain, specdec without drafts: {tps_plain:7.1f} tokens/s ({t_plain:.2f} s), "
              f"speedup {result['speedup_vs_plain_specdec']:.2f}x\n"
              f"[demo] identical to transformers' greedy output, token for token: {lossless}")
    if diff is not None:
        print(f"{parser.prog}: error: the speculative output differs from transformers' greedy output at new "
              f"token {diff}", file=sys.stderr)
        return 1
    return 0


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="speculative vs plain decode on the embedded model",
        description="Greedy generation with a drafter on the embedded model (or --model DIR), streamed as tokens "
                    "are committed; then, in the same run, plain decode with transformers' own generate and with "
                    "specdec without drafts. Prints tau, alpha, per-position acceptance, the tokens/s of all three "
                    "(after one short warmup of each), the speedups, and whether the output equals transformers' "
                    "greedy output token for token (exit status 1 if not).")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="save_pretrained directory: model and tokenizer (default: the embedded model); its trained "
                        "drafters are DIR/drafters/{dspark,eagle,mtp}/")
    p.add_argument("--drafter", choices=("auto", "ngram") + DEMO_KINDS[::-1], default="auto",
                   help="auto (default): the drafter named in <model>/drafters/best.txt (the measured best), else the "
                        "best shipped trained drafter (dspark, then eagle, then mtp), else "
                        "ngram (prompt lookup)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="prompt text")
    prompt.add_argument("--prompt-id", metavar="ID", default=None,
                        help=f"a prompt of {DEMO_PROMPTS} (default: its first code prompt, or a built-in one)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (stops early at EOS)")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="draft tokens per round (gamma)")
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
