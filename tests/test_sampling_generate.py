"""End to end: speculative sampling through `specdec.wrap(model).generate` follows the target's own distribution.

Oracle: the exact joint distribution of the first NEW generated tokens, from transformers' own forward of the
target over every prefix (pure-torch paths, float64) with the same logits transform (temperature / top-p).
Empirical: many seeded `generate` calls, each a batch of the same prompt. A chi-square goodness-of-fit test on
the joint (cells expecting fewer than 5 pooled) at significance 1e-3 must pass for the model drafter (drafts
sampled from the draft model's own q) and the n-gram drafter (deterministic drafts), and must fail for
deliberately wrong acceptance rules run through the same engine. Seeds are fixed, so the tests are deterministic.

The models are tiny and their logits scaled up so that p and q are far from uniform and differ: about half
the drafts are rejected, so the residual distribution decides much of the output.
"""

from __future__ import annotations


import pytest
import torch
from assertions import chi2_critical, chi2_gof, count_samples
from tiny_models import exact_joint, tiny_model

import specdec
import specdec.verify.accept as accept_mod
from specdec.verify import Acceptance, SamplingParams

RIGHT_CHAIN_RULE = accept_mod._chain_sampling

FAMILY = "qwen3_5"
V = 8
LOGIT_SCALE = 4.0  # sharpens the random models' near-uniform logits
PROMPT = [1, 3, 5, 7, 2, 4, 6, 0, 5, 3]  # holds every token, so the n-gram drafter always finds the anchor
NEW = 3  # tokens tested: the first is sampled after prefill, the rest come from verify rounds
GAMMA = 2
BATCH = 100  # copies of the prompt per generate call
N = 2000  # samples per setting

SETTINGS = {
    "temperature=1": dict(temperature=1.0),
    "temperature=0.7": dict(temperature=0.7),
    "top_p=0.9": dict(temperature=1.0, top_p=0.9),
}


# ----------------------------------------------------------------------------------------------
# chi-square goodness of fit


def test_chi2_critical_matches_tables():
    for df, q in [(5, 20.515), (10, 29.588), (30, 59.703), (100, 149.449)]:  # chi-square upper 0.001 quantiles
        assert abs(chi2_critical(df) - q) / q < 0.015


def test_chi2_gof_pools_small_cells():
    probs = torch.tensor([0.5, 0.3, 0.19, 0.006, 0.004, 0.0])
    counts = torch.tensor([50, 30, 19, 1, 0, 0])
    stat, df = chi2_gof(counts, probs)  # cells 3 and 4 pool (expect 1) and join cell 2 (19 + 1 = 20)
    assert df == 2 and stat == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(AssertionError):
        chi2_gof(torch.tensor([50, 30, 19, 0, 0, 1]), probs)


# ----------------------------------------------------------------------------------------------
# models, oracle, sampling


def make_model(seed: int, family: str = FAMILY):
    model = tiny_model(family, seed=seed, vocab_size=V, num_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model


@pytest.fixture(scope="module")
def target():
    return make_model(0)


@pytest.fixture(scope="module")
def draft():
    return make_model(1)


@pytest.fixture(scope="module")
def engines(target, draft):
    kw = dict(num_draft_tokens=GAMMA, max_batch_size=BATCH, max_length=64)
    return {"model": specdec.wrap(target, drafter="model", draft_model=draft, **kw),
            "ngram": specdec.wrap(target, drafter="ngram", **kw)}


def sample_counts(engine, params: dict, n: int, seed: int) -> tuple[torch.Tensor, dict]:
    """Counts `[V ** NEW]` of the first NEW tokens over `n` sampled continuations, and summed draft stats."""
    return count_samples(engine, n, seed, prompt=PROMPT, vocab=V, new=NEW, batch=BATCH,
                         stats=("proposed", "accepted", "rounds", "drafter_failures"), **params)


def gof(counts: torch.Tensor, joint: torch.Tensor) -> tuple[float, int, float]:
    stat, df = chi2_gof(counts, joint)
    return stat, df, chi2_critical(df)


# ----------------------------------------------------------------------------------------------
# speculative sampling follows the target


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_tokens_follow_target(engines, target, drafter, setting):
    params = SETTINGS[setting]
    joint = exact_joint(target, PROMPT, SamplingParams(do_sample=True, **params), NEW)
    seed = 1000 * list(SETTINGS).index(setting) + (0 if drafter == "model" else 500)
    counts, totals = sample_counts(engines[drafter], params, N, seed)
    # drafts matter at the tested positions: proposed in every first round, both accepted and rejected often
    # (the model drafter accepts about half, prompt lookup about a tenth)
    assert totals["drafter_failures"] == 0
    assert totals["proposed"] >= N, totals
    assert 0.05 * totals["proposed"] < totals["accepted"] < 0.9 * totals["proposed"], totals
    stat, df, crit = gof(counts, joint)
    print(f"{drafter} {setting}: chi2 {stat:.1f} df {df} critical {crit:.1f} "
          f"alpha {totals['accepted'] / totals['proposed']:.3f}")
    assert stat < crit, f"{drafter} {setting}: chi2 {stat:.1f} >= critical {crit:.1f} (df {df})"


@pytest.mark.parametrize("family, drafter, options", [
    ("olmo_hybrid", "model", {}), (FAMILY, "model", {"static_shapes": True}),
    (FAMILY, "mtp", {"static_shapes": True}), (FAMILY, "dspark", {"static_shapes": True}),
    (FAMILY, "eagle", {"static_shapes": True, "topk": 2, "num_nodes": 4})],
    ids=["olmo_hybrid", "static_shapes", "static_shapes-mtp", "static_shapes-dspark", "static_shapes-eagle"])
def test_sampling_on_more_paths(family, drafter, options):
    """The same test on another family's hybrid adapter (OLMo-Hybrid: Gated DeltaNet + attention), on the
    static-shape path (batch padded to its bucket, drafts to gamma, zero draft probabilities in the padding), and
    there with drafters that draft inside the device step (the static draft steps of mtp and dspark, which
    sample their chains, and eagle's tree)."""
    target = make_model(0, family)
    if drafter == "model":
        options = dict(options, draft_model=make_model(1, family))
    else:  # an untrained net of the kind
        options = dict(options, untrained=True)
    engine = specdec.wrap(target, drafter=drafter, num_draft_tokens=GAMMA, max_batch_size=BATCH, max_length=64,
                          **options)
    params = SETTINGS["temperature=1"]
    joint = exact_joint(target, PROMPT, SamplingParams(do_sample=True, **params), NEW)
    counts, totals = sample_counts(engine, params, N, seed=7000)
    assert totals["drafter_failures"] == 0 and totals["proposed"] >= N, totals
    assert 0.05 * totals["proposed"] < totals["accepted"] < 0.9 * totals["proposed"], totals
    stat, df, crit = gof(counts, joint)
    print(f"{family} {options}: chi2 {stat:.1f} df {df} critical {crit:.1f}")
    assert stat < crit, f"{family} {options}: chi2 {stat:.1f} >= critical {crit:.1f} (df {df})"


# ----------------------------------------------------------------------------------------------
# teeth: the same test rejects wrong acceptance rules run through the same engine


def _p_at(target_probs: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return target_probs[torch.arange(n.shape[0]), n]


def accept_every_draft(drafts, draft_probs, target_probs, generator, num_drafts):
    """Wrong: emits every draft (the draft model's own distribution), bonus from p after them."""
    n = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long) if num_drafts is None else num_drafts.long()
    return Acceptance.chain(n, torch.multinomial(_p_at(target_probs, n).double(), 1, generator=generator).squeeze(1),
                            drafts)


def bonus_without_residual(drafts, draft_probs, target_probs, generator, num_drafts):
    """Wrong: the right accept test, but after a rejection the bonus is drawn from p, not norm(max(0, p - q))."""
    n = RIGHT_CHAIN_RULE(drafts, draft_probs, target_probs, generator, num_drafts).num_accepted
    return Acceptance.chain(n, torch.multinomial(_p_at(target_probs, n).double(), 1, generator=generator).squeeze(1),
                            drafts)


@pytest.mark.parametrize("drafter, wrong, n", [
    ("model", accept_every_draft, 500),
    ("model", bonus_without_residual, 2000),
    ("ngram", bonus_without_residual, 1000),
])
def test_wrong_acceptance_is_detected(engines, target, monkeypatch, drafter, wrong, n):
    params = SETTINGS["temperature=1"]
    joint = exact_joint(target, PROMPT, SamplingParams(do_sample=True, **params), NEW)
    monkeypatch.setattr(accept_mod, "_chain_sampling", wrong)  # the rule the engine's `accept_round` runs
    counts, _ = sample_counts(engines[drafter], params, n, seed=7000)
    stat, df, crit = gof(counts, joint)
    print(f"{drafter} {wrong.__name__}: chi2 {stat:.1f} df {df} critical {crit:.1f}")
    assert stat > crit, f"{drafter} {wrong.__name__}: chi2 {stat:.1f} <= critical {crit:.1f} (df {df})"


# ----------------------------------------------------------------------------------------------
# seeds


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_seeded_generate_is_reproducible(engines, drafter):
    engine = engines[drafter]
    prompts = torch.tensor(PROMPT).expand(4, -1)
    kw = dict(max_new_tokens=24, do_sample=True, temperature=1.0, top_p=0.95, eos_token_id=None)
    a = engine.generate(prompts, seed=123, **kw).sequences
    b = engine.generate(prompts, seed=123, **kw).sequences
    c = engine.generate(prompts, seed=124, **kw).sequences
    assert a.shape == (4, len(PROMPT) + 24)
    assert torch.equal(a, b), "same seed, different sequences"
    assert not torch.equal(a, c), "different seeds, same sequences"
    # rows of one batch are independent draws, not copies
    assert len({tuple(r) for r in a.tolist()}) > 1
