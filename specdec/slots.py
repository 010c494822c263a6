"""The request slots of a hybrid target, with one owner.

A slot is one request's state in the target: its committed length, its KV pages (the block table row of
`KVCache`, and the token features a drafter observes, paged beside the KV), its recurrent pool state (conv window
and fp32 checkpoint, `replayssm.SlotPool`) and the pending records of a lazy commit (the state strategy's rings).
`Slots` is the only writer of all of them: a slot is taken (`alloc`), given pages (`reserve`), moved on by a
prefill chunk (`advance`) or a round (`open` ... `commit` / `abort`), copied out into a prefix-cache entry
(`snapshot`), filled from one (`restore`), and let go (`release`). The KV cache and the state strategy keep the
tensors; their length counters change only through these calls, so the committed length of a slot has one
source: `KVCache.lengths` on the device, `length(slot)` on the host (exact: every commit passes its host counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kernels.tree import VerifyTree
from specdec.verify.record import Acceptance

from .kv_cache import KVCache
from .tensors import outside_inference


@dataclass(eq=False)
class Entry:
    """The committed state of one prefix of `length` tokens, as `Slots.snapshot` takes it out of a slot: the
    recurrent conv windows `conv [Lyr, C, Kc-1]` and states `ssm [Lyr, H, K, V]` (copies), the full KV pages of the
    prefix (`pages`, held in `owner`'s pool until `free`: every attention layer's KV and every token feature) and
    the rest copied (`tail {key: ([n, heads, dim], ...)}`, n < a page). `nbytes` counts the tensors it owns (the
    pages are the pool's)."""

    length: int
    conv: torch.Tensor
    ssm: torch.Tensor
    pages: list[int]
    tail: dict
    owner: KVCache | None = None
    nbytes: int = 0
    used: int = 0  # LRU clock at the last hit or write
    pins: int = 0  # admissions restoring it right now: not evictable

    def __post_init__(self):
        tensors = [self.conv, self.ssm, *(t for ts in self.tail.values() for t in ts)]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def read(self, key) -> tuple[torch.Tensor, ...]:
        """The prefix's stored tensors of `key` (an attention layer, or a `kv_cache.feature_key`), `[heads, length,
        dim]` each: its pages, then its tail."""
        out = []
        for j, buf in enumerate(self.owner.store[key]):
            parts = [buf[self.pages].flatten(0, 1)] + ([self.tail[key][j]] if key in self.tail else [])
            out.append(torch.cat(parts, 0).transpose(0, 1))
        return tuple(out)

    def free(self) -> None:
        """Let go of the pages (the entry is gone from the cache)."""
        if self.owner is not None and self.pages:
            self.owner.drop(self.pages)
        self.pages = []


class Slots:
    """Every request slot of one hybrid target (see the module docstring): `state` the state strategy (its pool
    and rings), `kv` the KV cache (pages, block tables, lengths, token features)."""

    def __init__(self, state, kv: KVCache):
        self.state, self.kv = state, kv
        self._rounds: set[int] = set()  # slots committed to since their last fold: pending records (lazy commit)

    # ---- a slot's life -----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.state.pool.num_free

    @property
    def null_slot(self) -> int:
        return self.state.pool.null_slot

    def alloc(self, n: int) -> list[int]:
        """`n` fresh slots: zero state, no token, no page."""
        slots = self.state.pool.alloc(n)
        for s in slots:
            self.kv.reset(s)
        return slots

    def release(self, slots: list[int]) -> None:
        """The requests of `slots` ended: pending records folded, slots back to the pool, pages let go of."""
        self.state.release(slots)
        for s in slots:
            self.kv.release(s)
            self._rounds.discard(s)

    def reserve(self, slots: list[int], tokens: list[int]) -> None:
        """Fresh `slots` hold KV pages for `tokens[i]` tokens each, their worst case, before any round runs
        (`KVCache.reserve`): MemoryError, and nothing taken, when the pool cannot give them."""
        self.kv.reserve(slots, tokens)

    def fits(self, tokens: list[int]) -> bool:
        """Whether new requests of `tokens[i]` tokens each (their worst case) find their KV pages free."""
        return self.kv.fits(tokens)

    def length(self, slot: int) -> int:
        """The committed tokens of `slot` (host, exact)."""
        return self.kv.bound[slot]

    # ---- a forward ---------------------------------------------------------------------------------------
    def open(self, slots: torch.Tensor, num_tokens: int, tree: VerifyTree | None, *, host_slots: list[int],
             prefill: bool, tokens: list[int] | None = None) -> None:
        """Open a forward over `slots [B]` (the same as `host_slots`) of `num_tokens` tokens each (a chain, or
        `tree`): a round (verify: the state strategy records it, `commit` or `abort` closes it) or a prefill chunk
        (`prefill`: the state is written in place, `advance` closes it; `tokens`: each row's real tokens where fewer
        than T)."""
        if not prefill:
            self.state.open(slots, num_tokens, tree)
        try:
            self.kv.begin(slots, num_tokens, tree, host_slots=host_slots, tokens=tokens)
        except BaseException:  # no room for the round (max_length, pages): nothing of it stays open
            self.abort()
            raise

    def advance(self, slots: torch.Tensor, n: torch.Tensor, counts: list[int]) -> None:
        """Close a prefill chunk: each row of `slots [B]` keeps its `n [B]` tokens (`counts` on the host)."""
        self.kv.advance(n, host_counts=counts)
        self.state.pool.advance(slots, n)

    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Close a round keeping what `acc` accepted (its `path [B, M]`, `num_kept [B]`), device ops only;
        `host_counts`: `num_kept` on the host (keeps `length` exact)."""
        self._rounds.update(self.kv.host_slots)
        self.state.keep(acc)
        self.kv.commit(acc, host_counts=host_counts)

    def committed(self, host_slots: list[int], counts: list[int]) -> None:
        """The host side of a commit whose device work ran elsewhere (a replayed CUDA graph): each slot's length
        grows by its kept count."""
        self._rounds.update(host_slots)
        self.kv.advance_bound(host_slots, counts)

    def abort(self) -> None:
        """Drop the open round: nothing it wrote is kept."""
        self.state.abort()
        self.kv.abort()

    # ---- prefix-cache entries ------------------------------------------------------------------------------
    def snapshot(self, slot: int, boundary: int | None = None, *, interval: int | None = None) -> Entry:
        """`slot`'s committed state as an `Entry`: at its committed length (pending records folded first) from its
        pool state, or at `boundary`, a multiple of `interval` that its last round passed (the pool's track copy of
        it: a slot keeps its last two such boundaries); its KV and features below that length (the full pages
        shared, `KVCache.share`, the rest copied)."""
        pool, now = self.state.pool, self.length(slot)
        if boundary is None:
            if slot in self._rounds:
                self.state.flush([slot])
                self._rounds.discard(slot)
            length, conv, ssm = now, pool.conv[:, slot], pool.ssm[:, slot]
        else:
            if interval is None or boundary % interval or not 0 < boundary <= now < boundary + 2 * interval:
                raise ValueError(f"boundary: slot {slot} keeps its state at the last two multiples of "
                                 f"track_interval {interval} up to its {now} tokens; got {boundary}")
            par = (boundary // interval) % 2
            length, conv, ssm = boundary, pool.track_conv[:, slot, par], pool.track_ssm[:, slot, par]
        with outside_inference():  # kept across calls: normal tensors, as the pool's
            pages, tail = self.kv.share(slot, length)
            return Entry(length, conv.clone(), ssm.clone(), pages, tail, owner=self.kv)

    def restore(self, entry: Entry, slot: int) -> None:
        """`entry` into the fresh `slot`: state and conv window copied, its pages shared and its tail copied
        (`KVCache.adopt`), its length committed (the entry is read only: the slot writes only past its length)."""
        self.state.pool.load(slot, conv=entry.conv, ssm=entry.ssm, seq_len=entry.length)
        self.kv.adopt(slot, entry.pages, entry.tail, entry.length)

    def read(self, key, slots: torch.Tensor, length: int) -> torch.Tensor:
        """A token feature (`kv_cache.feature_key`) of `slots [B]` at positions `[0, length)`: `[B, length, d]`."""
        return self.kv.read(key, slots, length)[0][:, 0]
