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
