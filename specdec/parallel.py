"""Tensor parallelism over `torch.distributed` (the caller's process group: gloo on CPU, NCCL on GPU).

Each rank holds 1/tp of every recurrent layer's heads (its slice of the q / k / v / gate / beta projections, of the
short-conv channels, hence of the state pool and rings), of every attention's heads (hence of the KV cache) and of
every MLP's hidden units (and of each MoE expert's), as transformers' `tp_plan`s split MLPs; output projections are
row-parallel, followed by one all-reduce. MLA layers, whose latent cache every head reads, run whole and
data-parallel over the requests instead (each rank the rows whose slot it owns; `KVCache.split_slots`). Embeddings,
norms, routers and the lm_head are replicated, so the logits are the same on every rank and so is every decision
taken from them. Rank 0 drafts alone and broadcasts its block.

What is split is data: `LAYOUTS`, one `Layout` per mixer class (the `specdec.adapters` mixers) and one for
attentions and for MLPs, whose `Split`s name parameters by their path in the module. A layout's names the module
lacks are skipped, so one layout serves a family's variants (Qwen3-Next's fused `in_proj_qkvz` and Qwen3.5's
`in_proj_qkv`, `_z`, `_b`, `_a`).

Faults: a rank whose forward raises still runs the rest of that forward's all-reduces (with zeros) and then votes;
every rank learns the vote in the forward's one extra collective, drops the round and raises, so no rank is left
waiting in a collective and the engine stays usable.
"""

from __future__ import annotations

import copy
import gc
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from specdec.draft import Drafter, DraftBlock

from .adapters import GatedDeltaMixer, KimiDeltaMixer, Mamba2Mixer


class PeerFailure(RuntimeError):
    """Another rank failed in this forward: every rank dropped the round (the engine stays usable)."""


@dataclass(frozen=True)
class Split:
    """A parameter split across ranks: `path` in the module (dotted), along `dim`, in `sections` (a function of the
    module -> the sizes of the consecutive sections of `dim`, each split in tp equal pieces, the rank's pieces
    concatenated; None: `dim` is one section). A row-parallel weight (`dim` its input dim, 1) keeps its bias on rank
    0 only: the all-reduce adds it once."""

    path: str
    dim: int = 0
    sections: Callable | None = None


@dataclass(frozen=True)
class Layout:
    """How one kind of module splits: its `splits`, the integer attributes its forward reads that count per-rank
    things (`divide`: divided by tp), and `units`, a function of the module -> the sizes tp must divide (heads,
    groups: a head never straddles ranks)."""

    splits: tuple[Split, ...]
    divide: tuple[str, ...] = ()
    units: Callable = field(default=lambda mod: {})


def _rows(*names: str) -> tuple[Split, ...]:
    """Column-parallel linears (output rows split) and their biases."""
    return tuple(Split(f"{n}.{p}") for n in names for p in ("weight", "bias"))


KIMI = Layout(  # KDA: q, k, v, f_b, g_b by head; conv over [q | k | v]; f_a / g_a (low rank) and o_norm replicated
    _rows("q_proj", "k_proj", "v_proj", "forget_gate.f_b_proj", "b_proj", "g_b_proj")
    + (Split("conv1d.weight", 0, lambda m: [m.qkv_dim] * 3), Split("forget_gate.A_log", 2),
       Split("forget_gate.dt_bias"), Split("o_proj.weight", 1)),
    divide=("num_heads", "qkv_dim", "conv_dim"), units=lambda m: {"num_heads": m.num_heads})
GATED_DELTA = Layout(  # Gated DeltaNet: Qwen3-Next's in_proj_qkvz / ba are laid out per key head: a plain split
    _rows("in_proj_qkvz", "in_proj_ba", "in_proj_z", "in_proj_b", "in_proj_a")
    + tuple(Split(p, 0, lambda m: [m.key_dim, m.key_dim, m.value_dim])
            for p in ("in_proj_qkv.weight", "in_proj_qkv.bias", "conv1d.weight", "conv1d.bias"))
    + (Split("A_log"), Split("dt_bias"), Split("out_proj.weight", 1)),
    divide=("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"),
    units=lambda m: {"num_k_heads": m.num_k_heads, "num_v_heads": m.num_v_heads})


def _mamba_in(m) -> list[int]:
    gn = m.n_groups * m.ssm_state_size
    return [m.intermediate_size, m.intermediate_size, gn, gn, m.num_heads]  # gate, x, B, C, dt


MAMBA2 = Layout(  # in_proj over [gate | x | B | C | dt], conv over [x | B | C], the gated norm by groups
    (Split("in_proj.weight", 0, _mamba_in), Split("in_proj.bias", 0, _mamba_in))
    + tuple(Split(p, 0, lambda m: [m.intermediate_size] + [m.n_groups * m.ssm_state_size] * 2)
            for p in ("conv1d.weight", "conv1d.bias"))
    + (Split("dt_bias"), Split("A_log"), Split("D"), Split("norm.weight"), Split("out_proj.weight", 1)),
    divide=("num_heads", "n_groups", "intermediate_size", "conv_dim"),
    units=lambda m: {"num_heads": m.num_heads, "n_groups": m.n_groups})
ATTENTION = Layout(  # GQA by head (q, k, v, the output gate Qwen3-Next packs per head in q_proj); MLA: the query and
    # kv_b_proj by head, the latent projection and its norm replicated (the latent cache is every head's)
    _rows("q_proj", "q_b_proj", "k_proj", "v_proj", "kv_b_proj") + (Split("o_proj.weight", 1),),
    divide=("num_heads", "num_key_value_heads", "num_attention_heads"),
    units=lambda m: {"heads": _heads(m), **({"key/value heads": m.k_proj.out_features // m.head_dim}
                                           if hasattr(m, "k_proj") else {})})
MLP = Layout(  # as transformers' tp_plans: gate / up colwise, down rowwise; each expert's hidden units likewise
    tuple(s for pre in ("", "shared_expert.", "shared_experts.")
          for s in _rows(f"{pre}gate_proj", f"{pre}up_proj") + (Split(f"{pre}down_proj.weight", 1),))
    + (Split("experts.gate_up_proj", 1, lambda m: [m.experts.gate_up_proj.shape[1] // 2] * 2),
       Split("experts.down_proj", 2),
       # Granite-4.0-H's shared MLP: one input projection over [gate | up], chunked in two by its forward
       Split("input_linear.weight", 0, lambda m: [m.input_linear.out_features // 2] * 2),
       Split("output_linear.weight", 1)),
    divide=("experts.intermediate_dim",))
# the mixer classes with a layout (subclasses share their base's: Nemotron-H's and Granite's Mamba2 mixers; Bailing's
# KDA, Falcon-H1's and Zamba2's mixers change what feeds or gates the heads and have none yet)
LAYOUTS = {KimiDeltaMixer: KIMI, GatedDeltaMixer: GATED_DELTA, Mamba2Mixer: MAMBA2}
FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "nemotron_h",
            "bamba", "granitemoehybrid")


def _heads(m) -> int:
    n = getattr(m, "num_heads", None) or getattr(m, "num_attention_heads", None)
    if n is None:
        n = m.config.num_attention_heads
    return n


def shard(t: torch.Tensor, dim: int, sections: list[int] | None, rank: int, tp: int) -> torch.Tensor:
    """The rank's part of `t` along `dim`: each of `sections` (None: the whole dim) split in tp equal pieces, the
    rank's pieces concatenated; a copy (the full tensor can go)."""
    parts = t.split(list(sections), dim) if sections else [t]
    for p in parts:
        if p.shape[dim] % tp:
            raise ValueError(f"tp_group: {tp} ranks do not divide a section of {p.shape[dim]} along dim {dim}")
    return torch.cat([p.chunk(tp, dim)[rank] for p in parts], dim).clone()


def private_copy(model: nn.Module) -> nn.Module:
    """`model` with modules of its own (so sharding leaves the caller's model whole) sharing every parameter and
    buffer with it. A model loaded with transformers' `tp_plan` comes back with its tensor-parallel forwards undone
    on the copy (the replaced `forward` and the hooks of each module it sharded: the runner's all-reduces replace
    them); its DTensor weights stay as they are until `apply_layout` takes their local shards or `gather_rest`
    makes them whole."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    own = copy.deepcopy(model, memo)
    for mod in own.modules():
        if getattr(mod, "_is_hooked", False):
            mod.__dict__.pop("forward", None)  # transformers' wrapper, which calls the original module's forward
            for hooks in (mod._forward_pre_hooks, mod._forward_hooks):
                hooks.clear()
            mod._is_hooked = False
    return own


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def gather_rest(module: nn.Module, gathered: list[str] | None = None, *, skip: nn.Module | None = None) -> None:
    """Every DTensor parameter left in `module` (outside `skip`) made whole, in place (collectives, in
    `named_parameters` order: the same on every rank); their names appended to `gathered`."""
    skipped = set() if skip is None else {id(p) for p in skip.parameters()}
    for name, p in list(module.named_parameters()):
        if is_dtensor(p) and id(p) not in skipped:
            owner_path, _, attr = name.rpartition(".")
            setattr(_find(module, owner_path), attr, nn.Parameter(p.full_tensor().detach(), requires_grad=False))
            if gathered is not None:
                gathered.append(name)


def _local_part(t: torch.Tensor, s: "Split", sections, rank: int, tp: int, taken: list | None) -> torch.Tensor:
    """The rank's part of `t` by `s`: a DTensor already split that way (one `Shard` on `s.dim`, no sections) gives
    its local shard as it is; any other is gathered whole first, then split."""
    if is_dtensor(t):
        placements = t.placements
        if (sections is None and len(placements) == 1 and type(placements[0]).__name__ == "Shard"
                and placements[0].dim % t.ndim == s.dim % t.ndim and t.shape[s.dim] % tp == 0):
            if taken is not None:
                taken.append(s.path)
            return t.to_local().detach()
        t = t.full_tensor()
    return shard(t.detach(), s.dim, sections, rank, tp)


def apply_layout(mod: nn.Module, layout: Layout, rank: int, tp: int, where: str, *,
                 taken: list[str] | None = None) -> bool:
    """Split `mod`'s parameters by `layout`, in place (the module a `private_copy`'s); -> whether anything was
    split (a module with none of the layout's parameters stays whole). `taken`: where a weight was a DTensor
    already split the same way, its path is appended and its local shard used."""
    for name, n in layout.units(mod).items():
        if n % tp:
            raise ValueError(f"tp_group: {tp} ranks do not divide the {n} {name} of {where}; a head is never split "
                             f"across ranks")
    found = []
    for s in layout.splits:
        owner_path, _, name = s.path.rpartition(".")
        owner = _find(mod, owner_path)
        if owner is None or not isinstance(getattr(owner, name, None), torch.Tensor):
            continue
        t = getattr(owner, name)
        found.append((s, owner, name, t))
    sizes = {s.path: None if s.sections is None else list(s.sections(mod)) for s, *_ in found}
    for s, owner, name, t in found:
        local = _local_part(t, s, sizes[s.path], rank, tp, taken)
        setattr(owner, name, nn.Parameter(local, requires_grad=False) if isinstance(t, nn.Parameter) else local)
        bias = getattr(owner, "bias", None)
        if s.dim == 1 and name == "weight" and isinstance(bias, torch.Tensor):  # added once, by rank 0
            bias = bias.full_tensor() if is_dtensor(bias) else bias
            owner.bias = nn.Parameter(bias.detach() if rank == 0 else torch.zeros_like(bias), requires_grad=False)
    for _, owner, _, _ in found:  # the module's size attributes follow its weight (read by plans, by forwards)
        if isinstance(owner, nn.Linear):
            owner.out_features, owner.in_features = owner.weight.shape
        elif isinstance(owner, nn.Conv1d) and owner.groups == owner.in_channels:  # depthwise: a group per channel
            owner.in_channels = owner.out_channels = owner.groups = owner.weight.shape[0]
    if found:
        for path in layout.divide:
            owner_path, _, name = path.rpartition(".")
            owner = _find(mod, owner_path)
            if isinstance(getattr(owner, name, None), int):
                setattr(owner, name, getattr(owner, name) // tp)
    return bool(found)


def _find(mod, path: str):
    """`mod.<path>` (dotted; "" the module itself), None where the module has no such attribute."""
    for name in filter(None, path.split(".")):
        mod = getattr(mod, name, None)
    return mod


def layout_of(mixer: type) -> Layout | None:
    return next((LAYOUTS[c] for c in mixer.__mro__ if c in LAYOUTS), None)


def close_group(ok: bool = True) -> None:
    """End this process's part in the default group: a barrier when `ok` (no rank tears the group down while another
    still uses it), then a collection of the reference cycles that may still hold the group (an engine and its
    runner refer to each other, so they outlive their last name until the cycle collector runs), then
    `destroy_process_group`. Left to the collector, the last references could go at interpreter exit, where
    releasing a group's native state can abort the process."""
    if not dist.is_initialized():
        return
    try:
        if ok:
            dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


class TensorParallel:
    """A process group as the runner and engine use it: `all_reduce` of partial sums (counted, and drained with
    zeros after a local failure), `vote` (every rank ok?), `share_block` (rank 0's drafts to every rank) and
    `agree_seed`. `collectives` counts every collective issued."""

    def __init__(self, group, device):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("tp_group: torch.distributed is not initialized (call init_process_group first, e.g. "
                             "under torchrun)")
        if group is True:
            group = dist.group.WORLD
        try:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        except Exception as e:
            raise ValueError(f"tp_group: expected a torch.distributed process group, got {group!r} ({e})") from None
        if self.rank < 0:
            raise ValueError("tp_group: this process is not a member of the group")
        self.group, self.device = group, torch.device(device)
        self.src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        self.collectives = 0
        self.pending = 0  # all-reduces left in the running forward
        # a model loaded with transformers' tp_plan: the weights whose local shards were taken as they are, and
        # those gathered whole (then split here, or kept whole)
        self.local_shards: list[str] = []
        self.gathered: list[str] = []

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks."""
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        self.collectives += 1
        self.pending -= 1
        return x

    def drain(self, shape, dtype) -> None:
        """After a local failure: the all-reduces the other ranks still wait for in this forward, with zeros."""
        while self.pending > 0:
            self.all_reduce(torch.zeros(shape, dtype=dtype, device=self.device))

    def vote(self, ok: bool, logits: torch.Tensor | None = None) -> bool:
        """Whether every rank is ok (one collective; a host read). With `logits` (a forward's, the same bits on every
        rank when all is well) a digest of them is compared too: ranks that drifted apart raise here, on every rank,
        instead of waiting later in collectives that no longer match."""
        digest = torch.zeros((), dtype=torch.float64, device=self.device) if logits is None else \
            torch.nan_to_num(logits.detach().double().sum(), nan=0.0, posinf=1.0, neginf=-1.0)
        flag = torch.stack([torch.tensor(float(ok), dtype=torch.float64, device=self.device), digest, -digest])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        self.collectives += 1
        all_ok, low, high = flag.tolist()
        if all_ok and logits is not None and low != -high:
            raise PeerFailure("tp_group: the ranks' logits differ (ranks out of step); every rank stops here")
        return bool(all_ok)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, self.src, group=self.group)
        self.collectives += 1
        return t

    def broadcast_object(self, obj):
        """Rank 0's picklable `obj` on every rank (the others pass None): what a served request loop applies before
        each step (`SpecEngine.follow`)."""
        box = [obj]
        dist.broadcast_object_list(box, self.src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        self.collectives += 1
        return box[0]

    def agree_seed(self, seed: int | None) -> int:
        """`seed`, or a seed drawn on rank 0 for every rank (one sampling stream)."""
        if seed is not None:
            return seed
        t = torch.randint(0, 2 ** 62, (1,), device=self.device) if self.leads else \
            torch.zeros(1, dtype=torch.long, device=self.device)
        return int(self.broadcast(t).item())

    _DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def share_block(self, block: DraftBlock | None, B: int, width: int) -> DraftBlock:
        """Rank 0's checked `block` on every rank (others pass None): B rows of at most `width` drafts, a tree's
        parents over `1 + width` nodes. One broadcast of the integers, one more of the draft probabilities when
        the block has them."""
        n = 4 + B * (2 + 2 * width)
        buf = torch.zeros(n, dtype=torch.long, device=self.device)
        if self.leads:
            G = block.tokens.shape[1]
            p = block.probs
            buf[:4] = torch.tensor([G, block.parent is not None, -1 if p is None else self._DTYPES.index(p.dtype),
                                    0 if p is None else p.shape[-1]])
            body = buf[4:].view(B, 2 + 2 * width)
            body[:, 0] = block.num_drafts
            body[:, 1:1 + G] = block.tokens
            if block.parent is not None:
                body[:, 1 + width:2 + width + G] = block.parent
        self.broadcast(buf)
        G, tree, code, V = buf[:4].tolist()
        if self.leads:
            if code >= 0:
                self.broadcast(block.probs.contiguous())
            return block
        body = buf[4:].view(B, 2 + 2 * width)
        probs = None
        if code >= 0:
            probs = self.broadcast(torch.empty(B, G, V, dtype=self._DTYPES[code], device=self.device))
        return DraftBlock(body[:, 1:1 + G], body[:, 0], probs, body[:, 1 + width:2 + width + G] if tree else None)


class Follower(Drafter):
    """The drafter of a rank other than 0: rank 0 drafts (`TensorParallel.share_block`), so this one keeps nothing;
    it answers what the engine reads of a drafter's shape (feature layers, tree, verify window) as rank 0's does."""

    observes_features = False

    def __init__(self, lead: Drafter, gamma: int):
        self.name = f"{lead.name} (rank 0)"
        self.feature_layers = tuple(lead.feature_layers)
        self.observes_features = lead.observes_features
        self.tree = lead.tree
        self._verify = lead.max_verify_tokens(gamma)

    def bind(self, target) -> None:
        self.tree = self.tree and target.supports_tree

    def max_verify_tokens(self, gamma: int) -> int:
        return self._verify

    def modules(self) -> list[nn.Module]:
        return []

    def propose(self, rows, contexts, gamma, *, sampling=None, generator=None) -> DraftBlock:
        raise RuntimeError("a follower rank does not draft: rank 0's block is broadcast")

    def abort(self, rows) -> None:
        pass
