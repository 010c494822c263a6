"""The paged KV cache alone (no model), against plain Python oracles.

- `PageTable`: over random reservations and releases, a page is free if and only if no row holds it, no page is
  held twice, the device table is each row's held pages (the scratch page elsewhere), and a reservation the pool
  cannot give takes nothing.
- `KVCache`: random rounds (chains and trees, random acceptance, slots in any order, some slots idle) write K/V
  through the pages; after each commit every slot's committed keys and values, read through the table, are the
  ones a dense per-slot list of the accepted tokens holds, and idle slots' contents are bitwise unchanged. A teeth
  test points a slot's table at another slot's page and must fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.kernels.tree import VerifyTree
from specdec.kv_cache import KVCache, PageTable
from specdec.verify.record import Acceptance


def check_table(pt: PageTable) -> None:
    held = [p for row in pt.held for p in row]
    assert len(held) == len(set(held)), "a page is held twice"
    assert not set(held) & set(pt.free), "a held page is free"
    assert sorted(held + pt.free) == list(range(pt.num_pages)), "a page is neither free nor held"
    for r, row in enumerate(pt.held):
        want = row + [pt.num_pages] * (pt.table.shape[1] - len(row))
        assert pt.table[r].tolist() == want
        # `run`: the row's pages are one ascending run (a one-row round reads them as a slice of the pool)
        assert pt.run[r] == (row == list(range(row[0], row[0] + len(row))) if row else True)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 24), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 60)),
                                                  max_size=30))
def test_page_table_accounting(num_pages, ops):
    pt = PageTable(4, 8, num_pages, torch.device("cpu"), "kv.table")
    for take, row, tokens in ops:
        if take:
            before = ([list(r) for r in pt.held], list(pt.free), pt.table.clone())
            need = max(0, -(-tokens // 8) - len(pt.held[row]))
            if need > len(pt.free) or -(-tokens // 8) > 8:
                with pytest.raises((MemoryError, RuntimeError, IndexError)):
                    pt.ensure([row], [tokens], 8)
                if need > len(pt.free):  # refused before anything was taken
                    assert ([list(r) for r in pt.held], list(pt.free)) == before[:2]
                    assert torch.equal(pt.table, before[2])
                continue
            pt.ensure([row], [tokens], 8)
            assert len(pt.held[row]) * 8 >= tokens
        else:
            pt.release(row)
            assert pt.held[row] == []
        check_table(pt)


def _oracle_read(kv: KVCache, layer: int, slot: int, n: int) -> list[torch.Tensor]:
    return [t[0] for t in kv.read(layer, torch.tensor([slot]), n)]  # [h, n, d] each


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_rounds_through_pages_equal_a_dense_oracle(data):
    num_slots, h, d, page = 5, 2, 3, 4
    max_length = 40
    kv = KVCache(num_slots, max_length, page_size=page, num_pages=num_slots * 10)
    dense = {s: [] for s in range(num_slots - 1)}  # committed (k, v) per slot: [h, d] each
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16), label="seed"))
    for _ in range(data.draw(st.integers(1, 6), label="rounds")):
        slots = data.draw(st.lists(st.integers(0, num_slots - 2), min_size=1, max_size=num_slots - 1, unique=True),
                          label="slots")
        T = data.draw(st.integers(1, 5), label="T")
        if any(len(dense[s]) + T > max_length - 1 for s in slots):
            break
        tree = None
        if data.draw(st.booleans(), label="tree") and T > 1:
            parent = [-1] + [data.draw(st.integers(0, i - 1), label=f"parent{i}") for i in range(1, T)]
            tree = VerifyTree(torch.tensor([parent] * len(slots)))
        idle = {s: [t.clone() for t in _oracle_read(kv, 0, s, len(dense[s]))] for s in dense
                if s not in slots and dense[s]}
        kv.begin(torch.tensor(slots), T, tree, host_slots=slots)
        k = torch.randn(len(slots), h, T, d, generator=g, dtype=torch.float64)
        v = torch.randn(len(slots), h, T, d, generator=g, dtype=torch.float64)
        kv.update(k, v, 0)
        # accept a root-to-node path per row
        paths = []
        for b in range(len(slots)):
            node = data.draw(st.integers(0, T - 1), label=f"leaf{b}")
            path = []
            while node >= 0:
                path.append(node)
                node = (tree.parent[b, node].item() if tree is not None else node - 1)
            paths.append(path[::-1])
        M = T
        path_t = torch.tensor([p + [-1] * (M - len(p)) for p in paths])
        acc = Acceptance.kept(path_t, torch.tensor([len(p) for p in paths]))
        kv.commit(acc, host_counts=[len(p) for p in paths])
        for b, s in enumerate(slots):
            dense[s] += [(k[b, :, j], v[b, :, j]) for j in paths[b]]
        for s, n in ((s, len(dense[s])) for s in dense):
            if n == 0:
                continue
            got_k, got_v = _oracle_read(kv, 0, s, n)
            assert torch.equal(got_k, torch.stack([x[0] for x in dense[s]], 1)), f"slot {s} keys"
            assert torch.equal(got_v, torch.stack([x[1] for x in dense[s]], 1)), f"slot {s} values"
            if s in idle:
                assert all(torch.equal(a, b) for a, b in zip(_oracle_read(kv, 0, s, n), idle[s]))
        assert kv.lengths[:num_slots - 1].tolist() == [len(dense[s]) for s in range(num_slots - 1)]
    for s in dense:  # every page back to the pool
        kv.reset(s)
    check_table(kv.pages[False])
    assert kv.pages[False].num_free == kv.num_pages


def test_teeth_a_table_entry_pointing_at_another_slots_page_is_caught():
    kv = KVCache(3, 16, page_size=4, num_pages=8)
    for s, val in ((0, 1.0), (1, 2.0)):
        kv.begin(torch.tensor([s]), 4, host_slots=[s])
        x = torch.full((1, 1, 4, 2), val)
        kv.update(x, x, 0)
        kv.advance(torch.tensor([4]), host_counts=[4])
    assert bool((_oracle_read(kv, 0, 0, 4)[0] == 1.0).all())
    kv.pages[False].table[0, 0] = kv.pages[False].held[1][0]  # slot 0 reads slot 1's page
    assert not bool((_oracle_read(kv, 0, 0, 4)[0] == 1.0).all())
    with pytest.raises(AssertionError):
        check_table(kv.pages[False])


@pytest.mark.parametrize("order", ["fresh", "interleaved"])
def test_a_one_row_plain_step_reads_what_the_gather_reads(order):
    """One-token rounds of one slot: through a slice of the pool (its pages one run) or through the gather (pages
    interleaved with another slot's), with no mask where every key is visible: the keys and values each round
    returns equal a dense list of the tokens written."""
    kv = KVCache(3, 64, num_pages=12)
    kv.reserve([0], [40])
    if order == "interleaved":  # slot 1 takes pages between slot 0's
        kv.release(0)
        for s in (0, 1, 0, 1):
            kv.reserve([s], [16 * (1 + len(kv.pages[False].held[s]))])
    run = kv.pages[False].run[0]
    assert run == (order == "fresh")
    dense_k, dense_v = [], []
    g = torch.Generator().manual_seed(0)
    for t in range(33):
        kv.begin(torch.tensor([0]), 1, host_slots=[0])
        assert kv.attention_mask(torch.float32) is None  # one row, one token, its bound exact
        assert (kv._address(False)[3] is not None) == run
        k, v = torch.randn(1, 2, 1, 4, generator=g), torch.randn(1, 2, 1, 4, generator=g)
        dense_k.append(k[0, :, 0])
        dense_v.append(v[0, :, 0])
        keys, values = kv.update(k, v, 0)
        assert torch.equal(keys[0], torch.stack(dense_k, 1)) and torch.equal(values[0], torch.stack(dense_v, 1))
        kv.advance(torch.ones(1, dtype=torch.long), host_counts=[1])
    kv.begin(torch.tensor([0]), 2, host_slots=[0])  # two tokens: a mask again
    assert kv.attention_mask(torch.float32) is not None
    kv.abort()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_attention_mask_follows_the_visibility_rules(data):
    """`attention_mask` of a round (rows of different committed lengths, a chain or a tree, slots in any order)
    against the rule key by key: row b's token t sees key j iff j is one of its committed keys (j < length) or the
    round token j - length is t or an ancestor of t (the tree's parents, walked in Python); everything else, the
    other rows' longer spans included, is the dtype's minimum."""
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 6))
    kv = KVCache(4, 40)
    slots = data.draw(st.permutations(range(3)))[:B]
    lengths = [data.draw(st.integers(0, 20)) for _ in range(B)]
    for s, n in zip(slots, lengths):
        if n:
            kv.begin(torch.tensor([s]), n)
            kv.advance(torch.tensor([n]), host_counts=[n])
    if data.draw(st.booleans()):
        parents = [[-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, T)] for _ in range(B)]
        kv.begin(torch.tensor(slots), T, VerifyTree.check(torch.tensor(parents), B, T))
    else:
        parents = [[i - 1 for i in range(T)] for _ in range(B)]
        kv.begin(torch.tensor(slots), T)
    mask = kv.attention_mask(torch.float64)
    if mask is None:  # one row, one token, its bound exact: every key visible
        assert B == 1 and T == 1
        return
    S = max(lengths) + T
    assert mask.shape == (B, 1, T, S)
    low = torch.finfo(torch.float64).min
    for b in range(B):
        for t in range(T):
            seen, u = set(), t
            while u >= 0:
                seen.add(u)
                u = parents[b][u]
            want = [0.0 if j < lengths[b] or (j - lengths[b]) in seen else low for j in range(S)]
            assert mask[b, 0, t].tolist() == want, (b, t)
    kv.abort()
