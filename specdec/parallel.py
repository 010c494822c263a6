"""Tensor parallelism over `torch.distributed` (the caller's process group: gloo on CPU, NCCL on GPU): every piece of
it the runner and the KV cache ask for, in one place.

Each rank holds 1/tp of every recurrent layer's heads (its slice of the q / k / v / gate / beta projections, of the
short-conv channels, hence of the state pool and rings), of every attention's heads (hence of the KV cache) and of
every MLP's hidden units (and of each MoE expert's), as transformers' `tp_plan`s split MLPs; output projections are
row-parallel, followed by one all-reduce. MLA layers, whose latent cache every head reads, run whole and
data-parallel over the requests instead (each rank the rows whose slot it owns: `SlotSplit`). Embeddings, norms,
routers and the lm_head are replicated, so the logits are the same on every rank and so is every decision taken from
them. Rank 0 drafts alone and broadcasts its block (`TensorParallel.share_block`; the other ranks hold a
`specdec.draft.Follower`).

- `TensorParallel`: the process group and its collectives, counted.
- `ShardPlan`: what a runner splits, by its family's `adapters.HybridFamily.tp_layout` (the `tp_layouts` data):
  which layer parts end in an all-reduce, which MLA layers run data-parallel, how many all-reduces a forward makes.
- `Forward`: one forward's collectives (`ShardPlan.forward`): its all-reduces counted down, the drain of a failed
  forward and the fault vote.
- `SlotSplit`: which slots, and which rows of a round, this rank owns for the data-parallel layers (the KV cache
  asks it).

Faults: a rank whose forward raises still runs the rest of that forward's all-reduces (with zeros) and then votes;
every rank learns the vote in the forward's one extra collective, drops the round and raises, so no rank is left
waiting in a collective and the engine stays usable.
"""

from __future__ import annotations

import copy
import gc
import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from specdec.draft import DraftBlock
from specdec.replayssm.plan import BufferSpec
from specdec.tensors import index_tensor

from .adapters import HYBRID_FAMILIES
from .kv_cache import kv_specs, num_pages_for
from .tp_layouts import Layout, Split


class PeerFailure(RuntimeError):
    """Another rank failed in this forward: every rank dropped the round (the engine stays usable)."""


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


def _local_part(t: torch.Tensor, s: Split, sections, rank: int, tp: int, taken: list | None) -> torch.Tensor:
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
    """A process group as the runner (through `Forward`) and the engine use it: `all_reduce` of partial sums, `vote`
    (every rank ok?), `share_block` (rank 0's drafts to every rank) and `agree_seed`. `collectives` counts every
    collective issued."""

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
        return x

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


def owned_rows(num_slots: int, ranks: int) -> int:
    """Rows a rank keeps of a data-parallel layer (`SlotSplit`): its share of the request slots (slot s
    to rank s % ranks, row s // ranks; the null slot, the last, to none)."""
    return -(-(num_slots - 1) // ranks)


class SlotSplit:
    """The request slots of a runner's data-parallel layers (`ShardPlan`: MLA layers, run whole on each rank over the
    requests whose slot it owns), as the KV cache asks for them: slot s is rank `s % ranks`'s, at row `s // ranks` of
    that rank's tables and pages (`row`); the null slot, the last, is no rank's. `select` takes a round's slots:
    `own [B_own]`, the round's rows whose slot this rank owns, and `own_rows [B_own]`, their rows in the layers'
    buffers (until `clear`)."""

    def __init__(self, layers, rank: int, ranks: int, num_slots: int, device):
        self.layers = frozenset(layers)
        self.rank, self.ranks, self.null = rank, ranks, num_slots - 1
        self.rows = owned_rows(num_slots, ranks)  # rows of the layers' tables on this rank
        self.device = torch.device(device)
        self.own: torch.Tensor | None = None
        self.own_rows: torch.Tensor | None = None
        self._index: dict = {}

    def holds(self, layer) -> bool:
        """Whether `layer` (an attention layer's index, or a feature's key) runs data-parallel."""
        return layer in self.layers

    def row(self, slot: int) -> int | None:
        """`slot`'s row in this rank's buffers of the layers; None where another rank owns it, or for the null slot."""
        return slot // self.ranks if slot != self.null and slot % self.ranks == self.rank else None

    def select(self, host_slots: list[int]) -> None:
        """A round over `host_slots`: its owned rows and their buffer rows (device tensors, kept per distinct list)."""
        own = [b for b, s in enumerate(host_slots) if self.row(s) is not None]
        self.own = index_tensor(self._index, own, self.device)
        self.own_rows = index_tensor(self._index, [self.row(host_slots[b]) for b in own], self.device)

    def clear(self) -> None:
        self.own = self.own_rows = None

    def kv_specs(self, layers: dict, max_length: int, dtype: torch.dtype) -> dict[str, BufferSpec]:
        """The buffers the KV cache allocates for those of `layers` (`{layer: [(heads, dim) per stored tensor]}`) it
        holds: pages for `max_length` tokens in each of its `rows` (none is the null slot) and their block table."""
        return kv_specs(self.rows, max_length, {i: d for i, d in layers.items() if self.holds(i)}, dtype, group="dp",
                        num_pages=self.rows * num_pages_for(max_length))


class ShardPlan:
    """What a runner splits of its modules on this rank, and what that asks of each forward: per part ("mixer",
    "attn", "mlp") the layers whose output is a partial sum (`split`: an all-reduce follows it), the MLA layers that
    run whole and data-parallel over the requests (`data_parallel`, their slots a `SlotSplit`), and the all-reduces
    of one forward (`reduces`). Made once by the runner from its layer plan (`mixers {layer: module}`, `attns {layer:
    module}`, `mlps [(mlp, moe, scale)]`): the modules are split in place by the family's `HybridFamily.tp_layout`
    (the runner's model is the engine's `private_copy`), every attention but those of `replicate` (a drafter reads
    their KV cache). Without `tp` nothing is split and a forward makes no collective."""

    def __init__(self, tp: TensorParallel | None, family: str, *, mixers: dict, attns: dict, mlps: list,
                 model: nn.Module, replicate=()):
        self.tp = tp
        self.split: dict[str, set[int]] = {"mixer": set(), "attn": set(), "mlp": set()}
        self.dp: set[int] = set()
        self.slots: SlotSplit | None = None
        if tp is not None:
            self._apply(tp, family, mixers, attns, mlps, set(replicate))
            gather_rest(model, tp.gathered)  # what stays whole here (a tp_plan's other DTensors)
        self.reduces = sum(len(s) for s in self.split.values())

    def _apply(self, tp: TensorParallel, family: str, mixers: dict, attns: dict, mlps: list, replicate: set) -> None:
        """Split the modules by the family's `tp_layout` (refused where it declares none)."""
        spec = HYBRID_FAMILIES[family]
        layout = spec.tp_layout
        if layout is None:
            known = sorted(name for name, f in HYBRID_FAMILIES.items() if f.tp_layout is not None)
            raise ValueError(f"tp_group: no tensor-parallel layout for model_type {family!r}; those with one: {known}")
        for i, mod in mixers.items():
            if not apply_layout(mod, layout.mixer, tp.rank, tp.size, f"{family} layer {i} mixer",
                                taken=tp.local_shards):
                raise ValueError(f"tp_group: the {family} layer {i} mixer has none of the parameters its layout "
                                 f"splits")
            self.split["mixer"].add(i)
        for i, attn in attns.items():
            if i in replicate:
                continue
            if spec.latent_attention is not None and isinstance(attn, spec.latent_attention):
                # MLA: its latent cache is every head's, so the layer runs whole on each rank, over the requests
                # whose slots the rank owns (its cache 1/tp of the slots); the all-reduce joins the rows
                self.dp.add(i)
                self.split["attn"].add(i)
            elif apply_layout(attn, layout.attention, tp.rank, tp.size, f"{family} layer {i} attention",
                              taken=tp.local_shards):
                self.split["attn"].add(i)
        for i, (mlp, moe, _) in enumerate(mlps):
            done = [apply_layout(m, layout.mlp, tp.rank, tp.size, f"{family} layer {i} MLP", taken=tp.local_shards)
                    for m in (mlp, moe) if m is not None]
            if any(done) and not all(done):  # one all-reduce after their sum: both partial or both whole
                raise ValueError(f"tp_group: the {family} layer {i} MLP and MoE split differently")
            if any(done):
                self.split["mlp"].add(i)

    def data_parallel(self, layer: int) -> bool:
        return layer in self.dp

    def split_slots(self, num_slots: int, device) -> None:
        """Split `num_slots` request slots (the last the null slot) over the ranks for the data-parallel layers:
        `slots`, which the forwards read and the KV cache is given (None where no layer runs data-parallel)."""
        if self.dp:
            self.slots = SlotSplit(self.dp, self.tp.rank, self.tp.size, num_slots, device)

    def kv_specs(self, layers: dict, max_length: int, dtype: torch.dtype) -> dict[str, BufferSpec]:
        """The KV buffers of the data-parallel layers among `layers` (`SlotSplit.kv_specs`; none without)."""
        return {} if self.slots is None else self.slots.kv_specs(layers, max_length, dtype)

    def forward(self, shape: tuple[int, ...], dtype: torch.dtype) -> Forward:
        """A forward over hidden states `shape` `[B, T, d]` in `dtype` (`Forward`)."""
        return Forward(self, shape, dtype)


class Forward:
    """One forward of a runner, as a context (`with plan.forward(shape, dtype) as fwd:`): `reduce` sums a split part's
    output over the ranks and `attention` runs a layer's attention (a data-parallel one on the rows whose slot this
    rank owns), counting down the forward's all-reduces; `agree`, the last call, votes that every rank got there with
    the same logits. Left by an exception before `agree`, it runs the all-reduces the other ranks still wait for (with
    zeros), then votes no: every rank learns it in that one collective and raises, so none is left waiting. Without
    tensor parallelism every call passes its input through."""

    def __init__(self, plan: ShardPlan, shape: tuple[int, ...], dtype: torch.dtype):
        self.plan, self.shape, self.dtype = plan, shape, dtype
        self.pending = plan.reduces  # all-reduces left
        self.voted = False

    def __enter__(self) -> Forward:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        tp = self.plan.tp
        if kind is not None and tp is not None and not self.voted:  # the other ranks finish, then learn it failed
            self.voted = True
            while self.pending > 0:
                self._all_reduce(torch.zeros(self.shape, dtype=self.dtype, device=tp.device))
            tp.vote(False)
        return False

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = self.plan.tp.all_reduce(x)
        self.pending -= 1
        return x

    def reduce(self, x: torch.Tensor, part: str, i: int) -> torch.Tensor:
        """Layer i's `part` ("mixer", "attn", "mlp") output `[B, T, d]`, summed over the ranks where it is a partial
        sum."""
        return self._all_reduce(x) if i in self.plan.split[part] else x

    def attention(self, i: int, attend: Callable, x: torch.Tensor, mask: torch.Tensor | None,
                  positions: torch.Tensor, kw: dict) -> torch.Tensor:
        """Layer i's attention output `[B, T, d]` for its input `x [B, T, d]`, `mask [B, 1, T, S]` and `positions
        [B, T]` (`attend(i, x, mask, positions, kw)`: the runner's call of it; `kw`: its keywords, tuples of `[B, ...]`
        tensors taken per row), reduced. A data-parallel layer runs on the rows whose slot this rank owns, the other
        rows 0: each row's output comes from its owner alone through the all-reduce."""
        if i in self.plan.dp:
            own = self.plan.slots.own
            out = torch.zeros_like(x)
            if own.numel():
                kw = {k: tuple(t[own] for t in v) if isinstance(v, tuple) else v for k, v in kw.items()}
                out[own] = attend(i, x[own], None if mask is None else mask[own], positions[own], kw)
            return self.reduce(out, "attn", i)
        return self.reduce(attend(i, x, mask, positions, kw), "attn", i)

    def agree(self, logits: torch.Tensor) -> None:
        """The forward's end: every rank learns whether every other one got here, with the same `logits` (one
        collective); PeerFailure where one did not."""
        tp = self.plan.tp
        if tp is None:
            return
        self.voted = True
        if not tp.vote(True, logits):
            raise PeerFailure("tp_group: another rank failed in this forward; every rank dropped the round")
