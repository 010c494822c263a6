"""Target runners: one forward over a verify window (chain or tree) with commit / abort.

`HybridRunner` runs a known hybrid family with the model's own modules and weights: linear-attention
mixers through the state strategies of `specdec.replayssm`, attention through `KVCache`.
`GenericRunner` (`specdec.generic`) drives any causal LM's own forward with a cloned cache (slower, still lossless).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from specdec import kernels, parallel
from specdec.replayssm import StateConfig, make_strategy
from specdec.kernels.tree import VerifyTree
from specdec.replayssm.plan import DEFERRED_NAMES, pool_specs, strategy_specs
from specdec.verify.record import Acceptance
from specdec.tensors import index_tensor

from .adapters import HYBRID_FAMILIES, attr_path, kv_dims, layer_kind
from .hf_compat import cache_arg, rotary_tables
from .kv_cache import KVCache, feature_key, kv_specs, page_specs
from .memory import MemoryPlan
from .prefill import Chunk, PrefillOps
from .slots import Slots
from .target import TargetRunner


@dataclass
class RunnerOutput:
    logits: torch.Tensor  # [B, T, vocab]
    hidden: torch.Tensor  # [B, T, hidden] final normed hidden state
    captured: dict[int, torch.Tensor]  # layer index -> [B, T, hidden] output of that decoder layer


class _VerifyOps:
    def __init__(self, runner: "HybridRunner", li: int):
        self.r, self.li = runner, li

    def conv(self, x, weight, bias, activation):
        return self.r.state.conv(self.li, x, weight, bias, activation=activation)

    def mix(self, q, k, v, g, beta):
        return self.r.state.mix(self.li, q, k, v, g, beta)


@dataclass(frozen=True)
class _Join:
    """How a "hybrid" layer runs its attention with its mixer (`adapters.LayerLayout`): `attn` beside the mixer
    (with the layer's scales, None: 1), or the `shared` block through `proj` before it."""
    attn: torch.nn.Module | None = None
    shared: torch.nn.Module | None = None
    proj: torch.nn.Module | None = None
    attn_in: float | None = None
    attn_out: float | None = None
    mixer_out: float | None = None


def _layer_plan(family: str, spec, layers, kinds) -> tuple[list[tuple], dict, list[tuple], dict, dict]:
    """Per decoder layer its four norms (`LayerLayout.norms`), per attention (called by the runner) whether its
    forward takes `position_embeddings` (OLMo-Hybrid's does, None without RoPE), per layer `(mlp, moe, residual
    scale)` (each None where the layer has none), per layer with a mixer its mixer module, per attention its
    module, and per "hybrid" layer its `_Join`.
    Every module the runner calls is looked up here: a class transformers changed fails now, naming the family,
    layer and missing module."""
    def missing(owner, name: str, what: str):
        cls = type(owner).__name__
        return ValueError(f"model: {family} layer {i} ({cls}) has no {what} {name!r}; the hybrid adapter expects "
                          f"it (has transformers changed {cls}?)")

    def lookup(path: str, what: str = "module"):
        """`layer.<path>`: a module (or with `what` "number", a number at the end of the path)."""
        names, owner = path.split("."), layer
        for j, name in enumerate(names):
            value, last = getattr(owner, name, None), j == len(names) - 1
            if not isinstance(value, (int, float) if last and what == "number" else torch.nn.Module):
                raise missing(owner, name, what if last else "module")
            owner = value
        return owner

    norms, rope, mlps, mixers, attns, joins = [], {}, [], {}, {}, {}
    for i, (layer, kind) in enumerate(zip(layers, kinds)):
        layout = spec.layout(kind)
        if layout is None:
            what = "an MLP-only" if kind == "mlp" else f"a {kind}"
            raise ValueError(f"model: {family} layer {i} is {what} layer, which the hybrid adapter of "
                             f"{family} does not expect")
        for name in (layout.pre_mixer, layout.post_mixer, layout.pre_mlp, layout.post_mlp, layout.mlp):
            if name is not None:
                lookup(name)
        if kind in ("linear", "hybrid"):
            if layout.mixer is not None:
                mod = lookup(layout.mixer)
            else:
                try:
                    mod = spec.mixer.module(layer)
                except AttributeError as e:
                    raise missing(layer, getattr(e, "name", None) or "linear-attention mixer", "module") from None
            for name in spec.mixer.requires:
                if not hasattr(mod, name):
                    raise missing(mod, name, "attribute")
            mixers[i] = mod
        if kind == "hybrid" and layout.shared is not None:
            joins[i] = _Join(shared=lookup(layout.shared), proj=lookup(layout.shared_proj))
        elif kind in ("attention", "hybrid"):
            attns[i] = lookup(layout.attn)
            rope[i] = "position_embeddings" in inspect.signature(attns[i].forward).parameters
            if spec.latent_attention is not None and kind == "attention" and spec.latent_attention.applies(attns[i]):
                attns[i] = spec.latent_attention(attns[i])
            if kind == "hybrid":
                joins[i] = _Join(attns[i], **{k: None if name is None else lookup(name, "number") for k, name in (
                    ("attn_in", layout.attn_in_scale), ("attn_out", layout.attn_out_scale),
                    ("mixer_out", layout.mixer_out_scale))})
        norms.append(layout.norms(layer))
        mlp = None if layout.mlp is None else attr_path(layer, layout.mlp)
        moe = None if layout.moe is None else getattr(layer, layout.moe, None)  # None: a dense layer
        scale = None if layout.residual_scale is None else lookup(layout.residual_scale, "number")
        mlps.append((mlp, moe, scale))
    return norms, rope, mlps, mixers, attns, joins


class HybridRunner(TargetRunner):
    """A hybrid family of `adapters.HYBRID_FAMILIES` (Kimi-Linear, Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid,
    Bailing-Hybrid; the Mamba2 hybrids Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1 and Zamba2) with ReplaySSM (or
    snapshot) state and a paged rollback KV cache: trees verified, memory budgeted by pages."""

    supports_tree = True
    paged = True

    def __init__(self, model, *, strategy: str = "replay", commit: str = "eager", max_batch_size: int = 8,
                 max_length: int = 4096, num_verify_tokens: int = 8, track_interval: int | None = None,
                 prefill_chunk: int = 512, static: bool = False, check_memory=None,
                 tp: parallel.TensorParallel | None = None, replicate=(), features=()):
        """`check_memory`: called with the runner's `MemoryPlan` before any of its buffers is allocated (raising
        there stops the build). `features`: what a drafter observes at each position ("hidden", the final normed
        hidden state, and layer indices: those layers' outputs), kept in every slot's KV pages at each committed
        position (`KVCache.write`, for the prefix cache). `tp`: run this rank's share of a tensor-parallel target
        (`parallel.ShardPlan` splits the model's modules in place, so `model` is the engine's
        `parallel.private_copy`; the attentions of the layers in `replicate` stay whole: a drafter reads their KV
        cache)."""
        family = model.config.model_type
        if family not in HYBRID_FAMILIES:
            raise ValueError(f"model: no hybrid adapter for model_type {family!r}; known: {sorted(HYBRID_FAMILIES)}")
        spec = HYBRID_FAMILIES[family]
        self.model, self.mixer = model, spec.mixer
        self.features = {name: feature_key(name) for name in features}
        self._feature_layers = {n for n in features if n != "hidden"}
        base = model.model
        # bailing_hybrid appends its MTP layers to `layers`: the decoder is the first num_hidden_layers
        self.base, self.layers = base, list(base.layers)[:model.config.num_hidden_layers]
        self._kinds = [layer_kind(t) for t in model.config.layer_types[:len(self.layers)]]
        # every layer with a mixer: linear-attention layers and "hybrid" ones (mixer plus attention)
        mixed = (i for i, k in enumerate(self._kinds) if k in ("linear", "hybrid"))
        self.linear_index = {i: n for n, i in enumerate(mixed)}
        if not self.linear_index:
            raise ValueError("model: no linear_attention layers")
        (self._norms, self._attn_rope, self._mlps, self._mixers, self._attn,
         self._joins) = _layer_plan(family, spec, self.layers, self._kinds)
        # the keyword each attention / shared block takes the cache under (`hf_compat.cache_arg`)
        self._cache_args = {i: cache_arg(a) for i, a in self._attn.items()}
        self._cache_args.update({("shared", i): cache_arg(j.shared) for i, j in self._joins.items()
                                 if j.shared is not None})
        # what this rank holds of each layer and what its forwards all-reduce (nothing split without tp)
        self.shards = parallel.ShardPlan(tp, family, mixers=self._mixers, attns=self._attn, mlps=self._mlps,
                                         model=model, replicate=replicate)
        for name in (spec.embed, spec.final_norm):
            if not isinstance(getattr(base, name, None), torch.nn.Module):
                raise ValueError(f"model: {family} base model ({type(base).__name__}) has no module {name!r}; the "
                                 f"hybrid adapter expects it")
        self.embed, self.final_norm = getattr(base, spec.embed), getattr(base, spec.final_norm)
        # GraniteMoeHybrid scales the embeddings and divides the logits, Falcon-H1 scales both (None: the family
        # does not)
        self._embed_scale = None if spec.embed_scale is None else getattr(base, spec.embed_scale)
        self._logits_scale = None if spec.logits_scale is None else getattr(model.config, spec.logits_scale)
        self._logits_multiplier = None if spec.logits_multiplier is None else getattr(base, spec.logits_multiplier)
        first = self._mixers[next(iter(self.linear_index))]
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        gate_in_kernel = self.mixer.gate_in_kernel
        cfg = StateConfig(num_layers=len(self.linear_index), **self.mixer.dims(first), gate=self.mixer.gate,
                          norm=self.mixer.norm, rule=self.mixer.rule, gate_in_kernel=gate_in_kernel,
                          max_requests=max_batch_size, max_running=max_batch_size,
                          num_verify_tokens=num_verify_tokens,
                          ssm_dtype=torch.float64 if self.dtype == torch.float64 else torch.float32,
                          act_dtype=self.dtype, track_interval=track_interval)
        self.shards.split_slots(cfg.num_slots, self.device)  # the data-parallel layers' slots, if any
        self.memory = self._memory_plan(cfg, strategy, commit, max_length)
        # the check may size the KV page pool from a byte budget (`SpecConfig.memory`): then the plan is made again
        # with that many pages and checked as it will be allocated
        pages = check_memory(self.memory) if check_memory is not None else None
        if pages is not None:
            self.memory = self._memory_plan(cfg, strategy, commit, max_length, num_pages=pages)
            check_memory(self.memory)
        self.state = make_strategy(cfg, strategy, commit=commit, device=self.device)
        if gate_in_kernel:
            for i, n in self.linear_index.items():
                self.state.set_gate(n, *self.mixer.gate_params(self._mixers[i]))
        self.kv = KVCache(cfg.num_slots, max_length, device=self.device, static=static, num_pages=pages,
                          split=self.shards.slots)
        self.slots = Slots(self.state, self.kv)  # the one writer of every slot's state
        self.max_length, self.prefill_chunk = max_length, prefill_chunk
        self.num_verify_tokens = num_verify_tokens
        self._slot_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        self.vocab_size = model.config.vocab_size
        self.hidden_size = model.config.hidden_size

    def _attend(self, i: int, x: torch.Tensor, mask, positions, kw) -> torch.Tensor:
        """Layer i's attention on `x [B, T, d]` (the call `parallel.Forward.attention` makes, on the rows it picks)."""
        return self._attn[i](hidden_states=x, attention_mask=mask, position_ids=positions,
                             **{self._cache_args[i]: self.kv}, **kw)[0]

    def _memory_plan(self, cfg: StateConfig, strategy: str, commit: str, max_length: int,
                     num_pages: int | None = None) -> MemoryPlan:
        """The buffers this runner holds: its strategy's (`replayssm.plan.strategy_specs`, the pool apart) and
        the KV cache of every attention (each layer's at its first write), from the same specs they allocate."""
        # the backend the strategy's rounds will pick (`kernels.dispatch.uses_triton`: device and state dtype)
        probe = torch.empty(0, dtype=cfg.ssm_dtype, device=self.device)
        specs = strategy_specs(cfg, strategy, commit=commit, triton=kernels.dispatch.uses_triton(probe))
        pool = pool_specs(cfg)
        attns = dict(self._attn)
        attns.update({i: j.shared for i, j in self._joins.items() if j.shared is not None})
        layers = {i: kv_dims(a, self.model.config.get_text_config()) for i, a in sorted(attns.items())}
        plan = MemoryPlan(self.device)
        plan.add("state pool", {n: s for n, s in specs.items() if n in pool})
        plan.add("snapshots" if strategy == "snapshot" else "rings",
                 {n: s for n, s in specs.items() if n not in pool and n not in DEFERRED_NAMES})
        plan.add("rings", {n: s for n, s in specs.items() if n in DEFERRED_NAMES}, deferred=True)
        paged = {i: d for i, d in layers.items() if not self.shards.data_parallel(i)}
        paged.update({key: [(1, self.model.config.get_text_config().hidden_size)] for key in self.features.values()})
        kv = kv_specs(cfg.num_slots, max_length, paged, self.dtype, num_pages=num_pages)
        # a data-parallel layer keeps the rank's request slots only (`parallel.SlotSplit`)
        kv.update(self.shards.kv_specs(layers, max_length, self.dtype))
        # the pages at each layer's first write, the block tables at build
        pools = page_specs(kv)
        plan.add("KV cache", pools, deferred=True)
        plan.add("KV cache", {n: s for n, s in kv.items() if n not in pools})
        return plan

    @property
    def attention(self) -> dict[int, object]:
        """Layer index -> what the runner calls for that layer's attention: its module, or the family's stand-in
        for it (Kimi's MLA in latent form, `adapters.KimiLatentAttention`), whose work never passes through the
        module's own forward. Hybrid layers' shared attention blocks are not listed."""
        return dict(self._attn)

    # ---- requests ----------------------------------------------------------------------------------
    # the request surface every runner has (`GenericRunner` too); here each is the slots' own (`Slots`)
    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def alloc(self, n: int) -> list[int]:
        return self.slots.alloc(n)

    def release(self, slots: list[int]) -> None:
        self.slots.release(slots)

    def reserve(self, slots: list[int], tokens: list[int]) -> None:
        self.slots.reserve(slots, tokens)

    def fits(self, tokens: list[int]) -> bool:
        return self.slots.fits(tokens)

    def length(self, slot: int) -> int:
        return self.slots.length(slot)

    @torch.no_grad()
    def prefill_batch(self, slots: list[int], prompts: list[torch.Tensor], *, capture=(),
                      last_logits: bool = False) -> RunnerOutput:
        """Run B prompts `[P_b]` into their slots together: one forward per chunk of `prefill_chunk` positions over
        the right-padded batch (rows whose prompt has ended drop out). Each slot ends with the linear-attention
        state, conv window, KV entries and length that `prefill(slot, prompt)` gives it.

        Returns one padded `RunnerOutput`, rows in the order of `slots`, `P = max P_b`, 0 past each row's end:
        `hidden [B, P, hidden]`, `captured[i] [B, P, hidden]`, and `logits [B, P, vocab]`, or with `last_logits`
        `[B, 1, vocab]`: row b's logits at its last prompt token (the lm head then runs on those rows only).
        """
        B = len(slots)
        if B == 0 or len(prompts) != B:
            raise ValueError(f"prompts: expected one prompt per slot ({B} slots), got {len(prompts)}")
        if len(set(slots)) != B:
            raise ValueError(f"slots: expected distinct slots, got {list(slots)}")
        for b, p in enumerate(prompts):
            if p.dim() != 1 or p.shape[0] == 0:
                raise ValueError(f"prompts[{b}]: expected a non-empty 1-D tensor of token ids, got shape "
                                 f"{list(p.shape)}")
        lens = [int(p.shape[0]) for p in prompts]
        P, C = max(lens), self.prefill_chunk
        ids = torch.zeros(B, P, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            ids[b, :lens[b]] = p
        hidden = logits = None
        captured = {}
        for start in range(0, P, C):
            rows = [b for b in range(B) if lens[b] > start]
            n = [min(lens[b] - start, C) for b in rows]
            T = max(n)
            rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
            chunk = Chunk.make(n, T, self.device, last_logits)
            out = self._forward([slots[b] for b in rows], ids[rows_t, start:start + T], None, True, capture,
                                chunk)
            if hidden is None:
                hidden = out.hidden.new_zeros(B, P, out.hidden.shape[-1])
                logits = out.logits.new_zeros(B, 1 if last_logits else P, out.logits.shape[-1])
                captured = {i: out.captured[i].new_zeros(B, P, out.captured[i].shape[-1]) for i in capture}
            hidden[rows_t, start:start + T] = out.hidden
            for i in capture:
                captured[i][rows_t, start:start + T] = out.captured[i]
            if not last_logits:
                logits[rows_t, start:start + T] = out.logits
            else:  # rows whose prompt ends in this chunk
                ends = [j for j, b in enumerate(rows) if lens[b] <= start + C]
                ends_t = torch.tensor(ends, dtype=torch.long, device=self.device)
                logits[rows_t[ends_t]] = out.logits[ends_t]
        if any(m < P for m in lens):  # padded positions of the last chunks: 0
            pad = torch.arange(P, device=self.device)[None] >= torch.tensor(lens, device=self.device)[:, None]
            for x in (hidden, *captured.values(), *(() if last_logits else (logits,))):
                x.masked_fill_(pad[..., None], 0)
        return RunnerOutput(logits, hidden, captured)

    @torch.no_grad()
    def forward(self, slots: list[int], ids: torch.Tensor, *, parent=None, capture=(),
                slots_t: torch.Tensor | None = None) -> RunnerOutput:
        """Verify `ids [B, T]` (a chain, or a tree: a `VerifyTree`, or `parent [T] / [B, T]`, checked here) from
        the committed state; the round stays open until `commit` / `abort`. `slots_t`: the same slots as a device
        tensor `[B]` (else built from the list); the null slot marks a padding row."""
        tree = None if parent is None else VerifyTree.check(parent, *ids.shape, device=self.device)
        return self._forward(slots, ids, tree, False, capture, slots_t=slots_t)

    def commit(self, acc: Acceptance, *, host_counts: list[int] | None = None) -> None:
        """Keep what the open round accepted: `acc` as an accept rule returns it (its `path [B, M]` and `num_kept
        [B]`), taken as it is (the engine checked the round's inputs), device ops only. `host_counts`: `num_kept`
        on the host where the caller has it (it keeps the KV cache's length bounds exact)."""
        self.slots.commit(acc, host_counts=host_counts)

    def abort(self) -> None:
        self.slots.abort()

    # ---- forward -----------------------------------------------------------------------------------
    def slots_tensor(self, slots: list[int]) -> torch.Tensor:
        """`slots` as a device tensor, built once per distinct list (a host-to-device copy otherwise)."""
        return index_tensor(self._slot_tensors, slots, self.device)

    def _forward(self, slots, ids, tree: VerifyTree | None, prefill: bool, capture, chunk: Chunk | None = None, *,
                 slots_t: torch.Tensor | None = None) -> RunnerOutput:
        """One forward over `ids [B, T]`; a prefill commits at once (with `chunk`: `chunk.n` tokens per row)."""
        slots_t = self.slots_tensor(slots) if slots_t is None else slots_t
        B, T = ids.shape
        # one tree for the KV mask and every layer: what they derive from it is made once
        self.slots.open(slots_t, T, tree, host_slots=list(slots), prefill=prefill,
                        tokens=None if chunk is None else chunk.counts)
        keep = set(capture) | self._feature_layers  # the layers whose outputs are returned or paged
        try:
            # this rank's collectives (`parallel.Forward`): the split parts' all-reduces, and a vote at the end
            with self.shards.forward((B, T, self.hidden_size), self.dtype) as fwd:
                h = self.embed(ids)
                if self._embed_scale is not None:
                    h = h * self._embed_scale
                embeddings = h  # the input of Zamba2's shared blocks, beside the hidden state
                positions = self.kv.positions()
                mask = self.kv.attention_mask(h.dtype)
                rotary = getattr(self.base, "rotary_emb", None)
                pos_emb = rotary_tables(rotary, h, positions) if rotary is not None else None
                captured = {}
                for i in range(len(self.layers)):
                    pre, post, pre_mlp, post_mlp = self._norms[i]  # the family's layout; None: no norm there
                    mlp, moe, scale = self._mlps[i]
                    kind = self._kinds[i]
                    if kind != "mlp":  # an MLP-only layer (Nemotron-H) has no mixer
                        residual = h
                        join, x = self._joins.get(i), h
                        if join is not None and join.shared is not None:  # Zamba2: into the mixer's input only
                            t = join.shared(h, original_hidden_states=embeddings, layer_idx=i, attention_mask=mask,
                                            position_embeddings=pos_emb, position_ids=positions,
                                            **{self._cache_args["shared", i]: self.kv})
                            x = h + join.proj(t)
                        x = pre(x) if pre is not None else x
                        if kind == "attention" or (join is not None and join.attn is not None):
                            a = x if join is None or join.attn_in is None else x * join.attn_in
                            kw = dict(position_embeddings=pos_emb) if pos_emb is not None or self._attn_rope[i] else {}
                            a = fwd.attention(i, self._attend, a, mask, positions, kw)
                        if kind != "attention":
                            li = self.linear_index[i]
                            ops = PrefillOps(self, li, slots_t, chunk) if prefill else _VerifyOps(self, li)
                            x = fwd.reduce(self.mixer.run(self._mixers[i], x, ops), "mixer", i)
                            if join is not None and join.attn is not None:  # Falcon-H1: both branches, scaled
                                x = x if join.mixer_out is None else x * join.mixer_out
                                x = x + (a if join.attn_out is None else a * join.attn_out)
                        else:
                            x = a
                        x = post(x) if post is not None else x
                        h = residual + (x if scale is None else x * scale)
                    if mlp is not None:
                        residual = h
                        x_in = pre_mlp(h) if pre_mlp is not None else h
                        x = mlp(x_in)
                        x = x[0] if isinstance(x, tuple) else x
                        if moe is not None:  # routed experts beside the shared MLP, on the same input
                            routed = moe(x_in)
                            x = (routed[0] if isinstance(routed, tuple) else routed) + x
                        x = fwd.reduce(x, "mlp", i)
                        x = post_mlp(x) if post_mlp is not None else x
                        h = residual + (x if scale is None else x * scale)
                    if i in keep:
                        captured[i] = h
                hidden = self.final_norm(h)
                for name, key in self.features.items():  # at the round's positions, kept (or not) with its KV
                    self.kv.write(key, hidden if name == "hidden" else captured[name])
                captured = {i: captured[i] for i in capture}
                if chunk is not None and chunk.last_logits:  # [B, 1, vocab] at each row's last real token
                    logits = self.model.lm_head(hidden[torch.arange(B, device=self.device), chunk.n - 1][:, None])
                else:
                    logits = self.model.lm_head(hidden)
                if self._logits_scale is not None:
                    logits = logits / self._logits_scale
                if self._logits_multiplier is not None:
                    logits = logits * self._logits_multiplier
                fwd.agree(logits)  # every rank got here, with the same logits
        except BaseException:
            self.abort()
            raise
        if prefill:  # with `chunk`, keys past a row's real tokens stay beyond its length: never visible
            n, counts = (torch.full((B,), T, device=self.device), [T] * B) if chunk is None else (chunk.n, chunk.counts)
            self.slots.advance(slots_t, n, counts)
        return RunnerOutput(logits, hidden, captured)


def make_runner(model, **kw):
    """A hybrid adapter for known families, the generic path for any other causal LM."""
    if model.config.model_type in HYBRID_FAMILIES:
        return HybridRunner(model, **kw)
    from .generic import GenericRunner  # here: generic.py imports this module's RunnerOutput
    return GenericRunner(model, **kw)
