"""The device step of a round: step inputs, the drafter's static draft step, verify + accept, commit.

`RoundStep` holds the target runner, the drafter and the config (built by `SpecEngine`); the engine's request
loop (`SpecEngine._round`) and the CUDA graphs of `specdec.graphs.RoundGraphs` call it. The steps pass typed
records: `RoundInputs` (from `inputs`), `RoundResult` (from `verify_step`, its `acceptance` committed as it is) and
`HostRound` (the one readback).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Callable

import torch

from specdec.draft import Drafter, DraftBlock
from specdec.kernels.tree import VerifyTree
from specdec.verify import Acceptance, accept_round, probs_from_logits

from .config import SpecConfig
from .stats import SpecStats


def drafter_failed(drafter, what: str, stats: SpecStats | None) -> None:
    """A drafter's failure costs its round's drafts (plain decode): warned, naming the drafter and what went wrong,
    and counted in `stats`."""
    warnings.warn(f"drafter {drafter.name} failed ({what}); plain decode for this round", RuntimeWarning,
                  stacklevel=5)
    if stats is not None:
        stats.drafter_failures += 1


def padded_counts(counts: list[int], rows: int) -> list[int]:
    """A round's kept counts on the host, one per real row, then 0 for each padding row up to `rows`."""
    return counts + [0] * (rows - len(counts))


@dataclass
class RoundInputs:
    """A round's device inputs. Bk rows (B = `num_rows` real ones; static shapes pad to the batch bucket) and T =
    1 + G verify tokens per row.

    ids: `[Bk, T]` long, the anchor then the drafts.
    num_drafts: `[Bk]` long, drafts proposed per row (a chain's; a tree's padding nodes have parent -1).
    parent: `[Bk, T]` long tree parents (checked: `check_block`, or built on the device by a static draft step),
        None for a chain.
    host_slots: the target slot of each row (padding rows: the null slot).
    probs: `[Bk, G, V]` the drafts' distributions (sampling), or None.
    slots: `[Bk]` `host_slots` on the device (static shapes), else None.
    real: `[Bk]` bool, the real rows (static shapes), else None.
    rows: `[Bk]` the drafter rows of a static draft step (padding rows repeat the first), else None.
    draft_rows, gamma: the host side of a static draft step (`draft_rows` None: the drafts are in `ids` already).
    """

    ids: torch.Tensor
    num_drafts: torch.Tensor
    parent: torch.Tensor | None
    host_slots: list[int]
    num_rows: int
    probs: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    real: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    draft_rows: list[int] | None = None
    gamma: int = 0

    # the device tensors a captured step reads: a replay copies a later round's into the captured ones
    BUFFERS = ("ids", "num_drafts", "parent", "slots", "real", "rows")

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.BUFFERS if getattr(self, name) is not None}

    def copy(self) -> "RoundInputs":
        """The same inputs in new device buffers (a capture's own)."""
        return RoundInputs(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
                              for f in fields(self) for v in [getattr(self, f.name)]})

    def tree(self) -> VerifyTree | None:
        """The round's tree, taken as checked (see `parent`)."""
        return None if self.parent is None else VerifyTree(self.parent)


@dataclass
class HostRound:
    """What the host reads of a round, in one transfer, per real row: drafts accepted, finiteness of the logits,
    drafts proposed, draft positions reached, and the emitted tokens (accepted drafts then the bonus)."""

    num_accepted: list[int]
    finite: list[bool]
    num_drafts: list[int]
    reached: list[int]
    tokens: list[list[int]]

    @property
    def num_kept(self) -> list[int]:
        """Tokens each row's target keeps: the anchor and the accepted drafts."""
        return [m + 1 for m in self.num_accepted]


@dataclass
class RoundResult:
    """The verify step's outputs over Bk rows: the `acceptance` record (committed as it is; padding rows keep
    nothing), `finite [Bk]`, `logits [Bk, T, V]`, `hidden [Bk, T, d]`, `captured {layer: [Bk, T, d]}`, and the
    step's `ids`, `num_drafts`, `parent`."""

    acceptance: Acceptance
    finite: torch.Tensor
    logits: torch.Tensor
    hidden: torch.Tensor
    captured: dict
    ids: torch.Tensor
    num_drafts: torch.Tensor
    parent: torch.Tensor | None

    def reached(self, B: int) -> torch.Tensor:
        """Draft positions each of the first B rows' acceptance reached `[B]`: its accepted drafts, plus one when the
        last accepted node has a child (a chain: drafts left; a tree: a node whose parent it is) that was rejected."""
        acc = self.acceptance
        n = acc.num_accepted[:B]
        if self.parent is None:
            return n + (n < self.num_drafts[:B]).long()
        last = acc.path[:B].gather(1, n[:, None])  # [B, 1] node index of the last accepted node
        return n + (self.parent[:B] == last).any(1).long()

    def read(self, B: int) -> HostRound:
        """The first B rows' `HostRound`, in one device-to-host copy."""
        acc = self.acceptance
        n = acc.num_accepted[:B]
        cols = torch.cat([n[:, None], self.finite[:B, None].long(), self.num_drafts[:B, None],
                          self.reached(B)[:, None], acc.tokens[:B]], 1).tolist()
        return HostRound([r[0] for r in cols], [bool(r[1]) for r in cols], [r[2] for r in cols],
                         [r[3] for r in cols], [r[4:5 + r[0]] for r in cols])


class RoundStep:
    """A round's device work for one engine: `inputs`, `device_step` (`draft_step`, then `verify_step`),
    `commit_step`. `buckets`: the static batch buckets; `index(rows)`: the rows as a cached device index tensor."""

    def __init__(self, runner, drafter: Drafter, config: SpecConfig, buckets: list[int],
                 index: Callable[[list[int]], torch.Tensor]):
        self.runner = runner
        self.drafter = drafter
        self.config = config
        self.buckets = buckets
        self.index = index

    def inputs(self, host_slots: list[int], anchors: torch.Tensor, block: DraftBlock | None, sampling,
               gamma: int, *, rows: list[int]) -> RoundInputs:
        """The device step's inputs for the B rows `rows` (`anchors [B]`): Bk = B and T = 1 + G unless the engine
        keeps static shapes, which pads to the batch bucket, gamma drafts or the tree's node budget.

        `block` None: the drafter drafts in the device step (`draft_step`, static shapes only), which fills the
        drafts of `ids`, `num_drafts`, `parent` and `probs` in place."""
        B, dev = len(host_slots), self.runner.device
        if not self.config.static_shapes:
            return RoundInputs(torch.cat([anchors[:, None], block.tokens], 1), block.num_drafts, block.parent,
                               host_slots, B, probs=block.probs if sampling.do_sample else None)
        Bk = self.bucket(B)
        parent = None if block is None else block.parent
        tree = parent is not None or self.drafter.tree
        G = self.runner.num_verify_tokens - 1 if tree else gamma  # the round's gamma: its bucket's entry
        ids = torch.full((Bk, 1 + G), 0, dtype=torch.long, device=dev)
        ids[:B, 0] = anchors
        host = host_slots + [self.runner.slots.null_slot] * (Bk - B)
        # padding nodes: parent -1 and never a child of anything, so never accepted
        step = RoundInputs(ids, torch.zeros(Bk, dtype=torch.long, device=dev),
                           torch.full((Bk, 1 + G), -1, dtype=torch.long, device=dev) if tree else None, host, B,
                           slots=self.runner.slots_tensor(host), real=torch.arange(Bk, device=dev) < B)
        if block is None:
            step.draft_rows, step.gamma = list(rows), gamma
            step.rows = self.index(list(rows) + [rows[0]] * (Bk - B))
        else:
            self.place(step, block, sampling, B=B)
        return step

    @staticmethod
    def place(step: RoundInputs, block: DraftBlock, sampling, *, B: int | None = None) -> None:
        """Write a block's drafts into the static step's buffers, in place: those of its first `B` rows, or (B None:
        the block of a static draft step, one row per bucket row) of every row, padding rows given no drafts, so
        the ops are the same whatever the number of real rows."""
        rows = slice(None) if B is None else slice(0, B)
        tokens, num, parent, probs = block.tokens[rows], block.num_drafts[rows], block.parent, block.probs
        parent = None if parent is None else parent[rows]
        if B is None:
            num = torch.where(step.real, num, 0)
            parent = None if parent is None else torch.where(step.real[:, None], parent, -1)
        g = tokens.shape[1]
        step.ids[rows, 1:1 + g] = tokens
        step.num_drafts[rows] = num
        if parent is not None:
            step.parent[rows, :parent.shape[1]] = parent
        if sampling.do_sample and probs is not None:
            q = probs.new_zeros(step.ids.shape[0], step.ids.shape[1] - 1, probs.shape[-1])
            q[rows, :g] = probs[rows]
            step.probs = q

    def device_step(self, step: RoundInputs, sampling, gen, stats: SpecStats | None = None, *,
                    catch: bool = True) -> RoundResult:
        """The round's device work: the drafter's static draft step where it has one, then `verify_step`."""
        if step.draft_rows is not None:
            self.draft_step(step, sampling, gen, stats, catch=catch)
        return self.verify_step(step, sampling, gen)

    def draft_step(self, step: RoundInputs, sampling, gen, stats: SpecStats | None, *, catch: bool = True) -> None:
        """The drafter's `draft_step` into the step's buffers (real rows only: padding rows keep no drafts).
        Device ops of fixed shapes only. A drafter that raises costs this round's drafts (plain decode), as
        in `SpecEngine._propose`; with `catch` False (a CUDA-graph capture) the error propagates."""
        try:
            block = self.drafter.draft_step(step.draft_rows, step.rows, step.slots, step.ids[:, 0], step.gamma,
                                            sampling=sampling, generator=gen)
        except Exception as e:
            if not catch:
                raise
            drafter_failed(self.drafter, f"{type(e).__name__}: {e}", stats)
            return
        self.place(step, block, sampling)

    def bucket(self, B: int) -> int:
        """The static batch bucket of a round of B rows."""
        return next(b for b in self.buckets if b >= B)

    def verify_step(self, step: RoundInputs, sampling, gen) -> RoundResult:
        """Verify forward + acceptance over `step`; device ops only."""
        ids, tree = step.ids, step.tree()
        capture = tuple(self.drafter.feature_layers)
        out = self.runner.forward(step.host_slots, ids, parent=tree, capture=capture, slots_t=step.slots)
        # the round is open from here on: whatever raises, generate's handler aborts it (nothing committed)
        finite = torch.isfinite(out.logits).flatten(1).all(1)  # read back with the round; raised before commit
        if step.real is not None:
            finite = finite | ~step.real
        if sampling.do_sample:
            p = probs_from_logits(torch.where(finite[:, None, None], out.logits, 0), sampling)
            acc = accept_round(ids, tree, num_drafts=step.num_drafts, draft_probs=step.probs, target_probs=p,
                               generator=gen)
        else:
            acc = accept_round(ids, tree, num_drafts=step.num_drafts, logits=out.logits)
        return RoundResult(acc.masked(step.real), finite, out.logits, out.hidden, out.captured, ids, step.num_drafts,
                           step.parent)

    def commit_step(self, res: RoundResult, host: HostRound) -> None:
        """Commit the round's acceptance (padding rows keep nothing)."""
        kept = host.num_kept
        self.runner.commit(res.acceptance, host_counts=padded_counts(kept, res.ids.shape[0]))
