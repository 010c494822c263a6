"""The strategies on the Triton kernels (compiled on a GPU; on CPU the interpreter, `SPECDEC_FORCE_TRITON=1`),
chains and trees: the eager layout (rings by running row, conv windows rebuilt from input records inside the fold's
launch) and the lazy layout commit the same conv windows as the full-snapshot scheme, bit for bit, and the same
states within fp32 tolerance (across backends the contract is tolerance, docs/EXACTNESS.md); every committed state follows
plain decode (the torch oracle, on CPU) within that tolerance; slots outside the round are untouched."""

from __future__ import annotations

import pytest
import torch
from assertions import max_rel_err
from state_harness import Harness, random_paths

from specdec.kernels import dispatch
from specdec.replayssm import StateConfig

pytest.importorskip("triton")
pytestmark = pytest.mark.triton

FP32_REL = 1e-5  # Triton vs the torch oracle (tests/test_triton_kernels.py)


# Kimi's gate from its input records on the tree (a superset of the chain's paths: roots, reloads, lazy rebuild);
# chains with it: tests/test_gate_in_kernel.py and the fold property of tests/test_fold_exactness.py
@pytest.mark.parametrize("tree,gate_in_kernel", [(False, False), (True, False), (True, True)],
                         ids=["chain", "tree", "tree-gate-input-records"])
def test_triton_strategies_agree(monkeypatch, tree, gate_in_kernel, triton_device):
    monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")  # CPU tensors (the interpreter) take the Triton kernels too
    for op in ("verify_delta_rule", "short_conv_verify", "exact_fold", "masked_scatter"):
        assert dispatch.pick(op, torch.zeros(1, device=triton_device)) is dispatch.triton_impl(op)
    cfg = StateConfig(num_layers=2, num_heads=2, head_k_dim=5, head_v_dim=3, conv_kernel=4, max_requests=4,
                      num_verify_tokens=4, track_interval=3, norm="sqrt_div", gate_in_kernel=gate_in_kernel)
    h = Harness(cfg, seed=21, device=triton_device)
    gen = torch.Generator().manual_seed(22)
    slots = [2, cfg.null_slot, 0, -1, 3]  # max_running + 1 rows: reversed slots, a null row, a skipped row
    valid = [b for b, s in enumerate(slots) if s not in (-1, cfg.null_slot)]
    untouched = [1]
    for _ in range(3):
        B, T = len(slots), 4
        inp = h.inputs(B, T)
        parent = [-1, 0, 0, 2] if tree else None
        paths = random_paths(valid, T, gen, parent)
        before = h.states(untouched)
        h.round(slots, inp, paths, parent, width=T)
        snap = h.strats["snapshot"]
        for name, st in h.strats.items():
            ssm, conv = st.committed_ssm().cpu(), st.pool.conv.cpu()  # the oracle is on CPU
            for b in valid:
                s = slots[b]
                # conv windows are copies: records rebuilt == snapshot windows == plain decode, bit for bit
                assert torch.equal(st.pool.conv[:, s], snap.pool.conv[:, s]), f"{name}: conv of slot {s}"
                assert torch.equal(conv[:, s], h.conv[:, s]), f"{name}: conv of slot {s} vs decode"
                err = max_rel_err(ssm[:, s], h.ssm[:, s])
                assert err < FP32_REL, f"{name}: ssm of slot {s} rel err {err:.3e}"
            conv0, ssm0 = before[name]
            assert torch.equal(conv[:, untouched], conv0) and torch.equal(ssm[:, untouched], ssm0), name
            assert torch.equal(st.pool.track_conv, snap.pool.track_conv), f"{name}: track conv windows"
            assert torch.equal(st.pool.track_len, snap.pool.track_len), f"{name}: track lengths"
    assert int(snap.pool.track_len.max()) >= 3  # track boundaries were crossed
