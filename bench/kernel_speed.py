"""Kernel benchmark: each Triton kernel vs its torch reference (and, on CUDA, fla's fused_recurrent_kda).

    python bench/kernel_speed.py --device cuda --json kernels.json      # Kimi-Linear shapes
    python bench/kernel_speed.py --device cpu                           # tiny shapes, references only
    TRITON_INTERPRET=1 python bench/kernel_speed.py --device cpu        # + Triton in the interpreter

For every op it reports milliseconds per call, GB/s (bytes the op has to move / time, 1 GB = 1e9 B) and
that bandwidth as a fraction of a measured device copy (`dst.copy_(src)` of a large tensor, counted as
read + write). Per-layer ops (verify, short conv, fast rebuild) are timed for one layer; exact fold and
masked scatter cover all layers in one call, as they run at commit. The short conv runs twice: keeping every
token's window (`short_conv_verify`, the snapshot scheme and replay's copy commit) and keeping every token's input
record (`short_conv_verify_records`, replay's default).

On CUDA `ms` is the device's time alone, as a round captured in a CUDA graph runs the kernels: `--graph-calls`
calls captured in one graph, each sample one replay between two events, divided by the calls (fla's kernels are
timed the same way); where a capture fails, that many eager calls queued back to back (`timing`: "graph" or
"queued"). `call ms` is one eager call between two events after a sync: the wrapper's Python checks and the
launch included, which is what an eager round pays. Bandwidth shares and the GPU check's goals use `ms`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import sync  # noqa: E402  (also: `specdec` from a bare checkout)
finally:
    sys.path.pop(0)

from specdec.kernels import dispatch  # noqa: E402

GB = 1e9
CUDA_DEFAULTS = dict(heads=32, head_dim=128, draft_tokens=8, requests=64, layers=20, prefill_tokens=1024)
CPU_DEFAULTS = dict(heads=2, head_dim=16, draft_tokens=4, requests=2, layers=2, prefill_tokens=256)
# per-token log-decays of the chunked prefill: mild ones (every chunk of 16 takes the factored decays) and
# strong ones (the pairwise decays in every chunk), U(-x, 0) per channel
PREFILL_GATES = {"chunk_prefill_mild": 1.0, "chunk_prefill_strong": 20.0}
FOLD_N = (1, 2, 4, 8)  # accepted tokens folded per request


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def timed(fn, device: str, *, warmup: int, reps: int, budget_s: float) -> float:
    """Milliseconds per call: `warmup` calls, then up to `reps` calls or `budget_s` seconds."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        done, total = 0, 0.0
        while done < reps and total < budget_s * 1e3:
            start.record()
            fn()
            end.record()
            end.synchronize()
            total += start.elapsed_time(end)
            done += 1
        return total / done
    done, t0 = 0, time.perf_counter()
    while done < reps and (time.perf_counter() - t0) < budget_s:
        fn()
        done += 1
    return (time.perf_counter() - t0) * 1e3 / done


def device_timed(fn, *, calls: int, reps: int, budget_s: float) -> tuple[float, str]:
    """Milliseconds of CUDA device time per call of `fn` (warmed up already): `calls` calls captured in one CUDA
    graph, timed as the median of up to `reps` replays between two events -> `(ms, "graph")`; where the capture
    fails (an op that cannot be captured), `calls` eager calls queued back to back between two events, so the
    host's launch work overlaps the device's -> `(ms, "queued")`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the side-stream call a capture wants first (allocator, lazy inits)
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, method = graph.replay, "graph"
    except Exception:  # noqa: BLE001 - not capturable: queue the eager calls instead
        del graph
        torch.cuda.set_stream(current)  # a capture that fails at its end leaves the capture stream current
        torch.cuda.synchronize()

        def run():
            for _ in range(calls):
                fn()
        method = "queued"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    torch.cuda.synchronize()
    samples, t0 = [], time.perf_counter()
    while len(samples) < reps and (time.perf_counter() - t0) < budget_s:
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples), method


def measure(fn, device: str, *, slow: bool, reps: int, calls: int = 10) -> tuple[float, float, str]:
    """`(ms, call_ms, timing)` of one case: `call_ms` one eager call after a warm-up (`timed`); on CUDA, for a case
    that is not `slow` (a torch reference), `ms` the device's time per call (`device_timed`), else the call's."""
    call_ms = timed(fn, device, warmup=1 if slow else 3, reps=reps, budget_s=5.0 if slow else 2.0)
    if device == "cuda" and not slow:
        ms, how = device_timed(fn, calls=calls, reps=min(reps, 10), budget_s=2.0)
        return ms, call_ms, how
    return call_ms, call_ms, "call"


def copy_bandwidth(device: str) -> float:
    """GB/s of a device copy of a large tensor (read + write counted)."""
    n = (1 << 30 if device == "cuda" else 1 << 26) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, warmup=3, reps=20, budget_s=2.0)
    return 2 * n * 4 / (ms * 1e-3) / GB


class Shapes:
    def __init__(self, a):
        self.H, self.K, self.V = a.heads, a.head_dim, a.head_dim
        self.D, self.B, self.Lyr, self.T = a.draft_tokens, a.requests, a.layers, a.prefill_tokens
        self.N = self.B + 1                      # + the null slot
        self.L = 1 << max(0, (2 * self.D - 1).bit_length())  # next_pow2(2 D)
        self.C, self.Kc = 3 * self.H * self.K, 4  # q, k, v convs of one layer
        self.act = torch.bfloat16 if a.dtype == "bf16" else torch.float32
        self.ab = torch.tensor([], dtype=self.act).element_size()


def make_inputs(s: Shapes, device: str, seed: int = 0):
    """One layer's verify inputs, the layer's pool and rings, and all-layer fold / scatter buffers."""
    torch.manual_seed(seed)
    dev = dict(device=device)
    B, D, H, K, V, N, L, Lyr = s.B, s.D, s.H, s.K, s.V, s.N, s.L, s.Lyr
    x = dict(
        q=torch.randn(B, D, H, K, **dev).to(s.act), k=torch.randn(B, D, H, K, **dev).to(s.act),
        v=torch.randn(B, D, H, V, **dev).to(s.act),
        g=(-torch.rand(B, D, H, K, **dev) * 0.1), beta=torch.rand(B, D, H, **dev),
        ssm_state=torch.randn(N, H, K, V, **dev) * 0.1,
        ssm_state_indices=torch.arange(B, **dev).flip(0),
    )
    ring = (torch.randn(N, H, L, V, **dev).to(s.act), torch.randn(N, H, L, K, **dev).to(s.act),
            -torch.rand(N, H, L, K, **dev) * 0.1, torch.randn(N, H, L, V, **dev).to(s.act),
            torch.randn(N, H, L, K, **dev).to(s.act), torch.rand(N, H, L, **dev))
    ring_start = torch.randint(0, L, (N,), **dev)
    fold = dict(
        ssm_state=torch.randn(Lyr, N, H, K, V, **dev) * 0.1,
        ring_rawv=torch.randn(Lyr, N, H, L, V, **dev).to(s.act),
        ring_rawk=torch.randn(Lyr, N, H, L, K, **dev).to(s.act),
        ring_g=-torch.rand(Lyr, N, H, L, K, **dev) * 0.1, ring_beta=torch.rand(Lyr, N, H, L, **dev),
        ssm_state_indices=torch.arange(B, **dev).flip(0), ring_start=ring_start,
        num_tokens=torch.full((B,), D, **dev),
    )
    conv = dict(x=torch.randn(B, D, s.C, **dev).to(s.act), weight=torch.randn(s.C, s.Kc, **dev).to(s.act),
                bias=None, conv_state=torch.randn(N, s.C, s.Kc - 1, **dev).to(s.act),
                conv_state_indices=torch.arange(B, **dev).flip(0))
    return x, ring, ring_start, fold, conv


def byte_counts(s: Shapes) -> dict[str, int]:
    """Bytes each op has to move at least (inputs read once, outputs written once)."""
    B, D, H, K, V, Lyr, ab = s.B, s.D, s.H, s.K, s.V, s.Lyr, s.ab
    state = B * H * K * V * 4
    tokens_in = B * D * H * ((2 * K + V) * ab + K * 4 + 4)          # q k v, g, beta
    out = B * D * H * V * ab
    ring_rec = B * D * H * ((2 * V + 2 * K) * ab + K * 4 + 4)        # d k rawv rawk, g, beta
    pending = B * D * H * ((V + K) * ab + K * 4)                     # d k g of D pending records
    conv_io = B * D * s.C * ab * (2 + (s.Kc - 1)) + B * s.C * (s.Kc - 1) * ab + s.C * s.Kc * ab  # windows out
    conv_rec = B * D * s.C * ab * 3 + B * s.C * (s.Kc - 1) * ab + s.C * s.Kc * ab  # x in, y and the x record out
    return {
        "verify_replay_eager": tokens_in + state + out + ring_rec,
        "verify_replay_lazy": tokens_in + state + out + ring_rec + pending,
        "verify_snapshot": tokens_in + state + out + D * state,
        "fla_fused_recurrent_kda": tokens_in + state + out + state,  # reads the state, writes the final state
        "fla_fused_recurrent_kda_spec": tokens_in + state + out + D * state,
        "short_conv_verify": conv_io,
        "short_conv_verify_records": conv_rec,
        "fast_rebuild": 2 * state + pending,
        **{f"exact_fold_n{n}": Lyr * (2 * state + B * n * H * ((V + K) * ab + K * 4 + 4)) for n in FOLD_N},
        "masked_scatter": 2 * Lyr * state,
        **{op: B * s.T * H * ((2 * K + V) * ab + K * 4 + 4) + B * s.T * H * V * ab + state for op in PREFILL_GATES},
    }


def build_cases(s: Shapes, device: str, impls: list[str]):
    """[(op, impl, fn)] for every op and implementation."""
    x, ring, ring_start, fold, conv = make_inputs(s, device)
    B, D, H, K, V, Lyr = s.B, s.D, s.H, s.K, s.V, s.Lyr
    inter = torch.empty(B, D, H, K, V, device=device)
    win = torch.empty(B, D, s.C, s.Kc - 1, dtype=s.act, device=device)  # the snapshot scheme's windows
    xin = torch.empty(B, D, s.C, dtype=s.act, device=device)  # replay's per-token input records
    pending = torch.full((s.N,), D, device=device)
    snap = torch.empty(Lyr, B, D, H, K, V, device=device) if "masked_scatter" in s.ops else None
    step = torch.randint(0, D, (B,), device=device)
    full = torch.full((B,), D, device=device)  # made here, not in the timed calls
    fold_n = {n: {**fold, "num_tokens": torch.full((B,), n, device=device)} for n in FOLD_N if n <= s.L}
    cases = []
    for impl in impls:
        get = dispatch.reference_impl if impl == "reference" else dispatch.triton_impl
        verify, conv_fn = get("verify_delta_rule"), get("short_conv_verify")
        fold_fn, rebuild, scatter = get("exact_fold"), get("fast_rebuild"), get("masked_scatter")
        cases += [
            ("verify_replay_eager", impl, lambda verify=verify: verify(**x, ring=ring, ring_start=ring_start)),
            ("verify_replay_lazy", impl,
             lambda verify=verify: verify(**x, ring=ring, ring_start=ring_start, num_pending=pending)),
            ("verify_snapshot", impl, lambda verify=verify: verify(**x, intermediate_states=inter)),
            ("short_conv_verify", impl, lambda conv_fn=conv_fn: conv_fn(**conv, window_states=win)),
            ("short_conv_verify_records", impl, lambda conv_fn=conv_fn: conv_fn(**conv, conv_inputs=xin)),
            ("fast_rebuild", impl, lambda rebuild=rebuild: rebuild(
                x["ssm_state"], x["ssm_state_indices"], ring[0], ring[1], ring[2], ring_start, full)),
        ]
        cases += [(f"exact_fold_n{n}", impl, lambda fold_fn=fold_fn, f=f: fold_fn(**f)) for n, f in fold_n.items()]
        if snap is not None:
            cases.append(("masked_scatter", impl, lambda scatter=scatter: scatter(
                snap, fold["ssm_state"], fold["ssm_state_indices"], step)))
    if "reference" in impls:  # the chunked prefill of one layer (the CPU's; CUDA prefills with fla's kernels)
        from specdec.kernels import chunk_delta_rule
        gen = torch.Generator(device=device).manual_seed(1)
        pre = [torch.randn(B, s.T, H, n, generator=gen, device=device).to(s.act) for n in (K, K, V)]
        beta = torch.rand(B, s.T, H, generator=gen, device=device)
        for op, scale in PREFILL_GATES.items():
            g = -scale * torch.rand(B, s.T, H, K, generator=gen, device=device)
            cases.append((op, "reference", lambda g=g: chunk_delta_rule(*pre, g, beta, initial_state=x["ssm_state"][:B])))
    if "fla" in s.extra:
        cases += fla_cases(s, x, device)
    return [c for c in cases if c[0] in s.ops]


def fla_cases(s: Shapes, x, device: str):
    """fla's fused_recurrent_kda on the same D tokens: plain (final state out), and the spec-decode form
    SGLang uses (state read at num_accepted_tokens - 1, one state written per token into a pool)."""
    try:
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001 - fla missing or broken: report and go on
        print(f"# fla unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return []
    B, D = s.B, s.D
    h0 = x["ssm_state"][x["ssm_state_indices"]].contiguous()
    qf, kf, vf, gf, bf = (x[n].reshape(1, B * D, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "beta"))
    cu = torch.arange(0, B * D + 1, D, device=device)
    pool = torch.zeros(B * D + 1, s.H, s.K, s.V, device=device)
    idx = torch.arange(B * D, device=device).view(B, D)
    pool[idx[:, 0]] = h0
    nacc = torch.ones(B, dtype=torch.long, device=device)

    def plain():
        return fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)

    def spec():
        return fused_recurrent_kda_fwd(q=qf, k=kf, v=vf, g=gf, beta=bf, initial_state=pool, inplace_final_state=True,
                                       cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=nacc,
                                       use_qk_l2norm_in_kernel=True)

    return [("fla_fused_recurrent_kda", "fla", plain), ("fla_fused_recurrent_kda_spec", "fla", spec)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    for name in CUDA_DEFAULTS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="activation / ring dtype")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--graph-calls", type=int, default=10,
                   help="CUDA: calls per captured graph (the device time per call is a replay / this)")
    p.add_argument("--ops", default="all", help="comma-separated op names (default: all)")
    p.add_argument("--no-reference", action="store_true", help="skip the torch references")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new case after this many seconds (what was measured is printed and written)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    defaults = CUDA_DEFAULTS if a.device == "cuda" else CPU_DEFAULTS
    for name, val in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, val)
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    s = Shapes(a)
    s.ops = set(byte_counts(s)) if a.ops == "all" else set(a.ops.split(","))
    use_triton = a.device == "cuda" or interpret()
    impls = ([] if a.no_reference else ["reference"]) + (["triton"] if use_triton else [])
    s.extra = {"fla"} if a.device == "cuda" else set()
    reps = a.reps or (20 if a.device == "cuda" else 3)

    t0 = time.perf_counter()
    bw = copy_bandwidth(a.device)
    nbytes = byte_counts(s)
    print(f"# device={a.device} ({torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}) "
          f"H={s.H} K=V={s.K} D={s.D} B={s.B} layers={s.Lyr} L={s.L} act={a.dtype} "
          f"copy bandwidth {bw:.1f} GB/s", flush=True)
    cuda = a.device == "cuda"
    print(f"{'op':30s} {'impl':10s} {'ms':>10s} {'GB/s':>9s} {'copy bw':>8s} {'vs ref':>8s}"
          + (f" {'call ms':>9s} {'timing':>7s}" if cuda else ""), flush=True)
    rows, ref_ms, skipped = [], {}, []
    for op, impl, fn in build_cases(s, a.device, impls):
        if a.budget_s is not None and time.perf_counter() - t0 > a.budget_s:
            skipped.append(f"{op}[{impl}]")
            continue
        slow = impl == "reference" or (impl == "triton" and a.device == "cpu")
        try:
            ms, call_ms, how = measure(fn, a.device, slow=slow, reps=(a.reps or 2) if slow else reps,
                                       calls=a.graph_calls)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            print(f"# {op} [{impl}] failed: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        gbps = nbytes[op] / (ms * 1e-3) / GB
        r = dict(op=op, impl=impl, ms=ms, call_ms=call_ms, timing=how, bytes=nbytes[op], gbps=gbps,
                 frac_copy_bw=gbps / bw)
        rows.append(r)
        if impl == "reference":
            ref_ms[op] = call_ms
        sp = ref_ms.get(op)  # one call against one call: the references are timed eagerly only
        vs = f"{sp / call_ms:7.1f}x" if sp and impl != "reference" else ""
        print(f"{op:30s} {impl:10s} {ms:10.4f} {gbps:9.2f} {r['frac_copy_bw']:8.1%} {vs:>8s}"
              + (f" {call_ms:9.4f} {how:>7s}" if cuda else ""), flush=True)
    if skipped:
        print(f"# budget of {a.budget_s:.0f} s spent: not measured {', '.join(skipped)}", flush=True)
    if a.json:
        out = dict(device=a.device, device_name=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
                   shapes=dict(heads=s.H, head_dim=s.K, draft_tokens=s.D, requests=s.B, layers=s.Lyr, ring_depth=s.L,
                               conv_channels=s.C, conv_kernel=s.Kc, act_dtype=a.dtype),
                   copy_bandwidth_gbps=bw, results=rows, not_measured=skipped, triton_interpret=interpret())
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
