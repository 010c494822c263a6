"""Memory against the workload: prefix-cache bytes against a conversation's length, requests at once under one
budget, and the decode cost of reading KV through pages.

    python bench/memory_scale.py                                     # (a), (b), (c) on the embedded model
    python bench/memory_scale.py --parts c --json c.json             # (c) alone
    python bench/memory_scale.py --parts d                           # (d) on paper, no model
    python bench/memory_scale.py --parts e                           # (e) the agent loop
    python bench/ab.py --old 19bfdf4 --rounds 3 --metric 'decode.*.ms_per_token' -- memory_scale.py --parts c

(a) One conversation grows turn by turn (each turn resends the whole history plus a new message of
    `--message-tokens`, as a chat client does) with a prefix cache; at each length of `--conv-lengths` the cache's
    own bytes (state, features, partial pages), its entries, the KV pages they hold (shared, counted once) against
    the distinct KV the conversation holds (tokens x a token's KV bytes), and what copying each entry's prefix would
    take (tokens x entries).
(b) `--requests` requests, `--long-share` of them `--long` tokens and the rest `--short`, `--max-new-tokens` each,
    under one budget of `--budget-mib`: with `memory=` (pages, a request admitted when its worst case fits) against
    a static reservation of `max_length` per lane in the same KV bytes (the lanes that fit). Requests running at
    once (most and mean rows per round), wall time and new tokens per second; the outputs must be identical.
(c) Plain decoding (`drafter=None`) at contexts of `--contexts` tokens: ms per new token, the prefill excluded
    (the call's draft + verify time over its new tokens), median of `--repeats`. Against the contiguous KV
    buffers of an older revision through bench/ab.py (the command above; 19bfdf4 is the last before pages).
(d) On paper, no model loaded: requests at once on one GPU of `--gpu-gb` (141 GB, an H200) for SGLang's example
    workload, `--paper-in` 16384 tokens in and `--paper-out` 3072 out, verifying D = `--paper-draft-tokens` (8), for
    Kimi-Linear-48B-A3B, Qwen3-Next-80B-A3B and the reference notes' Kimi K3. Every shape is in `PAPER_MODELS` with
    where it was read; `SGLANG_RULE` holds SGLang's numbers. `python bench/memory_scale.py --parts d`.
    - The budget of one GPU: `--gpu-gb` less `--headroom` (10%) less the weights, total parameters x 2 bytes (bf16)
      / TP (`--paper-tp`). K3's weights are not stated in the notes (and its 2.8T parameters do not fit 8 x 141 GB
      in bf16): its caches get `--k3-cache-gib`, by default the bytes of the notes' K3 TP-8 allocation log.
    - specdec: the largest N whose memory plan fits the budget, from the functions the engine allocates with
      (`replayssm.plan.strategy_specs` with eager commit on the Triton kernels, `kv_cache.kv_specs`): N state slots
      (`conv_state [layer, slot, C, Kc-1]` bf16, `ssm_state [layer, slot, H, K, V]` fp32, the null slot too), the
      spec state of N running rows (`ring_* [layer, row, H, D, dim]`, `conv_inputs [layer, row, D, C]`, one layer's
      `tree_state_stack`) and KV pages `[pages + 1, 16, heads, dim]` bf16 for each request's worst case (in + out + D
      tokens). With a prefix cache the pool also keeps two tracked copies of each slot (`track_ssm [layer, slot, 2,
      H, K, V]`): the "+prefix" column. Under TP the MLA latents are data-parallel over the requests (each GPU the
      requests it owns, `parallel.SlotSplit`); the K3 line under the table puts every latent on every GPU, as
      SGLang does. `wrap` does not take `memory=` with a `tp_group` yet: the TP rows are the plan, not a run.
    - SGLang (python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py, mem_cache/kv_cache_configurator.py):
      the state pool gets rest x r / (1 + r) (`--mamba-full-memory-ratio` r, default 0.9) in slots of one request's
      state plus its ReplaySSM rings in SGLang's layout (`[layer, slot, H, L = 16, dim]`, six records, fp32 g, as the
      notes' logs show), less the verify conv windows of the running rows; the KV pool the rest, per token (page
      size 1), MLA latents on every GPU. Requests at once: the pool's slots // (3 to 5 per request), or the KV
      tokens // (in + out), the smaller; "tuned" is the ratio at which both run out together (SGLang's
      compute-mamba-ratio). The pool's extra slot is left out.
    Sources: Kimi-Linear-48B-A3B-Instruct's config.json (huggingface.co/moonshotai, read in a copy) and NeMo's model
    page (48B); transformers' Qwen3NextConfig, whose defaults are Qwen3-Next-80B-A3B-Instruct's, and Megatron
    Bridge's model page (80B); shared/reference/hybrid-linear-kv-cache-and-replayssm.md for K3 (93 layers, 69 KDA
    + 24 MLA of 576 elements per token, 96 heads of 128, kernel 4, TP 8, the allocation log, the 16k-in / 3k-out
    example, 3-5 slots per request); sgl-project/sglang for the rule. The addresses are in the tables.
(e) The agent loop: a conversation of `--agent-tokens` (17,500) in a `--agent-cache-mib` (64) prefix cache, edited
    every `--agent-step` (2,000) tokens: the tokens each edit finds cached (the goal: at most one track interval
    before the edit) and its output against an engine's without the cache.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

import specdec  # noqa: E402
from specdec import timing  # noqa: E402
from specdec.kv_cache import page_specs  # noqa: E402

MiB = 1 << 20


def text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    """`n` tokens of standard-library source (modules concatenated until there are enough), from `offset`."""
    import argparse as a1, collections as a2, inspect as a3, json.decoder as a4, tarfile as a5, typing as a6
    ids: list[int] = []
    for mod in (a1, a2, a3, a4, a5, a6) * 8:
        ids += tokenizer(inspect.getsource(mod))["input_ids"]
        if len(ids) >= n + offset:
            break
    if len(ids) < n + offset:
        raise ValueError(f"only {len(ids)} tokens of source text, {n + offset} asked")
    return ids[offset:offset + n]


def rows_per_round(engine) -> list[int]:
    """The rows of every round `engine` runs, recorded as it runs them."""
    rows, inner = [], engine._round
    engine._round = lambda active, *a, **k: (rows.append(len(active)), inner(active, *a, **k))[1]
    return rows


def part_a(model, tokenizer, a) -> dict:
    lengths = [int(x) for x in common.split_list(a.conv_lengths)]
    engine = specdec.wrap(model, drafter=a.drafter, max_batch_size=1, max_length=max(lengths) + 1024,
                          prefix_cache=4 << 30, states_per_path=a.states_per_path)  # no eviction up to 32k tokens
    from specdec.kv_cache import token_bytes
    per_token = token_bytes(engine.memory_plan.parts["KV cache"])
    hist, out, offset = [], [], 0
    for target in lengths:
        while len(hist) < target:
            msg = text_ids(tokenizer, a.message_tokens, offset)
            offset += a.message_tokens
            res = engine.generate(torch.tensor(hist + msg), max_new_tokens=a.reply_tokens, eos_token_id=None)
            hist = res.sequences[0].tolist()
        d = engine.prefix_cache.describe()
        entries = [e for _, e in engine.prefix_cache.entries()]
        page = engine.runner.kv.page_size * per_token
        out.append(dict(tokens=len(hist), entries=d["entries"], cache_bytes=d["bytes"],
                        distinct_kv_bytes=len(hist) * per_token,
                        entry_pages_bytes=len({p for e in entries for p in e.pages}) * page,
                        copies_bytes=sum(e.length for e in entries) * per_token))
    print(f"(a) prefix cache against a conversation's length ({a.drafter}, messages of {a.message_tokens} tokens, "
          f"replies of {a.reply_tokens}); the entries share KV pages: their pages against the conversation's "
          f"distinct KV and against a copy of each entry's prefix")
    print(f"{'tokens':>7} {'entries':>8} {'cache MiB':>10} {'entry pages MiB':>16} {'distinct KV MiB':>16} "
          f"{'copies would be MiB':>20}")
    for r in out:
        print(f"{r['tokens']:>7} {r['entries']:>8} {r['cache_bytes'] / MiB:>10.1f} {r['entry_pages_bytes'] / MiB:>16.2f} "
              f"{r['distinct_kv_bytes'] / MiB:>16.2f} {r['copies_bytes'] / MiB:>20.1f}")
    return {"rows": out, "kv_bytes_per_token": per_token}


def part_b(model, tokenizer, a) -> dict:
    n_long = max(1, round(a.requests * a.long_share))
    sizes = [a.long if i % max(1, a.requests // n_long) == 0 and i // max(1, a.requests // n_long) < n_long
             else a.short for i in range(a.requests)]
    prompts = [text_ids(tokenizer, s, 97 * i) for i, s in enumerate(sizes)]
    cap = a.long + a.max_new_tokens
    budget = int(a.budget_mib * MiB)
    paged = specdec.wrap(model, drafter=a.drafter, max_batch_size=a.requests, max_length=cap, memory=budget)
    plan = paged.memory_plan
    kv = plan.parts["KV cache"]
    pages_bytes = sum(s.nbytes for s in page_specs(kv).values())
    per_lane = None
    lanes = 0
    for lanes_try in range(a.requests, 0, -1):  # the most lanes whose static reservation fits the same bytes
        probe = specdec.wrap(model, drafter=a.drafter, max_batch_size=lanes_try, max_length=cap, cpu_linear="aten")
        held = sum(s.nbytes for s in page_specs(probe.memory_plan.parts["KV cache"]).values())
        other = probe.memory_plan.total - held
        if held + other <= budget:
            lanes, per_lane = lanes_try, held / lanes_try
            break
        del probe
    if lanes == 0:
        raise SystemExit(f"(b): a budget of {a.budget_mib} MiB holds no lane of max_length {cap} reserved")
    static = specdec.wrap(model, drafter=a.drafter, max_batch_size=lanes, max_length=cap)
    res = {}
    outs = {}
    for name, eng in (("paged", paged), ("static", static)):
        rows = rows_per_round(eng)
        t0 = time.perf_counter()
        out = eng.generate([torch.tensor(p) for p in prompts], max_new_tokens=a.max_new_tokens, eos_token_id=None)
        wall = time.perf_counter() - t0
        new = sum(out.new_token_counts)
        outs[name] = out.sequences
        res[name] = dict(lanes=eng.config.max_batch_size, most_at_once=max(rows), mean_at_once=statistics.mean(rows),
                         wall_s=wall, tokens_per_s=new / wall, rounds=len(rows))
    identical = torch.equal(outs["paged"], outs["static"])
    print(f"(b) {a.requests} requests ({n_long} of {a.long} tokens, the rest {a.short}), {a.max_new_tokens} new each, "
          f"{a.budget_mib} MiB: pages ({pages_bytes / MiB:.1f} MiB of KV pages) against a static reservation of "
          f"{cap} tokens per lane ({per_lane / MiB:.1f} MiB a lane)")
    print(f"{'':>7} {'lanes':>6} {'most at once':>13} {'mean at once':>13} {'wall s':>8} {'tokens/s':>9}")
    for name, r in res.items():
        print(f"{name:>7} {r['lanes']:>6} {r['most_at_once']:>13} {r['mean_at_once']:>13.2f} {r['wall_s']:>8.1f} "
              f"{r['tokens_per_s']:>9.1f}")
    print(f"identical outputs: {identical}")
    return {"budget_bytes": budget, "kv_page_bytes": pages_bytes, "reservation_per_lane_bytes": per_lane,
            "sizes": sizes, "identical": identical, **res}


def part_e(model, tokenizer, a) -> dict:
    """(e) An agent loop: a conversation of `--agent-tokens` in a `--agent-cache-mib` prefix cache, then edited at
    every `--agent-step` tokens (each edit a new request of the conversation cut there plus 3 tokens): the tokens each
    edit finds cached, how far before the edit that is (at most one `track_interval`, 256, is the goal), and whether
    its output equals an engine's without the cache."""
    ids = text_ids(tokenizer, a.agent_tokens)
    kw = dict(drafter=a.drafter, max_batch_size=1, max_length=a.agent_tokens + 512)
    cached = specdec.wrap(model, prefix_cache=int(a.agent_cache_mib * MiB), states_per_path=a.states_per_path, **kw)
    plain = specdec.wrap(model, **kw)
    t0 = time.perf_counter()
    cached.generate(torch.tensor(ids), max_new_tokens=8, eos_token_id=None)
    built = time.perf_counter() - t0
    rows = []
    for edit in range(a.agent_step, a.agent_tokens, a.agent_step):
        prompt = torch.tensor(ids[:edit] + [17, 18, 19])
        got = cached.generate(prompt, max_new_tokens=8, eos_token_id=None)
        want = plain.generate(prompt, max_new_tokens=8, eos_token_id=None)
        rows.append(dict(edit=edit, cached_tokens=got.stats.cached_tokens, gap=edit - got.stats.cached_tokens,
                         identical=torch.equal(got.sequences, want.sequences),
                         cache_bytes=cached.prefix_cache.bytes))
    mem = cached.memory()
    print(f"(e) agent loop: {a.agent_tokens} tokens in a {a.agent_cache_mib:g} MiB prefix cache (states_per_path "
          f"{a.states_per_path}), edited every {a.agent_step} ({built:.1f} s to build)")
    print(f"{'edit':>6} {'cached':>7} {'gap':>5} {'identical':>10} {'cache MiB':>10}")
    for r in rows:
        print(f"{r['edit']:>6} {r['cached_tokens']:>7} {r['gap']:>5} {str(r['identical']):>10} "
              f"{r['cache_bytes'] / MiB:>10.1f}")
    print(f"KV shared {mem['shared'] / MiB:.1f} MiB, evictable {mem['evictable'] / MiB:.1f} MiB")
    return {"rows": rows, "memory": mem, "build_s": built}


def part_c(model, tokenizer, a) -> dict:
    contexts = [int(x) for x in common.split_list(a.contexts)]
    engine = specdec.wrap(model, drafter=None, max_batch_size=1, max_length=max(contexts) + a.decode_tokens + 8)
    engine.generate(torch.tensor(text_ids(tokenizer, 64)), max_new_tokens=4, eos_token_id=None)  # warm
    out = {}
    for c in contexts:
        ids = torch.tensor(text_ids(tokenizer, c))
        per = []
        for _ in range(a.repeats):
            res = engine.generate(ids, max_new_tokens=a.decode_tokens, eos_token_id=None)
            t = res.stats.timings
            per.append((t["draft"] + t["verify"]) / a.decode_tokens * 1e3)
        out[str(c)] = dict(ms_per_token=statistics.median(per), spread=common.spread(per), samples_ms=per)
    print(f"(c) plain decoding, ms per new token ({a.decode_tokens} new, prefill excluded, median of {a.repeats})")
    for c, r in out.items():
        print(f"{c:>7} tokens: {r['ms_per_token']:7.2f} ms/token (spread {r['spread']:.2f})")
    return out


GB = 10 ** 9  # a GPU's memory as its maker counts it (141 GB)
GiB = 1 << 30
NOTES = "shared/reference/hybrid-linear-kv-cache-and-replayssm.md (the reference notes)"

# (d): the shapes of each model, every number with where it was read. `layers`: the recurrent layers; heads are
# all ranks' (a GPU holds heads / TP); `params`: total parameters, for the weights in bf16 (None: not stated).
PAPER_MODELS = {
    "kimi-linear": dict(
        name="Kimi-Linear-48B-A3B", gate="kda", layers=20, heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4,
        attention="mla", attention_layers=7, kv_lora_rank=512, qk_rope_head_dim=64, params=48e9, tp=1,
        sources={
            "num_hidden_layers 27; linear_attn_config: kda_layers 1-3, 5-7, ..., 25-26 (20), full_attn_layers "
            "[4, 8, 12, 16, 20, 24, 27] (7 MLA, the 3:1 pattern), num_heads 32, head_dim 128, short_conv_kernel_size "
            "4; kv_lora_rank 512, qk_rope_head_dim 64":
                "https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json, read in the "
                "copy of a quantized derivative that keeps these fields, https://hf.898520.xyz/Firworks/"
                "Kimi-Linear-48B-A3B-Instruct-nvfp4/resolve/main/config.json",
            "48B total parameters (3B active)":
                "https://docs.nvidia.com/nemo/automodel/model-coverage/large-language-models/moonshotai/kimi-linear.md",
        }),
    "qwen3-next": dict(
        name="Qwen3-Next-80B-A3B", gate="gdn", layers=36, heads=32, key_heads=16, head_k_dim=128, head_v_dim=128,
        conv_kernel=4, attention="gqa", attention_layers=12, kv_heads=2, attn_head_dim=256, params=80e9, tp=2,
        sources={
            "num_hidden_layers 48, full_attention_interval 4 (12 full attention, 36 Gated DeltaNet), "
            "num_key_value_heads 2, head_dim 256, linear_num_key_heads 16, linear_num_value_heads 32, "
            "linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4":
                "huggingface/transformers src/transformers/models/qwen3_next/configuration_qwen3_next.py (commit "
                "008e5743; its defaults are checkpoint Qwen/Qwen3-Next-80B-A3B-Instruct's)",
            "80B total parameters (3B active)":
                "https://docs.nvidia.com/nemo/megatron-bridge/nightly/models/qwen/qwen3-next.html",
            "TP 2: the smallest that holds 160 GB of bf16 weights on 141 GB GPUs": "assumption (--paper-tp)",
        }),
    "kimi-k3": dict(
        name="Kimi-K3", gate="kda", layers=69, heads=96, head_k_dim=128, head_v_dim=128, conv_kernel=4,
        attention="mla", attention_layers=24, kv_lora_rank=512, qk_rope_head_dim=64, params=None, tp=8,
        log=dict(tp=8, kv_tokens=974656, max_mamba_cache_size=51),
        sources={
            "93 layers = 23 x (3 KDA + 1 MLA) + a last MLA: 69 KDA, 24 MLA; MLA 576 elements per token and layer "
            "(kv_lora_rank 512 + qk_rope_head_dim 64, as DeepSeek V3.1); KDA 96 heads, head dim 128, short conv 4; "
            "TP 8": NOTES,
            "the allocation log at TP 8 (bf16 KV, fp32 state): KV 974656 tokens (25.10 GB), max_mamba_cache_size 51 "
            "(52 slots allocated), rings with L = 16": NOTES,
            "full_attn_layers [4, 8, ..., 92, 93] of 93 (the 3:1 ratio, a full-attention last layer)":
                "https://huggingface.co/riverclouds/Kimi-K3-8L-dummy (the official config's fields it changes)",
            "kimi_linear_num_heads 96, kimi_linear_head_dim 128, kimi_linear_conv_kernel_size 4":
                "https://docs.nvidia.com/nemo/megatron-bridge/nightly/apidocs/bridge/bridge.models.kimi."
                "kimi_k3_provider.html",
            "weights: not stated in the notes; moonshotai/Kimi-K3 is listed at 2.8T parameters (5.6 TB in bf16, "
            "700 GB per GPU at TP 8)": "https://huggingface.co/moonshotai/collections",
        }),
}

# SGLang's static split, with where each number was read.
SGLANG_RULE = dict(
    slots_per_request={"no_buffer": 3, "extra_buffer_lazy": 4, "extra_buffer": 5}, mamba_full_memory_ratio=0.9,
    sources={
        "state slots per running request: 3 (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO), + 2 with extra_buffer "
        "and the overlap scheduler (5), + 1 lazy (4)":
            "sgl-project/sglang python/sglang/srt/mem_cache/kv_cache_configurator.py (commit 003fca80)",
        "state pool = rest x r / (1 + r); max_mamba_cache_size = that // bytes per slot; max running = "
        "max_mamba_cache_size // slots per request; MLA KV per token = (kv_lora_rank + qk_rope_head_dim) x layers "
        "x dtype bytes, on every TP rank; GQA: max(1, kv heads / TP) x (K + V dims)":
            "sgl-project/sglang python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py (commit 001ccef0)",
        "--mamba-full-memory-ratio defaults to 0.9":
            "https://docs.sglang.io/cookbook/autoregressive/Qwen/Qwen3.8-27B",
        "the ratio at which neither pool runs out first: r* = (S + D) x state bytes per slot / KV bytes per token / "
        "context": "https://raw.githubusercontent.com/sgl-project/sglang/f620d733d256c535b00d6e2f6b8e43c27fa81214/"
                   ".agents/skills/compute-mamba-ratio/SKILL.md",
        "16k in / 3k out capped at 16 running by 80 slots of 5 per request; the ReplaySSM rings (L = 16, per "
        "slot) come out of the state pool's budget": NOTES,
    })


def paper_state(m: dict, tp: int, requests: int, draft_tokens: int, *, sglang: bool = False,
                track: bool = False):
    """The `StateConfig` of one GPU of model `m` at tensor parallelism `tp`: `requests` slots, all running, verifying
    `draft_tokens` tokens; fp32 state, bf16 activations. `sglang`: SGLang's records (the fp32 log-decay for g, not
    KDA's gate input); `track`: a prefix cache's tracked copies. The conv channels are given as the mixer has them
    (KDA: q, k, v of every head; Gated DeltaNet: q, k of the key heads and v of the value heads)."""
    from specdec.replayssm.config import StateConfig
    heads = m["heads"] // tp
    if m["gate"] == "kda":
        conv = heads * (2 * m["head_k_dim"] + m["head_v_dim"])
    else:
        conv = (2 * m["key_heads"] * m["head_k_dim"] + m["heads"] * m["head_v_dim"]) // tp
    return StateConfig(num_layers=m["layers"], num_heads=heads, head_k_dim=m["head_k_dim"], head_v_dim=m["head_v_dim"],
                       conv_kernel=m["conv_kernel"], conv_dim=conv, gate=m["gate"],
                       gate_in_kernel=m["gate"] == "kda" and not sglang, max_requests=requests, max_running=requests,
                       num_verify_tokens=draft_tokens, ssm_dtype=torch.float32, act_dtype=torch.bfloat16,
                       track_interval=256 if track else None)


def paper_kv_layers(m: dict, tp: int) -> dict[int, list[tuple[int, int]]]:
    """`{layer: [(heads, dim) per stored tensor]}` of one GPU (`kv_cache.kv_specs`' argument): MLA its two latents
    `(1, kv_lora_rank)`, `(1, qk_rope_head_dim)` (`adapters.kv_dims`), GQA K and V of its KV heads / TP."""
    if m["attention"] == "mla":
        dims = [(1, m["kv_lora_rank"]), (1, m["qk_rope_head_dim"])]
    else:
        dims = [(max(1, m["kv_heads"] // tp), m["attn_head_dim"])] * 2
    return {i: dims for i in range(m["attention_layers"])}


def specdec_plan(m: dict, tp: int, requests: int, tokens: int, draft_tokens: int, *, track: bool = False,
                 kv_dp: bool = True) -> dict[str, int]:
    """Bytes by part of one GPU's buffers for `requests` requests of at most `tokens` tokens each, as the runner's
    memory plan counts them (`HybridRunner._memory_plan`): the state pool, the spec state of eager commit on the
    Triton kernels (a tree round's stack included) and each request's KV pages plus the scratch page and the block
    table. `kv_dp`: under TP the MLA latents of a request on the GPU that owns it only."""
    from specdec.kv_cache import kv_specs, num_pages_for
    from specdec.parallel import owned_rows
    from specdec.replayssm.plan import pool_specs, strategy_specs
    cfg = paper_state(m, tp, requests, draft_tokens, track=track)
    specs = strategy_specs(cfg, "replay", commit="eager", triton=True)
    pool = pool_specs(cfg)
    layers = paper_kv_layers(m, tp)
    if kv_dp and tp > 1 and m["attention"] == "mla":
        rows = owned_rows(cfg.num_slots, tp)  # the requests one GPU owns, at most
        kv = kv_specs(rows, tokens, layers, torch.bfloat16, group="dp", num_pages=rows * num_pages_for(tokens))
    else:
        kv = kv_specs(cfg.num_slots, tokens, layers, torch.bfloat16, num_pages=requests * num_pages_for(tokens))
    return {"state pool": sum(s.nbytes for n, s in specs.items() if n in pool),
            "rings": sum(s.nbytes for n, s in specs.items() if n not in pool),
            "KV cache": sum(s.nbytes for s in kv.values())}


def most(fits) -> int:
    """The largest n >= 0 with `fits(n)` (`fits` true up to some n, false after; `fits(0)` taken as true)."""
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def sglang_costs(m: dict, tp: int, draft_tokens: int) -> dict[str, int]:
    """SGLang's bytes on one GPU: a state slot with its ReplaySSM rings (`buffer_specs(layout="sglang")`: the pool's
    conv and ssm state and the six rings `[layer, slot, H, L, dim]`), a running row's verify conv windows
    (`intermediate_conv_window [layer, row, D, C, Kc-1]`) and a token of KV (page size 1, MLA on every GPU)."""
    from specdec.kv_cache import kv_specs, token_bytes
    from specdec.replayssm.plan import POOL_NAMES, buffer_specs, ring_names
    one, two = (buffer_specs(paper_state(m, tp, n, draft_tokens, sglang=True), layout="sglang") for n in (1, 2))
    step = lambda names: sum(two[n].nbytes - one[n].nbytes for n in names)  # noqa: E731  one slot / row more
    return {"slot": step((*POOL_NAMES, *ring_names("sglang"))), "row": step(("intermediate_conv_window",)),
            "token": token_bytes(kv_specs(2, 1, paper_kv_layers(m, tp), torch.bfloat16))}


def sglang_requests(rest: int, cost: dict, tokens: int, per_request: int, ratio: float | None) -> int:
    """Requests SGLang runs at once in `rest` bytes with `per_request` slots each: the state pool takes rest x ratio
    / (1 + ratio) in slots (less the conv windows of the rows they run), the KV pool what the slots leave;
    `ratio` None: the split at which both pools run out together."""
    if ratio is None:
        return max(0, (rest - cost["row"]) // (per_request * cost["slot"] + cost["row"] + tokens * cost["token"]))
    slots = int(rest * ratio / (1 + ratio) // (cost["slot"] + cost["row"] / per_request))
    by_state = slots // per_request
    kv_tokens = (rest - slots * cost["slot"] - (by_state + 1) * cost["row"]) // cost["token"]
    return max(0, min(by_state, kv_tokens // tokens))


def k3_log_bytes(m: dict, draft_tokens: int) -> int:
    """The caches of the notes' K3 allocation log at its TP: its KV tokens and its slots (max_mamba_cache_size + 1)
    of fp32 state with SGLang's rings."""
    from specdec.replayssm.plan import POOL_NAMES, buffer_specs, ring_names
    log = m["log"]
    specs = buffer_specs(paper_state(m, log["tp"], log["max_mamba_cache_size"], draft_tokens, sglang=True),
                         layout="sglang")
    state = sum(specs[n].nbytes for n in (*POOL_NAMES, *ring_names("sglang")))
    return state + log["kv_tokens"] * sglang_costs(m, log["tp"], draft_tokens)["token"]


def part_d(a) -> dict:
    from specdec.kv_cache import PAGE_SIZE, num_pages_for
    D, tokens = a.paper_draft_tokens, a.paper_in + a.paper_out
    worst = tokens + D  # specdec reserves a request's worst case: prompt, new tokens and one verify window
    ratios = (a.mamba_full_memory_ratio, None)
    ends = (min(SGLANG_RULE["slots_per_request"].values()), max(SGLANG_RULE["slots_per_request"].values()))
    models, assumptions = {}, []
    for key, m in PAPER_MODELS.items():
        tp = a.paper_tp[key]
        if m["params"] is None:
            cache = int(a.k3_cache_gib * GiB) if a.k3_cache_gib is not None else k3_log_bytes(m, D)
            weights, source = None, ("--k3-cache-gib" if a.k3_cache_gib is not None else
                                     f"the notes' K3 TP-{m['log']['tp']} allocation log")
            assumptions.append(f"{m['name']}: weights not stated in the notes (2.8T parameters, listed on "
                               f"huggingface.co, do not fit 8 x {a.gpu_gb:g} GB in bf16); assumed: its caches get "
                               f"{cache / GiB:.2f} GiB per GPU, {source} (KV {m['log']['kv_tokens']} tokens, "
                               f"{m['log']['max_mamba_cache_size'] + 1} state slots with their rings)")
        else:
            weights = int(m["params"] * 2 / tp)
            cache = int(a.gpu_gb * GB * (1 - a.headroom)) - weights
            source = f"{a.gpu_gb:g} GB x {1 - a.headroom:g} - {m['params'] / 1e9:g}B x 2 bytes / TP {tp}"
            if cache <= 0:
                assumptions.append(f"{m['name']}: {weights / GB:.1f} GB of weights per GPU at TP {tp} leave no "
                                   f"memory for caches: no request fits")
        fits = lambda n, **kw: sum(specdec_plan(m, tp, n, worst, D, **kw).values()) <= cache  # noqa: E731
        one, two = (specdec_plan(m, tp, n, worst, D) for n in (1, 2))
        cost = sglang_costs(m, tp, D)
        row = dict(name=m["name"], tp=tp, weights_bytes=weights, cache_bytes=cache, cache_source=source,
                   kv_bytes_per_token=cost["token"], kv_pages_per_request=num_pages_for(worst),
                   kv_bytes_per_request=num_pages_for(worst) * PAGE_SIZE * cost["token"],
                   state_bytes_per_request=two["state pool"] - one["state pool"],
                   spec_bytes_per_running=two["rings"] - one["rings"],
                   sglang_slot_bytes=cost["slot"], sglang_row_bytes=cost["row"],
                   kv_data_parallel=tp > 1 and m["attention"] == "mla",
                   specdec=most(fits), specdec_prefix_cache=most(lambda n: fits(n, track=True)),
                   sglang={("tuned" if r is None else f"ratio_{r:g}"): {
                       str(k): sglang_requests(cache, cost, tokens, k, r) for k in ends} for r in ratios})
        if row["kv_data_parallel"]:
            row["specdec_kv_every_gpu"] = most(lambda n: fits(n, kv_dp=False))
            row["specdec_prefix_cache_kv_every_gpu"] = most(lambda n: fits(n, track=True, kv_dp=False))
        models[key] = row
    if any(r["kv_data_parallel"] for r in models.values()):
        assumptions.append("specdec under TP: the MLA latents of a request on the GPU that owns it (data-parallel "
                           "rows); wrap(memory=) does not take a tp_group yet, so the TP rows are the plan's")
    assumptions += ["SGLang: the ReplaySSM rings of each slot (layout sglang, L = 16) in the state pool's budget; "
                    "the verify conv windows of the running rows from it too; its pool's extra slot left out; KV "
                    "per token (page size 1) for in + out tokens",
                    "specdec +prefix: two tracked copies of each slot's state (track_interval); the prefix "
                    "cache's entries are evictable and not counted"]
    r0 = f"ratio_{a.mamba_full_memory_ratio:g}"
    print(f"(d) on paper: one {a.gpu_gb:g} GB GPU ({a.headroom:.0%} headroom, weights bf16 / TP), {a.paper_in} in + "
          f"{a.paper_out} out, D = {D}; KV bf16 (specdec pages of 16), state fp32; requests at once")
    print(f"{'model':<20} {'TP':>2} {'caches GiB':>10} {'KV KiB/tok':>10} {'state MiB':>9} {'spec MiB':>8} "
          f"{'specdec':>7} {'+prefix':>7} {'SGLang r=' + format(a.mamba_full_memory_ratio, 'g'):>12} "
          f"{'SGLang tuned':>12}")
    for r in models.values():
        fixed, tuned = (" / ".join(str(r["sglang"][k][str(n)]) for n in ends) for k in (r0, "tuned"))
        print(f"{r['name']:<20} {r['tp']:>2} {r['cache_bytes'] / GiB:>10.2f} {r['kv_bytes_per_token'] / 1024:>10.2f} "
              f"{r['state_bytes_per_request'] / MiB:>9.2f} {r['spec_bytes_per_running'] / MiB:>8.2f} "
              f"{r['specdec']:>7} {r['specdec_prefix_cache']:>7} {fixed:>12} {tuned:>12}")
    print(f"state: one request's conv windows + fp32 state per GPU; spec: specdec's rings, conv inputs and tree "
          f"stack per running request; SGLang: {ends[0]} / {ends[1]} state slots per request")
    for r in models.values():
        if r["kv_data_parallel"]:
            print(f"{r['name']}: MLA latents data-parallel over the requests (1/{r['tp']} of them per GPU); with "
                  f"every latent on every GPU, as SGLang keeps them: specdec {r['specdec_kv_every_gpu']}, +prefix "
                  f"{r['specdec_prefix_cache_kv_every_gpu']}")
    for line in assumptions:
        print(f"assumed: {line}")
    sources = {m["name"]: m["sources"] for m in PAPER_MODELS.values()}
    sources["SGLang"] = SGLANG_RULE["sources"]
    print("sources:")
    for what, table in sources.items():
        for numbers, where in table.items():
            print(f"  {what}: {numbers} <- {where}")
    return {"workload": dict(input_tokens=a.paper_in, output_tokens=a.paper_out, draft_tokens=D, gpu_gb=a.gpu_gb,
                             headroom=a.headroom, page_size=PAGE_SIZE,
                             mamba_full_memory_ratio=a.mamba_full_memory_ratio,
                             slots_per_request=SGLANG_RULE["slots_per_request"]),
            "models": models, "assumptions": assumptions, "sources": sources}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--parts", default="a,b,c")
    p.add_argument("--drafter", default="ngram", help="(a) and (b): ngram, or none")
    p.add_argument("--conv-lengths", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--message-tokens", type=int, default=512)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--long", type=int, default=16384)
    p.add_argument("--short", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--budget-mib", type=float, default=64)
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gpu-gb", type=float, default=141, help="(d): one GPU's memory, GB (10^9 bytes)")
    p.add_argument("--headroom", type=float, default=0.1, help="(d): the GPU's share kept for activations")
    p.add_argument("--paper-in", type=int, default=16384, help="(d): prompt tokens per request")
    p.add_argument("--paper-out", type=int, default=3072, help="(d): new tokens per request")
    p.add_argument("--paper-draft-tokens", type=int, default=8, help="(d): D, tokens per verify")
    p.add_argument("--paper-tp", default=",".join(f"{k}={m['tp']}" for k, m in PAPER_MODELS.items()),
                   help="(d): tensor parallelism per model, name=tp")
    p.add_argument("--mamba-full-memory-ratio", type=float, default=SGLANG_RULE["mamba_full_memory_ratio"],
                   help="(d): SGLang's fixed split of the caches' memory, state : KV")
    p.add_argument("--k3-cache-gib", type=float, default=None,
                   help="(d): assumption, the GiB one GPU has for K3's caches (its weights are not stated); "
                        "default: the bytes of the reference notes' K3 TP-8 allocation log")
    p.add_argument("--agent-tokens", type=int, default=17500, help="(e): the conversation's tokens")
    p.add_argument("--agent-step", type=int, default=2000, help="(e): an edit every this many tokens")
    p.add_argument("--agent-cache-mib", type=float, default=64, help="(e): the prefix cache's budget")
    p.add_argument("--states-per-path", type=int, default=None,
                   help="(a) and (e): the prefix cache's cap on entries per path (SpecConfig.states_per_path)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    parts = common.split_list(a.parts)
    if not parts or set(parts) - {"a", "b", "c", "d", "e"}:
        p.error(f"--parts: expected a comma list of a, b, c, d, e, got {a.parts!r}")
    if a.repeats < 3:
        p.error(f"--repeats: expected >= 3 (a median of at least 3), got {a.repeats}")
    if "d" in parts:
        check_paper_args(p, a)
    a.drafter = None if a.drafter == "none" else a.drafter
    result = {"machine": common.machine_info("cpu"), "threads": None, "args": vars(a)}
    if set(parts) & {"a", "b", "c", "e"}:
        model_dir = common.input_args(p, a.model)
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        result["threads"] = timing.torch_threads(model, a.threads)
        print(f"memory_scale, {a.model}, threads {result['threads']}")
        for part, fn, key in (("a", part_a, "conversation"), ("b", part_b, "workload"), ("c", part_c, "decode"),
                              ("e", part_e, "agent_loop")):
            if part in parts:
                result[key] = fn(model, tokenizer, a)
    if "d" in parts:
        result["paper"] = part_d(a)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return result


def check_paper_args(p, a) -> None:
    """(d)'s options, checked (`parser.error` naming the option); `a.paper_tp` becomes `{model: tp}`."""
    for flag, value, low in (("--gpu-gb", a.gpu_gb, 1), ("--paper-in", a.paper_in, 1), ("--paper-out", a.paper_out, 1),
                             ("--paper-draft-tokens", a.paper_draft_tokens, 1)):
        if value < low:
            p.error(f"{flag}: expected >= {low}, got {value}")
    if not 0 <= a.headroom < 1:
        p.error(f"--headroom: expected a share in [0, 1), got {a.headroom}")
    if a.mamba_full_memory_ratio <= 0:
        p.error(f"--mamba-full-memory-ratio: expected > 0, got {a.mamba_full_memory_ratio}")
    if a.k3_cache_gib is not None and a.k3_cache_gib <= 0:
        p.error(f"--k3-cache-gib: expected > 0, got {a.k3_cache_gib}")
    tps = {k: m["tp"] for k, m in PAPER_MODELS.items()}
    for item in common.split_list(a.paper_tp):
        name, _, value = item.partition("=")
        if name.strip() not in tps or not value.strip().isdigit() or int(value) < 1:
            p.error(f"--paper-tp: expected name=tp with a name of {', '.join(tps)} and tp >= 1, got {item!r}")
        tps[name.strip()] = int(value)
    for key, tp in tps.items():
        m = PAPER_MODELS[key]
        if m["heads"] % tp or m.get("key_heads", tp) % tp:
            p.error(f"--paper-tp: {m['name']}'s {m['heads']} recurrent heads do not split over TP {tp}")
    a.paper_tp = tps


if __name__ == "__main__":
    main()
