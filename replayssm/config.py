"""Flat configuration of the recurrent state held for speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "fp64": torch.float64,
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, *, arg: str = "dtype") -> torch.dtype:
    """`"bfloat16"` / `"bf16"` / `torch.bfloat16` -> `torch.bfloat16`; anything else is a `ValueError` naming `arg`."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"{arg}: unsupported dtype {dtype}; expected one of float64, float32, bfloat16, float16")
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"{arg}: unknown dtype {dtype!r}; expected one of float64, float32, bfloat16, float16")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


def check_ring_len(ring_len: int, num_verify_tokens: int) -> None:
    """Ring depth L must be a power of two and hold two verify windows (L >= 2*D)."""
    if num_verify_tokens < 1:
        raise ValueError(f"num_verify_tokens: expected D >= 1, got {num_verify_tokens}")
    if ring_len < 1 or ring_len & (ring_len - 1):
        raise ValueError(f"ring_len: expected a power of two, got L={ring_len} (D={num_verify_tokens})")
    if ring_len < 2 * num_verify_tokens:
        raise ValueError(f"ring_len: expected L >= 2*D, got L={ring_len} < 2*{num_verify_tokens}={2 * num_verify_tokens}")


@dataclass
class StateConfig:
    """Shapes and dtypes of every buffer the state strategies hold.

    `rule="mamba2"` (Mamba2 heads, docs/EXACTNESS.md, the recurrence with no delta correction): per token `S = exp(g) S + beta k v^T`,
    `o = S^T q` with k = B `[K = N]`, v = x `[V = P]`, q = C, g = dt * A, beta = dt; no L2 norm, no scale.

    Pool: `conv[layer, slot, C, Kc-1]` in `act_dtype`, `ssm[layer, slot, H, K, V]` in `ssm_dtype`;
    `num_slots = max_requests + 1` (the last slot is the null slot). Rings: `[layer, running row, H, D, dim]`
    with eager commit, `[layer, slot, H, L, dim]` with lazy commit (`plan.buffer_specs`). Per-request verify
    buffers have `max_running + 1` rows and `num_verify_tokens` steps (D, or the tree node budget T).
    """

    num_layers: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    conv_dim: int | None = None  # C; default H * (2K + V): the [q, k, v] channels of the short conv
    gate: str = "kda"  # "kda": per-channel log-decay [K]; "gdn": scalar per head
    # KDA only: the g ring keeps the gate's input f [K] in act_dtype, and verify and fold compute Kimi's
    # g = -exp(A_log) softplus(f + dt_bias) per token (fla's use_gate_in_kernel; `kernels.common.kda_gate`), from
    # the per-layer A_log / dt_bias given to the strategy's `set_gate`
    gate_in_kernel: bool = False
    rule: str = "delta"  # "delta": gated delta rule; "mamba2": S = exp(g) S + beta k v^T (k = B, v = x, beta = dt)
    max_requests: int = 8
    max_running: int | None = None  # rows of the per-request verify buffers; default max_requests
    num_verify_tokens: int = 8  # D = anchor + gamma drafts (or tree node budget T)
    ring_len: int | None = None  # L; default next_pow2(2*D)
    ssm_dtype: torch.dtype | str = torch.float32
    act_dtype: torch.dtype | str = torch.float32  # conv state, ring d/k/rawv/rawk
    track_interval: int | None = 256
    norm_eps: float = 1e-6
    norm: str = "rsqrt"  # "rsqrt": x * rsqrt(|x|^2 + eps) (Qwen3-Next/fla); "sqrt_div": x / sqrt(|x|^2 + eps) (Kimi)
    scale: float | None = None  # default K**-0.5

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_k_dim", "head_v_dim", "max_requests"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel: expected >= 2, got {self.conv_kernel}")
        if self.gate not in ("kda", "gdn"):
            raise ValueError(f"gate: expected 'kda' or 'gdn', got {self.gate!r}")
        if self.rule not in ("delta", "mamba2"):
            raise ValueError(f"rule: expected 'delta' or 'mamba2', got {self.rule!r}")
        if self.rule == "mamba2" and self.gate != "gdn":
            raise ValueError(f"gate: the mamba2 rule decays each head by a scalar; expected 'gdn', got {self.gate!r}")
        if self.gate_in_kernel and (self.gate != "kda" or self.rule != "delta"):
            raise ValueError(f"gate_in_kernel: computes Kimi's per-channel KDA gate; expected gate='kda' and "
                             f"rule='delta', got gate={self.gate!r}, rule={self.rule!r}")
        if self.norm not in ("rsqrt", "sqrt_div"):
            raise ValueError(f"norm: expected 'rsqrt' or 'sqrt_div', got {self.norm!r}")
        self.ssm_dtype = resolve_dtype(self.ssm_dtype, arg="ssm_dtype")
        self.act_dtype = resolve_dtype(self.act_dtype, arg="act_dtype")
        if self.conv_dim is None:
            self.conv_dim = self.num_heads * (2 * self.head_k_dim + self.head_v_dim)
        if self.max_running is None:
            self.max_running = self.max_requests
        if self.max_running < 1:
            raise ValueError(f"max_running: expected >= 1, got {self.max_running}")
        if self.num_verify_tokens < 1:
            raise ValueError(f"num_verify_tokens: expected D >= 1, got {self.num_verify_tokens}")
        if self.ring_len is None:
            self.ring_len = next_pow2(2 * self.num_verify_tokens)
        check_ring_len(self.ring_len, self.num_verify_tokens)
        if self.track_interval is not None and self.track_interval < 1:
            raise ValueError(f"track_interval: expected >= 1 or None, got {self.track_interval}")
        if self.scale is None:
            self.scale = self.head_k_dim ** -0.5

    @property
    def num_slots(self) -> int:
        """Pool slots including the null slot."""
        return self.max_requests + 1

    @property
    def null_slot(self) -> int:
        return self.max_requests

    @property
    def gate_dim(self) -> int:
        """Channels of the log-decay g per head: K for KDA, 1 for GDN."""
        return self.head_k_dim if self.gate == "kda" else 1

    @property
    def record_dtype(self) -> torch.dtype:
        """Ring g and beta: fp32, or fp64 when the checkpoint is fp64 (exactness tests)."""
        return torch.float64 if self.ssm_dtype == torch.float64 else torch.float32

    @property
    def gate_dtype(self) -> torch.dtype:
        """Ring g: the gate's input in act_dtype (`gate_in_kernel`), else the log-decay in `record_dtype`."""
        return self.act_dtype if self.gate_in_kernel else self.record_dtype

    @classmethod
    def tiny(cls, **overrides) -> "StateConfig":
        """A small preset for tests and examples."""
        base = dict(num_layers=2, num_heads=2, head_k_dim=8, head_v_dim=8, conv_kernel=4, max_requests=4,
                    num_verify_tokens=4)
        base.update(overrides)
        return cls(**base)
