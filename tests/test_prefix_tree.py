"""The prefix cache's radix tree alone (no model): over random inserts, hits and evictions under tight budgets, the
bytes it counts are the bytes of the entries reachable from its root, every reachable entry is found by a lookup of
its own tokens, and the budget holds. A teeth test detaches an entry and the check must fail. Oracle: a walk of the
tree (`entries`) and a plain dict of what was inserted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.prefix_cache import Entry, PrefixCache


def _entry(n: int, nbytes: int) -> Entry:
    return Entry(n, torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(0), [], {})


def _key(node) -> tuple[int, ...]:
    out = ()
    while node.parent is not None:
        out, node = node.edge + out, node.parent
    return out


def check(cache: PrefixCache) -> None:
    """Bytes counted == bytes reachable; each reachable entry sits at its own tokens and is what a lookup of them
    finds; nothing over the budget."""
    reachable = cache.entries()
    assert cache.bytes == sum(e.nbytes for _, e in reachable), "bytes counted for entries no lookup can reach"
    assert cache.bytes <= cache.budget
    for node, e in reachable:
        key = _key(node)
        assert len(key) == e.length
        assert cache.match(key, len(key)) is e


def test_an_insert_that_evicts_its_own_branch_keeps_its_entry():
    """The eviction an insert makes may empty the branch its new node sits on; the entry must still be reachable."""
    cache = PrefixCache(budget=100)
    cache.insert([1, 2, 3], lambda: _entry(3, 60))
    cache.insert([1, 2, 4], lambda: _entry(3, 30))
    e = cache.insert([1, 2], lambda: _entry(2, 90))
    assert e is not None and cache.match([1, 2, 9], 2) is e
    assert [x for _, x in cache.entries()] == [e] and cache.bytes == 90
    check(cache)


def test_teeth_a_detached_entry_fails_the_check():
    cache = PrefixCache(budget=1000)
    cache.insert([1, 2, 3], lambda: _entry(3, 60))
    cache.insert([1, 2], lambda: _entry(2, 30))
    check(cache)
    node = cache.root.children[1]
    del cache.root.children[1]  # the entries below are still counted, but no lookup reaches them
    with pytest.raises(AssertionError, match="bytes counted"):
        check(cache)
    cache.root.children[1] = node
    check(cache)


ops = st.lists(st.tuples(st.sampled_from(["insert", "match", "pin-insert"]),
                         st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 120)),
               min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(budget=st.integers(1, 300), ops=ops)
def test_random_inserts_hits_and_evictions_keep_the_accounting(budget, ops):
    cache = PrefixCache(budget=budget)
    written: dict[tuple[int, ...], Entry] = {}
    for op, tokens, size in ops:
        key = tuple(tokens)
        if op == "match":
            got = cache.match(tokens, len(tokens))
            if got is not None:
                assert written.get(key[:got.length]) is got  # a hit is the entry written at that prefix
        else:
            pin = cache.match(tokens[:-1], len(tokens) - 1) if op == "pin-insert" and len(tokens) > 1 else None
            with cache.pinned([pin]):
                e = cache.insert(tokens, lambda: _entry(len(tokens), size))
                if pin is not None:
                    assert any(x is pin for _, x in cache.entries()), "a pinned entry was evicted"
            if e is None:  # only an entry over the budget, or one that would need the pinned one evicted
                assert size > budget or pin is not None
            else:
                written[key] = e
        check(cache)
        # an entry once evicted is gone from the oracle too: what is reachable was written at its key
        for node, x in cache.entries():
            assert written.get(_key(node)) is x


def _path_lengths(cache: PrefixCache, tokens) -> list[int]:
    """The lengths of the entries on the path of `tokens` (each prefix of it looked up without touching)."""
    return sorted({e.length for n in range(1, len(tokens) + 1)
                   for e in [cache.match(tokens[:n], n, touch=False)] if e is not None})


def test_states_per_path_thins_a_long_history_evenly():
    """A 64-token chain with an entry every 2 tokens and a cap of 8: the path keeps 8 entries spread over the whole
    history (no gap more than twice the even spacing), the newest among them, not just the last 8; the bytes are
    the 8 entries'."""
    cache = PrefixCache(budget=10**6, per_path=8)
    chain = list(range(100, 164))
    for n in range(2, 65, 2):
        cache.insert(chain[:n], lambda n=n: _entry(n, 10))
        assert len(_path_lengths(cache, chain)) <= 8
    kept = _path_lengths(cache, chain)
    assert kept[-1] == 64 and len(kept) == 8 and cache.stats["thinned"] == 32 - 8
    gaps = [b - a for a, b in zip([0] + kept, kept)]
    assert max(gaps) <= 2 * 64 // 8, kept
    assert cache.bytes == 80
    check(cache)


def test_states_per_path_keeps_forks_and_pinned_entries():
    """An entry where two paths part and a pinned one are never thinned; the cap is soft when only they are left."""
    cache = PrefixCache(budget=10**6, per_path=2)
    a = cache.insert([1, 2], lambda: _entry(2, 10))
    cache.insert([1, 2, 3, 4], lambda: _entry(4, 10))
    cache.insert([1, 2, 9, 9], lambda: _entry(4, 10))  # [1, 2] is a fork now
    b = cache.insert([1, 2, 3, 4, 5, 6], lambda: _entry(6, 10))
    with cache.pinned([b]):
        c = cache.insert([1, 2, 3, 4, 5, 6, 7, 8], lambda: _entry(8, 10))
    held = {id(e) for _, e in cache.entries()}
    assert {id(a), id(b), id(c)} <= held  # fork, pinned, newest: 3 on the path, over the cap of 2
    assert _path_lengths(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == [2, 6, 8]
    check(cache)


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(2, 5), ops=ops)
def test_random_inserts_under_a_path_cap_keep_the_accounting(cap, ops):
    """Any inserts under a cap: the accounting holds, the newest entry is kept, and a path over the cap holds only
    entries the cap spares (forks, and the newest of the last insert on it)."""
    cache = PrefixCache(budget=10**6, per_path=cap)
    for op, tokens, size in ops:
        if op == "match":
            cache.match(tokens, len(tokens))
            continue
        e = cache.insert(tokens, lambda t=tokens, s=size: _entry(len(t), s))
        assert e is not None and cache.match(tokens, len(tokens), touch=False) is e
        check(cache)
    for node, e in cache.entries():
        on_path, n = [], node
        while n is not cache.root:
            if n.entry is not None:
                on_path.append(n)
            n = n.parent
        spared = [p for p in on_path[1:] if len(p.children) >= 2]  # forks above the path's end
        assert len(on_path) <= max(cap, len(spared) + 1 + 1), (cap, [p.entry.length for p in on_path])
