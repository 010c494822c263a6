"""The generic runner over a sweep of transformers causal-LM families (tiny float64 random models).

Per family: every forward of `GenericRunner` (prefill, then verify windows whose drafts are partly wrong, so
that some rounds commit fewer tokens than they verified) gives the same logits as the model's own uncached
forward over the full sequence, to 1e-9 relative to the logit scale (`max_rel_err`: max abs diff / max |logit|
of the reference); and `specdec.wrap(model).generate` equals transformers' greedy `generate` with the ngram
drafter and with a draft model (a noisy copy of the target). Models whose forward defaults positions to
`arange(new tokens)` (Bamba) only pass when the runner passes positions from the committed length, Mamba-1
mixers (Mamba, Falcon-Mamba, Jamba, Zamba) only when it feeds them one token at a time after the prompt.
"""

from __future__ import annotations

import functools

import pytest
import torch
from assertions import max_rel_err
from tiny_models import float64_everywhere, greedy_reference, noisy_copy

import specdec
import specdec.engine
from specdec.generic import GenericRunner
from specdec.verify import accept_chain_greedy

V = 96
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repetitive: the ngram drafter has something to propose
GAMMA = 4
WRONG = [None, 2, 0, None, 3, 1]  # per verify round: the draft made wrong (None: all right)
N = 12  # new tokens of the generate comparisons
REF = len(WRONG) * (GAMMA + 1) + 1  # new tokens of the one greedy reference per family (covers every round)
TOL = 1e-9

# initializer_range 0.1 (most default to 0.02): else the SSM layers of the hybrids carry almost nothing from one
# token to the next (1e-12 .. 1e-6 of the hidden state), and a mishandled recurrent state would go unseen at 1e-9
_BASE = dict(vocab_size=V, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             initializer_range=0.1)
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=8)
CONFIGS = {  # model_type -> tiny config kwargs (hidden 32)
    "llama": _DECODER,
    "mistral": dict(_DECODER, sliding_window=None),
    "qwen2": _DECODER,
    "qwen3": dict(_DECODER, head_dim=8),
    "gemma": dict(_DECODER, head_dim=8),
    "gemma2": dict(_DECODER, head_dim=8, sliding_window=8),
    "phi3": _DECODER,
    "olmo2": _DECODER,
    "starcoder2": _DECODER,
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=128),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=128),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                max_position_embeddings=128),
    "mamba": dict(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4),
    "falcon_mamba": dict(hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4),
    "mamba2": dict(hidden_size=32, num_heads=4, head_dim=16, state_size=16, n_groups=2, expand=2, conv_kernel=4,
                   num_hidden_layers=2, chunk_size=8),
    "bamba": dict(_DECODER, num_hidden_layers=5, attn_layer_indices=[2], **_MAMBA2),
    "jamba": dict(_DECODER, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2),
    "nemotron_h": dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       layers_block_type=["mamba", "attention", "mlp", "mamba"], mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=8,
                       max_position_embeddings=128),
    "granitemoehybrid": dict(_DECODER, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                             position_embedding_type="rope", **_MAMBA2),
    "falcon_h1": dict(_DECODER, mamba_d_ssm=64, **_MAMBA2),
    "zamba": dict(hidden_size=32, attention_hidden_size=64, attention_head_dim=16, intermediate_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=2,
                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  max_position_embeddings=128),
    "zamba2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=16,
                   mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=8,
                   num_mem_blocks=1, use_mem_rope=True, max_position_embeddings=128),
}


@functools.cache
def tiny(family: str, seed: int = 0):
    """A float64 random model of `family` built from its config class; `lm_head` x4 so logits are spread."""
    return build(family, seed)


def build(family: str, seed: int = 0, **overrides):
    """`tiny(family, seed)` with `overrides` on its config (not cached)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    # the classes by name: fla registers its own "mamba" / "mamba2" models with the Auto classes
    cfg = getattr(transformers, CONFIG_MAPPING_NAMES[family])(**_BASE, **dict(CONFIGS[family], **overrides))
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    torch.manual_seed(seed)
    model = cls._from_config(cfg, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4)
    return model


@functools.cache
def noisy_draft(family: str):
    """`tiny(family)` plus noise (`tiny_models.noisy_copy`), one per family."""
    return noisy_copy(tiny(family))


def uncached_logits(model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]), use_cache=False).logits[0]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_verify_logits_equal_uncached_forward(family):
    """Prefill and every verify window (all accepted, some accepted, none accepted) == an uncached forward."""
    model = tiny(family)
    ref = greedy_reference(model, PROMPT, REF)
    runner = GenericRunner(model, max_batch_size=1, max_length=64)
    (slot,) = runner.alloc(1)
    errs, committed = [], []
    with float64_everywhere():
        out = runner.prefill(slot, torch.tensor(PROMPT))
        errs.append(max_rel_err(out.logits[0], uncached_logits(model, PROMPT)))
        seq = list(PROMPT)
        for wrong in WRONG:
            L = len(seq)
            ids = ref[L:L + GAMMA + 1]  # anchor (the greedy token) + GAMMA drafts
            if wrong is not None:
                ids[1 + wrong] = (ids[1 + wrong] + 1) % V
            ids = torch.tensor([ids])
            out = runner.forward([slot], ids)
            errs.append(max_rel_err(out.logits[0], uncached_logits(model, seq + ids[0].tolist())[L:]))
            acc = accept_chain_greedy(ids[:, 1:], out.logits)
            n = acc.num_accepted
            runner.commit(acc)
            seq += ids[0, :int(n) + 1].tolist()
            committed.append(int(n) + 1)
            assert runner.length(slot) == len(seq)
    assert max(errs) <= TOL, f"{family}: max rel logit error per forward {['%.1e' % e for e in errs]}"
    assert seq == ref[:len(seq)]
    assert min(committed) < GAMMA + 1 and max(committed) == GAMMA + 1, committed  # partial and full commits


@pytest.mark.parametrize("family", ["llama", "mamba2", "gpt2"])
def test_prefill_batch_rows_equal_uncached_forward(family):
    """`prefill_batch` of prompts of different lengths: each row's hidden states, captured layer and last-token
    logits equal an uncached forward of that prompt alone; past a row's end, zeros (the padded layout the hybrid
    runner gives, which the engine reads the same way for every runner)."""
    model = tiny(family)
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:9]]
    runner = GenericRunner(model, max_batch_size=3, max_length=64)
    slots = runner.alloc(3)
    with float64_everywhere(), torch.no_grad():
        out = runner.prefill_batch(slots, [torch.tensor(p) for p in prompts], capture=(0,), last_logits=True)
        P = max(map(len, prompts))
        assert out.hidden.shape[:2] == out.captured[0].shape[:2] == (3, P) and out.logits.shape[:2] == (3, 1)
        for b, p in enumerate(prompts):
            ref = model(torch.tensor([p]), use_cache=False, output_hidden_states=True)
            assert max_rel_err(out.logits[b, 0], ref.logits[0, -1]) <= TOL
            assert max_rel_err(out.hidden[b, :len(p)], ref.hidden_states[-1][0]) <= TOL
            assert max_rel_err(out.captured[0][b, :len(p)], ref.hidden_states[1][0]) <= TOL
            assert not out.hidden[b, len(p):].any() and runner.length(slots[b]) == len(p)


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_identity(family, drafter, monkeypatch):
    model = tiny(family)
    # the generic runner for every family, those with a hybrid adapter too (tests/test_mamba2_adapters.py and
    # the adapter tests run those on the hybrid runner)
    monkeypatch.setattr(specdec.build, "make_runner", GenericRunner)
    kw = dict(draft_model=noisy_draft(family)) if drafter == "model" else {}
    engine = specdec.wrap(model, drafter=drafter, num_draft_tokens=GAMMA, max_batch_size=1, **kw)
    assert type(engine.runner).__name__ == "GenericRunner"
    with float64_everywhere():
        out = engine.generate(torch.tensor([PROMPT]), max_new_tokens=N, eos_token_id=None)
    assert out.sequences[0].tolist() == greedy_reference(model, PROMPT, REF)[:len(PROMPT) + N]
    if drafter == "model":  # random models rarely repeat themselves: the ngram drafter may propose nothing
        assert out.stats.accepted > 0, out.stats.as_dict()
