"""The native drafter at run time: the checkpoint's MTP layers (`native.Net`: config, net and training in
`draft/native.py`) drafting chains.

Positions and cache (as vLLM's MTP proposer runs these models). The pair `(h_t, x_{t+1})` sits at position t.
Committed pairs (a target hidden state and the token after it, the anchor included) keep their K/V in the
drafter's own `KVCache` (per request row, rollback by length); the anchor's pair (the last committed hidden
state, the anchor) sits at p = committed tokens - 1 and gives draft 1. Draft step k >= 2 feeds step k-1's
`out` and draft k-1 at position p + k - 1; those K/V are dropped when the block is done, so nothing of a
round survives it. Every step runs the first MTP layer (the published checkpoints ship one).
"""

from __future__ import annotations

import torch

from .base import BufferSpec, DraftBlock, Observation, kv_cache_specs
from .head import HeadDrafter, check_positive
from .layers import QUERY_CHUNK, DraftChain
from .native import Net, decoder_stack
from .registry import check_target


class NativeDrafter(HeadDrafter):
    """Chain drafts from a `Net` with its own KV cache over committed pairs (see the module docstring)."""

    name = "native"

    def __init__(self, net: Net, *, gamma: int = 7, max_batch_size: int = 8):
        check_positive("num_draft_tokens", gamma)
        check_positive("max_batch_size", max_batch_size)
        if not isinstance(net, Net):
            raise ValueError(f"drafter: expected a native Net, got {type(net).__name__}")
        self.net, self.gamma, self.max_batch_size = net.eval(), gamma, max_batch_size
        self.kv = None
        self.length: dict[int, int] = {}  # committed pairs in the cache, per row
        self.pending: dict[int, list[torch.Tensor]] = {}  # target hidden states `[n, d]` not yet run

    def bind(self, target) -> None:
        model = target.model
        check_target(self.net.config, model)
        if self.net.target_embed is not decoder_stack(model).embed_tokens:
            raise ValueError("drafter: this native net was read for another target model")
        super().bind(target)
        # the runner's kind of rollback cache, for the drafter's own K/V
        self.kv = target.new_kv_cache(self.max_batch_size, self._room(target.max_length, target.gamma),
                                      device=self.net.fc.weight.device)

    def _room(self, max_length: int, gamma: int) -> int:
        """Cache positions per row beside a target of `max_length` tokens drafting `gamma` per round."""
        return max_length + 2 * max(self.gamma, gamma) + 2

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """The KV cache of its one decoder layer (`TargetView.new_kv_cache`, a row per request row)."""
        return kv_cache_specs("native", self.max_batch_size, self._room(max_length, gamma), self.net.layer,
                              self.net.fc.weight.dtype)

    def begin(self, rows, prompts) -> None:
        self._check_begin(rows)
        for r in rows:
            self.kv.reset(r)
            self.length[r], self.pending[r] = 0, []

    def release(self, rows) -> None:
        for r in rows:
            self.length.pop(r, None)
            self.pending.pop(r, None)
            if self.kv is not None:
                self.kv.reset(r)

    def abort(self, rows) -> None:
        if self.kv is not None:
            self.kv.abort()

    def observe(self, obs: Observation) -> None:
        for r, hs in zip(obs.rows, obs.hidden):
            if hs.shape[0]:
                self.pending.setdefault(r, []).append(hs.detach())

    def _catch_up(self, rows, contexts, rows_t) -> torch.Tensor:
        """Run the queued committed pairs of every row (the anchor's pair last) into the cache, `QUERY_CHUNK` pairs
        per forward; a failure leaves the cache as it was and the pairs queued.
        -> (logits `[B, V]`, out `[B, d]`) of each row's anchor pair."""
        net, kv = self.net, self.kv
        hs, toks, counts = [], [], []
        for r, ctx in zip(rows, contexts):
            queued = self.pending.get(r)
            if not queued:
                raise RuntimeError(f"native: no target hidden states observed for row {r}")
            h = torch.cat(queued) if len(queued) > 1 else queued[0]
            tk = ctx[self.length[r] + 1:]
            if tk.shape[0] != h.shape[0]:
                raise RuntimeError(f"native: row {r} is out of step ({self.length[r]} cached + {h.shape[0]} queued "
                                   f"pairs for a context of {ctx.shape[0]} tokens)")
            hs.append(h)
            toks.append(tk)
            counts.append(h.shape[0])
        B, M = len(rows), max(counts)
        dev = rows_t.device
        hpad = hs[0].new_zeros(B, M, hs[0].shape[-1])
        tpad = torch.zeros(B, M, dtype=torch.long, device=dev)
        for b in range(B):
            hpad[b, :counts[b]] = hs[b]
            tpad[b, :counts[b]] = toks[b].to(dev)
        n = torch.tensor(counts, dtype=torch.long, device=dev)
        last_at, ar = n - 1, torch.arange(B, device=dev)
        logits = out = None
        done = [0] * B  # pairs of each row in the cache so far
        # a chunk of pairs per forward (a prompt's, after a prefill): its mask is the chunk's queries by the keys so
        # far, never M x M; pair i sees the committed pairs and pairs <= i
        try:
            for c0 in range(0, M, QUERY_CHUNK):
                c1 = min(M, c0 + QUERY_CHUNK)
                kv.begin(rows_t, c1 - c0, host_slots=rows)
                lg, o = net.step(tpad[:, c0:c1], hpad[:, c0:c1], kv.positions(), kv.attention_mask(net.dtype),
                                 cache=kv)
                took = [min(max(c - c0, 0), c1 - c0) for c in counts]
                kv.advance((n - c0).clamp(0, c1 - c0), host_counts=took)  # padding stays past the length
                done = [a + b for a, b in zip(done, took)]
                # each row's anchor pair (its last) from the chunk that holds it
                j = (last_at - c0).clamp(0, c1 - c0 - 1)
                here = ((last_at >= c0) & (last_at < c1))[:, None]
                logits = lg[ar, j] if logits is None else torch.where(here, lg[ar, j], logits)
                out = o[ar, j] if out is None else torch.where(here, o[ar, j], out)
        except BaseException:
            kv.abort()
            if any(done):  # the chunks already run leave the cache too: the pairs stay queued
                kv.lengths[rows_t] -= torch.tensor(done, dtype=torch.long, device=dev)
                kv.advance_bound(rows, [-d for d in done])
            raise
        for r, c in zip(rows, counts):
            self.length[r] += c
            self.pending[r] = []
        return logits, out

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        dev = self.net.fc.weight.device
        gamma = min(int(gamma), self.gamma)
        if not rows or gamma < 1:
            return DraftBlock.empty(len(rows), dev)
        rows_t = torch.tensor(rows, dtype=torch.long, device=dev)
        logits, h = self._catch_up(rows, contexts.tensors, rows_t)
        chain, steps = DraftChain(sampling, generator), 0
        try:
            for k in range(gamma):
                if k:  # the draft pair (previous out, previous draft) at the next position; dropped below
                    self.kv.begin(rows_t, 1, host_slots=rows)
                    lg, out = self.net.step(tok[:, None], h[:, None], self.kv.positions(),
                                            self.kv.attention_mask(self.net.dtype), cache=self.kv)
                    self.kv.advance(torch.ones(len(rows), dtype=torch.long, device=dev), host_counts=[1] * len(rows))
                    steps += 1
                    logits, h = lg[:, 0], out[:, 0]
                tok = chain.pick(logits)
        finally:
            self.kv.abort()
            if steps:  # forget the draft pairs: the cache holds committed pairs only
                self.kv.lengths[rows_t] -= steps
                self.kv.advance_bound(rows, [-steps] * len(rows))
        tokens, probs = chain.result()
        return DraftBlock(tokens, torch.full((len(rows),), gamma, dtype=torch.long, device=dev), probs)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, **kwargs) -> NativeDrafter:
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the native drafter (expected native_path)")
    return NativeDrafter(net, gamma=gamma, max_batch_size=max_batch_size)
