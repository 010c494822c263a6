"""What each rank holds of a module under tensor parallelism, as data: `Split`s of parameters, a `Layout` per kind of
module (each mixer, attention, MLP) and a family's `TPLayout`, which `adapters.HybridFamily.tp_layout` declares.
`specdec.parallel` applies them; this module imports nothing of specdec, so the adapters and parallel both can.

Splits name parameters by their path in the module. A layout's names the module lacks are skipped, so one layout
serves a family's variants (Qwen3-Next's fused `in_proj_qkvz` and Qwen3.5's `in_proj_qkv`, `_z`, `_b`, `_a`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Split:
    """A parameter split across ranks: `path` in the module (dotted), along `dim`, in `sections` (a function of the
    module -> the sizes of the consecutive sections of `dim`, each split in tp equal pieces, the rank's pieces
    concatenated; None: `dim` is one section). A row-parallel weight (`dim` its input dim, 1) keeps its bias on rank
    0 only: the all-reduce adds it once."""

    path: str
    dim: int = 0
    sections: Callable | None = None


@dataclass(frozen=True)
class Layout:
    """How one kind of module splits: its `splits`, the integer attributes its forward reads that count per-rank
    things (`divide`: divided by tp), and `units`, a function of the module -> the sizes tp must divide (heads,
    groups: a head never straddles ranks)."""

    splits: tuple[Split, ...]
    divide: tuple[str, ...] = ()
    units: Callable = field(default=lambda mod: {})


def _rows(*names: str) -> tuple[Split, ...]:
    """Column-parallel linears (output rows split) and their biases."""
    return tuple(Split(f"{n}.{p}") for n in names for p in ("weight", "bias"))


KIMI = Layout(  # KDA: q, k, v, f_b, g_b by head; conv over [q | k | v]; f_a / g_a (low rank) and o_norm replicated
    _rows("q_proj", "k_proj", "v_proj", "forget_gate.f_b_proj", "b_proj", "g_b_proj")
    + (Split("conv1d.weight", 0, lambda m: [m.qkv_dim] * 3), Split("forget_gate.A_log", 2),
       Split("forget_gate.dt_bias"), Split("o_proj.weight", 1)),
    divide=("num_heads", "qkv_dim", "conv_dim"), units=lambda m: {"num_heads": m.num_heads})
GATED_DELTA = Layout(  # Gated DeltaNet: Qwen3-Next's in_proj_qkvz / ba are laid out per key head: a plain split
    _rows("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a")
    + tuple(Split(p, 0, lambda m: [m.key_dim, m.key_dim, m.value_dim])
            for p in ("in_proj_qkv.weight", "in_proj_qkv.bias", "conv1d.weight", "conv1d.bias"))
    + (Split("A_log"), Split("dt_bias"), Split("out_proj.weight", 1)),
    divide=("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"),
    units=lambda m: {"num_k_heads": m.num_k_heads, "num_v_heads": m.num_v_heads})


def _mamba_in(m) -> list[int]:
    gn = m.n_groups * m.ssm_state_size
    return [m.intermediate_size, m.intermediate_size, gn, gn, m.num_heads]  # gate, x, B, C, dt


MAMBA2 = Layout(  # in_proj over [gate | x | B | C | dt], conv over [x | B | C], the gated norm by groups
    (Split("in_proj.weight", 0, _mamba_in), Split("in_proj.bias", 0, _mamba_in))
    + tuple(Split(p, 0, lambda m: [m.intermediate_size] + [m.n_groups * m.ssm_state_size] * 2)
            for p in ("conv1d.weight", "conv1d.bias"))
    + (Split("dt_bias"), Split("A_log"), Split("D"), Split("norm.weight"), Split("out_proj.weight", 1)),
    divide=("num_heads", "n_groups", "intermediate_size", "conv_dim"),
    units=lambda m: {"num_heads": m.num_heads, "n_groups": m.n_groups})


def _heads(m) -> int:
    n = getattr(m, "num_heads", None) or getattr(m, "num_attention_heads", None)
    if n is None:
        n = m.config.num_attention_heads
    return n


ATTENTION = Layout(  # GQA by head (q, k, v, the output gate Qwen3-Next packs per head in q_proj); MLA: the query and
    # kv_b_proj by head, the latent projection and its norm replicated (the latent cache is every head's)
    _rows("q_proj", "q_b_proj", "k_proj", "v_proj", "kv_b_proj") + (Split("o_proj.weight", 1),),
    divide=("num_heads", "num_key_value_heads", "num_attention_heads"),
    units=lambda m: {"heads": _heads(m), **({"key/value heads": m.k_proj.out_features // m.head_dim}
                                           if hasattr(m, "k_proj") else {})})
MLP = Layout(  # as transformers' tp_plans: gate / up colwise, down rowwise; each expert's hidden units likewise
    tuple(s for pre in ("", "shared_expert.", "shared_experts.")
          for s in _rows(f"{pre}gate_proj", f"{pre}up_proj") + (Split(f"{pre}down_proj.weight", 1),))
    + (Split("experts.gate_up_proj", 1, lambda m: [m.experts.gate_up_proj.shape[1] // 2] * 2),
       Split("experts.down_proj", 2)),
    divide=("experts.intermediate_dim",))
GRANITE_MLP = Layout(  # Granite-4.0-H's shared MLP: one input projection over [gate | up], chunked in two by its
    # forward, and the output projection; its routed experts as MLP's
    MLP.splits + (Split("input_linear.weight", 0, lambda m: [m.input_linear.out_features // 2] * 2),
                  Split("output_linear.weight", 1)),
    divide=MLP.divide)


@dataclass(frozen=True)
class TPLayout:
    """How a family's decoder splits across ranks: its mixers by `mixer`, its attentions by `attention` (an MLA layer,
    whose latent cache every head reads, runs whole and data-parallel over the requests instead: `parallel.ShardPlan`)
    and its MLPs and MoE blocks by `mlp`. Embeddings, norms, routers and the lm_head stay whole."""

    mixer: Layout
    attention: Layout = ATTENTION
    mlp: Layout = MLP
