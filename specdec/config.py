"""`SpecConfig`: the engine's options (`specdec.wrap(model, config, **drafter_options)`) and their checks."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields

from specdec.draft import NoDraft

from . import cpu_linear

STRATEGIES = ("replay", "snapshot")
COMMITS = ("eager", "lazy")
TRACK_INTERVAL = 256  # `track_interval` with a prefix cache unless given


@dataclass
class SpecConfig:
    """Options of the engine (drafter options are separate: `wrap(model, config, **drafter_options)`).

    drafter: "ngram", "model" (with `draft_model`), "native", a trained drafter directory, or a `Drafter` (a kind
    alone, "mtp", "eagle" or "dspark", needs the drafter option `untrained=True`: see `make_drafter`); None (or
    "none", or a `NoDraft`): plain decoding, one token per forward through the same runner (every round verifies
    the anchor alone, `[Bk, 1]` with static shapes; num_draft_tokens and draft_tokens_by_batch are not used).
    num_draft_tokens: gamma, drafts per round. strategy: "replay" or "snapshot".
    commit: "eager" or "lazy". max_batch_size: requests at once. max_length: prompt + new tokens per request.
    static_shapes: every round has the same shapes for a batch bucket (the batch padded with null-slot rows to
    1, 2, 4, ..., max_batch_size; drafts padded to gamma; the KV cache read as a static view with a mask).
    cuda_graph: capture each bucket's verify + accept (with the drafting of a drafter that has a static draft
    step: eagle, mtp, dspark) and its commit as CUDA graphs and replay them (implies static_shapes; needs a
    hybrid target on CUDA and eager commit).
    draft_tokens_by_batch: a draft-length schedule `{batch size: drafts}`: a round of B rows drafts the value of
    the largest key <= B (with static shapes: of the batch bucket), `num_draft_tokens` below the smallest key.
    Where a verify is compute-bound (a CPU, or a GPU at a large batch) each verified token costs time, and the
    drafts deep in a chain are the least likely accepted, so larger batches verify fewer of them: vLLM's
    `speculative_disable_by_batch_size`, by degrees. E.g. `{8: 3}` (the CPU sweep: bench/results/HISTORY.md,
    "Draft-length schedule"). A tree drafter keeps its node budget; the schedule bounds its depth.
    cpu_linear: the matmul backend of the `nn.Linear` layers of an fp32 model on CPU and of its drafter, which a
    verify feeds many rows at once. "onednn": `specdec.cpu_linear.install` turns them into `OneDNNLinear` (calls
    of >= 2 rows inside `generate` run oneDNN, on some x86 CPUs about twice MKL's sgemm at tree sizes; 1-row
    calls, calls outside `generate` and the weights are unchanged; a second, blocked copy of each weight is kept
    and checked against the weight in every `generate`). "aten": left as they are. "auto" (default): "onednn"
    for an fp32 model on a CPU other than Intel's (where MKL's own paths are the fast ones) when torch has oneDNN,
    else "aten". The model's layers change class in place (plain decoding through it runs the same layers);
    `specdec.cpu_linear.uninstall(model)` undoes it.
    prefix_cache: False (default), True (a budget of `prefix_cache.DEFAULT_BUDGET` bytes) or a byte budget: keep
    the committed state of prompts and finished requests (recurrent state, KV entries, the drafter's target
    features) in a radix tree over token ids, and start a request whose prompt begins with a cached prefix from
    that state, prefilling only the rest (`specdec.prefix_cache`; hybrid targets).
    memory: one byte budget for the engine's buffers, an int (bytes) or a float in (0, 1] (that share of the device's
    free memory at `wrap`): the state pool and rings, the drafter's caches and the prefix cache's budget come out of
    it, the KV pages get the rest. `max_length` is then a cap per request, not a reservation per lane: a request is
    admitted when the pages of its worst case (prompt + max_new_tokens + a verify window) are free, and waits in
    order otherwise (it never fails mid-generation). None (default): pages for `max_length` tokens in every slot.
    track_interval: with `prefix_cache`, the token interval at which a request's state is tracked, so that a
    finished request also leaves entries at its last two multiples of it (None, the default: 256 with a prefix
    cache; given without one: refused).
    states_per_path: with `prefix_cache`, the most entries one path from the tree's root keeps (None, the default: no
    cap; SGLang's `--mamba-max-states-per-path`; given without a prefix cache: refused). Past it the path is thinned
    evenly: the entry whose loss leaves the shortest gap between its neighbours goes (its KV pages stay with the
    deeper entries), never a fork, a pinned entry or the newest, so a long conversation keeps recurrent states at
    spread-out points of its history, not only near its end.
    """

    drafter: object = "ngram"
    num_draft_tokens: int = 7
    strategy: str = "replay"
    commit: str = "eager"
    draft_model: object = None
    max_batch_size: int = 8
    max_length: int | None = None
    static_shapes: bool = False
    cuda_graph: bool = False
    draft_tokens_by_batch: dict | None = None
    cpu_linear: str = "auto"
    prefix_cache: bool | int = False
    track_interval: int | None = None
    states_per_path: int | None = None
    memory: int | float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {self.strategy!r}")
        if self.commit not in COMMITS:
            raise ValueError(f"commit: expected one of {COMMITS}, got {self.commit!r}")
        if self.strategy == "snapshot" and self.commit == "lazy":
            raise ValueError("commit: 'lazy' leaves ReplaySSM's records pending; strategy='snapshot' keeps a state per "
                             "verify token and commits by copy, so it takes commit='eager' only")
        cpu_linear.check_mode(self.cpu_linear)
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens: expected an int >= 1, got {self.num_draft_tokens!r} (plain decoding: "
                             f"drafter=None)")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected an int >= 1, got {self.max_batch_size!r}")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 2):
            raise ValueError(f"max_length: expected an int >= 2 or None, got {self.max_length!r}")
        sched = self.draft_tokens_by_batch
        if sched is not None:
            ok = isinstance(sched, dict) and all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 1 and isinstance(v, int)
                and not isinstance(v, bool) and 1 <= v <= self.num_draft_tokens for k, v in sched.items())
            if not ok:
                raise ValueError(f"draft_tokens_by_batch: expected a dict {{batch size >= 1: drafts in [1, "
                                 f"num_draft_tokens = {self.num_draft_tokens}]}}, got {sched!r}")
            self.draft_tokens_by_batch = dict(sorted(sched.items()))
        ti = self.track_interval
        if ti is not None and (not isinstance(ti, int) or isinstance(ti, bool) or ti < 1):
            raise ValueError(f"track_interval: expected None or an int >= 1, got {ti!r}")
        k = self.states_per_path
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise ValueError(f"states_per_path: expected None (no cap) or an int >= 2, got {k!r}")
        pc = self.prefix_cache
        if not isinstance(pc, (bool, int)) or (not isinstance(pc, bool) and pc < 1):
            raise ValueError(f"prefix_cache: expected False, True or a byte budget (an int >= 1), got {pc!r}")
        if not pc:  # options of the prefix cache alone: silently unused otherwise
            for name in ("track_interval", "states_per_path"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: an option of the prefix cache; give prefix_cache=True (or a budget) "
                                     f"too, or leave it out")
        elif ti is None:
            self.track_interval = TRACK_INTERVAL
        m = self.memory
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float))
                              or (isinstance(m, int) and m < 1) or (isinstance(m, float) and not 0 < m <= 1)):
            raise ValueError(f"memory: expected None, a byte budget (an int >= 1) or a share of the free memory (a "
                             f"float in (0, 1]), got {m!r}")
        if self.cuda_graph:
            if self.commit != "eager":
                raise ValueError("cuda_graph: needs commit='eager' (lazy commit decides on the host when to fold)")
            self.static_shapes = True

    @property
    def plain(self) -> bool:
        """No drafter: plain decoding (`drafter` None, "none" or a `NoDraft`)."""
        d = self.drafter
        return d is None or isinstance(d, NoDraft) or (isinstance(d, str) and d == "none")

    def gamma_for(self, batch: int) -> int:
        """Drafts per round for a round of `batch` rows (see `draft_tokens_by_batch`); 0 for plain decoding."""
        if self.plain:
            return 0
        gamma = self.num_draft_tokens
        for k, v in (self.draft_tokens_by_batch or {}).items():
            if batch >= k:
                gamma = v
        return gamma

    @classmethod
    def split(cls, options: dict) -> tuple["SpecConfig", dict]:
        """`wrap`'s keyword options -> (engine config, drafter options). A name close to an engine option is
        taken for a typo of it, not passed on to the drafter."""
        names = [f.name for f in fields(cls)]
        engine = {k: v for k, v in options.items() if k in names}
        rest = {k: v for k, v in options.items() if k not in names}
        for k in rest:
            close = difflib.get_close_matches(k, names, n=1, cutoff=0.8)
            if close:
                raise ValueError(f"{k}: not an engine option (did you mean {close[0]!r}?); engine options: "
                                 f"{', '.join(names)}")
        return cls(**engine), rest
