"""CUDA graphs of a round's device steps: (draft +) verify + accept, then commit, one pair per batch bucket.

With static shapes (`SpecConfig.static_shapes`) every round of a bucket launches the same kernels on the same
buffers, so each step can be captured once and replayed. A bucket's first round runs eagerly (it compiles the
kernels and allocates the buffers made on first use); the second is captured and replayed; later rounds copy
their inputs into the captured step's input buffers and replay. Between the two steps the engine reads the
round back (accepted counts, tokens, finiteness), so non-finite logits still raise before anything is
committed. Host bookkeeping that a replay skips (the KV cache's length bounds) is done here. A drafter with a
static draft step (`Drafter.static_draft`: eagle, mtp, dspark) drafts inside the verify step, so its round is
one replay of draft + verify + accept and one of commit.

Greedy rounds are graphed; sampling rounds run the same static-shape steps eagerly (their random draws use a
caller's generator, which a captured graph would not follow).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .round import HostRound, RoundInputs, RoundResult, padded_counts


@dataclass
class Captured:
    """A captured step shape: its own input buffers, the device step's graph ((draft +) verify + accept) and its
    outputs (overwritten by every replay), and the commit graph once captured."""

    inputs: RoundInputs
    step: "torch.cuda.CUDAGraph"
    out: RoundResult
    commit: "torch.cuda.CUDAGraph | None" = None


class RoundGraphs:
    """Per step shape (`ids [Bk, T]`, chain or tree): eager warm-up, capture, replay."""

    def __init__(self, engine):
        self.engine = engine
        self.entries: dict[tuple, object] = {}  # key -> "warm" | "eager" | Captured
        self.pool = None
        self._current: Captured | None = None
        self._slots: list[int] = []  # the round's target slots (padding rows: the null slot)

    def counts(self) -> dict[str, int]:
        """Step shapes by what their rounds run: `captured` (replayed as CUDA graphs), `eager` (their capture
        failed: they run eagerly from then on) and `warm` (seen once, not captured yet)."""
        captured = sum(isinstance(e, Captured) for e in self.entries.values())
        eager = sum(e == "eager" for e in self.entries.values())
        return {"captured": captured, "eager": eager, "warm": len(self.entries) - captured - eager}

    @staticmethod
    def _key(step: RoundInputs) -> tuple:
        return tuple(step.ids.shape), step.parent is not None

    def step(self, step: RoundInputs, sampling) -> RoundResult:
        """The device step of this round (see `specdec.round.RoundStep.device_step`: the draft step of a drafter
        that has a static one, then verify + accept), replayed where captured."""
        eng, key = self.engine, self._key(step)
        entry = self.entries.get(key)
        self._current, self._slots = None, step.host_slots
        if entry is None or entry == "eager":
            if entry is None:
                self.entries[key] = "warm"
            return eng.round_step.device_step(step, sampling, None)
        if entry == "warm":
            return self._capture(key, step, sampling)
        eng.runner.kv.check_room(step.host_slots, step.ids.shape[1])
        for name, buf in entry.inputs.buffers().items():
            buf.copy_(getattr(step, name))
        entry.step.replay()
        self._current = entry
        return entry.out

    def _capture(self, key, step: RoundInputs, sampling) -> RoundResult:
        eng = self.engine
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        inputs = step.copy()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = eng.round_step.device_step(inputs, sampling, None, catch=False)
        except Exception as e:  # e.g. a layer of the model that reads values back: this bucket stays eager
            eng.runner.abort()
            self.entries[key] = "eager"
            warnings.warn(f"cuda_graph: capturing the device step of shape {key[0]} failed ({type(e).__name__}: {e}); "
                          f"those rounds run eagerly", RuntimeWarning, stacklevel=4)
            return eng.round_step.device_step(step, sampling, None)
        graph.replay()
        entry = self.entries[key] = Captured(inputs, graph, out)
        self._current = entry
        return out

    def commit_step(self, res: RoundResult, host: HostRound) -> None:
        """`RoundStep.commit_step` of this round, after its readback; captured right after its device step."""
        eng, entry = self.engine, self._current
        if entry is None:
            eng.round_step.commit_step(res, host)
            return
        if entry.commit is not None:
            entry.commit.replay()
            rows = self._slots
            kept = host.num_kept
            eng.runner.slots.committed(rows, padded_counts(kept, len(rows)))
            return
        graph = torch.cuda.CUDAGraph()
        try:  # runs the commit's host bookkeeping once, for this round; the replay below does the device work
            with torch.cuda.graph(graph, pool=self.pool):
                eng.round_step.commit_step(entry.out, host)
        except Exception as e:
            raise RuntimeError(f"cuda_graph: capturing the commit step failed ({type(e).__name__}: {e}); "
                               f"wrap the model with cuda_graph=False") from e
        graph.replay()
        entry.commit = graph
