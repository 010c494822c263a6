"""Teacher-forced logits of the hybrid adapters == the transformers model's own forward (float64)."""

from __future__ import annotations

import pytest
import torch
from assertions import max_rel_err, tree_node_sequences
from tiny_models import FAMILIES, float64_everywhere, tiny_model, torch_fallbacks

from specdec.runner import HybridRunner
from specdec.verify import Acceptance

TOL = 1e-10
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param, seed=1)


def reference_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over the whole sequence `[P]` -> `[P, vocab]`."""
    return model(ids[None]).logits[0]


@pytest.mark.parametrize("strategy, commit", MODES)
def test_chain_rounds_match_full_forward(model, strategy, commit):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (30,), generator=gen)
    with torch_fallbacks(), float64_everywhere():
        ref = reference_logits(model, ids)
        runner = HybridRunner(model, strategy=strategy, commit=commit, max_batch_size=2, max_length=64,
                              num_verify_tokens=5, prefill_chunk=4)
        slot = runner.alloc(1)[0]
        out = runner.prefill(slot, ids[:11])  # chunks of 4, 4, 3 tokens
        assert max_rel_err(out.logits[0], ref[:11]) < TOL  # outputs of every chunk
        pos = 11
        while pos < ids.numel():
            T = min(5, ids.numel() - pos)
            logits = runner.forward([slot], ids[None, pos:pos + T]).logits[0]
            assert max_rel_err(logits, ref[pos:pos + T]) < TOL, f"round at {pos}"
            n = int(torch.randint(1, T + 1, (), generator=gen))
            runner.commit(Acceptance.prefix([n], T, runner.device), host_counts=[n])
            pos += n


@pytest.mark.parametrize("strategy, commit", MODES)
def test_tree_round_then_chain(model, strategy, commit):
    """Every tree node's logits == the full forward of its root path; after committing one path, later
    rounds still match (KV compaction, fold of the accepted path)."""
    gen = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    ids = torch.randint(3, V, (24,), generator=gen)
    P = 10
    parent = [-1, 0, 0, 1, 2, 3, 1]  # node 0 = the next true token; path 0-1-3-5 follows the true sequence
    true_nodes = {0: P, 1: P + 1, 3: P + 2, 5: P + 3}
    tokens = torch.tensor([int(ids[true_nodes[i]]) if i in true_nodes else int(torch.randint(3, V, (), generator=gen))
                           for i in range(len(parent))])
    with torch_fallbacks(), float64_everywhere():
        runner = HybridRunner(model, strategy=strategy, commit=commit, max_batch_size=2, max_length=64,
                              num_verify_tokens=len(parent))
        other = runner.alloc(1)[0]  # a foreign request whose state must not move
        runner.prefill(other, ids[:5])
        slot = runner.alloc(1)[0]
        runner.prefill(slot, ids[:P])
        before = (runner.state.pool.ssm[:, other].clone(), runner.kv.lengths[other].item())
        logits = runner.forward([slot], tokens[None], parent=parent).logits[0]
        for node, seq in enumerate(tree_node_sequences(ids[:P], tokens, parent)):
            assert max_rel_err(logits[node], reference_logits(model, seq)[-1]) < TOL, f"node {node}"
        runner.commit(Acceptance.along([[0, 1, 3, 5]], device=runner.device), host_counts=[4])
        assert torch.equal(runner.state.pool.ssm[:, other], before[0]) and runner.kv.lengths[other] == before[1]
        ref = reference_logits(model, ids)
        pos = P + 4
        while pos < ids.numel():
            T = min(4, ids.numel() - pos)
            got = runner.forward([slot], ids[None, pos:pos + T]).logits[0]
            assert max_rel_err(got, ref[pos:pos + T]) < TOL
            runner.commit(Acceptance.prefix([T], T, runner.device), host_counts=[T])
            pos += T


def test_batched_rows_of_different_lengths(model):
    """Two requests with different committed lengths verified in one batch (padded KV, per-row masks)."""
    gen = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    a, b = torch.randint(3, V, (20,), generator=gen), torch.randint(3, V, (13,), generator=gen)
    with torch_fallbacks(), float64_everywhere():
        ra, rb = reference_logits(model, a), reference_logits(model, b)
        runner = HybridRunner(model, max_batch_size=3, max_length=64, num_verify_tokens=4)
        sa, sb = runner.alloc(2)
        runner.prefill(sa, a[:12])
        runner.prefill(sb, b[:5])
        pa, pb = 12, 5
        for _ in range(2):
            ids = torch.stack([b[pb:pb + 4], a[pa:pa + 4]])  # reversed slot order
            got = runner.forward([sb, sa], ids).logits
            assert max_rel_err(got[0], rb[pb:pb + 4]) < TOL and max_rel_err(got[1], ra[pa:pa + 4]) < TOL
            runner.commit(Acceptance.prefix([2, 4], 4, runner.device), host_counts=[2, 4])
            pb, pa = pb + 2, pa + 4


def test_kimi_attention_reads_latents_like_the_module():
    """Kimi-Linear's MLA layers run as `KimiLatentAttention` (the cached latents never expanded): its output
    equals the module's own forward (transformers' SDPA attention: the softmax in the queries' dtype, as here;
    eager's is float32) on the same cache contents, with a tree mask (float64); the tests above then check whole
    rounds of it against transformers' forward."""
    from specdec.adapters import KimiLatentAttention
    from specdec.hf_compat import cache_arg
    from specdec.kernels.tree import VerifyTree
    from specdec.kv_cache import KVCache

    model = tiny_model("kimi_linear", seed=2, attn_implementation="sdpa")
    runner = HybridRunner(model, max_batch_size=2, max_length=32)
    attn_layers = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert attn_layers and all(isinstance(runner._attn[i], KimiLatentAttention) for i in attn_layers)
    mod = model.model.layers[attn_layers[0]].self_attn
    gen = torch.Generator().manual_seed(3)
    d = model.config.hidden_size
    context, x = (torch.randn(2, T, d, generator=gen, dtype=torch.float64) for T in (6, 5))
    parent = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 3]])
    outs = []
    for attn in (mod, KimiLatentAttention(mod)):
        kv = KVCache(3, 32)
        kv.begin(torch.tensor([2, 0]), 6)  # a committed context of 6 tokens per row, written by the same attention
        attn(hidden_states=context, attention_mask=kv.attention_mask(torch.float64), **{cache_arg(attn): kv})
        kv.advance(torch.tensor([6, 4]))  # row 1 keeps 4 of them
        kv.begin(torch.tensor([2, 0]), 5, VerifyTree.check(parent, 2, 5))  # a tree round
        outs.append(attn(hidden_states=x, attention_mask=kv.attention_mask(torch.float64), **{cache_arg(attn): kv})[0])
    ref_out, out = outs
    assert max_rel_err(out, ref_out) < 1e-12
    # a module it does not mirror (a bias on kv_b_proj) runs as itself
    mod.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(mod.kv_b_proj.out_features, dtype=torch.float64))
    try:
        assert not KimiLatentAttention.applies(mod)
        runner = HybridRunner(model, max_batch_size=2, max_length=32)
        assert runner._attn[attn_layers[0]] is mod
    finally:
        mod.kv_b_proj.bias = None


def _kimi_mla():
    """A tiny Kimi-Linear's first MLA attention module (float64, transformers' SDPA attention) and its hidden size."""
    model = tiny_model("kimi_linear", seed=2, attn_implementation="sdpa")
    return model.model.layers[model.config.layer_types.index("full_attention")].self_attn, model.config.hidden_size


def test_kimi_latent_decode_step_like_the_module():
    """A plain decode step (T = 1) of `KimiLatentAttention` over contexts of different lengths (keys past the shorter
    row's length masked), and one row alone with no mask (every key visible): the module's own forward on the same
    cache contents (float64). A mask of another dtype is cast to the queries', with the same result."""
    from specdec.adapters import KimiLatentAttention
    from specdec.hf_compat import cache_arg
    from specdec.kv_cache import KVCache

    mod, d = _kimi_mla()
    gen = torch.Generator().manual_seed(4)
    context, x = (torch.randn(2, T, d, generator=gen, dtype=torch.float64) for T in (40, 1))
    outs = []
    for attn in (mod, KimiLatentAttention(mod)):
        kv = KVCache(3, 64)
        cache = {cache_arg(attn): kv}
        kv.begin(torch.tensor([2, 0]), 40)
        attn(hidden_states=context, attention_mask=kv.attention_mask(torch.float64), **cache)
        kv.advance(torch.tensor([40, 23]))  # row 1 keeps 23 of them: its keys 23..39 are masked below
        kv.begin(torch.tensor([2, 0]), 1)
        mask = kv.attention_mask(torch.float64)
        both = attn(hidden_states=x, attention_mask=mask, **cache)[0]
        other = attn(hidden_states=x, attention_mask=mask.float(), **cache)[0]
        unmasked = attn(hidden_states=x, attention_mask=None, **cache)[0]
        kv.abort()
        kv.begin(torch.tensor([2]), 1)
        alone = attn(hidden_states=x[:1], attention_mask=None, **cache)[0]
        kv.abort()
        outs.append((both, other, alone, unmasked))
    (ref_both, _, ref_alone, _), (both, other, alone, unmasked) = outs
    assert max_rel_err(both, ref_both) < 1e-12 and max_rel_err(alone, ref_alone) < 1e-12
    assert max_rel_err(other, both) < 1e-12
    # the mask is read: without it row 1 also attends to its stale keys past its length; row 0 sees every key anyway
    assert max_rel_err(unmasked[1], both[1]) > 1e-3 and max_rel_err(unmasked[0], both[0]) < 1e-12


def test_kimi_latent_chain_round_like_the_module():
    """A chain round of `KimiLatentAttention` (heads folded into query rows under the round's mask): rows of
    different committed lengths, one with nothing committed beside longer ones, and a first chunk where no row has
    anything committed: the module's own forward on the same cache contents (float64)."""
    from specdec.adapters import KimiLatentAttention
    from specdec.hf_compat import cache_arg
    from specdec.kv_cache import KVCache

    mod, d = _kimi_mla()
    gen = torch.Generator().manual_seed(6)
    context, x, first = (torch.randn(3, n, d, generator=gen, dtype=torch.float64) for n in (12, 6, 5))
    outs = []
    for attn in (mod, KimiLatentAttention(mod)):
        kv = KVCache(4, 64)
        cache = {cache_arg(attn): kv}
        kv.begin(torch.tensor([0, 1]), 5)  # nothing committed anywhere: the round's own keys alone
        start = attn(hidden_states=first[:2], attention_mask=kv.attention_mask(torch.float64), **cache)[0]
        kv.abort()
        kv.begin(torch.tensor([2, 0]), 12)
        attn(hidden_states=context[:2], attention_mask=kv.attention_mask(torch.float64), **cache)
        kv.advance(torch.tensor([12, 5]))
        kv.begin(torch.tensor([0, 1, 2]), 6)  # slot 1 fresh beside slots of 5 and 12 committed keys
        round_ = attn(hidden_states=x, attention_mask=kv.attention_mask(torch.float64), **cache)[0]
        kv.abort()
        outs.append((start, round_))
    (ref_start, ref_round), (start, round_) = outs
    assert max_rel_err(start, ref_start) < 1e-12 and max_rel_err(round_, ref_round) < 1e-12


def test_kimi_latent_prefill_chunk_like_the_module():
    """A prefill-sized chunk (T > ROUND_TOKENS: its heads attend one by one, not folded into query rows as a round's)
    after a context, rows of different lengths: the output equals the module's own forward on the same cache
    contents (float64)."""
    from specdec import adapters
    from specdec.adapters import KimiLatentAttention
    from specdec.hf_compat import cache_arg
    from specdec.kv_cache import KVCache

    mod, d = _kimi_mla()
    gen = torch.Generator().manual_seed(5)
    T = adapters.ROUND_TOKENS + 19
    context, x = (torch.randn(2, n, d, generator=gen, dtype=torch.float64) for n in (10, T))
    outs = []
    for attn in (mod, KimiLatentAttention(mod)):
        kv = KVCache(3, 128)
        cache = {cache_arg(attn): kv}
        kv.begin(torch.tensor([2, 0]), 10)
        attn(hidden_states=context, attention_mask=kv.attention_mask(torch.float64), **cache)
        kv.advance(torch.tensor([10, 7]))
        kv.begin(torch.tensor([2, 0]), T)  # a prefill chunk: causal over its own tokens
        outs.append(attn(hidden_states=x, attention_mask=kv.attention_mask(torch.float64), **cache)[0])
        kv.abort()
    assert max_rel_err(outs[1], outs[0]) < 1e-12
