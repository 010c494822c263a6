"""Compiled-code report: every Triton kernel and fla's `fused_recurrent_kda`, compiled for sm_90 (no GPU needed).

    python bench/sass_report.py                         # Kimi-Linear shapes, table on stdout
    python bench/sass_report.py --json sass.json        # + JSON
    python bench/sass_report.py --heads 2 --head-dim 16 --requests 2 --layers 2   # small (the CI test)
    python bench/sass_report.py --rule mamba2           # verify and fold with the Mamba2 step (GDN gates)
    python bench/sass_report.py --gate-in-kernel        # Kimi's gate computed from its bf16 input records
                                                        # (fla with use_gate_in_kernel too)

Each kernel is launched through its public wrapper exactly as the package launches it, with the launch
intercepted: triton specializes the arguments (dtypes, 16-byte alignment, strides divisible by 16) as it
would on the GPU and compiles for `GPUTarget("cuda", 90, 32)` with its bundled ptxas; nvdisasm gives the
SASS. Per kernel: registers, spill bytes, shared memory, CTAs per SM (H100/H200 limits), grid, and the
per-token loop (per record for fold and rebuild): the body of the outermost backward branch, its
instruction count and op mix. Bytes are what the op has to move at least; `ideal_us` is that at 4.3 TB/s.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real, even when called from the test suite's environment

import torch  # noqa: E402

HBM_BYTES_PER_S = 4.3e12  # H200 (H100 SXM: 3.35e12)
SM90 = dict(regs=65536, max_warps=64, max_ctas=32, smem=228 * 1024, reg_unit=256)
KIMI = dict(heads=32, head_dim=128, draft_tokens=8, requests=64, layers=20, conv_kernel=4)
FP32 = {"FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FCHK"}
FP64 = {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DRSQ", "DSEL"}


class _CompileOnlyDriver:
    """Stands in for the CUDA driver: a device 0 with an sm_90 target and no stream, so `JITFunction.run`
    specializes and compiles without a GPU."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def jit_functions(kernels) -> list:
    """`kernels` as triton JIT functions: each item one already, or a module standing for every JIT function it
    defines (what its public wrappers launch; the helpers it imports are left out)."""
    from triton.runtime import JITFunction

    out = []
    for k in kernels:
        if isinstance(k, types.ModuleType):
            out += [v for v in vars(k).values() if isinstance(v, JITFunction) and v.__module__ == k.__name__]
        else:
            out.append(k)
    return out


def capture(kernels, call):
    """Run `call()` with the launches of `kernels` (triton JIT functions, or modules: see `jit_functions`)
    compiled, not run.

    Returns `[(jit_fn, CompiledKernel, grid)]` in launch order.
    """
    from triton.runtime import driver

    seen, saved = [], {}
    for fn in jit_functions(kernels):
        orig = fn.run

        def run(*args, grid, warmup=False, _fn=fn, _orig=orig, **kw):
            kernel = _orig(*args, grid=grid, warmup=True, **kw)
            seen.append((_fn, kernel, tuple(grid(kw) if callable(grid) else grid)))
            return kernel

        saved[fn] = orig
        fn.run = run
    driver.set_active(_CompileOnlyDriver())
    try:
        call()
    finally:
        driver.reset_active() if driver._default is not None else setattr(driver, "_active", None)
        for fn, orig in saved.items():
            fn.run = orig
    return seen


def _opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # predicate
    return ins.split()[0] if ins else ""


def loop_body(code: list[tuple[int, str]]) -> list[str]:
    """Instructions of the outermost loop: the span of the backward branch that covers the most code
    (the per-token loop; per record for fold and rebuild). No loop: the whole kernel."""
    addr = {a: i for i, (a, _) in enumerate(code)}
    label_addr = {}
    best = None
    for i, (a, ins) in enumerate(code):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+|0x[0-9a-f]+)", ins)
        if not m:
            continue
        tgt = m.group(1)
        ta = int(tgt, 16) if tgt.startswith("0x") else label_addr.get(tgt)
        if ta is None or ta >= a:  # forward branches, and the `BRA self` that ends every kernel
            continue
        span = (addr.get(ta, 0), i)
        if best is None or span[1] - span[0] > best[1] - best[0]:
            best = span
    if best is None:
        return [ins for _, ins in code if _opcode(ins) not in ("NOP", "EXIT", "BRA")]
    return [ins for _, ins in code[best[0]:best[1] + 1]]


def op_mix(body: list[str]) -> dict[str, int]:
    c = collections.Counter()
    for ins in body:
        op = _opcode(ins)
        base = op.split(".")[0]
        c["instructions"] += 1
        if base in FP32:
            c["fp32"] += 1
        if base in FP64 or (base in ("MUFU",) and ".64" in op):
            c["fp64"] += 1
        if base == "F2F" and ".F64" in op:
            c["f64_conversions"] += 1
        if base == "SHFL":
            c["shuffles"] += 1
        if base in ("BAR", "MEMBAR"):
            c["barriers"] += 1
        if base in ("CALL", "RET"):
            c["calls"] += 1 if base == "CALL" else 0
        if base == "MUFU":
            c["mufu"] += 1
        if base in ("LDG", "LDS", "LD"):
            c["loads"] += 1
        if base in ("STG", "STS", "ST"):
            c["stores"] += 1
    return c


def occupancy(regs: int, smem: int, warps: int) -> int:
    per_warp = -(-max(regs, 1) * 32 // SM90["reg_unit"]) * SM90["reg_unit"]
    by_regs = SM90["regs"] // (per_warp * warps)
    by_smem = SM90["smem"] // smem if smem else SM90["max_ctas"]
    return int(min(by_regs, by_smem, SM90["max_ctas"], SM90["max_warps"] // warps))


def _tool(name: str, kernel) -> str:
    """stdout of triton's bundled `nvdisasm` / `cuobjdump` run on the kernel's cubin."""
    exe = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / name
    args = ["-c"] if name == "nvdisasm" else ["--dump-resource-usage"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(exe), *args, f.name], capture_output=True, text=True, check=True).stdout


def resources(kernel) -> dict[str, int]:
    """Registers, local memory (spills: the kernels keep no local arrays) and static shared memory per thread
    / CTA, as the cubin declares them."""
    text = _tool("cuobjdump", kernel)
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _sass_with_labels(kernel) -> list[tuple[int, str]]:
    """SASS with branch targets resolved to addresses (labels become `0x...` in the text)."""
    text = _tool("nvdisasm", kernel)
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            a = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = a
            pending = []
            code.append((a, m.group(2)))
    return [(a, re.sub(r"`?\(?(\.L_x_\d+)\)?", lambda mm: hex(labels.get(mm.group(1), 1 << 40)), ins))
            for a, ins in code]


def summarize(kernel, grid, nbytes: int) -> dict:
    code = _sass_with_labels(kernel)
    body = loop_body(code)
    mix = op_mix(body)
    md = kernel.metadata
    warps = md.num_warps
    res = resources(kernel)
    smem = max(md.shared, res.get("SHARED", 0))
    return dict(regs=res["REG"], spill_bytes=res.get("LOCAL", 0), smem=smem,
                ctas_per_sm=occupancy(res["REG"], smem, warps), num_warps=warps,
                grid=list(grid), total_instructions=len(code),
                loop_instructions=mix["instructions"], loop_fp32_ops=mix["fp32"], loop_fp64_ops=mix["fp64"],
                loop_f64_conversions=mix["f64_conversions"], loop_shuffles=mix["shuffles"],
                loop_barriers=mix["barriers"], loop_calls=mix["calls"], loop_mufu=mix["mufu"],
                loop_loads=mix["loads"], loop_stores=mix["stores"],
                bytes=int(nbytes), ideal_us=nbytes / HBM_BYTES_PER_S * 1e6)


# ------------------------------------------------------------------------------------------------ the cases

def empty(*shape, dtype=torch.float32):
    """A tensor the kernel never touches: allocated, not initialized (large ones are expanded views of one
    row, which keeps the strides' divisibility and costs no memory)."""
    n = 1
    for s in shape:
        n *= s
    if n * torch.tensor([], dtype=dtype).element_size() <= 1 << 30:
        return torch.empty(*shape, dtype=dtype)
    return torch.empty(1, *shape[1:], dtype=dtype).expand(*shape)


def cases(H: int, K: int, D: int, B: int, Lyr: int, Kc: int, *, act: torch.dtype = torch.bfloat16, gdn: bool = False,
          rule: str = "delta", gate_in_kernel: bool = False):
    """`[(name, kernels, call, bytes)]` (`kernels` as `capture` takes them): the package's launches at these shapes
    (activations and rings in `act`; fp32 state, gates and beta; KDA gates, or GDN's one per head), and fla's
    fused_recurrent_kda on the same tokens (KDA). `rule="mamba2"`: verify and fold run the Mamba2 step (their
    MAMBA2 flag); the other kernels do not depend on the rule. `gate_in_kernel`: the gate inputs and g records are
    Kimi's gate input in `act`, and verify, fold, rebuild and fla's kernel compute the gate (A_log, dt_bias)."""
    from specdec.kernels.fold import triton as tf
    from specdec.kernels.rebuild import triton as tr
    from specdec.kernels.scatter import triton as ts
    from specdec.kernels.verify import triton as tv

    V, N, L = K, B + 1, 1 << max(0, (2 * D - 1).bit_length())
    bf, f, i64 = act, torch.float32, torch.long
    ab = torch.tensor([], dtype=act).element_size()
    GK = 1 if gdn else K
    C = 3 * H * K  # the q, k and v convs of one layer
    q, k, v = (empty(B, D, H, K, dtype=bf) for _ in range(3))
    gk_dt = bf if gate_in_kernel else f  # the gate's input in act, or the fp32 log-decay
    gk_b = torch.tensor([], dtype=gk_dt).element_size()
    g, beta = empty(B, D, H, K, dtype=gk_dt) if not gdn else empty(B, D, H), empty(B, D, H)
    gate = dict(A_log=empty(H), dt_bias=empty(H, K)) if gate_in_kernel else {}
    gate_all = dict(A_log=empty(Lyr, H), dt_bias=empty(Lyr, H, K)) if gate_in_kernel else {}
    state = empty(N, H, K, V)
    idx = torch.arange(B)
    ring = (empty(N, H, L, V, dtype=bf), empty(N, H, L, K, dtype=bf), empty(N, H, L, GK, dtype=gk_dt),
            empty(N, H, L, V, dtype=bf), empty(N, H, L, K, dtype=bf), empty(N, H, L))
    start = torch.zeros(N, dtype=i64)
    parent = torch.tensor([-1] + [0] * (D - 1)).expand(B, D)  # a star: every node reloads its parent's state
    inter = empty(B, D, H, K, V)
    state_b = B * H * K * V * 4
    tokens_in = B * D * H * ((2 * K + V) * ab + K * gk_b + 4)
    out = B * D * H * V * ab
    ring_rec = B * D * H * ((2 * V + 2 * K) * ab + K * gk_b + 4)
    pending = B * D * H * ((V + K) * ab + K * gk_b)
    fold_rec = B * D * H * ((V + K) * ab + K * gk_b + 4)
    x, w, conv_state = empty(B, D, C, dtype=bf), empty(C, Kc, dtype=bf), empty(N, C, Kc - 1, dtype=bf)
    win = empty(B, D, C, Kc - 1, dtype=bf)
    res = [
        ("verify_chain", [tv],
         lambda: tv.verify_delta_rule(q, k, v, g, beta, state, idx, ring=ring, ring_start=start, rule=rule, **gate),
         tokens_in + state_b + out + ring_rec),
        ("verify_tree", [tv],
         lambda: tv.verify_delta_rule(q, k, v, g, beta, state, idx, parent=parent, intermediate_states=inter,
                                      ring=ring, ring_start=start, rule=rule, **gate),
         tokens_in + state_b + out + ring_rec + 2 * D * state_b),
        ("exact_fold", [tf],
         lambda: tf.exact_fold(empty(Lyr, N, H, K, V), empty(Lyr, N, H, L, V, dtype=bf),
                               empty(Lyr, N, H, L, K, dtype=bf), empty(Lyr, N, H, L, GK, dtype=gk_dt),
                               empty(Lyr, N, H, L), idx, start, torch.full((B,), D),
                               seq_lens=torch.zeros(N, dtype=i64), track_interval=256,
                               track_states=empty(Lyr, N, 2, H, K, V), rule=rule, **gate_all),
         Lyr * (2 * state_b + fold_rec)),
        ("fast_rebuild", [tr],
         lambda: tr.fast_rebuild(state, idx, ring[0], ring[1], ring[2], start, torch.full((B,), D), **gate),
         2 * state_b + pending),
        ("short_conv_verify", [tv],
         lambda: tv.short_conv_verify(x, w, None, conv_state, idx, window_states=win),
         B * D * C * ab * (2 + (Kc - 1)) + B * C * (Kc - 1) * ab + C * Kc * ab),
        ("masked_scatter", [ts],
         lambda: ts.masked_scatter(empty(Lyr, B, D, H, K, V), empty(Lyr, N, H, K, V), idx, torch.zeros(B, dtype=i64)),
         2 * Lyr * state_b),
    ]
    if gdn or rule != "delta":
        return res, None
    try:
        from fla.ops.kda import fused_recurrent as fr
    except Exception as e:  # noqa: BLE001 - report without the baseline rather than not at all
        print(f"# fla unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return res, None
    h0 = empty(B, H, K, V)
    fla = ("fla_fused_recurrent_kda", [fr.fused_recurrent_kda_fwd_kernel],
           lambda: fr.fused_recurrent_kda_fwd(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                              inplace_final_state=False, use_qk_l2norm_in_kernel=True,
                                              use_gate_in_kernel=gate_in_kernel, **gate),
           tokens_in + state_b + out + state_b)  # reads the state, writes the final state
    return res, fla


def report(H: int, K: int, D: int, B: int, Lyr: int, Kc: int, *, act: str = "bf16", gdn: bool = False,
           rule: str = "delta", gate_in_kernel: bool = False, only: set[str] | None = None) -> dict:
    """The summary of every kernel of `cases` (`only`: these names, fla's kernel among them by its name)."""
    gdn = gdn or rule == "mamba2"  # a Mamba2 head decays by one scalar
    if gate_in_kernel and gdn:
        raise ValueError("gate_in_kernel: Kimi's gate is per channel (KDA); not with --gdn or --rule mamba2")
    ours, fla = cases(H, K, D, B, Lyr, Kc, act=torch.bfloat16 if act == "bf16" else torch.float32, gdn=gdn, rule=rule,
                      gate_in_kernel=gate_in_kernel)
    gate = "gdn" if gdn else ("kda, computed from its input" if gate_in_kernel else "kda")
    result = {"shapes": dict(heads=H, head_dim=K, draft_tokens=D, requests=B, layers=Lyr, conv_kernel=Kc,
                             act_dtype=act, state_dtype="fp32", gate=gate, rule=rule),
              "kernels": {}}
    for name, fns, call, nbytes in ours:
        if only is None or name in only:
            (_, kernel, grid), = capture(fns, call)
            result["kernels"][name] = summarize(kernel, grid, nbytes)
    if fla is not None and (only is None or fla[0] in only):
        name, fns, call, nbytes = fla
        (_, kernel, grid), = capture(fns, call)
        result[name] = summarize(kernel, grid, nbytes)
    return result


COLS = [("regs", "regs"), ("spill_bytes", "spill"), ("smem", "smem"), ("ctas_per_sm", "CTA/SM"),
        ("loop_instructions", "loop ins"), ("loop_fp32_ops", "fp32"), ("loop_fp64_ops", "fp64"),
        ("loop_f64_conversions", "f2f64"), ("loop_shuffles", "shfl"), ("loop_barriers", "bar"),
        ("loop_calls", "call"), ("loop_mufu", "mufu"), ("ideal_us", "ideal us")]


def print_table(r: dict) -> None:
    s = r["shapes"]
    print(f"# sm_90 SASS, H={s['heads']} K=V={s['head_dim']} D={s['draft_tokens']} requests={s['requests']} "
          f"layers={s['layers']} {s['act_dtype']} activations, fp32 state, {s['gate']} gates, {s['rule']} rule")
    print(f"{'kernel':26s} " + " ".join(f"{h:>8s}" for _, h in COLS) + "  grid")
    rows = list(r["kernels"].items()) + ([("fla_fused_recurrent_kda", r["fla_fused_recurrent_kda"])]
                                         if "fla_fused_recurrent_kda" in r else [])
    for name, k in rows:
        vals = [f"{k[c]:8.1f}" if isinstance(k[c], float) else f"{k[c]:8d}" for c, _ in COLS]
        print(f"{name:26s} " + " ".join(vals) + f"  {k['grid']}")
    if "fla_fused_recurrent_kda" in r:
        ratio = r["kernels"]["verify_chain"]["loop_instructions"] / r["fla_fused_recurrent_kda"]["loop_instructions"]
        print(f"# verify_chain loop / fla loop: {ratio:.2f}x instructions")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=KIMI["heads"])
    p.add_argument("--head-dim", type=int, default=KIMI["head_dim"])
    p.add_argument("--draft-tokens", type=int, default=KIMI["draft_tokens"], help="verify tokens D (anchor + drafts)")
    p.add_argument("--requests", type=int, default=KIMI["requests"])
    p.add_argument("--layers", type=int, default=KIMI["layers"])
    p.add_argument("--conv-kernel", type=int, default=KIMI["conv_kernel"])
    p.add_argument("--act-dtype", choices=["bf16", "fp32"], default="bf16", help="activations and rings")
    p.add_argument("--gdn", action="store_true", help="GDN gates (one per head) instead of KDA's per channel")
    p.add_argument("--rule", choices=["delta", "mamba2"], default="delta",
                   help="the step of verify and fold (mamba2: no delta correction, no q/k norm; implies --gdn)")
    p.add_argument("--gate-in-kernel", action="store_true",
                   help="KDA: g records are the gate's input (act dtype); the kernels compute Kimi's gate, as the "
                        "package runs Kimi-Linear (and fla with use_gate_in_kernel)")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    if a.gate_in_kernel and (a.gdn or a.rule == "mamba2"):
        p.error("argument --gate-in-kernel: Kimi's gate is per channel (KDA); not with --gdn or --rule mamba2")
    r = report(a.heads, a.head_dim, a.draft_tokens, a.requests, a.layers, a.conv_kernel, act=a.act_dtype, gdn=a.gdn,
               rule=a.rule, gate_in_kernel=a.gate_in_kernel)
    print_table(r)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
