"""The Mamba2 hybrid adapters (Bamba, Nemotron-H, GraniteMoeHybrid, Falcon-H1, Zamba2) against transformers' own
model (float64 tiny random models of transformers' classes, the configs of tests/test_generic_families.py; Granite's
and Falcon-H1's multipliers set away from 1; Zamba2 with two invocations of one shared block, LoRA adapters on):

- teacher-forced logits of `HybridRunner` (chunked prefill, chain rounds with partial accepts, a tree round then
  chains) == the model's uncached forward, for every strategy and commit mode; a foreign request's state and KV
  length bitwise unchanged; the SSM state matters at that tolerance (a zeroed state is caught);
- `specdec.wrap(model).generate` == transformers' greedy `generate` with the ngram, model and eagle (tree)
  drafters, every strategy and commit mode;
- a module the adapter expects but the model lacks fails at build, naming family, layer and module;
- speculative sampling on Nemotron-H follows the target's exact joint distribution (chi-square).

transformers runs its Mamba2 scan in float32 even in a float64 model; both sides run under `float64_everywhere`.
"""

from __future__ import annotations

import copy
import functools

import pytest
import test_generic_families as generic
from assertions import max_rel_err
from test_adapters_more import check_rounds_match_full_forward
import test_sampling_generate as sampling
import torch
import transformers
from tiny_models import exact_joint, float64_everywhere, greedy_reference, noisy_copy, remove_module

import specdec
from specdec.adapters import HYBRID_FAMILIES, MAMBA2_FAMILIES
from specdec.draft.eagle_drafter import EagleDrafter
from specdec.runner import HybridRunner, make_runner
from specdec.verify import SamplingParams

FAMILIES = ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba2")
# Granite's multipliers default to 1: other values, so that a missed one shows
GRANITE_SCALES = dict(embedding_multiplier=3.0, residual_multiplier=0.7, logits_scaling=2.5, attention_multiplier=0.3)
# the config overrides of the families built here: Falcon-H1's multipliers (all 1 by default; the muP vector, one
# per in_proj section, is computed from `ssm_multipliers` at build), Zamba2 with one shared block invoked by two
# hybrid layers (a KV cache each) and the per-invocation LoRA adapters of its attention and MLP
FALCON_SCALES = dict(embedding_multiplier=3.0, lm_head_multiplier=0.6, key_multiplier=0.8, attention_in_multiplier=1.3,
                     attention_out_multiplier=0.7, ssm_in_multiplier=1.4, ssm_out_multiplier=0.6,
                     ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9], mlp_multipliers=[1.3, 0.7])
OVERRIDES = {
    "falcon_h1": FALCON_SCALES,
    # the gated RMSNorm (grouped, gate before the norm) and a dt ceiling that binds (dt_bias starts at 1); teacher-
    # forced only: transformers' one-token decode step does not apply `time_step_limit`, so its generate would not
    # be the forward this checks against
    "falcon_h1_rms_norm": dict(FALCON_SCALES, mamba_rms_norm=True, mamba_norm_before_gate=False,
                               time_step_limit=(0.0, 1.0)),
    "zamba2": dict(layers_block_type=["hybrid", "mamba", "hybrid"], use_shared_attention_adapter=True, adapter_rank=4),
}


@functools.cache
def tiny(family: str, seed: int = 0):
    """`test_generic_families.tiny`, Granite with its multipliers set, Falcon-H1 and Zamba2 with `OVERRIDES` (a
    model of its own per seed)."""
    if family in OVERRIDES:
        return generic.build(family.removesuffix("_rms_norm"), seed, **OVERRIDES[family])
    if family != "granitemoehybrid":
        return generic.tiny(family, seed)
    model = copy.deepcopy(generic.tiny(family, seed))
    for name, value in GRANITE_SCALES.items():
        setattr(model.config, name, value)
    model.model.embedding_multiplier = GRANITE_SCALES["embedding_multiplier"]
    for layer in model.model.layers:
        layer.residual_multiplier = GRANITE_SCALES["residual_multiplier"]
        if layer.self_attn is not None:
            layer.self_attn.scaling = GRANITE_SCALES["attention_multiplier"]
    return model


@functools.cache
def noisy_draft(family: str, scale: float):
    """`tiny(family)` plus noise (`tiny_models.noisy_copy`), one per family and scale."""
    return noisy_copy(tiny(family), scale)


MODES = [("replay", "eager"), ("replay", "lazy"), ("snapshot", "eager")]
TOL = 1e-10
GAMMA, N = 4, 14
PROMPTS = {"rep4": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "rep3": [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11]}
TREE = dict(topk=3, depth=4, num_nodes=10)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mamba2_families_are_registered():
    assert all(HYBRID_FAMILIES[f] is MAMBA2_FAMILIES[f] for f in FAMILIES)


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own uncached forward over `[P]` -> `[P, vocab]`."""
    return model(ids[None], use_cache=False).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_dispatch_and_state_config(family):
    model = tiny(family)
    runner = make_runner(model, max_batch_size=1, max_length=16)
    assert type(runner).__name__ == "HybridRunner"
    cfg = runner.state.cfg
    # the layers with a Mamba2 mixer: "linear_attention", and Falcon-H1's / Zamba2's "hybrid"
    mixers = [i for i, t in enumerate(model.config.layer_types) if t in ("linear_attention", "hybrid")]
    assert list(runner.linear_index) == mixers
    mod = runner._mixers[mixers[0]]
    assert (cfg.rule, cfg.gate, cfg.num_layers) == ("mamba2", "gdn", len(mixers))
    assert (cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim) == (mod.num_heads, mod.ssm_state_size, mod.head_dim)


@pytest.mark.parametrize("strategy, commit", MODES)
@pytest.mark.parametrize("family", FAMILIES + ("falcon_h1_rms_norm",))
def test_chain_and_tree_rounds_match_full_forward(family, strategy, commit):
    """Chunked prefill, chain rounds with random partial accepts, then a tree round (every node == the full
    forward of its root path), one path committed, and chain rounds after it (tests/test_adapters_more.py)."""
    check_rounds_match_full_forward(tiny(family), strategy, commit, _reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_ssm_state_matters(family):
    """Teeth of the logit comparison: a verify from a zeroed Mamba2 state is far off the full forward."""
    model = tiny(family)
    ids = torch.randint(3, model.config.vocab_size, (16,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), float64_everywhere():
        ref = _reference(model, ids)
        runner = HybridRunner(model, max_batch_size=1, max_length=32, num_verify_tokens=4)
        slot = runner.alloc(1)[0]
        runner.prefill(slot, ids[:12])
        runner.state.pool.ssm[:, slot] = 0
        got = runner.forward([slot], ids[None, 12:16]).logits[0]
    assert max_rel_err(got, ref[12:16]) > 1e3 * TOL


@pytest.mark.parametrize("strategy, commit", MODES)
@pytest.mark.parametrize("drafter", ["ngram", "model", "eagle"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(family, drafter, strategy, commit):
    target = tiny(family)
    kw = dict(num_draft_tokens=GAMMA, strategy=strategy, commit=commit, max_batch_size=2)
    names = ["rep4", "rep3"]  # one batch, prompts of different lengths
    if drafter == "model":
        engine = specdec.wrap(target, drafter="model", draft_model=noisy_draft(family, 3e-2), **kw)
        names = ["rep4"]
    elif drafter == "eagle":  # an untrained head: branching trees, verified as trees
        torch.manual_seed(11)
        engine = specdec.wrap(target, drafter="eagle", untrained=True, **kw, **TREE)
        assert isinstance(engine.drafter, EagleDrafter)
    else:
        engine = specdec.wrap(target, drafter="ngram", **kw)
    assert type(engine.runner).__name__ == "HybridRunner"
    refs = [greedy_reference(target, PROMPTS[n], N) for n in names]
    with float64_everywhere():
        out = engine.generate([torch.tensor(PROMPTS[n]) for n in names], max_new_tokens=N, eos_token_id=None)
    for b, ref in enumerate(refs):
        assert out.sequences[b, :len(ref)].tolist() == ref, f"row {b} differs from transformers' greedy generate"
    stats = out.stats
    assert stats.proposed > 0 and stats.drafter_failures == 0, stats.as_dict()
    if drafter == "model":  # the noisy copy: some drafts rejected, some accepted
        assert 0.0 < stats.alpha < 1.0, stats.as_dict()
    assert engine.runner.num_free == 2


@pytest.mark.parametrize("drafter", ["dspark", "mtp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_trained_kinds(family, drafter):
    """The block drafter (an untrained DSpark net: context K/V from the target's captured hidden states) and the
    frozen-KV MTP head (reading the last full-attention layer's cache, tests/test_drafter_mtp.py checks what it
    reads) on every Mamba2 family, replay with eager commit. Zamba2's one attention is a shared block whose cache
    the head does not read: it refuses that target by name."""
    target = tiny(family)
    torch.manual_seed(3)
    kw = dict(num_draft_tokens=GAMMA, max_batch_size=2)
    if drafter == "mtp" and family == "zamba2":
        with pytest.raises(ValueError, match="drafter: mtp .*'zamba2' has none it can read"):
            specdec.wrap(target, drafter="mtp", untrained=True, **kw)
        return
    engine = specdec.wrap(target, drafter=drafter, untrained=True, **kw)
    names = ["rep4", "rep3"]
    refs = [greedy_reference(target, PROMPTS[n], N) for n in names]
    with float64_everywhere():
        out = engine.generate([torch.tensor(PROMPTS[n]) for n in names], max_new_tokens=N, eos_token_id=None)
    for b, ref in enumerate(refs):
        assert out.sequences[b, :len(ref)].tolist() == ref, f"row {b} differs from transformers' greedy generate"
    assert out.stats.proposed > 0 and out.stats.drafter_failures == 0, out.stats.as_dict()


@pytest.mark.parametrize("family, layer_idx, path, name", [
    ("bamba", 0, ("mamba",), "dt_bias"),
    ("bamba", 2, (), "pre_ff_layernorm"),
    ("nemotron_h", 0, ("mixer",), "D"),
    ("nemotron_h", 2, (), "norm"),  # the MLP-only block
    ("granitemoehybrid", 1, (), "shared_mlp"),
    ("granitemoehybrid", 0, (), "residual_multiplier"),
    ("falcon_h1", 0, ("mamba",), "mup_vector"),
    ("falcon_h1", 1, (), "attn_out_multiplier"),
    ("falcon_h1", 1, (), "self_attn"),
    ("zamba2", 0, (), "shared_transformer"),
    ("zamba2", 2, ("mamba_decoder",), "input_layernorm"),
    ("zamba2", 1, ("mamba",), "D"),
])
def test_missing_module_names_family_layer_and_module(family, layer_idx, path, name):
    # a model of its own (seed 3 + layer): the cached models are shared
    model = remove_module(tiny(family, seed=3 + layer_idx), layer_idx, path, name)
    with pytest.raises(ValueError, match=rf"{family} layer {layer_idx} .*'{name}'"):
        HybridRunner(model, max_batch_size=1, max_length=16)


def test_sampling_follows_the_target():
    """Speculative sampling on Nemotron-H's adapter (model drafter, temperature 1) follows the target's exact joint
    distribution of the first tokens: the chi-square test of tests/test_sampling_generate.py, vocabulary 8."""
    def model(seed: int):
        cfg = transformers.NemotronHConfig(**dict(generic._BASE, vocab_size=sampling.V),
                                           **generic.CONFIGS["nemotron_h"])
        torch.manual_seed(seed)
        m = transformers.NemotronHForCausalLM._from_config(cfg, dtype=torch.float64, attn_implementation="eager")
        with torch.no_grad():
            m.lm_head.weight.mul_(sampling.LOGIT_SCALE)
        return m.eval()

    target, draft = model(0), model(1)
    engine = specdec.wrap(target, drafter="model", draft_model=draft, num_draft_tokens=sampling.GAMMA,
                          max_batch_size=sampling.BATCH, max_length=64)
    assert type(engine.runner).__name__ == "HybridRunner"
    params = sampling.SETTINGS["temperature=1"]
    joint = exact_joint(target, sampling.PROMPT, SamplingParams(do_sample=True, **params), sampling.NEW)
    counts, totals = sampling.sample_counts(engine, params, sampling.N, seed=7100)
    assert totals["drafter_failures"] == 0 and totals["proposed"] >= sampling.N, totals
    assert 0.05 * totals["proposed"] < totals["accepted"] < 0.9 * totals["proposed"], totals
    stat, df, crit = sampling.gof(counts, joint)
    assert stat < crit, f"chi2 {stat:.1f} >= critical {crit:.1f} (df {df})"
