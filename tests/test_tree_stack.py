"""Tree verify with a stack of parent states (`common.tree_schedule`, `tree_stack_slots`).

1. The schedule, against a walk that simulates it (hypothesis, random trees of 1..70 nodes with several roots,
   chains, stars and complete binary trees): every node runs once, after its parent; the state a step starts
   from is exactly its parent's (registers, a stack slot nobody overwrote, or the checkpoint for a root); the
   stack never holds more than `tree_stack_slots(T)` states, and complete binary trees need all of them.
2. The Triton tree verify with `tree_stack` (sized `tree_stack_slots(T)`, NaN-filled) gives the outputs and
   ring records of the same kernel reloading from every node's state (`intermediate_states`), bit for bit, and
   of the torch reference within fp32 tolerance; eager and lazy (pending records) rings, null and -1 slots.
3. A stack one slot too small is refused, naming the argument.
"""

from __future__ import annotations

import pytest
import torch
from assertions import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
import test_triton_kernels as ttk
from test_triton_kernels import NULL, SLOTS, check_values, nan, to, verify_case

from specdec.kernels.tree import tree_schedule, tree_stack_slots
from specdec.kernels.verify import triton as tverify
from specdec.kernels.verify.naive import verify_delta_rule as ref_verify_delta_rule


@pytest.fixture
def device(triton_device):
    """The device the kernels run on (conftest's `triton_device`); the torch references run on CPU copies."""
    return triton_device


def simulate(parents: list[list[int]]) -> int:
    """Run `tree_schedule` as the kernel does, tracking which state each register / slot holds; -> the number
    of slots used (asserting every start state is the node's parent's)."""
    order, load, store = (x.tolist() for x in tree_schedule(torch.tensor(parents)))
    used = 0
    for par, o, ld, sto in zip(parents, order, load, store):
        assert sorted(o) == list(range(len(par))), "every node runs once"
        seen, stack, reg = set(), {}, "root"
        for i, node in enumerate(o):
            p = par[node]
            assert p < 0 or p in seen, f"node {node} runs before its parent {p}"
            start = {-2: reg, -1: "root"}.get(ld[i], stack.get(ld[i]))
            assert start == ("root" if p < 0 else p), f"step {i} (node {node}) starts from {start}, parent {p}"
            reg = node
            seen.add(node)
            if sto[i] >= 0:
                stack[sto[i]] = node
                used = max(used, sto[i] + 1)
    return used


@st.composite
def trees(draw, max_nodes=70):
    T = draw(st.integers(1, max_nodes))
    shape = draw(st.sampled_from(["random", "roots", "chain", "star", "binary"]))
    par = [-1]
    for t in range(1, T):
        if shape == "random":
            par.append(draw(st.integers(0, t - 1)))
        elif shape == "roots":
            par.append(draw(st.integers(-1, t - 1)))
        else:
            par.append({"chain": t - 1, "star": 0, "binary": (t - 1) // 2}[shape])
    return par


@settings(max_examples=300, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=3))
def test_schedule_walks_every_tree_with_a_bounded_stack(batch):
    T = max(map(len, batch))
    # rows of one batch share T: shorter trees get extra roots (each restarts from the checkpoint)
    parents = [p + [-1] * (T - len(p)) for p in batch]
    assert simulate(parents) <= tree_stack_slots(T)


@pytest.mark.parametrize("T", [3, 7, 8, 15, 49, 64, 127])
def test_complete_binary_trees_need_every_slot(T):
    par = [-1] + [(t - 1) // 2 for t in range(1, T)]
    assert simulate([par]) == tree_stack_slots(T)
    assert tree_stack_slots(T) == max(len(bin(T + 1)) - 4, 1)  # floor(log2(T + 1)) - 1


# besides test_triton_kernels' 5 rows of 5 nodes: 5 rows of 12 nodes (nested branching, two roots, a chain, a star)
WIDE = [[-1, 0, 0, 1, 1, 0, 2, 6, 6, 3, 3, 4], [-1, 0, 1, 0, 3, 3, 4, 5, 5, 0, 9, 9],
        [-1, -1, 0, 1, 2, 2, 1, 6, 6, 6, 0, 10], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
        [-1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]


@pytest.mark.triton
@pytest.mark.parametrize("case", ["eager-kda", "lazy-gdn", "wide-lazy-kda"])
def test_stack_equals_node_states_bitwise(device, case, monkeypatch):
    lazy, gdn = "lazy" in case, "gdn" in case
    if case.startswith("wide"):  # the same case builder, at 12 nodes
        monkeypatch.setattr(ttk, "T", len(WIDE[0]))
        monkeypatch.setattr(ttk, "TREE", WIDE)
        monkeypatch.setattr(ttk, "L", 16)  # pending (<= 3) + 12 nodes fit
    kw = verify_case(11, K=5, V=6, gdn=gdn, tree=True, lazy=lazy, inter=True, ring=True)
    T = kw["parent"].shape[1]
    by_nodes = {n: to(t, device) for n, t in kw.items()}
    o_nodes = tverify.verify_delta_rule(**by_nodes)
    with_stack = {n: to(t, device) for n, t in kw.items() if n != "intermediate_states"}
    H, K, V = kw["intermediate_states"].shape[2:]
    stack = nan(len(SLOTS), tree_stack_slots(T), H, K, V).to(device)
    o_stack = tverify.verify_delta_rule(**with_stack, tree_stack=stack)
    assert_close(o_stack.cpu(), o_nodes.cpu(), exact=True, msg="outputs")
    for name, a, b in zip(("d", "k", "g", "rawv", "rawk", "beta"), with_stack["ring"], by_nodes["ring"]):
        assert_close(a.cpu(), b.cpu(), exact=True, msg=f"ring {name}")
    assert_close(with_stack["ssm_state"].cpu(), kw["ssm_state"], exact=True, msg="checkpoint written")
    for b, s in enumerate(SLOTS):  # skipped rows: zero outputs, their stack rows never touched
        if s in (-1, NULL):
            assert bool((o_stack[b] == 0).all()) and bool(stack[b].isnan().all())
    o_ref = ref_verify_delta_rule(**{n: to(t, "cpu") for n, t in kw.items()})
    check_values("outputs vs reference", o_stack, o_ref)


@pytest.mark.triton
def test_stack_too_small_is_refused(device):
    kw = verify_case(12, K=4, V=4, gdn=False, tree=True, lazy=False, inter=False, ring=True)
    kt = {n: to(t, device) for n, t in kw.items()}
    T = kw["parent"].shape[1]
    small = torch.zeros(len(SLOTS), tree_stack_slots(T) - 1, 3, 4, 4, device=device)
    with pytest.raises(ValueError, match="tree_stack"):
        tverify.verify_delta_rule(**kt, tree_stack=small)
    with pytest.raises(ValueError, match="tree_stack"):
        tverify.verify_delta_rule(**kt)
