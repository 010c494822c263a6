"""KV cache of the full-attention layers: pages of `page_size` tokens from one pool, a block table per request slot,
rollback by length, tree masks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.kernels.tree import VerifyTree
from specdec.replayssm.plan import BufferSpec
from specdec.replayssm.pool import allocate
from specdec.tensors import run_of
from specdec.verify.record import Acceptance

if TYPE_CHECKING:  # parallel.py imports this module
    from specdec.parallel import SlotSplit

PAGE_SIZE = 16  # tokens per page (vLLM's default block size)


def num_pages_for(tokens: int, page_size: int = PAGE_SIZE) -> int:
    return -(-tokens // page_size)


def kv_spec(layer_idx: int, index: int, num_pages: int, heads: int, dim: int, dtype: torch.dtype, *,
            page_size: int = PAGE_SIZE) -> BufferSpec:
    """Stored tensor `index` (0: K, 1: V, or MLA's latents) of one layer: `[num_pages + 1, page_size, heads, dim]`
    (the last page is the scratch page that unassigned table entries point at: written by padding rows, never read
    unmasked)."""
    return BufferSpec(f"kv.{layer_idx}.{index}", (num_pages + 1, page_size, heads, dim), dtype)


def kv_specs(num_slots: int, max_length: int, layers: dict, dtype: torch.dtype, *, num_pages: int | None = None,
             page_size: int = PAGE_SIZE, group: str = "") -> dict[str, BufferSpec]:
    """The buffers a `KVCache(num_slots, max_length)` allocates for attention layers `{layer: [(heads, dim) per
    stored tensor]}` (and token features, `{feature_key(name): [(1, width)]}`) whose tensors come in `dtype`: each
    one's pages (`num_pages`, default a full `max_length` for every request slot: the null slot, the last, takes
    none) and the block table `[num_slots, max_length / page_size]` of the group (`group`: "" for the layers of every
    slot, "dp" for data-parallel layers, `parallel.SlotSplit`)."""
    pages = (num_slots - 1) * num_pages_for(max_length, page_size) if num_pages is None else num_pages
    out = {spec.name: spec for layer, dims in layers.items() for j, (heads, dim) in enumerate(dims)
           for spec in [kv_spec(layer, j, pages, heads, dim, dtype, page_size=page_size)]}
    if layers:
        name = f"kv.table{'.' + group if group else ''}"
        out[name] = BufferSpec(name, (num_slots, num_pages_for(max_length, page_size)), torch.long)
    return out


def feature_key(name) -> str:
    """The store key of a token feature (`"hidden"`, or a layer index whose output is captured): what a drafter
    observes at each committed position, kept in pages beside the KV (`KVCache(features=...)`)."""
    return f"feature.{name}"


def spec_key(name: str):
    """The store key of a pool among `kv_specs`: `kv.<key>.<j>` -> an attention layer's index, or a feature's key."""
    key = name[len("kv."):].rsplit(".", 1)[0]
    return int(key) if key.isdigit() else key


def page_specs(specs: dict[str, BufferSpec]) -> dict[str, BufferSpec]:
    """The page pools among `kv_specs`' `specs` (the block tables aside)."""
    return {n: s for n, s in specs.items() if len(s.shape) == 4}


def token_bytes(specs: dict[str, BufferSpec]) -> int:
    """Bytes one token takes in the page pools among `specs` (`page_specs`)."""
    return sum(s.nbytes // (s.shape[0] * s.shape[1]) for s in page_specs(specs).values())


class PageTable:
    """The pages of one group of layers: a free list, each row's pages on the host, each page's holders (`refs`:
    rows and prefix-cache entries), and the block table `[rows, max_pages]` (long, on the device) that attention
    reads through; unassigned entries point at the scratch page `num_pages`. A row takes fresh pages as its tokens
    need them (`ensure`), may start from pages it shares (`adopt`), and lets go at `release`; an entry holds pages
    with `hold` / `drop`. A page is free if and only if nothing holds it."""

    def __init__(self, rows: int, max_pages: int, num_pages: int, device: torch.device, name: str):
        self.num_pages, self.table_name = num_pages, name
        self.free = list(range(num_pages - 1, -1, -1))  # popped from the end: low ids first
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.run = [True] * rows  # row r's pages are held[r][0] + j at entry j: its span is a slice of the pool
        self.refs = [0] * num_pages
        self.table = allocate(BufferSpec(name, (rows, max_pages), torch.long), device, fill=num_pages)

    def ensure(self, rows: list[int], tokens: list[int], page_size: int) -> None:
        """Rows `rows` hold pages for `tokens[i]` tokens each: missing pages taken from the free list and written
        into the table in one copy (none when every row has its pages). MemoryError when the pool runs out (nothing
        taken then)."""
        need = [(r, num_pages_for(t, page_size) - len(self.held[r])) for r, t in zip(rows, tokens)]
        need = [(r, k) for r, k in need if k > 0]
        if not need:
            return
        total = sum(k for _, k in need)
        if total > len(self.free):
            raise MemoryError(f"KV cache: {total} more pages of the pool are needed and {len(self.free)} are free")
        rs, js, ps = [], [], []
        for r, k in need:
            for _ in range(k):
                page = self.free.pop()
                self.run[r] &= not self.held[r] or page == self.held[r][-1] + 1
                self.refs[page] = 1
                rs.append(r)
                js.append(len(self.held[r]))
                ps.append(page)
                self.held[r].append(page)
        self._write(rs, js, ps)

    def _write(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """Table entries `(rows[i], cols[i]) = pages[i]`, in one copy to the device."""
        idx = torch.tensor([rows, cols, pages], dtype=torch.long).to(self.table.device)
        self.table[idx[0], idx[1]] = idx[2]

    def adopt(self, row: int, pages: list[int]) -> None:
        """Row `row` starts from the shared `pages` (its first ones): the fresh pages it held there go back."""
        k = len(pages)
        old = self.held[row][:k]
        self.hold(pages)
        self.held[row][:k] = list(pages)
        held = self.held[row]
        self.run[row] = run_of(held) is not None
        self.drop(old)
        if k:
            self._write([row] * k, list(range(k)), list(pages))

    def hold(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def drop(self, pages: list[int]) -> None:
        """Let go of `pages` once each; a page nothing holds any more is free."""
        for p in reversed(pages):
            if self.refs[p] <= 0:
                raise RuntimeError(f"KV page {p} let go of more often than held")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def release(self, row: int) -> None:
        """Row `row` lets go of its pages; its table row points at the scratch page again."""
        if self.held[row]:
            self.drop(self.held[row])
            self.held[row] = []
            self.run[row] = True
            self.table[row] = self.num_pages

    @property
    def num_free(self) -> int:
        return len(self.free)


class KVCache:
    """Quacks like a transformers `Cache` for the model's own attention modules (`update` returns the
    full keys/values), over pages: each stored tensor (K and V, or MLA's compressed latents) of a layer is a pool
    `[num_pages + 1, page_size, heads, dim]`, allocated at the layer's first `update`, and each request slot holds
    pages through a block table (`PageTable`). A slot takes pages as its tokens need them (`reserve`, or at a round's
    `begin`) and lets go of them at `release`; a prefix-cache entry may hold a slot's full pages on (`share`), and a
    fresh slot may start from them (`adopt`).

    A round writes its T new entries after each request's committed length, into the slot's pages; `commit` keeps
    the accepted ones (compacting a tree's accepted path inside the tail pages) by moving the length, so rollback
    costs nothing. Attention reads a round's key span through the table (a gather of the slots' pages).

    Nothing here reads a value back to the host: the lengths live on the device, and `bound` keeps a host
    upper bound of each slot's length (exact when commits pass their host counts), which sizes the key span
    `S` of a round. Keys past a row's true length are masked, so a loose bound costs work, never correctness.
    `static=True` fixes `S = max_length` (every round's shapes depend on B and T only, as CUDA graphs need; the
    pages a round writes must be reserved before it, so that `begin` copies nothing to the device).
    `num_pages` (default: `max_length` for every request slot) sizes the pool.

    `split` (a tensor-parallel runner's, `parallel.SlotSplit`): the layers it holds run data-parallel over the
    requests, and are kept for the request slots this rank owns only, each at its row of the split, in pages of a
    pool of their own (`pages[True]`, `max_length` for every row).
    """

    def __init__(self, num_slots: int, max_length: int, *, device: torch.device | str = "cpu", static: bool = False,
                 page_size: int = PAGE_SIZE, num_pages: int | None = None, split: SlotSplit | None = None):
        self.max_length = max_length
        self.static = static
        self.page_size = page_size
        self.max_pages = num_pages_for(max_length, page_size)
        self.num_pages = (num_slots - 1) * self.max_pages if num_pages is None else num_pages  # null slot: none
        self.device = torch.device(device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.store: dict[int, list[torch.Tensor]] = {}
        self.bound = [0] * num_slots  # host upper bound of `lengths`
        self.loose: set[int] = set()  # slots whose bound may be above their length (a commit without host counts)
        self.slots: torch.Tensor | None = None
        self.host_slots: list[int] = []
        self.tree: VerifyTree | None = None
        self.num_tokens = 0
        self.span = 0  # S: keys a round's attention reads
        self._addr: dict = {}  # per round and group: (page, offset) of the new tokens, the pages of the key span
        self.pages = {False: PageTable(num_slots, self.max_pages, self.num_pages, self.device, "kv.table")}
        self.split = split
        if split is not None:
            self.pages[True] = PageTable(split.rows, self.max_pages, split.rows * self.max_pages, self.device,
                                         "kv.table.dp")

    def _split_holds(self, layer) -> bool:
        """Whether `layer`'s pages are the data-parallel group's (`split`)."""
        return self.split is not None and self.split.holds(layer)

    # ---- pages -------------------------------------------------------------------------------------
    def reserve(self, host_slots: list[int], tokens: list[int]) -> None:
        """Slots `host_slots` hold pages for `tokens[i]` tokens each (their worst case: prompt, new tokens and a
        verify window), so no round of theirs takes pages (static shapes and CUDA graphs need that). MemoryError
        when the pool cannot give them (nothing taken then)."""
        null = self.lengths.shape[0] - 1
        pairs = [(s, t) for s, t in zip(host_slots, tokens) if s != null]
        self.pages[False].ensure([s for s, _ in pairs], [t for _, t in pairs], self.page_size)
        if self.split is not None:
            own = [(r, t) for r, t in ((self.split.row(s), t) for s, t in pairs) if r is not None]
            self.pages[True].ensure([r for r, _ in own], [t for _, t in own], self.page_size)

    def share(self, slot: int, length: int) -> tuple[list[int], dict[int, tuple[torch.Tensor, ...]]]:
        """The first `length` committed tokens of `slot` for a prefix-cache entry: its full pages below `length`,
        held once more (the caller lets go with `drop`), and a copy of the rest, `{layer: ([n, heads, dim], ...)}`
        (n < page_size; the slot goes on writing into that page)."""
        if self.split is not None:
            raise RuntimeError("KV cache: data-parallel layers' pages are not shared")
        table = self.pages[False]
        k, n = length // self.page_size, length % self.page_size
        full = table.held[slot][:k]
        table.hold(full)
        tail = {}
        if n:
            page = table.held[slot][k]
            tail = {layer: tuple(buf[page, :n].clone() for buf in bufs) for layer, bufs in self.store.items()}
        return full, tail

    def drop(self, pages: list[int]) -> None:
        """A prefix-cache entry lets go of `pages` (`share`)."""
        self.pages[False].drop(pages)

    def adopt(self, slot: int, pages: list[int], tail: dict[int, tuple[torch.Tensor, ...]], n: int) -> None:
        """A fresh `slot` holds the `n` committed tokens of a prefix-cache entry: its full `pages`, shared (the slot
        writes only past `n`, in pages of its own), and the `tail` tokens, copied into the slot's next page."""
        table = self.pages[False]
        table.adopt(slot, pages)
        self.reserve([slot], [n])
        start = len(pages) * self.page_size
        if n > start:
            page = table.held[slot][len(pages)]
            for layer, ts in tail.items():
                for buf, t in zip(self.store[layer], ts):
                    buf[page, :n - start] = t.to(buf.dtype)
        self.lengths[slot] = n
        self.bound[slot] = n
        self.loose.discard(slot)

    def fits(self, tokens: list[int]) -> bool:
        """Whether fresh slots of `tokens[i]` tokens each would find their pages free. The pool of every slot decides
        (the same on every rank: a data-parallel group's pool, `split`, holds `max_length` for each slot the rank
        owns)."""
        return sum(num_pages_for(t, self.page_size) for t in tokens) <= self.pages[False].num_free

    def page_bytes(self, specs: dict[str, BufferSpec]) -> dict[bool, int]:
        """Bytes of one page of each group (`pages`: every layer's; the data-parallel ones'), from the memory plan's
        `kv_specs` (the pools are allocated at each layer's first write)."""
        pools = page_specs(specs)
        return {g: self.page_size * token_bytes({n: s for n, s in pools.items()
                                                 if self._split_holds(spec_key(n)) == g}) for g in self.pages}

    # ---- round -------------------------------------------------------------------------------------
    def begin(self, slots: torch.Tensor, num_tokens: int, tree: VerifyTree | None = None, *,
              host_slots: list[int] | None = None, tokens: list[int] | None = None) -> None:
        """Open a round: `slots [B]` (and the same as a host list), T tokens (a chain, or the round's tree).
        `tokens`: the real tokens of each row where fewer than T (a right-padded prefill chunk): pages are taken for
        those; the padding's entries land on the scratch page or past the row's length."""
        host_slots = slots.tolist() if host_slots is None else list(host_slots)
        need = self.check_room(host_slots, num_tokens)
        real = [num_tokens] * len(host_slots) if tokens is None else tokens
        self.reserve(host_slots, [self.bound[s] + n for s, n in zip(host_slots, real)])
        self.slots, self.host_slots, self.num_tokens, self.tree = slots, host_slots, num_tokens, tree
        self._addr = {}
        self.span = self.max_length if self.static else need
        if self.split is not None:
            self.split.select(host_slots)

    def check_room(self, host_slots: list[int], num_tokens: int) -> int:
        """-> the key span a round of `num_tokens` needs; ValueError when it would not fit."""
        need = max(self.bound[s] for s in host_slots) + num_tokens
        if need > self.max_length:
            raise ValueError(f"max_length: {need} tokens would exceed the cache length {self.max_length}")
        return need

    def advance_bound(self, host_slots: list[int], counts: list[int]) -> None:
        """The host side of `commit`: each slot's length bound grows by its kept count."""
        for s, c in zip(host_slots, counts):
            self.bound[s] += c

    def visible(self) -> torch.Tensor:
        """`[B, T, T]` bool: round token t sees round token u (u is t or an ancestor of t)."""
        B, T = self.slots.shape[0], self.num_tokens
        if self.tree is None:
            return torch.ones(T, T, dtype=torch.bool, device=self.device).tril().expand(B, T, T)
        return self.tree.ancestors()

    def depth(self) -> torch.Tensor:
        """Depth of each round token `[B, T]` (chain: t; tree: ancestors counted)."""
        B, T = self.slots.shape[0], self.num_tokens
        if self.tree is None:
            return torch.arange(T, device=self.device).expand(B, T)
        return self.tree.depth()

    def positions(self) -> torch.Tensor:
        """Position ids `[B, T]`: committed length + depth."""
        return self.lengths[self.slots][:, None] + self.depth()

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive mask `[B, 1, T, S]`, `S = max committed length + T`: committed keys and the token's
        own ancestors are visible; other round tokens and padding are not. None where every key is visible: one
        row, one token, its length bound exact (a plain decode step), outside static shapes."""
        if (self.tree is None and self.num_tokens == 1 and len(self.host_slots) == 1 and not self.static
                and self.host_slots[0] not in self.loose):
            return None
        lens = self.lengths[self.slots]
        B, T = lens.shape[0], self.num_tokens
        S = self.span
        zero, low = torch.zeros((), dtype=dtype, device=self.device), torch.finfo(dtype).min
        j = torch.arange(S, device=self.device)
        committed = zero.where(j < lens[:, None], low)  # [B, S]
        mask = committed[:, None, None, :].expand(B, 1, T, S).clone()
        # the round's own keys, at columns lens .. lens + T - 1 of each row (< S): its token t sees u where u is t
        # or an ancestor; one indexed write of [B, T, T]
        rows = torch.arange(B, device=self.device)[:, None, None]
        t = torch.arange(T, device=self.device)
        cols = (lens[:, None] + t)[:, None, :]  # [B, 1, T]
        block = zero.where(self.visible(), low)  # [B, T, T]
        mask[rows, 0, t[None, :, None], cols] = block
        return mask

    # ---- page addressing ---------------------------------------------------------------------------
    def _at(self, dp: bool, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of positions `pos [B, n]` of table rows `rows [B]`."""
        table = self.pages[dp].table[rows]  # [B, max_pages]
        return table.gather(1, (pos // self.page_size).clamp(max=self.max_pages - 1)), pos % self.page_size

    def read(self, layer_idx: int, rows: torch.Tensor, span: int, *, pages: torch.Tensor | None = None,
             first: int | None = None) -> list[torch.Tensor]:
        """Positions `[0, span)` of table rows `rows [B]`, each stored tensor of the layer as `[B, heads, span,
        dim]` (a gather of the rows' pages, whole pages at a time; a view of it). `pages`: the rows' table entries
        over the span, when the caller has them. `first`: one row whose span pages are `first, first + 1, ...`
        (`_address`): a view of the pool itself, no copy."""
        n = num_pages_for(span, self.page_size)
        if pages is None and first is None:
            pages = self.pages[self._split_holds(layer_idx)].table[rows, :n]  # [B, n]
        out = []
        for buf in self.store[layer_idx]:  # [P + 1, page, h, d] -> [B, n, page, h, d] -> [B, h, span, d]
            if first is not None:
                x = buf[first:first + n].unsqueeze(0)
            else:  # index_select copies whole pages (aten::index goes element by element)
                x = buf.index_select(0, pages.reshape(-1)).view(pages.shape[0], n, *buf.shape[1:])
            out.append(x.view(x.shape[0], n * self.page_size, *x.shape[3:])[:, :span].transpose(1, 2))
        return out

    # ---- transformers Cache surface -----------------------------------------------------------------
    def update(self, *states, **kwargs):
        """`update(key [B, h, T, dk], value [B, h, T, dv], layer_idx, ...)` -> full `[B, h, S, d]` each; a layer
        storing one tensor per token (`adapters.KimiLatentAttention`'s latents) passes that one alone."""
        new = tuple(x for x in states if isinstance(x, torch.Tensor))
        layer_idx = states[len(new)] if len(states) > len(new) else kwargs["layer_idx"]
        dp = self._split_holds(layer_idx)
        if layer_idx not in self.store:  # normal tensors (`allocate`): kept across calls
            pool = self.pages[dp].num_pages
            self.store[layer_idx] = [allocate(kv_spec(layer_idx, j, pool, x.shape[1], x.shape[3], x.dtype,
                                                      page_size=self.page_size), self.device)
                                     for j, x in enumerate(new)]
        page, off, span, first = self._address(dp)
        for buf, x in zip(self.store[layer_idx], new):
            buf[page, off] = x.transpose(1, 2).to(buf.dtype)  # [B, T, h, d] at (page, offset)
        return tuple(self.read(layer_idx, self._rows(dp)[1], self.span, pages=span, first=first))

    def write(self, key: str, x: torch.Tensor) -> None:
        """A token feature (`feature_key`) of the open round's T tokens, `x [B, T, d]`, into the slots' pages at the
        positions their KV takes: kept by `commit` as the KV is (a tree's accepted path compacted), so a slot's
        pages hold the feature of every committed position, and a prefix-cache entry shares them with its KV."""
        if key not in self.store:
            self.store[key] = [allocate(kv_spec(key, 0, self.pages[False].num_pages, 1, x.shape[-1], x.dtype,
                                                page_size=self.page_size), self.device)]
        page, off, _, _ = self._address(False)
        buf = self.store[key][0]
        buf[page, off] = x[:, :, None].to(buf.dtype)  # [B, T, 1, d] at (page, offset)

    def _address(self, dp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]:
        """(page, offset) of the round's new tokens `[B', T]` each, the pages of the key span `[B', n]` in the
        group's table (`dp`: the data-parallel layers', the owned rows only), and the first of them where the round
        has one row whose pages are one ascending run (else None; never with static shapes, whose reads keep one
        shape): once a round for every layer."""
        if dp not in self._addr:
            slots, rows, _ = self._rows(dp)
            idx = self.lengths[slots][:, None] + torch.arange(self.num_tokens, device=self.device)  # [B, T]
            span = self.pages[dp].table[rows, :num_pages_for(self.span, self.page_size)]
            first = None
            if not dp and not self.static and len(self.host_slots) == 1:
                table = self.pages[False]
                row = self.host_slots[0]
                if table.run[row] and table.held[row]:
                    first = table.held[row][0]
            self._addr[dp] = (*self._at(dp, rows, idx), span, first)
        return self._addr[dp]

    def _rows(self, dp: bool) -> tuple[torch.Tensor, torch.Tensor, object]:
        """The round's slots a layer's buffers hold `[B']`, their table rows and which round rows they are: every
        row's, or (`dp`, a data-parallel layer) the owned ones."""
        if not dp:
            return self.slots, self.slots, slice(None)
        own = self.split.own
        return self.slots[own], self.split.own_rows, own

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span - self.num_tokens if self.slots is not None else 0

    # ---- commit ------------------------------------------------------------------------------------
    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Keep `acc.num_kept [B]` round tokens of each row, `acc.path [B, M]` their node indices (root first).
        `host_counts`: the same counts on the host, which keep `bound` exact (else it grows by T)."""
        n = acc.num_kept
        if self.tree is not None:  # tree: move each accepted path to consecutive positions
            for dp in (False, True):
                layers = [bufs for layer, bufs in self.store.items() if self._split_holds(layer) == dp]
                if not layers:
                    continue
                slots, rows, sel = self._rows(dp)
                path, kept = (acc.path[sel], n[sel]) if dp else (acc.path, n)
                lens = self.lengths[slots]
                j = torch.arange(path.shape[1], device=self.device)
                keep = (j[None, :] < kept[:, None])[..., None, None]  # [B, M, 1, 1]
                src = self._at(dp, rows, (lens[:, None] + path.clamp(min=0)).clamp(max=self.max_length - 1))
                dst = self._at(dp, rows, (lens[:, None] + j[None, :]).clamp(max=self.max_length - 1))
                for buf in (b for bufs in layers for b in bufs):  # [P + 1, page, h, d]: indexed -> [B, M, h, d]
                    new, old = buf[src], buf[dst]
                    buf[dst] = torch.where(keep, new, old)
        self.advance(n, host_counts=host_counts)

    def advance(self, n: torch.Tensor, *, host_counts: list[int] | None = None) -> None:
        """Keep the first `n [B]` round tokens of each row (a chain's, a prefill's) and close the round."""
        self.lengths[self.slots] += n
        if host_counts is None:
            self.loose.update(self.host_slots)
        self.advance_bound(self.host_slots, host_counts if host_counts is not None
                           else [self.num_tokens] * len(self.host_slots))
        self.abort()

    def abort(self) -> None:
        self.slots = self.tree = None
        self._addr = {}
        if self.split is not None:
            self.split.clear()

    def reset(self, slot: int) -> None:
        """The slot holds no token and no page (a slot taken for a new request)."""
        self.lengths[slot] = 0
        self.bound[slot] = 0
        self.loose.discard(slot)
        self.release(slot)

    def release(self, slot: int) -> None:
        """The slot's pages go back to the pool (a request that ended); its length stays as it was committed."""
        self.pages[False].release(slot)
        row = None if self.split is None else self.split.row(slot)
        if row is not None:
            self.pages[True].release(row)
