"""State strategies: full snapshot (the oracle) and ReplaySSM (rings + exact fold), one interface.

A speculative round on the linear layers:

    strategy.begin(slots, num_tokens=D)            # or parent=[T] / [B, T] (or a VerifyTree) for a tree
    for layer in range(num_layers):
        y = strategy.conv(layer, x, weight, bias)  # short conv; conv windows (snapshot) or inputs (replay) kept
        o = strategy.mix(layer, q, k, v, g, beta)  # delta rule from the checkpoint
    strategy.commit(num_kept)                      # or path=[B, M] accepted node indices

Nothing persistent changes before `commit`; `abort` drops an open round, leaving every slot as it was.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from specdec import kernels
from specdec.kernels.common import valid_slots
from specdec.kernels.scatter.naive import rebuild_windows
from specdec.kernels.tree import VerifyTree
from specdec.verify.record import Acceptance

from .config import StateConfig
from .plan import buffer_specs
from .pool import SlotPool, allocate
from .ring import RingBuffers


@dataclass
class Round:
    slots: torch.Tensor  # [B] slot per request row
    num_tokens: int  # T
    tree: VerifyTree | None  # [B, T] tree parents; None = chain
    copy_commit: bool = False  # ReplaySSM: a one-token round that keeps its state and commits it by copy
    conv_done: set[int] = field(default_factory=set)
    mix_done: set[int] = field(default_factory=set)


class StateStrategy(ABC):
    """Common part: slot pool, round bookkeeping, the short conv and track copies."""

    name = "base"

    def __init__(self, cfg: StateConfig, *, device: torch.device | str = "cpu", pool: SlotPool | None = None):
        self.cfg = cfg
        self.pool = pool if pool is not None else SlotPool(cfg, device=device)
        self.device = self.pool.device
        self._round: Round | None = None
        if cfg.gate_in_kernel:  # every layer's A_log [Lyr, H] and dt_bias [Lyr, H, K], read by verify and fold
            specs = buffer_specs(cfg)
            self.gate_A_log = allocate(specs["gate_A_log"], self.device)
            self.gate_dt_bias = allocate(specs["gate_dt_bias"], self.device)
            self._gate_set: set[int] = set()

    def set_gate(self, layer: int, A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """The gate parameters of one layer (`cfg.gate_in_kernel`): `A_log` with H entries (Kimi's `[1, 1, H, 1]`),
        `dt_bias` with H * K (`[H * K]`), copied in `cfg.record_dtype` (fp32, as the model computes its gate; fp64
        for a float64 state, which the float64 tests run the model's own gate in)."""
        cfg = self.cfg
        if not cfg.gate_in_kernel:
            raise ValueError("set_gate: this state takes log-decays (StateConfig.gate_in_kernel is False)")
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"layer: expected 0..{cfg.num_layers - 1}, got {layer}")
        H, K = cfg.num_heads, cfg.head_k_dim
        if A_log.numel() != H:
            raise ValueError(f"A_log: expected {H} entries (one per head), got shape {list(A_log.shape)}")
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias: expected {H * K} entries (heads x K), got shape {list(dt_bias.shape)}")
        self.gate_A_log[layer] = A_log.detach().reshape(H)
        self.gate_dt_bias[layer] = dt_bias.detach().reshape(H, K)
        self._gate_set.add(layer)

    def gate(self, layer: int | None = None) -> dict:
        """`A_log=`, `dt_bias=` of one layer (`[H]`, `[H, K]`) or of all (`[Lyr, H]`, `[Lyr, H, K]`) for the kernels;
        nothing when the g records are log-decays."""
        if not self.cfg.gate_in_kernel:
            return {}
        if layer is None:
            return dict(A_log=self.gate_A_log, dt_bias=self.gate_dt_bias)
        return dict(A_log=self.gate_A_log[layer], dt_bias=self.gate_dt_bias[layer])

    # ---- round -------------------------------------------------------------------------------------
    def begin(self, slots, *, num_tokens: int | None = None, parent=None) -> None:
        """Open a round for requests in `slots` (`[B]`; -1 or the null slot: skipped rows)."""
        if self._round is not None:
            raise RuntimeError("begin: a round is open; call commit() or abort() first")
        slots = torch.as_tensor(slots, dtype=torch.long, device=self.device)
        self.pool.check_slots(slots)
        B, D = slots.shape[0], self.cfg.num_verify_tokens
        if not 1 <= B <= self.cfg.max_running + 1:
            raise ValueError(f"slots: expected 1..{self.cfg.max_running + 1} requests, got {B}")
        tree = None if parent is None else VerifyTree.check(parent, B, device=self.device)
        if tree is not None:
            T = tree.T
            if num_tokens is not None and num_tokens != T:
                raise ValueError(f"num_tokens: {num_tokens} != {T} tree nodes in parent")
        else:
            T = D if num_tokens is None else int(num_tokens)
        if not 1 <= T <= D:
            raise ValueError(f"num_tokens: expected 1 <= T <= D={D}, got {T}")
        self.open(slots, T, tree)

    def open(self, slots: torch.Tensor, num_tokens: int, tree: VerifyTree | None) -> None:
        """Open a round whose inputs the caller checked at its own boundary (the slot owner; `begin` checks them
        first): `slots [B]` long on the device, the round's tree or None. Reads nothing back to the host."""
        if self._round is not None:
            raise RuntimeError("begin: a round is open; call commit() or abort() first")
        self._round = Round(slots=slots, num_tokens=num_tokens, tree=tree)

    def abort(self) -> None:
        """Drop the open round; persistent state is untouched."""
        self._round = None

    def _open(self, layer: int, x: torch.Tensor, tail: tuple, arg: str) -> Round:
        r = self._round
        if r is None:
            raise RuntimeError("no open round: call begin() first")
        if not 0 <= layer < self.cfg.num_layers:
            raise ValueError(f"layer: expected 0..{self.cfg.num_layers - 1}, got {layer}")
        want = (r.slots.shape[0], r.num_tokens, *tail)
        if tuple(x.shape) != want:
            raise ValueError(f"{arg}: expected shape {list(want)}, got {list(x.shape)}")
        return r

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             activation: str | None = "silu") -> torch.Tensor:
        """Short conv of one layer. x `[B, T, C]` pre-conv, weight `[C, Kc]` -> y `[B, T, C]`."""
        cfg = self.cfg
        r = self._open(layer, x, (cfg.conv_dim,), "x")
        if tuple(weight.shape) != (cfg.conv_dim, cfg.conv_kernel):
            raise ValueError(f"weight: expected shape {[cfg.conv_dim, cfg.conv_kernel]}, got {list(weight.shape)}")
        # the round's tree was checked once, by `begin` or the runner's caller: the kernels take it as it is
        y = kernels.short_conv_verify(x, weight, bias, self.pool.conv[layer], r.slots, parent=r.tree,
                                      activation=activation, null_slot=self.pool.null_slot,
                                      **self._conv_out(layer))
        r.conv_done.add(layer)
        return y

    def mix(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor) -> torch.Tensor:
        """Delta rule (or the Mamba2 rule: q = C, k = B, v = x, g = dt A, beta = dt) of one layer: raw q, k
        `[B, T, H, K]`, v `[B, T, H, V]`, g `[B, T, H, K]` (KDA; with `cfg.gate_in_kernel` the gate's input f) or
        `[B, T, H]` (GDN), beta `[B, T, H]` -> o `[B, T, H, V]`."""
        cfg = self.cfg
        H, K, V = cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim
        r = self._open(layer, q, (H, K), "q")
        if cfg.gate_in_kernel and layer not in self._gate_set:
            raise RuntimeError(f"mix: gate_in_kernel needs layer {layer}'s A_log and dt_bias: call set_gate first")
        self._open(layer, k, (H, K), "k")
        self._open(layer, v, (H, V), "v")
        self._open(layer, g, (H, K) if cfg.gate == "kda" else (H,), "g")
        self._open(layer, beta, (H,), "beta")
        o = self._verify(layer, r, q, k, v, g, beta)
        r.mix_done.add(layer)
        return o

    def commit(self, num_kept=None, *, path=None) -> None:
        """Keep the accepted tokens of each request: `num_kept [B]` (chain: tokens kept, 1..T; ignored on skipped
        rows) or `path [B, M]` (accepted node indices root to leaf, -1 padded). Checked against the round, then
        committed as an `Acceptance` (`keep`, which the slot owner calls with an accept rule's record); closes it."""
        r = self._round
        if r is None:
            raise RuntimeError("commit: no open round")
        missing = sorted(set(range(self.cfg.num_layers)) - (r.conv_done & r.mix_done))
        if missing:
            raise RuntimeError(f"commit: layers {missing} were not verified (conv and mix) in this round")
        self.keep(Acceptance.kept(*self._accepted(r, num_kept, path)))

    def keep(self, acc: Acceptance) -> None:
        """Commit what an accept rule's record says, unchecked (`commit` checks its arguments, then calls this):
        `acc.path [B, M]` accepted node indices (root first; entries past `acc.num_kept` ignored), `acc.num_kept
        [B]` tokens kept per row. Rows whose slot is -1 or the null slot keep nothing. Device ops only: nothing is
        read back to the host."""
        r = self._round
        valid = valid_slots(r.slots, self.pool.null_slot)
        n = torch.where(valid, acc.num_kept, 0)
        path = acc.path.clamp(min=0)
        before = self.committed_len(r.slots)
        self._commit_state(r, path, n, before)
        self._round = None

    def _accepted(self, r: Round, num_kept, path) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the accepted tokens; -> (path `[B, M]`, n `[B]`, 0 on skipped rows)."""
        B, T = r.slots.shape[0], r.num_tokens
        valid = valid_slots(r.slots, self.pool.null_slot)
        if (num_kept is None) == (path is None):
            raise ValueError("commit: pass exactly one of num_kept (chain) or path (tree)")
        if num_kept is not None:
            if r.tree is not None:
                raise ValueError("num_kept: this round is a tree; pass path=[B, M] node indices")
            n = torch.as_tensor(num_kept, dtype=torch.long, device=self.device)
            if n.shape != (B,):
                raise ValueError(f"num_kept: expected shape [{B}], got {list(n.shape)}")
            bad = valid & ((n < 1) | (n > T))
            if bool(bad.any()):
                raise ValueError(f"num_kept: expected 1..{T} per request (tokens kept: the anchor and the accepted "
                                 f"drafts), got {n.tolist()}")
            n = torch.where(valid, n, 0)
            return torch.arange(T, device=self.device).expand(B, T), n
        path = torch.as_tensor(path, dtype=torch.long, device=self.device)
        if path.dim() != 2 or path.shape[0] != B or not 1 <= path.shape[1] <= T:
            raise ValueError(f"path: expected [{B}, M] with 1 <= M <= {T}, got {list(path.shape)}")
        parent = r.tree.parent if r.tree is not None else torch.arange(-1, T - 1, device=self.device).expand(B, T)
        live = path >= 0
        n = live.sum(1)
        # a root-to-leaf path: live entries first, each in range and the child of the one before it
        prefix = live.long().cumprod(1).sum(1) == n
        idx = path.clamp(0, T - 1)
        par = parent.gather(1, idx)
        prev = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=self.device), path[:, :-1]], 1)
        linked = ~live | ((path < T) & (par == prev))
        ok = ~valid | ((n >= 1) & prefix & linked.all(1))
        if not bool(ok.all()):
            b = int((~ok).nonzero()[0])
            raise ValueError(f"path: row {b} = {path[b].tolist()} is not a root-to-leaf path of the verified tree "
                             f"(parents {parent[b].tolist()})")
        return path.clamp(min=0), torch.where(valid, n, 0)

    def _track(self, r: Round, path: torch.Tensor, n: torch.Tensor, before: torch.Tensor, src,
               dst: torch.Tensor, *, lengths: bool = False) -> None:
        """Copy the state after the token of this round that lands on a track boundary (token count a multiple
        of `track_interval`) to `dst[:, slot, parity]`, and with `lengths` record the count. `src` is a
        per-node buffer `[Lyr, R, T, ...]` (read at `[:, row, node]`) or a function `(j [B]) -> [Lyr, B, ...]`
        giving the state after the first j + 1 accepted tokens. Masked writes on the device: at most
        `T // interval + 1` of them."""
        iv = self.cfg.track_interval
        if iv is None:
            return
        B, M = path.shape
        valid = valid_slots(r.slots, self.pool.null_slot)
        s = torch.where(valid, r.slots, self.pool.null_slot)
        rows = torch.arange(B, device=self.device)
        for k in range(r.num_tokens // iv + 1):
            count = (before // iv + 1 + k) * iv
            j = count - before - 1  # offset of the boundary token in the path
            hit = valid & (j < n)
            node = path.gather(1, j.clamp(0, M - 1)[:, None])[:, 0]
            par = (count // iv) % 2
            new = src(j.clamp(0, M - 1)) if callable(src) else src[:, rows, node]
            old = dst[:, s, par]
            dst[:, s, par] = torch.where(hit.view(1, B, *[1] * (new.dim() - 2)), new.to(dst.dtype), old)
            if lengths:
                self.pool.track_len[s, par] = torch.where(hit, count, self.pool.track_len[s, par])

    def _scatter_commit(self, r: Round, path: torch.Tensor, n: torch.Tensor, before: torch.Tensor,
                        states: torch.Tensor, windows: torch.Tensor) -> None:
        """Commit by copy: each row's slot takes the state `states [Lyr, R, T, H, K, V]` and conv window
        `windows [Lyr, R, T, C, Kc-1]` after its last accepted node (tracks first); rows keeping nothing skip."""
        self._track(r, path, n, before, states, self.pool.track_ssm)
        self._track(r, path, n, before, windows, self.pool.track_conv, lengths=True)
        last = torch.where(n > 0, path.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0], -1)
        kernels.masked_scatter(states, self.pool.ssm, r.slots, last, null_slot=self.pool.null_slot)
        kernels.masked_scatter(windows, self.pool.conv, r.slots, last, null_slot=self.pool.null_slot)
        self._add_len(r, n)

    def _add_len(self, r: Round, n: torch.Tensor) -> None:
        """Committed length += n per row (n is 0 on skipped rows, which go to the null slot)."""
        valid = valid_slots(r.slots, self.pool.null_slot)
        self.pool.seq_len.index_add_(0, torch.where(valid, r.slots, self.pool.null_slot), n)

    # ---- state -------------------------------------------------------------------------------------
    def committed_len(self, slots: torch.Tensor) -> torch.Tensor:
        """Tokens committed per slot `[B]` (folded + pending); 0 for skipped rows."""
        valid = valid_slots(slots, self.pool.null_slot)
        return torch.where(valid, self.pool.seq_len[slots.clamp(min=0)], 0)

    def committed_ssm(self) -> torch.Tensor:
        """`[Lyr, N, H, K, V]` committed checkpoints, pending records included (no state changes)."""
        return self.pool.ssm

    def flush(self, slots=None) -> None:
        """Fold pending records (lazy commit) into the checkpoints of `slots` (default: all)."""

    def release(self, slots: list[int]) -> None:
        """End requests: fold what is pending, return the slots to the pool."""
        self.flush(slots)
        self.pool.free(list(slots))

    def _kw(self, layer: int) -> dict:
        c = self.cfg
        return dict(scale=c.scale, eps=c.norm_eps, norm=c.norm, null_slot=self.pool.null_slot, rule=c.rule,
                    **self.gate(layer))

    # ---- per strategy ------------------------------------------------------------------------------
    @abstractmethod
    def _conv_out(self, layer: int) -> dict:
        """What the short conv of `layer` keeps for commit: `short_conv_verify` keyword arguments."""

    @abstractmethod
    def _verify(self, layer, r, q, k, v, g, beta) -> torch.Tensor:
        """Run the delta rule of one layer for the open round; -> o `[B, T, H, V]`."""

    @abstractmethod
    def _commit_state(self, r: Round, path: torch.Tensor, n: torch.Tensor, before: torch.Tensor) -> None:
        """Advance the checkpoints and conv windows by the accepted tokens (`before`: committed length per row)."""


class SnapshotStrategy(StateStrategy):
    """Full snapshot (SGLang's default scheme): verify writes the state and the conv window after every token;
    commit scatters the last accepted one."""

    name = "snapshot"

    def __init__(self, cfg: StateConfig, *, device: torch.device | str = "cpu", pool: SlotPool | None = None):
        super().__init__(cfg, device=device, pool=pool)
        specs = buffer_specs(cfg)
        self.states = allocate(specs["snapshot_intermediate_ssm"], self.device)  # [Lyr, R, T, H, K, V]
        self.conv_windows = allocate(specs["intermediate_conv_window"], self.device)  # [Lyr, R, T, C, Kc-1]

    def _conv_out(self, layer):
        return dict(window_states=self.conv_windows[layer])

    def _verify(self, layer, r, q, k, v, g, beta):
        return kernels.verify_delta_rule(q, k, v, g, beta, self.pool.ssm[layer], r.slots, parent=r.tree,
                                         intermediate_states=self.states[layer], **self._kw(layer))

    def _commit_state(self, r, path, n, before):
        self._scatter_commit(r, path, n, before, self.states, self.conv_windows)


class ReplayStrategy(StateStrategy):
    """ReplaySSM: verify keeps per-token records; commit re-folds the accepted ones exactly.

    The short conv keeps each verify token's pre-conv input (`conv_inputs [Lyr, R, T, C]`); commit rebuilds the
    window after the last accepted token from the committed window and those inputs, in the fold's launch.

    `commit="eager"` folds right after acceptance: the rings hold one round, `[Lyr, running row, H, D, *]`, and
    only the fold's records (rawv, rawk, g, beta). `commit="lazy"` leaves them pending in per-slot rings
    `[Lyr, slot, H, L, *]` with all six records: the next verify starts from the fast rebuild of checkpoint +
    pending `(d, k, g)`, and the fold runs when pending + D would overflow the ring, when a track boundary is
    crossed, on `flush`, or at request end.

    A one-token round (a plain decode step) on the reference backend with eager commit keeps no records: its
    verify is the fold's own step (`common.delta_step`), so the state it computes is the one the fold would
    rebuild, bit for bit; it keeps that state and the conv window (`step_ssm`, `step_conv_window` of the memory
    plan) and commit copies them, as the snapshot strategy does. On a CPU that halves the state work of a plain
    step and drops the fold's ops. The Triton backend folds.
    """

    name = "replay"

    def __init__(self, cfg: StateConfig, *, commit: str = "eager", device: torch.device | str = "cpu",
                 pool: SlotPool | None = None):
        if commit not in ("eager", "lazy"):
            raise ValueError(f"commit: expected 'eager' or 'lazy', got {commit!r}")
        super().__init__(cfg, device=device, pool=pool)
        self.commit_mode = commit
        self.rings = RingBuffers(cfg, layout=commit, device=self.device)
        self.conv_inputs = allocate(buffer_specs(cfg, layout=commit)["conv_inputs"], self.device)  # [Lyr, R, T, C]
        # [R, tree_stack_slots(T), H, K, V]: one layer's kept parent states of a tree verify, reused
        self.tree_stack: torch.Tensor | None = None
        # [Lyr, R, 1, H, K, V] and [Lyr, R, 1, C, Kc-1]: a one-token round's state and window (see above)
        self.step_states: torch.Tensor | None = None
        self.step_windows: torch.Tensor | None = None

    def _one_token(self, num_tokens: int) -> bool:
        """Whether a round of `num_tokens` commits by copy: one token, eager commit, the reference backend."""
        return num_tokens == 1 and self.commit_mode == "eager" and not kernels.dispatch.uses_triton(self.pool.ssm)

    def open(self, slots, num_tokens, tree):
        super().open(slots, num_tokens, tree)
        self._round.copy_commit = self._one_token(num_tokens)  # decided once, read by every layer and commit

    def _step_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.step_states is None:  # allocated by the first one-token round, then reused
            specs = buffer_specs(self.cfg)
            self.step_states = allocate(specs["step_ssm"], self.device)
            self.step_windows = allocate(specs["step_conv_window"], self.device)
        return self.step_states, self.step_windows

    def _conv_out(self, layer):
        if self._round.copy_commit:
            return dict(window_states=self._step_buffers()[1][layer])
        return dict(conv_inputs=self.conv_inputs[layer])

    def _rows(self, r: Round) -> torch.Tensor:
        """Eager ring index of each request: its running row `0..B-1` `[B]`."""
        return torch.arange(r.slots.shape[0], device=self.device)

    def _verify(self, layer, r, q, k, v, g, beta):
        if r.copy_commit:  # the state after the token, kept for commit; no records
            kw = dict(intermediate_states=self._step_buffers()[0][layer])
        else:
            kw = {}
            # the Triton tree kernel reloads parent states from a stack; the CPU's chunk form needs none (commit
            # folds the records)
            if r.tree is not None and kernels.dispatch.uses_triton(q, self.pool.ssm):
                if self.tree_stack is None:  # allocated once, overwritten layer after layer
                    self.tree_stack = allocate(buffer_specs(self.cfg)["tree_state_stack"], self.device)
                kw["tree_stack"] = self.tree_stack
            if self.commit_mode == "lazy":
                kw.update(ring_start=self.rings.start, num_pending=self.rings.pending)
            else:
                kw.update(ring_indices=self._rows(r))
            kw["ring"] = self.rings.layer(layer)
        return kernels.verify_delta_rule(q, k, v, g, beta, self.pool.ssm[layer], r.slots, parent=r.tree,
                                         **kw, **self._kw(layer))

    def _fold(self, ssm: torch.Tensor, slots: torch.Tensor, num: torch.Tensor, offsets=None, *,
              track: bool = True, **kw) -> None:
        c, rings = self.cfg, self.rings
        kernels.exact_fold(ssm, rings.rawv, rings.rawk, rings.g, rings.beta, slots, rings.start, num,
                           offsets=offsets, seq_lens=self.pool.seq_len if track else None,
                           track_interval=c.track_interval if track else None,
                           track_states=self.pool.track_ssm if track else None, eps=c.norm_eps, norm=c.norm,
                           null_slot=self.pool.null_slot, rule=c.rule, **self.gate(), **kw)

    def _commit_state(self, r, path, n, before):
        if r.copy_commit:
            self._scatter_commit(r, path, n, before, *self._step_buffers())
            return
        slots = torch.where(valid_slots(r.slots, self.pool.null_slot), r.slots, self.pool.null_slot)
        # a track boundary's conv window, from the committed window: before the fold's launch rewrites it
        self._track(r, path, n, before,
                    lambda j: rebuild_windows(self.pool.conv[:, slots], self.conv_inputs[:, :slots.shape[0]], path,
                                              j + 1),
                    self.pool.track_conv, lengths=True)
        conv = dict(conv_state=self.pool.conv, conv_inputs=self.conv_inputs, conv_path=path, conv_count=n)
        if self.commit_mode == "eager":
            self._fold(self.pool.ssm, r.slots, n, path, ring_indices=self._rows(r), **conv)
            self._add_len(r, n)
            return
        if r.tree is not None:  # a tree's accepted path moves to consecutive ring positions
            self.rings.compact(torch.where(n > 0, slots, self.pool.null_slot), path, n)
        self.rings.pending.index_add_(0, slots, n)
        # fold now where the ring would overflow next round or a track boundary was crossed
        iv, L, D = self.cfg.track_interval, self.cfg.ring_len, self.cfg.num_verify_tokens
        due = (n > 0) & (self.rings.pending[slots] + D > L)
        if iv is not None:
            due |= (n > 0) & ((before + n) // iv > before // iv)
        # one launch: the due rows' pending records, and every row's conv window
        self._flush(slots, due, **conv)

    def committed_len(self, slots):
        valid = valid_slots(slots, self.pool.null_slot)
        s = slots.clamp(min=0)
        pending = self.rings.pending[s] if self.commit_mode == "lazy" else 0
        return torch.where(valid, self.pool.seq_len[s] + pending, 0)

    def committed_ssm(self) -> torch.Tensor:
        if self.commit_mode == "eager":
            return self.pool.ssm
        ssm = self.pool.ssm.clone()
        slots = (self.rings.pending > 0).nonzero().flatten()
        self._fold(ssm, slots, self.rings.pending[slots], track=False)
        return ssm

    def flush(self, slots=None) -> None:
        if self.commit_mode == "eager":
            return
        if slots is None:
            slots = (self.rings.pending > 0).nonzero().flatten().tolist()
        slots = torch.as_tensor([s for s in slots if int(self.rings.pending[s]) > 0], dtype=torch.long,
                                device=self.device)
        if slots.numel() == 0:
            return
        self._flush(slots, torch.ones_like(slots, dtype=torch.bool))

    def _flush(self, slots: torch.Tensor, due: torch.Tensor, **conv) -> None:
        """Fold the pending records of `slots [S]` where `due [S]` (distinct slots; null-slot entries are skipped)
        on the device; `conv`: the round's conv commit, run in the same launch."""
        live = due & (slots != self.pool.null_slot)
        num = torch.where(live, self.rings.pending[slots], 0)
        self._fold(self.pool.ssm, slots, num, **conv)
        self.rings.start[slots] = (self.rings.start[slots] + num) % self.cfg.ring_len
        self.pool.seq_len.index_add_(0, slots, num)
        self.rings.pending[slots] = torch.where(live, 0, self.rings.pending[slots])

    def release(self, slots: list[int]) -> None:
        super().release(slots)
        for s in slots:
            self.rings.reset(s)


def make_strategy(cfg: StateConfig, strategy: str = "replay", *, commit: str = "eager",
                  device: torch.device | str = "cpu", pool: SlotPool | None = None) -> StateStrategy:
    """`strategy` in {"replay", "snapshot"}; `commit` in {"eager", "lazy"} (replay only)."""
    if strategy == "replay":
        return ReplayStrategy(cfg, commit=commit, device=device, pool=pool)
    if strategy == "snapshot":
        if commit != "eager":
            raise ValueError(f"commit: strategy 'snapshot' commits eagerly (a state per verify token, copied); "
                             f"expected 'eager', got {commit!r}")
        return SnapshotStrategy(cfg, device=device, pool=pool)
    raise ValueError(f"strategy: expected 'replay' or 'snapshot', got {strategy!r}")
