"""`bench/memory_scale.py` on the embedded model at small settings: (a) the cache's KV copies against the distinct KV
of a growing conversation, (b) one budget run with pages and with a static reservation of the same bytes, with
identical outputs and the paged side running more requests at once, (c) the decode cost per context."""

import json

from bench_scripts import load_bench


def test_tiny_settings(tmp_path):
    out = tmp_path / "memory.json"
    res = load_bench("memory_scale").main([
        "--conv-lengths", "96,192", "--message-tokens", "48", "--reply-tokens", "8",
        "--requests", "6", "--long", "4096", "--short", "32", "--long-share", "0.34", "--max-new-tokens", "4",
        "--budget-mib", "14", "--contexts", "64,128", "--decode-tokens", "4", "--repeats", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert "paper" not in res  # (d) only when asked
    rows = res["conversation"]["rows"]
    assert [r["tokens"] >= t for r, t in zip(rows, (96, 192))] == [True, True]
    for r in rows:  # the entries' pages are the conversation's KV, counted once (up to a page of each's own)
        assert r["distinct_kv_bytes"] >= r["entry_pages_bytes"] > 0 and r["entries"] >= 2
        assert r["copies_bytes"] > r["entry_pages_bytes"]
    w = res["workload"]
    assert w["identical"] is True and w["sizes"].count(4096) == 2
    assert w["paged"]["most_at_once"] > w["static"]["most_at_once"] == w["static"]["lanes"], w
    assert w["paged"]["wall_s"] > 0 and w["static"]["tokens_per_s"] > 0
    assert set(res["decode"]) == {"64", "128"} and all(r["ms_per_token"] > 0 for r in res["decode"].values())


def test_paper_part_d(tmp_path):
    """(d) on paper: the budget, the KV bytes per token and the state bytes recomputed here from the config numbers
    (by hand) and from replayssm.plan; specdec's count within one of the per-request quotient; specdec at least
    SGLang's count at 3 slots per request."""
    import torch

    from specdec.replayssm.config import StateConfig
    from specdec.replayssm.plan import buffer_specs

    out = tmp_path / "paper.json"
    res = load_bench("memory_scale").main(["--parts", "d", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert set(res) >= {"paper", "args"} and not {"conversation", "workload", "decode"} & set(res)
    paper = res["paper"]
    models = paper["models"]
    assert set(models) == {"kimi-linear", "qwen3-next", "kimi-k3"}
    # bf16 KV per token on one GPU: MLA (kv_lora_rank 512 + rope 64) per layer, on every GPU; GQA 2 KV heads / TP 2
    assert models["kimi-linear"]["kv_bytes_per_token"] == 7 * (512 + 64) * 2
    assert models["kimi-k3"]["kv_bytes_per_token"] == 24 * (512 + 64) * 2
    assert models["qwen3-next"]["kv_bytes_per_token"] == 12 * 2 * (2 // 2) * 256 * 2
    assert models["kimi-linear"]["cache_bytes"] == int(141e9 * 0.9) - 48e9 * 2
    assert models["qwen3-next"]["cache_bytes"] == int(141e9 * 0.9) - 80e9 * 2 // 2
    assert models["kimi-k3"]["weights_bytes"] is None and "log" in models["kimi-k3"]["cache_source"]

    # one slot of fp32 state + bf16 conv window per GPU: (layers, heads / TP, K, V, conv channels / TP)
    shapes = {"kimi-linear": (20, 32, 128, 128, 32 * 384), "kimi-k3": (69, 12, 128, 128, 12 * 384),
              "qwen3-next": (36, 16, 128, 128, (2 * 16 * 128 + 32 * 128) // 2)}
    for key, (layers, heads, k, v, conv) in shapes.items():
        specs = buffer_specs(StateConfig(num_layers=layers, num_heads=heads, head_k_dim=k, head_v_dim=v,
                                         conv_dim=conv, max_requests=1, ssm_dtype=torch.float32,
                                         act_dtype=torch.bfloat16))
        slot = (specs["ssm_state"].nbytes + specs["conv_state"].nbytes) // 2  # two slots: one and the null slot
        assert slot == layers * (heads * k * v * 4 + conv * 3 * 2)
        m = models[key]
        assert m["state_bytes_per_request"] == slot, key
        # SGLang's slot holds the state and six rings of depth L = 16 (bf16 d, k, rawv, rawk; fp32 g, beta)
        gate = k if key != "qwen3-next" else 1
        rings = layers * heads * 16 * (4 * k * 2 + gate * 4 + 4)
        assert m["sglang_slot_bytes"] == slot + rings, key

        kv = m["kv_bytes_per_token"] * (-(-(16384 + 3072 + 8) // 16) * 16)  # pages of 16 for in + out + D
        owners = m["tp"] if m["kv_data_parallel"] else 1  # each GPU the latents of the requests it owns
        n = 0  # N requests: N + 1 slots and spec rows (the null slot's too), KV of ceil(N / owners) requests
        while (n + 2) * (slot + m["spec_bytes_per_running"]) + -(-(n + 1) // owners) * kv <= m["cache_bytes"]:
            n += 1
        assert abs(m["specdec"] - n) <= 1, (key, m["specdec"], n)
        assert m["spec_bytes_per_running"] > 0 and m["specdec_prefix_cache"] < m["specdec"]
        tuned3 = (m["cache_bytes"] - m["sglang_row_bytes"]) // (
            3 * m["sglang_slot_bytes"] + m["sglang_row_bytes"] + (16384 + 3072) * m["kv_bytes_per_token"])
        assert m["sglang"]["tuned"]["3"] == tuned3
        for split in ("ratio_0.9", "tuned"):
            assert m["specdec"] >= m["sglang"][split]["3"] >= m["sglang"][split]["5"] > 0, (key, split)
    k3 = models["kimi-k3"]
    assert k3["specdec"] >= k3["specdec_kv_every_gpu"] >= k3["sglang"]["tuned"]["3"]
    assert paper["sources"]["Kimi-K3"] and paper["sources"]["SGLang"] and paper["assumptions"]


def test_agent_loop_at_small_settings(tmp_path):
    res = load_bench("memory_scale").main([
        "--parts", "e", "--agent-tokens", "900", "--agent-step", "300", "--agent-cache-mib", "16",
        "--json", str(tmp_path / "e.json")])
    rows = res["agent_loop"]["rows"]
    assert [r["edit"] for r in rows] == [300, 600]
    for r in rows:  # each edit from the boundary (every 256 tokens) before it, with the output of no cache
        assert r["identical"] is True and 0 <= r["gap"] <= 256, r
