"""The eagle drafter at run time: a trained `eagle.Net` (its config, net and training: `draft/eagle.py`; a published
EAGLE-3 checkpoint: `draft/eagle3_format.py`) drafting a dynamic tree verified as a tree.

Cache. Only committed positions (pairs of a target feature and the token after it) are ever kept in the
drafter's KV cache. After a prefill `observe` runs the prompt's pairs, all rows together, `layers.QUERY_CHUNK`
pairs per forward (each chunk over the keys of the chunks before it; a one-layer net, EAGLE-3's, makes their K/V
alone, `_catch_up`); after a round
it queues the pairs whose next token is now committed (the previous root pair, then the accepted ones) on
the device, and keeps each row's last committed feature (`root_f`) and cached length (`len_t`) there too.
A draft runs each row's queue and its root pair (that feature and the anchor) in one forward: the queue's
K/V join the cache, the root's stays in the round's scratch. Then the tree: its nodes live in that scratch
and see the committed cache plus their own ancestors (ancestor mask), at positions `root + depth`; nothing
of a round's tree survives it, so rollback is free.

Tree: EAGLE-2's dynamic tree (`tree.DynamicTree`, grown by `eagle.Net.draft_tree`): at every depth the `topk`
best candidates of the newest depth are expanded into their `topk` most likely children; the best `num_nodes` by
cumulative draft log-probability are kept, in topological order. The drafts are deterministic functions of the committed
history, so the block carries `probs=None` (one-hot q): recursive rejection over distinct siblings with
one-hot q is exactly sampling from the target, so this is lossless for sampling as well as greedy.

Context window. With a window W (the `context_window` option, else the net's config; `eagle.Config`) a query at
position p attends to keys at positions > p - W only, so no query of a round reaches a committed position more than
W - 1 before the round's first, and the cache is a ring of W slots per row: position p at slot `p % W`, each slot
masked by the position it holds. A prompt's observe keeps only each row's last W pairs, and a round writes only its
committed pairs: a round reads W slots whatever the context, and the cache never holds more.

Static shapes (the CUDA-graph path): the cache is sized once for the target's `max_length` (or the ring) and the
queue for one verify window, and `draft_step` drafts over all of both; `propose` over the rows' longest cache and
queue (host bounds).
"""

from __future__ import annotations

import torch

from specdec.tensors import outside_inference, run_of

from .base import BufferSpec, DraftBlock, Observation, grown_kv_specs
from .eagle import Net
from .head import HeadDrafter, check_positive
from .layers import QUERY_CHUNK, KVRoom, ring_positions, ring_write
from .registry import check_target


def _columns(kvs, cols: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer K/V `[B, H, n, D]` -> the entries at columns `cols [B, R]` of each row, `[B, H, R, D]`."""
    at = cols[:, None, :, None]
    return [tuple(x.gather(2, at.expand(-1, x.shape[1], -1, x.shape[3])) for x in kv) for kv in kvs]


class _Row:
    __slots__ = ("length", "pending", "rooted")

    def __init__(self):
        # the host's copies of `len_t` and `pend_n` (committed pairs in the cache, queued for the next draft):
        # host bounds of the dynamic path, not kept with static shapes
        self.length = 0
        self.pending = 0
        self.rooted = False  # the row's last committed feature is in `root_f`


# The default tree, by the device the drafter runs on. On a GPU a verify window's cost barely grows with its tokens
# (the weights are read once for all of them), so the tree is EAGLE-2's size. On a CPU every node is target compute,
# so a narrow tree wins on the embedded model despite its lower tau (measured: bench/verify_cost.py,
# bench/results/HISTORY.md, "EAGLE's default tree, by device").
DEFAULT_TREE = {"cuda": dict(topk=8, num_nodes=48), "cpu": dict(topk=2, num_nodes=16)}


def default_tree(device: torch.device) -> dict:
    """`{"topk", "num_nodes"}` of the default tree on `device` (a CPU's, or the accelerators' one)."""
    return DEFAULT_TREE["cpu" if torch.device(device).type == "cpu" else "cuda"]


class EagleDrafter(HeadDrafter):
    """Dynamic-tree drafts from an EAGLE-3 `Net`; see the module docstring. `propose` and `draft_step` (the
    engine's CUDA-graph path) draft the same way (`_draft`), over a span of the cache that is the rows' longest
    committed length or, with static shapes or a ring that rows have filled, the whole cache; what either writes to
    the cache is committed pairs only (the tree's K/V stay in the round's scratch)."""

    name = "eagle"
    static_draft = True

    def __init__(self, net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 depth: int | None = None, num_nodes: int | None = None, context_window: int | None = None):
        tree = default_tree(next(net.parameters()).device) if isinstance(net, Net) else DEFAULT_TREE["cuda"]
        check_positive("gamma", gamma)
        check_positive("max_batch_size", max_batch_size)
        depth = gamma if depth is None else depth
        check_positive("depth", depth)
        self._tree_options(depth, topk, num_nodes, default_topk=tree["topk"], default_nodes=tree["num_nodes"])
        if not isinstance(net, Net):
            raise ValueError(f"drafter: expected an eagle Net, got {type(net).__name__}")
        self.net = net.eval()
        if context_window is None:
            context_window = net.config.context_window
        if isinstance(context_window, bool) or not isinstance(context_window, int) or context_window < 0:
            raise ValueError(f"context_window: expected an int >= 0 (0: every position), got {context_window!r}")
        self.window = context_window  # W: a query sees keys fewer than W positions back (0: all)
        self.depth = depth
        self.max_batch_size = max_batch_size
        self.feature_layers = tuple(net.config.feature_layers)
        p = next(net.layers.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = net.config
        empty = dict(size=(max_batch_size, cfg.num_heads, 0, cfg.head_dim), dtype=self.dtype, device=self.device)
        self.cache = [(torch.zeros(**empty), torch.zeros(**empty)) for _ in net.layers]  # per layer K, V
        self.rows: dict[int, _Row] = {}
        self.root_f: torch.Tensor | None = None  # [max_batch_size, F] each row's last feature
        self.len_t: torch.Tensor | None = None  # [max_batch_size] committed pairs in the cache
        # each row's queue of committed pairs not yet run: features [max_batch_size, Q, F], tokens, count
        self.pend_f: torch.Tensor | None = None
        self.pend_t: torch.Tensor | None = None
        self.pend_n: torch.Tensor | None = None

    def bind(self, target) -> None:
        super().bind(target)
        model = target.model
        check_target(self.net.config, model)
        L = model.config.get_text_config().num_hidden_layers
        bad = [i for i in self.feature_layers if not 0 <= i < L]
        if bad:
            raise ValueError(f"drafter: feature_layers {bad} do not exist in a target with {L} layers")
        if self.net.target_embed is not model.get_input_embeddings() and not torch.equal(
                self.net.target_embed.weight, model.get_input_embeddings().weight):
            raise ValueError("drafter: this eagle net shares the embedding of another target model")

    def asks_tree(self) -> bool:
        """Always: topk 1 is a tree of one child per node (on the generic runner, which verifies chains only, the
        single most likely path)."""
        return True

    def max_verify_tokens(self, gamma: int) -> int:
        return self.num_nodes + 1  # its node budget, bound or not

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """Each layer's K/V over the target's window (see `grown_kv_specs`), or with a context window over the ring
        (which the cache reaches and never outgrows, with either shapes), and the queue of a verify window's
        features `[max_batch_size, T (twice that without static shapes), F]` with each row's root feature."""
        window = max_length + num_verify_tokens
        if self.window:
            cap = min(self.window, window if static else max(2 * window, 64))
            specs = grown_kv_specs("eagle", self.net.attentions(), self.max_batch_size, cap, self.dtype, static=True)
        else:
            specs = grown_kv_specs("eagle", self.net.attentions(), self.max_batch_size, window, self.dtype,
                                   static=static)
        width, queue = self.net.feature_width, num_verify_tokens * (1 if static else 2)
        for name, shape in (("eagle.pend_f", (self.max_batch_size, queue, width)),
                            ("eagle.root_f", (self.max_batch_size, width))):
            specs[name] = BufferSpec(name, shape, self.dtype)
        return specs

    # ---- request lifecycle ---------------------------------------------------------------------------
    def begin(self, rows, prompts) -> None:
        self._check_begin(rows)
        for r in rows:
            self.rows[r] = _Row()

    def release(self, rows) -> None:
        for r in rows:
            self.rows.pop(r, None)

    @torch.no_grad()
    def observe(self, obs: Observation) -> None:
        """The pairs of every row whose next token is now committed. After a prefill (tokens = the prompt) the
        pairs (f_i, x_i+1) of all but the last position run at once, all rows together, a chunk of pairs per
        forward (a one-layer net: their K/V only, `_catch_up`). After a round
        (tokens = the anchor and the accepted drafts) the previous root pair (its feature `root_f`, its token the
        anchor) and the accepted ones are queued on the device (`pend_f`, `pend_t`, `pend_n`): the next draft
        runs them with the new root pair in one forward. The last feature becomes the row's root."""
        dev, rows, counts = self.device, obs.rows, obs.sizes
        if min(counts, default=0) < 1:
            raise ValueError("eagle: observe needs at least one new position per row")
        fresh = [not self.rows.setdefault(r, _Row()).rooted for r in rows]
        if any(fresh) and not all(fresh):
            raise ValueError("eagle: observe of new and running requests together")
        feat = torch.cat([obs.padded_features(l) for l in self.feature_layers], -1).to(self.dtype)  # [B, M, F]
        tok = obs.padded_tokens().to(dev)  # [B, M]
        B, M = tok.shape
        if self.root_f is None:
            with outside_inference():
                self.root_f = feat.new_zeros(self.max_batch_size, feat.shape[-1])
                self.len_t = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
                self.pend_n = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)
        rows_t = self._index(rows, self.device)
        n = obs.counts.to(dev)
        i = torch.arange(M, device=dev)
        static = self._static_shapes()
        if fresh[0]:  # pairs (f_i, x_i+1), i < n - 1, causal among themselves, from position 0
            # static shapes: room for the target's whole window and one verify window's queue, allocated here,
            # outside any CUDA graph (a draft reads all of both); else as needed
            self._reserve(self.target.max_length + self.target.num_verify_tokens if static else M - 1)
            if static:
                self._reserve_pending(self.target.num_verify_tokens, feat.shape[-1])
            if M > 1 and self.window and M - 1 > self.cache[0][0].shape[2]:
                self._observe_window(rows_t, tok, feat, n)
            elif M > 1 and self.net.caches_from_inputs:
                self._catch_up(rows_t, tok, feat)
            elif M > 1:
                pos = i[None, :-1].expand(B, M - 1)
                rooms = self._rooms(rows_t, 0, M - 1)
                # a chunk of pairs at a time over the chunks before it: the visibility and the attention's work
                # are one chunk's queries by all the keys so far, never (M - 1) x (M - 1)
                for c0 in range(0, M - 1, QUERY_CHUNK):
                    c1 = min(M - 1, c0 + QUERY_CHUNK)
                    ok = i[c0:c1, None] >= i[None, :c1]  # [C, c1]
                    self._forward(tok[:, c0 + 1:c1 + 1], feat[:, c0:c1], pos[:, c0:c1], ok[None], rooms, c0)
                self._write(rows_t, pos, rooms)
            self.len_t[rows_t] = n - 1
            self.pend_n.index_fill_(0, rows_t, 0)  # (by value, as in `_draft`)
            for r, c in zip(rows, counts):
                self.rows[r].length, self.rows[r].pending = c - 1, 0
        else:  # queue the previous root (f, anchor), then (f_i, x_i+1) of the accepted drafts
            if not static:  # (static: every round drafts each row, emptying its queue, before it is observed)
                held = [self.rows[r].pending for r in rows]
                self._reserve_pending(max(held) + M, feat.shape[-1])  # rows are written at all M padded places
            at = (rows_t[:, None], self.pend_n[rows_t][:, None] + i)  # [B, M]: past each row's queue
            self.pend_f[at] = torch.cat([self.root_f[rows_t][:, None], feat[:, :-1]], 1)
            self.pend_t[at] = tok
            self.pend_n[rows_t] += n
            if not static:
                for r, c in zip(rows, counts):
                    self.rows[r].pending += c
        self.root_f[rows_t] = feat[torch.arange(B, device=dev), n - 1]
        for r in rows:
            self.rows[r].rooted = True

    def _catch_up(self, rows_t, tok, feat) -> None:
        """The cache of a fresh observe of a one-layer net (`Net.caches_from_inputs`): K/V of the pairs
        (feat `[B, M, F]` at i, tok `[B, M]` at i + 1), i < M - 1, written at positions i of rows `rows_t [B]`, a
        chunk of pairs at a time. Only the cache outlives an observe (a draft runs the root pair itself, from
        `root_f`, and never reads a committed pair's hidden output), and a position's K/V come from its own input
        alone, so no attention or MLP runs: linear in M where the full forward's attention is quadratic. The ops
        and chunks are those of the full forward's K/V, so the cache is the same."""
        ck, cv = self.cache[0]
        M = tok.shape[1]
        pos = torch.arange(M - 1, device=self.device)[None].expand(tok.shape[0], M - 1)
        ck[rows_t, :, :M - 1], cv[rows_t, :, :M - 1] = self._input_kv(tok[:, 1:], feat[:, :M - 1], pos)

    def _input_kv(self, tok, feat, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """A one-layer net's K/V `[B, H, n, D]` of pairs (feat `[B, n, F]`, tok `[B, n]`) at `positions [B, n]`, from
        each pair's input alone, a chunk of QUERY_CHUNK pairs at a time (the full forward's ops and chunks)."""
        net, n = self.net, tok.shape[1]
        kvs = [net.input_kv(net.inputs(tok[:, c0:c0 + QUERY_CHUNK], net.fused(feat[:, c0:c0 + QUERY_CHUNK])),
                            positions[:, c0:c0 + QUERY_CHUNK]) for c0 in range(0, n, QUERY_CHUNK)]
        return torch.cat([k for k, _ in kvs], 2), torch.cat([v for _, v in kvs], 2)

    def _observe_window(self, rows_t, tok, feat, n) -> None:
        """A fresh observe longer than the ring (a context window W, `cap` = W slots): the cache of each row's last
        `cap` pairs (feat `[B, M, F]` at i, tok `[B, M]` at i + 1, i < n - 1 for the row's count n of `n [B]`), at
        slots i % cap. A one-layer net makes those pairs' K/V alone (as `_catch_up`); a deeper one runs every pair,
        a chunk at a time over the keys of its window only (a key's K/V past the first layer depend on its own
        window), and keeps the last `cap`."""
        net, dev = self.net, self.device
        B, M = tok.shape
        cap = self.cache[0][0].shape[2]
        cols = (n - 1 - cap)[:, None] + torch.arange(cap, device=dev)  # [B, cap]: each row's last pairs
        valid = cols >= 0  # (a row of fewer pairs: its slots past them keep what they held)
        if net.caches_from_inputs:
            at = cols.clamp(min=0)
            f = feat.gather(1, at[..., None].expand(B, cap, feat.shape[-1]))
            ring_write(self.cache, rows_t, cols, valid, [self._input_kv(tok.gather(1, at + 1), f, at)])
            return
        W = self.window
        i = torch.arange(M - 1, device=dev)
        pos = i[None].expand(B, M - 1)
        rooms = self._rooms(rows_t, 0, M - 1)
        for c0 in range(0, M - 1, QUERY_CHUNK):
            c1 = min(M - 1, c0 + QUERY_CHUNK)
            lo = max(0, c0 - W + 1)  # no query of the chunk sees a key before its window
            q, k = i[c0:c1, None], i[None, lo:c1]
            ok = (q >= k) & net.in_window(q, k, W)  # [C, c1 - lo]
            self._forward(tok[:, c0 + 1:c1 + 1], feat[:, c0:c1], pos[:, c0:c1], ok[None], [
                (rk[:, :, lo:], rv[:, :, lo:]) for rk, rv in rooms], c0 - lo)
        ring_write(self.cache, rows_t, cols, valid, _columns(rooms, cols.clamp(min=0)))

    def _reserve(self, need: int) -> None:
        """Cache room for `need` positions per row; with a context window never more than the ring (W slots),
        where later positions wrap. A cache grows only before any row wraps (every row holds position p at slot p),
        so the slots it keeps stay where they are."""
        cap = self.cache[0][0].shape[2]
        if self.window:
            need = min(need, self.window)
        if need <= cap:
            return
        new = max(need, 2 * cap, 64)
        if self.window:
            new = min(new, self.window)
        grown = []
        for k, v in self.cache:
            with outside_inference():
                k2 = k.new_zeros(k.shape[0], k.shape[1], new, k.shape[3])
                v2 = v.new_zeros(v.shape[0], v.shape[1], new, v.shape[3])
            k2[:, :, :cap], v2[:, :, :cap] = k, v
            grown.append((k2, v2))
        self.cache = grown

    def _reserve_pending(self, need: int, width: int) -> None:
        """Queue room for `need` pairs per row: the target's verify window (what one round commits) at first,
        so the width, and with it the draft's shapes, stays fixed while every round is drafted."""
        cap = 0 if self.pend_f is None else self.pend_f.shape[1]
        if need <= cap:
            return
        new = max(need, 2 * cap, self.target.num_verify_tokens if self.target is not None else 8)
        with outside_inference():
            f = self.root_f.new_zeros(self.max_batch_size, new, width)
            t = torch.zeros(self.max_batch_size, new, dtype=torch.long, device=self.device)
        if cap:
            f[:, :cap], t[:, :cap] = self.pend_f, self.pend_t
        self.pend_f, self.pend_t = f, t

    # ---- drafting ------------------------------------------------------------------------------------
    def _rooms(self, rows_t, span: int, room: int, *,
               run: slice | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K/V buffers `[B, H, span + room, D]` of rows `rows_t [B]`, the first `span` positions their
        cached K/V, the rest for the keys a forward adds (`layers.KVRoom`). `run`: the same rows as a slice where
        they are consecutive, so the cache is copied once, not gathered first."""
        rooms = []
        sel = rows_t if run is None else run
        for ck, cv in self.cache:
            k = ck.new_empty(rows_t.shape[0], ck.shape[1], span + room, ck.shape[3])
            v = cv.new_empty(rows_t.shape[0], cv.shape[1], span + room, cv.shape[3])
            if span:
                k[:, :, :span], v[:, :, :span] = ck[sel, :, :span], cv[sel, :, :span]
            rooms.append((k, v))
        return rooms

    def _forward(self, tok, feat, positions, visible, rooms, at: int):
        """The net over pairs `(feat [B, M, F], tok [B, M])` at `positions [B, M]`, their K/V written into each
        layer's room (`_rooms`) at `at .. at + M`; a pair sees the room's keys before `at` and the M pairs as
        `visible [B or 1, M, at + M]` says. -> (hidden `[B, M, d]`, the pairs' K/V per layer `[B, H, M, D]`)."""
        net = self.net
        return net.run(net.inputs(tok, net.fused(feat)), positions, visible, [KVRoom(k, v, at) for k, v in rooms])

    def _write(self, rows_t, positions, kvs) -> None:
        """K/V per layer `[B, H, M, D]` into the cache at `positions [B, M]` of rows `rows_t`, one indexed copy
        per layer."""
        at = (rows_t[:, None], slice(None), positions)
        for (ck, cv), (k, v) in zip(self.cache, kvs):
            ck[at] = k.transpose(1, 2)
            cv[at] = v.transpose(1, 2)

    @torch.no_grad()
    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        if not rows:
            return DraftBlock.empty(0, self.device)
        self._check_rows(rows)
        rows = list(rows)
        anchors = torch.stack([c[-1] for c in contexts.tensors]).to(self.device)
        if self._static_shapes():
            return self._draft(None, self._index(rows, self.device), anchors, gamma, self.cache[0][0].shape[2],
                               self.pend_f.shape[1], sampling)
        # host bounds: the longest cache and queue among the rows (a ring's slots at most)
        span, queued = (max(x) for x in zip(*((self.rows[r].length, self.rows[r].pending) for r in rows)))
        if self.window:
            span = min(span, self.cache[0][0].shape[2])
        return self._draft(rows, self._index(rows, self.device), anchors, gamma, span, queued, sampling)

    @torch.no_grad()
    def draft_step(self, rows, rows_t, slots_t, anchors, gamma, *, sampling=None, generator=None) -> DraftBlock:
        """`propose` as device work of fixed shapes (see `Drafter.draft_step`): the whole cache and queue."""
        self._check_rows(rows)
        return self._draft(None, rows_t, anchors, gamma, self.cache[0][0].shape[2], self.pend_f.shape[1], sampling)

    def _check_rows(self, rows) -> None:
        for r in rows:
            st = self.rows.get(r)
            if st is None or not st.rooted:
                raise RuntimeError(f"eagle: no target features observed for row {r}")
        if self.pend_f is None:  # (dynamic shapes) every row observed only its prompt: an empty queue
            self._reserve_pending(1, self.root_f.shape[-1])

    def _draft(self, rows, rows_t, anchors, gamma, span: int, queued: int, sampling) -> DraftBlock:
        """One forward over each row's queued pairs (the first `queued` of the queue, >= every row's count) and
        its root pair (`root_f`, anchor `[B]`), over the first `span` cache slots (>= every row's length, or all
        the slots a ring holds); the queued pairs' K/V join the cache (committed pairs: kept whatever the round
        does), the root's stays in the round's scratch (`_rooms`); then the tree. `rows` (host) are the rows whose
        host counts it keeps in step; None with static shapes, where a CUDA graph replays this without its Python:
        only device work then, on buffers sized beforehand (`observe`), and the host counts are not kept."""
        dev = self.device
        B, Q = rows_t.shape[0], queued
        lens, qn = self.len_t[rows_t], self.pend_n[rows_t]
        tok = torch.cat([self.pend_t[rows_t, :Q], anchors[:, None]], 1)  # [B, Q + 1]
        feat = torch.cat([self.pend_f[rows_t, :Q], self.root_f[rows_t][:, None]], 1)
        i = torch.arange(Q + 1, device=dev)
        positions = lens[:, None] + torch.where(i < Q, i, qn[:, None])  # the root right after the queue
        depth = max(1, min(self.depth, int(gamma)))
        W = self.window
        if rows is not None:
            longest = max(self.rows[r].length for r in rows)
            self._reserve(longest + Q)  # the queue lands at all Q places per row
            if longest + Q + depth <= W:  # no query reaches W positions past position 0: the window cuts nothing
                W = 0
        key_pos = None
        if W:  # slot s holds the latest position p <= the row's last with p = s (mod cap); < 0: none yet
            cap = self.cache[0][0].shape[2]
            held = ring_positions(lens, span, cap)  # [B, span]
            cached = (held >= 0)[:, None]  # [B, 1, span]
            key_pos = torch.cat([held, positions[:, :Q]], 1)  # [B, span + Q]: the committed keys' positions
        else:
            cached = torch.arange(span, device=dev)[None, None] < lens[:, None, None]  # [B, 1, span]
        # a queued pair sees the queue up to itself; the root sees the row's queue and itself
        block = torch.where(i[:, None] < Q, i[None, :] <= i[:, None], (i[None, :] < qn[:, None, None]) | (i == Q))
        ok = torch.cat([cached.expand(B, Q + 1, span), block.expand(B, Q + 1, Q + 1)], 2)
        if W:
            ok = ok & self.net.in_window(positions[:, :, None], torch.cat([held, positions], 1)[:, None], W)
        # one room per layer for the round: the cache read, the queue, the root, then the tree's nodes, `w` per
        # depth past the first (w <= the tree's topk)
        rooms = self._rooms(rows_t, span, Q + 1 + (depth - 1) * (self.topk if self.tree else 1),
                            run=None if rows is None else run_of(rows))
        h, kvs = self._forward(tok, feat, positions, ok, rooms, span)
        if W and Q <= cap:  # the queue's places are distinct slots: its padding keeps what they hold
            ring_write(self.cache, rows_t, positions[:, :Q], i[None, :Q] < qn[:, None],
                       [(k[:, :, :Q], v[:, :, :Q]) for k, v in kvs])
        elif W:  # the last ring's worth of each row's queued pairs (the earlier ones would be written over)
            cols = qn[:, None] - cap + torch.arange(cap, device=dev)  # [B, cap]
            ring_write(self.cache, rows_t, lens[:, None] + cols, cols >= 0, _columns(kvs, cols.clamp(min=0)))
        else:
            self._write(rows_t, positions[:, :Q], [(k[:, :, :Q], v[:, :, :Q]) for k, v in kvs])
        self.len_t[rows_t] = lens + qn
        # by value: a Python scalar assigned through a tensor index is a host tensor copied to the device, which a
        # CUDA-graph capture refuses
        self.pend_n.index_fill_(0, rows_t, 0)
        for r in rows or ():
            st = self.rows[r]
            st.length, st.pending = st.length + st.pending, 0
        seen = torch.cat([cached[:, 0], i[None, :Q] < qn[:, None]], 1)  # [B, span + Q]
        root_h = h[:, Q]
        return self.net.draft_tree(root_h, self.net.lm_logits(root_h), rooms, seen, lens + qn, depth, sampling,
                                   topk=self.topk, num_nodes=self.num_nodes, tree=self.tree, key_pos=key_pos, window=W)


def make_drafter(net: Net, *, gamma: int = 7, max_batch_size: int = 8, topk: int | None = None,
                 depth: int | None = None, num_nodes: int | None = None, context_window: int | None = None,
                 **kwargs) -> EagleDrafter:
    """`specdec.wrap(model, drafter=DIR, topk=..., depth=gamma, num_nodes=..., context_window=W)`: `topk` children
    per expanded node and nodes expanded per depth, `depth` tree depth (capped by the round's gamma), `num_nodes`
    drafts kept after reranking (the verify window is num_nodes + 1), `context_window` the sliding window W its
    queries attend within (0: every position; unset: the net's config, `eagle.Config.context_window`). Unset,
    `topk` and `num_nodes` (at least `depth`) are the device's default tree (`DEFAULT_TREE`: 8 and 48 on a GPU, 2
    and 16 on a CPU)."""
    if kwargs:
        raise ValueError(f"{sorted(kwargs)[0]}: unknown option for the eagle drafter "
                         "(expected topk, depth, num_nodes, context_window)")
    return EagleDrafter(net, gamma=gamma, max_batch_size=max_batch_size, topk=topk, depth=depth,
                        num_nodes=num_nodes, context_window=context_window)
