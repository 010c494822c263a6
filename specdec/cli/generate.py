"""`specdec generate`: generate from a local model with speculative decoding, streaming the text."""

from __future__ import annotations

import argparse
import json
import os

NAME = "generate"
HELP = "generate from a local model with speculative decoding"
DESCRIPTION = ("Load a local save_pretrained directory (model and tokenizer), generate with specdec.wrap and "
               "stream the text as tokens are committed, then print tau, alpha, per-position acceptance, "
               "rounds and tokens/s. Greedy output equals the model's own greedy decode.")


DRAFTERS = ("ngram", "model", "native")


def _check_generate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag, value in (("--model", args.model), ("--draft-model", args.draft_model)):
        if value is not None and not os.path.isdir(value):
            parser.error(f"argument {flag}: no such directory: {value}")
    if args.drafter is None:
        args.drafter = "model" if args.draft_model is not None else "ngram"
    if args.drafter not in (*DRAFTERS, "none") and not os.path.isdir(args.drafter):
        parser.error(f"argument --drafter: expected {', '.join(DRAFTERS)}, none or a drafter directory, got "
                     f"{args.drafter!r} (not a directory)")
    if args.drafter == "model" and args.draft_model is None:
        parser.error("argument --draft-model: required with --drafter model")
    if args.drafter != "model" and args.draft_model is not None:
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
    if args.threads is not None and args.threads < 1:
        parser.error(f"argument --threads: expected >= 1, got {args.threads}")
    check_ranks(args, parser, "generate")


def check_ranks(args: argparse.Namespace, parser: argparse.ArgumentParser, command: str) -> None:
    """`--tp N`: at least 1, and N processes started by torchrun for N > 1."""
    if args.tp < 1:
        parser.error(f"argument --tp: expected >= 1, got {args.tp}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp > 1 and world != args.tp:
        parser.error(f"argument --tp: {args.tp} ranks need as many processes, launched by torchrun "
                     f"(torchrun --nproc-per-node {args.tp} -m specdec {command} ...); WORLD_SIZE is {world}")


def on_ranks(args: argparse.Namespace, fn):
    """`fn(group, device)` on this process's rank (`tensor_parallel`; no group without `--tp`), the process group
    closed after it, with the command line's quiet setup (no progress bars, no fla-on-CPU warning)."""
    import warnings
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    group, device = tensor_parallel(args)
    ok = False
    try:
        code = fn(group, device)
        ok = True
        return code
    finally:
        if group is not None:
            from specdec.parallel import close_group
            close_group(ok)


def wrap_or_error(model, options: dict, group, parser: argparse.ArgumentParser):
    """`specdec.wrap(model, **options)` on the rank's `group` (None: no tensor parallelism); a refused option is the
    command's argument error."""
    import specdec

    try:
        return specdec.wrap(model, **options, **({} if group is None else {"tp_group": group}))
    except ValueError as exc:
        parser.error(argument_message(str(exc)))


def error_line(exc: Exception) -> str:
    """An exception as one line for a command-line error: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"


def tensor_parallel(args: argparse.Namespace):
    """With `--tp N`: this process's rank in the group torchrun started (gloo on CPU, NCCL on CUDA, each rank on
    its local GPU), and the device it runs on; else (None, the device)."""
    if args.tp == 1:
        return None, args.device
    import torch
    import torch.distributed as dist
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    return dist.group.WORLD, device


def load_model(path: str, flag: str, dtype, device: str, parser: argparse.ArgumentParser, tokenizer: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(path) if tokenizer else None
    except Exception as exc:  # no config / weights / tokenizer, unknown architecture, ...
        parser.error(f"argument {flag}: cannot load {path}: {error_line(exc)}")
    return model, tok


def _format_stats(stats: dict) -> str:
    per_pos = " ".join(f"{a:.2f}" for a in stats["per_position"]) or "-"
    return (f"[specdec] {stats['new_tokens']} new tokens in {stats['timings']['total']:.2f} s "
            f"({stats['tokens_per_s']:.1f} tokens/s), {stats['rounds']} rounds; first token after "
            f"{stats['timings']['prefill']:.2f} s\n"
            f"[specdec] tau {stats['tau']:.2f} tokens/round, alpha {stats['alpha']:.3f} "
            f"({stats['accepted']}/{stats['proposed']} drafts accepted)\n"
            f"[specdec] acceptance per draft position: {per_pos}")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_generate_args(args, parser)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    return on_ranks(args, lambda group, device: _generate(args, parser, dtype, group, device))


def _generate(args: argparse.Namespace, parser: argparse.ArgumentParser, dtype, group, device) -> int:
    import torch
    from transformers import TextStreamer

    lead = group is None or torch.distributed.get_rank() == 0  # with --tp, rank 0 streams and prints
    model, tokenizer = load_model(args.model, "--model", dtype, device, parser, tokenizer=True)
    draft_model = None
    if args.draft_model is not None:
        draft_model, _ = load_model(args.draft_model, "--draft-model", dtype, device, parser, tokenizer=False)
    input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids[0]
    if input_ids.numel() == 0:
        parser.error("argument --prompt: the prompt tokenizes to no tokens")
    options = {"drafter": None if args.drafter == "none" else args.drafter, "num_draft_tokens": args.num_draft_tokens,
               "strategy": args.strategy,
               "commit": args.commit, "draft_model": draft_model}
    engine = wrap_or_error(model, options, group, parser)
    eos = engine.eos_token_id if engine.eos_token_id is not None else tokenizer.eos_token_id
    sampling = {"do_sample": False}  # the command's default, whatever the model's generation_config says
    if args.do_sample:
        sampling = {"do_sample": True, "temperature": 1.0 if args.temperature is None else args.temperature,
                    "top_k": args.top_k or 0, "top_p": 1.0 if args.top_p is None else args.top_p}
    if args.seed is not None:
        torch.manual_seed(args.seed)
    streamer = None if args.json or args.no_stream or not lead else TextStreamer(tokenizer, skip_prompt=False,
                                                                          skip_special_tokens=True)
    try:
        out = engine.generate(input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, seed=args.seed,
                              streamer=streamer, **sampling)
    except ValueError as exc:
        parser.error(argument_message(str(exc)))
    new = out.sequences[0, input_ids.numel():].tolist()  # one prompt: no right padding
    stats = out.stats.as_dict()
    total = stats["timings"]["total"]
    stats["new_tokens"] = len(new)
    stats["tokens_per_s"] = len(new) / total if total > 0 else 0.0
    text = tokenizer.decode(new, skip_special_tokens=True)
    if not lead:
        return 0
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


def argument_message(message: str) -> str:
    """`max_new_tokens: ...` from the engine -> `argument --max-new-tokens: ...`."""
    name, sep, rest = message.partition(": ")
    return f"argument {_ENGINE_ARGS[name]}: {rest}" if sep and name in _ENGINE_ARGS else message


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="save_pretrained directory: model and tokenizer")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--drafter", default=None, metavar="{ngram,model,native,none,DIR}",
                   help="ngram: prompt lookup (default); none: plain decoding; model: a draft model (--draft-model); "
                        "native: the MTP "
                        "layers of the model's own checkpoint; DIR: a trained drafter (eagle, mtp or dspark, as "
                        "python -m specdec draft-train saves it) or an EAGLE-3 checkpoint (SpecForge / SGLang)")
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
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N (each rank holds 1/N of the "
                        "heads; rank 0 prints)")
    p.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {text, tokens, stats} (generated text and token ids only)")
