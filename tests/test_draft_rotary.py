"""`draft.layers.rotary` (the drafters' half-split RoPE) against the rotation as complex numbers in float64: pair i
of a head, `(x[i], x[i + D/2])`, times `exp(1j * position * theta ** (-2i / D))`."""

import torch
from assertions import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.draft.layers import rotary


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[B, H, T, D]`, positions `[B, T]` -> x rotated, in float64."""
    D = x.shape[-1]
    x = x.double()
    # the frequencies rounded as the drafters make them (`1 / theta ** (2i / D)`): an ulp of theirs, times positions
    # in the thousands, would be more than float64's tolerance of the rotation itself
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = positions.double()[:, None, :, None] * inv
    turn = torch.polar(torch.ones_like(ang), ang)  # [B, 1, T, D/2]
    z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * turn
    return torch.cat([z.real, z.imag], -1)


@settings(max_examples=30)
@given(B=st.integers(1, 3), H=st.integers(1, 4), T=st.integers(1, 9), half=st.sampled_from([1, 2, 8, 32]),
       theta=st.sampled_from([10000.0, 500000.0, 37.5]), dtype=st.sampled_from([torch.float64, torch.float32]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_rotary_is_the_complex_rotation(B, H, T, half, theta, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, 2 * half, generator=gen, dtype=torch.float64).to(dtype)
    positions = torch.randint(0, 8192, (B, T), generator=gen)
    out = rotary(x, positions, theta)
    assert out.dtype == dtype
    assert_close(out, complex_rotation(x, positions, theta).to(dtype), msg="rotary")


def test_rotary_teeth():
    """The sign of the sine term matters: the inverse rotation is far from it."""
    x = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    positions = torch.arange(1, 6)[None]
    assert not torch.allclose(rotary(x, positions, 10000.0), complex_rotation(x, -positions, 10000.0), atol=1e-3)
    assert_close(rotary(rotary(x, positions, 10000.0), -positions, 10000.0), x, msg="rotate back")
