"""Jit helpers shared by the Triton kernels: the one delta-rule step (and its Mamba2 form), the norm, the gate
(a log-decay record, or Kimi's gate computed from its input record), casts.

Every kernel that advances a state (verify, exact fold, fast rebuild's callers) calls `delta_step` from here,
and every launch passes `enable_fp_fusion=False`: the step's fused multiply-adds are the explicit `tl.fma`
below and nothing else is contracted, and every reduction is `pair_sum`'s fixed tree, whose bits do not depend
on the layouts the compiler picks. So each inlining compiles to the same fp32 arithmetic, which makes a fold of
n records bitwise equal to n verify steps on one device (docs/EXACTNESS.md). All math is fp32.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

# The interpreter's fp32 -> bf16 cast truncates; the GPU's rounds to nearest even (as torch does).
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))


def check_float(name: str, *tensors: torch.Tensor | None) -> None:
    """The kernels compute in fp32; fp64 inputs go to the references (the dispatcher does that)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            raise ValueError(f"{name}: the Triton kernel computes in fp32 and does not take fp64 tensors; "
                             f"use the reference (specdec.kernels dispatches fp64 there)")


TILE_OPS = ("verify", "fold", "rebuild")  # the kernels that step a state, each with its own tile
TILE_ENV = "SPECDEC_STATE_TILE"
STATE_TILES = Path(__file__).with_name("state_tiles.json")  # measured tiles per device name (bench/tile_sweep.py)


def state_blocks(K: int, V: int, op: str = "verify", device: str | None = None) -> tuple[int, int, int]:
    """`(BK, BV, num_warps)` of the `[K, V]` state tile of `op` (one of TILE_OPS): the whole K in one program
    (`pair_sum` reduces over it), BV columns and the warps from, in order, the environment's `SPECDEC_STATE_TILE`
    (`BVxWARPS` for every op, or `verify=8x1,fold=32x4`), the tile measured fastest for this op on the device named
    `device` (kernels/state_tiles.json), else 32 columns and 4 warps (for K < 128: 64 columns, and 1 or 2 warps
    for tiles of at most 1024 or 2048 elements).

    The bits do not depend on the tile: every reduction is `pair_sum`'s fixed tree over K, and a tile only splits V
    (bench/step_check.py `--tiles` compares the compiled steps across tiles), so verify, fold and rebuild may each
    take their own. The speed does: each warp bit of K is one exchange through shared memory per reduction, and a
    narrower tile runs more programs that each normalize the same keys (bench/tile_sweep.py measures them)."""
    if op not in TILE_OPS:
        raise ValueError(f"op: expected one of {TILE_OPS}, got {op!r}")
    BK = triton.next_power_of_2(K)
    tile = tile_override(os.environ.get(TILE_ENV, "")).get(op) or shipped_tiles().get(device or "", {}).get(op)
    if tile is not None:
        return BK, min(tile[0], triton.next_power_of_2(V)), tile[1]
    BV = min(triton.next_power_of_2(V), 32 if BK >= 128 else 64)
    return BK, BV, num_warps_for(BK * BV)


def parse_tiles(text: str, source: str) -> dict[str, tuple[int, int]]:
    """`"8x1"` (every op) or `"verify=8x1,fold=16x2"` -> `{op: (BV, num_warps)}`; one ValueError naming `source`."""
    out: dict[str, tuple[int, int]] = {}
    for part in text.split(","):
        op, _, tile = part.strip().rpartition("=")
        bv, _, w = tile.partition("x")
        ops = TILE_OPS if not op else (op,)
        ok = op in ("", *TILE_OPS) and bv.isdigit() and w.isdigit()
        if ok:
            bv_, w_ = int(bv), int(w)
            ok = bv_ >= 1 and not bv_ & (bv_ - 1) and w_ in (1, 2, 4, 8, 16)
        if not ok:
            raise ValueError(f"{source}: expected BVxWARPS or OP=BVxWARPS[,OP=BVxWARPS...] with OP in {TILE_OPS}, "
                             f"BV a power of two and WARPS 1, 2, 4, 8 or 16 (e.g. verify=8x1,fold=32x4), got {text!r}")
        out.update({o: (bv_, w_) for o in ops})
    return out


@functools.lru_cache(maxsize=8)
def tile_override(text: str) -> dict[str, tuple[int, int]]:
    """The tiles `SPECDEC_STATE_TILE` names (`{}` when unset)."""
    return parse_tiles(text, TILE_ENV) if text.strip() else {}


@functools.cache
def shipped_tiles() -> dict[str, dict[str, tuple[int, int]]]:
    """`{device name: {op: (BV, num_warps)}}` from kernels/state_tiles.json."""
    data = json.loads(STATE_TILES.read_text()) if STATE_TILES.exists() else {}
    return {name: parse_tiles(",".join(f"{op}={t}" for op, t in tiles.items()), f"{STATE_TILES.name} [{name}]")
            for name, tiles in data.get("devices", {}).items()}


def device_name(t: torch.Tensor) -> str | None:
    """The CUDA device name of `t` (the key of kernels/state_tiles.json); None off CUDA."""
    return _cuda_name(t.device.index if t.device.index is not None else torch.cuda.current_device()) \
        if t.is_cuda else None


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def num_warps_for(block_elems: int) -> int:
    return 1 if block_elems <= 1024 else (2 if block_elems <= 2048 else 4)


@triton.jit
def state_tile(K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """The K x BV state tile of this program (V block `program_id(2)`): `(offs_k, offs_v, mask_k, mask_v,
    mask_kv)`."""
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    return offs_k, offs_v, mask_k, mask_v, mask_k[:, None] & mask_v[None, :]


@triton.jit
def cast_to(x, ptr):
    """`x` in the element type of `ptr`, rounded to nearest even (emulated in the interpreter, whose own
    fp32 -> bf16 cast truncates)."""
    if INTERPRET and (ptr.dtype.element_ty == tl.bfloat16) and (x.dtype == tl.float32):
        u = x.to(tl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        y = tl.where(x == x, r, 0x7FC0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(ptr.dtype.element_ty)
    return y


@triton.constexpr_function
def _bits(n, *tail):
    """`[n, *tail]` with n split into its bits: `[2, 2, ..., 2, *tail]`."""
    return [2] * _levels(n) + list(tail)


@triton.constexpr_function
def _levels(n):
    """log2 of a power of two."""
    return n.bit_length() - 1


@triton.jit
def pair_sum(x, N: tl.constexpr):
    """Sum over axis 0 of `x` `[N]` or `[N, BV]` (N a power of two) as a fixed pairwise tree: element i + N/2 is
    added to element i, then the same over the N/2 sums, down to one. Returns `[]` or `[BV]` fp32.

    The bits of `tl.sum` depend on the layout the compiler picks (what a thread adds in registers, what it adds
    across lanes and across warps), and a kernel's layouts change with its loads and with triton's version. A
    sum of two elements is one value whatever the layout (`a + b == b + a`), so a tree of them fixes the bits:
    every kernel that steps a state gets the same ones (bench/step_check.py checks the compiled code). The
    index bits become axes of size 2 in one reshape, and each level sums the leading one.
    """
    if N == 1:
        r = tl.sum(x, axis=0)
    else:
        if len(x.shape) == 1:
            x = tl.reshape(x, _bits(N))
        else:
            x = tl.reshape(x, _bits(N, x.shape[1]))
        for _ in tl.static_range(_levels(N)):
            x = tl.sum(x, axis=0)
        r = x
    return r


@triton.jit
def l2norm(x, eps, SQRT_DIV: tl.constexpr):
    """`x * rsqrt(sum(x^2) + eps)` (fla, Qwen3-Next) or `x / sqrt(sum(x^2) + eps)` (Kimi-Linear), `[BK]` fp32;
    one square root per vector."""
    ss = pair_sum(x * x, x.shape[0]) + eps
    if SQRT_DIV:
        y = x / tl.sqrt(ss)
    else:
        y = x * tl.math.rsqrt(ss)
    return y


@triton.jit
def kda_gate(f, neg_a, bias):
    """Kimi-Linear's log-decay from the gate's input (kernels/common.py `kda_gate`): `neg_a * softplus(f + bias)`
    with `neg_a = -exp(A_log)` of the head and softplus as `log(1 + exp(x))` (x above 20); `[BK]` fp32."""
    x = f + bias
    return neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def gate_params(a_log, dt_bias, i_h, offs_k, mask_k, s_ah, s_bh, s_bk, BK: tl.constexpr, GATE_IN: tl.constexpr):
    """A head's `(neg_a, bias)` for `kda_gate`, loaded once per program: `-exp(A_log[h])` and `dt_bias[h]`
    `[BK]` (zeros when the gate records are log-decays)."""
    if GATE_IN:
        neg_a = -tl.exp(tl.load(a_log + i_h * s_ah).to(tl.float32))
        bias = tl.load(dt_bias + i_h * s_bh + offs_k * s_bk, mask=mask_k, other=0.0).to(tl.float32)
    else:
        neg_a = 0.0
        bias = tl.zeros([BK], dtype=tl.float32)
    return neg_a, bias


@triton.jit
def log_decay(rec, neg_a, bias, GATE_IN: tl.constexpr):
    """The log-decay a gate record stands for: the record itself, or (`GATE_IN`) `kda_gate` of it."""
    if GATE_IN:
        g = kda_gate(rec, neg_a, bias)
    else:
        g = rec
    return g


@triton.jit
def load_gate(ptr, offs_k, mask_k, stride_k, BK: tl.constexpr, GDN: tl.constexpr, GATE_IN: tl.constexpr, neg_a,
              bias):
    """One token's gate record and its decay, as `[BK]` fp32 vectors `(rec, alpha)`: rec is the log-decay g, or
    with `GATE_IN` the KDA gate's input f (what the ring keeps), and `alpha = exp(g)`; GDN: one scalar and one
    exp, broadcast over K."""
    if GDN:
        g0 = tl.load(ptr).to(tl.float32)
        rec = tl.zeros([BK], dtype=tl.float32) + g0
        a = tl.zeros([BK], dtype=tl.float32) + tl.exp(g0)
    else:
        rec = tl.load(ptr + offs_k * stride_k, mask=mask_k, other=0.0).to(tl.float32)
        a = tl.exp(log_decay(rec, neg_a, bias, GATE_IN))
    return rec, a


@triton.jit
def prepare_k(k, eps, SQRT_DIV: tl.constexpr, MAMBA2: tl.constexpr):
    """The key as the step takes it (kernels/common.py `prepare_qk`): normalized (delta rule), or B as it comes
    (`MAMBA2`), `[BK]` fp32."""
    if MAMBA2:
        kn = k
    else:
        kn = l2norm(k, eps, SQRT_DIV)
    return kn


@triton.jit
def prepare_q(q, eps, scale, SQRT_DIV: tl.constexpr, MAMBA2: tl.constexpr):
    """The query as the readout takes it: normalized and scaled (delta rule), or C as it comes (`MAMBA2`: no
    norm, no scale), `[BK]` fp32."""
    if MAMBA2:
        qn = q
    else:
        qn = l2norm(q, eps, SQRT_DIV) * scale
    return qn


@triton.jit
def delta_step(S, k, v, alpha, beta, MAMBA2: tl.constexpr):
    """One token: `S' = alpha S`; `d = beta (v - S'^T k)`; `S = S' + k d^T` (kernels/common.py `delta_step`).
    `MAMBA2`: the Mamba2 rule, no delta correction: `d = beta v` (k = B, v = x, alpha = exp(dt A), beta = dt).

    S `[BK, BV]`, k / alpha `[BK]`, v `[BV]`, beta scalar, all fp32. Returns `(S, d [BV])`.
    """
    S = S * alpha[:, None]
    if MAMBA2:
        d = beta * v
    else:
        d = beta * (v - pair_sum(S * k[:, None], S.shape[0]))
    S = tl.fma(k[:, None], d[None, :], S)
    return S, d


@triton.jit
def readout(S, q):
    """`S^T q` over K: `[BK, BV]`, `[BK]` -> `[BV]`."""
    return pair_sum(S * q[:, None], S.shape[0])
