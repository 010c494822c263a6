"""`specdec serve`: an OpenAI-compatible HTTP server over a local model with speculative decoding."""

from __future__ import annotations

import argparse
import os
import sys

from .generate import DRAFTERS, check_ranks, load_model, on_ranks, wrap_or_error

NAME = "serve"
HELP = "an OpenAI-compatible server over a local model"
DESCRIPTION = ("Load a local save_pretrained directory (model and tokenizer) and serve /v1/completions, "
               "/v1/chat/completions, /v1/models, /health and /metrics (FastAPI + uvicorn: pip install "
               "'specdec[serve]'). Concurrent requests are batched in the engine's rounds; the prefix cache is on, "
               "so a conversation's next turn starts from its cached state.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="save_pretrained directory: model and tokenizer")
    p.add_argument("--drafter", default="ngram", metavar="{ngram,native,DIR,none}",
                   help="ngram: prompt lookup (default); native: the checkpoint's own MTP layers; DIR: a trained "
                        "drafter (eagle, mtp or dspark) or an EAGLE-3 checkpoint; none: plain decoding")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float64"), default="float32", help="model dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device")
    p.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together at most")
    p.add_argument("--max-length", type=int, default=None, help="prompt + new tokens of one request at most")
    p.add_argument("--num-draft-tokens", type=int, default=7, help="draft tokens per round (gamma)")
    p.add_argument("--prefix-cache-mib", type=float, default=1024,
                   help="the prefix cache's budget in MiB (0: no prefix cache)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N (rank 0 serves HTTP, every rank "
                        "runs the same rounds)")
    p.add_argument("--log-level", default="warning", help="uvicorn's log level")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not os.path.isdir(args.model):
        parser.error(f"argument --model: no such directory: {args.model}")
    if args.drafter not in (*DRAFTERS, "none") and not os.path.isdir(args.drafter):
        parser.error(f"argument --drafter: expected ngram, native, none or a drafter directory, got {args.drafter!r}")
    if args.drafter == "model":
        parser.error("argument --drafter: a draft model is not served yet (use ngram, native, a drafter DIR or none)")
    for flag, value in (("--max-batch-size", args.max_batch_size), ("--num-draft-tokens", args.num_draft_tokens)):
        if value < 1:
            parser.error(f"argument {flag}: expected >= 1, got {value}")
    if not 0 < args.port < 65536:
        parser.error(f"argument --port: expected 1-65535, got {args.port}")
    check_ranks(args, parser, "serve")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        parser.error(f"serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'specdec[serve]'")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("argument --device: CUDA is not available")
    return on_ranks(args, lambda group, device: _serve(args, parser, group, device))


def _serve(args, parser, group, device) -> int:
    import torch
    import uvicorn

    from specdec.build import prefix_cache_refusal
    from specdec.server import create_app

    model, tokenizer = load_model(args.model, "--model", getattr(torch, args.dtype), device, parser,
                                  tokenizer=True)
    options = dict(drafter=None if args.drafter == "none" else args.drafter, max_batch_size=args.max_batch_size,
                   num_draft_tokens=args.num_draft_tokens)
    if args.max_length is not None:
        options["max_length"] = args.max_length
    refused = prefix_cache_refusal(model, tp=group is not None)
    if args.prefix_cache_mib > 0 and refused is None:
        options["prefix_cache"] = int(args.prefix_cache_mib * (1 << 20))
    elif args.prefix_cache_mib > 0:  # on by default: a target the cache cannot serve runs without it
        print(f"[specdec serve] no prefix cache: {refused}", file=sys.stderr)
    engine = wrap_or_error(model, options, group, parser)
    if group is not None and torch.distributed.get_rank() != 0:
        engine.follow()  # rank 0's loop leads, step for step, until it stops
        return 0
    name = args.served_model_name or args.model
    app = create_app(engine, tokenizer, model_name=name)
    print(f"[specdec] serving {name} on http://{args.host}:{args.port}/v1 (drafter {args.drafter})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
