"""`TargetRunner`: what the engine runs a target model through. `runner.make_runner` is the one place that picks
the class (`HybridRunner` for a family of `adapters.HYBRID_FAMILIES`, `GenericRunner` for any other causal LM);
everything else asks the runner's declared capabilities, never its class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from specdec.verify import Acceptance


class TargetRunner(ABC):
    """Request slots, prefill, and a verify forward that stays open until `commit` or `abort`.

    Capabilities (class attributes):
        supports_tree: `forward(parent=...)` verifies a token tree (else chains only);
        paged: the KV cache is pages owned by a slot owner (`kv`, `slots`): what a memory budget, the prefix cache
            and fixed shapes (`static_shapes`, CUDA graphs) need.
    Instance attributes: `device`, `vocab_size`, `hidden_size`, `max_length`, `num_verify_tokens` (the most tokens
    one verify forward takes per row), `kv` (the paged KV cache, None where not `paged`), `memory`.
    """

    supports_tree: ClassVar[bool] = False
    paged: ClassVar[bool] = False
    kv = None
    memory = None  # the runner's `MemoryPlan` (its buffers by part), where it keeps one

    device: torch.device
    vocab_size: int
    hidden_size: int
    max_length: int
    num_verify_tokens: int

    # ---- requests ----
    @property
    @abstractmethod
    def num_free(self) -> int:
        """Slots free for new requests."""

    @abstractmethod
    def alloc(self, n: int) -> list[int]:
        """`n` fresh slots (raises when fewer are free)."""

    @abstractmethod
    def release(self, slots: list[int]) -> None:
        """Give the slots back."""

    @abstractmethod
    def reserve(self, slots: list[int], tokens: list[int]) -> None:
        """Hold room for `tokens[i]` more tokens in `slots[i]` (a paged cache takes its pages now)."""

    @abstractmethod
    def fits(self, tokens: list[int]) -> bool:
        """Whether requests of `tokens[i]` tokens each fit in what is free."""

    @abstractmethod
    def length(self, slot: int) -> int:
        """The slot's committed tokens."""

    # ---- forwards ----
    def prefill(self, slot: int, ids: torch.Tensor, *, capture=()):
        """Run a prompt `[P]` into a fresh slot; -> `RunnerOutput` over the whole prompt `[1, P, ...]`."""
        return self.prefill_batch([slot], [ids], capture=capture)

    @abstractmethod
    def prefill_batch(self, slots: list[int], prompts: list[torch.Tensor], *, capture=(),
                      last_logits: bool = False):
        """Run B prompts `[P_b]` into their slots; -> one right-padded `RunnerOutput` (rows in the order of
        `slots`, `P = max P_b`, 0 past a row's end): `hidden [B, P, hidden]`, `captured[i] [B, P, hidden]`,
        `logits [B, P, vocab]`, or with `last_logits` `[B, 1, vocab]` (each row's last prompt token)."""

    @abstractmethod
    def forward(self, slots: list[int], ids: torch.Tensor, *, parent=None, capture=(),
                slots_t: torch.Tensor | None = None):
        """Verify `ids [B, T]` from the committed state (a chain; a tree with `parent` where `supports_tree`);
        the round stays open until `commit` / `abort`. -> `RunnerOutput` `[B, T, ...]`."""

    @abstractmethod
    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Keep what the open round accepted: `acc.path [B, M]` and `acc.num_kept [B]` (tokens kept, 1..T).
        `host_counts`: `num_kept` on the host where the caller has it."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the open round: every slot as it was before its forward."""
