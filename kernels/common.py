"""Shared math of the references: the model's L2 norm, one delta-rule step, argument checks.

Pure torch; never imports triton. The math runs in fp32 (fp64 when an input is fp64). Plain decode,
verify and the exact fold all advance a state through `delta_step`, so on this backend a fold of n records
is bit for bit the state of n decode steps (docs/EXACTNESS.md).
"""

from __future__ import annotations

import functools
import inspect

import torch


def math_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the state is never advanced in a lower precision."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def dot(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`S^T x` over the K axis: S `[..., K, V]`, x `[..., K]` -> `[..., V]`, in S's dtype.

    Products then one sum over K: torch reduces each column in an order fixed by K and V alone (not by the
    leading dims), so every caller of `delta_step` rounds a state the same way.
    """
    return (S * x[..., None]).sum(-2)


def l2norm(x: torch.Tensor, *, eps: float = 1e-6, norm: str = "rsqrt") -> torch.Tensor:
    """Normalize the last dim exactly as the model does.

    `norm="rsqrt"`: `x * rsqrt(sum(x^2) + eps)` (fla, Qwen3-Next, Qwen3.5; as `x * (1 / sqrt(.))`);
    `norm="sqrt_div"`: `x / sqrt(sum(x^2) + eps)` (Kimi-Linear). The two differ in the last bit, and a
    state advanced with the wrong one drifts while outputs still look right.
    """
    r = torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)
    if norm == "rsqrt":
        return x * (1.0 / r)
    if norm == "sqrt_div":
        return x / r
    raise ValueError(f"norm: expected 'rsqrt' or 'sqrt_div', got {norm!r}")


def gate_channels(g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """KDA gate `[..., H, K]` stays; GDN gate `[..., H]` (same shape as `beta`) becomes `[..., H, 1]`."""
    return g.unsqueeze(-1) if g.dim() == beta.dim() else g


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Kimi-Linear's forget gate from its input, op for op as the model computes it (`KimiLinearForgetGate`;
    fla's `use_gate_in_kernel`): `g = -exp(A_log) * softplus(f + dt_bias)` in fp32 whatever the model's dtype (the
    model casts to fp32 too), softplus as `log(1 + exp(x))` (x itself above 20).

    Args:
        f: the gate's input (`f_b_proj(f_a_proj(x))`) `[..., H, K]`, any float dtype.
        A_log: `[..., H]`;  dt_bias: `[..., H, K]` (both broadcast against f's leading dims).
    Returns:
        g `[..., H, K]` fp32. `exp` and `log` give the same bits for an element wherever it sits in a tensor, so
        the verify (a round of tokens) and the fold (one record at a time) agree bit for bit.
    """
    x = f.float() + dt_bias.float()
    return -A_log.float().exp()[..., None] * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def check_gate_params(A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lead: tuple, H: int, K: int,
                      g: torch.Tensor | None = None) -> bool:
    """Whether the gate is computed from its input (`A_log` `[*lead, H]` and `dt_bias` `[*lead, H, K]` given,
    both or neither; then `g` (inputs or ring), when passed, must be KDA-shaped: K channels last). One `ValueError`
    naming the argument."""
    if (A_log is None) != (dt_bias is None):
        raise ValueError("A_log: pass A_log and dt_bias together (the gate computed from its input) or neither")
    if A_log is None:
        return False
    check_shape("A_log", A_log, (*lead, H))
    check_shape("dt_bias", dt_bias, (*lead, H, K))
    if g is not None and (g.dim() < 2 or g.shape[-1] != K or K == 1):
        raise ValueError(f"g: with A_log / dt_bias, g is the KDA gate's input [..., {K}] (per channel), got "
                         f"{list(g.shape)}")
    return True


RULES = ("delta", "mamba2")


def check_rule(rule: str) -> str:
    """`rule` if known, else one `ValueError` naming it."""
    if rule not in RULES:
        raise ValueError(f"rule: expected 'delta' or 'mamba2', got {rule!r}")
    return rule


def delta_step(S: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, *,
               rule: str = "delta") -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One token of the gated delta rule (or the Mamba2 rule), in plain-decode op order.

    Args:
        S: state `[N, H, K, V]` in the math dtype.
        q: normalized, scaled query `[N, H, K]` (None: no output, as in the exact fold);  k: normalized key `[N, H, K]`.
        v: raw value `[N, H, V]`;  g: log-decay `[N, H, K]` (KDA) or `[N, H, 1]` (GDN);  beta: `[N, H]`.
    Returns:
        `(S_t [N, H, K, V], o_t [N, H, V], d_t [N, H, V])` with `S' = exp(g) S`,
        `d = beta (v - S'^T k)`, `S_t = S' + k d^T` (one fused multiply-add per element, `torch.addcmul`),
        `o = S_t^T q`.
        `rule="mamba2"`: no delta correction, `d = beta v` (a Mamba2 head: k = B, v = x, q = C, g = dt A,
        beta = dt). The same `d` feeds the fast rebuild, so lazy commit holds for both rules.
    """
    S = S * g.exp()[..., None]  # a new tensor: the caller's S is never written (a tree's parent has children)
    if rule == "mamba2":
        d = beta[..., None] * v
    else:
        d = beta[..., None] * (v - dot(S, k))
    # S + k d^T as one fused op (no temporary outer product); in place unless autograd needs S (training)
    if torch.is_grad_enabled() and (S.requires_grad or k.requires_grad or d.requires_grad):
        S = torch.addcmul(S, k[..., None], d[..., None, :])
    else:
        S.addcmul_(k[..., None], d[..., None, :])
    o = None if q is None else dot(S, q)
    return S, o, d


def prepare_qk(q: torch.Tensor | None, k: torch.Tensor, *, scale: float, eps: float, norm: str,
               dtype: torch.dtype, rule: str = "delta") -> tuple[torch.Tensor | None, torch.Tensor]:
    """Raw q/k `[..., K]` -> (normalized q * scale, normalized k) in `dtype`; the mamba2 rule uses C and B as
    they come (cast only)."""
    if check_rule(rule) == "mamba2":
        return (None if q is None else q.to(dtype)), k.to(dtype)
    k = l2norm(k.to(dtype), eps=eps, norm=norm)
    if q is not None:
        q = l2norm(q.to(dtype), eps=eps, norm=norm) * scale
    return q, k


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    """`shape` entries of None are free. Raises one `ValueError` naming the argument."""
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def check_delta_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor):
    """Shapes of the delta-rule inputs (q, k `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H, K]` or `[B, T, H]`,
    beta `[B, T, H]`) -> `(B, T, H, K, V, g [B, T, H, K or 1])`."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    check_shape("q", q, (B, T, H, K))
    check_shape("v", v, (B, T, H, V))
    check_shape("beta", beta, (B, T, H))
    g = gate_channels(g, beta)
    check_shape("g", g, (B, T, H, None))
    return B, T, H, K, V, g


def check_verify_buffers(B: int, T: int, H: int, K: int, V: int, ssm_state: torch.Tensor,
                         ssm_state_indices: torch.Tensor, intermediate_states: torch.Tensor | None) -> None:
    """The state-side arguments of a verify of `B` requests x `T` tokens: checkpoints `[N, H, K, V]`, slots `[B]`,
    node states `[>= B, >= T, H, K, V]`. Raises one `ValueError` naming the argument."""
    check_shape("ssm_state", ssm_state, (None, H, K, V))
    check_shape("ssm_state_indices", ssm_state_indices, (B,))
    if intermediate_states is not None and (intermediate_states.dim() != 5 or intermediate_states.shape[0] < B
                                            or intermediate_states.shape[1] < T
                                            or intermediate_states.shape[2:] != (H, K, V)):
        raise ValueError(f"intermediate_states: expected [>={B}, >={T}, {H}, {K}, {V}], "
                         f"got {list(intermediate_states.shape)}")


def valid_slots(indices: torch.Tensor, null_slot: int) -> torch.Tensor:
    """Rows whose slot is neither -1 nor the null slot (`[B]` bool)."""
    return (indices >= 0) & (indices != null_slot)


def conv_step(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the causal depthwise short conv.

    Args:
        window: the last `Kc-1` pre-conv inputs `[N, C, Kc-1]`;  x: this token's input `[N, C]`.
        weight: `[C, Kc]`;  bias: `[C]` or None;  activation: "silu" or None.
    Returns:
        `(y [N, C], new_window [N, C, Kc-1])`, both in the math dtype of the inputs.
    """
    dt = math_dtype(window, x, weight)
    full = torch.cat([window.to(dt), x.to(dt)[..., None]], dim=-1)  # [N, C, Kc]
    y = (full * weight.to(dt)).sum(-1)
    if bias is not None:
        y = y + bias.to(dt)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    elif activation is not None:
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    return y, full[..., 1:]


@functools.lru_cache(maxsize=None)
def _keyword_defaults(spec) -> dict:
    return {n: p.default for n, p in inspect.signature(spec).parameters.items() if p.kind is p.KEYWORD_ONLY}


def keyword_options(spec, options: dict) -> dict:
    """`options` over the keyword-only defaults of `spec`, the op's reference function, which holds the op's one
    signature and docstring: for a backend that takes the same options as `**options`. An unknown name is one
    TypeError, as a call of `spec` would raise."""
    known = _keyword_defaults(spec)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"{spec.__name__}() got unexpected keyword arguments {unknown}")
    return {**known, **options}
