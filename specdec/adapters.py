"""Per-family linear-attention mixers: the model's own projections, gates and output norm around our
short conv and delta rule (Mamba2 mixers: the mamba2 rule). Each `run` mirrors the transformers module's forward
op for op.

`HYBRID_FAMILIES` is the registry the hybrid runner dispatches on: per `config.model_type` the mixer, where
the decoder layers put their norms, and how the layers split under tensor parallelism (`tp_layouts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .tp_layouts import GATED_DELTA, GRANITE_MLP, KIMI, MAMBA2, TPLayout


class MixerOps(Protocol):
    """What a mixer calls for the stateful parts (prefill: plain recurrence; verify: the state strategy)."""

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None) -> torch.Tensor: ...

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor: ...


class _Mixer:
    """Where a family's mixer sits and what sizes its state, as data: `layer_attr`, the decoder layer's attribute
    holding the mixer module (`module`); `dim_attrs`, the module's attributes giving the heads, key dim and value dim
    (`dims`; conv width and kernel are `conv_dim` / `conv_kernel_size` in every family); `rule`, the state update
    ("delta" or "mamba2"); `gate_in_kernel`, whether the kernel takes the gate's input and computes the decay."""

    layer_attr: str
    dim_attrs: tuple[str, str, str]
    rule = "delta"
    gate_in_kernel = False

    @classmethod
    def module(cls, layer):
        return getattr(layer, cls.layer_attr)

    @classmethod
    def dims(cls, mod) -> dict:
        heads, head_k_dim, head_v_dim = (getattr(mod, name) for name in cls.dim_attrs)
        return dict(num_heads=heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim, conv_dim=mod.conv_dim,
                    conv_kernel=mod.conv_kernel_size)


class KimiDeltaMixer(_Mixer):
    """`KimiLinearDeltaAttention`: KDA (per-channel decay), l2norm as x / sqrt(|x|^2 + eps). The forget gate
    `-exp(A_log) softplus(f_b_proj(f_a_proj(x)) + dt_bias)` is computed by the kernels from its input
    (`gate_in_kernel`), so the rings keep f in the model's dtype, not an fp32 log-decay."""

    gate, norm = "kda", "sqrt_div"
    gate_in_kernel = True
    requires = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm",
                "o_proj")
    layer_attr, dim_attrs = "self_attn", ("num_heads", "head_dim", "head_dim")

    @classmethod
    def run(cls, mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        """x `[B, T, hidden]` (after the input norm) -> `[B, T, hidden]`."""
        B, T, _ = x.shape
        mixed = torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], dim=-1)
        y = ops.conv(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation)
        q, k, v = (t.reshape(B, T, -1, mod.head_dim) for t in torch.split(y, [mod.qkv_dim] * 3, dim=-1))
        g = cls.gate_input(mod, x) if cls.gate_in_kernel else mod.forget_gate(x)
        beta = torch.sigmoid(mod.b_proj(x))
        o = ops.mix(q, k, v, g, beta)
        return mod.o_proj(mod.o_norm(o, cls.output_gate(mod, x)).reshape(B, T, -1))

    @staticmethod
    def gate_input(mod, x: torch.Tensor) -> torch.Tensor:
        """The forget gate's input f `[B, T, H, head_dim]`: `f_b_proj(f_a_proj(x))` (`KimiLinearForgetGate`)."""
        fg = mod.forget_gate
        return fg.f_b_proj(fg.f_a_proj(x)).view(*x.shape[:2], -1, mod.head_dim)

    @staticmethod
    def gate_params(mod) -> tuple[torch.Tensor, torch.Tensor]:
        """`(A_log, dt_bias)` of the forget gate (`[1, 1, H, 1]`, `[H * head_dim]`)."""
        return mod.forget_gate.A_log, mod.forget_gate.dt_bias

    @staticmethod
    def output_gate(mod, x: torch.Tensor) -> torch.Tensor:
        """The gate of the output norm, `[B, T, H, head_dim]`: low rank `g_b_proj(g_a_proj(x))`."""
        return mod.g_b_proj(mod.g_a_proj(x)).view(*x.shape[:2], -1, mod.head_dim)


class BailingDeltaMixer(KimiDeltaMixer):
    """`BailingHybridDeltaAttention` (Ling): Kimi's KDA layer with a full-rank output gate `g_proj` (not
    `g_b_proj(g_a_proj(x))`); the forget gate may be the bounded `lower_bound * sigmoid(A * (f + dt_bias))`
    (`kda_safe_gate`), computed by the module's own `forget_gate`; the gated norm takes a sigmoid gate. Its
    conv weight is kept in fp32 (`_keep_in_fp32_modules_strict`): the short conv runs in fp32 on low-precision
    models, as transformers' conv does."""

    requires = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_proj", "o_norm", "o_proj")
    gate_in_kernel = False  # its gate may be the bounded one: the module computes it, the rings keep log-decays

    @staticmethod
    def output_gate(mod, x: torch.Tensor) -> torch.Tensor:
        """Full rank: `g_proj(x)`."""
        return mod.g_proj(x).view(*x.shape[:2], -1, mod.head_dim)


class GatedDeltaMixer(_Mixer):
    """Gated DeltaNet of Qwen3-Next (`in_proj_qkvz` / `in_proj_ba`) and Qwen3.5 (`in_proj_qkv`, `_z`, `_b`,
    `_a`): scalar decay per head, grouped value heads (q, k shared by `num_v_heads // num_k_heads`)."""

    gate, norm = "gdn", "rsqrt"
    requires = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
    layer_attr, dim_attrs = "linear_attn", ("num_v_heads", "head_k_dim", "head_v_dim")

    @staticmethod
    def conv_qkv(mod, mixed: torch.Tensor, ops: MixerOps):
        """Short conv over the `[q, k, v]` channels `[B, T, C]`, split into heads: q, k `[B, T, Hv, K]` (each
        key head repeated for its group of value heads), v `[B, T, Hv, V]`."""
        B, T, _ = mixed.shape
        y = ops.conv(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation)
        q, k, v = torch.split(y, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        rep = mod.num_v_heads // mod.num_k_heads
        q = q.reshape(B, T, -1, mod.head_k_dim).repeat_interleave(rep, dim=2)
        k = k.reshape(B, T, -1, mod.head_k_dim).repeat_interleave(rep, dim=2)
        return q, k, v.reshape(B, T, -1, mod.head_v_dim)

    @staticmethod
    def run(mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        B, T, _ = x.shape
        if hasattr(mod, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
            q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(x), mod.in_proj_ba(x))
            mixed = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
        else:  # Qwen3.5
            mixed = mod.in_proj_qkv(x)
            z = mod.in_proj_z(x).reshape(B, T, -1, mod.head_v_dim)
            b, a = mod.in_proj_b(x), mod.in_proj_a(x)
        q, k, v = GatedDeltaMixer.conv_qkv(mod, mixed, ops)
        beta = b.sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
        o = ops.mix(q, k, v, g, beta)
        o = mod.norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1]))
        return mod.out_proj(o.reshape(B, T, -1))


class OlmoGatedDeltaMixer(GatedDeltaMixer):
    """`OlmoHybridGatedDeltaNet`: Gated DeltaNet with separate `q_proj` / `k_proj` / `v_proj` / `a_proj` /
    `b_proj`, an output gate `g_proj` (in place of Qwen's z), `o_norm` / `o_proj`, a bias-free conv, and
    beta doubled when `allow_neg_eigval` (beta in (0, 2): negative eigenvalues of the transition)."""

    requires = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "conv1d", "A_log", "dt_bias", "o_norm",
                "o_proj")

    @staticmethod
    def run(mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        B, T, _ = x.shape
        mixed = torch.cat([mod.q_proj(x), mod.k_proj(x), mod.v_proj(x)], dim=-1)
        q, k, v = GatedDeltaMixer.conv_qkv(mod, mixed, ops)
        beta = mod.b_proj(x).sigmoid()
        if mod.allow_neg_eigval:
            beta = beta * 2.0
        g = -mod.A_log.float().exp() * F.softplus(mod.a_proj(x).float() + mod.dt_bias)
        o = ops.mix(q, k, v, g, beta)
        gate = mod.g_proj(x)
        o = mod.o_norm(o.reshape(-1, mod.head_v_dim), gate.reshape(-1, mod.head_v_dim))
        return mod.o_proj(o.reshape(B, T, -1))


class Mamba2Mixer(_Mixer):
    """transformers' Mamba2 mixer of Bamba (`BambaMixer`, at `layer.mamba`), GraniteMoeHybrid
    (`GraniteMoeHybridMambaLayer`, the same module) and Zamba2 (`Zamba2MambaMixer`: its gated norm gates before
    the grouped norm, its `time_step_limit` floors dt at `time_step_min`): `in_proj` split into gate / xBC / dt,
    short conv over `[x, B, C]` with its activation, dt = softplus(dt + dt_bias) clamped to `time_step_limit`, the
    SSM through `ops.mix` (the mamba2 rule: q = C, k = B, v = x, g = dt A, beta = dt; each group's B and C repeated
    for its heads), the D skip, the gated RMSNorm, `out_proj`. Subclasses change `project` (what feeds the split)
    and `gated_norm` (gate and norm of the scan output)."""

    gate, norm, rule = "gdn", "rsqrt", "mamba2"
    requires = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "time_step_limit")
    layer_attr, dim_attrs = "mamba", ("num_heads", "ssm_state_size", "head_dim")  # a Mamba2 head: K = N, V = P

    @staticmethod
    def project(mod, x: torch.Tensor) -> torch.Tensor:
        """`[B, T, hidden]` -> the projection split into gate / xBC / dt: `in_proj(x)`."""
        return mod.in_proj(x)

    @staticmethod
    def gated_norm(mod, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The scan output `[B, T, intermediate]` gated by `gate` and normed: the module's gated RMSNorm."""
        return mod.norm(y, gate)

    @classmethod
    def run(cls, mod, x: torch.Tensor, ops: MixerOps) -> torch.Tensor:
        """x `[B, T, hidden]` (after the input norm) -> `[B, T, hidden]`."""
        B, T, _ = x.shape
        H, P, N, G = mod.num_heads, mod.head_dim, mod.ssm_state_size, mod.n_groups
        gate, xBC, dt = cls.project(mod, x).split([mod.intermediate_size, mod.conv_dim, H], dim=-1)
        xBC = ops.conv(xBC, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.activation)
        xs, Bg, Cg = torch.split(xBC, [mod.intermediate_size, G * N, G * N], dim=-1)
        v = xs.reshape(B, T, H, P)
        k = Bg.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)  # [B, T, H, N]: head h reads group h // (H/G)
        q = Cg.reshape(B, T, G, N).repeat_interleave(H // G, dim=2)
        lo, hi = mod.time_step_limit
        dt = F.softplus(dt + mod.dt_bias.to(dt.dtype)).clamp(min=lo, max=hi)  # [B, T, H]
        A = -torch.exp(mod.A_log.float())
        o = ops.mix(q, k, v, dt * A, dt)  # [B, T, H, P]
        y = o + v * mod.D[:, None].to(o.dtype)
        y = cls.gated_norm(mod, y.reshape(B, T, -1), gate)
        return mod.out_proj(y.to(x.dtype))


class NemotronHMamba2Mixer(Mamba2Mixer):
    """`NemotronHMamba2Mixer`: the same Mamba2 mixer, held as a Nemotron-H block's `mixer`."""

    layer_attr = "mixer"


class FalconH1Mamba2Mixer(Mamba2Mixer):
    """`FalconH1Mixer`: the Mamba2 mixer with its input scaled by `ssm_in_multiplier` and the `in_proj` output by
    the muP vector (`mup_vector` `[1, 1, 2 I + 2 G N + H]`: one multiplier per gate / x / B / C / dt section); the
    gated RMSNorm only with `mamba_rms_norm` (the module's `FalconH1RMSNormGated`, grouped, norm before or after
    the gate as configured), else the scan output times silu(gate)."""

    requires = Mamba2Mixer.requires + ("mup_vector", "ssm_in_multiplier", "mamba_rms_norm")

    @staticmethod
    def project(mod, x: torch.Tensor) -> torch.Tensor:
        return mod.in_proj(x * mod.ssm_in_multiplier) * mod.mup_vector

    @staticmethod
    def gated_norm(mod, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return mod.norm(y, gate) if mod.mamba_rms_norm else y * F.silu(gate)


def _packed(x: torch.Tensor, perm: tuple, shape: tuple) -> torch.Tensor:
    """`x.permute(perm)` copied contiguous, viewed as `shape`: one copy whatever B and T are (a reshape copies or
    not depending on them, and the ops of a round must not change with the batch)."""
    return x.permute(perm).clone(memory_format=torch.contiguous_format).view(shape)


# Queries of a round at most (a verify window, a tree): their heads are folded into query rows, so one pass over the
# cached latents serves every head; more (a prefill chunk) run head by head, each head's rows reading the one mask.
ROUND_TOKENS = 64


def latent_attention(q_nope: torch.Tensor, q_rot: torch.Tensor, latents: torch.Tensor, kv_b: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """MLA attention over cached latents, never expanding them (weight absorption, as vLLM and SGLang run MLA
    decode): with `kv_b` (`kv_b_proj.weight`, rows per head `[W_UK (dn rows); W_UV (dv rows)]` over the latent r),
        score(t, s) = [q_nope W_UK | q_rot] . [c_s | k_rot_s],    out(t) = (sum_s p_ts c_s) W_UV^T,
    the attention of the expanded keys `[W_UK c; k_rot]` and values `W_UV c` with the sums associated differently.
    One `scaled_dot_product_attention` whose keys and values are both the latents (the value's rope columns dropped
    after): a fused kernel (flash on a CPU) never holds the `[T, S]` scores beyond a block, and reads the latents
    once for all the heads of a round (T <= ROUND_TOKENS: heads folded into query rows). The same ops for every B.

    Args:
        q_nope `[B, H, T, dn]`, q_rot `[B, H, T, dr]`: queries;  latents `[B, 1, S, r + dr]`: `[c | k_rot]` as an MLA
        cache holds them (`KimiLatentAttention`);  kv_b: `[H (dn + dv), r]`;
        mask: additive `[B, 1, T, S]` (or broadcastable; cast to the queries' dtype), None: all visible.
    Returns:
        `[B, T, H dv]` (heads concatenated, as the output projection takes them).
    """
    B, H, T, dn = q_nope.shape
    r = latents.shape[-1] - q_rot.shape[-1]
    w = kv_b.view(H, -1, r)
    dv = w.shape[1] - dn
    q_lat = torch.bmm(_packed(q_nope, (1, 0, 2, 3), (H, B * T, dn)), w[:, :dn])    # [H, B T, r]
    q = torch.cat([q_lat.view(H, B, T, r).permute(1, 0, 2, 3), q_rot], -1)        # [B, H, T, r + dr]
    mask = None if mask is None else mask.to(q.dtype)
    if T <= ROUND_TOKENS:
        q = q.view(B, 1, H * T, -1)                                                 # row h T + t
        if mask is not None and mask.shape[-2] > 1:
            mask = mask.expand(B, H, T, mask.shape[-1]).reshape(B, 1, H * T, -1)
    kv = latents.expand(B, q.shape[1], *latents.shape[2:])  # every head the same latents: a view, no copy
    o = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, scale=scale)
    o_lat = _packed(o.reshape(B, H, T, -1)[..., :r], (1, 0, 2, 3), (H, B * T, r))
    out = torch.bmm(o_lat, w[:, dn:].transpose(1, 2))                             # [H, B T, dv]
    return _packed(out.view(H, B, T, dv), (1, 2, 0, 3), (B, T, H * dv))


class KimiLatentAttention:
    """`KimiLinearAttention` (MLA whose shared "rope" key part is not rotated) reading its cache in latent form.

    The module expands every cached latent through `kv_b_proj` at every forward (`[B * S, r] x [r, H (dn + dv)]`
    per layer per round, growing with the context); here the expansion is folded into the queries and the output
    (`latent_attention`), as vLLM and SGLang run MLA decode: the module's attention, equal to fp32 rounding.
    The cache holds the module's latents as one tensor per token, `[c | k_rot]` (`c` after `kv_a_layernorm`), the
    keys and values of that one attention.
    Called as the module is: `(hidden_states [B, T, d], attention_mask [B, 1, T, S], cache, ...)` -> (out, None).
    """

    requires = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "num_heads", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "scaling", "layer_idx", "q_lora_rank")

    def __init__(self, mod):
        self.mod = mod

    @classmethod
    def applies(cls, mod) -> bool:
        """The module is one this mirrors (else the runner calls the module itself)."""
        return type(mod).__name__ == "KimiLinearAttention" and all(hasattr(mod, n) for n in cls.requires) \
            and mod.kv_b_proj.bias is None

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                 **kwargs) -> tuple[torch.Tensor, None]:
        m, x = self.mod, hidden_states
        B, T, _ = x.shape
        H, dn, dr, r = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        q = m.q_proj(x) if m.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
        q_nope, q_rot = q.view(B, T, H, dn + dr).transpose(1, 2).split([dn, dr], -1)   # [B, H, T, dn / dr]
        c, k_rot = m.kv_a_proj_with_mqa(x).split([r, dr], -1)
        latents = torch.cat([m.kv_a_layernorm(c), k_rot], -1).view(B, 1, T, r + dr)
        if cache is not None:
            (latents,) = cache.update(latents, layer_idx=m.layer_idx)                # [B, 1, S, r + dr]
        out = latent_attention(q_nope, q_rot, latents, m.kv_b_proj.weight, attention_mask, m.scaling)  # [B, T, H dv]
        return m.o_proj(out), None


def kv_dims(attn, config=None) -> list[tuple[int, int]]:
    """`(heads, dim)` of each tensor an attention stores in the KV cache through `update` (the memory plan's KV
    shapes; the cache itself allocates from the tensors it is given): `KimiLatentAttention` one,
    `(1, kv_lora_rank + qk_rope_head_dim)`; an MLA module (Kimi's, Bailing's) its two latents,
    `(1, kv_lora_rank)` and `(1, qk_rope_head_dim)`; otherwise K and V, `(k_proj.out_features / head_dim, head_dim)`
    and the same of `v_proj`. `attn` is the module, `KimiLatentAttention` around one, or Zamba2's shared block (its
    `self_attn`). A module with neither: the model config's `num_key_value_heads` and head dim (`config`), or []
    (not planned) without one."""
    if isinstance(attn, KimiLatentAttention):
        return [(1, attn.mod.kv_lora_rank + attn.mod.qk_rope_head_dim)]
    mod = attn
    inner = getattr(mod, "self_attn", None)
    mod = inner if isinstance(inner, torch.nn.Module) else mod
    if isinstance(getattr(mod, "kv_lora_rank", None), int) and isinstance(getattr(mod, "qk_rope_head_dim", None), int):
        return [(1, mod.kv_lora_rank), (1, mod.qk_rope_head_dim)]
    head_dim = getattr(mod, "head_dim", None)
    projs = [getattr(mod, name, None) for name in ("k_proj", "v_proj")]
    if isinstance(head_dim, int) and all(isinstance(getattr(p, "out_features", None), int) for p in projs):
        return [(p.out_features // head_dim, head_dim) for p in projs]
    heads = getattr(config, "num_key_value_heads", None)
    dim = getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads if heads else None)
    return [(heads, dim)] * 2 if heads and dim else []


@dataclass(frozen=True)
class LayerLayout:
    """Where a decoder layer puts its norms and modules (attribute names, dotted for a sub-module's; None: none
    there): `h += post_mixer(mixer(pre_mixer(h)))`, then `h += post_mlp(mlp(pre_mlp(h)))`. `attn` names the
    attention module of a full-attention layer; `mlp=None`: the layer has no MLP (Nemotron-H blocks hold one
    module; an MLP-only block, `HybridFamily.mlp_only`, has no mixer). `moe`: a module whose output is added
    to the MLP's, on the same input (GraniteMoeHybrid's `block_sparse_moe` beside its `shared_mlp`; None on the
    layer: a dense model). `residual_scale`: the layer's attribute scaling both branches before the residual add
    (GraniteMoeHybrid's `residual_multiplier`). `mixer`: the linear mixer's path where it is not where the family's
    mixer class finds it (`module`).

    A "hybrid" layer (`HybridFamily.hybrid`) runs its mixer with an attention, one of two ways:
    - `shared` None: `attn` beside the mixer on the same normed input x = pre_mixer(h) (Falcon-H1):
      `h += post_mixer(mixer(x) * mixer_out_scale + attn(x * attn_in_scale) * attn_out_scale)`, the scales the
      layer's attributes (None: 1);
    - `shared`: a transformer block (the attention inside it) on h and the model's input embeddings, through
      `shared_proj`, joins the mixer's input, not the residual (Zamba2):
      `h += post_mixer(mixer(pre_mixer(h + shared_proj(shared(h, embeddings)))))`."""

    pre_mixer: str | None = "input_layernorm"
    post_mixer: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None
    mlp: str | None = "mlp"
    attn: str = "self_attn"
    moe: str | None = None
    residual_scale: str | None = None
    mixer: str | None = None
    shared: str | None = None
    shared_proj: str | None = None
    attn_in_scale: str | None = None
    attn_out_scale: str | None = None
    mixer_out_scale: str | None = None

    def norms(self, layer) -> tuple:
        """The layer's four norm modules (None where the layout has none)."""
        return tuple(None if name is None else attr_path(layer, name)
                     for name in (self.pre_mixer, self.post_mixer, self.pre_mlp, self.post_mlp))


def attr_path(obj, path: str):
    """`obj.a.b` for `path` "a.b"."""
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


PRE_NORM = LayerLayout()
# OLMo 2/3 attention blocks: no input norm, the norms on the outputs of attention and MLP
POST_NORM = LayerLayout(None, "post_attention_layernorm", None, "post_feedforward_layernorm")
# Bamba: mamba or attention, then `feed_forward` after `pre_ff_layernorm`
BAMBA = LayerLayout(pre_mlp="pre_ff_layernorm", mlp="feed_forward")
# Nemotron-H blocks: `h += mixer(norm(h))`, the mixer a Mamba2 layer, an attention or an MLP / MoE
NEMOTRON_MIXER = LayerLayout("norm", None, None, None, mlp=None, attn="mixer")
NEMOTRON_MLP = LayerLayout(None, None, "norm", None, mlp="mixer")
# GraniteMoeHybrid (Granite-4.0-H): `shared_mlp` plus the routed experts, both branches scaled before the add
GRANITE = LayerLayout(mlp="shared_mlp", moe="block_sparse_moe", residual_scale="residual_multiplier")
# Falcon-H1: every layer mamba and attention in parallel on the normed input, each branch with its multipliers
FALCON_H1 = LayerLayout(pre_mlp="pre_ff_layernorm", mlp="feed_forward", attn_in_scale="attention_in_multiplier",
                        attn_out_scale="attn_out_multiplier", mixer_out_scale="ssm_out_multiplier")
# Zamba2: mamba layers without an MLP; a hybrid layer runs the shared transformer block (attention + MLP, with
# its per-invocation adapters) and `linear` before its own mamba layer `mamba_decoder`
ZAMBA2_MAMBA = LayerLayout(pre_mlp=None, mlp=None)
ZAMBA2_HYBRID = LayerLayout("mamba_decoder.input_layernorm", pre_mlp=None, mlp=None, mixer="mamba_decoder.mamba",
                            shared="shared_transformer", shared_proj="linear")

LINEAR_TYPES = ("linear_attention",)
MLP_TYPES = ("mlp", "moe")  # Nemotron-H blocks holding an MLP / MoE alone
HYBRID_TYPES = ("hybrid",)  # Falcon-H1 / Zamba2 layers running a mixer and an attention


@dataclass(frozen=True)
class HybridFamily:
    """One hybrid family: its linear-attention mixer, the layout of its linear / full-attention layers (and of
    its MLP-only layers, `config.layer_types` "mlp" / "moe", and its "hybrid" layers: mixer plus attention), the
    names of the base model's embedding and final norm, the base model's attributes scaling the embeddings
    (`embed_scale`) and multiplying the logits (`logits_multiplier`), the config's dividing the logits
    (`logits_scale`), a class running the family's MLA attention on latents (`latent_attention`, used where
    its `applies` holds), and how its layers split across tensor-parallel ranks (`tp_layout`; None: the family
    runs on one rank only)."""

    mixer: type
    linear: LayerLayout = PRE_NORM
    attention: LayerLayout = PRE_NORM
    mlp_only: LayerLayout | None = None
    hybrid: LayerLayout | None = None
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    embed_scale: str | None = None
    logits_scale: str | None = None
    logits_multiplier: str | None = None
    latent_attention: type | None = None
    tp_layout: TPLayout | None = None

    def layout(self, kind: str) -> LayerLayout | None:
        """The layout of a layer of `kind` ("linear", "attention", "mlp", "hybrid"); None where the family has
        none."""
        return {"linear": self.linear, "attention": self.attention, "mlp": self.mlp_only, "hybrid": self.hybrid}[kind]


def layer_kind(layer_type: str) -> str:
    """`config.layer_types` entry -> "linear" / "mlp" / "hybrid" / "attention" (every other type)."""
    if layer_type in LINEAR_TYPES:
        return "linear"
    if layer_type in HYBRID_TYPES:
        return "hybrid"
    return "mlp" if layer_type in MLP_TYPES else "attention"


HYBRID_FAMILIES = {
    "kimi_linear": HybridFamily(KimiDeltaMixer, latent_attention=KimiLatentAttention, tp_layout=TPLayout(KIMI)),
    "qwen3_next": HybridFamily(GatedDeltaMixer, tp_layout=TPLayout(GATED_DELTA)),
    "qwen3_5": HybridFamily(GatedDeltaMixer, tp_layout=TPLayout(GATED_DELTA)),
    "qwen3_5_text": HybridFamily(GatedDeltaMixer, tp_layout=TPLayout(GATED_DELTA)),
    "qwen3_5_moe": HybridFamily(GatedDeltaMixer, tp_layout=TPLayout(GATED_DELTA)),
    "qwen3_5_moe_text": HybridFamily(GatedDeltaMixer, tp_layout=TPLayout(GATED_DELTA)),
    # OLMo-Hybrid's and Bailing's mixers, Falcon-H1's and Zamba2's change what feeds or gates the heads: no tp layout
    # yet
    "olmo_hybrid": HybridFamily(OlmoGatedDeltaMixer, attention=POST_NORM),
    "bailing_hybrid": HybridFamily(BailingDeltaMixer),
    "nemotron_h": HybridFamily(NemotronHMamba2Mixer, linear=NEMOTRON_MIXER, attention=NEMOTRON_MIXER,
                               mlp_only=NEMOTRON_MLP, embed="embeddings", final_norm="norm_f",
                               tp_layout=TPLayout(MAMBA2)),
    "granitemoehybrid": HybridFamily(Mamba2Mixer, linear=GRANITE, attention=GRANITE,
                                     embed_scale="embedding_multiplier", logits_scale="logits_scaling",
                                     tp_layout=TPLayout(MAMBA2, mlp=GRANITE_MLP)),
    "bamba": HybridFamily(Mamba2Mixer, linear=BAMBA, attention=BAMBA, final_norm="final_layernorm",
                          tp_layout=TPLayout(MAMBA2)),
    "falcon_h1": HybridFamily(FalconH1Mamba2Mixer, hybrid=FALCON_H1, final_norm="final_layernorm",
                              embed_scale="embedding_multiplier", logits_multiplier="lm_head_multiplier"),
    "zamba2": HybridFamily(Mamba2Mixer, linear=ZAMBA2_MAMBA, hybrid=ZAMBA2_HYBRID, final_norm="final_layernorm"),
}
# The Mamba2 hybrids with an adapter
MAMBA2_FAMILIES = {name: HYBRID_FAMILIES[name]
                   for name in ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")}
MIXERS = {name: fam.mixer for name, fam in HYBRID_FAMILIES.items()}
