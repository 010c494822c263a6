"""State tiles per kernel (kernels/triton_utils.py `state_blocks`): `SPECDEC_STATE_TILE`, the measured table
kernels/state_tiles.json by device name, the default; and the contract that lets each kernel take its own: the tile
changes no bit. With verify at one tile and fold at another, a verify's outputs and node states, the fold and the
one-token verifies (at verify's tile) are bit for bit what they are at the default tiles (in the interpreter here,
whose warps change nothing; compiled on a GPU, where they do)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.kernels import dispatch
from specdec.kernels import triton_utils as tu

pytestmark = pytest.mark.triton


def test_default_override_and_table(monkeypatch):
    monkeypatch.delenv(tu.TILE_ENV, raising=False)
    assert tu.state_blocks(128, 128) == (128, 32, 4)
    assert tu.state_blocks(64, 64, "fold") == (64, 64, 4)
    assert tu.state_blocks(3, 5, "rebuild") == (4, 8, 1)
    table = {"NVIDIA H200": {"fold": (16, 2), "verify": (8, 1)}}
    monkeypatch.setattr(tu, "shipped_tiles", lambda: table)
    assert tu.state_blocks(128, 128, "fold", "NVIDIA H200") == (128, 16, 2)
    assert tu.state_blocks(128, 128, "rebuild", "NVIDIA H200") == (128, 32, 4)  # not in the table: the default
    assert tu.state_blocks(128, 128, "fold", "NVIDIA H100") == (128, 32, 4)
    assert tu.state_blocks(128, 6, "verify", "NVIDIA H200") == (128, 8, 1)
    monkeypatch.setenv(tu.TILE_ENV, "64x4")  # the environment wins, every op
    assert [tu.state_blocks(128, 128, op, "NVIDIA H200") for op in tu.TILE_OPS] == [(128, 64, 4)] * 3
    assert tu.state_blocks(128, 16, "fold") == (128, 16, 4)  # never wider than V
    monkeypatch.setenv(tu.TILE_ENV, "fold=8x1, rebuild=16x2")
    assert tu.state_blocks(128, 128, "fold") == (128, 8, 1)
    assert tu.state_blocks(128, 128, "rebuild") == (128, 16, 2)
    assert tu.state_blocks(128, 128, "verify", "NVIDIA H200") == (128, 8, 1)  # from the table
    with pytest.raises(ValueError, match="op: expected one of"):
        tu.state_blocks(128, 128, "scatter")


def test_table_file(tmp_path, monkeypatch):
    """The shipped file is in the form the lookup reads (an empty `devices` until a GPU run fills it); a file with an
    entry is read by device name, and a malformed one is one error naming the file and the device."""
    shipped = json.loads(tu.STATE_TILES.read_text())
    assert isinstance(shipped["devices"], dict) and tu.shipped_tiles() == {
        name: tu.parse_tiles(",".join(f"{op}={t}" for op, t in tiles.items()), "x")
        for name, tiles in shipped["devices"].items()}
    f = tmp_path / "state_tiles.json"
    f.write_text(json.dumps({"devices": {"NVIDIA H200": {"verify": "8x1", "fold": "16x2"}}}))
    monkeypatch.setattr(tu, "STATE_TILES", f)
    monkeypatch.delenv(tu.TILE_ENV, raising=False)
    tu.shipped_tiles.cache_clear()
    try:
        assert tu.state_blocks(128, 128, "verify", "NVIDIA H200") == (128, 8, 1)
        assert tu.state_blocks(128, 128, "fold", "NVIDIA H200") == (128, 16, 2)
        assert tu.state_blocks(128, 128, "rebuild", "NVIDIA H200") == (128, 32, 4)
        f.write_text(json.dumps({"devices": {"NVIDIA H200": {"fold": "16x3"}}}))
        tu.shipped_tiles.cache_clear()
        with pytest.raises(ValueError, match=r"state_tiles.json \[NVIDIA H200\]: expected BVxWARPS"):
            tu.shipped_tiles()
    finally:
        tu.shipped_tiles.cache_clear()


@pytest.mark.parametrize("text", ["", "32", "32x3", "x4", "fold=", "fold=32x4,", "scatter=8x1", "24x2", "0x1",
                                  "8x1;fold=8x2"])
def test_bad_tile_is_one_clear_error(text):
    with pytest.raises(ValueError, match="SPECDEC_STATE_TILE: expected BVxWARPS"):
        tu.parse_tiles(text or ",", tu.TILE_ENV)
    assert tu.parse_tiles("8x1", "x") == {op: (8, 1) for op in tu.TILE_OPS}


def _inputs(dev, T=5, H=2, K=5, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    return dict(q=r(1, T, H, K), k=r(1, T, H, K), v=r(1, T, H, V),
                g=(-torch.rand(1, T, H, K, generator=g) * 0.5).to(dev),
                beta=(0.1 + 0.8 * torch.rand(1, T, H, generator=g)).to(dev)), r(2, H, K, V)


def _run(dev, inputs, S0, n):
    """One chain verify (rings written, every node state kept), the fold of its first n records and n one-token
    verifies from the checkpoint, at whatever tiles the environment names: (node states, folded, stepped)."""
    verify, fold = dispatch.triton_impl("verify_delta_rule"), dispatch.triton_impl("exact_fold")
    _, T, H, K = inputs["k"].shape
    V = inputs["v"].shape[-1]
    L = 8
    ring = tuple(torch.full((2, H, L, d), float("nan"), device=dev) for d in (V, K, K, V, K)) + \
        (torch.full((2, H, L), float("nan"), device=dev),)
    idx, start = torch.tensor([1], device=dev), torch.tensor([0, 3], device=dev)
    inter = torch.full((1, T, H, K, V), float("nan"), device=dev)
    o = verify(*inputs.values(), S0, idx, ring=ring, ring_start=start, intermediate_states=inter)
    state = S0.clone()[None]
    fold(state, ring[3][None], ring[4][None], ring[2][None], ring[5][None], idx, start, torch.tensor([n], device=dev))
    cur = S0[1:2].clone()
    for j in range(n):
        out = torch.full((1, 1, H, K, V), float("nan"), device=dev)
        verify(*(t[:, j:j + 1] for t in inputs.values()), cur, torch.tensor([0], device=dev), intermediate_states=out)
        cur = out[:, 0]
    return (o, inter), state[0], cur[0]


def test_tiles_change_no_bit(monkeypatch, triton_device):
    dev = triton_device
    inputs, S0 = _inputs(dev)
    monkeypatch.delenv(tu.TILE_ENV, raising=False)
    (o_d, inter_d), folded_d, stepped_d = _run(dev, inputs, S0, 4)
    assert torch.equal(folded_d[1], stepped_d) and torch.equal(folded_d[1], inter_d[0, 3])
    # verify in 3 V blocks of one warp, fold in one block of 2 warps (and the other way round)
    for tiles in ("verify=4x1,fold=16x2", "verify=16x2,fold=4x1"):
        monkeypatch.setenv(tu.TILE_ENV, tiles)
        (o, inter), folded, stepped = _run(dev, inputs, S0, 4)
        assert torch.equal(o, o_d) and torch.equal(inter, inter_d), tiles
        assert torch.equal(folded, folded_d) and torch.equal(stepped, stepped_d), tiles
        assert torch.equal(folded[0], S0[0]), "a foreign slot was written"


def test_bad_tile_raises_before_any_write(monkeypatch, triton_device):
    """A malformed `SPECDEC_STATE_TILE` is one error at the launch that reads it, before the kernel writes."""
    dev = triton_device
    _, S0 = _inputs(dev)
    H, K, V, L = 2, 5, 12, 8
    ring = tuple(torch.randn(1, 2, H, L, d, device=dev) for d in (V, K, K)) + (torch.rand(1, 2, H, L, device=dev),)
    state = S0.clone()[None]
    monkeypatch.setenv(tu.TILE_ENV, "fold=12x1")
    fold = dispatch.triton_impl("exact_fold")
    args = (ring[0], ring[1], -ring[2].abs(), ring[3], torch.tensor([1], device=dev), torch.tensor([0, 3], device=dev),
            torch.tensor([2], device=dev))
    with pytest.raises(ValueError, match="SPECDEC_STATE_TILE"):
        fold(state, *args)
    assert torch.equal(state[0], S0)
    monkeypatch.setenv(tu.TILE_ENV, "fold=4x1")  # the same call at a good tile does write (the check has teeth)
    fold(state, *args)
    assert not torch.equal(state[0, 1], S0[1])
