"""Prefix-state cache: a request whose prompt starts with an earlier one's tokens starts from the state cached there.

A radix tree over token ids holds entries at boundaries: every multiple of `track_interval` a request's committed
tokens pass (a prompt's prefill runs in segments that end there; a round that passes one publishes the pool's track
copy of it, `replayssm.pool`), each prompt's end, and each finished request's committed end. An entry is the
committed state of that prefix, copied out of the slot:
- every recurrent layer's conv window `[Lyr, C, Kc-1]` and state `[Lyr, H, K, V]`;
- every attention layer's KV: the full pages of its prefix, shared with the slot it was taken from and every slot
  restored from it (refcounts in the pool, `kv_cache.PageTable`), and a copy of the tokens past the last full page
  (a slot writes only past its committed length, so shared pages are never written: the page a slot goes on
  writing into is its own);
- the target features the drafter observes over the prefix (`hidden` and its `feature_layers`, `[n, d]`): drafters
  with their own caches (eagle, mtp, dspark, native) rebuild them from these, as from a prefill, instead of the
  cache keeping entries per drafter kind; the features are the target's, so they serve any drafter.

Only committed state enters (after a prefill, or at the end of a request, with lazy records folded first), never a
verify-time or tree-node state; an aborted request publishes nothing. Entries are immutable: a request copies an
entry into its slot and never writes into it. Within a byte budget the least recently used entries go first;
entries pinned by an admission in progress are never evicted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .kv_cache import token_bytes
from .memory import format_bytes
from .tensors import outside_inference

DEFAULT_BUDGET = 1 << 30  # `prefix_cache=True`


@dataclass(eq=False)
class Entry:
    """The committed state of one prefix of `length` tokens (see the module docstring): recurrent state, the KV
    pages it shares (`pages`, the full pages of its prefix, held in `owner`'s pool until `free`) and the rest of its
    KV copied (`tail {layer: ([n, heads, dim], ...)}`, n < a page), and the drafter's features. `nbytes` counts the
    tensors it owns (the pages are the pool's)."""

    length: int
    conv: torch.Tensor
    ssm: torch.Tensor
    pages: list[int]
    tail: dict[int, tuple[torch.Tensor, ...]]
    features: dict[str, torch.Tensor]
    owner: object = None  # the KVCache whose pages it holds
    nbytes: int = 0
    used: int = 0  # LRU clock at the last hit or write
    pins: int = 0  # admissions restoring it right now: not evictable

    def __post_init__(self):
        tensors = [self.conv, self.ssm, *(t for ts in self.tail.values() for t in ts), *self.features.values()]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def kv(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The prefix's stored tensors of `layer`, `[heads, length, dim]` each: its pages, then its tail."""
        store = self.owner.store[layer]
        out = []
        for j, buf in enumerate(store):
            parts = [buf[self.pages].flatten(0, 1)] + ([self.tail[layer][j]] if self.tail else [])
            out.append(torch.cat(parts, 0).transpose(0, 1))
        return tuple(out)

    def free(self) -> None:
        """Let go of the pages (the entry is gone from the cache)."""
        if self.owner is not None and self.pages:
            self.owner.drop(self.pages)
        self.pages = []


class _Node:
    __slots__ = ("edge", "children", "entry", "parent")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None


class PrefixCache:
    """Radix tree of `Entry`s over token ids, within `budget` bytes (LRU eviction of unpinned entries)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.root = _Node((), None)
        self.bytes = 0
        self.clock = 0
        # over the cache's life: lookups, hits (a lookup that found an entry), cached_tokens (prompt tokens served
        # from entries), inserted, evicted, skipped (an entry larger than the whole budget)
        self.stats = dict.fromkeys(("lookups", "hits", "cached_tokens", "inserted", "evicted", "skipped"), 0)

    # ---- lookup ------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int, *, touch: bool = True) -> Entry | None:
        """The deepest entry whose prefix starts `tokens` and holds at most `limit` tokens (a request keeps at
        least one prompt token to prefill: its logits give the first new token). `touch=False`: a look that
        neither counts nor refreshes the entry (admission sizing a request's pages)."""
        if touch:
            self.stats["lookups"] += 1
        node, i, best = self.root, 0, None
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or i + len(child.edge) > limit or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                break
            node, i = child, i + len(child.edge)
            if node.entry is not None:
                best = node.entry
        if best is not None and touch:
            self.clock += 1
            best.used = self.clock
            self.stats["hits"] += 1
            self.stats["cached_tokens"] += best.length
        return best

    @contextlib.contextmanager
    def pinned(self, entries: Sequence[Entry | None]):
        """Hold `entries` (None skipped) unevictable while an admission copies them."""
        held = [e for e in entries if e is not None]
        for e in held:
            e.pins += 1
        try:
            yield
        finally:
            for e in held:
                e.pins -= 1

    # ---- insert / evict ------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], make: Callable[[], Entry]) -> Entry | None:
        """The entry of the prefix `tokens`: the one already there (entries are immutable), or `make()`'s, stored
        after evicting least recently used entries down to the budget. None when it alone exceeds the budget."""
        tokens = tuple(tokens)
        self.clock += 1
        held = self.match(tokens, len(tokens), touch=False)
        if held is not None and held.length == len(tokens):  # an entry at exactly these tokens
            held.used = self.clock
            return held
        entry = make()
        if entry.nbytes > self.budget or not self._evict(self.budget - entry.nbytes):
            self.stats["skipped"] += 1
            entry.free()
            return None
        node = self._node(tokens)  # after the eviction, which may prune the branch it sits on
        entry.used = self.clock
        node.entry = entry
        self.bytes += entry.nbytes
        self.stats["inserted"] += 1
        return entry

    def _node(self, tokens: tuple[int, ...]) -> _Node:
        """The node at the end of `tokens`, made (splitting an edge where `tokens` ends or turns inside it)."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                new = _Node(tokens[i:], node)
                node.children[tokens[i]] = new
                return new
            edge = child.edge
            m = 0
            while m < len(edge) and i + m < len(tokens) and edge[m] == tokens[i + m]:
                m += 1
            if m < len(edge):  # split: node -> mid (edge[:m]) -> child (edge[m:])
                mid = _Node(edge[:m], node)
                node.children[tokens[i]] = mid
                child.edge, child.parent = edge[m:], mid
                mid.children[edge[m]] = child
                child = mid
            node, i = child, i + m
        return node

    def _evict(self, room: int) -> bool:
        """Drop unpinned entries, least recently used first, until the cache holds at most `room` bytes."""
        if self.bytes <= room:
            return True
        victims = sorted((e for e in self.entries() if e[1].pins == 0), key=lambda ne: ne[1].used)
        for node, e in victims:
            if self.bytes <= room:
                break
            self._drop(node)
        return self.bytes <= room

    def evict_one(self) -> bool:
        """Drop the least recently used unpinned entry with no entry below it, for KV pages: a deeper entry holds
        every page of the shallower ones on its path, so only a leaf's eviction frees pages (those past the entry
        above it). False when there is none."""
        victims = [ne for ne in self._leaves() if ne[1].pins == 0]
        if not victims:
            return False
        self._drop(min(victims, key=lambda ne: ne[1].used)[0])
        return True

    def _drop(self, node: _Node) -> None:
        e = node.entry
        node.entry = None
        self.bytes -= e.nbytes
        self.stats["evicted"] += 1
        e.free()
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Remove `node` and its ancestors while they hold no entry and no child."""
        while node is not self.root and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent

    def entries(self) -> list[tuple[_Node, Entry]]:
        """Every (node, entry), depth first."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.entry is not None:
                out.append((node, node.entry))
            stack.extend(node.children.values())
        return out

    def _leaves(self) -> list[tuple[_Node, Entry]]:
        """Every (node, entry) with no entry below it, in one walk (children after their parent, then backwards)."""
        order, stack = [], [self.root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        below: dict[int, bool] = {}  # id(node) -> an entry at or below it
        out = []
        for node in reversed(order):
            deeper = any(below[id(c)] for c in node.children.values())
            if node.entry is not None and not deeper:
                out.append((node, node.entry))
            below[id(node)] = deeper or node.entry is not None
        return out

    def describe(self) -> dict:
        return dict(entries=len(self.entries()), bytes=self.bytes, budget=self.budget, **self.stats)


# ---- the runner's side: take an entry out of a slot, put one into a slot ------------------------------------
def take(runner, slot: int, length: int, features: dict[str, torch.Tensor], *, conv=None, ssm=None) -> Entry:
    """`slot`'s committed state after `length` tokens: a copy of its pool state (or `conv [Lyr, C, Kc-1]`, `ssm
    [Lyr, H, K, V]`: a track copy of an earlier boundary), its KV below `length` (the full pages shared,
    `KVCache.share`, the rest copied) and a copy of `features[name][:length]`. The slot's pending records (lazy
    commit) must be folded first."""
    pool, kv = runner.state.pool, runner.kv
    with outside_inference():  # kept across calls: normal tensors, as the pool's
        conv = (pool.conv[:, slot] if conv is None else conv).clone()
        ssm = (pool.ssm[:, slot] if ssm is None else ssm).clone()
        feats = {k: f[:length].clone() for k, f in features.items()}
        pages, tail = kv.share(slot, length)
    return Entry(length, conv, ssm, pages, tail, feats, owner=kv)


def restore(runner, entry: Entry, slot: int) -> None:
    """`entry` into the fresh `slot`: state and conv window copied, its KV pages shared and its tail copied
    (`KVCache.adopt`), lengths (the entry is read only; the slot writes only past its length)."""
    pool, kv, n = runner.state.pool, runner.kv, entry.length
    pool.conv[:, slot] = entry.conv
    pool.ssm[:, slot] = entry.ssm
    pool.seq_len[slot] = n
    kv.adopt(slot, entry.pages, entry.tail, n)


def entry_bytes(runner, tokens: int, feature_bytes_per_token: int) -> dict[str, int]:
    """The bytes of an entry of `tokens` tokens, by part: recurrent state, KV (a token's bytes in the runner's KV
    pages, from its memory plan) and drafter features."""
    pool = runner.state.pool
    state = (pool.conv[:, 0].numel() * pool.conv.element_size() + pool.ssm[:, 0].numel() * pool.ssm.element_size())
    kv = token_bytes(runner.memory.parts.get("KV cache", {}))
    return {"recurrent state": state, "KV": kv * tokens, "drafter features": feature_bytes_per_token * tokens}


def budget_bytes(option) -> int:
    """`SpecConfig.prefix_cache` (True or a byte budget, checked there) as bytes: True -> `DEFAULT_BUDGET`."""
    return DEFAULT_BUDGET if option is True else int(option)


def check_budget(option, runner, feature_bytes_per_token: int) -> int:
    """`prefix_cache=` as bytes (`budget_bytes`); a budget below one entry of one token is a ValueError."""
    budget = budget_bytes(option)
    parts = entry_bytes(runner, 1, feature_bytes_per_token)
    least = sum(parts.values())
    if budget < least:
        detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        raise ValueError(f"prefix_cache: a budget of {format_bytes(budget)} is smaller than one entry "
                         f"({format_bytes(least)} for a 1-token prefix: {detail}); give at least {least} bytes")
    return budget


# ---- the engine's side: admission, rounds and retirement of `SpecEngine.generate` with a cache ---------------------
def prefill(engine, slots: list[int], prompts: list[torch.Tensor], hosts: list[list[int]], capture: tuple, stats,
            worst: list[int]):
    """Start the prompts `[P_b]` (`hosts`: the same as lists) in their fresh `slots`: each from its deepest cached
    prefix (at most P - 1 tokens, one is left for the first token's logits; its KV pages shared), then the pages of
    each request's `worst` case reserved, the rest prefilled in segments that end at the multiples of
    `track_interval` (each boundary an entry) and at the prompt's end. -> (logits at each prompt's last token
    `[k, V]`, the features the drafter observes over each whole prompt `{name: [k, P, d]}`: the cached prefix's from
    its entry, zeros where the drafter observes none)."""
    cache, runner, iv = engine.prefix_cache, engine.runner, engine.config.track_interval
    hits = [cache.match(h, len(h) - 1) for h in hosts]
    with cache.pinned(hits):
        for s, e in zip(slots, hits):
            if e is not None:
                restore(runner, e, s)
    runner.reserve(slots, worst)
    pos = [0 if e is None else e.length for e in hits]
    sizes = [len(h) for h in hosts]
    stats.cached_tokens += sum(pos)
    ends = [list(range((c // iv + 1) * iv, P, iv)) + [P] for c, P in zip(pos, sizes)]  # each segment's end
    feats, last = None, [None] * len(slots)
    for step in range(max(len(x) for x in ends)):
        rows = [b for b in range(len(slots)) if step < len(ends[b])]
        seg = [prompts[b][pos[b]:ends[b][step]] for b in rows]
        out = runner.prefill_batch([slots[b] for b in rows], seg, capture=capture, last_logits=True)
        got = {"hidden": out.hidden, **out.captured}
        if feats is None:
            feats = {k: x.new_zeros(len(slots), max(sizes), x.shape[-1]) for k, x in got.items()}
            for b, e in enumerate(hits):
                for k in feats:
                    if e is not None and k in e.features:
                        feats[k][b, :e.length] = e.features[k]
        for i, b in enumerate(rows):
            n = len(seg[i])
            for k, x in got.items():
                feats[k][b, pos[b]:pos[b] + n] = x[i, :n]
            pos[b] += n
            if step == len(ends[b]) - 1:
                last[b] = out.logits[i, 0]
            else:  # a track boundary inside the prompt: the slot holds its state now
                names = engine.feature_names
                cache.insert(hosts[b][:pos[b]], lambda b=b, t=pos[b]: take(
                    runner, slots[b], t, {k: feats[k][b] for k in names}))
    return torch.stack(last), feats


def publish_prompts(engine, lanes, ids: list[int], sizes: list[int]) -> None:
    """Each new request's prompt end as an entry (its state, KV and features as the prefill left them)."""
    for l, P in zip(ids, sizes):
        engine.prefix_cache.insert(lanes.hist[l][:P], lambda l=l, P=P: take(
            engine.runner, lanes.slot[l], P, {k: buf[l] for k, buf in lanes.feat.items()}))


def publish_boundaries(engine, lanes, active: list[int], kept: list[int]) -> None:
    """After a round that kept `kept[i]` tokens of lane `active[i]`: an entry at each multiple of `track_interval`
    the round passed, from the pool's track copy of it (ping-pong: the last two boundaries are kept, which is every
    boundary a round passes since `wrap` requires 2 * track_interval >= num_draft_tokens + 1)."""
    runner, iv, pool = engine.runner, engine.config.track_interval, engine.runner.state.pool
    for l, n in zip(active, kept):
        s = lanes.slot[l]
        after = runner.kv.bound[s]  # exact: every commit passes its host counts
        for t in range(max((after - n) // iv + 1, after // iv - 1) * iv, after + 1, iv):
            if t <= 0:
                continue
            par = (t // iv) % 2
            engine.prefix_cache.insert(lanes.hist[l][:t], lambda t=t, par=par, l=l, s=s: take(
                runner, s, t, {k: buf[l] for k, buf in lanes.feat.items()}, conv=pool.track_conv[:, s, par],
                ssm=pool.track_ssm[:, s, par]))


def publish_end(engine, lanes, l: int) -> None:
    """A finished request's committed end as an entry (lazy records folded first): its returned tokens, or all but the
    last one (a round commits nothing past what it returns: `SpecEngine._cut_at_returned`), so the next turn of a
    conversation, which starts with them, finds it."""
    runner, s = engine.runner, lanes.slot[l]
    runner.state.flush([s])
    c = runner.kv.bound[s]
    engine.prefix_cache.insert(lanes.hist[l][:c], lambda: take(runner, s, c, {k: buf[l] for k, buf in
                                                                                    lanes.feat.items()}))
