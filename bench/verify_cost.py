"""Verify cost: a T-token chain or tree verify forward as a multiple of one 1-token decode step.

    python bench/verify_cost.py                                   # embedded model, 1 torch thread
    python bench/verify_cost.py --repeats 31 --json verify_cost.json

On one `HybridRunner` (replay strategy, eager commit, batch 1, sized for the largest verify), after the prefill
of a real prompt (the first code prompt of bench/data/prompts.jsonl), each of these is one
`runner.forward(slots, ids, parent=...)` from the committed state, followed by `runner.abort()` (untimed), so
every forward starts from the same state:

    step_1   one token (what plain decode runs per token)
    chain_8  an 8-token chain (anchor + 7 drafts: a gamma-7 round)
    tree_13, tree_25, tree_49   trees of 13, 25 and 49 nodes (anchor included)

The trees have the shape of EAGLE's top-k trees (topk `--topk`, default 8, as the eagle drafter's GPU tree):
the anchor's `topk` children, then at every further depth the best half of the previous depth (its first nodes)
expanded into two children each, `topk` nodes per depth, until the node count is reached; node order is
topological.

All kinds run in one process, interleaved (each repeat runs every kind once, in a rotated order) after
`--warmup` untimed rounds; each figure is the median over `--repeats`. Ratios are median(kind) / median(step_1).
Each timed forward is the last of `--block` (default 2) back-to-back forwards of its kind, as decoding runs them:
the caches then hold what that kind reads. (With oneDNN linears a verify reads the blocked weight copies and a
1-token step the original weights; timed right after another kind, a step_1 would pay for the other copy's
eviction and read slow, flattering every ratio.)
The spread of a kind is (p90 - p10) / median over its repeats; above 25% the run is reported as noisy.

`--verify chunk,per-token` (the default) times both CPU implementations of the delta-rule verify in the same run,
interleaved with each other: `chunk` (kernels/verify/chunk.py, what the dispatcher serves off the GPU) and
`per-token` (kernels/verify/naive.py, the recurrence token by token). Each has its own step_1 and ratios; the
top-level `ratios` of the JSON are the first one's. `--breakdown` then profiles (cProfile) the chain and the largest
tree per implementation and prints where a forward's time goes: the delta-rule verify, the short conv, the rest of
the linear-attention mixers, the attention layers, the KV mask and positions, the MLPs, and everything else; plus,
across all of them, the model's matmuls (every `nn.Linear`: projections, MLPs, lm_head), which grow with the tokens
whatever the verify does.

`--cpu-linear onednn,aten` times the model's `nn.Linear` layers with both backends in the same run (interleaved, as
cases `chunk / onednn linear`, `chunk / aten linear`, ...): "auto" is what the engine uses (`specdec.cpu_linear`:
oneDNN for an fp32 model on a CPU other than Intel's), "aten" is torch's `F.linear` (MKL's sgemm on x86).

The same run also measures the floor those matmuls set (`matmul floor`): every `nn.Linear` call of one forward of
each kind (projections, MLPs, lm_head: the model's weights, at the rows the kind feeds them, with the first case's
backend) is recorded and replayed alone, in the forward's order, interleaved across kinds like the forwards; the
floor of a kind is (step_1 + its matmuls - step_1's matmuls) / step_1, the ratio a verify would reach if everything
besides its weight matmuls cost no more than in a 1-token step. On a CPU, where those matmuls are compute-bound
at a few rows, no verify implementation goes below it; on a GPU decode is memory-bound and the floor sits near 1.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import PROMPTS, input_args, load_prompts, machine_info, spread, sync, tree_parents  # noqa: E402
finally:
    sys.path.pop(0)

from specdec import cpu_linear  # noqa: E402
from specdec.kernels import dispatch  # noqa: E402
from specdec.kernels.verify import chunk as verify_chunk  # noqa: E402
from specdec.kernels.verify import naive as verify_naive  # noqa: E402

TREE_SIZES = (13, 25, 49)
NOISY = 0.25
LINEAR_FORWARDS = (torch.nn.Linear.forward.__code__, cpu_linear.OneDNNLinear.forward.__code__)
VERIFY_IMPLS = {"chunk": verify_chunk.verify_delta_rule, "per-token": verify_naive.verify_delta_rule}


@contextlib.contextmanager
def case(impl: str | None, linear: str):
    """One measured case: verify implementation `impl` (see `verify_impl`) and the `nn.Linear` backend `linear`
    ("onednn": the installed `OneDNNLinear` layers, engaged as inside the engine's `generate`; "aten": the same
    layers with oneDNN switched off, so every call is `F.linear`)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(verify_impl(impl))
        stack.enter_context(cpu_linear.engaged())
        if linear == "aten":
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="TF32 acceleration on top of oneDNN")  # flags() says it each time
            stack.enter_context(torch.backends.mkldnn.flags(enabled=False))
        yield


@contextlib.contextmanager
def verify_impl(name: str | None):
    """Serve `verify_delta_rule` off the GPU with implementation `name` (None: as dispatched), restored after."""
    if name is None:
        yield
        return
    entry = dispatch.OPS["verify_delta_rule"]
    dispatch.OPS["verify_delta_rule"] = (VERIFY_IMPLS[name], entry[1])
    try:
        yield
    finally:
        dispatch.OPS["verify_delta_rule"] = entry


def kinds(chain: int, trees, topk: int) -> dict[str, list[int] | None]:
    """name -> parent list (None: chain)."""
    out: dict[str, list[int] | None] = {"step_1": None, f"chain_{chain}": None}
    for n in trees:
        out[f"tree_{n}"] = tree_parents(n, topk)
    return out


def make_inputs(runner, ids: torch.Tensor, shapes: dict) -> dict:
    """name -> (ids `[1, T]`, parent `[T]` or None) for every kind."""
    inputs = {}
    for name, parent in shapes.items():
        T = 1 if name == "step_1" else (len(parent) if parent is not None else int(name.split("_")[1]))
        x = ids[torch.arange(T) % ids.numel()][None].to(runner.device)  # token values do not change the cost
        p = None if parent is None else torch.tensor(parent, dtype=torch.long, device=runner.device)
        inputs[name] = (x, p)
    return inputs


def measure(runner, slots: list[int], ids: torch.Tensor, shapes: dict, repeats: int, warmup: int,
            cases: dict | None = None, block: int = 1) -> dict:
    """-> case -> kind -> list of seconds per forward; every (case, kind) once per repeat, in a rotated order.
    `cases`: name -> (verify implementation, linear backend) (default: as dispatched, as installed). `block`: each
    timed forward is the last of `block` back-to-back forwards of its kind, as decoding runs them (the others warm
    the caches with the weights that kind reads: with oneDNN a verify reads the blocked copies, a 1-row step the
    originals)."""
    wait = functools.partial(sync, runner.device)
    inputs = make_inputs(runner, ids, shapes)
    cases = cases or {None: (None, "onednn")}
    order0 = [(c, name) for c in cases for name in shapes]
    times: dict = {c: {n: [] for n in shapes} for c in cases}
    for r in range(warmup + repeats):
        order = order0[r % len(order0):] + order0[:r % len(order0)]
        for impl, name in order:
            x, p = inputs[name]
            with case(*cases[impl]):
                for _ in range(block - 1):
                    runner.forward(slots, x, parent=p)
                    runner.abort()
                wait()
                t = time.perf_counter()
                runner.forward(slots, x, parent=p)
                wait()
                dt = time.perf_counter() - t
            runner.abort()
            if r >= warmup:
                times[impl][name].append(dt)
    return times


def components(runner) -> dict[str, list]:
    """label -> code objects whose cumulative time makes that part of a forward (cProfile keys)."""
    layers = runner.layers
    # what the runner calls for each attention layer: the module, or a family's stand-in for it (Kimi's MLA in
    # latent form, `adapters.KimiLatentAttention`), whose work never passes through the module's own forward
    attn = {(type(a).forward if isinstance(a, torch.nn.Module) else type(a).__call__).__code__
            for a in runner.attention.values()}
    mlp = {type(layer.mlp).forward.__code__ for layer in layers}
    kv = type(runner.kv)
    return {
        "delta-rule verify": [f.__code__ for f in VERIFY_IMPLS.values()],
        "short conv": [verify_naive.short_conv_verify.__code__],
        "linear-attn mixers (all)": [getattr(runner.mixer.run, "__func__", runner.mixer.run).__code__],
        "attention layers": sorted(attn, key=str),
        "KV mask + positions": [kv.attention_mask.__code__, kv.positions.__code__],
        "MLPs": sorted(mlp, key=str),
    }


def breakdown(runner, slots: list[int], x: torch.Tensor, p, impl: str | None, linear: str = "onednn",
              n: int = 10) -> dict:
    """ms per forward (under cProfile, so Python-heavy parts read high) of each component, and the total."""
    prof = cProfile.Profile()
    with case(impl, linear):
        runner.forward(slots, x, parent=p)
        runner.abort()
        prof.enable()
        for _ in range(n):
            runner.forward(slots, x, parent=p)
            runner.abort()
        prof.disable()
    stats = pstats.Stats(prof).stats
    cum = lambda code: stats.get((code.co_filename, code.co_firstlineno, code.co_name), (0, 0, 0, 0))[3]  # noqa: E731
    out = {label: 1e3 * sum(cum(c) for c in codes) / n for label, codes in components(runner).items()}
    # every nn.Linear of the model (projections, MLPs, lm_head), whichever part above it belongs to: the compute
    # that grows with the tokens whatever the verify does
    out["model matmuls (nn.Linear)"] = 1e3 * sum(cum(c) for c in LINEAR_FORWARDS) / n
    out["total"] = 1e3 * sum(v[3] for k, v in stats.items() if k[2] == "forward" and k[0].endswith("runner.py")) / n
    return out


def linear_calls(runner, slots: list[int], x: torch.Tensor, p) -> list[tuple]:
    """The `nn.Linear` calls of one forward of `x` (ids `[1, T]`, parent `[T]` or None), in order, as
    (layer, input shape, input dtype)."""
    calls: list[tuple] = []
    record = lambda m, args: calls.append((m, tuple(args[0].shape), args[0].dtype))  # noqa: E731
    hooks = [m.register_forward_pre_hook(record) for m in runner.model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        runner.forward(slots, x, parent=p)
    finally:
        for h in hooks:
            h.remove()
    runner.abort()
    return calls


def matmul_floor(runner, slots: list[int], inputs: dict, step_1_s: float, repeats: int, warmup: int,
                 linear: str = "onednn") -> dict:
    """The weight matmuls of each kind replayed alone (the model's `nn.Linear` layers, with backend `linear`):
    name -> {matmul_ms (median), floor (ratio), calls}. `inputs` as `make_inputs` gives them; `step_1_s` the
    median 1-token forward of the same run."""
    wait = functools.partial(sync, runner.device)
    calls = {name: linear_calls(runner, slots, *xp) for name, xp in inputs.items()}
    gen = torch.Generator(device=runner.device).manual_seed(0)
    args = {name: [(m, torch.randn(shape, generator=gen, device=runner.device, dtype=dt)) for m, shape, dt in cs]
            for name, cs in calls.items()}
    names = list(args)
    times: dict = {n: [] for n in names}
    with torch.no_grad(), case(None, linear):
        for r in range(warmup + repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                wait()
                t = time.perf_counter()
                for m, x in args[name]:
                    m(x)
                wait()
                if r >= warmup:
                    times[name].append(time.perf_counter() - t)
    mm = {n: statistics.median(v) for n, v in times.items()}
    return {n: {"matmul_ms": 1e3 * mm[n], "spread": spread(times[n]), "calls": len(calls[n]),
                "floor": (step_1_s - mm["step_1"] + mm[n]) / step_1_s if step_1_s > 0 else 0.0} for n in names}


def format_floor(fl: dict, res: dict) -> str:
    """The matmul floor of every kind beside the measured ratio (one implementation's `res`)."""
    head = f"{'kind':10s} {'nn.Linear':>9s} {'matmul ms':>10s} {'spread':>7s} {'floor':>8s} {'measured':>9s}"
    lines = [head, "-" * len(head)]
    for name, f in fl.items():
        lines.append(f"{name:10s} {f['calls']:9d} {f['matmul_ms']:10.2f} {f['spread'] * 100:6.0f}% "
                     f"{f['floor']:7.2f}x {res['kinds'][name]['ratio']:8.2f}x")
    return "\n".join(lines)


def format_table(res: dict) -> str:
    """One implementation's kinds as a table."""
    head = f"{'verify':10s} {'tokens':>6s} {'depth':>5s} {'median ms':>10s} {'spread':>7s} {'x 1-token':>10s}"
    lines = [head, "-" * len(head)]
    for name, r in res["kinds"].items():
        lines.append(f"{name:10s} {r['tokens']:6d} {r['depth']:5d} {r['median_s'] * 1e3:10.2f} "
                     f"{r['spread'] * 100:6.0f}% {r['ratio']:9.2f}x")
    return "\n".join(lines)


def depth(parent: list[int] | None, T: int) -> int:
    if parent is None:
        return T
    d = [0] * len(parent)
    for i, p in enumerate(parent):
        d[i] = 1 if p < 0 else d[p] + 1
    return max(d)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded", help="save_pretrained directory (model + tokenizer) or 'embedded'")
    p.add_argument("--prompts", default=str(PROMPTS), help="JSONL prompt file")
    p.add_argument("--prompt-tokens", type=int, default=256, help="the prompt is cut to its last N tokens")
    p.add_argument("--chain", type=int, default=8, help="chain verify tokens (anchor + drafts)")
    p.add_argument("--trees", default=",".join(map(str, TREE_SIZES)), help="tree node counts, comma-separated")
    p.add_argument("--topk", type=int, default=8, help="tree width per depth (EAGLE's topk)")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats of every kind (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds of every kind first")
    p.add_argument("--block", type=int, default=2,
                   help="forwards of a kind back to back, the last one timed (>= 1; 1: every forward timed, "
                        "kinds fully interleaved)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--verify", default="chunk,per-token",
                   help="comma-separated CPU verify implementations to time in the same run (chunk, per-token); "
                        "'dispatch': whatever the dispatcher serves (Triton on CUDA)")
    p.add_argument("--cpu-linear", default="auto",
                   help="comma-separated nn.Linear backends to time in the same run (auto, onednn, aten; see "
                        "specdec.cpu_linear); auto (the engine's default) is onednn for an fp32 model on a CPU "
                        "other than Intel's, else aten")
    p.add_argument("--breakdown", action="store_true", help="profile the chain and the largest tree per implementation")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return p


def summarize(times: dict, shapes: dict, chain: int) -> dict:
    """name -> tokens, depth, parent, median, spread, ratio to step_1, times (one implementation)."""
    base = statistics.median(times["step_1"])
    res = {}
    for name, parent in shapes.items():
        T = len(parent) if parent is not None else (1 if name == "step_1" else chain)
        med = statistics.median(times[name])
        res[name] = {"tokens": T, "depth": depth(parent, T), "parent": parent, "median_s": med,
                     "spread": spread(times[name]), "ratio": med / base if base > 0 else 0.0, "times_s": times[name]}
    return res


@torch.inference_mode()  # every forward as `generate` runs it
def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        trees = [int(t) for t in a.trees.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--trees: expected comma-separated integers, got {a.trees!r}")
    for flag, val, low in (("--chain", a.chain, 1), ("--topk", a.topk, 1), ("--repeats", a.repeats, 1),
                           ("--warmup", a.warmup, 0), ("--block", a.block, 1), ("--threads", a.threads, 1),
                           ("--prompt-tokens", a.prompt_tokens, 1),
                           *(("--trees", t, 2) for t in trees)):
        if val < low:
            parser.error(f"{flag}: expected >= {low}, got {val}")
    impls = [x.strip() for x in a.verify.split(",") if x.strip()]
    bad = [x for x in impls if x not in (*VERIFY_IMPLS, "dispatch")]
    if not impls or bad or len(set(impls)) != len(impls):
        parser.error(f"--verify: expected distinct names from {sorted(VERIFY_IMPLS) + ['dispatch']}, got {a.verify!r}")
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    linears = [x.strip() for x in a.cpu_linear.split(",") if x.strip()]
    for x in linears:
        try:
            cpu_linear.check_mode(x)
        except ValueError as e:
            parser.error(f"--cpu-linear: {e}")
    if not linears:
        parser.error("--cpu-linear: no backend named")
    model_dir = input_args(parser, a.model)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from specdec.runner import HybridRunner

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(a.prompts, ["code"], 1) or load_prompts(a.prompts, ["prose"], 1)
    if not prompts:
        parser.error(f"--prompts: no code or prose prompt in {a.prompts}")
    ids = tok(prompts[0]["prompt"], return_tensors="pt").input_ids[0][-a.prompt_tokens:]
    shapes = kinds(a.chain, trees, a.topk)
    T_max = max([a.chain, *trees])
    backends = list(dict.fromkeys(cpu_linear.resolve(x, model) for x in linears))  # "auto" resolved, deduplicated
    if "onednn" in backends:
        cpu_linear.install(model)  # as the engine does; "aten" cases switch oneDNN off around their forwards
    runner = HybridRunner(model, max_batch_size=1, max_length=ids.numel() + T_max + 1, num_verify_tokens=T_max)
    slots = runner.alloc(1)
    runner.prefill(slots[0], ids.to(a.device))
    cases = {(f"{v} / {b} linear" if len(backends) > 1 else v): (None if v == "dispatch" else v, b)
             for v in impls for b in backends}
    times = measure(runner, slots, ids, shapes, a.repeats, a.warmup, cases, a.block)
    per_impl = {name: {"kinds": summarize(times[name], shapes, a.chain), "verify": v, "cpu_linear": b}
                for name, (v, b) in cases.items()}
    for r in per_impl.values():
        r["ratios"] = {n: k["ratio"] for n, k in r["kinds"].items() if n != "step_1"}
    inputs = make_inputs(runner, ids, shapes)
    first_name = next(iter(cases))
    first = per_impl[first_name]
    floor = matmul_floor(runner, slots, inputs, first["kinds"]["step_1"]["median_s"], a.repeats, a.warmup,
                         linear=backends[0])
    if a.breakdown:
        big = [f"chain_{a.chain}"] + ([f"tree_{max(trees)}"] if trees else [])
        for name, c in cases.items():
            per_impl[name]["breakdown_ms"] = {k: breakdown(runner, slots, *inputs[k], *c) for k in ["step_1", *big]}
    noisy = {f"{i} {n}": r["spread"] for i, res in per_impl.items() for n, r in res["kinds"].items()
             if r["spread"] > NOISY}
    n_params = sum(p.numel() for p in model.parameters())
    out = {
        "ratios": first["ratios"],
        "kinds": first["kinds"],
        "verify": impls[0],
        "cpu_linear": backends[0],
        "matmul_floor": {"floor_ratios": {n: f["floor"] for n, f in floor.items() if n != "step_1"}, "kinds": floor},
        "impls": per_impl,
        "noisy": bool(noisy),
        "machine": machine_info(a.device),
        "model": {"path": str(model_dir), "model_type": model.config.model_type, "params": n_params},
        "settings": {"prompt_id": prompts[0]["id"], "prompt_tokens": int(ids.numel()), "chain": a.chain,
                     "trees": trees, "topk": a.topk, "repeats": a.repeats, "warmup": a.warmup, "block": a.block,
                     "threads": torch.get_num_threads(), "device": a.device, "strategy": "replay",
                     "commit": "eager", "num_verify_tokens": T_max, "verify": impls, "cpu_linear": backends},
    }
    print(f"# bench/verify_cost.py: {a.model} ({model.config.model_type}, {n_params / 1e6:.1f}M params, float32, "
          f"{a.device}), torch threads {torch.get_num_threads()}, prompt {prompts[0]['id']} ({ids.numel()} tokens), "
          f"median of {a.repeats} interleaved repeats after {a.warmup} warmup rounds")
    for name, res in per_impl.items():
        print(f"\nverify: {name}" + (f" ({res['cpu_linear']} linear)" if len(backends) == 1 else ""))
        print(format_table(res))
        if "breakdown_ms" in res:
            print(format_breakdown(res["breakdown_ms"]))
    print(f"\nmatmul floor (the weight matmuls of each kind replayed alone; floor = step_1 + their growth over "
          f"step_1's, as a ratio; measured: {first_name}" + (f", {backends[0]} linear)" if len(backends) == 1 else ")"))
    print(format_floor(floor, first))
    if noisy:
        worst = ", ".join(f"{n} {s * 100:.0f}%" for n, s in noisy.items())
        print(f"timing is noisy on this machine: spread (p90-p10)/median above {NOISY * 100:.0f}% ({worst}); "
              f"rerun on a quiet machine or with more --repeats")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def format_breakdown(bd: dict) -> str:
    kinds = list(bd)
    labels = list(next(iter(bd.values())))
    head = f"{'ms per forward (cProfile)':28s}" + "".join(f"{k:>10s}" for k in kinds)
    lines = [head, "-" * len(head)]
    for label in labels:
        lines.append(f"{label:28s}" + "".join(f"{bd[k][label]:10.2f}" for k in kinds))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
