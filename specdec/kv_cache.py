"""KV cache of the full-attention layers: per-request buffers, rollback by length, tree masks."""

from __future__ import annotations

import torch

from specdec.kernels.tree import VerifyTree
from specdec.replayssm.plan import BufferSpec
from specdec.replayssm.pool import allocate
from specdec.tensors import index_tensor
from specdec.verify.record import Acceptance


def kv_spec(layer_idx: int, index: int, num_slots: int, heads: int, max_length: int, dim: int,
            dtype: torch.dtype) -> BufferSpec:
    """Stored tensor `index` (0: K, 1: V, or MLA's latents) of one layer: `[N, heads, max_length, dim]`."""
    return BufferSpec(f"kv.{layer_idx}.{index}", (num_slots, heads, max_length, dim), dtype)


def kv_specs(num_slots: int, max_length: int, layers: dict[int, list[tuple[int, int]]],
             dtype: torch.dtype) -> dict[str, BufferSpec]:
    """The buffers a `KVCache(num_slots, max_length)` allocates, for attention layers `{layer: [(heads, dim) per
    stored tensor]}` whose tensors come in `dtype`."""
    return {spec.name: spec for layer, dims in layers.items() for j, (heads, dim) in enumerate(dims)
            for spec in [kv_spec(layer, j, num_slots, heads, max_length, dim, dtype)]}


def owned_rows(num_slots: int, ranks: int) -> int:
    """Rows a rank keeps of a data-parallel layer (`KVCache.split_slots`): its share of the request slots (slot s
    to rank s % ranks, row s // ranks; the null slot, the last, to none)."""
    return -(-(num_slots - 1) // ranks)


class KVCache:
    """Quacks like a transformers `Cache` for the model's own attention modules (`update` returns the
    full keys/values), but keeps one buffer per request slot: `[N, heads, max_length, dim]` per stored
    tensor (K and V, or MLA's compressed latents), allocated at the first `update` of each layer.

    A round writes its T new entries after each request's committed length; `commit` keeps the accepted
    ones (compacting a tree's accepted path) by moving the length, so rollback costs nothing.

    Nothing here reads a value back to the host: the lengths live on the device, and `bound` keeps a host
    upper bound of each slot's length (exact when commits pass their host counts), which sizes the key span
    `S` of a round. Keys past a row's true length are masked, so a loose bound costs work, never correctness.
    `static=True` fixes `S = max_length` (every round's shapes depend on B and T only, as CUDA graphs need).
    """

    def __init__(self, num_slots: int, max_length: int, *, device: torch.device | str = "cpu", static: bool = False):
        self.max_length = max_length
        self.static = static
        self.device = torch.device(device)
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.store: dict[int, list[torch.Tensor]] = {}
        self.bound = [0] * num_slots  # host upper bound of `lengths`
        self.slots: torch.Tensor | None = None
        self.host_slots: list[int] = []
        self.tree: VerifyTree | None = None
        self.num_tokens = 0
        self.span = 0  # S: keys a round's attention reads
        # data-parallel layers (tensor parallelism, `split_slots`): stored for this rank's request slots only
        self.dp_layers: set[int] = set()
        self.rank = self.ranks = 0
        self.own: torch.Tensor | None = None  # [B_own] the round's rows whose slot this rank owns
        self.own_rows: torch.Tensor | None = None  # [B_own] their rows in a data-parallel layer's buffers
        self._index: dict = {}

    def split_slots(self, layers, rank: int, ranks: int) -> None:
        """Keep `layers` for the request slots `s` with `s % ranks == rank` only (row `s // ranks`; the null slot,
        the last, for none): the attention of those layers runs data-parallel over the requests, each rank on the
        rows it owns (a tensor-parallel MLA layer: its latent cache is every head's, so it is split by request)."""
        self.dp_layers, self.rank, self.ranks = set(layers), rank, ranks

    def rows(self, layer_idx: int) -> int:
        """Buffer rows of a layer: one per slot, a data-parallel one's one per request slot this rank may own."""
        n = self.lengths.shape[0]
        return owned_rows(n, self.ranks) if layer_idx in self.dp_layers else n

    def _own(self, host_slots: list[int]) -> None:
        """The round's owned rows and their buffer rows (device tensors, kept per distinct list)."""
        null = self.lengths.shape[0] - 1
        own = [b for b, s in enumerate(host_slots) if s != null and s % self.ranks == self.rank]
        self.own = index_tensor(self._index, own, self.device)
        self.own_rows = index_tensor(self._index, [host_slots[b] // self.ranks for b in own], self.device)

    # ---- round -------------------------------------------------------------------------------------
    def begin(self, slots: torch.Tensor, num_tokens: int, tree: VerifyTree | None = None, *,
              host_slots: list[int] | None = None) -> None:
        """Open a round: `slots [B]` (and the same as a host list), T tokens (a chain, or the round's tree)."""
        host_slots = slots.tolist() if host_slots is None else list(host_slots)
        need = self.check_room(host_slots, num_tokens)
        self.slots, self.host_slots, self.num_tokens, self.tree = slots, host_slots, num_tokens, tree
        self.span = self.max_length if self.static else need
        if self.dp_layers:
            self._own(host_slots)

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

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask `[B, 1, T, S]`, `S = max committed length + T`: committed keys and the token's
        own ancestors are visible; other round tokens and padding are not."""
        lens = self.lengths[self.slots]
        B, T = lens.shape[0], self.num_tokens
        S = self.span
        j = torch.arange(S, device=self.device)
        ok = (j[None, None, :] < lens[:, None, None]).expand(B, T, S).clone()
        rel = j[None, :] - lens[:, None]  # [B, S]: index of the round token stored at key j
        inside = (rel >= 0) & (rel < T)
        vis = self.visible()  # [B, T, T]
        gathered = vis.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(B, T, S))
        ok |= inside[:, None, :] & gathered
        mask = torch.zeros(B, 1, T, S, dtype=dtype, device=self.device)
        return mask.masked_fill(~ok[:, None], torch.finfo(dtype).min)

    # ---- transformers Cache surface -----------------------------------------------------------------
    def update(self, *states: torch.Tensor, **kwargs):
        """`update(key [B, h, T, dk], value [B, h, T, dv], layer_idx, ...)` -> full `[B, h, S, d]` each."""
        layer_idx = states[2] if len(states) > 2 else kwargs["layer_idx"]
        new = states[:2]
        if layer_idx not in self.store:  # normal tensors (`allocate`): kept across calls
            self.store[layer_idx] = [allocate(kv_spec(layer_idx, j, self.rows(layer_idx), x.shape[1], self.max_length,
                                                      x.shape[3], x.dtype), self.device) for j, x in enumerate(new)]
        slots, rows, _ = self._rows(layer_idx in self.dp_layers)  # data-parallel: the owned rows' states come in
        lens = self.lengths[slots]
        S = self.span
        idx = lens[:, None] + torch.arange(self.num_tokens, device=self.device)  # [B, T]
        out = []
        for buf, x in zip(self.store[layer_idx], new):
            buf[rows[:, None], :, idx] = x.transpose(1, 2).to(buf.dtype)  # [B, T, h, d] at (slot, pos)
            out.append(buf[rows, :, :S])
        return tuple(out)

    def _rows(self, dp: bool) -> tuple[torch.Tensor, torch.Tensor, object]:
        """The round's slots a layer's buffers hold `[B']`, their buffer rows and which round rows they are: every
        row's, or (`dp`, a data-parallel layer) the owned ones."""
        return (self.slots[self.own], self.own_rows, self.own) if dp else (self.slots, self.slots, slice(None))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span - self.num_tokens if self.slots is not None else 0

    # ---- commit ------------------------------------------------------------------------------------
    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Keep `acc.num_kept [B]` round tokens of each row, `acc.path [B, M]` their node indices (root first).
        `host_counts`: the same counts on the host, which keep `bound` exact (else it grows by T)."""
        n = acc.num_kept
        if self.tree is not None:  # tree: move each accepted path to consecutive positions
            for dp in (False, True):
                layers = [bufs for layer, bufs in self.store.items() if (layer in self.dp_layers) == dp]
                if not layers:
                    continue
                slots, rows, sel = self._rows(dp)
                path, kept = (acc.path[sel], n[sel]) if dp else (acc.path, n)
                lens = self.lengths[slots]
                j = torch.arange(path.shape[1], device=self.device)
                keep = (j[None, :] < kept[:, None])[..., None, None]  # [B, M, 1, 1]
                src = (lens[:, None] + path.clamp(min=0)).clamp(max=self.max_length - 1)
                dst = (lens[:, None] + j[None, :]).clamp(max=self.max_length - 1)
                rows = rows[:, None]
                for buf in (b for bufs in layers for b in bufs):  # [N, h, max_length, d]: indexed -> [B, M, h, d]
                    new, old = buf[rows, :, src], buf[rows, :, dst]
                    buf[rows, :, dst] = torch.where(keep, new, old)
        self.advance(n, host_counts=host_counts)

    def advance(self, n: torch.Tensor, *, host_counts: list[int] | None = None) -> None:
        """Keep the first `n [B]` round tokens of each row (a chain's, a prefill's) and close the round."""
        self.lengths[self.slots] += n
        self.advance_bound(self.host_slots, host_counts if host_counts is not None
                           else [self.num_tokens] * len(self.host_slots))
        self.abort()

    def abort(self) -> None:
        self.slots = self.tree = self.own = self.own_rows = None

    def reset(self, slot: int) -> None:
        self.lengths[slot] = 0
        self.bound[slot] = 0
