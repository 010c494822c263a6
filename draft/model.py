"""A small causal LM as drafter (any model; hybrid ones roll back through the same state machinery)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.verify import Acceptance

from .base import BufferSpec, DraftBlock, Drafter
from .layers import pick_draft


class ModelDrafter(Drafter):
    """Drafts autoregressively with `draft_model`. Its caches only ever commit tokens the target accepted:
    each propose first commits the tokens accepted since the last one (anchor included), then drafts
    token by token in rounds that are aborted, so rejected drafts never touch its state."""

    name = "model"
    observes_features = False  # its own model's runner prefills the token history

    def __init__(self, draft_model, *, runner_factory: Callable, max_batch_size: int = 8, max_length: int = 4096,
                 gamma: int = 7, **unknown):
        """`runner_factory`: builds the draft model's runner; a callable with `specdec.runner.make_runner`'s
        signature (passed in so that draft/ does not depend on the runner)."""
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not an option of the model drafter (it has none)")
        if not callable(runner_factory):
            raise ValueError(f"runner_factory: expected a callable like specdec.runner.make_runner, "
                             f"got {runner_factory!r}")
        self.runner = runner_factory(draft_model, max_batch_size=max_batch_size, max_length=max_length + gamma + 1,
                                     num_verify_tokens=gamma + 1)
        self.gamma = gamma
        self.slot: dict[int, int] = {}
        self.seen: dict[int, int] = {}

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """What its runner allocates at first use (its KV cache; what it allocated at build is in memory already)."""
        plan = self.runner.memory
        return {} if plan is None else {f"draft.{n}": s for n, s in plan.specs(deferred=True).items()}

    def begin(self, rows, prompts):
        slots = self.runner.alloc(len(rows))
        for r, s, p in zip(rows, slots, prompts):
            self.slot[r], self.seen[r] = s, 0

    def abort(self, rows):
        """Drop the open draft round and restart `rows` from scratch: a failure may have come between the
        catch-up forward and its commit, so the next propose re-prefills the whole context."""
        self.runner.abort()
        rows = [r for r in rows if r in self.slot]
        if rows:
            self.runner.release([self.slot[r] for r in rows])
            for r, s in zip(rows, self.runner.alloc(len(rows))):
                self.slot[r], self.seen[r] = s, 0

    def release(self, rows):
        slots = [self.slot.pop(r) for r in rows if r in self.slot]
        for r in rows:
            self.seen.pop(r, None)
        if slots:
            self.runner.release(slots)

    def _next(self, logits: torch.Tensor, sampling, generator):
        tok, q = pick_draft(logits, sampling, generator)
        return int(tok), q

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        gamma = min(gamma, self.gamma)
        drafts, probs = [], []
        for r, ctx in zip(rows, contexts.tensors):
            s = self.slot[r]
            new = ctx[self.seen[r]:]
            if self.seen[r] == 0:
                out = self.runner.prefill(s, new)
            else:
                out = self.runner.forward([s], new[None])
                n = new.shape[0]  # every token the catch-up ran was committed by the target
                self.runner.commit(Acceptance.prefix([n], n, self.runner.device), host_counts=[n])
            self.seen[r] = ctx.shape[0]
            row, qs = [], []
            tok, q = self._next(out.logits[0, -1], sampling, generator)
            row.append(tok)
            qs.append(q)
            while len(row) < gamma:
                out = self.runner.forward([s], torch.tensor([row], dtype=torch.long, device=ctx.device))
                self.runner.abort()
                tok, q = self._next(out.logits[0, -1], sampling, generator)
                row.append(tok)
                qs.append(q)
            drafts.append(row)
            probs.append(qs)
        block = DraftBlock.from_lists(drafts, contexts.tensors[0].device)
        if sampling is not None and sampling.do_sample and drafts:
            block.probs = torch.stack([torch.stack(qs) for qs in probs])
        return block
