"""The mamba2 rule of the state core against an independent float64 Mamba2 recurrence (hypothesis).

A Mamba2 head keeps h `[P, N]` and per token `h = exp(dt A) h + dt x B^T`, `y = h C` (D skip outside). The state
core holds it as S = h^T `[K = N, V = P]` with k = B, v = x, q = C, g = dt A, beta = dt (`rule="mamba2"`). Checked
here: replay (eager, lazy) == snapshot == the recurrence written below, round after round, chains and trees;
null and foreign slots bitwise unchanged; the fold of n records == n single steps == plain decode, bitwise in fp32;
one corrupted record fails; the chunked prefill equals the recurrence; the CUDA / Triton dispatch sends the rule
to the Triton kernels' mamba2 flag, never to the delta rule (the kernels themselves: tests/test_mamba2_triton.py).
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close, max_rel_err
from hypothesis import given, settings
from hypothesis import strategies as st
from state_harness import Harness, first_record
from test_state_properties import run_round, slot_map

from specdec import kernels
from specdec.kernels.verify import naive as verify_naive
from specdec.replayssm import StateConfig


def mamba2_decode(h: torch.Tensor, x: torch.Tensor, B: torch.Tensor, C: torch.Tensor, dt: torch.Tensor,
                  A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 recurrence in float64, transformers' layout: h `[H, P, N]`, x `[T, H, P]`, B, C `[T, H, N]`,
    dt `[T, H]`, A `[H]` -> (y `[T, H, P]` without the D skip, h after the last token)."""
    h = h.double().clone()
    ys = []
    for t in range(x.shape[0]):
        dA = torch.exp(dt[t].double() * A.double())[:, None, None]
        dBx = (dt[t].double()[:, None, None] * B[t].double()[:, None, :]) * x[t].double()[:, :, None]
        h = h * dA + dBx
        ys.append(torch.einsum("hpn,hn->hp", h, C[t].double()))
    return torch.stack(ys), h


def conv_decode(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + silu in float64: window `[C, Kc-1]`, x `[T, C]`, weight `[C, Kc]` -> (y `[T, C]`,
    window after the last token)."""
    full = torch.cat([window.double(), x.double().T], dim=1)  # [C, Kc-1+T]
    Kc = weight.shape[1]
    y = torch.stack([(full[:, t:t + Kc] * weight.double()).sum(1) for t in range(x.shape[0])])
    return torch.nn.functional.silu(y), full[:, x.shape[0]:]


class Mamba2Harness(Harness):
    """The state harness with Mamba2 inputs (g = dt A, dt > 0, A < 0 per head) and the float64 oracle above."""

    def __init__(self, cfg: StateConfig, **kw):
        super().__init__(cfg, **kw)
        self.A = -(0.2 + torch.rand(cfg.num_layers, cfg.num_heads, generator=self.gen, dtype=torch.float64))

    def inputs(self, B: int, T: int) -> dict[str, torch.Tensor]:
        inp = super().inputs(B, T)
        dt = 0.05 + torch.rand(inp["beta"].shape, generator=self.gen, dtype=torch.float64)
        inp["beta"] = dt.to(self.cfg.record_dtype)
        inp["g"] = (dt * self.A[:, None, None, :]).to(self.cfg.record_dtype)
        return inp

    def oracle(self, slot: int, b: int, inp: dict, path: list[int], *, advance: bool):
        out = []
        for layer in range(self.cfg.num_layers):
            sel = {n: t[layer, b, path] for n, t in inp.items()}
            y, win = conv_decode(self.conv[layer, slot], sel["x"], self.weights[layer])
            h0 = self.ssm[layer, slot].transpose(-1, -2)  # S [H, N, P] -> h [H, P, N]
            o, h = mamba2_decode(h0, sel["v"], sel["k"], sel["q"], sel["beta"], self.A[layer])
            if advance:
                self.conv[layer, slot] = win.to(self.conv.dtype)
                self.ssm[layer, slot] = h.transpose(-1, -2).to(self.ssm.dtype)
            out.append((y, o))
        return out


@st.composite
def configs(draw):
    D = draw(st.integers(1, 5))
    return StateConfig(
        num_layers=draw(st.integers(1, 2)), num_heads=draw(st.integers(1, 3)),
        head_k_dim=draw(st.sampled_from([3, 4, 8])), head_v_dim=draw(st.sampled_from([2, 5, 6])),
        conv_kernel=draw(st.integers(2, 4)), gate="gdn", rule="mamba2", max_requests=draw(st.integers(2, 4)),
        num_verify_tokens=D, ssm_dtype=torch.float64, act_dtype=torch.float64,
        track_interval=draw(st.sampled_from([None, 3, 7])))


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_strategies_equal_mamba2_recurrence(tree, data):
    """replay-eager == replay-lazy == snapshot == the float64 Mamba2 recurrence of the accepted tokens; verify
    outputs == its outputs; skipped, null and foreign slots bitwise unchanged."""
    cfg = data.draw(configs())
    h = Mamba2Harness(cfg, seed=data.draw(st.integers(0, 2 ** 16)))
    for _ in range(data.draw(st.integers(1, 4))):
        run_round(h, data.draw, slot_map(data.draw, cfg), tree=tree)


def test_long_run_lazy_folds_and_ring_wrap():
    """64 rounds (ring wrap, lazy folds on overflow and track boundaries) stay on the recurrence."""
    cfg = StateConfig(num_layers=2, num_heads=2, head_k_dim=4, head_v_dim=3, conv_kernel=4, gate="gdn",
                      rule="mamba2", max_requests=3, num_verify_tokens=4, ssm_dtype=torch.float64,
                      act_dtype=torch.float64, track_interval=16)
    h = Mamba2Harness(cfg, seed=1)
    gen = torch.Generator().manual_seed(2)

    def draw(strategy):
        s = strategy.wrapped_strategy
        return int(torch.randint(s.start, s.end + 1, (), generator=gen))

    for i in range(64):
        run_round(h, draw, [2, 0, cfg.null_slot, 1] if i % 2 else [1, 2], tree=False, check_outputs=i % 16 == 0)
    assert int(h.strats["replay-lazy"].pool.track_len.max()) >= 16 * 4


@pytest.mark.parametrize("name", ["replay-eager", "replay-lazy"])
def test_teeth_corrupt_one_x_record_fails(name):
    """One corrupted x record (ring rawv) makes the committed state differ from the recurrence."""
    cfg = StateConfig.tiny(gate="gdn", rule="mamba2", ssm_dtype=torch.float64, act_dtype=torch.float64,
                           track_interval=None)

    def corrupt(strat):
        row, pos = first_record(strat)
        strat.rings.rawv[0, row, 0, pos, 0] += 1e-3

    h = Mamba2Harness(cfg, seed=7, strategies=(name,))
    draws = iter([4, 3])
    with pytest.raises(AssertionError, match="rel err"):
        run_round(h, lambda _: next(draws), [1], tree=False, check_outputs=False, corrupt=corrupt)
        h.strats[name].flush()
        h.check_state(name, [1])


def test_fold_equals_single_steps_and_plain_decode_bitwise():
    """fp32: folding n records in one call == n calls of one record == plain decode (recurrent_delta_rule)."""
    gen = torch.Generator().manual_seed(3)
    Lyr, N, H, L, K, V, n = 2, 3, 2, 8, 4, 5, 6
    x = torch.randn(Lyr, N, H, L, V, generator=gen)
    Bm = torch.randn(Lyr, N, H, L, K, generator=gen)
    dt = torch.rand(Lyr, N, H, L, generator=gen) + 0.05
    g = (dt * -(0.3 + torch.rand(Lyr, 1, H, 1, generator=gen)))[..., None]
    S0 = torch.randn(Lyr, N, H, K, V, generator=gen)
    slots, start = torch.tensor([1]), torch.tensor([0, 5, 0])  # slot 1's records wrap around the ring

    def fold(state, num, begin):
        kernels.exact_fold(state, x, Bm, g, dt, slots, begin, torch.tensor([num]), rule="mamba2")

    once = S0.clone()
    fold(once, n, start)
    steps = S0.clone()
    for j in range(n):
        fold(steps, 1, (start + j) % L)
    assert torch.equal(once, steps)
    assert torch.equal(once[:, [0, 2]], S0[:, [0, 2]])  # other slots untouched
    pos = (5 + torch.arange(n)) % L
    for layer in range(Lyr):
        sel = lambda t: t[layer, 1][:, pos].transpose(0, 1)[None]  # noqa: E731  [H, n, *] -> [1, n, H, *]
        _, S = kernels.recurrent_delta_rule(sel(Bm), sel(Bm), sel(x), sel(g)[..., 0], sel(dt),
                                            initial_state=S0[layer, 1][None], rule="mamba2")
        assert torch.equal(S[0], once[layer, 1])


def test_chunked_prefill_equals_recurrence():
    """The chunked form (prefill) of the mamba2 rule == the float64 recurrence, chunk boundaries included."""
    gen = torch.Generator().manual_seed(4)
    Bt, T, H, K, V = 2, 13, 3, 4, 5
    x = torch.randn(Bt, T, H, V, generator=gen, dtype=torch.float64)
    Bm, C = (torch.randn(Bt, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    dt = torch.rand(Bt, T, H, generator=gen, dtype=torch.float64) + 0.05
    A = -(0.2 + torch.rand(H, generator=gen, dtype=torch.float64))
    S0 = torch.randn(Bt, H, K, V, generator=gen, dtype=torch.float64)
    o, S = kernels.chunk_delta_rule(C, Bm, x, dt * A, dt, initial_state=S0, chunk_size=4, rule="mamba2")
    for b in range(Bt):
        y, h = mamba2_decode(S0[b].transpose(-1, -2), x[b], Bm[b], C[b], dt[b], A)
        assert max_rel_err(o[b], y) < 1e-12
        assert max_rel_err(S[b], h.transpose(-1, -2)) < 1e-12


@pytest.mark.triton
def test_gpu_dispatch_runs_the_mamba2_kernels(monkeypatch, triton_device):
    """Where the Triton kernels run (CUDA tensors; forced on CPU), the mamba2 rule gets their mamba2 flag: the
    per-token reference's outputs within the fp32 tolerance (across backends, docs/EXACTNESS.md), never the delta rule's."""
    pytest.importorskip("triton")
    monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")  # CPU tensors (the interpreter) take the Triton kernels too
    cfg = StateConfig.tiny(gate="gdn", rule="mamba2", ssm_dtype=torch.float32, act_dtype=torch.float32)
    h = Mamba2Harness(cfg, seed=9, strategies=("replay-eager",), device=triton_device)
    inp = {n: t[0] for n, t in h.inputs(2, 4).items()}
    state = h.strats["replay-eager"].pool.ssm[0]
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], state.cpu(), torch.tensor([0, 1]))
    got = kernels.verify_delta_rule(*(t.to(triton_device) for t in args), rule="mamba2").cpu()
    want = verify_naive.verify_delta_rule(*args, rule="mamba2")  # the reference on CPU copies
    assert_close(got, want, dtype=torch.float32)
    assert not torch.allclose(got, verify_naive.verify_delta_rule(*args))  # the delta rule differs


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="rule"):
        StateConfig.tiny(rule="mamba1")
    with pytest.raises(ValueError, match="gate"):
        StateConfig.tiny(rule="mamba2", gate="kda")
    with pytest.raises(ValueError, match="rule"):
        kernels.exact_fold(torch.zeros(1, 1, 1, 2, 2), torch.zeros(1, 1, 1, 2, 2), torch.zeros(1, 1, 1, 2, 2),
                           torch.zeros(1, 1, 1, 2, 1), torch.zeros(1, 1, 1, 2), torch.tensor([0]), None,
                           torch.tensor([1]), rule="mamba3")


def test_memory_plan_prints_the_mamba2_buffers(capsys):
    """`specdec memory --rule mamba2` at Nemotron-H-8B-like shapes (128 heads of P = 64, N = 128, 8 groups):
    the state per head is [N, P], the rings hold x [P] and B [N], the conv runs over [x, B, C]."""
    import json

    from specdec.__main__ import main
    args = ["memory", "--rule", "mamba2", "--gate", "gdn", "--layers", "24", "--slots", "9", "--heads", "128",
            "--head-dim", "64", "--state-dim", "128", "--groups", "8", "--draft-tokens", "8"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Mamba2 heads (rule mamba2)" in text and "full snapshot" in text and "ReplaySSM" in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    shapes = plan["shapes"]
    assert shapes["ssm_state"] == [24, 9, 128, 128, 64]
    assert shapes["ring_rawv"] == [24, 9, 128, 8, 64] and shapes["ring_rawk"] == [24, 9, 128, 8, 128]
    assert shapes["conv_state"] == [24, 9, 128 * 64 + 2 * 8 * 128, 3]
    assert plan["config"]["rule"] == "mamba2"
    assert plan["spec_state_snapshot"] == 24 * 9 * 8 * (128 * 128 * 64 * 4 + (128 * 64 + 2 * 8 * 128) * 3 * 2)
    code = main(["memory", "--rule", "mamba2", "--layers", "2", "--slots", "3", "--heads", "4", "--gate", "gdn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--state-dim" in err[0]
