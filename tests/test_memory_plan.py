"""Memory plan: buffer shapes, byte counts, the published SGLang allocation logs (`--layout sglang`), the lean
layouts' speculative state against the full-snapshot scheme, and the strategies' actual allocations."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.__main__ import main
from specdec.replayssm import make_strategy
from specdec.replayssm.config import StateConfig
from specdec.replayssm.plan import (BufferSpec, buffer_specs, format_plan, plan_json, pool_specs, spec_bytes,
                                    strategy_specs, with_tokens)
from specdec.replayssm.pool import SlotPool

GIB = 2 ** 30
BASE = ["memory", "--layers", "69", "--heads", "96", "--tp", "8", "--head-dim", "128", "--draft-tokens", "8",
        "--running", "23"]
SGLANG = ["--layout", "sglang"]
RINGS = ["ring_d", "ring_k", "ring_g", "ring_rawv", "ring_rawk", "ring_beta"]
KEYS = ["conv_state", "ssm_state", "intermediate_conv_window", *RINGS, "ring_total", "snapshot_intermediate_ssm"]


def run_main(capsys, *args):
    code = main([*BASE, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_published_log_120_slots_bf16_subprocess():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "specdec", *BASE, "--slots", "120", "--ssm-dtype", "bfloat16",
                           *SGLANG],
                          capture_output=True, text=True, cwd=root, env={**os.environ}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "d=0.379GB k=0.379GB g=0.758GB rawv=0.379GB rawk=0.379GB beta=0.006GB" in out
    assert "ssm_state size: 3.03GB" in out
    assert "conv_state size: 0.21GB" in out
    assert "intermediate_conv_window size: 0.34GB" in out
    # one line per buffer with its shape and dtype
    assert "ring_d" in out and "[69, 120, 12, 16, 128]" in out
    assert "ssm_state" in out and "[69, 120, 12, 128, 128]" in out
    assert "[69, 24, 8, 4608, 3]" in out and "[69, 24, 8, 12, 128, 128]" in out
    assert "ratio" in out


def test_published_log_52_slots_fp32(capsys):
    code, out, _ = run_main(capsys, "--slots", "52", "--ssm-dtype", "float32", *SGLANG)
    assert code == 0
    assert "ssm_state size: 2.63GB" in out
    assert "d=0.164GB k=0.164GB g=0.328GB rawv=0.164GB rawk=0.164GB beta=0.003GB" in out


def test_published_log_81_slots_bf16(capsys):
    code, out, _ = run_main(capsys, "--slots", "81", "--ssm-dtype", "bfloat16", *SGLANG)
    assert code == 0
    assert "ssm_state size: 2.05GB" in out
    assert "d=0.256GB " in out and "g=0.512GB " in out and "beta=0.004GB" in out


@pytest.mark.parametrize("slots,ssm_bytes", [(120, 2), (52, 4), (81, 2)])
def test_json_byte_counts(capsys, slots, ssm_bytes):
    ssm_dtype = {2: "bfloat16", 4: "float32"}[ssm_bytes]
    code, out, _ = run_main(capsys, "--slots", str(slots), "--ssm-dtype", ssm_dtype, "--json", *SGLANG)
    assert code == 0
    plan = json.loads(out)
    for key in KEYS:
        assert isinstance(plan[key], int), key
    # L=69 layers, S=slots, H=96/8=12 heads, K=V=128, ring L=16, D=8, 23+1 rows, conv C=12*(128+128+128)
    expected = {
        "conv_state": 69 * slots * 4608 * 3 * 2,
        "ssm_state": 69 * slots * 12 * 128 * 128 * ssm_bytes,
        "intermediate_conv_window": 69 * 24 * 8 * 4608 * 3 * 2,
        "ring_d": 69 * slots * 12 * 16 * 128 * 2,
        "ring_k": 69 * slots * 12 * 16 * 128 * 2,
        "ring_g": 69 * slots * 12 * 16 * 128 * 4,
        "ring_rawv": 69 * slots * 12 * 16 * 128 * 2,
        "ring_rawk": 69 * slots * 12 * 16 * 128 * 2,
        "ring_beta": 69 * slots * 12 * 16 * 4,
        "snapshot_intermediate_ssm": 69 * 24 * 8 * 12 * 128 * 128 * ssm_bytes,
    }
    expected["ring_total"] = sum(expected[k] for k in RINGS)
    for key, value in expected.items():
        assert plan[key] == value, key
    snap = expected["snapshot_intermediate_ssm"] + expected["intermediate_conv_window"]
    replay = expected["ring_total"] + expected["intermediate_conv_window"]
    assert plan["ratio"] == pytest.approx(snap / replay)
    if slots == 120:
        assert f"{expected['ring_d'] / GIB:.3f}" == "0.379"
        assert f"{expected['ssm_state'] / GIB:.2f}" == "3.03"


def test_gdn_gate_and_running_default(capsys):
    code, out, _ = run_main(capsys, "--slots", "30", "--gate", "gdn", "--json", *SGLANG)
    assert code == 0
    plan = json.loads(out)
    assert plan["ring_g"] == 69 * 30 * 12 * 16 * 1 * 4  # one log-decay per head
    assert plan["ring_k"] == 69 * 30 * 12 * 16 * 128 * 2
    code = main(["memory", "--layers", "2", "--slots", "5", "--heads", "4", "--head-dim", "8", "--json", *SGLANG])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert plan["config"]["max_running"] == 4  # default running = slots - 1
    assert plan["intermediate_conv_window"] == 2 * 5 * 8 * (4 * 24) * 3 * 2
    assert plan["snapshot_intermediate_ssm"] == 2 * 5 * 8 * 4 * 8 * 8 * 4  # float32 ssm by default


@pytest.mark.parametrize("draft,ring_len", [(8, 16), (9, 32), (1, 2), (4, 8)])
def test_default_ring_len(capsys, draft, ring_len):
    code = main(["memory", "--layers", "1", "--slots", "2", "--heads", "1", "--head-dim", "4",
                 "--draft-tokens", str(draft), "--json", *SGLANG])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    assert plan["config"]["ring_len"] == ring_len
    assert plan["ring_d"] == 1 * 2 * 1 * ring_len * 4 * 2


@pytest.mark.parametrize("args,flag", [
    (["--ring-len", "24"], "--ring-len"),    # not a power of two
    (["--ring-len", "8"], "--ring-len"),     # L < 2D with D = 8
    (["--draft-tokens", "0"], "--draft-tokens"),
    (["--ssm-dtype", "float8"], "--ssm-dtype"),
    (["--tp", "7"], "--tp"),                 # 96 heads not divisible by 7
    (["--gate", "mamba"], "--gate"),
    (["--slots", "10"], "--running"),        # 23 running requests do not fit 9 slots
    (["--layers", "0"], "--layers"),
    (["--layout", "slots"], "--layout"),
    (["--gate", "gdn", "--gate-record", "input"], "--gate-record"),  # the gate's input is KDA's
])
def test_bad_arguments(capsys, args, flag):
    code = main([*BASE, "--slots", "120", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert flag in lines[0] and "error" in lines[0]
    assert "Traceback" not in err


def test_bad_argument_subprocess():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "specdec", *BASE, "--slots", "120", "--ring-len", "12"],
                          capture_output=True, text=True, cwd=root, timeout=120)
    assert proc.returncode == 2
    assert "--ring-len" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_buffer_specs_contract():
    cfg = StateConfig(num_layers=3, num_heads=2, head_k_dim=8, head_v_dim=16, conv_kernel=4, max_requests=5,
                      max_running=3, num_verify_tokens=4, ring_len=8, ssm_dtype="bfloat16", act_dtype="bfloat16")
    c = 2 * (8 + 8 + 16)
    common = {"conv_state", "ssm_state", "intermediate_conv_window", "snapshot_intermediate_ssm", "tree_state_stack",
              "step_ssm", "step_conv_window"}
    sglang = buffer_specs(cfg, layout="sglang")
    assert set(sglang) == common | set(RINGS)
    assert set(buffer_specs(cfg, layout="lazy")) == common | set(RINGS) | {"conv_inputs"}
    eager = buffer_specs(cfg)  # the default layout: eager commit's
    assert set(eager) == common | {"ring_g", "ring_rawv", "ring_rawk", "ring_beta", "conv_inputs"}
    for specs in (sglang, eager):
        assert specs["conv_state"].shape == (3, 6, c, 3)
        assert specs["ssm_state"].shape == (3, 6, 2, 8, 16)
        assert specs["intermediate_conv_window"].shape == (3, 4, 4, c, 3)
        assert specs["snapshot_intermediate_ssm"].shape == (3, 4, 4, 2, 8, 16)
        # one layer's stack of parent states (floor(log2(4 + 1)) - 1 = 1 slot), fp32 even with a bf16 checkpoint
        assert specs["tree_state_stack"].shape == (4, 1, 2, 8, 16)
        assert specs["tree_state_stack"].dtype == torch.float32
        # one token's state and conv window per running row (the reference backend's one-token rounds)
        assert specs["step_ssm"].shape == (3, 4, 1, 2, 8, 16) and specs["step_ssm"].dtype == torch.bfloat16
        assert specs["step_conv_window"].shape == (3, 4, 1, c, 3)
    # per slot, depth L: SGLang's layout (and lazy commit's)
    assert sglang["ring_d"].shape == (3, 6, 2, 8, 16)
    assert sglang["ring_k"].shape == (3, 6, 2, 8, 8)
    assert sglang["ring_g"].shape == (3, 6, 2, 8, 8) and sglang["ring_g"].dtype == torch.float32
    assert sglang["ring_rawv"].shape == (3, 6, 2, 8, 16)
    assert sglang["ring_rawk"].shape == (3, 6, 2, 8, 8)
    assert sglang["ring_beta"].shape == (3, 6, 2, 8) and sglang["ring_beta"].dtype == torch.float32
    # eager: running rows (3 + 1), depth D = 4, the fold's records only; conv inputs, one column per token
    assert eager["ring_g"].shape == (3, 4, 2, 4, 8) and eager["ring_g"].dtype == torch.float32
    assert eager["ring_rawv"].shape == (3, 4, 2, 4, 16) and eager["ring_rawv"].dtype == torch.bfloat16
    assert eager["ring_rawk"].shape == (3, 4, 2, 4, 8)
    assert eager["ring_beta"].shape == (3, 4, 2, 4)
    assert eager["conv_inputs"].shape == (3, 4, 4, c) and eager["conv_inputs"].dtype == torch.bfloat16
    for spec in [*sglang.values(), *eager.values()]:
        # nbytes agrees with an actual allocation of that shape and dtype
        assert spec.nbytes == torch.empty(spec.shape, dtype=spec.dtype, device="meta").numel() * \
            torch.empty((), dtype=spec.dtype).element_size()
        assert spec.gib == spec.nbytes / GIB
    assert BufferSpec("x", (3, 5), torch.float32).nbytes == 60
    gdn = buffer_specs(StateConfig.tiny(gate="gdn"))
    assert gdn["ring_g"].shape[-1] == 1
    for layout in ("eager", "lazy", "sglang"):
        plan = plan_json(cfg, layout=layout)
        rings = [k for k in RINGS if k in plan]
        assert plan["ring_total"] == sum(plan[k] for k in rings)
        text = format_plan(cfg, layout=layout)
        assert all(name in text for name in buffer_specs(cfg, layout=layout)) and f"layout: {layout}" in text
        # the torch backend's one-token buffers say so: a GPU (Triton) plan never allocates them
        assert all("(torch backend only: one-token rounds)" in line for line in text.splitlines()
                   if line.startswith("step_"))
    with pytest.raises(ValueError, match="layout: expected one of eager, lazy, sglang"):
        buffer_specs(cfg, layout="slots")


def test_tree_report_kimi_linear_shapes():
    """Tree verify at T=64 on Kimi-Linear shapes (20 KDA layers, 32 heads, K=V=128, 64 requests): the
    ReplaySSM spec state (rings, conv records or windows, one layer's stack of parent states) vs an all-layer
    snapshot."""
    cfg = StateConfig(num_layers=20, num_heads=32, head_k_dim=128, head_v_dim=128, max_requests=64,
                      num_verify_tokens=64, act_dtype="bfloat16")
    rows, T, H, K, C = 65, 64, 32, 128, 32 * 3 * 128
    snapshot = 20 * rows * T * H * K * K * 4 + 20 * rows * T * C * 3 * 2
    nodes = rows * 5 * H * K * K * 4  # a 64-node tree keeps at most 5 parent states (floor(log2 65) - 1)
    sglang_rings = 20 * 65 * H * 128 * (4 * K * 2 + K * 4 + 4)  # d k rawv rawk bf16, g fp32 [K], beta fp32
    eager_rings = 20 * rows * H * T * (2 * K * 2 + K * 4 + 4)  # rawv rawk bf16, g fp32 [K], beta fp32
    for layout, replay in (("sglang", sglang_rings + 20 * rows * T * C * 3 * 2),
                           ("lazy", sglang_rings + 20 * rows * T * C * 2),
                           ("eager", eager_rings + 20 * rows * T * C * 2)):
        plan = plan_json(cfg, layout=layout)
        assert plan["spec_state_snapshot"] == snapshot
        assert plan["spec_state_replay_tree"] == replay + nodes, layout
        assert abs(plan["ratio_tree"] - snapshot / (replay + nodes)) < 1e-12
        assert plan["spec_bytes"]["tree_64"] == {"snapshot": snapshot, "replayssm": replay + nodes}
        assert "tree T=64" in format_plan(cfg, layout=layout)


def test_published_settings_lean_layout(capsys):
    """The published SGLang settings (69 layers, 120 slots, 23 running, D = 8, bf16): the eager layout's
    speculative state against the full-snapshot scheme, for the chain and trees of 8, 16 and 64 nodes, every
    byte counted from the shapes (rows = 23 + 1, H = 12, K = V = 128, C = 12 * 384, Kc - 1 = 3)."""
    code, out, _ = run_main(capsys, "--slots", "120", "--ssm-dtype", "bfloat16", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["layout"] == "eager"
    rows, H, K, C, W = 24, 12, 128, 12 * 384, 3

    def schemes(T):
        snapshot = 69 * rows * T * (H * K * K * 2 + C * W * 2)  # bf16 states + bf16 conv windows
        # rawv rawk bf16, g = the KDA gate's input bf16 (the kernels compute the gate), beta fp32; conv inputs
        records = 69 * rows * T * (H * (3 * K * 2 + 4) + C * 2)
        return snapshot, records

    snap, rec = schemes(8)
    assert plan["spec_bytes"]["chain"] == {"snapshot": snap, "replayssm": rec}
    for T in (8, 16, 64):
        snap, rec = schemes(T)
        nodes = rows * {8: 2, 16: 3, 64: 5}[T] * H * K * K * 4  # one layer's fp32 stack: floor(log2(T + 1)) - 1
        assert plan["spec_bytes"][f"tree_{T}"] == {"snapshot": snap, "replayssm": rec + nodes}
    chain, tree64 = plan["spec_bytes"]["chain"], plan["spec_bytes"]["tree_64"]
    assert chain["snapshot"] / chain["replayssm"] >= 15
    assert tree64["snapshot"] / tree64["replayssm"] >= 20
    assert plan["dtypes"]["ring_g"] == "bfloat16"
    # with fp32 log-decay records instead (--gate-record g): every other buffer the same, g twice the bytes
    code, out, _ = run_main(capsys, "--slots", "120", "--ssm-dtype", "bfloat16", "--json", "--gate-record", "g")
    g32 = json.loads(out)
    assert g32["dtypes"]["ring_g"] == "float32" and g32["ring_g"] == 2 * plan["ring_g"]
    assert g32["spec_bytes"]["chain"]["replayssm"] - chain["replayssm"] == plan["ring_g"]
    code, text, _ = run_main(capsys, "--slots", "120", "--ssm-dtype", "bfloat16")
    assert "layout: eager [layer, running row, H, D, dim]" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("chain D=8"))
    assert line.split()[2:] == ["full", "snapshot", f"{chain['snapshot'] / GIB:.2f}GB", "vs", "ReplaySSM",
                                f"{chain['replayssm'] / GIB:.2f}GB,", "ratio",
                                f"{chain['snapshot'] / chain['replayssm']:.2f}x"]
    # SGLang's layout on the same settings: the 1.98x of its own log
    code, out, _ = run_main(capsys, "--slots", "120", "--ssm-dtype", "bfloat16", "--json", *SGLANG)
    sg = json.loads(out)["spec_bytes"]["chain"]
    assert f"{sg['snapshot'] / sg['replayssm']:.2f}" == "1.98"


def allocated_bytes(obj, seen: set) -> int:
    """Bytes of the floating-point tensors `obj` holds (attributes, tuples, nested rings), each storage once."""
    total = 0
    values = obj if isinstance(obj, (tuple, list)) else vars(obj).values()
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.untyped_storage().nbytes()
        elif isinstance(v, (tuple, list)) or type(v).__name__ == "RingBuffers":
            total += allocated_bytes(v, seen)
    return total


@pytest.mark.parametrize("gate_in_kernel", [False, True], ids=["g-records", "gate-input-records"])
@pytest.mark.parametrize("strategy,commit", [pytest.param("replay", "eager", marks=pytest.mark.triton),
                                             pytest.param("replay", "lazy", marks=pytest.mark.triton),
                                             ("snapshot", "eager")])
def test_allocation_equals_plan(strategy, commit, gate_in_kernel, monkeypatch, request):
    """What a strategy actually allocates equals the plan of its layout: the pool (conv_state + ssm_state), and
    the speculative state (rings + conv inputs; + one layer's tree state stack once a tree ran; snapshot: states and
    conv windows per token); with `gate_in_kernel` also the gate parameters (weights, outside the spec state)."""
    cfg = StateConfig(num_layers=2, num_heads=3, head_k_dim=5, head_v_dim=7, conv_kernel=4, max_requests=6,
                      max_running=3, num_verify_tokens=5, ssm_dtype="bfloat16", act_dtype="bfloat16",
                      track_interval=None, gate_in_kernel=gate_in_kernel)
    # replay runs a tree round on the Triton kernels below: its state lives where they run
    dev = request.getfixturevalue("triton_device") if strategy == "replay" else "cpu"
    st = make_strategy(cfg, strategy, commit=commit, device=dev)
    specs = buffer_specs(cfg, layout=commit)
    assert allocated_bytes(st.pool, set()) == specs["conv_state"].nbytes + specs["ssm_state"].nbytes
    seen = {t.untyped_storage().data_ptr() for t in (st.pool.conv, st.pool.ssm)}
    if gate_in_kernel:
        assert specs["ring_g"].dtype == torch.bfloat16
        assert allocated_bytes((st.gate_A_log, st.gate_dt_bias), set()) == (specs["gate_A_log"].nbytes
                                                                           + specs["gate_dt_bias"].nbytes)
        seen |= {t.untyped_storage().data_ptr() for t in (st.gate_A_log, st.gate_dt_bias)}
        for layer in range(cfg.num_layers):
            st.set_gate(layer, -torch.rand(3).to(dev), torch.randn(15).to(dev))
    plan = spec_bytes(cfg, layout=commit)
    assert allocated_bytes(st, seen) == plan["snapshot" if strategy == "snapshot" else "replayssm"]
    if strategy == "replay":  # a tree round allocates one layer's state stack, once
        monkeypatch.setenv("SPECDEC_FORCE_TRITON", "1")  # the plan is the GPU's: the Triton tree kernel's buffer
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(dev)  # noqa: E731
        slots = st.pool.alloc(2)
        st.begin(slots, parent=[-1, 0, 0, 1, 1])
        seen = {t.untyped_storage().data_ptr() for t in (st.pool.conv, st.pool.ssm)}
        if gate_in_kernel:
            seen |= {t.untyped_storage().data_ptr() for t in (st.gate_A_log, st.gate_dt_bias)}
        for layer in range(cfg.num_layers):
            st.conv(layer, r(2, 5, cfg.conv_dim), r(cfg.conv_dim, 4))
            st.mix(layer, r(2, 5, 3, 5), r(2, 5, 3, 5), r(2, 5, 3, 7), -torch.rand(2, 5, 3, 5, generator=g).to(dev),
                   torch.rand(2, 5, 3, generator=g).to(dev))
        st.commit(path=[[0, 1, 3], [0, 2, -1]])
        assert allocated_bytes(st, seen) == spec_bytes(cfg, layout=commit, tree=True)["replayssm"]
    if strategy == "replay" and commit == "eager":  # the reference backend: a one-token round keeps its state
        monkeypatch.delenv("SPECDEC_FORCE_TRITON", raising=False)
        st = make_strategy(cfg, strategy, commit=commit)
        r = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
        seen = {t.untyped_storage().data_ptr() for t in (st.pool.conv, st.pool.ssm)}
        if gate_in_kernel:
            seen |= {t.untyped_storage().data_ptr() for t in (st.gate_A_log, st.gate_dt_bias)}
            for layer in range(cfg.num_layers):
                st.set_gate(layer, -torch.rand(3), torch.randn(15))
        slots = st.pool.alloc(2)
        for _ in range(2):  # allocated once
            st.begin(slots, num_tokens=1)
            for layer in range(cfg.num_layers):
                st.conv(layer, r(2, 1, cfg.conv_dim), r(cfg.conv_dim, 4))
                st.mix(layer, r(2, 1, 3, 5), r(2, 1, 3, 5), r(2, 1, 3, 7), -torch.rand(2, 1, 3, 5, generator=g),
                       torch.rand(2, 1, 3, generator=g))
            st.commit(torch.tensor([1, 1]))
        assert allocated_bytes(st, seen) == plan["replayssm"] + specs["step_ssm"].nbytes + \
            specs["step_conv_window"].nbytes
    # a tree of T nodes is the plan of T verify tokens
    assert spec_bytes(with_tokens(cfg, 16), layout=commit, tree=True)["replayssm"] > plan["replayssm"]


def test_pool_specs_with_track_states():
    """The pool's plan (with a track interval: the ping-pong copies of every slot's state) is its allocation."""
    cfg = StateConfig(num_layers=2, num_heads=3, head_k_dim=5, head_v_dim=7, max_requests=4, track_interval=16,
                      ssm_dtype="float32", act_dtype="bfloat16")
    pool, specs = SlotPool(cfg), pool_specs(cfg)
    assert list(specs) == ["conv_state", "ssm_state", "track_ssm", "track_conv"]
    assert specs["track_ssm"].shape == (2, 5, 2, 3, 5, 7) and specs["track_conv"].shape == (2, 5, 2, cfg.conv_dim, 3)
    for name, t in (("conv_state", pool.conv), ("ssm_state", pool.ssm), ("track_ssm", pool.track_ssm),
                    ("track_conv", pool.track_conv)):
        assert (tuple(t.shape), t.dtype) == (specs[name].shape, specs[name].dtype), name
    assert allocated_bytes(pool, set()) == sum(s.nbytes for s in specs.values())
    assert list(pool_specs(StateConfig.tiny(track_interval=None))) == ["conv_state", "ssm_state"]


def test_strategy_specs_buffers():
    """Which buffers each strategy holds: the pool, then snapshot's per-token states, or ReplaySSM's rings and conv
    inputs with a one-token round's buffers (reference backend, eager) or one layer's tree stack (Triton)."""
    cfg = StateConfig.tiny(track_interval=None)
    pool = {"conv_state", "ssm_state"}
    fold = {"ring_g", "ring_rawv", "ring_rawk", "ring_beta", "conv_inputs"}
    assert set(strategy_specs(cfg, "snapshot")) == pool | {"snapshot_intermediate_ssm", "intermediate_conv_window"}
    assert set(strategy_specs(cfg)) == pool | fold | {"step_ssm", "step_conv_window"}
    assert set(strategy_specs(cfg, triton=True)) == pool | fold | {"tree_state_stack"}
    assert set(strategy_specs(cfg, commit="lazy")) == pool | set(RINGS) | {"conv_inputs"}
    gated = StateConfig.tiny(track_interval=None, gate_in_kernel=True)
    assert set(strategy_specs(gated, commit="lazy")) == pool | set(RINGS) | {"conv_inputs", "gate_A_log",
                                                                             "gate_dt_bias"}
    specs = buffer_specs(cfg)
    assert all(spec == specs[name] for name, spec in strategy_specs(cfg).items())


def test_the_model_option_reads_the_shapes_the_engine_allocates(capsys):
    """`specdec memory --model specdec/embedded --json`: the pool's conv windows and states are those of the engine
    `wrap` builds on the loaded model (its memory plan, max_batch_size 8: 9 slots)."""
    import specdec
    from transformers import AutoModelForCausalLM
    root = Path(__file__).resolve().parents[1] / "specdec" / "embedded"
    code = main(["memory", "--model", str(root), "--act-dtype", "float32", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0
    engine = specdec.wrap(AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32), drafter=None)
    pool = engine.memory_plan.parts["state pool"]
    assert plan["conv_state"] == pool["conv_state"].nbytes and plan["ssm_state"] == pool["ssm_state"].nbytes
    assert plan["config"]["num_layers"] == len(engine.runner.linear_index)
    code = main(["memory", "--model", str(root), "--layers", "3"])
    assert code == 2 and "--layers: read from --model" in capsys.readouterr().err
