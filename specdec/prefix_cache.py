"""Prefix-state cache: a request whose prompt starts with an earlier one's tokens starts from the state cached there.

A radix tree over token ids holds entries at boundaries: every multiple of `track_interval` a request's committed
tokens pass (a prompt's prefill runs in segments that end there; a round that passes one publishes the pool's track
copy of it, `replayssm.pool`), each prompt's end, and each finished request's committed end. An entry
(`slots.Entry`, taken by `Slots.snapshot`) is the committed state of that prefix:
- every recurrent layer's conv window `[Lyr, C, Kc-1]` and state `[Lyr, H, K, V]`, copied out of the slot;
- the KV pages of its prefix, which hold every attention layer's KV and the target features the drafter observes
  at each position (`hidden` and its `feature_layers`): the full pages shared with the slot it was taken from and
  every slot restored from it (refcounts in the pool, `kv_cache.PageTable`), and a copy of the tokens past the last
  full page (a slot writes only past its committed length, so shared pages are never written: the page a slot goes
  on writing into is its own). Drafters with their own caches (eagle, mtp, dspark, native) rebuild them from the
  features, as from a prefill; the features are the target's, so they serve any drafter.

Only committed state enters (after a prefill, or at the end of a request, with lazy records folded first), never a
verify-time or tree-node state; an aborted request publishes nothing. Entries are immutable: a request restores an
entry into its slot and never writes into it. Within a byte budget the least recently used entries go first;
entries pinned by an admission in progress are never evicted.

`PrefixCache` is the tree alone; `CachedSlots` is its side toward a target's `Slots`: admission from the deepest
entry, and the entries a slot publishes.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from .kv_cache import token_bytes
from .memory import format_bytes
from .slots import Entry, Slots

DEFAULT_BUDGET = 1 << 30  # `prefix_cache=True`


class _Node:
    __slots__ = ("edge", "children", "entry", "parent")

    def __init__(self, edge: tuple[int, ...], parent: "_Node | None"):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None


class PrefixCache:
    """Radix tree of `Entry`s over token ids, within `budget` bytes (LRU eviction of unpinned entries), at most
    `per_path` entries on one path from the root (None: no cap; `SpecConfig.states_per_path`: thinned evenly)."""

    def __init__(self, budget: int, per_path: int | None = None):
        self.budget = int(budget)
        self.per_path = per_path
        self.root = _Node((), None)
        self.bytes = 0
        self.clock = 0
        # over the cache's life: lookups, hits (a lookup that found an entry), cached_tokens (prompt tokens served
        # from entries), inserted, evicted, skipped (an entry larger than the whole budget)
        # thinned: entries dropped for the per-path cap
        self.stats = dict.fromkeys(("lookups", "hits", "cached_tokens", "inserted", "evicted", "skipped", "thinned"), 0)

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
        if self.per_path is not None:
            self._thin(node)
        return entry

    def _thin(self, node: _Node) -> None:
        """While the path from the root to `node` holds more than `per_path` entries, drop the one whose loss leaves
        the shortest gap between the entries (or the root) beside it; forks (a node with several children: other
        paths go through it), pinned entries and `node`'s own are kept, so the cap is soft where only those are
        left."""
        path = []
        n = node
        while n is not self.root:
            if n.entry is not None:
                path.append(n)
            n = n.parent
        path.reverse()  # root first
        while len(path) > self.per_path:
            lengths = [0] + [p.entry.length for p in path]
            gaps = [(lengths[i + 2] - lengths[i], i) for i in range(len(path) - 1)
                    if len(path[i].children) < 2 and path[i].entry.pins == 0]
            if not gaps:
                return
            _, i = min(gaps)
            self.stats["thinned"] += 1
            self._drop(path.pop(i), count=False)

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

    def _drop(self, node: _Node, *, count: bool = True) -> None:
        e = node.entry
        node.entry = None
        self.bytes -= e.nbytes
        if count:
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


def entry_bytes(runner, tokens: int) -> dict[str, int]:
    """The bytes of an entry of `tokens` tokens, by part: recurrent state, and the KV pages' bytes of its tokens (a
    token's bytes in the runner's pages, every attention layer's KV and every paged feature, from its memory plan)."""
    pool = runner.state.pool
    state = (pool.conv[:, 0].numel() * pool.conv.element_size() + pool.ssm[:, 0].numel() * pool.ssm.element_size())
    kv = token_bytes(runner.memory.parts.get("KV cache", {}))
    return {"recurrent state": state, "KV pages": kv * tokens}


def budget_bytes(option) -> int:
    """`SpecConfig.prefix_cache` (True or a byte budget, checked there) as bytes: True -> `DEFAULT_BUDGET`."""
    return DEFAULT_BUDGET if option is True else int(option)


def check_budget(option, runner) -> int:
    """`prefix_cache=` as bytes (`budget_bytes`); a budget below one entry of one token is a ValueError."""
    budget = budget_bytes(option)
    parts = entry_bytes(runner, 1)
    least = sum(parts.values())
    if budget < least:
        detail = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        raise ValueError(f"prefix_cache: a budget of {format_bytes(budget)} is smaller than one entry "
                         f"({format_bytes(least)} for a 1-token prefix: {detail}); give at least {least} bytes")
    return budget


class CachedSlots:
    """The prefix cache toward a target's slots: a new request starts from its prompt's deepest entry (`start`), and
    a slot publishes entries (`publish`) at its prompt's end, at the track boundaries its rounds pass
    (`boundaries`) and at its request's end. Takes plain data: slots, token lists, lengths.

    `prefill(slots, prompts, capture=, last_logits=True)`: the runner's batched prefill (`HybridRunner.
    prefill_batch`); `features`: the `kv_cache.feature_key`s of what the drafter observes (paged with the KV)."""

    def __init__(self, cache: PrefixCache, slots: Slots, prefill: Callable, track_interval: int,
                 features: dict):
        self.cache, self.slots, self.prefill, self.interval = cache, slots, prefill, track_interval
        self.features = features  # observed name -> its key in the KV pages

    def start(self, slots: list[int], prompts: list[torch.Tensor], hosts: list[list[int]], worst: list[int],
              capture: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int]]:
        """Start the prompts `[P_b]` (`hosts`: the same as lists) in their fresh `slots`: each from its deepest
        cached prefix (at most P - 1 tokens: one is left for the first token's logits), then the pages of each
        request's `worst` case reserved, the rest prefilled in segments that end at the multiples of
        `track_interval` (each boundary an entry) and at the prompt's end. -> (logits at each prompt's last token
        `[k, V]`, the features the drafter observes over each whole prompt `{name: [k, P, d]}` read back from the
        slots' pages (the cached prefix's with them), each prompt's tokens served from the cache)."""
        cache, iv = self.cache, self.interval
        hits = [cache.match(h, len(h) - 1) for h in hosts]
        with cache.pinned(hits):
            for s, e in zip(slots, hits):
                if e is not None:
                    self.slots.restore(e, s)
        self.slots.reserve(slots, worst)
        pos = [0 if e is None else e.length for e in hits]
        cached = list(pos)
        sizes = [len(h) for h in hosts]
        ends = [list(range((c // iv + 1) * iv, P, iv)) + [P] for c, P in zip(pos, sizes)]  # each segment's end
        last = [None] * len(slots)
        for step in range(max(len(x) for x in ends)):
            rows = [b for b in range(len(slots)) if step < len(ends[b])]
            seg = [prompts[b][pos[b]:ends[b][step]] for b in rows]
            out = self.prefill([slots[b] for b in rows], seg, capture=capture, last_logits=True)
            for i, b in enumerate(rows):
                pos[b] += len(seg[i])
                if step == len(ends[b]) - 1:
                    last[b] = out.logits[i, 0]
                else:  # a track boundary inside the prompt: the slot holds its state now
                    self.publish(hosts[b][:pos[b]], slots[b])
        slots_t = torch.tensor(slots, dtype=torch.long, device=last[0].device)
        feats = {name: self.slots.read(key, slots_t, max(sizes)) for name, key in self.features.items()}
        return torch.stack(last), feats, cached

    def boundaries(self, before: int, after: int) -> list[int]:
        """The multiples of `track_interval` a round passed going from `before` to `after` committed tokens, whose
        state the slot holds (its last two: every one a round passes, since `wrap` requires 2 * track_interval >=
        num_draft_tokens + 1)."""
        iv = self.interval
        return [t for t in range(max(before // iv + 1, after // iv - 1) * iv, after + 1, iv) if t > 0]

    def publish(self, tokens: list[int], slot: int, boundary: int | None = None) -> None:
        """An entry of `tokens`, the tokens `slot` committed: at its committed length (`boundary` None: tokens are
        all of them), or at `boundary`, a track boundary its last round passed (tokens its first `boundary`)."""
        self.cache.insert(tokens, lambda: self.slots.snapshot(slot, boundary, interval=self.interval))
