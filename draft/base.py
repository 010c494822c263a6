"""Drafter interface: propose a block of draft tokens per request, keep own caches in step with the target's
committed tokens (`observe`); what a drafter sees of the target (`TargetView`), and the one place in draft/ that
reads the target's internals (its attention layers, its cache type)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from specdec.adapters import HYBRID_FAMILIES, attr_path, kv_dims, layer_kind
from specdec.adapters import latent_attention  # noqa: F401  (for mtp: MLA queries over the target's latents)
from specdec.kv_cache import KVCache, kv_specs
from specdec.kernels.tree import topology_errors
from specdec.replayssm.plan import BufferSpec


@dataclass
class DraftBlock:
    """Drafts for B requests.

    tokens: `[B, G]` draft tokens following each request's anchor (G may be 0).
    num_drafts: `[B]` valid drafts per row (<= G; the rest is padding and never accepted).
    probs: `[B, G, V]` distribution each draft was drawn from, or None for deterministic drafts (one-hot q).
    parent: None for a chain, or `[B, 1 + G]` parents over `[anchor, drafts...]` for a tree (anchor -1).
    """

    tokens: torch.Tensor
    num_drafts: torch.Tensor
    probs: torch.Tensor | None = None
    parent: torch.Tensor | None = None

    @classmethod
    def empty(cls, B: int, device) -> "DraftBlock":
        return cls(torch.zeros(B, 0, dtype=torch.long, device=device), torch.zeros(B, dtype=torch.long, device=device))

    @classmethod
    def from_lists(cls, drafts: list[list[int]], device) -> "DraftBlock":
        """Right-padded chain block from per-row token lists."""
        G = max((len(d) for d in drafts), default=0)
        # one host-to-device copy: the padded tokens with each row's count in the last column
        packed = torch.tensor([list(d) + [0] * (G - len(d)) + [len(d)] for d in drafts], dtype=torch.long,
                              device=device).view(len(drafts), G + 1)
        return cls(packed[:, :G], packed[:, G])


def check_block(block: DraftBlock, B: int, gamma: int, *, device, vocab: tuple[int, int], tree_budget: int | None,
                target: str) -> DraftBlock:
    """Validate a drafter's block completely; -> the block to verify (a chain cut to `gamma` drafts).

    Shapes, dtypes and devices are checked from metadata; the values (ids in [0, vocab), num_drafts in
    [0, G], tree parents topological, probs finite, >= 0, summing to 1 and > 0 at the draft) with tensor
    ops whose results are read back once, as one combined flag. Raises ValueError naming what is wrong.

    The target's side: `device` its tensors live on; `vocab` (ids it can read: embedding rows, scores it returns:
    the logits' last dim); `tree_budget` its verify window (`num_verify_tokens`, anchor included) when it verifies
    trees, None when it verifies chains only; `target` its runner's name (for the error messages)."""
    dev = device
    if not isinstance(block, DraftBlock):
        raise ValueError(f"drafter returned {type(block).__name__}, expected a DraftBlock")
    tokens, num, probs, parent = block.tokens, block.num_drafts, block.probs, block.parent

    def tensor(name, t, dtype, shape):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if dtype is None and not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
        if t.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev}, got {t.device}")

    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        got = list(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens: expected a tensor [B, G] = [{B}, G], got {got}")
    G = tokens.shape[1]
    tensor("tokens", tokens, torch.long, (B, G))
    tensor("num_drafts", num, torch.long, (B,))
    id_vocab, V = vocab
    if parent is not None:
        if tree_budget is None:
            raise ValueError(f"parent: a tree block needs a hybrid target; {target} verifies chains only")
        if 1 + G > tree_budget:
            raise ValueError(f"tokens: a tree of {G} drafts exceeds the node budget ({tree_budget - 1} drafts)")
        if isinstance(parent, torch.Tensor) and parent.dim() == 1:
            tensor("parent", parent, torch.long, (1 + G,))
            parent = parent.expand(B, 1 + G)
        tensor("parent", parent, torch.long, (B, 1 + G))
    if probs is not None:
        tensor("probs", probs, None, (B, G, V))
    # values: one flag per check, read back together
    ar = torch.arange(G, device=dev)
    checks = [("tokens: ids outside [0, vocab)", ((tokens < 0) | (tokens >= id_vocab)).any()),
              ("num_drafts: outside [0, G]", ((num < 0) | (num > G)).any())]
    if parent is None:
        live = ar[None] < num[:, None]  # [B, G]
    else:
        checks += [("parent: not topological (expected -1 <= parent[i] < i; the root, node 0, -1)",
                    topology_errors(parent).any())]
        live = parent[:, 1:] >= 0
    if probs is not None:
        acc = torch.float64 if probs.dtype == torch.float64 else torch.float32
        tol = max(1e-3, 4 * torch.finfo(probs.dtype).eps)
        lv = live[..., None]
        at = probs.gather(-1, tokens.clamp(0, V - 1)[..., None])[..., 0]
        checks += [("probs: not finite", (lv & ~torch.isfinite(probs)).any()),
                   ("probs: negative", (lv & (probs < 0)).any()),
                   ("probs: rows do not sum to 1", (live & ((probs.sum(-1, dtype=acc) - 1).abs() > tol)).any()),
                   ("probs: a draft token has probability 0 under its own distribution",
                    (live & ~(at > 0)).any())]
    bad = torch.stack([c for _, c in checks])
    if bool(bad.any()):  # the one host read of a good block
        failed = [name for (name, _), b in zip(checks, bad.tolist()) if b]
        raise ValueError("malformed draft block: " + "; ".join(failed) + _block_detail(block, id_vocab, G))
    if parent is not None or G <= gamma:
        return block if parent is None or parent is block.parent else replace(block, parent=parent)
    return replace(block, tokens=tokens[:, :gamma], num_drafts=num.clamp(max=gamma),
                   probs=None if probs is None else probs[:, :gamma])


def _block_detail(block: DraftBlock, vocab: int, G: int) -> str:
    t = block.tokens
    detail = f" (vocab {vocab}, G {G}; token ids {int(t.min()) if t.numel() else '-'}.." \
             f"{int(t.max()) if t.numel() else '-'}, num_drafts {block.num_drafts.tolist()}"
    if block.parent is not None:
        detail += f", parent {block.parent.tolist()}"
    return detail + ")"


@dataclass(frozen=True)
class TargetView:
    """What a drafter sees of the target: its model (embeddings, lm_head, config), the attention layers' KV cache
    (`specdec.kv_cache.KVCache` on the hybrid runner, else None), whether it verifies trees, the verify window
    (`num_verify_tokens`, anchor included), the engine's `gamma` and `max_length`, and each request row's slot:
    `slots(rows) -> [int]`, and `index([int]) -> [n]`: a list of ints (rows, slots) as a long tensor on the target's
    device, built once per distinct list (rounds reuse theirs, so no host-to-device copy each round)."""

    model: object
    kv: object
    supports_tree: bool
    num_verify_tokens: int
    gamma: int
    max_length: int
    slots: Callable[[list[int]], list[int]]
    index: Callable[[list[int]], torch.Tensor]

    def new_kv_cache(self, num_slots: int, max_length: int, *, device) -> KVCache:
        """A KV cache of the kind the hybrid runner keeps (`specdec.kv_cache.KVCache`: a row per slot, rollback by
        length), for a drafter's own attention layers; `kv_cache_specs` are its buffers."""
        return KVCache(num_slots, max_length, device=device)


# ---- the target's internals ------------------------------------------------------------------------------
# The one place in draft/ that reads the target's adapters (`specdec.adapters`) and its cache type
# (`specdec.kv_cache`): the heads find the target's attention layers here, and a bound drafter reaches the rest of
# the target through its `TargetView`.
@dataclass(frozen=True)
class TargetAttention:
    """A target full-attention layer as a head reads it: the module, the norm in front of it, and the layer's
    scale of the normed input (Falcon-H1's `attention_in_multiplier`; None: 1)."""

    attn: nn.Module
    norm: nn.Module
    in_scale: float | None = None


def attention_layers(model) -> dict[int, TargetAttention]:
    """Every decoder layer of `model` whose own attention caches keys/values (not a shared block, Zamba2's), by
    the family's adapter layout (`specdec.adapters.HYBRID_FAMILIES`)."""
    spec = HYBRID_FAMILIES.get(model.config.model_type)
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    out = {}
    for i, t in enumerate(types[:model.config.get_text_config().num_hidden_layers]):
        kind = layer_kind(t)
        layout = None if spec is None or kind not in ("attention", "hybrid") else spec.layout(kind)
        if layout is None or layout.shared is not None:
            continue
        layer = model.model.layers[i]
        scale = None if layout.attn_in_scale is None else float(attr_path(layer, layout.attn_in_scale))
        out[i] = TargetAttention(attr_path(layer, layout.attn), attr_path(layer, layout.pre_mixer), scale)
    return out


def kv_cache_specs(name: str, num_slots: int, max_length: int, attn: nn.Module,
                   dtype: torch.dtype) -> dict[str, BufferSpec]:
    """The buffers of `TargetView.new_kv_cache(num_slots, max_length)` holding the one attention layer `attn`
    (module of the target's kind) in `dtype`, named `name.*` (the engine's memory plan, made before binding)."""
    return {f"{name}.{key}": spec for key, spec in kv_specs(num_slots, max_length, {0: kv_dims(attn)},
                                                            dtype).items()}


def grown_kv_specs(name: str, attns, rows: int, window: int, dtype: torch.dtype, *,
                   static: bool) -> dict[str, BufferSpec]:
    """K and V `[rows, heads, cap, head_dim]` of each attention in `attns` (its `num_kv` K/V heads where it groups
    queries, else `num_heads`; `head_dim`) for a cache
    holding `window` positions per row: `cap = window` with static shapes (sized once), else `max(2 * window, 64)`,
    a conservative bound: a cache grown by doubling (from 64) ends below twice the positions it must hold."""
    cap = window if static else max(2 * window, 64)
    return {f"{name}.{i}.{kv}": BufferSpec(f"{name}.{i}.{kv}", (rows, getattr(a, "num_kv", a.num_heads), cap,
                                                                  a.head_dim), dtype)
            for i, a in enumerate(attns) for kv in ("k", "v")}


def pad_rows(seqs: list[torch.Tensor]) -> torch.Tensor:
    """Per-row tensors `[n_b, ...]` as one right-padded batch `[B, max n_b, ...]` (zeros past a row)."""
    return torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)


@dataclass(frozen=True)
class Contexts:
    """What `propose` drafts after, per request row: `tensors[b] [n_b]` long, the row's token history (prompt,
    committed tokens, the anchor last; the engine's are views of its token buffer), and `host[b]`, the same tokens
    as a host list, so that a drafter working on the host (prompt lookup) needs no device read."""

    tensors: list[torch.Tensor]
    host: list[list[int]]

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> "Contexts":
        """From the token tensors alone (a drafter's own caller, tests): the host lists are read back here."""
        tensors = list(tensors)
        return cls(tensors, [t.tolist() for t in tensors])


@dataclass(frozen=True)
class Observation:
    """Target outputs at the newly committed positions of request rows `rows`, n_b positions for row b:

    tokens: `[n_b]` per row (the prompt after a prefill; the anchor and the accepted drafts after a round); the
        token following them is the next anchor.
    counts: `[B]` long, the n_b on a device, so that a drafter indexes its device buffers with no host-to-device
        copy.
    hidden: `[n_b, d]` per row, the final normed hidden state (empty: the caller has none, for a drafter that reads
        features alone).
    features: `{layer: [n_b, d] per row}`, the outputs of the drafter's `feature_layers`.
    token_batch, feature_batches: the right-padded batches `[B, M]` / `{layer: [B, M, d]}` (M >= every n_b) that the
        rows are views of, where the caller has them (the engine); a drafter reads them whole (`padded_tokens`,
        `padded_features`), with no op per row.
    """

    rows: list[int]
    tokens: list[torch.Tensor]
    counts: torch.Tensor
    hidden: list[torch.Tensor] = field(default_factory=list)
    features: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    token_batch: torch.Tensor | None = None
    feature_batches: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, rows: list[int], tokens: list[torch.Tensor], hidden: list[torch.Tensor] = (),
           features: dict[int, list[torch.Tensor]] | None = None) -> "Observation":
        """From per-row lists (a drafter's own caller, tests): `counts` from the tokens' lengths (one host-to-device
        copy), no batches."""
        tokens = list(tokens)
        counts = torch.tensor([int(t.shape[0]) for t in tokens], dtype=torch.long,
                              device=tokens[0].device if tokens else "cpu")
        return cls(list(rows), tokens, counts, list(hidden), dict(features or {}))

    @classmethod
    def rows_of(cls, rows: list[int], sizes: list[int], counts: torch.Tensor, *,
                tokens: torch.Tensor | list[torch.Tensor], hidden: torch.Tensor,
                features: dict[int, torch.Tensor]) -> "Observation":
        """Rows of right-padded batches (the engine's): row b is the first `sizes[b]` entries of row b of `hidden
        [B, M, d]`, of each `features[layer] [B, M, d]` and of `tokens [B, M]` (or `tokens` are the rows `[n_b]`
        themselves), as views; `counts [B]` are the sizes on the device."""
        def cut(batch: torch.Tensor) -> list[torch.Tensor]:
            return [batch[i, :n] for i, n in enumerate(sizes)]

        batch = tokens if isinstance(tokens, torch.Tensor) else None
        return cls(list(rows), cut(tokens) if batch is not None else list(tokens), counts, cut(hidden),
                   {l: cut(f) for l, f in features.items()}, batch, dict(features))

    @property
    def sizes(self) -> list[int]:
        """n_b per row, on the host (the tokens' lengths: no device read)."""
        return [int(t.shape[0]) for t in self.tokens]

    def padded_tokens(self) -> torch.Tensor:
        """The tokens as one right-padded batch `[B, max n_b]` (past a row: padding, never a committed token)."""
        return self._padded(self.tokens, self.token_batch)

    def padded_features(self, layer: int) -> torch.Tensor:
        """The features of `layer` as one right-padded batch `[B, max n_b, d]` (past a row: finite padding)."""
        return self._padded(self.features[layer], self.feature_batches.get(layer))

    @staticmethod
    def _padded(seqs: list[torch.Tensor], batch: torch.Tensor | None) -> torch.Tensor:
        if batch is None:
            return pad_rows(seqs)
        return batch[:, :max((int(t.shape[0]) for t in seqs), default=0)]


class Drafter(ABC):
    """A drafter sees each request's full token history (prompt + committed tokens + the anchor)."""

    name = "drafter"
    target: TargetView | None = None  # the engine's view of the target (`bind`); None for a drafter used on its own
    feature_layers: tuple[int, ...] = ()  # target decoder layers whose outputs `observe` receives
    static_draft = False  # has `draft_step`: drafting as device work of fixed shapes (CUDA-graph capturable)
    tree = False  # drafts trees (a `parent` in its blocks): the round's verify takes the tree form
    # `observe` reads the target's hidden states / features (a drafter with caches of its own): a prefix cache keeps
    # them with its entries, so that a request started from a cached prefix observes its whole prompt
    observes_features = True
    # target layers whose KV cache the drafter reads (a tensor-parallel target keeps their attention whole)
    target_kv_layers: tuple[int, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.static_draft and cls.draft_step is Drafter.draft_step:  # the engine would call the missing step
            raise TypeError(f"{cls.__name__} sets static_draft but defines no draft_step")

    def bind(self, target: TargetView) -> None:
        """Called once by the engine with its view of the target."""
        self.target = target

    def modules(self) -> list[torch.nn.Module]:
        """The torch modules this drafter runs (its attributes that are modules): where the engine's `cpu_linear`
        swaps in oneDNN linears."""
        return [v for v in vars(self).values() if isinstance(v, torch.nn.Module)]

    def max_verify_tokens(self, gamma: int) -> int:
        """Most tokens one verify window needs (anchor included): a chain's gamma + 1, a tree's node budget."""
        return gamma + 1

    def memory_specs(self, *, max_length: int, num_verify_tokens: int, gamma: int,
                     static: bool) -> dict[str, BufferSpec]:
        """The caches this drafter will allocate, at their largest, beside a target of `max_length` tokens that
        verifies `num_verify_tokens` per round (`gamma` drafts; `static`: static shapes): the engine's memory plan,
        made before either allocates. None here: a drafter that keeps nothing per position (ngram's host tables)."""
        return {}

    def begin(self, rows: list[int], prompts: list[torch.Tensor]) -> None:
        """New requests `rows` with their prompts `[P]`."""

    @abstractmethod
    def propose(self, rows: list[int], contexts: Contexts, gamma: int, *, sampling=None,
                generator: torch.Generator | None = None) -> DraftBlock:
        """Up to `gamma` drafts after each row's context (`Contexts`: its last token is the anchor)."""

    def draft_step(self, rows: list[int], rows_t: torch.Tensor, slots_t: torch.Tensor, anchors: torch.Tensor,
                   gamma: int, *, sampling=None, generator: torch.Generator | None = None) -> DraftBlock:
        """`propose` for drafters with `static_draft`, which the engine calls with static shapes: a block for the
        `Bk` rows of a batch bucket from the request rows `rows_t [Bk]` (padding rows repeat a real one; the engine
        drops their drafts), their target slots `slots_t [Bk]` and anchors `[Bk]`, with device ops only (no host
        reads) whose shapes depend on `Bk` and `gamma` alone, reading the drafter's persistent buffers and the
        target's KV cache over its whole `max_length`: a CUDA graph captures it with the verify. `rows` are the
        real rows on the host, for checks made before any device work."""
        # An optional hook, not unfinished work: the engine calls it only on drafters that set `static_draft`, and a
        # class that sets it without defining this is refused when it is defined (`__init_subclass__`).
        raise TypeError(f"{type(self).__name__}: draft_step is called on drafters with static_draft only")

    def _index(self, values: list[int], device) -> torch.Tensor:
        """`values` (rows, slots) as a long device tensor: the bound target's (built once per distinct list), else
        built here (a drafter used on its own)."""
        if self.target is not None:
            return self.target.index(list(values))
        return torch.tensor(list(values), dtype=torch.long, device=device)

    def _static_shapes(self) -> bool:
        """Whether the bound target keeps static shapes (its KV cache a fixed view): drafters with a static draft
        step then size their caches once, for the target's whole `max_length`."""
        kv = None if self.target is None else self.target.kv
        return kv is not None and kv.static

    def observe(self, obs: Observation) -> None:
        """Target outputs at newly committed positions of `obs.rows` (`Observation`: tokens, hidden states,
        features and their counts on the device)."""

    def abort(self, rows: list[int]) -> None:
        """A round of `rows` failed part-way: `propose` raised or returned a malformed block (the next round
        drafts again), or something raised after the target's verify opened (`release` follows). Drop whatever
        is half-done so the drafter is back at its committed state. The default has nothing to drop: drafters
        with mid-round state (an own runner or cache) override it."""

    def release(self, rows: list[int]) -> None:
        """Requests ended."""


class NoDraft(Drafter):
    """Proposes nothing: every round verifies the anchor alone, i.e. plain decoding through the same engine (the
    baseline of the timing comparisons)."""

    observes_features = False

    name = "none"

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        return DraftBlock.empty(len(rows), contexts.tensors[0].device)
