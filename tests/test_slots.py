"""The slot owner (`specdec.slots.Slots`): prefix-cache entries hold the features a drafter observes as shared KV
pages, never copies; a snapshot at a boundary the slot does not hold is refused before anything is taken."""

from __future__ import annotations

import pytest
import torch

from tiny_models import float64_everywhere, generate_f64, torch_fallbacks
from test_prefix_cache import check_page_holders, engine

from specdec.kv_cache import feature_key, num_pages_for


def _state_bytes(pool) -> int:
    return pool.conv[:, 0].numel() * pool.conv.element_size() + pool.ssm[:, 0].numel() * pool.ssm.element_size()


def test_entries_share_the_observed_features_as_pages():
    """eagle observes the target's hidden state and three layers' outputs. A 150-token exchange in a cache with
    entries every 16 tokens: every entry owns its recurrent state and less than one page of copied tokens (KV and
    features, computed from the stored shapes), whatever its length; its features are the pages'. Evicting every
    entry frees every page."""
    eng = engine("qwen3_next", "eagle", ("replay", "eager"), prefix_cache=True, track_interval=16)
    prompt = [5 + (7 * i) % 80 for i in range(130)]
    generate_f64(eng, [prompt], max_new_tokens=20)
    keys = {feature_key("hidden"), *(feature_key(i) for i in eng.drafter.feature_layers)}
    kv = eng.runner.kv
    assert keys <= set(kv.store), "the observed features are paged"
    token = sum(buf[0, 0].numel() * buf.element_size() for bufs in kv.store.values() for buf in bufs)
    state = _state_bytes(eng.runner.state.pool)
    entries = [e for _, e in eng.prefix_cache.entries()]
    assert len(entries) >= 130 // 16 and max(e.length for e in entries) >= 140
    for e in entries:
        tail = e.length % kv.page_size
        assert e.nbytes == state + tail * token, (e.length, e.nbytes)
        assert len(e.pages) == e.length // kv.page_size
    assert eng.prefix_cache.bytes == sum(e.nbytes for e in entries)
    check_page_holders(eng)
    while eng.prefix_cache.evict_one():
        pass
    table = kv.pages[False]
    assert table.num_free == table.num_pages


def test_a_request_from_an_entry_reads_the_features_a_fresh_prefill_gives():
    """A second request whose prompt extends the first's starts from its entry; the features its drafter observes
    over the whole prompt (read back from the slot's pages: the entry's shared pages, then its own) equal those of
    a prefill of that prompt in a cache-less engine (float64)."""
    seen = []

    def spy(eng):
        observe = eng.drafter.observe

        def wrapped(obs):
            seen.append((eng, [h.clone() for h in obs.hidden],
                         {k: [x.clone() for x in v] for k, v in obs.features.items()}))
            return observe(obs)
        eng.drafter.observe = wrapped

    cached = engine("qwen3_next", "eagle", ("replay", "eager"), prefix_cache=True, track_interval=16)
    plain = engine("qwen3_next", "eagle", ("replay", "eager"))
    spy(cached)
    spy(plain)
    first = [5 + (7 * i) % 80 for i in range(40)]
    out = generate_f64(cached, [first], max_new_tokens=6)
    second = out.sequences[0].tolist() + [9, 10, 11]
    seen.clear()
    got = generate_f64(cached, [second], max_new_tokens=6)
    assert got.stats.cached_tokens >= 40
    (_, h_cached, f_cached), = [s for s in seen if s[0] is cached][:1]
    generate_f64(plain, [second], max_new_tokens=6)
    (_, h_plain, f_plain), = [s for s in seen if s[0] is plain][:1]
    assert torch.allclose(h_cached[0], h_plain[0], rtol=1e-10, atol=1e-12)
    for k in f_plain:
        assert torch.allclose(f_cached[k][0], f_plain[k][0], rtol=1e-10, atol=1e-12), k


def test_a_snapshot_at_a_boundary_the_slot_does_not_hold_is_refused():
    """Only the last two multiples of track_interval up to the committed length are held (ping-pong track copies):
    any other boundary is a ValueError, and no page is taken."""
    eng = engine("qwen3_next", "ngram", ("replay", "eager"), prefix_cache=True, track_interval=8)
    slots = eng.runner.slots
    s = slots.alloc(1)[0]
    slots.reserve([s], [40])
    with torch_fallbacks(), float64_everywhere():
        eng.runner.prefill(s, torch.arange(5, 5 + 30) % 90)
    refs = list(eng.runner.kv.pages[False].refs)
    for bad in (8, 12, 0, 32):  # too old, not a multiple, nothing, past the length
        with pytest.raises(ValueError, match="boundary: slot .* track_interval 8 .* 30 tokens; got"):
            slots.snapshot(s, bad, interval=8)
    assert eng.runner.kv.pages[False].refs == refs
    e = slots.snapshot(s)
    assert e.length == 30 and len(e.pages) == num_pages_for(30, eng.runner.kv.page_size) - 1
    e.free()
    slots.release([s])
