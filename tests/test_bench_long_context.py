"""`bench/long_context.py` on the embedded model at tiny contexts and two prompts: every context and drafter measured,
the JSON what `main` returns, each drafter's greedy tokens equal to plain decoding's and to transformers' own generate,
and each context its prompt's tokens at its end."""

import importlib.util
import json

import torch

from bench_scripts import load_bench

ROW_KEYS = {"ttft_s", "ttft_cpu_s", "ms_per_token", "cpu_ms_per_token", "tau", "rounds", "round_ms", "round_cpu_ms",
            "draft_ms", "verify_ms", "rest_ms", "draft_share", "spread", "cpu_spread", "ms_per_token_all",
            "cpu_ms_per_token_all", "ttft_s_all", "ttft_cpu_s_all", "tau_all", "tokens", "identical", "speedup",
            "speedup_cpu", "speedup_all", "speedup_cpu_all", "round_vs_plain_step", "round_vs_plain_step_cpu",
            "identical_to_plain"}
NEW = 8


def test_tiny_contexts(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.hf_compat import transformers_generate

    bench = load_bench("long_context")
    out = tmp_path / "lc.json"
    args = ["--contexts", "512,64", "--drafters", "none,ngram,dspark", "--long-from", "512", "--long-drafters",
            "none,dspark", "--new-tokens", str(NEW), "--repeats", "1", "--prompts", "code-2,code-7", "--clock", "cpu",
            "--json", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(tmp_path / "lc.png")]
    threads = torch.get_num_threads()
    try:
        res = bench.main(args)
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert res["threads"] == 1 and res["skipped"] == {}
    assert [pr["id"] for pr in res["prompts"]] == ["code-2", "code-7"]
    assert list(res["contexts"]) == ["64", "512"]
    # 512 tokens is at --long-from: only the long drafters run there
    assert list(res["contexts"]["64"]["drafters"]) == ["none", "ngram", "dspark"]
    assert list(res["contexts"]["512"]["drafters"]) == ["none", "dspark"]

    model = AutoModelForCausalLM.from_pretrained(res["model"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(res["model"])
    prompts = [bench.find_prompt(bench.common.resolve_model_dir("embedded"), pid) for pid in ("code-2", "code-7")]
    for c, ctx in res["contexts"].items():
        expected = {}
        for prompt in prompts:
            tail = tokenizer(prompt["prompt"])["input_ids"]
            ids, files = bench.context_ids(tokenizer, int(c), prompt)
            rec = ctx["prompts"][prompt["id"]]
            assert len(ids) == int(c) and bench.ids_hash(ids) == rec["ids_sha256"] and files == rec["files"]
            assert ids[-min(len(tail), len(ids)):] == tail[-len(ids):]  # the context ends with the prompt
            assert prompt["source"] not in files
            assert bool(files) == (int(c) > len(tail))  # held-out files before the prompt where it is shorter
            # transformers' own greedy decode of the same context, outside specdec
            ref = transformers_generate(model, torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW)
            expected[prompt["id"]] = ref[0, len(ids):].tolist()
        for name, r in ctx["drafters"].items():
            assert set(r) == ROW_KEYS, name
            assert r["tokens"] == expected, (c, name)
            assert r["identical"] is True and r["identical_to_plain"] is True
            assert r["ttft_s"] > 0 and r["ms_per_token"] > 0 and r["round_ms"] > 0
            assert len(prompts) <= r["rounds"] <= len(prompts) * (NEW - 1) and r["tau"] >= 1
            # the rounds between each first token and last, pooled: ms/token x tokens = round ms x rounds
            for ms, rnd in (("ms_per_token", "round_ms"), ("cpu_ms_per_token", "round_cpu_ms")):
                assert abs(r[ms] * len(prompts) * (NEW - 1) - r[rnd] * r["rounds"]) <= 1e-6 * r[rnd] * r["rounds"]
            assert r["ttft_cpu_s"] > 0 and r["cpu_ms_per_token"] > 0
            assert 0 <= r["draft_share"] <= 1 and r["verify_ms"] > 0
            assert len(r["ms_per_token_all"]) == len(r["ttft_s_all"]) == 1
        plain = ctx["drafters"]["none"]
        assert plain["tau"] == 1 and plain["rounds"] == len(prompts) * (NEW - 1)
        assert plain["speedup"] == plain["speedup_cpu"] == 1 and plain["speedup_cpu_all"] == [1.0]
        for r in ctx["drafters"].values():  # one repeat: its pair's ratio is the medians'
            assert r["speedup_all"] == [r["speedup"]] and r["speedup_cpu_all"] == [r["speedup_cpu"]]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "lc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeats_interleave_across_drafters(monkeypatch):
    """At one context the drafters' repeats interleave, the order rotated each repeat (none, ngram; ngram, none;
    none, ngram), each repeat a real measurement of its own engine, and each drafter's summary holds its own
    repeats."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    bench = load_bench("long_context")
    model_dir = bench.common.resolve_model_dir("embedded")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids, _ = bench.context_ids(tokenizer, 64, bench.find_prompt(model_dir, "code-2"))
    calls, made, real_measure, real_wrap = [], {}, bench.measure_once, bench.specdec.wrap

    def wrap(model, *, drafter, **kw):
        made[drafter or "none"] = engine = real_wrap(model, drafter=drafter, **kw)
        return engine

    def measure_once(engine, *args):
        calls.append(next(name for name, e in made.items() if e is engine))
        return real_measure(engine, *args)

    monkeypatch.setattr(bench.specdec, "wrap", wrap)
    monkeypatch.setattr(bench, "measure_once", measure_once)
    a = SimpleNamespace(options={}, new_tokens=4, repeats=3)
    out = bench.run_context(model, {"none": None, "ngram": "ngram"}, {"code-2": torch.tensor(ids)}, a)
    assert calls == ["none", "ngram", "ngram", "none", "none", "ngram"]
    assert list(out) == ["none", "ngram"]
    for r in out.values():
        assert len(r["ms_per_token_all"]) == 3 and r["identical"] is True
    assert out["none"]["tau"] == 1 and out["none"]["tokens"] == out["ngram"]["tokens"]
