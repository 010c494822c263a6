"""The mtp drafter at run time: a trained `mtp.Net` (its config, net and training: `draft/mtp.py`) drafting from the
target's committed KV cache."""

from __future__ import annotations

import torch

from specdec.tensors import outside_inference

from .base import DraftBlock, Observation
from .head import HeadDrafter, check_positive
from .mtp import Net


class MTPDrafter(HeadDrafter):
    """Drafts with a `Net` from the target's committed KV cache and the final hidden state of each request's
    last committed token (kept from `observe` in a `[max_batch_size, d]` buffer, one row per request row).
    Holds no cache of its own, so there is nothing to roll back. A chain of `gamma` drafts (`topk` 1), or
    EAGLE-2's dynamic tree of depth `gamma` with `topk` children per expanded node and `num_nodes` drafts (on
    targets that verify trees; a chain elsewhere). Its drafting is device work over buffers of fixed shape
    (`draft_step`), so with static shapes the engine runs it inside the round's device step (and a CUDA graph
    captures it with the verify)."""

    name = "mtp"
    static_draft = True

    def __init__(self, net: Net, *, gamma: int = 7, topk: int | None = None, num_nodes: int | None = None,
                 max_batch_size: int = 8):
        check_positive("num_draft_tokens", gamma)
        check_positive("max_batch_size", max_batch_size)
        self._tree_options(gamma, topk, num_nodes)
        self.net, self.gamma = net.eval(), gamma
        self.max_batch_size = max_batch_size
        self.h: torch.Tensor | None = None  # [max_batch_size, d]: each row's last committed hidden state
        self.ready: set[int] = set()  # rows whose h is set

    @property
    def target_kv_layers(self) -> tuple[int, ...]:
        return (self.net.config.attn_layer,)

    def bind(self, target) -> None:
        if target.kv is None:
            raise ValueError(f"drafter: mtp reads the target's KV cache, which {type(target.model).__name__} does "
                             f"not expose on its own-forward path (targets of the hybrid runner only)")
        super().bind(target)

    def begin(self, rows, prompts):
        self._check_begin(rows)
        self.ready.difference_update(rows)

    def observe(self, obs: Observation) -> None:
        have = [(r, hs[-1]) for r, hs in zip(obs.rows, obs.hidden) if hs.shape[0]]
        if not have:
            return
        last = torch.stack([x for _, x in have])  # [n, d]: one copy for every row
        if self.h is None:
            with outside_inference():
                self.h = last.new_zeros(self.max_batch_size, last.shape[-1])
        at = [r for r, _ in have]
        self.h[self.target.index(at)] = last
        self.ready.update(at)

    def release(self, rows):
        self.ready.difference_update(rows)

    def _check_rows(self, rows) -> None:
        missing = [r for r in rows if r not in self.ready]
        if missing:
            raise RuntimeError(f"mtp: no committed hidden state observed for rows {missing}")

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        device = contexts.tensors[0].device if contexts.tensors else "cpu"
        if not rows or min(gamma, self.gamma) < 1:
            return DraftBlock.empty(len(rows), device)
        self._check_rows(rows)
        kv = self.target.kv
        slots = self.target.slots(rows)
        span = kv.max_length if kv.static else max(kv.bound[s] for s in slots)  # a host bound, masked per row
        anchors = torch.stack([c[-1] for c in contexts.tensors]).to(device)
        return self._draft(self.target.index(rows), self.target.index(slots), anchors, gamma, span, sampling,
                           generator)

    @torch.no_grad()
    def draft_step(self, rows, rows_t, slots_t, anchors, gamma, *, sampling=None, generator=None) -> DraftBlock:
        """`propose` as device work of fixed shapes: request rows `rows_t [Bk]` (padding rows repeat a real row;
        the engine drops their drafts), their target slots `slots_t [Bk]`, anchors `[Bk]`; the key span is the
        cache's `max_length`. `rows` (the real rows, on the host) are checked here, before any device work."""
        self._check_rows(rows)
        return self._draft(rows_t, slots_t, anchors, gamma, self.target.kv.max_length, sampling, generator)

    def _draft(self, rows_t, slots_t, anchors, gamma, span, sampling, generator) -> DraftBlock:
        gamma = min(gamma, self.gamma)
        ctx = self.net.context_from_cache(self.target.kv, slots_t, span)
        h = self.h[rows_t]
        B = rows_t.shape[0]
        if self.tree:
            return self.net.draft_tree(anchors, h, ctx, gamma, topk=self.topk, num_nodes=self.num_nodes,
                                       sampling=sampling)
        tokens, probs = self.net.draft(anchors, h, ctx, gamma, sampling=sampling, generator=generator)
        return DraftBlock(tokens, torch.full((B,), gamma, dtype=torch.long, device=anchors.device), probs)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 num_nodes: int | None = None, **kwargs) -> MTPDrafter:
    """`specdec.wrap(model, drafter=DIR, topk=..., num_nodes=...)`: `topk` 1 drafts a chain of gamma
    tokens; above 1, EAGLE-2's dynamic tree of depth gamma, `topk` children per expanded node, `num_nodes` drafts
    (the verify window is num_nodes + 1; default 16). Unset, topk is 1: the chain vLLM and SGLang draft.
    `max_batch_size`: request rows at once (the hidden-state buffer's rows)."""
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the mtp drafter (expected topk, num_nodes)")
    return MTPDrafter(net, gamma=gamma, topk=topk, num_nodes=num_nodes, max_batch_size=max_batch_size)
