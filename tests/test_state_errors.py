"""Bad arguments: one clear error, raised before any state changes."""

from __future__ import annotations

import pytest
import torch
from state_harness import Harness

from specdec.replayssm import SlotPool, StateConfig, make_strategy


def snapshot_state(strat):
    s = [strat.pool.conv.clone(), strat.pool.ssm.clone(), strat.pool.seq_len.clone()]
    if hasattr(strat, "rings") and strat.rings.layout == "lazy":  # records past the pending ones are scratch
        r = strat.rings
        s += [r.start.clone(), r.pending.clone()]
        for slot in range(strat.cfg.num_slots):
            pos = (r.start[slot] + torch.arange(int(r.pending[slot]))) % strat.cfg.ring_len
            s += [b[:, slot, :, pos].clone() for b in r.buffers]
    return s


def assert_unchanged(strat, before):
    for a, b in zip(snapshot_state(strat), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ring_len=12), r"ring_len: expected a power of two, got L=12"),
    (dict(ring_len=4, num_verify_tokens=4), r"ring_len: expected L >= 2\*D, got L=4 < 2\*4=8"),
    (dict(num_verify_tokens=0), r"num_verify_tokens: expected D >= 1, got 0"),
    (dict(ssm_dtype="float8"), r"ssm_dtype: unknown dtype 'float8'"),
    (dict(act_dtype=torch.int32), r"act_dtype: unsupported dtype"),
    (dict(gate="mamba"), r"gate: expected 'kda' or 'gdn'"),
    (dict(num_heads=0), r"num_heads: expected >= 1"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StateConfig.tiny(**kwargs)


def test_default_ring_len():
    assert StateConfig.tiny(num_verify_tokens=8).ring_len == 16
    assert StateConfig.tiny(num_verify_tokens=9).ring_len == 32
    assert StateConfig.tiny(num_verify_tokens=1).ring_len == 2


def test_slot_exhaustion_is_clear_and_takes_nothing():
    pool = SlotPool(StateConfig.tiny(max_requests=3))
    pool.alloc(2)
    with pytest.raises(RuntimeError, match=r"slot pool exhausted: requested 2 slot\(s\), 1 of 3 free"):
        pool.alloc(2)
    assert pool.num_free == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([2])
    assert pool.num_free == 1


@pytest.mark.parametrize("name", ["snapshot", "replay-eager", "replay-lazy"])
def test_round_errors_leave_state_untouched(name):
    cfg = StateConfig.tiny(ssm_dtype=torch.float64, act_dtype=torch.float64, max_requests=3)
    h = Harness(cfg, seed=11, strategies=(name,))
    strat = h.strats[name]
    inp = h.inputs(2, 4)
    qkv = lambda layer: [inp[n][layer] for n in ("q", "k", "v", "g", "beta")]  # noqa: E731
    strat.begin([0, 1])  # one committed round first, so lazy mode has pending records to protect
    for layer in range(cfg.num_layers):
        strat.conv(layer, inp["x"][layer], h.weights[layer])
        strat.mix(layer, *qkv(layer))
    strat.commit([2, 3])
    if name == "replay-lazy":
        assert strat.rings.pending[:2].tolist() == [2, 3]
    before = snapshot_state(strat)

    with pytest.raises(ValueError, match=r"slots: slots \[9\] are not allocated"):
        strat.begin([0, 9])
    with pytest.raises(ValueError, match="a slot appears twice"):
        strat.begin([1, 1])
    with pytest.raises(ValueError, match=r"num_tokens: expected 1 <= T <= D=4, got 5"):
        strat.begin([0, 1], num_tokens=5)
    with pytest.raises(ValueError, match=r"parent: not topological; expected -1 <= parent\[i\] < i"):
        strat.begin([0, 1], parent=[-1, 1, 0, 0])
    with pytest.raises(RuntimeError, match="no open round"):
        strat.mix(0, *qkv(0))

    strat.begin([0, 1], num_tokens=4)
    with pytest.raises(ValueError, match=r"q: expected shape \[2, 4, 2, 8\], got \[2, 4, 2, 7\]"):
        strat.mix(0, inp["q"][0][..., :7], *qkv(0)[1:])
    with pytest.raises(ValueError, match=r"g: expected shape"):
        strat.mix(0, *qkv(0)[:3], inp["g"][0][..., 0], inp["beta"][0])
    with pytest.raises(ValueError, match=r"layer: expected 0..1, got 2"):
        strat.mix(2, *qkv(0))
    with pytest.raises(ValueError, match=r"weight: expected shape"):
        strat.conv(0, inp["x"][0], h.weights[0][:, :3])
    # A failure half-way through the layers: commit refuses, abort leaves every slot as it was.
    strat.conv(0, inp["x"][0], h.weights[0])
    strat.mix(0, *qkv(0))
    with pytest.raises(RuntimeError, match=r"commit: layers \[1\] were not verified"):
        strat.commit([2, 2])
    for layer in range(cfg.num_layers):
        strat.conv(layer, inp["x"][layer], h.weights[layer])
        strat.mix(layer, *qkv(layer))
    with pytest.raises(ValueError, match=r"num_kept: expected 1..4 per request \(tokens kept: .*\), got \[0, 2\]"):
        strat.commit([0, 2])
    with pytest.raises(ValueError, match=r"num_kept: expected shape \[2\]"):
        strat.commit([1, 2, 3])
    with pytest.raises(ValueError, match="is not a root-to-leaf path"):
        strat.commit(path=[[0, 2, -1], [0, 1, 2]])
    with pytest.raises(RuntimeError, match="a round is open"):
        strat.begin([0, 1])
    assert_unchanged(strat, before)
    strat.abort()
    assert_unchanged(strat, before)


def test_unknown_strategy_and_commit_mode():
    cfg = StateConfig.tiny()
    with pytest.raises(ValueError, match=r"strategy: expected 'replay' or 'snapshot', got 'full'"):
        make_strategy(cfg, "full")
    with pytest.raises(ValueError, match=r"commit: expected 'eager' or 'lazy', got 'later'"):
        make_strategy(cfg, "replay", commit="later")


def test_snapshot_with_lazy_commit_is_refused():
    """A full-snapshot strategy has no pending records to fold later: lazy commit is one error, at wrap and below."""
    import specdec
    from specdec.replayssm import StateConfig, make_strategy
    with pytest.raises(ValueError, match="commit: 'lazy' leaves ReplaySSM's records pending; strategy='snapshot'"):
        specdec.SpecConfig(strategy="snapshot", commit="lazy")
    cfg = StateConfig(num_layers=1, num_heads=1, head_k_dim=4, head_v_dim=4, max_requests=1)
    with pytest.raises(ValueError, match="commit: strategy 'snapshot' commits eagerly"):
        make_strategy(cfg, "snapshot", commit="lazy")
