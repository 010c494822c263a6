"""`GenericRunner`: the target runner of any causal LM outside `adapters.HYBRID_FAMILIES` (`make_runner`'s
fallback). It drives the model's own forward with a cloned cache: slower than `HybridRunner`, still lossless."""

from __future__ import annotations

import copy
import functools
import inspect

import torch

from specdec.verify import Acceptance

from .hf_compat import CACHE_ARGS, cache_arg
from .runner import RunnerOutput
from .target import TargetRunner


# transformers' Mamba-1 mixers start the selective scan from a zero state whenever more than one token comes in,
# cached state or not: the generic runner feeds these models one token at a time after the prompt
ONE_TOKEN_CONTINUATION = {"mamba", "falcon_mamba", "jamba", "zamba"}


class GenericRunner(TargetRunner):
    """Any causal LM: its own forward and cache. A round runs on a deep copy of the request's cache; commit
    adopts the copy when everything was accepted, else re-runs the accepted tokens on the original. Chains only,
    no paged cache (`TargetRunner`'s capabilities all off)."""

    def __init__(self, model, *, max_batch_size: int = 8, max_length: int = 4096, num_verify_tokens: int = 8, **_):
        self.model = model
        self.device = next(model.parameters()).device
        self.max_length = max_length
        self.num_verify_tokens = num_verify_tokens
        self.vocab_size = model.config.get_text_config().vocab_size
        self.hidden_size = model.config.get_text_config().hidden_size
        self.max_batch_size = max_batch_size
        self._free = list(range(max_batch_size))
        self._cache: dict[int, object] = {}
        self._len: dict[int, int] = {}
        self._round = None
        params = inspect.signature(model.forward).parameters
        self._cache_arg = cache_arg(model)
        self._position_args = [a for a in ("position_ids", "cache_position") if a in params]
        self._one_token = model.config.get_text_config().model_type in ONE_TOKEN_CONTINUATION

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"slot pool exhausted: requested {n} slot(s), {len(self._free)} of "
                               f"{self.max_batch_size} free")
        slots = [self._free.pop(0) for _ in range(n)]
        for s in slots:
            self._cache[s], self._len[s] = None, 0
        return slots

    def reserve(self, slots: list[int], tokens: list[int]) -> None:
        """Nothing to reserve: each slot's cache is the model's own, which grows as its forward appends."""

    def fits(self, tokens: list[int]) -> bool:
        """Always: the model's own caches are not paged from a budget."""
        return True

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self._cache.pop(s, None)
            self._free.append(s)

    def length(self, slot: int) -> int:
        return self._len[slot]

    def _positions(self, start: int, n: int) -> dict:
        """`position_ids` / `cache_position` (those the forward takes) of tokens `start .. start + n - 1`: some
        models (Bamba) otherwise count positions from 0 in every call, whatever the cache holds."""
        pos = torch.arange(start, start + n, device=self.device)
        return {a: pos[None] if a == "position_ids" else pos for a in self._position_args}

    def _run(self, slot: int, ids: torch.Tensor, cache):
        """`ids [T]` right after the slot's committed tokens, on `cache` (None: a fresh one);
        -> (logits `[1, T, V]`, cache, hidden states per layer `[1, T, hidden]`)."""
        from transformers import DynamicCache
        if cache is None and self._cache_arg != "cache_params":  # (a `cache_params` model builds its own)
            cache = DynamicCache(config=self.model.config)
        start = self._len[slot]
        parts = ids.split(1) if start and self._one_token else [ids]
        outs = []
        for part in parts:
            out = self.model(input_ids=part[None], **{self._cache_arg: cache}, **self._positions(start, len(part)),
                             use_cache=True, output_hidden_states=True)
            new = next((c for c in (getattr(out, a, None) for a in CACHE_ARGS) if c is not None), None)
            cache, start = (new if new is not None else cache), start + len(part)
            outs.append(out)
        return (torch.cat([o.logits for o in outs], 1), cache,
                tuple(torch.cat(h, 1) for h in zip(*(o.hidden_states for o in outs))))

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], prompts: list[torch.Tensor], *, capture=(),
                      last_logits: bool = False) -> RunnerOutput:
        """Each prompt `[P_b]` through the model's own forward into its slot, one after another; -> one
        right-padded `RunnerOutput` as `TargetRunner.prefill_batch` says."""
        if not slots or len(prompts) != len(slots):
            raise ValueError(f"prompts: expected one prompt per slot ({len(slots)} slots), got {len(prompts)}")
        outs = []
        for slot, ids in zip(slots, prompts):
            logits, cache, hs = self._run(slot, ids, self._cache[slot])
            self._cache[slot], self._len[slot] = cache, self._len[slot] + ids.shape[0]
            outs.append((logits[0, -1:] if last_logits else logits[0], hs[-1][0], [hs[i + 1][0] for i in capture]))
        pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
        return RunnerOutput(pad([o[0] for o in outs]), pad([o[1] for o in outs]),
                            {i: pad([o[2][j] for o in outs]) for j, i in enumerate(capture)})

    @torch.no_grad()
    def forward(self, slots: list[int], ids: torch.Tensor, *, parent=None, capture=(), slots_t=None) -> RunnerOutput:
        if parent is not None:
            raise ValueError("parent: tree verify needs a hybrid adapter; the generic path verifies chains")
        logits, hidden, caps, clones = [], [], {i: [] for i in capture}, []
        for b, s in enumerate(slots):
            if self._len[s] + ids.shape[1] > self.max_length:
                raise ValueError(f"max_length: {self._len[s] + ids.shape[1]} tokens exceed {self.max_length}")
            lg, cache, hs = self._run(s, ids[b], copy.deepcopy(self._cache[s]))
            logits.append(lg[0])
            hidden.append(hs[-1][0])
            for i in capture:
                caps[i].append(hs[i + 1][0])
            clones.append(cache)
        self._round = (list(slots), ids, clones)
        return RunnerOutput(torch.stack(logits), torch.stack(hidden), {i: torch.stack(v) for i, v in caps.items()})

    @torch.no_grad()
    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Keep `acc.num_kept [B]` tokens of each row (a chain's); `host_counts`: the same counts on the host (else
        read back here)."""
        slots, ids, clones = self._round
        n = list(host_counts) if host_counts is not None else acc.num_kept.tolist()
        if any(not 1 <= m <= ids.shape[1] for m in n):
            raise ValueError(f"acc: expected 1..{ids.shape[1]} kept tokens per request, got {n}")
        for b, s in enumerate(slots):
            m = n[b]
            if m == ids.shape[1]:
                self._cache[s] = clones[b]
            else:  # snapshot was the original cache: re-run the accepted tokens on it
                _, self._cache[s], _ = self._run(s, ids[b, :m], self._cache[s])
            self._len[s] += m
        self._round = None

    def abort(self) -> None:
        self._round = None
