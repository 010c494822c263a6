"""Drives the state strategies and a plain sequential decode side by side on the same random inputs."""

from __future__ import annotations

import torch
from assertions import assert_close, max_rel_err, root_path

from specdec.kernels import kda_gate, recurrent_delta_rule, short_conv
from specdec.replayssm import StateConfig, make_strategy

STRATEGIES = {"snapshot": ("snapshot", "eager"), "replay-eager": ("replay", "eager"), "replay-lazy": ("replay", "lazy")}


def rel_tol(dtype: torch.dtype) -> float:
    """Exact-fold states: fp64 1e-12 relative; fp32 2 eps (the fold steps in plain decode's op order)."""
    return 1e-12 if dtype == torch.float64 else 2 * torch.finfo(torch.float32).eps


def check_verify_value(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, msg: str) -> None:
    """Verify outputs and the snapshot scheme's states (node states of the verify): off the GPU the verify is the
    chunk form, the recurrence in another op order, so fp64 1e-12 relative and fp32 the fp32 tolerance of
    `assertions` (docs/EXACTNESS.md), not the 2 eps of the exact fold."""
    if dtype == torch.float64:
        err = max_rel_err(got, want)
        assert err <= 1e-12, f"{msg}: rel err {err:.3e}"
    else:
        assert_close(got, want, dtype=dtype, msg=msg)


def random_paths(valid: list[int], T: int, gen: torch.Generator, parent: list[int] | None = None
                 ) -> dict[int, list[int]]:
    """What each row b in `valid` keeps of a round of `T` tokens, drawn from `gen`: a chain its first 1..T tokens,
    a tree (`parent`) the root path of one of its T nodes."""
    if parent is not None:
        return {b: root_path(parent, int(torch.randint(0, T, (), generator=gen))) for b in valid}
    return {b: list(range(int(torch.randint(1, T + 1, (), generator=gen)))) for b in valid}


def first_record(strat, slot: int = 1) -> tuple[int, int]:
    """(ring row, position) of the open round's first record of request `slot` (its first running row in the
    eager layout: the teeth tests run one request), where a corrupted record must show in the committed state."""
    if strat.rings.layout == "lazy":
        return slot, int(strat.rings.start[slot] + strat.rings.pending[slot]) % strat.cfg.ring_len
    return 0, 0


class Harness:
    """Same slots in every strategy; an independent plain-decode oracle per slot.

    The strategies (pools, rings) live on `device` (the Triton kernels' device, see conftest's `triton_device`);
    inputs, weights and the oracle stay on CPU, and `verify` moves what the strategies read onto `device`."""

    def __init__(self, cfg: StateConfig, *, seed: int = 0, strategies=tuple(STRATEGIES),
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.gen = torch.Generator().manual_seed(seed)
        self.strats = {n: make_strategy(cfg, STRATEGIES[n][0], commit=STRATEGIES[n][1], device=self.device)
                       for n in strategies}
        self.slots = None
        for st in self.strats.values():
            self.slots = st.pool.alloc(cfg.max_requests)
        c, dt = cfg, cfg.ssm_dtype
        self.weights = [self.randn(c.conv_dim, c.conv_kernel, dtype=torch.float64).to(c.act_dtype)
                        for _ in range(c.num_layers)]
        # Random starting states (a prefill), identical in every strategy and the oracle.
        self.conv = self.randn(c.num_layers, c.num_slots, c.conv_dim, c.conv_kernel - 1).to(c.act_dtype)
        self.ssm = (0.5 * self.randn(c.num_layers, c.num_slots, c.num_heads, c.head_k_dim, c.head_v_dim)).to(dt)
        for st in self.strats.values():
            for s in self.slots:
                st.pool.load(s, conv=self.conv[:, s].to(self.device), ssm=self.ssm[:, s].to(self.device))
        self.conv, self.ssm = self.conv.clone(), self.ssm.clone()
        if c.gate_in_kernel:  # Kimi's gate parameters per layer: decays exp(A_log) * softplus(f + dt_bias)
            self.A_log = (0.5 * self.randn(c.num_layers, c.num_heads) - 1.0).float()
            self.dt_bias = self.randn(c.num_layers, c.num_heads, c.head_k_dim).float()
            for st in self.strats.values():
                for layer in range(c.num_layers):
                    st.set_gate(layer, self.A_log[layer].to(self.device), self.dt_bias[layer].to(self.device))

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """`t` where the strategies read it."""
        return t.to(self.device)

    def randn(self, *shape, dtype=torch.float64):
        return torch.randn(*shape, generator=self.gen, dtype=torch.float64).to(dtype)

    def inputs(self, B: int, T: int) -> dict[str, torch.Tensor]:
        """Random activations; q/k/v/x in act dtype, g/beta in the record dtype (`gate_in_kernel`: g is the gate's
        input f, in act dtype, spanning softplus's curved part and both signs)."""
        c, act, rec = self.cfg, self.cfg.act_dtype, self.cfg.record_dtype
        g_shape = (B, T, c.num_heads, c.head_k_dim) if c.gate == "kda" else (B, T, c.num_heads)
        if c.gate_in_kernel:
            g = (2.0 * self.randn(c.num_layers, *g_shape) - 1.0).to(act)
        else:
            g = (-0.5 * torch.rand(c.num_layers, *g_shape, generator=self.gen, dtype=torch.float64)).to(rec)
        return dict(
            x=self.randn(c.num_layers, B, T, c.conv_dim).to(act),
            q=self.randn(c.num_layers, B, T, c.num_heads, c.head_k_dim).to(act),
            k=self.randn(c.num_layers, B, T, c.num_heads, c.head_k_dim).to(act),
            v=self.randn(c.num_layers, B, T, c.num_heads, c.head_v_dim).to(act),
            g=g,
            beta=torch.rand(c.num_layers, B, T, c.num_heads, generator=self.gen, dtype=torch.float64).to(rec),
        )

    def verify(self, name: str, slots: list[int], inp: dict, parent=None, corrupt=None):
        """One verify pass over all layers; -> (conv outputs, mix outputs) per layer."""
        st = self.strats[name]
        T = inp["x"].shape[2]
        st.begin(slots, num_tokens=None if parent is not None else T, parent=parent)
        ys, os = [], []
        dev = self.on_device
        for layer in range(self.cfg.num_layers):
            ys.append(st.conv(layer, dev(inp["x"][layer]), dev(self.weights[layer])))
            os.append(st.mix(layer, *(dev(inp[n][layer]) for n in ("q", "k", "v", "g", "beta"))))
        if corrupt is not None:
            corrupt(st)
        return ys, os

    def commit(self, name: str, paths: dict[int, list[int]], B: int, tree: bool, width: int | None = None) -> None:
        """Commit the open round of strategy `name`: row b keeps `paths[b]` (a tree: node indices from the root, sent
        as a -1 padded `[B, width]` matrix, width by default the longest path; a chain: its first len(paths[b])
        tokens); a row without a path keeps nothing."""
        st = self.strats[name]
        if tree:
            width = max((len(p) for p in paths.values()), default=1) if width is None else width
            path = torch.full((B, width), -1, dtype=torch.long)
            for b, p in paths.items():
                path[b, :len(p)] = torch.tensor(p)
            st.commit(path=path)
        else:
            st.commit(torch.tensor([len(paths[b]) if b in paths else 0 for b in range(B)]))

    def round(self, slots: list[int], inp: dict, paths: dict[int, list[int]], parent=None,
              width: int | None = None) -> None:
        """One round in every strategy, verify of `inp` on `slots` then commit of `paths` (a tree with `parent`),
        and the oracle's plain decode of each row's path (its state moves on)."""
        for name in self.strats:
            self.verify(name, slots, inp, parent=parent)
            self.commit(name, paths, len(slots), parent is not None, width=width)
        for b, path in paths.items():
            self.oracle(slots[b], b, inp, path, advance=True)

    def states(self, slots: list[int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each strategy's committed (conv, ssm) of `slots`, on CPU."""
        return {n: (st.pool.conv[:, slots].cpu(), st.committed_ssm()[:, slots].cpu()) for n, st in self.strats.items()}

    def oracle(self, slot: int, b: int, inp: dict, path: list[int], *, advance: bool):
        """Plain decode of the tokens `path` of row b from the oracle state of `slot`.
        -> per layer (y [n, C], o [n, H, V]); with `advance`, the oracle state moves on."""
        out = []
        for layer in range(self.cfg.num_layers):
            sel = {n: t[layer, b, path][None] for n, t in inp.items()}
            if self.cfg.gate_in_kernel:
                sel["g"] = kda_gate(sel["g"], self.A_log[layer], self.dt_bias[layer])
            y, win = short_conv(sel["x"], self.weights[layer], conv_state=self.conv[layer, slot][None])
            o, S = recurrent_delta_rule(sel["q"], sel["k"], sel["v"], sel["g"], sel["beta"],
                                        initial_state=self.ssm[layer, slot][None], scale=self.cfg.scale,
                                        eps=self.cfg.norm_eps, norm=self.cfg.norm)
            if advance:
                self.conv[layer, slot], self.ssm[layer, slot] = win[0], S[0].to(self.ssm.dtype)
            out.append((y[0], o[0]))
        return out

    def check_state(self, name: str, slots: list[int]) -> None:
        """Committed conv (bitwise) and ssm of `slots` equal the oracle's: replay's exact fold within `rel_tol`,
        the snapshot's node states within `check_verify_value`'s tolerance."""
        st = self.strats[name]
        ssm, conv = st.committed_ssm().cpu(), st.pool.conv.cpu()
        for s in slots:
            assert torch.equal(conv[:, s], self.conv[:, s]), f"{name}: conv of slot {s} differs"
            if name == "snapshot":  # it commits the verify's node states
                check_verify_value(ssm[:, s], self.ssm[:, s], self.cfg.ssm_dtype, f"{name}: ssm of slot {s}")
                continue
            err = max_rel_err(ssm[:, s], self.ssm[:, s])
            assert err <= rel_tol(self.cfg.ssm_dtype), f"{name}: ssm of slot {s} rel err {err:.3e}"
