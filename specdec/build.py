"""What an engine is built from: the option checks, the drafter, the target runner and its memory plan, the round's
device step and CUDA graphs, the drafter's view of the target, and the checks of the caller's prompts."""

from __future__ import annotations

import functools
from dataclasses import fields

import torch

from specdec.draft import Drafter, Follower, TargetView, make_drafter
from specdec.replayssm.plan import BufferSpec

from . import cpu_linear, generation, memory
from .adapters import HYBRID_FAMILIES
from .config import SpecConfig
from .graphs import RoundGraphs
from .kv_cache import page_specs
from . import parallel
from .parallel import TensorParallel
from .prefix_cache import CachedSlots, PrefixCache, budget_bytes, check_budget
from .round import RoundStep
from .runner import index_tensor, make_runner


def _buckets(max_batch: int) -> list[int]:
    """Batch buckets 1, 2, 4, ... and max_batch itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def prefix_cache_refusal(model, *, tp: bool) -> str | None:
    """Why `model` (run tensor-parallel or not) cannot have a prefix cache, as the error `wrap` raises; None: it
    can."""
    family = HYBRID_FAMILIES.get(model.config.model_type)
    if family is None:
        return (f"prefix_cache: needs a hybrid target; {type(model).__name__} runs through its own forward and "
                f"cache")
    if tp and family.latent_attention is not None:
        return ("tp_group: not with prefix_cache on an MLA target yet (its attention runs data-parallel over the "
                "slots: a cached latent would have to move to the rank of the slot it fills)")
    return None


class EngineParts:
    """An engine's parts, built and checked in `__init__` (`SpecEngine` runs requests on them)."""

    def __init__(self, model, config: SpecConfig | None = None, *, tp_group=None, **options):
        if config is not None and not isinstance(config, SpecConfig):
            raise ValueError(f"config: expected a SpecConfig or None, got {type(config).__name__}")
        if config is None:
            config, drafter_options = SpecConfig.split(options)
        else:
            clash = sorted(set(options) & {f.name for f in fields(SpecConfig)})
            if clash:
                raise ValueError(f"{clash[0]}: given both in config and as a keyword")
            drafter_options = options
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise ValueError(f"model: expected a transformers causal LM (a torch.nn.Module with a config, e.g. from "
                             f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
        self.config = cfg = config
        self.model = model
        self.gamma = cfg.num_draft_tokens
        self.max_length = int(cfg.max_length or min(getattr(model.config, "max_position_embeddings", 4096) or 4096,
                                                    4096))
        self._check_model(model, cfg)
        refused = prefix_cache_refusal(model, tp=tp_group is not None) if cfg.prefix_cache else None
        if refused is not None:
            raise ValueError(refused)
        self.tp = None if tp_group is None else self._tensor_parallel(tp_group, model, cfg)
        # with tp the runner splits its own copy of the modules (the caller's model stays whole), which the drafter
        # reads too; a tp_plan's DTensors outside the decoder layers (embeddings, lm_head) are made whole first
        target = model if self.tp is None else parallel.private_copy(model)
        if self.tp is not None:
            parallel.gather_rest(target, self.tp.gathered, skip=target.model.layers)
        self.drafter = self._make_drafter(cfg.drafter, cfg.draft_model, cfg.max_batch_size, drafter_options,
                                          target)
        # with tp, rank 0 drafts alone (its block is broadcast); the attention a drafter reads stays whole
        replicate = tuple(self.drafter.target_kv_layers)
        if self.tp is not None and not self.tp.leads:
            self.drafter = Follower(self.drafter, self.gamma)
        verify_tokens = max(self.gamma + 1, self.drafter.max_verify_tokens(self.gamma))
        self.memory_plan: memory.MemoryPlan | None = None  # the buffers by part (None: a runner with no plan)
        # the hybrid runner calls `_check_memory` with its plan before it allocates its pool, rings and KV cache
        # with a prefix cache: the track interval, and the target features a drafter with its own caches observes,
        # paged with the KV (an entry shares them as its KV pages)
        self.feature_names = (("hidden", *self.drafter.feature_layers)
                              if cfg.prefix_cache and self.drafter.observes_features else ())
        tracked = dict(track_interval=cfg.track_interval, features=self.feature_names) if cfg.prefix_cache else {}
        if cfg.prefix_cache and 2 * cfg.track_interval < self.gamma + 1:
            raise ValueError(f"track_interval: {cfg.track_interval} with num_draft_tokens {self.gamma}: a round keeps up "
                             f"to {self.gamma + 1} tokens and a slot holds the state of its last two boundaries "
                             f"(ping-pong), so a round could pass a boundary the prefix cache would miss; give "
                             f"track_interval >= {-(-(self.gamma + 1) // 2)}")
        self.runner = make_runner(target, strategy=cfg.strategy, commit=cfg.commit, max_batch_size=cfg.max_batch_size,
                                  max_length=self.max_length + verify_tokens, num_verify_tokens=verify_tokens,
                                  static=cfg.static_shapes,
                                  check_memory=lambda plan: self._check_memory(plan, verify_tokens), **tracked,
                                  **({} if self.tp is None else dict(tp=self.tp, replicate=replicate)))
        if cfg.memory is not None and not self.runner.paged:
            raise ValueError(f"memory: needs a hybrid target; {type(model).__name__} runs through its own forward and "
                             f"cache")
        if cfg.static_shapes and not self.runner.paged:
            raise ValueError(f"static_shapes: needs a hybrid target; {type(model).__name__} runs through its own "
                             f"forward, whose cache grows every round")
        cpu_linear.apply(cfg.cpu_linear, target, *self.drafter.modules())  # after every check: changes the model
        self.buckets = _buckets(cfg.max_batch_size)
        self._row_index: dict[tuple[int, ...], torch.Tensor] = {}
        # the round's device step (inputs, draft step, verify + accept, commit), called by `_round` and the graphs
        self.round_step = RoundStep(self.runner, self.drafter, cfg, self.buckets, self._index)
        self._graphs = RoundGraphs(self) if cfg.cuda_graph else None
        self.lane_slots: list = []  # target slot of each lane (a drafter row)
        runner = self.runner
        self.target = TargetView(model=target, kv=runner.kv, supports_tree=runner.supports_tree,
                                 num_verify_tokens=runner.num_verify_tokens,
                                 gamma=self.gamma, max_length=self.max_length,
                                 slots=lambda rows: [self.lane_slots[r] for r in rows],
                                 index=lambda values: index_tensor(self._draft_index, values, runner.device))
        self._draft_index: dict[tuple[int, ...], torch.Tensor] = {}
        self.drafter.bind(self.target)
        self.prefix_cache = self._cached = None
        if cfg.prefix_cache:  # the tree, and its side toward the runner's slots
            self.prefix_cache = PrefixCache(check_budget(cfg.prefix_cache, self.runner), cfg.states_per_path)
            self._cached = CachedSlots(self.prefix_cache, self.runner.slots, self.runner.prefill_batch,
                                       cfg.track_interval, self.runner.features)
        gen = getattr(model, "generation_config", None)
        self.eos_token_id = getattr(gen, "eos_token_id", None)
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = getattr(model.config, "pad_token_id", None)
        if pad is None:
            eos = self.eos_token_id
            pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
        self.pad_token_id = int(pad)

    @property
    def graph_counts(self) -> dict[str, int]:
        """With `cuda_graph`, the step shapes captured as CUDA graphs, those that fell back to eager rounds and those
        not captured yet (`RoundGraphs.counts`); all 0 without."""
        if self._graphs is None:
            return {"captured": 0, "eager": 0, "warm": 0}
        return self._graphs.counts()

    def memory(self) -> dict:
        """The bytes of the engine's buffers now: `parts` {part: bytes} (the memory plan's, the KV cache as the pages
        held), `used` (every part), `shared` (KV pages held more than once: by slots and prefix-cache entries),
        `evictable` (the prefix cache's entries, and the KV pages only they hold), `free` (KV pages free, and what the
        prefix cache's budget has left), `budget` (used + free)."""
        plan = self.memory_plan
        parts = {} if plan is None else {k: v for k, v in plan.part_bytes().items() if k not in ("KV cache",
                                                                                             "prefix cache")}
        free = shared = entry_pages = 0
        if plan is not None and plan.parts.get("KV cache"):
            kv, specs = self.runner.kv, plan.parts["KV cache"]
            parts["KV cache"] = sum(s.nbytes for n, s in specs.items() if n not in page_specs(specs))  # tables
            for dp, page in kv.page_bytes(specs).items():
                pages = kv.pages[dp]
                parts["KV cache"] += (pages.num_pages - pages.num_free) * page
                free += pages.num_free * page
                shared += sum(1 for r in pages.refs if r > 1) * page
                if not dp and self.prefix_cache is not None:  # pages no slot holds: the entries' alone
                    by_slots = {p for row in pages.held for p in row}
                    entry_pages += len({p for _, e in self.prefix_cache.entries() for p in e.pages} - by_slots) * page
        evictable = entry_pages + (0 if self.prefix_cache is None else self.prefix_cache.bytes)
        if self.prefix_cache is not None:
            parts["prefix cache"] = self.prefix_cache.bytes
            free += self.prefix_cache.budget - self.prefix_cache.bytes
        used = sum(parts.values())
        return {"parts": parts, "used": used, "shared": shared, "evictable": evictable, "free": free,
                "budget": used + free}

    @staticmethod
    def _tensor_parallel(group, model, cfg: SpecConfig) -> TensorParallel:
        """The process group checked, for a hybrid target (`specdec.parallel`)."""
        if model.config.model_type not in HYBRID_FAMILIES:
            raise ValueError(f"tp_group: needs a hybrid target; {type(model).__name__} runs through its own forward")
        if cfg.memory is not None:
            raise ValueError("tp_group: not with memory= yet (a data-parallel MLA layer's pages would need a share "
                             "of the budget per rank)")
        if cfg.cuda_graph:
            raise ValueError("tp_group: not with cuda_graph (a round's fault vote reads back mid-round)")
        return TensorParallel(group, next(model.parameters()).device)

    @staticmethod
    def _check_model(model, cfg: SpecConfig) -> None:
        """What the hybrid runner cannot honour, refused before anything is built."""
        hybrid = model.config.model_type in HYBRID_FAMILIES
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if hybrid and impl not in ("eager", "sdpa"):
            raise ValueError(f"model: attn_implementation {impl!r} is not supported by the hybrid runner, which "
                             f"passes tree and padding masks as a dense additive mask; load the model with "
                             f"attn_implementation='sdpa' or 'eager'")
        if cfg.cuda_graph:
            device = next(model.parameters()).device
            if device.type != "cuda" or not torch.cuda.is_available():
                raise ValueError(f"cuda_graph: CUDA graphs need the model on a CUDA device, got {device}")
            if not hybrid:
                raise ValueError(f"cuda_graph: needs a hybrid target; {type(model).__name__} runs through its own "
                                 f"forward")

    def _make_drafter(self, drafter, draft_model, max_batch_size, kwargs, target) -> Drafter:
        # a draft model's runner is checked on its own, before it allocates (the target's plan needs the drafter's
        # verify window, so it comes after)
        factory = functools.partial(make_runner, check_memory=lambda plan: memory.check_fits(
            plan, self._memory_options(), what="the draft model"))
        return make_drafter(drafter, target, gamma=self.gamma, max_batch_size=max_batch_size,
                            max_length=self.max_length, draft_model=draft_model, runner_factory=factory, **kwargs)

    def _memory_options(self) -> dict:
        opts = {"max_batch_size": self.config.max_batch_size, "max_length": self.max_length}
        if self.config.memory is not None:
            opts["memory"] = self.config.memory
        return {**opts, "prefix_cache": self.config.prefix_cache} if self.config.prefix_cache else opts

    def _check_memory(self, plan: memory.MemoryPlan, verify_tokens: int) -> int | None:
        """The target runner's plan with the drafter's caches and the prefix cache's budget (kept as `memory_plan`)
        against the free memory (`memory.check_fits`). With `memory=`, -> the KV pages the budget leaves after
        every other part (`memory.pages_within`), else None (pages for max_length in every slot)."""
        self.memory_plan = plan.copy().add("drafter caches", self.drafter.memory_specs(
            max_length=self.max_length, num_verify_tokens=verify_tokens, gamma=self.gamma,
            static=self.config.static_shapes), deferred=True)
        if self.config.prefix_cache:  # filled as requests finish, up to its budget
            self.memory_plan.add("prefix cache", {"prefix_cache.budget": BufferSpec(
                "prefix_cache.budget", (budget_bytes(self.config.prefix_cache),), torch.uint8)}, deferred=True)
        if self.config.memory is None:
            memory.check_fits(self.memory_plan, self._memory_options())
            return None
        return memory.pages_within(self.memory_plan, self.config.memory, max_length=self.max_length + verify_tokens,
                                   options=self._memory_options())

    # ---- generate ----------------------------------------------------------------------------------
    def _prompts(self, input_ids, attention_mask, *, extras: dict, pad_token_id: int | None, eos: set[int]
                 ) -> tuple[generation.Prompts, list[torch.Tensor], list[list[int]]]:
        """The caller's prompts (`generation.read_prompts`: shapes, masks, dtypes) checked against the vocabulary:
        -> (what was given, each prompt `[P_b]` long on the target's device, the same as host lists)."""
        given = generation.read_prompts(input_ids, attention_mask, extras=extras, pad_token_id=pad_token_id, eos=eos)
        rows = given.rows
        emb = self.model.get_input_embeddings()
        vocab = getattr(emb, "num_embeddings", None) or self.runner.vocab_size
        for i, p in enumerate(rows):
            if bool(((p < 0) | (p >= vocab)).any()):  # else the embedding fails after slots are taken
                raise ValueError(f"input_ids: prompt {i} has token ids outside [0, {vocab}): "
                                 f"min {int(p.min())}, max {int(p.max())}")
        return given, [p.to(self.runner.device, torch.long) for p in rows], [p.tolist() for p in rows]

    @property
    def _vocab(self) -> tuple[int, int]:
        """(ids the target can read: embedding rows, scores it returns: the logits' last dim)."""
        emb = self.model.get_input_embeddings()
        head = self.model.get_output_embeddings()
        logits_v = getattr(head, "out_features", None) or self.runner.vocab_size
        return min(getattr(emb, "num_embeddings", None) or logits_v, logits_v), logits_v
