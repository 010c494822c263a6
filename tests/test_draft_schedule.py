"""The draft-length schedule (`wrap(model, draft_tokens_by_batch={B: drafts})`): fewer drafts at larger batches.

Float64 tiny targets of transformers' own classes, three requests that finish at different rounds (so the batch
shrinks 3 -> 2 -> 1):
- every round drafts what the schedule gives for its batch (its bucket with static shapes), capped by the tokens
  still to generate, and verifies that many tokens plus the anchor;
- the output equals transformers' own greedy `generate`, dynamic and static shapes, chain and tree drafters;
- a malformed schedule is refused at `wrap`, naming the option.
"""

from __future__ import annotations

import pytest
from tiny_models import assert_greedy, generate_f64

import specdec
from specdec.draft.ngram import NgramDrafter
from specdec.config import SpecConfig

FAMILY = "qwen3_5"  # conftest's `target`
GAMMA = 4
SCHEDULE = {2: 2, 3: 1}
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13, 11], [3, 41, 17, 88, 9]]
NEW = 14


class _Recording(NgramDrafter):
    """Prompt lookup that records (rows, gamma) of every round."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def propose(self, rows, contexts, gamma, **kw):
        self.calls.append((len(rows), gamma))
        return super().propose(rows, contexts, gamma, **kw)


@pytest.mark.parametrize("static", [False, True])
def test_rounds_follow_the_schedule(target, static):
    drafter = _Recording()
    engine = specdec.wrap(target, drafter=drafter, num_draft_tokens=GAMMA, max_batch_size=4, max_length=64,
                          static_shapes=static, draft_tokens_by_batch=SCHEDULE)
    widths = []
    inner = engine.round_step.verify_step
    engine.round_step.verify_step = lambda step, *a, **k: (widths.append(tuple(step.ids.shape)), inner(step, *a, **k))[1]
    out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
    assert_greedy(out, target, PROMPTS, NEW)
    sizes = [rows for rows, _ in drafter.calls]
    assert sizes[0] == 3 and 1 in sizes, f"the batch did not shrink: {sizes}"
    # the schedule, written out: 3 rows (bucket 4) -> 1 draft, 2 rows -> 2, 1 row -> gamma
    expected = {1: GAMMA, 2: 2, 3: 1, 4: 1}
    for (rows, gamma), (bk, width) in zip(drafter.calls, widths):
        if static:
            assert gamma == expected[bk] and width == 1 + expected[bk], (rows, gamma, bk, width)
        else:
            assert gamma <= expected[rows] and bk == rows and width <= 1 + gamma, (rows, gamma, width)
    if not static:  # capped only by the tokens still to generate, which are many in the first rounds
        assert drafter.calls[0] == (3, 1)


def test_tree_depth_follows_the_schedule(target):
    engine = specdec.wrap(target, drafter="eagle", untrained=True, num_draft_tokens=GAMMA, max_batch_size=4,
                          max_length=64, topk=2, num_nodes=6, draft_tokens_by_batch={3: 1})
    depths = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda rows, ctx, gamma, **k: (depths.append((len(rows), gamma)),
                                                            propose(rows, ctx, gamma, **k))[1]
    out = generate_f64(engine, PROMPTS, max_new_tokens=NEW)
    assert_greedy(out, target, PROMPTS, NEW)
    assert depths[0] == (3, 1) and all(g == 1 for n, g in depths if n == 3)


@pytest.mark.parametrize("bad", [{0: 2}, {2: 0}, {2: GAMMA + 1}, {2: 2.5}, {True: 2}, [(2, 2)], {"8": 3}])
def test_malformed_schedule_refused(target, bad):
    with pytest.raises(ValueError, match=r"draft_tokens_by_batch: expected a dict \{batch size >= 1: drafts in "
                                         r"\[1, num_draft_tokens = 4\]\}"):
        specdec.wrap(target, num_draft_tokens=GAMMA, draft_tokens_by_batch=bad)


def test_gamma_for():
    cfg = SpecConfig(num_draft_tokens=7, draft_tokens_by_batch={16: 2, 4: 5, 8: 3})
    assert [cfg.gamma_for(b) for b in (1, 3, 4, 7, 8, 15, 16, 64)] == [7, 7, 5, 5, 3, 3, 2, 2]
    assert SpecConfig(num_draft_tokens=6).gamma_for(64) == 6
