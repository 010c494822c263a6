"""Host syncs and launches per speculative round do not grow with the batch size (bench/syncs.py's counter).

It counts, it does not time: a `TorchDispatchMode` sees every aten op of `generate` on the embedded model, and
kernel ops count as a GPU runs them (the Triton wrapper's host side plus one launch). A round reads back to
the host at most: the drafter's block (one host-to-device copy for a host drafter), the block check, the
round's one readback, and a new row index when rows finished in the round before. So the bound is 4 syncs
per round whatever the batch, and the package's own ops per round are the same at every batch size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
syncs = pytest.importorskip("syncs")  # bench/syncs.py
from common import resolve_drafter  # noqa: E402

import specdec  # noqa: E402

ROUND_SYNC_BOUND = 4


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "eagle"])  # eagle: a tree round, its own KV catch-up
def test_syncs_and_launches_per_round_do_not_grow_with_batch(embedded, drafter):
    model, model_dir, prompts = embedded
    name, why = resolve_drafter(model_dir, drafter)
    assert name is not None, why
    rows = {}
    for B in (1, 6):
        engine = specdec.wrap(model, drafter=name, max_batch_size=B)
        # the trained drafters accept up to 8 tokens a round here: more tokens for as many rounds
        rows[B] = syncs.measure(engine, [prompts[i % len(prompts)] for i in range(B)], 24 if drafter == "ngram" else 48)
    for B, r in rows.items():
        assert r["rounds"] > 3, r
        assert r["round_syncs_per_round"] <= ROUND_SYNC_BOUND, (B, r["round_syncs_per_round"], r["top_syncs"])
        assert r["syncs_per_round"] <= 8, (B, r["syncs_per_round"], r["top_syncs"])  # prefill included
    one, many = rows[1]["round_pkg_launches_per_round"], rows[6]["round_pkg_launches_per_round"]
    assert many <= 1.05 * one, f"package ops per round grew with the batch: {one:.1f} at 1, {many:.1f} at 6"


@pytest.mark.parametrize("drafter, static", [("dspark", False), ("dspark", True), ("eagle", False), ("eagle", True)])
def test_drafters_index_their_device_buffers_without_host_copies(embedded, drafter, static):
    """dspark's and eagle's `observe` and `propose` (dynamic and static shapes) place the new positions in
    their device caches from device lengths and the engine's device counts (`Observation.counts`): no line of the
    drafter (its net's module and its drafter's, `draft/<kind>*.py`) reads back or copies host values to the device
    in a round (each did once per round before)."""
    model, model_dir, prompts = embedded
    name, why = resolve_drafter(model_dir, drafter)
    assert name is not None, why
    engine = specdec.wrap(model, drafter=name, max_batch_size=4, static_shapes=static)
    r = syncs.measure(engine, [prompts[i % len(prompts)] for i in range(6)], 24)
    assert r["rounds"] > 3, r
    mine = [(line, n) for line, n in r["top_syncs"] if f"draft/{drafter}" in line]
    assert not mine, mine


def test_counter_sees_syncs():
    """The counter is not blind: `.item()`, `.tolist()`, a boolean mask and `nonzero` each count once."""
    c = syncs.Counter()
    x = torch.arange(6.0)
    with c, syncs.patched(c):
        x.sum().item()
        x.tolist()
        x[x > 2]
        (x > 2).nonzero()
        x + 1
    assert sum(c.syncs.values()) == 4
    assert sum(c.launches.values()) >= 2
