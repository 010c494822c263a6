"""`kernels.tree.VerifyTree`: a round's tree is checked once, at the boundary, and what the kernels, the KV cache and
acceptance derive from it is made once per tree. Results are compared with pure-python walks of the tree;
`specdec.tensors.per_tensor` (the drafters' rotary tables) is checked against in-place writes and inference mode."""

from __future__ import annotations

import pytest
import torch
from tiny_models import assert_greedy, generate_f64, tiny_model

import specdec
import specdec.draft.base as draft_base
import specdec.kernels.tree as tree_mod
from specdec.kernels.tree import VerifyTree, ancestor_mask
from specdec.kernels.verify import chunk as verify_chunk
from specdec.kernels.verify import naive as verify_naive
from specdec.tensors import per_tensor


def py_ancestors(parent: list[int]) -> list[list[bool]]:
    t = len(parent)
    out = [[False] * t for _ in range(t)]
    for j in range(t):
        u = j
        while u >= 0:
            out[j][u] = True
            u = parent[u]
    return out


def test_derived_tensors_follow_the_tree_and_are_made_once():
    p = torch.tensor([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, -1, 3, 3]])
    tree = VerifyTree.check(p, 2, 6)
    for r in range(2):
        anc = py_ancestors(p[r].tolist())
        assert tree.ancestors()[r].tolist() == anc
        assert tree.depth()[r].tolist() == [sum(row) - 1 for row in anc]
    assert tree.ancestors() is tree.ancestors() and tree.schedule() is tree.schedule()  # once per tree
    p[0, 4] = 1  # the next round reuses the buffer: a new tree, derived again
    assert VerifyTree(p).ancestors()[0].tolist() == py_ancestors(p[0].tolist())
    sub = tree.rows(torch.tensor([1]))
    assert sub.ancestors()[0].tolist() == py_ancestors([-1, 0, 1, -1, 3, 3]) and tree.rows(torch.tensor([1])) is sub


@pytest.mark.parametrize("parent, match", [
    ([[-1, 0, 2, 1]], r"parent: not topological; .* got parent\[2\] = 2 in row 0"),
    ([[-1, 0, -2, 1]], r"parent: not topological"),
    ([[0, 0, 1, 1]], r"parent: node 0 is the root and must have parent -1"),
    ([[-1, 0, 1]], r"parent: expected an integer tensor \[T\] = \[4\] or \[B, T\] = \[1, 4\], got \[1, 3\]"),
    ([[-1.0, 0.0, 0.0, 1.0]], r"parent: expected an integer tensor"),
])
def test_check_errors(parent, match):
    with pytest.raises(ValueError, match=match):
        VerifyTree.check(torch.tensor(parent), 1, 4)


def test_a_checked_tree_passes_with_its_shape_checked_only(monkeypatch):
    tree = VerifyTree.check(torch.tensor([-1, 0, 0]), 2, 3)  # [T]: one tree for every row
    assert tree.parent.shape == (2, 3) and tree.parent.dtype == torch.long
    monkeypatch.setattr(tree_mod, "topology_errors", _refuse)
    assert VerifyTree.check(tree, 2, 3) is tree
    with pytest.raises(ValueError, match=r"parent: expected a tree of \[2, 4\] nodes"):
        VerifyTree.check(tree, 2, 4)


def _refuse(*a):
    raise AssertionError("the topology check ran")


def test_kernels_take_a_tree_as_checked(monkeypatch):
    """Given a `VerifyTree` (what a round passes to every layer) the verify and conv ops never check the topology
    (a host read on a GPU, once per layer) and return what the checked call returns; given a tensor they check."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, C, Kc = 2, 5, 2, 4, 6, 4
    parent = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 3]])
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    ssm, slots = torch.randn(3, H, K, K, generator=g, dtype=torch.float64), torch.tensor([2, 0])
    x, w = torch.randn(B, T, C, generator=g), torch.randn(C, Kc, generator=g)
    conv_state = torch.randn(3, C, Kc - 1, generator=g)
    ops = [lambda p: verify_chunk.verify_delta_rule(q, k, v, gate, beta, ssm, slots, parent=p),
           lambda p: verify_naive.verify_delta_rule(q, k, v, gate, beta, ssm, slots, parent=p),
           lambda p: verify_naive.short_conv_verify(x, w, None, conv_state, slots, parent=p)]
    checked = [op(parent) for op in ops]
    tree = VerifyTree.check(parent, B, T)
    monkeypatch.setattr(tree_mod, "topology_errors", _refuse)
    for op, want in zip(ops, checked):
        assert torch.equal(op(tree), want)
        with pytest.raises(AssertionError, match="topology check ran"):  # teeth: a tensor is checked
            op(parent)


def test_conv_columns_of_a_chain_shaped_tree_are_the_sliding_windows():
    T = 5
    chain = VerifyTree(torch.arange(-1, T - 1).expand(2, T).clone())
    for Kc in (2, 4, 3):
        conv_state, x = torch.randn(2, 3, Kc - 1), torch.randn(2, T, 3)
        want = torch.cat([conv_state.transpose(1, 2), x], 1).unfold(1, Kc, 1).transpose(-1, -2)
        assert torch.equal(verify_naive.conv_columns(conv_state, x, chain, Kc), want)
        assert torch.equal(verify_naive.conv_columns(conv_state, x, None, Kc), want)


def test_a_round_checks_its_tree_once(monkeypatch):
    """The engine's eagle rounds: the tree's topology is checked once per round (by `check_block`, with the block's
    other checks), never by the runner, the KV cache, the state strategy, the kernels or acceptance; the output is
    transformers' greedy decode's."""
    calls = []

    def counted(p):
        calls.append(p.shape)
        return real(p)
    real = tree_mod.topology_errors
    monkeypatch.setattr(tree_mod, "topology_errors", counted)
    monkeypatch.setattr(draft_base, "topology_errors", counted)
    model = tiny_model("kimi_linear")
    engine = specdec.wrap(model, drafter="eagle", untrained=True, num_draft_tokens=3, max_batch_size=2)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4, 5]]
    calls.clear()
    out = generate_f64(engine, prompts, max_new_tokens=10)
    assert out.stats.steps >= 2 and out.stats.drafter_failures == 0
    assert len(calls) == out.stats.steps  # one batched round, one check
    assert_greedy(out, model, prompts, 10)


def test_per_tensor_follows_in_place_writes_and_inference_tensors():
    mask = per_tensor(ancestor_mask)
    p = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    assert mask(p) is mask(p)  # the same tensor, unchanged: computed once
    p[0, 4] = 1  # written in place: its version moved
    assert mask(p)[0].tolist() == py_ancestors(p[0].tolist())
    q = p.clone()
    q[0, 5] = 4  # another object, never served p's result
    assert mask(q)[0].tolist() == py_ancestors(q[0].tolist())
    with torch.inference_mode():  # no version counter: remembered by value
        p = torch.tensor([[-1, 0, 0, 1, 2, 3]])
        first = mask(p)
        assert mask(p) is first
        p[0, 4] = 1
        assert mask(p)[0].tolist() == py_ancestors(p[0].tolist())
