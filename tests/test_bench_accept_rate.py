"""`bench/accept_rate.py` on a tiny saved Kimi-Linear: run as a user would (subprocess), JSON shape, the
on-the-fly losslessness check, a missing trained drafter reported as skipped, `--cuda-graph` (static shapes on a
CPU, plain decoding included) and `--budget-s`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench_scripts import load_bench
from tiny_models import save_tiny

from specdec import plot

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "accept_rate.py"
NEW = 12
PROMPTS = [
    {"id": "code-0", "kind": "code", "source": "textwrap.py",
     "prompt": "def wrap(text, width=70, **kwargs):\n    w = TextWrapper(width=width, **kwargs)\n    return w.wrap(text)\n\n"
               "def fill(text, width=70, **kwargs):\n    w = TextWrapper(width=width, **kwargs)\n"},
    {"id": "code-1", "kind": "code", "source": "textwrap.py", "prompt": "    def _split(self, text):\n        if self."},
    {"id": "prose-2", "kind": "prose", "source": "topic:wrap",
     "prompt": "Wrap a single paragraph of text, returning a list of wrapped lines. The text is wrapped so"},
]
DRAFTER_KEYS = {"tau", "alpha", "per_position", "tokens_per_s_spec", "tokens_per_s_plain", "speedup",
                "spec_state_bytes_replay", "spec_state_bytes_snapshot", "identical", "speedup_per_repeat", "spread",
                "noisy", "tokens_per_s_transformers", "speedup_vs_transformers", "identical_transformers",
                "time_parts", "tokens_per_s_plain_graph", "speedup_vs_plain_graph"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """-> (model directory, prompts.jsonl) in a temporary folder."""
    root = tmp_path_factory.mktemp("accept_rate")
    save_tiny(root / "model", "kimi_linear")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root / "model", prompts


def test_ngram_json_shape_and_lossless(saved, tmp_path):
    model, prompts = saved
    out = tmp_path / "out.json"
    args = [sys.executable, SCRIPT, "--model", model, "--prompts", prompts, "--drafters", "ngram",
            "--max-new-tokens", NEW, "--device", "cpu", "--json", out]  # a tiny model: 1 thread by default
    if plot.available():
        args += ["--plot", tmp_path / "out.png"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ngram" in proc.stdout and "tau" in proc.stdout  # the printed table
    assert "WARNING" not in proc.stderr

    res = json.loads(out.read_text())
    assert set(res) == {"machine", "model", "settings", "drafters"}
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["threads"] == 1
    assert "torch threads 1" in proc.stdout and "median of 3 interleaved repeats" in proc.stdout
    assert res["model"]["params"] > 0 and res["model"]["dtype"] == "float32"
    s = res["settings"]
    assert (s["gamma"], s["temperature"], s["max_new_tokens"], s["num_prompts"]) == (7, 0.0, NEW, 3)
    assert (s["repeats"], s["threads"]) == (3, 1)
    assert set(res["drafters"]) == {"ngram"}
    r = res["drafters"]["ngram"]
    assert set(r) == DRAFTER_KEYS
    assert r["identical"] is True
    assert r["tokens_per_s_plain_graph"] is None and r["speedup_vs_plain_graph"] is None  # no --cuda-graph
    assert (s["cuda_graph"], s["graph_mode"], s["budget_s"]) == (False, None, None)
    # transformers' own greedy generate, timed in the same interleave: the same tokens
    assert s["reference"] == "transformers" and "tok/s hf" in proc.stdout
    assert r["identical_transformers"] is True and r["tokens_per_s_transformers"] > 0
    assert r["speedup_vs_transformers"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_transformers"])
    assert r["tau"] >= 1 and 0 <= r["alpha"] <= 1
    assert all(0 <= a <= 1 for a in r["per_position"]) and len(r["per_position"]) <= 7
    assert r["tokens_per_s_spec"] > 0 and r["tokens_per_s_plain"] > 0
    assert r["speedup"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_plain"])
    assert 0 < r["spec_state_bytes_replay"] < r["spec_state_bytes_snapshot"]
    assert len(r["speedup_per_repeat"]) == 3 and all(x > 0 for x in r["speedup_per_repeat"])
    assert r["spread"] >= 0 and r["noisy"] == (r["spread"] > 0.25)
    assert ("timing is noisy on this machine: ngram" in proc.stdout) == r["noisy"]
    # where a generate goes, by the engine's timers: the parts make up the round, the rounds commit the new
    # tokens after the first (tau tokens each), and the budget is the round that would reach 2.5x plain's time
    t = r["time_parts"]
    assert "round budget at 2.5x" in proc.stdout
    assert min(t["prefill_ms"], t["round_ms"], t["verify_ms"], t["plain_step_ms"], t["plain_prefill_ms"]) > 0
    assert t["draft_ms"] >= 0 and t["other_ms"] >= 0
    assert t["draft_ms"] + t["verify_ms"] + t["other_ms"] == pytest.approx(t["round_ms"])
    assert 1 <= t["rounds_per_generate"] <= NEW - 1
    assert t["rounds_per_generate"] * r["tau"] <= NEW - 1 + 1e-9
    assert t["plain_generate_ms"] > t["plain_prefill_ms"] + t["plain_step_ms"]
    assert t["target_speedup"] == 2.5
    assert t["round_budget_ms"] == pytest.approx((t["plain_generate_ms"] / 2.5 - t["prefill_ms"])
                                                 / t["rounds_per_generate"])
    if plot.available():  # the picture draws the numbers of the JSON (`specdec.plot`; its drawing: test_demo.py)
        assert plot.read_numbers(tmp_path / "out.png") == {"ngram": {k: r[k] for k in plot.KEYS}}


def test_missing_trained_drafter_is_skipped(saved, tmp_path, capsys):
    model, prompts = saved
    bench = load_bench("accept_rate")
    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    try:
        rc = bench.main(["--model", str(model), "--prompts", str(prompts), "--drafters", "ngram,mtp",
                         "--max-new-tokens", "4", "--max-prompts", "1", "--device", "cpu", "--threads", "1",
                         "--reference", "none", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())["drafters"]
    assert list(res) == ["ngram", "mtp"]
    assert res["ngram"]["identical"] is True and "skipped" not in res["ngram"]
    # --reference none: transformers' generate is not run
    assert all(res["ngram"][k] is None for k in ("tokens_per_s_transformers", "speedup_vs_transformers",
                                                 "identical_transformers"))
    reason = res["mtp"]["skipped"]
    assert "no trained drafter" in reason and str(Path(model) / "drafters" / "mtp") in reason
    assert all(res["mtp"][k] is None for k in DRAFTER_KEYS)
    printed = capsys.readouterr().out
    assert "mtp" in printed and "skipped: no trained drafter" in printed


def test_prompt_selection_round_robin_over_kinds(tmp_path):
    bench = load_bench("accept_rate")
    f = tmp_path / "p.jsonl"
    recs = [{"id": f"c{i}", "kind": "code", "prompt": "x"} for i in range(3)]
    recs += [{"id": f"p{i}", "kind": "prose", "prompt": "y"} for i in range(2)]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [p["id"] for p in bench.load_prompts(str(f), ["code", "prose"], 3)] == ["c0", "p0", "c1"]
    assert [p["id"] for p in bench.load_prompts(str(f), ["prose"], None)] == ["p0", "p1"]
    assert len(bench.load_prompts(str(f), ["code", "prose"], None)) == 5


def test_drafter_options_are_passed_and_checked(saved, tmp_path, capsys):
    """`NAME:key=value` reaches the drafter: a different n-gram setting is a separate entry, an unknown
    option is reported as skipped with the drafter's own error, and a malformed spec is a usage error."""
    model, prompts = saved
    bench = load_bench("accept_rate")
    assert bench.parse_drafter("eagle:num_nodes=16:topk=4") == ("eagle", {"num_nodes": 16, "topk": 4})
    assert bench.parse_drafter("dspark:confidence_threshold=0.5") == ("dspark", {"confidence_threshold": 0.5})
    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    try:
        rc = bench.main(["--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "6",
                         "--drafters", "ngram,ngram:max_ngram=1,ngram:min_ngram=4,ngram:bogus=1",
                         "--max-prompts", "1", "--device", "cpu", "--threads", "1", "--json", str(out)])
        with pytest.raises(SystemExit) as e:
            bench.main(["--model", str(model), "--prompts", str(prompts), "--drafters", "ngram:max_ngram"])
        assert e.value.code == 2
        with pytest.raises(SystemExit) as e:
            bench.main(["--model", str(model), "--prompts", str(prompts), "--target-speedup", "0"])
        assert e.value.code == 2
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())["drafters"]
    assert list(res) == ["ngram", "ngram:max_ngram=1", "ngram:min_ngram=4", "ngram:bogus=1"]
    assert res["ngram"]["identical"] is True and res["ngram:max_ngram=1"]["identical"] is True
    assert "min_ngram" in res["ngram:min_ngram=4"]["skipped"]  # 4 > max_ngram 3: the drafter's own check
    assert "ValueError: bogus: not an option of the ngram drafter" in res["ngram:bogus=1"]["skipped"]
    err = capsys.readouterr().err
    assert "--drafters" in err and "--target-speedup: expected > 0, got 0.0" in err


def test_cuda_graph_flag_and_budget(saved, tmp_path, capsys):
    """`--cuda-graph` on a CPU: every engine, plain decoding's too, with static shapes (wrap refuses CUDA graphs
    off CUDA); the speculative output equals the static plain output and transformers' greedy generate, and the
    plain-graph fields are the plain baseline's. A spent `--budget-s` starts no drafter: each is skipped, exit 0."""
    model, prompts = saved
    bench = load_bench("accept_rate")
    out, spent = tmp_path / "out.json", tmp_path / "spent.json"
    threads = torch.get_num_threads()
    common = ["--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "6", "--max-prompts", "2",
              "--device", "cpu", "--threads", "1"]
    try:
        rc = bench.main(common + ["--drafters", "ngram", "--cuda-graph", "--json", str(out)])
        rc_spent = bench.main(common + ["--drafters", "ngram,ngram:max_ngram=1", "--budget-s", "1e-9", "--json",
                                        str(spent)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0 and rc_spent == 0
    res = json.loads(out.read_text())
    s, r = res["settings"], res["drafters"]["ngram"]
    assert (s["cuda_graph"], s["graph_mode"]) == (True, "static")
    assert "every engine with static shapes (plain decoding too" in capsys.readouterr().out
    assert set(r) == DRAFTER_KEYS
    assert r["identical"] is True and r["identical_transformers"] is True
    assert r["tokens_per_s_plain_graph"] == r["tokens_per_s_plain"] > 0
    assert r["speedup_vs_plain_graph"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_plain_graph"])
    assert r["speedup_vs_transformers"] == pytest.approx(r["tokens_per_s_spec"] / r["tokens_per_s_transformers"])
    res = json.loads(spent.read_text())
    assert res["settings"]["budget_s"] == 1e-9
    assert list(res["drafters"]) == ["ngram", "ngram:max_ngram=1"]
    assert all(r["skipped"] == "budget of 1e-09 s spent" for r in res["drafters"].values())
