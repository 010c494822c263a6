"""`specdec memory`: the memory plan of the state buffers for given model and pool settings."""

from __future__ import annotations

import argparse
import json

NAME = "memory"
HELP = "print the memory plan of the state buffers"
DESCRIPTION = ("Shape, dtype and size (GiB) of every state buffer, in the style of SGLang's allocation "
               "log, and the full-snapshot scheme vs ReplaySSM for the same settings (chain and trees). "
               "--model DIR reads the shapes from a hybrid model's config (no weights are loaded); otherwise "
               "--layers, --slots and --heads give them.")


def model_shapes(path: str, parser: argparse.ArgumentParser) -> dict:
    """The linear-attention shapes of the hybrid model whose config is in `path`: its modules built on the meta
    device (no memory, no weights) and read through the family's adapter, as the runner reads them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.adapters import HYBRID_FAMILIES, layer_kind
    from specdec.runner import _layer_plan

    from .generate import error_line
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        parser.error(f"argument --model: cannot read a config in {path}: {error_line(exc)}")
    family = config.model_type
    if family not in HYBRID_FAMILIES:
        parser.error(f"argument --model: no hybrid adapter for model_type {family!r} (known: "
                     f"{', '.join(sorted(HYBRID_FAMILIES))})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = HYBRID_FAMILIES[family]
    n = config.num_hidden_layers
    layers = list(model.model.layers)[:n]
    kinds = [layer_kind(t) for t in config.layer_types[:n]]
    mixers = _layer_plan(family, spec, layers, kinds)[3]
    dims = spec.mixer.dims(mixers[min(mixers)])
    return dict(layers=len(mixers), heads=dims["num_heads"], k=dims["head_k_dim"], v=dims["head_v_dim"],
                conv_kernel=dims["conv_kernel"], conv_dim=dims["conv_dim"], gate=spec.mixer.gate,
                rule=spec.mixer.rule, family=family)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from specdec.replayssm.config import StateConfig, check_ring_len, next_pow2, resolve_dtype
    from specdec.replayssm.plan import format_plan, plan_json

    shapes = None
    if args.model is not None:
        for flag, value in (("--layers", args.layers), ("--heads", args.heads)):
            if value is not None:
                parser.error(f"argument {flag}: read from --model; give one or the other")
        shapes = model_shapes(args.model, parser)
        args.layers, args.heads, args.head_dim = shapes["layers"], shapes["heads"], shapes["k"]
        args.conv_kernel, args.gate, args.rule = shapes["conv_kernel"], shapes["gate"], shapes["rule"]
        args.slots = 9 if args.slots is None else args.slots  # wrap's max_batch_size 8, and the null slot
    for flag, value in (("--layers", args.layers), ("--slots", args.slots), ("--heads", args.heads)):
        if value is None:
            parser.error(f"argument {flag}: required without --model")
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
        act_dtype = resolve_dtype(args.act_dtype, arg="--act-dtype")
    except ValueError as exc:
        parser.error(f"argument {exc}")

    heads = args.heads // args.tp
    if shapes is not None:  # the model's own: its conv spans every head's channels, split by tp as its heads are
        k, v = shapes["k"], shapes["v"]
        conv_dim = shapes["conv_dim"] // args.tp
    elif args.rule == "mamba2":
        if args.state_dim is None or args.state_dim < 1:
            parser.error(f"argument --state-dim: the mamba2 rule needs N >= 1, got {args.state_dim}")
        if args.groups < 1 or args.groups % args.tp or heads % max(args.groups // args.tp, 1):
            parser.error(f"argument --groups: expected G >= 1 dividing the heads per rank after --tp {args.tp}, "
                         f"got {args.groups}")
        if args.gate == "kda":
            parser.error("argument --gate: the mamba2 rule decays each head by a scalar; use --gate gdn")
        # a Mamba2 head: K = N (B, C), V = P (x); the conv runs over [x, B, C] of the rank's groups
        k, v = args.state_dim, args.head_dim
        conv_dim = heads * v + 2 * (args.groups // args.tp) * k
    else:
        k = v = args.head_dim
        conv_dim = heads * (2 * k + v)
    gate_record = args.gate_record
    if gate_record is None:  # Kimi's gate from its input where the layout is ours; SGLang's keeps log-decays
        gate_record = "input" if args.gate == "kda" and args.rule == "delta" and args.layout != "sglang" else "g"
    if gate_record == "input" and (args.gate != "kda" or args.rule != "delta"):
        parser.error("argument --gate-record: 'input' is the KDA gate's input (with --gate kda, --rule delta)")
    cfg = StateConfig(
        num_layers=args.layers, num_heads=heads, head_k_dim=k, head_v_dim=v, conv_kernel=args.conv_kernel,
        conv_dim=conv_dim, gate=args.gate, rule=args.rule, max_requests=max_requests, max_running=running,
        num_verify_tokens=args.draft_tokens, ring_len=ring_len, ssm_dtype=ssm_dtype, act_dtype=act_dtype,
        gate_in_kernel=gate_record == "input",
    )
    print(json.dumps(plan_json(cfg, layout=args.layout), indent=2) if args.json
          else format_plan(cfg, layout=args.layout))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a hybrid model's directory: layers, heads, head dims, conv and gate from its config")
    p.add_argument("--layers", type=int, default=None, help="linear-attention layers (without --model)")
    p.add_argument("--slots", type=int, default=None,
                   help="pool slots, including the null slot (with --model: 9, wrap's 8 requests and the null slot)")
    p.add_argument("--heads", type=int, default=None, help="linear-attention heads, all ranks (without --model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; heads per rank = heads / tp")
    p.add_argument("--head-dim", type=int, default=128, help="K = V (mamba2: P, the head dim)")
    p.add_argument("--conv-kernel", type=int, default=4, help="short-conv kernel width (window = kernel - 1)")
    p.add_argument("--draft-tokens", type=int, default=8, help="D: tokens per verify step")
    p.add_argument("--ring-len", type=int, default=None, help="L, a power of two >= 2*D (default next_pow2(2*D))")
    p.add_argument("--running", type=int, default=None,
                   help="running requests; spec buffers get running+1 rows (default slots-1)")
    p.add_argument("--ssm-dtype", default="float32", help="float32 | bfloat16 | float16 | float64")
    p.add_argument("--act-dtype", default="bfloat16",
                   help="the model's dtype: conv windows, records (float32 | bfloat16 | float16 | float64)")
    p.add_argument("--gate", choices=("kda", "gdn"), default="kda", help="kda: per-channel g; gdn: scalar g")
    p.add_argument("--gate-record", choices=("input", "g"), default=None,
                   help="what the g ring keeps: input (KDA: the gate's input f in bf16, the kernels compute Kimi's "
                        "gate; the default for kda with our layouts), g (the fp32 log-decay; the default for gdn and "
                        "with --layout sglang, as in SGLang's logs)")
    p.add_argument("--rule", choices=("delta", "mamba2"), default="delta",
                   help="delta: gated delta rule; mamba2: Mamba2 heads (with --gate gdn, --head-dim P, --state-dim "
                        "N, --groups G)")
    p.add_argument("--state-dim", type=int, default=None, help="mamba2: N, the SSM state size (K)")
    p.add_argument("--groups", type=int, default=1, help="mamba2: G, the B / C groups (all ranks)")
    p.add_argument("--layout", choices=("eager", "lazy", "sglang"), default="eager",
                   help="ring layout: eager (eager commit: [layer, running row, H, D, dim], the fold's records, "
                        "conv inputs), lazy (lazy commit: per-slot rings, conv inputs), sglang (SGLang's: "
                        "per-slot rings, conv window snapshots)")
    p.add_argument("--json", action="store_true", help="print byte counts as JSON (spec_bytes: both schemes, "
                                                       "chain and trees of 8, 16, 64 nodes)")
