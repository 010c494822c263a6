"""`specdec.timing`, the comparison `specdec demo` and bench/accept_rate.py share: pooled medians, speedups,
spreads and the interleaving order, checked against sums worked out by hand."""

from __future__ import annotations

import pytest

from specdec import timing


def test_pooled_medians_and_speedups():
    # two prompts, three repeats each: medians 2.0 and 4.0 (spec), 4.0 and 8.0 (plain)
    spec = timing.Pooled().add(10, [2.0, 1.0, 3.0]).add(20, [4.0, 5.0, 4.0])
    plain = timing.Pooled().add(10, [4.0, 4.0, 6.0]).add(20, [8.0, 8.0, 9.0])
    assert spec.median_seconds == 6.0 and plain.median_seconds == 12.0
    assert spec.tokens_per_s == 30 / 6 and plain.tokens_per_s == 30 / 12
    assert timing.speedup(spec, plain) == pytest.approx(2.0)
    # repeat r pools the prompts' r-th seconds: spec 6, 6, 7; plain 12, 12, 15
    assert spec.tokens_per_s_per_repeat() == pytest.approx([5.0, 5.0, 30 / 7])
    assert timing.speedup_per_repeat(spec, plain) == pytest.approx([2.0, 2.0, (30 / 7) / 2.0])
    # spreads: spec (3-1)/2 = 1.0 and (5-4)/4 = 0.25; plain (6-4)/4 = 0.5 and (9-8)/8 = 0.125
    assert timing.spread([2.0, 1.0, 3.0]) == 1.0 and timing.spread([7.0]) == 0.0
    assert timing.pooled_spread(spec, plain) == pytest.approx((1.0 + 0.25) / 2)
    assert timing.is_noisy(0.26) and not timing.is_noisy(timing.NOISY)
    note = timing.noisy_note(0.5, [1.5, 2.25])
    assert "repeats differ by 50%" in note and "1.50x to 2.25x" in note


def test_interleave_order_and_warm_up():
    calls = []
    runs = timing.interleave({"a": lambda: calls.append("a") or "A", "b": lambda: calls.append("b") or "B"}, 3)
    assert calls == ["a", "b"] * 3
    assert [out for out, _ in runs["a"]] == ["A"] * 3 and all(t >= 0 for _, t in runs["b"])
    seen = []
    timing.warm_up([seen.append, lambda n: seen.append(-n)], 100)
    assert seen == [timing.WARMUP_TOKENS, -timing.WARMUP_TOKENS]
    timing.warm_up([seen.append], 3)
    assert seen[-1] == 3


def test_torch_threads():
    import torch

    before = torch.get_num_threads()
    small = torch.nn.Linear(4, 4)
    try:
        assert timing.torch_threads(small) == 1 == torch.get_num_threads()
        assert timing.torch_threads(small, 2) == 2 == torch.get_num_threads()
        torch.set_num_threads(3)
        assert timing.torch_threads(small, device="cuda") == 3  # off the CPU: torch's own count
    finally:
        torch.set_num_threads(before)
