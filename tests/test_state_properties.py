"""State invariants of the strategies against plain sequential decode (hypothesis)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from assertions import assert_close, max_rel_err, root_path
from hypothesis import given, settings
from hypothesis import strategies as st
from state_harness import Harness, check_verify_value, first_record, rel_tol

from specdec.kernels.tree import tree_stack_slots
from specdec.replayssm import StateConfig


def random_tree(draw, T: int) -> list[int]:
    return [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)]


def run_round(h: Harness, draw, slots: list[int], *, tree: bool, check_outputs: bool = True,
              corrupt=None) -> None:
    """One verify + commit in every strategy, checked against the oracle; the oracle then advances."""
    cfg = h.cfg
    B = len(slots)
    T = draw(st.integers(1, cfg.num_verify_tokens))
    parent = random_tree(draw, T) if tree else None
    inp = h.inputs(B, T)
    valid = [b for b, s in enumerate(slots) if s not in (-1, cfg.null_slot)]
    if tree:
        paths = {b: root_path(parent, draw(st.integers(0, T - 1))) for b in valid}
    else:
        paths = {b: list(range(draw(st.integers(1, T)))) for b in valid}
    untouched = [s for s in range(cfg.num_slots) if s not in slots or s == cfg.null_slot]
    before = {n: (s.pool.conv.clone(), s.committed_ssm().clone()) for n, s in h.strats.items()}

    outs = {n: h.verify(n, slots, inp, parent=parent, corrupt=corrupt) for n in h.strats}
    for name in h.strats:
        h.commit(name, paths, B, tree)

    if check_outputs:
        for b in valid:
            s = slots[b]
            nodes = range(T) if not tree else range(T)
            for node in nodes:
                ref = h.oracle(s, b, inp, root_path(parent, node) if tree else list(range(node + 1)), advance=False)
                for name, (ys, os) in outs.items():
                    for layer, (y_ref, o_ref) in enumerate(ref):
                        if cfg.act_dtype in (torch.float32, torch.float64):  # batched sums: last-bit differences
                            assert max_rel_err(ys[layer][b, node], y_ref[-1]) <= rel_tol(cfg.act_dtype), (name, "y")
                        else:
                            assert_close(ys[layer][b, node], y_ref[-1], dtype=cfg.act_dtype, msg=f"{name} y")
                        got, want = os[layer][b, node], o_ref[-1]
                        if cfg.act_dtype in (torch.float32, torch.float64) and name != "replay-lazy":
                            check_verify_value(got, want, cfg.ssm_dtype, f"{name} layer {layer} node {node}")
                        else:  # fast rebuild from d records (lazy) / low-precision outputs
                            assert_close(got, want, dtype=cfg.act_dtype, msg=f"{name} layer {layer} node {node}")
        for name, (ys, os) in outs.items():
            for b, s in enumerate(slots):
                if b not in valid:
                    assert all(bool((o[b] == 0).all()) for o in os), f"{name}: skipped row {b} got output"
    for b in valid:
        h.oracle(slots[b], b, inp, paths[b], advance=True)
    for name, strat in h.strats.items():
        h.check_state(name, [slots[b] for b in valid])
        conv0, ssm0 = before[name]
        ssm1 = strat.committed_ssm()
        for s in untouched:
            assert torch.equal(strat.pool.conv[:, s], conv0[:, s]), f"{name}: conv of untouched slot {s} changed"
            assert torch.equal(ssm1[:, s], ssm0[:, s]), f"{name}: ssm of untouched slot {s} changed"


@st.composite
def configs(draw, dtype=torch.float64):
    D = draw(st.integers(1, 5))
    L = draw(st.sampled_from([None, 2 * (1 << (2 * D - 1).bit_length())]))
    return StateConfig(
        num_layers=draw(st.integers(1, 2)), num_heads=draw(st.integers(1, 3)),
        head_k_dim=draw(st.sampled_from([3, 4, 5, 8])), head_v_dim=draw(st.sampled_from([2, 3, 6, 7])),
        conv_kernel=draw(st.integers(2, 4)), max_requests=draw(st.integers(2, 4)), num_verify_tokens=D,
        ring_len=L, ssm_dtype=dtype, act_dtype=dtype, **draw(gates()),
        track_interval=draw(st.sampled_from([None, 3, 7])), norm=draw(st.sampled_from(["rsqrt", "sqrt_div"])))


def gates():
    """KDA with log-decay records, KDA with the gate computed from its input records (Kimi), or GDN."""
    return st.sampled_from([dict(gate="kda"), dict(gate="kda", gate_in_kernel=True), dict(gate="gdn")])


def slot_map(draw, cfg: StateConfig) -> list[int]:
    """A random order of some allocated slots (reversed included) with null rows mixed in."""
    real = draw(st.permutations(list(range(cfg.max_requests))))
    real = real[:draw(st.integers(1, len(real)))]
    if draw(st.booleans()):
        real = sorted(real, reverse=True)
    rows = list(real)
    for _ in range(draw(st.integers(0, cfg.max_requests + 1 - len(rows)))):
        rows.insert(draw(st.integers(0, len(rows))), draw(st.sampled_from([-1, cfg.null_slot])))
    return rows


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@settings(max_examples=40)
@given(data=st.data())
def test_strategies_equal_sequential_decode(dtype, tree, data):
    """replay-eager == replay-lazy == snapshot == plain decode of the accepted tokens, round after round;
    verify outputs == plain decode outputs; skipped, null and foreign slots bitwise unchanged."""
    cfg = data.draw(configs(dtype))
    h = Harness(cfg, seed=data.draw(st.integers(0, 2 ** 16)))
    for _ in range(data.draw(st.integers(1, 4))):
        run_round(h, data.draw, slot_map(data.draw, cfg), tree=tree)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_256_chained_rounds(dtype):
    """Long runs (ring wrap, lazy folds on overflow and track boundaries) stay on plain decode."""
    cfg = StateConfig(num_layers=2, num_heads=2, head_k_dim=5, head_v_dim=3, conv_kernel=4, max_requests=3,
                      num_verify_tokens=4, ssm_dtype=dtype, act_dtype=dtype, track_interval=16)
    h = Harness(cfg, seed=1)
    gen = torch.Generator().manual_seed(2)

    def draw(strategy):  # deterministic stand-in for hypothesis' draw: uniform over the integer range
        lo, hi = strategy.wrapped_strategy.start, strategy.wrapped_strategy.end
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    for i in range(256):
        run_round(h, draw, [2, 0, cfg.null_slot, 1] if i % 2 else [1, 2], tree=False, check_outputs=i % 32 == 0)
    snap = h.strats["snapshot"].pool
    for name in ("replay-eager", "replay-lazy"):
        pool = h.strats[name].pool
        assert torch.equal(pool.track_len, snap.track_len)
        assert torch.equal(pool.track_conv, snap.track_conv)
        check_verify_value(pool.track_ssm, snap.track_ssm, dtype, f"{name}: track states")  # snapshot: node states
    assert int(snap.track_len.max()) >= 16 * 20  # boundaries were crossed many times


@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["g-records", "gate-input-records"])
def test_bf16_ring_storage_matches_decode_of_same_bf16_activations(gate_in_kernel):
    """bf16 activations and rings, fp32 checkpoint: committed state == plain decode fed the same bf16 inputs
    (with `gate_in_kernel` the g ring holds the bf16 gate input itself: nothing is rounded on the way)."""
    cfg = StateConfig(num_layers=2, num_heads=2, head_k_dim=6, head_v_dim=5, max_requests=3, num_verify_tokens=4,
                      ssm_dtype=torch.float32, act_dtype=torch.bfloat16, track_interval=None,
                      gate_in_kernel=gate_in_kernel)
    h = Harness(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)

    def draw(strategy):
        s = getattr(strategy, "wrapped_strategy", strategy)
        return int(torch.randint(s.start, s.end + 1, (), generator=gen))

    for i in range(24):
        run_round(h, draw, [0, 2, 1], tree=False, check_outputs=i % 8 == 0)


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.triton), "reference"])
def test_tree_state_stack_only_for_the_triton_kernel(backend, monkeypatch, request):
    """The Triton tree kernel reloads parent states from one layer's stack (log2 of the node count), allocated
    once and reused; the CPU's chunk form needs none (commit folds the records), so none is allocated there."""
    device = "cpu"
    if backend == "triton":
        monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")  # CPU tensors (the interpreter) take the Triton kernels too
        device = request.getfixturevalue("triton_device")
    cfg = StateConfig.tiny(num_layers=3, ssm_dtype=torch.float32, act_dtype=torch.float32)
    h = Harness(cfg, seed=5, strategies=("replay-eager",), device=device)
    strat = h.strats["replay-eager"]
    ptrs = set()
    for _ in range(3):
        inp = h.inputs(2, 4)
        strat.begin([0, 1], parent=[-1, 0, 0, 1])
        for layer in range(cfg.num_layers):
            strat.conv(layer, h.on_device(inp["x"][layer]), h.on_device(h.weights[layer]))
            strat.mix(layer, *(h.on_device(inp[n][layer]) for n in ("q", "k", "v", "g", "beta")))
            ptrs.add(None if strat.tree_stack is None else strat.tree_stack.data_ptr())
        strat.commit(path=[[0, 1, 3], [0, 2, -1]])
    if backend == "reference":
        assert ptrs == {None}
        return
    assert len(ptrs) == 1 and None not in ptrs
    # one layer's size: [rows, T, H, K, V], not [layers, ...]
    assert strat.tree_stack.shape == (cfg.max_running + 1, tree_stack_slots(cfg.num_verify_tokens), cfg.num_heads,
                                      cfg.head_k_dim, cfg.head_v_dim)


def one_token_pair(cfg: StateConfig, seed: int) -> tuple[Harness, Harness]:
    """Two replay-eager harnesses on the same inputs: one commits one-token rounds by copy (the default on the
    reference backend), the other folds their record as every longer round does."""
    copy, fold = Harness(cfg, seed=seed, strategies=("replay-eager",)), Harness(cfg, seed=seed,
                                                                               strategies=("replay-eager",))
    fold.strats["replay-eager"]._one_token = lambda num_tokens: False
    return copy, fold


def committed(strat) -> list[torch.Tensor]:
    p = strat.pool
    return [t for t in (p.ssm, p.conv, p.seq_len, p.track_ssm, p.track_conv, p.track_len) if t is not None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@settings(max_examples=30)
@given(data=st.data())
def test_one_token_round_commits_the_folds_bits(dtype, data):
    """A one-token round (plain decode) of replay-eager on the reference backend keeps the verify's state and conv
    window and commits them by copy, no record: the verify's step is the fold's, so everything committed (states,
    windows, lengths, track states) equals bit for bit what folding the round's record commits, round after round,
    one-token rounds mixed with longer ones, in random slot orders with null rows; the verify's outputs too. Both
    rules (delta, mamba2)."""
    cfg = data.draw(configs(torch.float64))
    mamba2 = dict(rule="mamba2", gate="gdn", gate_in_kernel=False) if data.draw(st.booleans()) else {}
    cfg = dataclasses.replace(cfg, ssm_dtype=torch.float32 if dtype == torch.bfloat16 else dtype, act_dtype=dtype,
                              track_interval=data.draw(st.sampled_from([None, 1, 2])), **mamba2)
    copy, fold = one_token_pair(cfg, data.draw(st.integers(0, 2 ** 16)))
    for _ in range(data.draw(st.integers(1, 6))):
        slots = slot_map(data.draw, cfg)
        T = data.draw(st.sampled_from([1, 1, cfg.num_verify_tokens]))
        inp = copy.inputs(len(slots), T)
        n = torch.tensor([0 if s in (-1, cfg.null_slot) else data.draw(st.integers(1, T)) for s in slots])
        outs = [h.verify("replay-eager", slots, inp) for h in (copy, fold)]
        for a, b in zip(*outs):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "verify outputs differ"
        for h in (copy, fold):
            h.strats["replay-eager"].commit(n)
        for a, b in zip(committed(copy.strats["replay-eager"]), committed(fold.strats["replay-eager"])):
            assert torch.equal(a, b), f"T={T}: committed state differs"
    assert copy.strats["replay-eager"].step_states is not None or cfg.num_verify_tokens > 1


def test_one_token_copy_has_teeth():
    """The copy path is what commits: a corrupted kept state of a one-token round shows in the committed state
    (and against plain decode), while the fold path never reads it."""
    cfg = StateConfig.tiny(ssm_dtype=torch.float64, act_dtype=torch.float64, track_interval=None)
    copy, fold = one_token_pair(cfg, 9)
    inp = copy.inputs(1, 1)
    for h in (copy, fold):
        strat = h.strats["replay-eager"]
        h.verify("replay-eager", [1], inp)
        if strat.step_states is not None:
            strat.step_states[0, 0, 0, 0, 0, 0] += 1e-3
        strat.commit(torch.tensor([1]))
    assert copy.strats["replay-eager"].step_states is not None and fold.strats["replay-eager"].step_states is None
    copy.oracle(1, 0, inp, [0], advance=True)
    with pytest.raises(AssertionError, match="rel err"):
        copy.check_state("replay-eager", [1])
    fold.oracle(1, 0, inp, [0], advance=True)
    fold.check_state("replay-eager", [1])


@pytest.mark.parametrize("record", ["rawk", "g"])
@pytest.mark.parametrize("name", ["replay-eager", "replay-lazy"])
def test_teeth_corrupt_one_record_fails(name, record):
    """The comparison has teeth: one corrupted rawk record, or gate-input record (`gate_in_kernel`), makes the
    committed state differ."""
    cfg = StateConfig.tiny(ssm_dtype=torch.float64, act_dtype=torch.float64, track_interval=None,
                           gate_in_kernel=record == "g")

    def corrupt(strat):  # the first record of this round: slot 1's ring (lazy) or running row 0 (eager)
        row, pos = first_record(strat)
        getattr(strat.rings, record)[0, row, 0, pos, 0] += 1e-3

    h = Harness(cfg, seed=7, strategies=(name,))
    draws = iter([4, 3])  # T = 4 tokens, accept 3

    with pytest.raises(AssertionError, match="rel err"):
        run_round(h, lambda _: next(draws), [1], tree=False, check_outputs=False, corrupt=corrupt)
        h.strats[name].flush()
        h.check_state(name, [1])
