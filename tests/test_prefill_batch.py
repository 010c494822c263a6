"""Batched prefill (`HybridRunner.prefill_batch`) == per-prompt prefill, and the loop-free `short_conv` == the
per-token recurrence."""

from __future__ import annotations

import pytest
import torch
from assertions import max_rel_err
from tiny_models import FAMILIES, float64_everywhere, tiny_model, torch_fallbacks

from specdec.kernels import short_conv
from specdec.kernels.common import conv_step
from specdec.runner import HybridRunner
from specdec.verify import Acceptance

TOL = 1e-12
LENGTHS = [1, 5, 17, 33]  # with prefill_chunk 8: 1, 1, 3 and 5 chunks; rows drop out as their prompt ends
CAPTURE = (0, 2)


def close(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.numel():
        err = max_rel_err(a, b)
        assert err <= TOL, f"{msg}: rel err {err:.3e}"


# ---- short_conv -------------------------------------------------------------------------------------------------
def conv_loop(x, weight, bias, conv_state, activation):
    """The per-token recurrence short_conv replaced: T steps of `conv_step`."""
    window, ys = conv_state, []
    for t in range(x.shape[1]):
        y, window = conv_step(window, x[:, t], weight, bias, activation)
        ys.append(y)
    return torch.stack(ys, 1).to(x.dtype), window.to(x.dtype)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_short_conv_vs_token_loop(dtype, tol, activation):
    gen = torch.Generator().manual_seed(0)
    for B, T, C, Kc, bias in [(1, 1, 3, 4, False), (2, 7, 5, 4, True), (3, 33, 12, 2, True), (2, 2, 64, 3, True),
                              (1, 40, 24, 4, False)]:
        def rnd(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

        x, w, state = rnd(B, T, C), rnd(C, Kc), rnd(B, C, Kc - 1)
        b = rnd(C) if bias else None
        y, win = short_conv(x, w, b, conv_state=state, activation=activation)
        y_ref, win_ref = conv_loop(x, w, b, state, activation)
        assert y.dtype == win.dtype == dtype and y.shape == (B, T, C) and win.shape == (B, C, Kc - 1)
        assert torch.equal(win, win_ref), "window: the last Kc-1 columns of [state, x]"
        err = max_rel_err(y, y_ref)
        assert err <= tol, f"{(B, T, C, Kc)} y rel err {err:.3e}"
        # one call == token-by-token calls, bitwise
        w_step, ys = state, []
        for t in range(T):
            yt, w_step = short_conv(x[:, t:t + 1], w, b, conv_state=w_step, activation=activation)
            ys.append(yt)
        assert torch.equal(torch.cat(ys, 1), y) and torch.equal(w_step, win)
    # no window: zeros; T = 0: nothing, window unchanged
    x, w = torch.randn(2, 3, 4, dtype=torch.float64).to(dtype), torch.randn(4, 4, dtype=torch.float64).to(dtype)
    y, win = short_conv(x, w, activation=activation)
    y_ref, win_ref = conv_loop(x, w, None, x.new_zeros(2, 4, 3), activation)
    assert max_rel_err(y, y_ref) <= tol and torch.equal(win, win_ref)
    state = torch.randn(2, 4, 3, dtype=torch.float64).to(dtype)
    y, win = short_conv(x[:, :0], w, conv_state=state, activation=activation)
    assert y.shape == (2, 0, 4) and torch.equal(win, state)


# ---- prefill_batch ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, seed=1)


def make_runner(model):
    return HybridRunner(model, max_batch_size=6, max_length=64, num_verify_tokens=4, prefill_chunk=8)


def test_prefill_batch_matches_per_prompt(model):
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(3, V, (n,), generator=gen) for n in LENGTHS]
    with torch_fallbacks(), float64_everywhere():
        one, many = make_runner(model), make_runner(model)
        # a foreign request in each runner, prefilled before: the batch must not move it
        other_one, other_many = one.alloc(1)[0], many.alloc(1)[0]
        foreign = torch.randint(3, V, (11,), generator=gen)
        one.prefill(other_one, foreign)
        many.prefill(other_many, foreign)
        slots = one.alloc(len(prompts))[::-1]  # reversed slot order
        assert many.alloc(len(prompts))[::-1] == slots
        before = (many.state.pool.ssm[:, other_many].clone(), many.state.pool.conv[:, other_many].clone(),
                  int(many.kv.lengths[other_many]))

        refs = [one.prefill(s, p, capture=CAPTURE) for s, p in zip(slots, prompts)]
        out = many.prefill_batch(slots, prompts, capture=CAPTURE)
        P = max(LENGTHS)
        assert out.logits.shape == (len(prompts), P, V) and out.hidden.shape[:2] == (len(prompts), P)
        for b, (ref, n) in enumerate(zip(refs, LENGTHS)):
            close(out.logits[b, :n], ref.logits[0], f"row {b} logits")
            close(out.hidden[b, :n], ref.hidden[0], f"row {b} hidden")
            assert not out.logits[b, n:].any() and not out.hidden[b, n:].any(), f"row {b}: padding is 0"
            for i in CAPTURE:
                close(out.captured[i][b, :n], ref.captured[i][0], f"row {b} captured {i}")
                assert not out.captured[i][b, n:].any()

        # state of every slot: ssm checkpoint, conv window, lengths, KV entries up to the length
        for s, n in zip(slots, LENGTHS):
            close(many.state.pool.ssm[:, s], one.state.pool.ssm[:, s], f"slot {s} ssm")
            close(many.state.pool.conv[:, s], one.state.pool.conv[:, s], f"slot {s} conv")
            assert int(many.kv.lengths[s]) == int(one.kv.lengths[s]) == n
            assert int(many.state.pool.seq_len[s]) == int(one.state.pool.seq_len[s]) == n
        assert one.kv.store.keys() == many.kv.store.keys() and many.kv.store
        for layer in many.kv.store:
            for s, n in zip(slots, LENGTHS):  # read through each runner's pages
                row = torch.tensor([s])
                for got, ref in zip(many.kv.read(layer, row, n), one.kv.read(layer, row, n)):
                    close(got, ref, f"slot {s} KV layer {layer}")
        assert torch.equal(many.state.pool.ssm[:, other_many], before[0])
        assert torch.equal(many.state.pool.conv[:, other_many], before[1])
        assert int(many.kv.lengths[other_many]) == before[2]

        # the state is usable: verify rounds (rows of different lengths, partial accepts) agree
        rows = slots + [other_one]
        for r, accepted in enumerate([[1, 3, 2, 3, 1], [3, 1, 2, 2, 3]]):
            ids = torch.randint(3, V, (len(rows), 3), generator=gen)
            got, ref = many.forward(rows, ids).logits, one.forward(rows, ids).logits
            close(got, ref, f"verify round {r} logits")
            for runner in (many, one):
                runner.commit(Acceptance.prefix(accepted, 3, runner.device), host_counts=accepted)
        for s in rows:
            close(many.state.pool.ssm[:, s], one.state.pool.ssm[:, s], f"slot {s} ssm after rounds")
            assert int(many.kv.lengths[s]) == int(one.kv.lengths[s])


def test_prefill_batch_last_logits(model):
    gen = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    prompts = [torch.randint(3, V, (n,), generator=gen) for n in [9, 3, 16, 8]]  # ends inside and at a chunk end
    with torch_fallbacks(), float64_everywhere():
        full, last = make_runner(model), make_runner(model)
        slots = full.alloc(4)
        assert last.alloc(4) == slots
        ref = full.prefill_batch(slots, prompts, capture=CAPTURE)
        out = last.prefill_batch(slots, prompts, capture=CAPTURE, last_logits=True)
        assert out.logits.shape == (4, 1, V)
        for b, p in enumerate(prompts):
            close(out.logits[b, 0], ref.logits[b, p.numel() - 1], f"row {b} last logits")
        close(out.hidden, ref.hidden, "hidden")
        for s in slots:
            close(last.state.pool.ssm[:, s], full.state.pool.ssm[:, s], f"slot {s} ssm")


def test_prefill_is_a_batch_of_one(model):
    """`prefill(slot, ids)` returns `[1, P, ...]` and accepts one-token prompts."""
    with torch_fallbacks(), float64_everywhere():
        runner = make_runner(model)
        slot = runner.alloc(1)[0]
        out = runner.prefill(slot, torch.tensor([5]), capture=CAPTURE)
        assert out.logits.shape == (1, 1, model.config.vocab_size) and out.captured[0].shape[:2] == (1, 1)
        assert int(runner.kv.lengths[slot]) == 1


def test_prefill_batch_argument_errors(model):
    runner = make_runner(model)
    a, b = runner.alloc(2)
    p = torch.tensor([4, 5, 6])
    with pytest.raises(ValueError, match="prompts"):
        runner.prefill_batch([a, b], [p])
    with pytest.raises(ValueError, match="slots"):
        runner.prefill_batch([a, a], [p, p])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        runner.prefill_batch([a, b], [p, p[:0]])
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        runner.prefill_batch([a], [p[None]])
    assert int(runner.kv.lengths[a]) == int(runner.kv.lengths[b]) == 0
