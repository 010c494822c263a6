"""Target runners: one forward over a verify window (chain or tree) with commit / abort.

`HybridRunner` runs a known hybrid family with the model's own modules and weights: linear-attention
mixers through the state strategies of `specdec.replayssm`, attention through `KVCache`.
`GenericRunner` drives any causal LM's own forward with a cloned cache (slower, still lossless).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch

from specdec import kernels
from specdec.replayssm import StateConfig, make_strategy

from .adapters import MIXERS
from .kv_cache import KVCache


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [B, T, vocab]
    hidden: torch.Tensor  # [B, T, hidden] final normed hidden state
    captured: dict[int, torch.Tensor]  # layer index -> [B, T, hidden] output of that decoder layer


def path_and_count(num_accepted, path, B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain `num_accepted [B]` or tree `path [B, M]` -> (path `[B, M]` -1 padded, n `[B]`)."""
    if path is None:
        n = torch.as_tensor(num_accepted, dtype=torch.long, device=device)
        ar = torch.arange(T, device=device)
        return torch.where(ar[None] < n[:, None], ar[None], -1), n
    path = torch.as_tensor(path, dtype=torch.long, device=device)
    return path, (path >= 0).sum(1)


class _PrefillOps:
    """Prefill from the slot's state, written straight back (prefill has nothing to roll back)."""

    def __init__(self, runner: "HybridRunner", li: int, slots: torch.Tensor):
        self.r, self.li, self.slots = runner, li, slots

    def conv(self, x, weight, bias, activation):
        pool = self.r.state.pool
        y, win = kernels.short_conv(x, weight, bias, conv_state=pool.conv[self.li, self.slots], activation=activation)
        pool.conv[self.li, self.slots] = win.to(pool.conv.dtype)
        return y

    def mix(self, q, k, v, g, beta):
        pool, cfg = self.r.state.pool, self.r.state.cfg
        o, S = prefill_delta_rule(q, k, v, g, beta, pool.ssm[self.li, self.slots], cfg)
        pool.ssm[self.li, self.slots] = S.to(pool.ssm.dtype)
        return o


class _VerifyOps:
    def __init__(self, runner: "HybridRunner", li: int):
        self.r, self.li = runner, li

    def conv(self, x, weight, bias, activation):
        return self.r.state.conv(self.li, x, weight, bias, activation=activation)

    def mix(self, q, k, v, g, beta):
        return self.r.state.mix(self.li, q, k, v, g, beta)


def prefill_delta_rule(q, k, v, g, beta, state: torch.Tensor, cfg: StateConfig):
    """Prefill of one chunk: fla's chunk kernels on CUDA, `kernels.chunk_delta_rule` elsewhere (the same
    recurrence in chunked form). q, k `[B, T, H, K]` raw; -> (o `[B, T, H, V]`, S `[B, H, K, V]`)."""
    if q.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.kda import chunk_kda
        except ImportError:
            pass
        else:
            fn = chunk_kda if cfg.gate == "kda" else chunk_gated_delta_rule
            o, S = fn(q, k, v, g.float(), beta, scale=cfg.scale, initial_state=state.float(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
            return o, S
    return kernels.chunk_delta_rule(q, k, v, g, beta, initial_state=state, scale=cfg.scale, eps=cfg.norm_eps,
                                    norm=cfg.norm)


class HybridRunner:
    """Kimi-Linear / Qwen3-Next / Qwen3.5 with ReplaySSM (or snapshot) state and a rollback KV cache."""

    def __init__(self, model, *, strategy: str = "replay", commit: str = "eager", max_batch_size: int = 8,
                 max_length: int = 4096, num_verify_tokens: int = 8, track_interval: int | None = None,
                 prefill_chunk: int = 512):
        family = model.config.model_type
        if family not in MIXERS:
            raise ValueError(f"model: no hybrid adapter for model_type {family!r}; known: {sorted(MIXERS)}")
        self.model, self.mixer = model, MIXERS[family]
        base = model.model
        self.base, self.layers = base, list(base.layers)
        types = model.config.layer_types
        self.linear_index = {i: n for n, i in enumerate(i for i, t in enumerate(types) if t == "linear_attention")}
        if not self.linear_index:
            raise ValueError("model: no linear_attention layers")
        first = self.mixer.module(self.layers[next(iter(self.linear_index))])
        self.dtype = base.embed_tokens.weight.dtype
        self.device = base.embed_tokens.weight.device
        cfg = StateConfig(num_layers=len(self.linear_index), **self.mixer.dims(first), gate=self.mixer.gate,
                          norm=self.mixer.norm, max_requests=max_batch_size, max_running=max_batch_size,
                          num_draft_tokens=num_verify_tokens,
                          ssm_dtype=torch.float64 if self.dtype == torch.float64 else torch.float32,
                          act_dtype=self.dtype, track_interval=track_interval)
        self.state = make_strategy(cfg, strategy, commit=commit, device=self.device)
        self.kv = KVCache(cfg.num_slots, max_length, device=self.device)
        self.max_length, self.prefill_chunk = max_length, prefill_chunk
        self.num_verify_tokens = num_verify_tokens
        self.vocab_size = model.config.vocab_size
        self.hidden_size = model.config.hidden_size

    # ---- requests ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.state.pool.num_free

    def alloc(self, n: int) -> list[int]:
        slots = self.state.pool.alloc(n)
        for s in slots:
            self.kv.reset(s)
        return slots

    def release(self, slots: list[int]) -> None:
        self.state.release(slots)

    def length(self, slot: int) -> int:
        return int(self.kv.lengths[slot])

    @torch.no_grad()
    def prefill(self, slot: int, ids: torch.Tensor, *, capture=()) -> RunnerOutput:
        """Run a prompt `[P]` into a fresh slot in chunks; -> outputs over the whole prompt."""
        outs = [self._forward([slot], ids[None, start:start + self.prefill_chunk], None, True, capture)
                for start in range(0, ids.shape[0], self.prefill_chunk)]
        if len(outs) == 1:
            return outs[0]
        return RunnerOutput(torch.cat([o.logits for o in outs], 1), torch.cat([o.hidden for o in outs], 1),
                            {i: torch.cat([o.captured[i] for o in outs], 1) for i in capture})

    @torch.no_grad()
    def forward(self, slots: list[int], ids: torch.Tensor, *, parent=None, capture=()) -> RunnerOutput:
        """Verify `ids [B, T]` (chain, or tree with `parent [T] / [B, T]`) from the committed state; the
        round stays open until `commit` / `abort`."""
        return self._forward(slots, ids, parent, False, capture)

    def commit(self, num_accepted=None, *, path=None) -> None:
        B, T = self.kv.slots.shape[0], self.kv.num_tokens
        path, n = path_and_count(num_accepted, path, B, T, self.device)
        self.state.commit(path=path)  # validates before anything changes
        self.kv.commit(path.clamp(min=0), n)

    def abort(self) -> None:
        self.state.abort()
        self.kv.abort()

    # ---- forward -----------------------------------------------------------------------------------
    def _forward(self, slots, ids, parent, prefill: bool, capture) -> RunnerOutput:
        slots_t = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        B, T = ids.shape
        if parent is not None:
            parent = torch.as_tensor(parent, dtype=torch.long, device=self.device)
            parent = parent.expand(B, -1) if parent.dim() == 1 else parent
        if not prefill:
            self.state.begin(slots_t, num_tokens=T, parent=parent)
        try:
            self.kv.begin(slots_t, T, parent)
            h = self.base.embed_tokens(ids)
            positions = self.kv.positions()
            mask = self.kv.attention_mask(h.dtype)
            rotary = getattr(self.base, "rotary_emb", None)
            pos_emb = rotary(h, positions) if rotary is not None else None
            captured = {}
            for i, layer in enumerate(self.layers):
                residual = h
                x = layer.input_layernorm(h)
                li = self.linear_index.get(i)
                if li is not None:
                    ops = _PrefillOps(self, li, slots_t) if prefill else _VerifyOps(self, li)
                    x = self.mixer.run(self.mixer.module(layer), x, ops)
                else:
                    kw = dict(position_embeddings=pos_emb) if pos_emb is not None else {}
                    x = layer.self_attn(hidden_states=x, attention_mask=mask, position_ids=positions, cache=self.kv,
                                        **kw)[0]
                h = residual + x
                residual = h
                x = layer.mlp(layer.post_attention_layernorm(h))
                h = residual + (x[0] if isinstance(x, tuple) else x)
                if i in capture:
                    captured[i] = h
            hidden = self.base.norm(h)
            logits = self.model.lm_head(hidden)
        except BaseException:
            self.abort()
            raise
        if prefill:
            self.kv.commit(torch.arange(T, device=self.device).expand(B, T), torch.full((B,), T, device=self.device))
            self.state.pool.seq_len[slots_t] += T
        return RunnerOutput(logits, hidden, captured)


# transformers' Mamba-1 mixers start the selective scan from a zero state whenever more than one token comes in,
# cached state or not: the generic runner feeds these models one token at a time after the prompt
ONE_TOKEN_CONTINUATION = {"mamba", "falcon_mamba", "jamba", "zamba"}


class GenericRunner:
    """Any causal LM: its own forward and cache. A round runs on a deep copy of the request's cache; commit
    adopts the copy when everything was accepted, else re-runs the accepted tokens on the original."""

    def __init__(self, model, *, max_batch_size: int = 8, max_length: int = 4096, **_):
        self.model = model
        self.device = next(model.parameters()).device
        self.max_length = max_length
        self.vocab_size = model.config.get_text_config().vocab_size
        self.hidden_size = model.config.get_text_config().hidden_size
        self.max_batch_size = max_batch_size
        self._free = list(range(max_batch_size))
        self._cache: dict[int, object] = {}
        self._len: dict[int, int] = {}
        self._round = None
        # transformers renamed `past_key_values` to `cache` (the old name is deprecated from 5.x on)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
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
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        start = self._len[slot]
        parts = ids.split(1) if start and self._one_token else [ids]
        outs = []
        for part in parts:
            out = self.model(input_ids=part[None], **{self._cache_arg: cache}, **self._positions(start, len(part)),
                             use_cache=True, output_hidden_states=True)
            new = getattr(out, "cache", None)
            new = getattr(out, "past_key_values", None) if new is None else new
            cache, start = (new if new is not None else cache), start + len(part)
            outs.append(out)
        return (torch.cat([o.logits for o in outs], 1), cache,
                tuple(torch.cat(h, 1) for h in zip(*(o.hidden_states for o in outs))))

    @torch.no_grad()
    def prefill(self, slot: int, ids: torch.Tensor, *, capture=()) -> RunnerOutput:
        logits, cache, hs = self._run(slot, ids, self._cache[slot])
        self._cache[slot], self._len[slot] = cache, self._len[slot] + ids.shape[0]
        return RunnerOutput(logits, hs[-1], {i: hs[i + 1] for i in capture})

    @torch.no_grad()
    def forward(self, slots: list[int], ids: torch.Tensor, *, parent=None, capture=()) -> RunnerOutput:
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
    def commit(self, num_accepted=None, *, path=None) -> None:
        slots, ids, clones = self._round
        _, n = path_and_count(num_accepted, path, len(slots), ids.shape[1], self.device)
        if bool(((n < 1) | (n > ids.shape[1])).any()):
            raise ValueError(f"num_accepted: expected 1..{ids.shape[1]} per request, got {n.tolist()}")
        for b, s in enumerate(slots):
            m = int(n[b])
            if m == ids.shape[1]:
                self._cache[s] = clones[b]
            else:  # snapshot was the original cache: re-run the accepted tokens on it
                _, self._cache[s], _ = self._run(s, ids[b, :m], self._cache[s])
            self._len[s] += m
        self._round = None

    def abort(self) -> None:
        self._round = None


def make_runner(model, **kw):
    """A hybrid adapter for known families, the generic path for any other causal LM."""
    if model.config.model_type in MIXERS:
        return HybridRunner(model, **kw)
    return GenericRunner(model, **kw)
