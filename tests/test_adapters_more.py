"""The hybrid adapters of qwen3_5_moe, olmo_hybrid and bailing_hybrid against transformers' own model (float64 tiny
random models, transformers' pure-torch layers):

- teacher-forced logits of `HybridRunner` (chunked prefill, chain rounds with partial accepts, a tree round then
  chains) == the model's uncached forward, for every strategy and commit mode;
- `specdec.wrap(model).generate` == transformers' greedy `generate`, ngram and model drafters, every mode;
- a module the adapter expects but the model lacks fails at build, naming family, layer and module;
- `torch_fallbacks(chunked=True)` leaves these models' forward unchanged.
"""

from __future__ import annotations

import pytest
import torch
from assertions import max_rel_err, tree_node_sequences
from tiny_models import (float64_everywhere, generate_f64, greedy_reference, noisy_copy, remove_module, tiny_model,
                         torch_fallbacks)

import specdec
from specdec.runner import HybridRunner, make_runner
from specdec.verify import Acceptance

TOL = 1e-10
MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
# olmo_hybrid with RoPE (transformers' default config) and without (the released checkpoints: NoPE)
LOGIT_FAMILIES = ("qwen3_5_moe", "olmo_hybrid", "olmo_hybrid_nope", "bailing_hybrid")
GEN_FAMILIES = ("qwen3_5_moe", "olmo_hybrid", "bailing_hybrid")
MODEL_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text", "olmo_hybrid": "olmo_hybrid", "olmo_hybrid_nope": "olmo_hybrid",
               "bailing_hybrid": "bailing_hybrid"}
GAMMA, N = 5, 14
PROMPTS = {"rep4": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "rep3": [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11]}

pytestmark = pytest.mark.usefixtures("one_thread")

_MODELS: dict = {}


def _model(family: str, seed: int = 1):
    if (family, seed) not in _MODELS:
        _MODELS[family, seed] = tiny_model(family, seed=seed)
    return _MODELS[family, seed]


def _noisy_draft(family: str):
    """The generation target plus noise (`tiny_models.noisy_copy`): partial acceptance."""
    if (family, "noisy") not in _MODELS:
        _MODELS[family, "noisy"] = noisy_copy(_model(family, seed=0), seed=7)
    return _MODELS[family, "noisy"]


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own uncached forward over `[P]` -> `[P, vocab]`."""
    return model(ids[None]).logits[0]


# ---- 1. teacher-forced logits ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", LOGIT_FAMILIES)
def test_dispatch_and_model_type(family):
    model = _model(family)
    assert model.config.model_type == MODEL_TYPES[family]
    assert type(make_runner(model, max_batch_size=1, max_length=16)).__name__ == "HybridRunner"


@pytest.mark.parametrize("strategy, commit", MODES)
@pytest.mark.parametrize("family", LOGIT_FAMILIES)
def test_chain_and_tree_rounds_match_full_forward(family, strategy, commit):
    """Chunked prefill, chain rounds with random partial accepts, then a tree round (every node == the full
    forward of its root path), one path committed, and chain rounds after it."""
    check_rounds_match_full_forward(_model(family), strategy, commit, _reference)


def check_rounds_match_full_forward(model, strategy: str, commit: str, reference) -> None:
    """The rounds of `test_chain_and_tree_rounds_match_full_forward` on `model` (float64), each round's logits
    against `reference(model, ids [P]) -> [P, vocab]` (transformers' own uncached forward) within `TOL`; a
    foreign request's SSM state, conv window and KV length stay bitwise unchanged."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, V, (34,), generator=gen)
    parent = [-1, 0, 0, 1, 2, 3, 1]  # path 0-1-3-5 follows the true sequence
    with torch.no_grad(), torch_fallbacks(), float64_everywhere():
        ref = reference(model, ids)
        runner = HybridRunner(model, strategy=strategy, commit=commit, max_batch_size=2, max_length=64,
                              num_verify_tokens=len(parent), prefill_chunk=4)
        other = runner.alloc(1)[0]  # a foreign request whose state must not move
        runner.prefill(other, ids[:5])
        slot = runner.alloc(1)[0]
        out = runner.prefill(slot, ids[:11])  # chunks of 4, 4, 3
        assert max_rel_err(out.logits[0], ref[:11]) < TOL
        before = (runner.state.pool.ssm[:, other].clone(), runner.state.pool.conv[:, other].clone(),
                  int(runner.kv.lengths[other]))
        pos = 11
        for _ in range(3):  # chain rounds, partial accepts
            logits = runner.forward([slot], ids[None, pos:pos + 5]).logits[0]
            assert max_rel_err(logits, ref[pos:pos + 5]) < TOL, f"chain round at {pos}"
            n = int(torch.randint(1, 5, (), generator=gen))
            runner.commit(Acceptance.prefix([n], 5, runner.device), host_counts=[n])
            pos += n
        true_nodes = {0: 0, 1: 1, 3: 2, 5: 3}
        tokens = torch.tensor([int(ids[pos + true_nodes[i]]) if i in true_nodes
                               else int(torch.randint(3, V, (), generator=gen)) for i in range(len(parent))])
        logits = runner.forward([slot], tokens[None], parent=parent).logits[0]
        for node, seq in enumerate(tree_node_sequences(ids[:pos], tokens, parent)):
            assert max_rel_err(logits[node], reference(model, seq)[-1]) < TOL, f"tree node {node}"
        runner.commit(Acceptance.along([[0, 1, 3, 5]], device=runner.device), host_counts=[4])
        pos += 4
        while pos < ids.numel():
            T = min(4, ids.numel() - pos)
            got = runner.forward([slot], ids[None, pos:pos + T]).logits[0]
            assert max_rel_err(got, ref[pos:pos + T]) < TOL, f"chain round after the tree at {pos}"
            n = T if pos + T == ids.numel() else int(torch.randint(1, T + 1, (), generator=gen))
            runner.commit(Acceptance.prefix([n], T, runner.device), host_counts=[n])
            pos += n
        assert torch.equal(runner.state.pool.ssm[:, other], before[0])
        assert torch.equal(runner.state.pool.conv[:, other], before[1])
        assert int(runner.kv.lengths[other]) == before[2]


# ---- 2. greedy identity with transformers' generate --------------------------------------------------------


@pytest.mark.parametrize("strategy, commit", MODES)
@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("family", GEN_FAMILIES)
def test_greedy_identity(family, drafter, strategy, commit):
    target = _model(family, seed=0)  # its greedy output repeats itself: the ngram drafter finds matches
    kw = dict(num_draft_tokens=GAMMA, strategy=strategy, commit=commit, max_batch_size=2)
    if drafter == "ngram":
        engine = specdec.wrap(target, drafter="ngram", **kw)
        names = ["rep4", "rep3"]  # one batch, prompts of different lengths
    else:
        engine = specdec.wrap(target, drafter="model", draft_model=_noisy_draft(family), **kw)
        names = ["rep4"]
    assert type(engine.runner).__name__ == "HybridRunner"
    refs = [greedy_reference(target, PROMPTS[n], N) for n in names]
    out = generate_f64(engine, [PROMPTS[n] for n in names], max_new_tokens=N)
    for b, ref in enumerate(refs):
        assert out.sequences[b, :len(ref)].tolist() == ref, f"row {b} differs from transformers' greedy generate"
    stats = out.stats
    assert stats.proposed > 0 and stats.accepted > 0 and stats.drafter_failures == 0, stats.as_dict()
    if drafter == "model":  # the noisy copy: some drafts rejected, some accepted
        assert 0.0 < stats.alpha < 1.0, stats.as_dict()
    assert engine.runner.num_free == 2


# ---- 3. a changed transformers class fails at build ---------------------------------------------------------


@pytest.mark.parametrize("family, path, name", [
    ("olmo_hybrid", ("linear_attn",), "g_proj"),
    ("olmo_hybrid", (), "post_feedforward_layernorm"),
    ("bailing_hybrid", ("self_attn",), "forget_gate"),
    ("qwen3_5_moe", (), "linear_attn"),
])
def test_missing_module_names_family_layer_and_module(family, path, name):
    layer_idx = 3 if name == "post_feedforward_layernorm" else 0  # the full-attention layer / a linear one
    model = remove_module(tiny_model(family, seed=3), layer_idx, path, name)
    with pytest.raises(ValueError, match=rf"{MODEL_TYPES[family]} layer {layer_idx} .*'{name}'"):
        HybridRunner(model, max_batch_size=1, max_length=16)


# ---- 4. the chunked prefill swap of torch_fallbacks ----------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_5_moe", "olmo_hybrid", "bailing_hybrid"])
def test_chunked_fallback_matches_transformers(family):
    """`torch_fallbacks(chunked=True)` (training, reference outputs) replaces the family's chunked delta rule with
    `kernels.chunk_delta_rule` under the family's l2norm: the model's forward is unchanged."""
    model = _model(family)
    ids = torch.randint(3, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), float64_everywhere():
        with torch_fallbacks(family):
            ref = model(ids).logits
        with torch_fallbacks(family, chunked=True, chunk_size=8):
            got = model(ids).logits
    assert max_rel_err(got, ref) < TOL
