"""Memory plan: the shape, dtype and size of every buffer the state strategies allocate.

`buffer_specs` is the allocation contract: the pool, ring and snapshot classes allocate exactly these
shapes. `format_plan` prints them in the style of SGLang's allocation log (sizes in GiB = 2**30 bytes,
written "GB" as SGLang does); `plan_json` gives the byte counts.

Three ring layouts (`layout=`):
- `"eager"` (eager commit): the accepted records are folded in the round that wrote them, so nothing in a
  ring outlives a round. Rings `[layer, running row, H, D, dim]` hold only what the exact fold reads
  (rawv, rawk, g, beta); the conv keeps each verify token's pre-conv input `conv_inputs [layer, row, D, C]`.
  With `gate_in_kernel` (KDA) the g ring holds the gate's input in the activation dtype (bf16: half the bytes
  of an fp32 log-decay) and the kernels compute the gate.
- `"lazy"` (lazy commit): records stay pending across rounds, so the rings are per slot,
  `[layer, slot, H, L, dim]`, with all six records (`d`, `k` feed the fast rebuild); conv inputs as eager.
- `"sglang"`: SGLang's layout (the rings of lazy, conv window snapshots `[layer, row, D, C, Kc-1]`), which its
  published allocation logs describe.
The full-snapshot scheme (SGLang's default, our oracle) is the same in every layout: all-layer states and
conv windows after every verify token.

On the reference backend (torch, the CPU) ReplaySSM with eager commit also keeps `step_ssm` and `step_conv_window`,
one token's state and conv window per running row: a one-token round (a plain decode step, which the verify runs as
the fold's own step) commits them by copy instead of folding its record again, the same bits for less work. The
Triton backend folds every round and never allocates them, so `spec_bytes` (the device's comparison) leaves them out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from specdec.kernels.tree import tree_stack_slots
from .config import StateConfig, next_pow2

GIB = 2 ** 30

LAYOUTS = ("eager", "lazy", "sglang")
RING_NAMES = ("ring_d", "ring_k", "ring_g", "ring_rawv", "ring_rawk", "ring_beta")
FOLD_RING_NAMES = ("ring_g", "ring_rawv", "ring_rawk", "ring_beta")  # what the exact fold reads
SNAPSHOT_NAMES = ("snapshot_intermediate_ssm", "intermediate_conv_window")
STEP_NAMES = ("step_ssm", "step_conv_window")  # ReplaySSM, torch backend: a one-token round's state (see above)
TREE_SIZES = (8, 16, 64)  # tree node budgets of the comparison


@dataclass(frozen=True)
class BufferSpec:
    """One buffer: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def ring_names(layout: str) -> tuple[str, ...]:
    """The ring records a layout holds."""
    return FOLD_RING_NAMES if check_layout(layout) == "eager" else RING_NAMES


def conv_record_name(layout: str) -> str:
    """What the replay scheme keeps for the conv: pre-conv inputs, or (SGLang) window snapshots."""
    return "intermediate_conv_window" if check_layout(layout) == "sglang" else "conv_inputs"


def replay_names(layout: str, *, tree: bool = False) -> tuple[str, ...]:
    """Buffers the ReplaySSM scheme holds for speculation (tree: plus one layer's stack of parent states)."""
    return (*ring_names(layout), conv_record_name(layout), *(("tree_state_stack",) if tree else ()))


def buffer_specs(cfg: StateConfig, *, layout: str = "eager") -> dict[str, BufferSpec]:
    """Every buffer of the memory plan for `layout`, keyed by name (see the module docstring): the pool
    (`conv_state`, `ssm_state`), the ReplaySSM buffers of the layout, one layer's tree state stack, and the
    full-snapshot scheme's `snapshot_intermediate_ssm` and `intermediate_conv_window`."""
    n, s, h = cfg.num_layers, cfg.num_slots, cfg.num_heads
    k, v, c, w = cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel - 1
    rows, d = cfg.max_running + 1, cfg.num_verify_tokens
    act, ssm, f32 = cfg.act_dtype, cfg.ssm_dtype, cfg.record_dtype
    # eager: one record per verify token of each running row; lazy / sglang: a ring of depth L per slot
    ring_lead = (n, rows, h, d) if check_layout(layout) == "eager" else (n, s, h, cfg.ring_len)
    rings = {
        "ring_d": ((*ring_lead, v), act),
        "ring_k": ((*ring_lead, k), act),
        "ring_g": ((*ring_lead, cfg.gate_dim), cfg.gate_dtype),
        "ring_rawv": ((*ring_lead, v), act),
        "ring_rawk": ((*ring_lead, k), act),
        "ring_beta": (ring_lead, f32),
    }
    shapes = {
        "conv_state": ((n, s, c, w), act),
        "ssm_state": ((n, s, h, k, v), ssm),
        "intermediate_conv_window": ((n, rows, d, c, w), act),
        **{name: rings[name] for name in ring_names(layout)},
        "snapshot_intermediate_ssm": ((n, rows, d, h, k, v), ssm),
        # tree verify with ReplaySSM: the parent states a later child reloads, of ONE layer, reused layer after
        # layer (never committed): log2 of the node count (kernels/tree.py `tree_stack_slots`)
        "tree_state_stack": ((rows, tree_stack_slots(d), h, k, v), torch.promote_types(ssm, torch.float32)),
        # the reference backend's one-token rounds (a plain decode step): the state and conv window after the
        # token, which commit copies in place of folding its record (allocated by the first such round)
        "step_ssm": ((n, rows, 1, h, k, v), ssm),
        "step_conv_window": ((n, rows, 1, c, w), act),
    }
    if layout != "sglang":
        shapes["conv_inputs"] = ((n, rows, d, c), act)
    if cfg.gate_in_kernel:  # weights, not speculative state: every layer's A_log and dt_bias, read by verify and fold
        shapes["gate_A_log"] = ((n, h), f32)
        shapes["gate_dt_bias"] = ((n, h, k), f32)
    return {name: BufferSpec(name, tuple(int(x) for x in shape), dtype) for name, (shape, dtype) in shapes.items()}


POOL_NAMES = ("conv_state", "ssm_state")
TRACK_NAMES = ("track_ssm", "track_conv")
# allocated by the first round of a kind, not at build: a one-token round on the reference backend, a tree round
# on the Triton kernels (ReplaySSM)
DEFERRED_NAMES = (*STEP_NAMES, "tree_state_stack")


def pool_specs(cfg: StateConfig) -> dict[str, BufferSpec]:
    """The slot pool's buffers (`SlotPool`): `conv_state`, `ssm_state` and, with a track interval, their ping-pong
    copies `track_ssm [layer, slot, 2, H, K, V]` and `track_conv [layer, slot, 2, C, Kc-1]`."""
    specs = buffer_specs(cfg)
    out = {name: specs[name] for name in POOL_NAMES}
    if cfg.track_interval is not None:
        for name, base in zip(TRACK_NAMES, ("ssm_state", "conv_state")):
            s = specs[base]
            out[name] = BufferSpec(name, (*s.shape[:2], 2, *s.shape[2:]), s.dtype)
    return out


def strategy_specs(cfg: StateConfig, strategy: str = "replay", *, commit: str = "eager",
                   triton: bool = False) -> dict[str, BufferSpec]:
    """Every buffer a strategy of `make_strategy` holds once it has run every kind of round: the pool
    (`pool_specs`), the gate parameters (`gate_in_kernel`) and the speculative state. Snapshot: all-layer states and
    conv windows per token. ReplaySSM: the rings and conv inputs of the commit layout, and (`DEFERRED_NAMES`) on the
    reference backend with eager commit the one-token round's `step_ssm` and `step_conv_window`, on the Triton
    kernels (`triton`) one layer's `tree_state_stack`."""
    specs = buffer_specs(cfg, layout=commit)
    out = pool_specs(cfg)
    if cfg.gate_in_kernel:
        out.update({name: specs[name] for name in ("gate_A_log", "gate_dt_bias")})
    if strategy == "snapshot":
        names = SNAPSHOT_NAMES
    elif triton:
        names = replay_names(commit, tree=True)
    else:
        names = (*replay_names(commit), *(STEP_NAMES if commit == "eager" else ()))
    out.update({name: specs[name] for name in names})
    return out


def with_tokens(cfg: StateConfig, num_tokens: int) -> StateConfig:
    """`cfg` verifying `num_tokens` tokens (a tree's node budget); the ring depth grows to hold two windows."""
    ring_len = max(cfg.ring_len, next_pow2(2 * num_tokens))
    return dataclasses.replace(cfg, num_verify_tokens=num_tokens, ring_len=ring_len)


def spec_bytes(cfg: StateConfig, *, layout: str = "eager", tree: bool = False) -> dict[str, int]:
    """Bytes each scheme holds for speculation: `{"snapshot": N, "replayssm": N}`."""
    specs = buffer_specs(cfg, layout=layout)
    return {"snapshot": sum(specs[name].nbytes for name in SNAPSHOT_NAMES),
            "replayssm": sum(specs[name].nbytes for name in replay_names(layout, tree=tree))}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_json(cfg: StateConfig, *, layout: str = "eager") -> dict:
    """Byte counts (ints) per buffer, the ring total, both spec-state schemes and their ratio, and
    `spec_bytes`: both schemes for the chain (D tokens) and for trees of 8, 16 and 64 nodes."""
    specs = buffer_specs(cfg, layout=layout)
    out: dict = {"layout": layout}
    out.update({name: spec.nbytes for name, spec in specs.items()})
    out["ring_total"] = sum(specs[name].nbytes for name in ring_names(layout))
    chain = spec_bytes(cfg, layout=layout)
    out["spec_state_snapshot"] = chain["snapshot"]
    out["spec_state_replay"] = chain["replayssm"]
    out["ratio"] = out["spec_state_snapshot"] / out["spec_state_replay"]
    out["spec_state_replay_tree"] = spec_bytes(cfg, layout=layout, tree=True)["replayssm"]
    out["ratio_tree"] = out["spec_state_snapshot"] / out["spec_state_replay_tree"]
    out["spec_bytes"] = {"chain": chain, **{f"tree_{t}": spec_bytes(with_tokens(cfg, t), layout=layout, tree=True)
                                            for t in TREE_SIZES}}
    out["shapes"] = {name: list(spec.shape) for name, spec in specs.items()}
    out["dtypes"] = {name: _dtype_name(spec.dtype) for name, spec in specs.items()}
    out["config"] = {
        "num_layers": cfg.num_layers, "num_slots": cfg.num_slots, "max_requests": cfg.max_requests,
        "max_running": cfg.max_running, "num_heads": cfg.num_heads, "head_k_dim": cfg.head_k_dim,
        "head_v_dim": cfg.head_v_dim, "conv_dim": cfg.conv_dim, "conv_kernel": cfg.conv_kernel,
        "num_verify_tokens": cfg.num_verify_tokens, "ring_len": cfg.ring_len, "gate": cfg.gate, "rule": cfg.rule,
        "ssm_dtype": _dtype_name(cfg.ssm_dtype), "act_dtype": _dtype_name(cfg.act_dtype),
    }
    return out


LAYOUT_SHAPES = {"eager": "[layer, running row, H, D, dim]", "lazy": "[layer, slot, H, L, dim]",
                 "sglang": "[layer, slot, H, L, dim]"}


def format_plan(cfg: StateConfig, *, layout: str = "eager") -> str:
    """Allocation-log style report: one line per buffer, then the SGLang-style summary lines and the
    comparison of both schemes for the chain and for trees of 8, 16 and 64 nodes."""
    specs = buffer_specs(cfg, layout=layout)
    plan = plan_json(cfg, layout=layout)
    width = max(map(len, specs))
    lines = []
    for name, spec in specs.items():
        shape = "[" + ", ".join(map(str, spec.shape)) + "]"
        where = "  (torch backend only: one-token rounds)" if name in STEP_NAMES else ""
        lines.append(f"{name:<{width}}  shape={shape:<32} dtype={_dtype_name(spec.dtype):<8} "
                     f"size={spec.gib:.3f}GB ({spec.nbytes} bytes){where}")

    def gb(nbytes: int, digits: int = 2) -> str:
        return f"{nbytes / GIB:.{digits}f}GB"

    lines.append(
        f"Mamba Cache is allocated. max_mamba_cache_size: {cfg.num_slots}, "
        f"conv_state size: {gb(plan['conv_state'])}, ssm_state size: {gb(plan['ssm_state'])}, "
        f"intermediate_conv_window size: {gb(plan['intermediate_conv_window'])}")
    rings = " ".join(f"{name.removeprefix('ring_')}={gb(plan[name], 3)}" for name in ring_names(layout))
    depth = f"ring_len: {cfg.ring_len}" if layout != "eager" else f"depth D: {cfg.num_verify_tokens}"
    lines.append(f"ReplaySSM ring is allocated. layout: {layout} {LAYOUT_SHAPES[layout]}, {depth}, {rings}, "
                 f"ring total size: {gb(plan['ring_total'], 3)}")
    conv = conv_record_name(layout)
    conv_what = "conv windows" if conv == "intermediate_conv_window" else "conv inputs"
    if cfg.rule == "mamba2":
        lines.append(f"Mamba2 heads (rule mamba2): ssm_state holds h^T [N={cfg.head_k_dim}, P={cfg.head_v_dim}] per "
                     f"head; ring_rawv = x [P], ring_rawk = B [N] (its group's, per head), ring_g = dt*A, "
                     f"ring_beta = dt; conv channels [x, B, C] = {cfg.conv_dim}")
    lines.append(f"Spec state, layout {layout} (max_running={cfg.max_running}+1; snapshot: all-layer states + "
                 f"conv windows per token; ReplaySSM: rings + {conv_what}, trees + one layer's stack of parent "
                 f"states):")
    for key, label in [("chain", f"chain D={cfg.num_verify_tokens}"), *((f"tree_{t}", f"tree T={t}")
                                                                         for t in TREE_SIZES)]:
        sb = plan["spec_bytes"][key]
        lines.append(f"  {label:<12} full snapshot {gb(sb['snapshot'])} vs ReplaySSM {gb(sb['replayssm'])}, "
                     f"ratio {sb['snapshot'] / sb['replayssm']:.2f}x")
    return "\n".join(lines)
