"""The dspark drafter at run time: a trained `dspark.Net` (its config, net and training: `draft/dspark.py`)
drafting blocks.

Use: `specdec.wrap(model, drafter=DIR)` (trained with `python -m specdec draft-train --drafter dspark`) or
`drafter="dspark", untrained=True` (an untrained net sized for the target); options `confidence_threshold` (default
0: never truncate; chains only) and the draft shape `topk` / `num_nodes`: topk 1 drafts the block as one chain;
above 1 (on targets that verify trees) EAGLE-2's dynamic tree over the block's slots, each node's children scored by
the block's logits of its slot plus the Markov term of the node's own token, so the tree costs no more drafter
forwards than the chain (`DSparkDrafter._tree`). Unset, topk is 1: the reference's block, one chain.
"""

from __future__ import annotations

import torch

from specdec.tensors import outside_inference, run_of

from .base import BufferSpec, DraftBlock, Observation, grown_kv_specs, pad_rows
from .dspark import Net
from .head import HeadDrafter, check_positive
from .layers import DraftChain, ring_positions, ring_write
from .tree import DynamicTree, log_scores


class DSparkDrafter(HeadDrafter):
    """Drafts DSpark blocks. The context cache (each layer's K, V of the target features at the committed
    positions) is one buffer per layer, `[max_batch_size, H, cap, D]`, a row per request row, filled by
    `observe` for all rows at once; lengths are kept on the host (`length`) and, for the static draft step, read
    from the target's committed lengths, which they equal.

    A row holds position p at slot `p % cap`. Without a context window (`context_window` 0) the cache grows to hold
    every position (it never wraps); with static shapes it holds the target's whole `max_length` from the first
    `observe` on. With a window W a block reads only the last W positions, so the cache is a ring of at most
    `W + num_verify_tokens` slots (`_ring`): the window, and room to drop one round's observed positions again
    (`propose`). Drafting reads the first `span` slots (all of them once a row wraps) and masks each by the position
    it holds, so a round's cost is bounded by the ring, not the context. `draft_step` drafts over the whole cache
    (masked per row), so the engine runs drafting inside the round's device step (and a CUDA graph captures it with
    the verify)."""

    name = "dspark"
    static_draft = True

    def __init__(self, net: Net, *, gamma: int = 7, max_batch_size: int = 8, confidence_threshold: float = 0.0,
                 topk: int | None = None, num_nodes: int | None = None):
        check_positive("gamma", gamma)
        if (isinstance(confidence_threshold, bool) or not isinstance(confidence_threshold, (int, float))
                or not 0.0 <= confidence_threshold <= 1.0):
            raise ValueError(f"confidence_threshold: expected a number in [0, 1] (0 never truncates), got "
                             f"{confidence_threshold!r}")
        check_positive("max_batch_size", max_batch_size)
        self.net = net.eval()  # each round drafts propose's gamma; this one sizes the ring of an unbound drafter
        self.gamma = gamma
        self.max_batch_size = max_batch_size
        self._tree_options(gamma, topk, num_nodes)
        if confidence_threshold > 0 and self.topk > 1:
            raise ValueError(f"topk: the confidence threshold truncates a chain (topk 1), got topk {topk!r} with "
                             f"confidence_threshold {confidence_threshold!r}")
        self.confidence_threshold = float(confidence_threshold)
        self.feature_layers = tuple(net.config.feature_layers)
        self.k: list[torch.Tensor] = []  # per layer [max_batch_size, H, cap, D]
        self.v: list[torch.Tensor] = []
        self.length: dict[int, int] = {}  # committed positions cached per request row
        self.len_t: torch.Tensor | None = None  # the same on the device [max_batch_size]
        self.last_confidence: torch.Tensor | None = None  # [B, G] of the last propose (diagnostics)

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """The context cache: each layer's K/V over the target's window (see `grown_kv_specs`), or with a context
        window over the ring (`_ring`), which the cache reaches and never outgrows with either shapes."""
        attns, dtype = [b.attn for b in self.net.layers], self.net.mask_embed.dtype
        window = max_length + num_verify_tokens
        ring = self._ring(num_verify_tokens)
        if ring is not None:
            return grown_kv_specs("dspark", attns, self.max_batch_size, min(ring, window), dtype, static=True)
        return grown_kv_specs("dspark", attns, self.max_batch_size, window, dtype, static=static)

    def _ring(self, num_verify_tokens: int | None = None) -> int | None:
        """Slots per row of a windowed cache: the window W and one verify window (`num_verify_tokens`: the bound
        target's, else this drafter's own), the positions a round may observe and `propose` drop again; None
        without a window (the cache holds every position)."""
        W = self.net.config.context_window
        if not W:
            return None
        if num_verify_tokens is None:
            num_verify_tokens = (self.target.num_verify_tokens if self.target is not None
                                 else self.max_verify_tokens(self.gamma))
        return W + num_verify_tokens

    def begin(self, rows, prompts):
        self._check_begin(rows)
        for r in rows:
            self.length[r] = 0
        if self.len_t is None:
            with outside_inference():
                self.len_t = torch.zeros(self.max_batch_size, dtype=torch.long, device=self.net.mask_embed.device)
        self.len_t[self._index(list(rows), self.len_t.device)] = 0

    def release(self, rows):
        for r in rows:
            self.length.pop(r, None)

    def _reserve(self, need: int, like: list[torch.Tensor]) -> None:
        """Room for positions `0 .. need - 1` per row (the buffers shaped after `like`'s K per layer `[B, H, n, D]`),
        never more than the ring (`_ring`), where later positions wrap; with static shapes the whole target
        `max_length` (plus a verify window), or the ring, at once, so the span never changes. A cache grows only
        before it wraps (its rows hold every position at its own index), so the slots it keeps stay valid."""
        cap = self.k[0].shape[2] if self.k else 0
        ring = self._ring()
        if ring is not None:
            need = min(need, ring)
        if need <= cap:
            return
        if self._static_shapes():
            new = max(need, self.target.max_length + self.target.num_verify_tokens)
        else:
            new = max(need, 2 * cap, 64)
        if ring is not None:
            new = min(new, ring)
        for buf in (self.k, self.v):
            for j, x in enumerate(like):
                with outside_inference():
                    grown = x.new_zeros(self.max_batch_size, x.shape[1], new, x.shape[3])
                if cap:
                    grown[:, :, :cap] = buf[j]
                if j < len(buf):
                    buf[j] = grown
                else:
                    buf.append(grown)

    @torch.no_grad()
    def observe(self, obs: Observation) -> None:
        """Every row's new committed positions in one pass: their features padded to the longest, one context
        projection and one indexed write per layer (a row's padding is not written). With a context window only
        each row's last ring's worth of new positions are projected and written: the earlier ones would be
        overwritten before any block reads them."""
        net = self.net
        rows, counts = obs.rows, obs.sizes
        M = max(counts, default=0)
        if M == 0:
            return
        dtype = net.mask_embed.dtype
        dev = obs.features[self.feature_layers[0]][0].device
        starts = [self.length.setdefault(r, 0) for r in rows]
        if self.len_t is None:  # rows observed without `begin`: they start at 0
            with outside_inference():
                self.len_t = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
        rows_t = self._index(list(rows), dev)
        # the starts from the device lengths (`begin` zeroes them), the counts from the engine: no host copy
        start_t = self.len_t[rows_t]
        count_t = obs.counts.to(dev)
        ring = self._ring()
        if ring is not None and M > ring:  # each row's last `ring` new positions (all of a shorter row's), from 0
            feats = [pad_rows([x[-ring:] for x in obs.features[l]]) for l in self.feature_layers]  # [B, ring, d]
            n_t = count_t.clamp(max=ring)
            j = torch.arange(ring, device=dev)
            cols, keep = (count_t - n_t)[:, None] + j, j < n_t[:, None]  # [B, ring]: their columns, which are new
        else:
            feats = [obs.padded_features(l) for l in self.feature_layers]  # per layer [B, M, d]
            cols = torch.arange(M, device=dev).expand(rows_t.shape[0], M)  # [B, M]
            keep = cols < count_t[:, None]  # a row's padding is not written
        pos = start_t[:, None] + cols  # [B, n]
        kv = net.context_kv(net.context([f.to(dtype) for f in feats]), pos)  # per layer [B, H, n, D]
        self._reserve(max(starts) + M, [k for k, _ in kv])
        ring_write(zip(self.k, self.v), rows_t, pos, keep, kv)  # n <= cap here (`_reserve`): distinct slots
        self.len_t[rows_t] = start_t + count_t
        for r, n in zip(rows, counts):
            self.length[r] += n

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        net = self.net
        B = len(rows)
        dev = net.mask_embed.device
        if B == 0 or gamma < 1:
            return DraftBlock.empty(B, dev)
        lengths, dropped = [], False
        for r, ctx in zip(rows, contexts.tensors):
            have = self.length.get(r, 0)
            if have == 0:
                raise ValueError(f"dspark: no target features observed for row {r}")
            want = ctx.shape[0] - 1  # every committed position; the last context token is the anchor
            if have > want:  # positions observed past the context: dropped (their cache entries are overwritten)
                self._check_drop(r, have, want)
                self.length[r] = have = want
                dropped = True
            if have != want:
                raise ValueError(f"dspark: row {r} has {have} observed positions, expected {want}")
            lengths.append(want)
        anchors = torch.stack([ctx[-1] for ctx in contexts.tensors]).to(dev)
        rows_t = self._index(list(rows), dev)
        if dropped:  # the device lengths follow (one copy, on this path only)
            self.len_t[rows_t] = torch.tensor(lengths, dtype=torch.long, device=dev)
        # slots past the longest row's length hold nothing yet (a row wraps only past the whole cache)
        span = min(max(lengths), self.k[0].shape[2])
        return self._draft(rows_t, self.len_t[rows_t], anchors, gamma, span, sampling, generator, run=run_of(rows))

    def _check_drop(self, row: int, have: int, want: int) -> None:
        """A row cut back from `have` to `want` positions still holds the window before `want`: a ring keeps the
        last `cap` positions observed, `cap - W` more than a block reads."""
        W, cap = self.net.config.context_window, self.k[0].shape[2]
        if W and have > cap and have - want > cap - W:
            raise ValueError(f"dspark: row {row} drops {have - want} observed positions, more than its context "
                             f"cache keeps beyond the window ({cap - W})")

    @torch.no_grad()
    def draft_step(self, rows, rows_t, slots_t, anchors, gamma, *, sampling=None, generator=None) -> DraftBlock:
        """`propose` as device work of fixed shapes (see `Drafter.draft_step`): each row's cached length is the
        target's committed length of its slot, and the span the whole cache."""
        kv = self.target.kv
        for r, s in zip(rows, self.target.slots(rows)):
            if self.length.get(r, 0) == 0:
                raise ValueError(f"dspark: no target features observed for row {r}")
            if self.length[r] != kv.bound[s]:  # the engine commits with host counts: bound is the length
                raise ValueError(f"dspark: row {r} has {self.length[r]} observed positions, its target slot "
                                 f"{kv.bound[s]} committed")
        lens = kv.lengths[slots_t]
        return self._draft(rows_t, lens, anchors, gamma, self.k[0].shape[2], sampling, generator)

    def _draft(self, rows_t, lens, anchors, gamma, span, sampling, generator, *, run: slice | None = None
               ) -> DraftBlock:
        """The block after `anchors [B]` of rows `rows_t [B]` whose contexts hold `lens [B]` positions, reading the
        first `span` slots of the cache (every slot that holds one of the rows' positions: all of them once a
        row wraps), each visible as the position it holds is (`Net.context_visible`). `run`: the same rows as a
        slice where they are consecutive, so the cache is read as a view, not gathered."""
        net = self.net
        B, dev = rows_t.shape[0], anchors.device
        G = max(gamma, net.config.block_size)
        cap = self.k[0].shape[2]
        sel = rows_t if run is None else run
        kv = [(k[sel, :, :span], v[sel, :, :span]) for k, v in zip(self.k, self.v)]
        held = ring_positions(lens, span, cap)  # [B, span]
        ctx_ok = (held >= 0) & net.context_visible(held, lens)  # negative: a slot no position reached yet
        ok = torch.cat([ctx_ok, torch.ones(B, G, dtype=torch.bool, device=dev)], 1)  # [B, span + G]: every slot alike
        pos = lens[:, None] + torch.arange(G, device=dev)
        h = net.block_hidden(anchors[:, None], pos, kv, ok[:, None])[:, :gamma]  # [B, gamma, d]
        base = net.lm_head(h)
        if self.tree:
            self.last_confidence = None
            return self._tree(base, anchors, gamma, sampling)
        prev = anchors
        chain, prevs = DraftChain(sampling, generator), []
        for i in range(gamma):
            prevs.append(prev)
            prev = chain.pick(base[:, i] + net.markov(prev))
        tokens, probs = chain.result()
        conf = net.confidence_prob(h, torch.stack(prevs, 1))  # [B, gamma]
        self.last_confidence = conf
        num = torch.full((B,), gamma, dtype=torch.long, device=dev)
        if self.confidence_threshold > 0:
            keep = conf.cumprod(-1) >= self.confidence_threshold
            num = keep.long().cumprod(-1).sum(-1).clamp(min=1)
        return DraftBlock(tokens, num, probs)

    def _tree(self, base: torch.Tensor, anchors: torch.Tensor, depth: int, sampling) -> DraftBlock:
        """EAGLE-2's dynamic tree (`tree.DynamicTree`) over the block's slots: a node at depth i (slot i - 1)
        scores its children with `base[:, i] + markov(node token)`, the chain's logits with the node as the
        previous draft. `base [B, >= depth, V]` comes from the one block forward, so expanding costs only the
        Markov head."""
        net = self.net
        tree = DynamicTree(log_scores(base[:, 0] + net.markov(anchors), sampling), self.topk)
        for i in range(1, depth):
            sel, _, tok = tree.frontier()
            tree.grow(sel, log_scores(base[:, i, None] + net.markov(tok), sampling))
        return tree.block(self.num_nodes)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, confidence_threshold: float = 0.0,
                 **unknown) -> DSparkDrafter:
    """The `drafter="dspark"` drafter around `net` (untrained from `build_drafter_net("dspark", target)`, or
    loaded from a trained directory). Options: confidence_threshold (0 never truncates a chain), topk and
    num_nodes (the draft shape; see the module docstring)."""
    extra = sorted(set(unknown) - {"topk", "num_nodes"})
    if extra:
        raise ValueError(f"{extra[0]}: not an option of the dspark drafter (options: confidence_threshold, topk, "
                         f"num_nodes)")
    if not isinstance(net, Net):
        raise ValueError(f"drafter: expected a dspark Net, got {type(net).__name__}")
    return DSparkDrafter(net, gamma=gamma, max_batch_size=max_batch_size, confidence_threshold=confidence_threshold,
                         **unknown)
