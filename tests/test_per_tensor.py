"""`kernels.common.per_tensor`: what a forward derives from `parent` once (the ancestor mask, the conv rows, the
topology check) is recomputed whenever the tensor is another object or was written in place. Each result is
checked against a pure-python walk of the tree as it is at the time of the call."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels.common import ancestor_mask
from specdec.kernels.verify import naive as verify_naive


def py_ancestors(parent: list[int]) -> list[list[bool]]:
    t = len(parent)
    out = [[False] * t for _ in range(t)]
    for j in range(t):
        u = j
        while u >= 0:
            out[j][u] = True
            u = parent[u]
    return out


def test_mask_follows_in_place_writes():
    p = torch.tensor([[-1, 0, 0, 1, 2, 3]])
    assert ancestor_mask(p)[0].tolist() == py_ancestors(p[0].tolist())
    assert ancestor_mask(p) is ancestor_mask(p)  # the same forward: computed once
    p[0, 4] = 1  # the next round reuses the buffer with another tree
    assert ancestor_mask(p)[0].tolist() == py_ancestors(p[0].tolist())
    p[:, 3:].copy_(torch.tensor([[0, 0, 2]]))
    assert ancestor_mask(p)[0].tolist() == py_ancestors(p[0].tolist())
    q = p.clone()
    q[0, 5] = 4  # another object, never served p's mask
    assert ancestor_mask(q)[0].tolist() == py_ancestors(q[0].tolist())
    assert ancestor_mask(p)[0].tolist() == py_ancestors(p[0].tolist())


def test_inference_tensors_are_remembered_by_value():
    """Under inference mode (as `generate` runs) a tensor has no version counter: the mask is kept while the
    same tensor holds the values it was derived from, and follows in-place writes and other trees."""
    with torch.inference_mode():
        p = torch.tensor([[-1, 0, 0, 1, 2, 3]])
        first = ancestor_mask(p)
        assert first[0].tolist() == py_ancestors(p[0].tolist())
        assert ancestor_mask(p) is first  # the same forward: computed once
        other = ancestor_mask(p.clone())  # another object (the next round's tree): derived again
        assert other is not first and torch.equal(other, first)
        p[0, 4] = 1  # written in place: no version bump on an inference tensor, the values differ
        assert ancestor_mask(p)[0].tolist() == py_ancestors(p[0].tolist())
        assert ancestor_mask(p[:, :5])[0].tolist() == py_ancestors(p[0, :5].tolist())  # another shape
        wide = p.to(torch.int32)  # another dtype: the check runs on it, and it is not served the long tree's mask
        assert ancestor_mask(wide)[0].tolist() == py_ancestors(p[0].tolist())
    with torch.inference_mode():
        q = torch.tensor([-1, 0, 1, 1])
        verify_naive._parents(q, 2, 4, q.device)
        q[2] = 3  # no longer topological: the check must run again
        with pytest.raises(ValueError, match="parent"):
            verify_naive._parents(q, 2, 4, q.device)


def test_check_follows_in_place_writes():
    p = torch.tensor([-1, 0, 1, 1])
    verify_naive._parents(p, 2, 4, p.device)
    p[2] = 3  # no longer topological: the check must run again
    with pytest.raises(ValueError, match="parent"):
        verify_naive._parents(p, 2, 4, p.device)


def test_conv_rows_follow_the_arguments():
    """Same tree, another window length or batch: other rows; checked against the chain's sliding windows."""
    T = 5
    chain = torch.arange(-1, T - 1).expand(2, T).clone()
    for Kc in (2, 4, 3):
        conv_state, x = torch.randn(2, 3, Kc - 1), torch.randn(2, T, 3)
        full = torch.cat([conv_state.transpose(1, 2), x], 1)
        want = full.unfold(1, Kc, 1).transpose(-1, -2)  # token t reads rows t .. t+Kc-1
        assert torch.equal(verify_naive.conv_columns(conv_state, x, chain, Kc), want)
    one = chain[:1]
    conv_state, x = torch.randn(1, 3, 2), torch.randn(1, T, 3)
    want = torch.cat([conv_state.transpose(1, 2), x], 1).unfold(1, 3, 1).transpose(-1, -2)
    assert torch.equal(verify_naive.conv_columns(conv_state, x, one, 3), want)


@pytest.mark.triton
def test_validate_false_skips_the_check(monkeypatch, triton_device):
    """`validate=False` (a caller that checked the tree at its own boundary, as the state strategies do): the
    verify and conv ops never run the topology check (a host read on a GPU, once per layer) and return what the
    checked call returns."""
    from specdec.kernels.verify import chunk as verify_chunk
    from specdec.kernels.verify import triton as verify_triton
    g = torch.Generator().manual_seed(0)
    B, T, H, K, C, Kc = 2, 5, 2, 4, 6, 4
    parent = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 3]])
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    gate = -torch.rand(B, T, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    ssm, slots = torch.randn(3, H, K, K, generator=g, dtype=torch.float64), torch.tensor([2, 0])
    x, w = torch.randn(B, T, C, generator=g), torch.randn(C, Kc, generator=g)
    conv_state = torch.randn(3, C, Kc - 1, generator=g)
    ops = [lambda **kw: verify_chunk.verify_delta_rule(q, k, v, gate, beta, ssm, slots, parent=parent, **kw),
           lambda **kw: verify_naive.verify_delta_rule(q, k, v, gate, beta, ssm, slots, parent=parent, **kw),
           lambda **kw: verify_naive.short_conv_verify(x, w, None, conv_state, slots, parent=parent, **kw)]
    checked = [op() for op in ops]

    def refuse(*a):
        raise AssertionError("the topology check ran")
    monkeypatch.setattr(verify_naive, "is_topological", refuse)
    monkeypatch.setattr(verify_triton, "is_topological", refuse)
    for op, want in zip(ops, checked):
        assert torch.equal(op(validate=False), want)
        with pytest.raises(AssertionError, match="topology check ran"):  # teeth: the default does check
            op()
    pd = parent.to(triton_device)  # the Triton side's parents live where its kernels run
    assert verify_triton._parents(pd, B, T, pd.device, validate=False).tolist() == parent.tolist()
    with pytest.raises(AssertionError, match="topology check ran"):
        verify_triton._parents(pd, B, T, pd.device)
