"""Memory plan: the shape, dtype and size of every buffer the state strategies allocate.

`buffer_specs` is the allocation contract: the pool, ring and snapshot classes allocate exactly these
shapes. `format_plan` prints them in the style of SGLang's allocation log (sizes in GiB = 2**30 bytes,
written "GB" as SGLang does); `plan_json` gives the byte counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import StateConfig

GIB = 2 ** 30

RING_NAMES = ("ring_d", "ring_k", "ring_g", "ring_rawv", "ring_rawk", "ring_beta")
BUFFER_NAMES = ("conv_state", "ssm_state", "intermediate_conv_window", *RING_NAMES, "snapshot_intermediate_ssm",
                "tree_node_states")


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


def buffer_specs(cfg: StateConfig) -> dict[str, BufferSpec]:
    """Every buffer of the memory plan, keyed by name (see the module docstring)."""
    n, s, h = cfg.num_layers, cfg.num_slots, cfg.num_heads
    k, v, c, w = cfg.head_k_dim, cfg.head_v_dim, cfg.conv_dim, cfg.conv_kernel - 1
    rows, d, ring = cfg.max_running + 1, cfg.num_verify_tokens, cfg.ring_len
    act, ssm, f32 = cfg.act_dtype, cfg.ssm_dtype, cfg.record_dtype
    shapes = {
        "conv_state": ((n, s, c, w), act),
        "ssm_state": ((n, s, h, k, v), ssm),
        "intermediate_conv_window": ((n, rows, d, c, w), act),
        "ring_d": ((n, s, h, ring, v), act),
        "ring_k": ((n, s, h, ring, k), act),
        "ring_g": ((n, s, h, ring, cfg.gate_dim), f32),
        "ring_rawv": ((n, s, h, ring, v), act),
        "ring_rawk": ((n, s, h, ring, k), act),
        "ring_beta": ((n, s, h, ring), f32),
        "snapshot_intermediate_ssm": ((n, rows, d, h, k, v), ssm),
        # tree verify with ReplaySSM: node states of ONE layer, reused layer after layer (never committed)
        "tree_node_states": ((rows, d, h, k, v), torch.promote_types(ssm, torch.float32)),
    }
    return {name: BufferSpec(name, tuple(int(x) for x in shape), dtype) for name, (shape, dtype) in shapes.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_json(cfg: StateConfig) -> dict:
    """Byte counts (ints) per buffer, the ring total, both spec-state schemes and their ratio."""
    specs = buffer_specs(cfg)
    out: dict = {name: spec.nbytes for name, spec in specs.items()}
    out["ring_total"] = sum(specs[name].nbytes for name in RING_NAMES)
    window = out["intermediate_conv_window"]
    out["spec_state_snapshot"] = out["snapshot_intermediate_ssm"] + window
    out["spec_state_replay"] = out["ring_total"] + window
    out["ratio"] = out["spec_state_snapshot"] / out["spec_state_replay"]
    out["spec_state_replay_tree"] = out["spec_state_replay"] + out["tree_node_states"]
    out["ratio_tree"] = out["spec_state_snapshot"] / out["spec_state_replay_tree"]
    out["shapes"] = {name: list(spec.shape) for name, spec in specs.items()}
    out["dtypes"] = {name: _dtype_name(spec.dtype) for name, spec in specs.items()}
    out["config"] = {
        "num_layers": cfg.num_layers, "num_slots": cfg.num_slots, "max_requests": cfg.max_requests,
        "max_running": cfg.max_running, "num_heads": cfg.num_heads, "head_k_dim": cfg.head_k_dim,
        "head_v_dim": cfg.head_v_dim, "conv_dim": cfg.conv_dim, "conv_kernel": cfg.conv_kernel,
        "num_verify_tokens": cfg.num_verify_tokens, "ring_len": cfg.ring_len, "gate": cfg.gate,
        "ssm_dtype": _dtype_name(cfg.ssm_dtype), "act_dtype": _dtype_name(cfg.act_dtype),
    }
    return out


def format_plan(cfg: StateConfig) -> str:
    """Allocation-log style report: one line per buffer, then the SGLang-style summary lines."""
    specs = buffer_specs(cfg)
    plan = plan_json(cfg)
    width = max(map(len, specs))
    lines = []
    for name, spec in specs.items():
        shape = "[" + ", ".join(map(str, spec.shape)) + "]"
        lines.append(f"{name:<{width}}  shape={shape:<32} dtype={_dtype_name(spec.dtype):<8} "
                     f"size={spec.gib:.3f}GB ({spec.nbytes} bytes)")

    def gb(nbytes: int, digits: int) -> str:
        return f"{nbytes / GIB:.{digits}f}GB"

    lines.append(
        f"Mamba Cache is allocated. max_mamba_cache_size: {cfg.num_slots}, "
        f"conv_state size: {gb(plan['conv_state'], 2)}, ssm_state size: {gb(plan['ssm_state'], 2)}, "
        f"intermediate_conv_window size: {gb(plan['intermediate_conv_window'], 2)}")
    rings = " ".join(f"{name.removeprefix('ring_')}={gb(plan[name], 3)}" for name in RING_NAMES)
    lines.append(f"ReplaySSM ring is allocated. ring_len: {cfg.ring_len}, {rings}, "
                 f"ring total size: {gb(plan['ring_total'], 3)}")
    lines.append(
        f"Spec state (max_running={cfg.max_running}+1, D={cfg.num_verify_tokens}): "
        f"full snapshot (snapshot_intermediate_ssm {gb(plan['snapshot_intermediate_ssm'], 2)} "
        f"+ intermediate_conv_window {gb(plan['intermediate_conv_window'], 2)}) = "
        f"{gb(plan['spec_state_snapshot'], 2)} vs ReplaySSM (rings {gb(plan['ring_total'], 2)} "
        f"+ intermediate_conv_window {gb(plan['intermediate_conv_window'], 2)}) = "
        f"{gb(plan['spec_state_replay'], 2)}, ratio {plan['ratio']:.2f}x")
    lines.append(
        f"Tree verify (T={cfg.num_verify_tokens} nodes): all-layer snapshot {gb(plan['spec_state_snapshot'], 2)} vs "
        f"ReplaySSM (rings + one layer's node states {gb(plan['tree_node_states'], 2)} + conv windows) = "
        f"{gb(plan['spec_state_replay_tree'], 2)}, ratio {plan['ratio_tree']:.2f}x")
    return "\n".join(lines)
