"""The device step of a round: step inputs, the drafter's static draft step, verify + accept, commit.

`RoundStep` holds the target runner, the drafter and the config (built by `SpecEngine`); the engine's request
loop (`SpecEngine._round`) and the CUDA graphs of `specdec.graphs.RoundGraphs` call it. The steps pass dicts:
`step` (`inputs`) and `res` (`verify_step`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from specdec.draft import Drafter, DraftBlock
from specdec.verify import (accept_chain_greedy, accept_chain_sampling, accept_tree_greedy, accept_tree_sampling,
                            probs_from_logits)

from .config import SpecConfig
from .runner import path_and_count
from .stats import SpecStats


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
               gamma: int, *, rows: list[int]) -> dict:
        """The device step's inputs: `ids [Bk, T]` (anchor, drafts), `slots [Bk]`, `num_drafts [Bk]`, `real [Bk]`
        bool, `parent [Bk, T]` or None, `probs` (sampling: `[Bk, G, V]` or None); Bk = B and T = 1 + G unless
        the engine keeps static shapes, which pads to the batch bucket, gamma drafts or the tree's node budget.

        `block` None: the drafter drafts in the device step (`draft_step`, static shapes only), which fills
        the drafts of `ids`, `num_drafts`, `parent` and `probs` in place; `draft` holds its host inputs and
        `rows [Bk]` the request rows (padding rows repeat the first)."""
        B, dev = len(host_slots), self.runner.device
        if not self.config.static_shapes:
            return dict(ids=torch.cat([anchors[:, None], block.tokens], 1), slots=None, host_slots=host_slots,
                        num_drafts=block.num_drafts, real=None, parent=block.parent,
                        probs=block.probs if sampling.do_sample else None, draft=None, rows=None)
        Bk = self.bucket(B)
        parent = None if block is None else block.parent
        tree = parent is not None or getattr(self.drafter, "tree", False)
        G = self.runner.num_verify_tokens - 1 if tree else gamma  # the round's gamma: its bucket's entry
        ids = torch.full((Bk, 1 + G), 0, dtype=torch.long, device=dev)
        ids[:B, 0] = anchors
        num_p = torch.zeros(Bk, dtype=torch.long, device=dev)
        host = host_slots + [self.runner.state.pool.null_slot] * (Bk - B)
        slots_t = self.runner.slots_tensor(host)
        real = torch.arange(Bk, device=dev) < B
        # padding nodes: parent -1 and never a child of anything, so never accepted
        par = torch.full((Bk, 1 + G), -1, dtype=torch.long, device=dev) if tree else None
        step = dict(ids=ids, slots=slots_t, host_slots=host, num_drafts=num_p, real=real, parent=par, probs=None,
                    draft=None, rows=None)
        if block is None:
            step["draft"] = dict(rows=list(rows), gamma=gamma)
            step["rows"] = self.index(list(rows) + [rows[0]] * (Bk - B))
        else:
            self.place(step, block, sampling, B=B)
        return step

    @staticmethod
    def place(step: dict, block: DraftBlock, sampling, *, B: int | None = None) -> None:
        """Write a block's drafts into the static step's buffers, in place: those of its first `B` rows, or (B None:
        the block of a static draft step, one row per bucket row) of every row, padding rows given no drafts, so
        the ops are the same whatever the number of real rows."""
        rows = slice(None) if B is None else slice(0, B)
        tokens, num, parent, probs = block.tokens[rows], block.num_drafts[rows], block.parent, block.probs
        parent = None if parent is None else parent[rows]
        if B is None:
            real = step["real"]
            num = torch.where(real, num, 0)
            parent = None if parent is None else torch.where(real[:, None], parent, -1)
        g = tokens.shape[1]
        step["ids"][rows, 1:1 + g] = tokens
        step["num_drafts"][rows] = num
        if parent is not None:
            step["parent"][rows, :parent.shape[1]] = parent
        if sampling.do_sample and probs is not None:
            q = probs.new_zeros(step["ids"].shape[0], step["ids"].shape[1] - 1, probs.shape[-1])
            q[rows, :g] = probs[rows]
            step["probs"] = q

    def device_step(self, step: dict, sampling, gen, stats: SpecStats | None = None, *, catch: bool = True) -> dict:
        """The round's device work: the drafter's static draft step where it has one, then `verify_step`."""
        if step["draft"] is not None:
            self.draft_step(step, sampling, gen, stats, catch=catch)
        return self.verify_step(step, sampling, gen)

    def draft_step(self, step: dict, sampling, gen, stats: SpecStats | None, *, catch: bool = True) -> None:
        """The drafter's `draft_step` into the step's buffers (real rows only: padding rows keep no drafts).
        Device ops of fixed shapes only. A drafter that raises costs this round's drafts (plain decode), as
        in `SpecEngine._propose`; with `catch` False (a CUDA-graph capture) the error propagates."""
        d, ids = step["draft"], step["ids"]
        try:
            block = self.drafter.draft_step(d["rows"], step["rows"], step["slots"], ids[:, 0], d["gamma"],
                                            sampling=sampling, generator=gen)
        except Exception as e:
            if not catch:
                raise
            warnings.warn(f"drafter {getattr(self.drafter, 'name', type(self.drafter).__name__)} failed "
                          f"({type(e).__name__}: {e}); plain decode for this round", RuntimeWarning, stacklevel=4)
            if stats is not None:
                stats.drafter_failures += 1
            return
        self.place(step, block, sampling)

    def bucket(self, B: int) -> int:
        """The static batch bucket of a round of B rows."""
        return next(b for b in self.buckets if b >= B)

    def verify_step(self, step: dict, sampling, gen) -> dict:
        """Verify forward + acceptance over `step` (see `inputs`); device ops only. -> n `[Bk]` accepted
        drafts, bonus `[Bk]`, path `[Bk, M]` (-1 padded), new `[Bk, M]` (accepted drafts, then the bonus at n),
        finite `[Bk]`, logits `[Bk, T, V]`, hidden `[Bk, T, d]`, captured."""
        ids, parent = step["ids"], step["parent"]
        capture = tuple(self.drafter.feature_layers)
        out = self.runner.forward(step["host_slots"], ids, parent=parent, capture=capture, slots_t=step["slots"])
        # the round is open from here on: whatever raises, generate's handler aborts it (nothing committed)
        finite = torch.isfinite(out.logits).flatten(1).all(1)  # read back with the round; raised before commit
        if step["real"] is not None:
            finite = finite | ~step["real"]
        tokens = ids[:, 1:]
        if sampling.do_sample:
            logits = torch.where(finite[:, None, None], out.logits, 0)
            p = probs_from_logits(logits, sampling)
        if parent is None:
            if sampling.do_sample:
                n, bonus = accept_chain_sampling(tokens, step["probs"], p, generator=gen,
                                                 num_drafts=step["num_drafts"], validate=False)
            else:
                n, bonus = accept_chain_greedy(tokens, out.logits, num_drafts=step["num_drafts"], validate=False)
            path, _ = path_and_count(n + 1, None, ids.shape[0], ids.shape[1], ids.device)
        else:
            if sampling.do_sample:
                q = step["probs"]
                q = None if q is None else torch.cat([torch.zeros_like(q[:, :1]), q], 1)
                path, bonus = accept_tree_sampling(ids, parent, q, p, generator=gen, validate=False)
            else:
                path, bonus = accept_tree_greedy(ids, parent, out.logits, validate=False)
            n = (path >= 0).sum(1) - 1
        j = torch.arange(path.shape[1], device=ids.device)
        new = torch.cat([ids.gather(1, path[:, 1:].clamp(min=0)), bonus[:, None]], 1)
        new = torch.where(j[None] == n[:, None], bonus[:, None], new)
        return dict(n=n, bonus=bonus, path=path, new=new, finite=finite, logits=out.logits, hidden=out.hidden,
                    captured=out.captured, ids=ids, num_drafts=step["num_drafts"], parent=parent)

    def commit_step(self, step: dict, res: dict, host_slots: list[int], n_h: list[int]) -> None:
        """Commit the accepted path of every real row (padding rows keep nothing)."""
        path = res["path"]
        if step["real"] is not None:
            path = torch.where(step["real"][:, None], path, -1)
        counts = [m + 1 for m in n_h] + [0] * (path.shape[0] - len(n_h))
        self.runner.commit(path=path, host_counts=counts)
