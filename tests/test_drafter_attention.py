"""The drafters' attention (`draft.layers.attend`) and their chunked prefill.

1. `attend` (scaled_dot_product_attention over a bool visibility) equals a float64 recomputation of the dense
   formula it replaced, `softmax(q k^T * scale + additive mask) v` (mask 0 where visible, the dtype's minimum
   elsewhere), for causal, tree (ancestor) and block (dspark: a context window, then a bidirectional block)
   visibility, with keys given alone, as a past pair or in a `KVRoom`, with and without GQA.
2. A long prefill run as chunks of queries through a `KVRoom` equals one unchunked call, and no mask the kernel
   gets covers more than `QUERY_CHUNK` queries.
3. The eagle drafter's `observe` of a prompt longer than one chunk leaves the same cache and state as observing
   it in one forward, and then drafts the same tree; the native drafter's chunked catch-up drafts the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from assertions import assert_close
from tiny_models import generate_f64, save_with_mtp, tiny_model

import specdec
import specdec.draft.eagle_drafter as eagle_drafter
import specdec.draft.native_drafter as native_drafter
from specdec.draft.base import Contexts, Observation
from specdec.draft.layers import QUERY_CHUNK, KVRoom, additive_mask, attend
from specdec.draft.registry import build_drafter_net

pytestmark = pytest.mark.usefixtures("one_thread")


def dense_reference(q, k, v, visible, scale):
    """The formula `attend` replaced, in float64: `softmax(q k^T * scale + mask) v` with the additive mask of
    `visible [B or 1, T, S]`; key heads repeated for GQA. q `[B, H, T, D]`, k, v `[B, Hkv, S, D]` -> `[B, H, T, D]`."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = q @ k.transpose(-1, -2) * scale
    if visible is not None:
        att = att + additive_mask(visible, torch.float64)
    return att.softmax(-1) @ v


def causal(T: int, S: int) -> torch.Tensor:
    """`[1, T, S]`: the last T of S positions, each seeing the keys up to itself."""
    return (torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None])[None]


def tree(B: int, S: int, T: int, gen) -> torch.Tensor:
    """`[B, T, S + T]`: per row a random committed length (keys past it hidden), then T nodes of a random tree
    (node i's parent before it, -1 the root), each seeing the committed keys, its ancestors and itself."""
    lens = torch.randint(1, S + 1, (B,), generator=gen)
    ok = torch.zeros(B, T, S + T, dtype=torch.bool)
    ok[:, :, :S] = (torch.arange(S)[None, :] < lens[:, None])[:, None]
    for b in range(B):
        parent = [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(T)]
        for i in range(T):
            j = i
            while j >= 0:
                ok[b, i, S + j] = True
                j = parent[j]
    return ok


def block(B: int, S: int, G: int, window: int, gen) -> torch.Tensor:
    """`[B, G, S + G]`: dspark's block: the context keys before each row's anchor, at most `window` back, then
    the whole block of G slots."""
    ends = torch.randint(1, S + 1, (B,), generator=gen)
    keys = torch.arange(S)
    ctx = (keys < ends[:, None]) & (keys >= ends[:, None] - window)
    return torch.cat([ctx[:, None].expand(B, G, S), torch.ones(B, G, G, dtype=torch.bool)], 2)


def qkv(B, H, Hkv, T, S, D, dtype, gen):
    """Queries `[B, H, T, D]`, past keys / values `[B, Hkv, S, D]`, new keys / values `[B, Hkv, T, D]`."""
    r = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return r(B, H, T, D), (r(B, Hkv, S, D), r(B, Hkv, S, D)), (r(B, Hkv, T, D), r(B, Hkv, T, D))


def all_ways(q, past, new, visible, scale):
    """`attend` with the past keys as a pair, in a `KVRoom` (NaN past the keys: room never read) and, with the
    new keys joined to them, as the keys alone. -> the three outputs."""
    (pk, pv), (k, v) = past, new
    S, T = pk.shape[2], k.shape[2]
    room = (*pk.shape[:2], S + T + 3, pk.shape[3])
    rk, rv = pk.new_full(room, float("nan")), pv.new_full(room, float("nan"))
    rk[:, :, :S], rv[:, :, :S] = pk, pv
    return (attend(q, k, v, (pk, pv), visible, scale=scale),
            attend(q, k, v, KVRoom(rk, rv, S), visible, scale=scale),
            attend(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), None, visible, scale=scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("kind", ["causal", "tree", "block", "none"])
def test_attend_equals_the_dense_formula(kind, heads, dtype):
    gen = torch.Generator().manual_seed(1)
    B, D, S = 3, 16, 37
    H, Hkv = heads
    T = {"causal": 9, "tree": 11, "block": 7, "none": 5}[kind]
    visible = {"causal": lambda: causal(T, S + T), "tree": lambda: tree(B, S, T, gen),
               "block": lambda: block(B, S, T, 6, gen), "none": lambda: None}[kind]()
    q, past, new = qkv(B, H, Hkv, T, S, D, dtype, gen)
    scale = D ** -0.5
    ref = dense_reference(q, torch.cat([past[0], new[0]], 2), torch.cat([past[1], new[1]], 2), visible, scale)
    for way, out in zip(("pair", "room", "alone"), all_ways(q, past, new, visible, scale)):
        assert out.dtype == dtype
        assert_close(out, ref, dtype=dtype, msg=f"{kind}, keys {way}")


def test_visibility_broadcasts_over_batch_and_queries():
    """A visibility of one row `[1, T, S]`, or one for all queries `[B, 1, S]`, as the drafters pass them."""
    gen = torch.Generator().manual_seed(3)
    B, H, T, S, D = 2, 2, 4, 10, 8
    q, (k, v), _ = qkv(B, H, H, T, S, D, torch.float64, gen)
    for visible in (causal(T, S), torch.rand(B, 1, S, generator=gen) < 0.6):
        visible[..., 0] = True  # every query sees a key
        assert_close(attend(q, k, v, None, visible, scale=0.3), dense_reference(q, k, v, visible, 0.3))


class MaskSpy:
    """Wraps `F.scaled_dot_product_attention` and records each call's query count and mask."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = F.scaled_dot_product_attention

        def spy(q, k, v, attn_mask=None, **kw):
            self.calls.append((q.shape[2], k.shape[2], None if attn_mask is None else (attn_mask.dtype,
                                                                                      tuple(attn_mask.shape))))
            return real(q, k, v, attn_mask=attn_mask, **kw)
        monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def check(self, *, max_keys: int):
        """Every call took at most `QUERY_CHUNK` queries and a bool mask of at most that many rows."""
        assert self.calls
        for T, S, mask in self.calls:
            assert T <= QUERY_CHUNK and S <= max_keys
            if mask is not None:
                assert mask[0] == torch.bool and mask[1][-2] <= QUERY_CHUNK, mask


def test_long_prefill_in_chunks_equals_one_forward(monkeypatch):
    """A prompt of 2.6 chunks of queries: one `attend` call over all of it (chunked inside), and the chunks run
    one by one through a `KVRoom` with each chunk's own visibility (as the eagle drafter's `observe` runs them),
    equal the dense float64 formula; no kernel call sees more than one chunk of queries."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, D = 2, 4, 2, 16
    M = 2 * QUERY_CHUNK + 300
    q, _, (k, v) = qkv(B, H, Hkv, M, 0, D, torch.float32, gen)
    scale = D ** -0.5
    ref = dense_reference(q, k, v, causal(M, M), scale)
    spy = MaskSpy(monkeypatch)
    whole = attend(q, k, v, None, causal(M, M), scale=scale)
    rk, rv = torch.empty_like(k), torch.empty_like(v)
    i = torch.arange(M)
    chunks = []
    for c0 in range(0, M, QUERY_CHUNK):
        c1 = min(M, c0 + QUERY_CHUNK)
        ok = (i[c0:c1, None] >= i[None, :c1])[None]
        chunks.append(attend(q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], KVRoom(rk, rv, c0), ok, scale=scale))
    spy.check(max_keys=M)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert_close(whole, ref, dtype=torch.float32, msg="one call")
    assert_close(torch.cat(chunks, 2), ref, dtype=torch.float32, msg="chunks")
    assert_close(torch.cat(chunks, 2), whole, msg="chunks against one call")


def _observe(net, tokens, features, *, chunk: int, monkeypatch):
    """A fresh eagle drafter (tree top-2, 6 nodes) that observed `tokens` (per row) with `features` (per row, per
    layer) in chunks of `chunk` pairs, then drafted once. -> (drafter, block)."""
    monkeypatch.setattr(eagle_drafter, "QUERY_CHUNK", chunk)
    drafter = eagle_drafter.make_drafter(net, gamma=3, max_batch_size=2, topk=2, num_nodes=6)
    rows = list(range(len(tokens)))
    drafter.begin(rows, tokens)
    drafter.observe(Observation.of(rows, tokens, [f[0] for f in features],
                                   {l: [f[i] for f in features] for i, l in enumerate(net.config.feature_layers)}))
    state = ([(k.clone(), v.clone()) for k, v in drafter.cache], drafter.root_f.clone(), drafter.len_t.clone())
    anchors = [torch.cat([t, t[-1:]]) for t in tokens]
    return state, drafter.propose(rows, Contexts.of(anchors), 3)


def test_chunked_eagle_observe_equals_one_forward(monkeypatch):
    """Two prompts of 1.3 and 2.4 chunks (different lengths: the shorter padded) observed by a two-layer eagle
    net in float32, in chunks of `QUERY_CHUNK` pairs and in one forward: the same cache (every committed
    position of every layer: the second layer's keys depend on the first's attention over the whole prefix), root
    features and lengths, within float32 rounding; the same draft tree after it. The chunked run's kernel calls
    each take one chunk of queries."""
    target = tiny_model("qwen3_next", seed=0, dtype=torch.float32)
    torch.manual_seed(11)
    net = build_drafter_net("eagle", target, num_layers=2)
    assert next(net.parameters()).dtype == torch.float32
    gen = torch.Generator().manual_seed(5)
    d, V = target.config.hidden_size, target.config.vocab_size
    lengths = [int(1.3 * QUERY_CHUNK), int(2.4 * QUERY_CHUNK)]
    tokens = [torch.randint(3, V, (n,), generator=gen) for n in lengths]
    features = [[torch.randn(n, d, generator=gen) for _ in net.config.feature_layers] for n in lengths]
    one, one_block = _observe(net, tokens, features, chunk=10 ** 9, monkeypatch=monkeypatch)
    spy = MaskSpy(monkeypatch)
    (cache, root_f, len_t), block = _observe(net, tokens, features, chunk=QUERY_CHUNK, monkeypatch=monkeypatch)
    spy.check(max_keys=max(lengths) + 16)
    assert {QUERY_CHUNK, 2 * QUERY_CHUNK} <= {S for _, S, _ in spy.calls}  # chunks over the keys so far
    assert torch.equal(len_t, one[2]) and len_t[:2].tolist() == [n - 1 for n in lengths]
    assert_close(root_f, one[1], exact=True, msg="root features")
    for layer, ((k, v), (k1, v1)) in enumerate(zip(cache, one[0])):
        for b, n in enumerate(lengths):
            assert_close(k[b, :, :n - 1], k1[b, :, :n - 1], msg=f"layer {layer} row {b} keys")
            assert_close(v[b, :, :n - 1], v1[b, :, :n - 1], msg=f"layer {layer} row {b} values")
    assert torch.equal(block.tokens, one_block.tokens) and torch.equal(block.parent, one_block.parent)


NATIVE_PROMPTS = [[3, 41, 17, 88, 9, 60, 23, 5, 40, 11, 12], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 50, 12, 13, 70, 71, 72, 4]]


@pytest.fixture(scope="module")
def native_model(tmp_path_factory):
    return save_with_mtp(str(tmp_path_factory.mktemp("native")), "qwen3_next")


def _native_drafts(model, chunk: int, monkeypatch, *, fail_at: int = 0):
    """Greedy generation of `NATIVE_PROMPTS` with the native drafter catching up `chunk` pairs per forward, its
    net's `fail_at`-th step raising (0: none). -> (sequences, every returned draft block's tokens)."""
    monkeypatch.setattr(native_drafter, "QUERY_CHUNK", chunk)
    engine = specdec.wrap(model, drafter="native", num_draft_tokens=3, max_batch_size=2)
    net, seen, propose, calls = engine.drafter.net, [], engine.drafter.propose, [0]
    step = net.step

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected")
        return step(*a, **k)

    def recording(*a, **k):
        block = propose(*a, **k)
        seen.append(block.tokens.clone())
        return block
    net.step, engine.drafter.propose = failing, recording
    out = generate_f64(engine, NATIVE_PROMPTS, max_new_tokens=8)
    assert out.stats.drafter_failures == (1 if fail_at else 0)
    return out.sequences, seen


def test_chunked_native_catch_up_drafts_the_same(native_model, monkeypatch):
    """The native drafter's first catch-up runs a prompt's pairs a chunk per forward (chunks of 4 here, two rows
    of different lengths): the drafts of a greedy generation equal those of one forward, in float64."""
    seq, chunked = _native_drafts(native_model, 4, monkeypatch)
    seq1, whole = _native_drafts(native_model, 10 ** 9, monkeypatch)
    assert torch.equal(seq, seq1)
    assert len(chunked) == len(whole) and all(torch.equal(a, b) for a, b in zip(chunked, whole))


def test_native_catch_up_failing_midway_leaves_the_cache_as_it_was(native_model, monkeypatch):
    """A catch-up that fails in its second chunk takes the first chunk's pairs back out of the cache: they stay
    queued, and every later draft equals that of a run whose catch-up failed before any chunk ran."""
    with pytest.warns(RuntimeWarning, match="injected"):
        seq, late = _native_drafts(native_model, 4, monkeypatch, fail_at=2)
    with pytest.warns(RuntimeWarning, match="injected"):
        seq1, first = _native_drafts(native_model, 4, monkeypatch, fail_at=1)
    assert torch.equal(seq, seq1)
    assert len(late) == len(first) and all(torch.equal(a, b) for a, b in zip(late, first))
