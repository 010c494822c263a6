"""Step costs and projected speedups at a realistic model size: a random ~1.4B Kimi-Linear on one device.

    python bench/realistic.py --device cuda --json realistic.json            # ~1.4B params, bf16, CUDA graphs
    python bench/realistic.py --device cuda --budget-s 90 --tau-json bench/results/accept_rate_cpu_code.json
    python bench/realistic.py --tiny --device cpu --dtype float32            # a few M params (the CPU test's preset)

The target is transformers' own `KimiLinearForCausalLM`, built from a `KimiLinearConfig` (`model_config`: KDA
linear-attention layers and MLA full attention in the 3:1 pattern of Kimi-Linear and `specdec/embedded`, dense
MLPs, no MoE) directly on `--device` (created under a `torch.device` context: nothing is materialised on the CPU
first), with random weights (`--seed`): nothing is downloaded. The realistic preset has hidden 2048, 24 layers
(18 KDA + 6 MLA), KDA 16 heads of 128, MLA 16 heads (qk 128 + 64 rope, v 128, latent rank 512, no q LoRA), MLP
5632, vocab 32000 (untied), a 4096-token context: 1,366,158,880 parameters, printed and written by every run.

Steps (`step_1`, `chain_8`, `tree_49`): one `HybridRunner` in static-shape mode (`static=True`, as the engine's
runner with `static_shapes`: the KV cache read as a fixed `[.., max_length, ..]` view with a mask, so a step's
cost depends on its shapes only), replay strategy, eager commit, `--batch` slots, sized for the largest verify
(49 tokens). Each step is one `runner.forward(slots, ids [B, T], parent=...)`, the verify forward of the
engine's device step, from the committed state (no prefill: with static shapes the state's and cache's contents
do not change the work), and the round is left open (never committed):

    step_1   ids [B, 1]: the forward of one plain decode step
    chain_8  ids [B, 8]: anchor + 7 drafts, a gamma-7 chain round (mtp, dspark, ngram)
    tree_49  ids [B, 49], parent [B, 49]: anchor + 48 nodes in EAGLE's top-8 shape (bench/common.py's
             `tree_parents(49, 8)`: depth 7), the size of the eagle drafter's GPU tree

On CUDA each step is captured once as a CUDA graph (after one eager forward that compiles its kernels) and every
timed sample is one replay between two CUDA events after a device sync, as a decode step runs after the host
read of the previous one. Off CUDA the same static-shape forwards run eagerly (no graphs; the output says so)
and are timed with the wall clock, on the torch thread count printed (1 for a model under 50M parameters unless
`--threads` says otherwise). The kinds are interleaved (every repeat runs each once, in a rotated order) after
`--warmup` untimed rounds; figures are medians. `ratios`: chain_8 / step_1 and tree_49 / step_1.

Rounds (`round_ms`): for each drafter of `--drafters`, `specdec.wrap(model, drafter=NAME, static_shapes=True,
cuda_graph=<on CUDA>)` with the drafter's defaults for this device: ngram (prompt lookup on the host, its block
checked and placed in the static step), and untrained mtp, dspark and eagle nets sized for this target
(`untrained=True`: `draft/factory.py`, `build_drafter_net`, each kind's `Config.for_target`), drafting inside the
captured device step; mtp and dspark draft a chain of 7, eagle its device's default tree (`draft/eagle.py`
DEFAULT_TREE: 48 nodes of top-8 on a GPU). One warm-up `generate` (it compiles, and captures each bucket's round on
its second round), then `--round-repeats` timed `generate` calls of `--new-tokens` tokens from a random
`--prompt-tokens` prompt, no early stop. A call's round time is (its wall clock, device synced, minus the engine's
own prefill timer) / its rounds (`stats.steps`): the whole round (drafting, verify, acceptance, the host read,
commit, the drafter's observe and the engine's bookkeeping), plus a call's fixed costs outside the prefill spread
over its rounds; `round_ms` is the median over calls. With random weights and a random prompt the drafts (ngram's
too) are almost never accepted, which leaves a static-shape round's work as it is (only its commit grows with the
accepted tokens); the tau measured here is reported as `tau_untrained`, for information only.

Projection: `projected_speedup = tau * step_1_ms / round_ms` per drafter, tau the drafter's tokens per round on
the embedded model from `--tau-json` (default: `bench/results/accept_rate_cpu_code.json`, the code-prompt run of
the shipped drafters, gamma 7, greedy; any bench/accept_rate.py JSON works). A drafter's tau is read from the key
that names its tree options (`eagle:num_nodes=48:topk=8`) when the file has one, else from its plain key, which
holds the drafter's defaults on the device the file was measured on; where that tree differs from this round's,
the output says so (`tau_notes`). The baseline is the step_1 forward alone: plain decoding also pays the commit
of its token and a host read per token, so the projection leans low. It is a projection: tau comes from the small
embedded model and its trained drafters, the costs from this random model.

Plain decoding's own round (`plain_round_ms`), where the engine has one (`wrap(model, drafter=None)`: rounds that
verify the anchor alone, `[Bk, 1]`, graphed on CUDA): timed after the drafters, as their rounds are, and
`projected_speedup_vs_plain_round = tau * plain_round_ms / round_ms` sets whole rounds against whole rounds (the
baseline's commit, host read and bookkeeping included). Without it in the engine, `skipped` says so.

`--budget-s` (default 90, counted from the start of `main`, model build included) bounds the run: the steps and
each drafter start only while time is left, and a timer stops a phase that runs past the budget; what was
measured is then printed and written and the script exits 0 (`budget_exhausted` in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, also when loaded from elsewhere
try:
    from common import BENCH, machine_info, parse_drafter, spread, tree_parents  # noqa: E402
finally:
    sys.path.pop(0)

import specdec  # noqa: E402
from specdec import cpu_linear, timing  # noqa: E402
from specdec.draft.factory import TRAINED_KINDS  # noqa: E402

DEFAULT_TAU_JSON = BENCH / "results" / "accept_rate_cpu_code.json"
DRAFTERS = ("ngram", "mtp", "dspark", "eagle")
CHAIN, TREE, TOPK = 8, 49, 8  # verify tokens: anchor + gamma 7; anchor + 48 nodes of EAGLE's top-8 tree

# KimiLinearConfig fields of each preset (the rest: `model_config`). `max_length`: the engine's context.
PRESETS = {
    "realistic": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                      num_attention_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                      v_head_dim=128, linear_num_heads=16, linear_head_dim=128, max_length=4096),
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=48, qk_rope_head_dim=16,
                 v_head_dim=64, linear_num_heads=4, linear_head_dim=64, max_length=512),
}


class BudgetExceeded(BaseException):
    """Raised by the budget timer; a BaseException so that no `except Exception` on the way swallows it."""


# ---- model -------------------------------------------------------------------------------------------
def model_config(preset: str):
    """The `KimiLinearConfig` of `preset`: layers in the 3:1 pattern (three KDA, then one MLA), dense MLPs."""
    from transformers import KimiLinearConfig
    p = dict(PRESETS[preset])
    L = p["num_hidden_layers"]
    return KimiLinearConfig(
        vocab_size=p["vocab_size"], hidden_size=p["hidden_size"], intermediate_size=p["intermediate_size"],
        moe_intermediate_size=p["intermediate_size"], num_hidden_layers=L,
        num_attention_heads=p["num_attention_heads"], num_key_value_heads=p["num_attention_heads"],
        kv_lora_rank=p["kv_lora_rank"], q_lora_rank=None, qk_nope_head_dim=p["qk_nope_head_dim"],
        qk_rope_head_dim=p["qk_rope_head_dim"], v_head_dim=p["v_head_dim"], linear_num_heads=p["linear_num_heads"],
        linear_head_dim=p["linear_head_dim"], linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(L)],
        mlp_layer_types=["dense"] * L, num_experts=1, num_experts_per_token=1, num_shared_experts=0,
        model_max_length=p["max_length"], pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)


def build_model(config, device: str, dtype: torch.dtype, seed: int = 0):
    """Random `KimiLinearForCausalLM` created on `device` (under a `torch.device` context), in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(config) -> str:
    kinds = config.layer_types
    kda, mla = kinds.count("linear_attention"), kinds.count("full_attention")
    return (f"{len(kinds)} layers ({kda} KDA + {mla} MLA), hidden {config.hidden_size}, KDA {config.linear_num_heads}"
            f"x{config.linear_head_dim}, MLA {config.num_attention_heads} heads (latent {config.kv_lora_rank}, "
            f"qk {config.qk_nope_head_dim}+{config.qk_rope_head_dim}, v {config.v_head_dim}), MLP "
            f"{config.intermediate_size}, vocab {config.vocab_size}, context {config.max_position_embeddings}")


# ---- tau -------------------------------------------------------------------------------------------
def tree_options(drafter) -> dict:
    """The tree a drafter verifies, as accept_rate keys name it (`{"topk", "num_nodes"}`); {} for a chain."""
    if not getattr(drafter, "tree", False):
        return {}
    return {"topk": int(drafter.topk), "num_nodes": int(drafter.num_nodes)}


def implied_options(name: str, device: str) -> dict:
    """The tree a plain key `name` of an accept_rate JSON measured on `device` stands for (the defaults there)."""
    if name == "eagle":
        from specdec.draft.eagle_drafter import DEFAULT_TREE
        return dict(DEFAULT_TREE["cpu" if device == "cpu" else "cuda"])
    return {}  # mtp, dspark: a chain unless topk says otherwise; ngram: a chain


def pick_tau(data: dict, name: str, options: dict) -> tuple[float | None, str | None, str | None]:
    """-> (tau, key, note) of drafter `name` whose round verifies `options` (`tree_options`), from an accept_rate
    JSON `data`: the key naming exactly those options, else the plain key (note: set where its tree differs)."""
    drafters = data.get("drafters", {})
    for key, entry in drafters.items():
        try:
            kname, opts = parse_drafter(key)
        except ValueError:
            continue
        if (kname == name and options and set(opts) == {"topk", "num_nodes"} and opts == options
                and isinstance(entry, dict) and "tau" in entry):
            return float(entry["tau"]), key, None
    entry = drafters.get(name)
    if not isinstance(entry, dict) or "tau" not in entry:
        return None, None, f"no '{name}' entry with a tau"
    measured_on = str(data.get("settings", {}).get("device", "cpu"))
    implied = implied_options(name, measured_on)
    note = None
    if implied != options:
        had = "a chain" if not implied else f"topk {implied['topk']}, {implied['num_nodes']} nodes"
        now = "a chain" if not options else f"topk {options['topk']}, {options['num_nodes']} nodes"
        note = f"tau measured with {had} (defaults on {measured_on}); this round verifies {now}"
    return float(entry["tau"]), name, note


# ---- steps -----------------------------------------------------------------------------------------
def step_shapes(B: int, vocab: int, device, seed: int = 0) -> dict:
    """name -> (ids `[B, T]`, parent `[B, T]` or None) of step_1, chain_8 and tree_49."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, T, tree in (("step_1", 1, False), (f"chain_{CHAIN}", CHAIN, False), (f"tree_{TREE}", TREE, True)):
        ids = torch.randint(3, vocab, (B, T), generator=gen).to(device)  # token values do not change the cost
        parent = None
        if tree:
            parent = torch.tensor(tree_parents(T, TOPK), dtype=torch.long).expand(B, T).contiguous().to(device)
        out[name] = (ids, parent)
    return out


class StepTimer:
    """Times `runner.forward` of each step shape: a CUDA graph replay between CUDA events, or (off CUDA, or where a
    capture fails) an eager forward timed by the wall clock; the round is never committed."""

    def __init__(self, runner, B: int, shapes: dict, graphs: bool):
        self.runner, self.shapes = runner, shapes
        self.slots = runner.alloc(B)
        self.slots_t = runner.slots_tensor(self.slots)
        self.cuda = runner.device.type == "cuda"
        self.graphs: dict = {}
        self.outs: dict = {}  # keeps each graph's outputs alive
        self.failed: dict[str, str] = {}
        for name in shapes:  # eager first: compiles the kernels, allocates the buffers made on first use
            self._forward(name)
            if graphs:
                self._capture(name)

    def _forward(self, name: str):
        ids, parent = self.shapes[name]
        try:
            return self.runner.forward(self.slots, ids, parent=parent, slots_t=self.slots_t)
        finally:
            self.runner.abort()

    def _capture(self, name: str) -> None:
        ids, parent = self.shapes[name]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # a private pool per graph: replays interleave in any order
                self.outs[name] = self.runner.forward(self.slots, ids, parent=parent, slots_t=self.slots_t)
        except Exception as e:  # a layer that reads back: this step is timed eagerly
            self.failed[name] = f"{type(e).__name__}: {e}"
            warnings.warn(f"capturing {name} failed ({self.failed[name]}); timed eagerly", RuntimeWarning)
        else:
            self.graphs[name] = graph
        finally:
            self.runner.abort()  # the host side of the round the capture opened

    def sample_ms(self, name: str) -> float:
        """One timed forward of `name`, in ms, from an idle device."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if name in self.graphs:
                self.graphs[name].replay()
                end.record()
            else:
                ids, parent = self.shapes[name]
                self.runner.forward(self.slots, ids, parent=parent, slots_t=self.slots_t)
                end.record()
                self.runner.abort()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        self._forward(name)
        return (time.perf_counter() - t) * 1e3


def measure_steps(timer: StepTimer, repeats: int, warmup: int, deadline: float) -> dict[str, list[float]]:
    """name -> ms of each timed sample; every kind once per repeat, in a rotated order. Stops at `deadline`
    (after at least one timed sample of every kind)."""
    names = list(timer.shapes)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        if r > warmup and time.perf_counter() > deadline:
            break
        for name in names[r % len(names):] + names[:r % len(names)]:
            ms = timer.sample_ms(name)
            if r >= warmup:
                times[name].append(ms)
    return times


# ---- rounds ----------------------------------------------------------------------------------------
def measure_rounds(engine, prompt: torch.Tensor, new_tokens: int, repeats: int, deadline: float) -> dict:
    """Round time of `engine` (see the module docstring): a warm-up `generate`, then up to `repeats` timed ones."""
    cuda = engine.runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    engine.generate(prompt, max_new_tokens=new_tokens, eos_token_id=None)  # compiles, captures (2nd round)
    per_round, taus, rounds = [], [], []
    for r in range(repeats):
        if r and time.perf_counter() > deadline:
            break
        sync()
        t = time.perf_counter()
        out = engine.generate(prompt, max_new_tokens=new_tokens, eos_token_id=None)
        sync()
        wall = time.perf_counter() - t
        s = out.stats
        per_round.append((wall - s.timings["prefill"]) / s.steps * 1e3)
        taus.append(s.tau)
        rounds.append(s.steps)
    graphs = engine.graph_counts
    return {"round_ms": statistics.median(per_round), "samples_ms": per_round, "spread": spread(per_round),
            "rounds_per_call": rounds, "tau_untrained": statistics.mean(taus),
            "verify_tokens": 1 if getattr(engine.config, "plain", False) else int(engine.runner.num_verify_tokens),
            "tree": bool(getattr(engine.drafter, "tree", False)),
            "graphs_captured": graphs["captured"], "graphs_eager": graphs["eager"]}


# ---- budget ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def budget_timer(deadline: float):
    """Raise `BudgetExceeded` in the main thread once `deadline` (perf_counter) passes; the caller's own timer
    and handler are restored after. Nothing is armed off the main thread or without `setitimer`."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise BudgetExceeded()

    old_timer, armed = signal.getitimer(signal.ITIMER_REAL), time.perf_counter()
    old = signal.signal(signal.SIGALRM, fire)
    try:  # armed inside the try: a timer that fires at once still restores the caller's handler
        signal.setitimer(signal.ITIMER_REAL, max(deadline - time.perf_counter(), 1e-3))
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if old_timer[0] > 0:  # the caller's timer, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(old_timer[0] - (time.perf_counter() - armed), 1e-3),
                             old_timer[1])


# ---- output ----------------------------------------------------------------------------------------
def projected(tau: dict, step_1_ms: float | None, round_ms: dict) -> dict:
    """drafter -> tau * step_1_ms / round_ms (None where a figure is missing)."""
    out = {}
    for name, ms in round_ms.items():
        t = tau.get(name)
        out[name] = t * step_1_ms / ms if t is not None and step_1_ms and ms else None
    return out


def fmt(x, width: int, spec: str = ".2f", suffix: str = "") -> str:
    """`x` formatted (None: "-"), right-aligned in `width` columns."""
    return ("-" if x is None else format(x, spec) + suffix).rjust(width)


def round_row(name: str, r: dict, cuda: bool, tau: float | None, proj: float | None) -> str:
    T = r["verify_tokens"]
    verify = "step_1" if T == 1 else f"tree_{T}" if r["tree"] else f"chain_{T}"
    graphs = "-" if not cuda else str(r["graphs_captured"]) + (f"+{r['graphs_eager']}e" if r["graphs_eager"] else "")
    return (f"{name:8s} {verify:>8s} {r['round_ms']:9.3f} {r['spread'] * 100:6.0f}% {graphs:>6s} {fmt(tau, 6)} "
            f"{fmt(proj, 18, suffix='x')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--tiny", action="store_true", help="the tiny preset (a few M params) instead of ~1.4B")
    p.add_argument("--batch", type=int, default=1, help="requests per step and round")
    p.add_argument("--max-length", type=int, default=None,
                   help="context of the static KV cache (default: the preset's, 4096; tiny 512)")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated: ngram, mtp, dspark, eagle")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per step (default: 30 on CUDA, 7 off)")
    p.add_argument("--warmup", type=int, default=3, help="untimed interleaved rounds of the steps first")
    p.add_argument("--round-repeats", type=int, default=None, help="timed generate calls per drafter (5; tiny 2)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per timed generate (32; tiny 12)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="random prompt length (128; tiny 32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads off CUDA (default: 1 under 50M params, else torch's count)")
    p.add_argument("--tau-json", default=str(DEFAULT_TAU_JSON), help="accept_rate JSON with each drafter's tau")
    p.add_argument("--budget-s", type=float, default=90.0, help="stop measuring after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    return p


def run_steps(model, vocab: int, a, max_length: int, repeats: int, deadline: float, res: dict) -> None:
    """Time step_1, chain_8 and tree_49 (see the module docstring) into `res`, printing the table."""
    from specdec.runner import HybridRunner
    cuda = model.device.type == "cuda"
    runner = HybridRunner(model, strategy="replay", commit="eager", max_batch_size=a.batch,
                          max_length=max_length + TREE, num_verify_tokens=TREE, static=True)
    shapes = step_shapes(a.batch, vocab, model.device, a.seed)
    with cpu_linear.engaged():  # oneDNN linears where the engine would use them (an fp32 model on CPU)
        timer = StepTimer(runner, a.batch, shapes, graphs=cuda)
        times = measure_steps(timer, repeats, a.warmup, deadline)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    base = med.get("step_1")
    print(f"\n{'step':10s} {'tokens':>6s} {'median ms':>10s} {'spread':>7s} {'samples':>7s} {'x step_1':>9s} "
          f"{'graph':>6s}", flush=True)
    for name, (ids, _) in shapes.items():
        m = med.get(name)
        ratio = m / base if m is not None and base else None
        res[f"{name}_ms"] = m
        if name != "step_1":
            res["ratios"][name] = ratio
        graphed = name in timer.graphs
        res["steps"][name] = {"tokens": int(ids.shape[1]), "samples_ms": times[name], "spread": spread(times[name]),
                              "graphed": graphed, "capture_error": timer.failed.get(name)}
        print(f"{name:10s} {ids.shape[1]:6d} {fmt(m, 10, '.3f')} {spread(times[name]) * 100:6.0f}% "
              f"{len(times[name]):7d} {fmt(ratio, 9, suffix='x')} {'yes' if graphed else 'no':>6s}", flush=True)


def run_drafter(model, name: str | None, a, max_length: int, backend: str, prompt, new_tokens: int,
                round_repeats: int, deadline: float) -> tuple[dict | None, dict, str | None]:
    """-> (`measure_rounds`' figures or None, the round's tree options, the error of a failed attempt); `name`
    None: plain decoding. On CUDA the rounds are graphed; where that fails they are measured again with static
    shapes alone."""
    cuda = model.device.type == "cuda"
    err = None
    for graphed in ((True, False) if cuda else (False,)):
        engine = None
        try:
            torch.manual_seed(a.seed)  # the untrained nets' weights
            engine = specdec.wrap(model, drafter=name, max_batch_size=a.batch, max_length=max_length,
                                  static_shapes=True, cuda_graph=graphed, cpu_linear=backend,
                                  untrained=name in TRAINED_KINDS)  # the cost of a round, not its tau
            r = measure_rounds(engine, prompt, new_tokens, round_repeats, deadline)
            r["graph_error"] = err
            return r, tree_options(engine.drafter), err
        except Exception as e:  # graph capture has failure modes of its own: static-shape rounds still say much
            err = f"{type(e).__name__}: {e}"
            again = "; again without CUDA graphs" if graphed else ""
            print(f"# {name or 'plain'}: {'graphed' if graphed else 'static-shape'} rounds failed ({err}){again}",
                  flush=True)
        finally:
            del engine
            if cuda:
                torch.cuda.empty_cache()
    return None, {}, err


@torch.inference_mode()  # as `generate` runs its forwards
def main(argv=None) -> int:
    t0 = time.perf_counter()
    parser = build_parser()
    a = parser.parse_args(argv)
    deadline = t0 + a.budget_s
    drafters = [d.strip() for d in a.drafters.split(",") if d.strip()]
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or len(set(drafters)) != len(drafters):
        parser.error(f"--drafters: expected distinct names from {list(DRAFTERS)}, got {a.drafters!r}")
    for flag, val in (("--batch", a.batch), ("--repeats", a.repeats), ("--round-repeats", a.round_repeats),
                      ("--new-tokens", a.new_tokens), ("--prompt-tokens", a.prompt_tokens), ("--threads", a.threads),
                      ("--max-length", a.max_length)):
        if val is not None and val < 1:
            parser.error(f"{flag}: expected >= 1, got {val}")
    if a.warmup < 0:
        parser.error(f"--warmup: expected >= 0, got {a.warmup}")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {a.device}: no CUDA device")
    preset = "tiny" if a.tiny else "realistic"
    repeats = a.repeats or (30 if cuda else 7)
    round_repeats = a.round_repeats or (2 if a.tiny else 5)
    new_tokens = a.new_tokens or (12 if a.tiny else 32)
    prompt_tokens = a.prompt_tokens or (32 if a.tiny else 128)
    max_length = a.max_length or PRESETS[preset]["max_length"]
    if prompt_tokens + new_tokens > max_length:
        parser.error(f"--prompt-tokens + --new-tokens: {prompt_tokens + new_tokens} exceed --max-length {max_length}")
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    tau_data, tau_source = None, str(a.tau_json)
    try:
        tau_data = json.loads(Path(a.tau_json).read_text())
    except (OSError, ValueError) as e:
        print(f"# tau: cannot read {a.tau_json} ({type(e).__name__}: {e}); no projection", flush=True)
    config = model_config(preset)
    config.max_position_embeddings = max_length
    res: dict = {"params": None, "dtype": a.dtype, "device": str(dev), "preset": preset, "batch": a.batch,
                 "graphs": cuda, "threads": None, "step_1_ms": None, f"chain_{CHAIN}_ms": None,
                 f"tree_{TREE}_ms": None, "ratios": {f"chain_{CHAIN}": None, f"tree_{TREE}": None}, "round_ms": {},
                 "tau": {}, "tau_keys": {}, "tau_notes": {}, "tau_source": tau_source, "projected_speedup": {},
                 "plain_round_ms": None, "projected_speedup_vs_plain_round": {}, "steps": {}, "rounds": {},
                 "skipped": {}, "config": config.to_diff_dict(), "budget_s": a.budget_s, "budget_exhausted": False}

    def over(where: str) -> bool:
        if time.perf_counter() <= deadline:
            return False
        res["budget_exhausted"] = True
        print(f"# budget of {a.budget_s:g} s spent before {where}", flush=True)
        return True

    try:
        with budget_timer(deadline):
            model = build_model(config, dev, getattr(torch, a.dtype), a.seed)
            res["params"] = n = count_params(model)
            res["threads"] = threads = None if cuda else timing.torch_threads(model, a.threads)
            res["machine"] = machine_info("cuda" if cuda else "cpu")
            where = (f"cuda ({torch.cuda.get_device_name(dev)}), CUDA graphs" if cuda else
                     f"{dev.type}, static shapes without CUDA graphs (no CUDA), torch threads {threads}")
            print(f"# bench/realistic.py: random KimiLinearForCausalLM ({preset}), {n:,} params ({n / 1e9:.3f}B), "
                  f"{a.dtype}, {where}, batch {a.batch}", flush=True)
            print(f"# {describe(config)}", flush=True)
            backend = cpu_linear.apply("auto", model)  # as the engine's wrap does (oneDNN: fp32, a non-Intel CPU)
            if not over("the steps"):
                run_steps(model, config.vocab_size, a, max_length, repeats, deadline, res)
                if cuda:
                    torch.cuda.empty_cache()

            if tau_data is not None:
                print(f"\n# tau from {tau_source} (tokens per round on the embedded model, measured on "
                      f"{tau_data.get('settings', {}).get('device', '?')})", flush=True)
            print(f"\n{'drafter':8s} {'verify':>8s} {'round ms':>9s} {'spread':>7s} {'graphs':>6s} {'tau':>6s} "
                  f"{'projected speedup':>18s}", flush=True)
            gen = torch.Generator().manual_seed(a.seed + 1)
            prompt = torch.randint(3, config.vocab_size, (a.batch, prompt_tokens), generator=gen).to(dev)
            for name in drafters:
                if over(f"drafter {name}"):
                    res["skipped"][name] = "budget"
                    continue
                r, opts, err = run_drafter(model, name, a, max_length, backend, prompt, new_tokens, round_repeats,
                                           deadline)
                if r is None:
                    res["skipped"][name] = err
                    continue
                res["rounds"][name] = r
                res["round_ms"][name] = r["round_ms"]
                tau = None
                if tau_data is not None:
                    tau, key, note = pick_tau(tau_data, name, opts)
                    if note:
                        res["tau_notes"][name] = note
                    if tau is not None:
                        res["tau"][name], res["tau_keys"][name] = tau, key
                proj = projected(res["tau"], res["step_1_ms"], {name: r["round_ms"]})[name]
                res["projected_speedup"][name] = proj
                print(round_row(name, r, cuda, tau, proj), flush=True)

            # plain decoding's own round (the engine's drafter=None: [Bk, 1] rounds), where the engine has one
            if not hasattr(specdec.SpecConfig, "plain"):
                res["skipped"]["plain"] = "this engine has no plain-decoding round (drafter=None)"
            elif over("plain decoding"):
                res["skipped"]["plain"] = "budget"
            else:
                r, _, err = run_drafter(model, None, a, max_length, backend, prompt, new_tokens, round_repeats,
                                        deadline)
                if r is None:
                    res["skipped"]["plain"] = err
                else:
                    res["rounds"]["plain"] = r
                    res["plain_round_ms"] = r["round_ms"]
                    print(round_row("plain", r, cuda, None, None), flush=True)
                    res["projected_speedup_vs_plain_round"] = vs = projected(res["tau"], r["round_ms"],
                                                                             res["round_ms"])
                    print(f"# projected speedup over plain decoding's own round (tau x {r['round_ms']:.3f} ms / "
                          f"round ms): " + ", ".join(f"{d} {fmt(x, 0, suffix='x')}" for d, x in vs.items()), flush=True)
    except BudgetExceeded:
        res["budget_exhausted"] = True
        print(f"# budget of {a.budget_s:g} s ran out; reporting what was measured", flush=True)
        for name in drafters:
            if name not in res["round_ms"]:
                res["skipped"].setdefault(name, "budget")
        if res["plain_round_ms"] is None:
            res["skipped"].setdefault("plain", "budget")

    res["elapsed_s"] = time.perf_counter() - t0
    for name, note in res["tau_notes"].items():
        print(f"# tau {name}: {note}", flush=True)
    if res["tau"]:
        used = ", ".join(f"{d}={t:.3f} (key '{res['tau_keys'][d]}')" for d, t in res["tau"].items())
        print(f"# tau used: {used} from {tau_source}", flush=True)
    print("# projected speedup = tau x step_1 ms / round ms: tau of the embedded model's trained drafters, costs of "
          "this random model", flush=True)
    if res["skipped"]:
        print(f"# not measured: {', '.join(f'{d} ({w})' for d, w in res['skipped'].items())}", flush=True)
    print(f"# elapsed {res['elapsed_s']:.1f} s of a {a.budget_s:g} s budget", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
