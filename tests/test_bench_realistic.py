"""`bench/realistic.py` at its tiny preset on the CPU, through its `main`: the JSON's fields, the parameter count
against a model built from the same config, the projection recomputed from the JSON's own figures, the tau picked
by each round's tree, and a budget that runs out still writing the JSON."""

import json

import pytest
import torch

from bench_scripts import load_bench

DRAFTERS = ["ngram", "mtp", "dspark", "eagle"]
FAST = ["--tiny", "--device", "cpu", "--dtype", "float32", "--repeats", "2", "--warmup", "1", "--round-repeats", "1",
        "--new-tokens", "6", "--prompt-tokens", "16"]


def write_tau(path):
    # eagle twice: its plain key (the defaults of the device the file names) and a key naming a tree
    drafters = {"ngram": {"tau": 2.0}, "mtp": {"tau": 3.0}, "dspark": {"tau": 3.5}, "eagle": {"tau": 4.0},
                "eagle:num_nodes=16:topk=2": {"tau": 4.5}, "eagle:num_nodes=48:topk=8": {"tau": 5.0}}
    path.write_text(json.dumps({"settings": {"device": "cpu"}, "drafters": drafters}))
    return path


def test_tiny_run(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    bench = load_bench("realistic")
    tau_json, out = write_tau(tmp_path / "tau.json"), tmp_path / "out.json"
    rc = bench.main(FAST + ["--tau-json", str(tau_json), "--budget-s", "300", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    for key in ("params", "dtype", "device", "step_1_ms", "chain_8_ms", "tree_49_ms", "ratios", "round_ms", "tau",
                "tau_source", "projected_speedup"):
        assert key in res, key
    assert (res["dtype"], res["device"], res["graphs"], res["budget_exhausted"]) == ("float32", "cpu", False, False)
    assert "without CUDA graphs" in printed and f"torch threads {res['threads']}" in printed

    # the parameter count: a model of transformers' class from the same config, built here
    expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(bench.model_config("tiny")).parameters())
    assert res["params"] == expected and 1e6 < expected < 10e6
    assert f"{expected:,} params" in printed

    assert set(res["ratios"]) == {"chain_8", "tree_49"}
    for name in ("chain_8", "tree_49"):
        assert res["ratios"][name] == pytest.approx(res[f"{name}_ms"] / res["step_1_ms"], rel=1e-12)
        assert res["steps"][name]["graphed"] is False and len(res["steps"][name]["samples_ms"]) == 2
    assert res["steps"]["tree_49"]["tokens"] == 49

    assert sorted(res["round_ms"]) == sorted(DRAFTERS) and set(res["skipped"]) <= {"plain"}
    assert all(ms > 0 for ms in res["round_ms"].values())
    # the CPU's eagle tree (16 nodes of top-2) takes the key naming it; the chains their plain keys
    assert res["tau"] == {"ngram": 2.0, "mtp": 3.0, "dspark": 3.5, "eagle": 4.5}
    assert res["tau_keys"]["eagle"] == "eagle:num_nodes=16:topk=2" and not res["tau_notes"]
    assert res["tau_source"] == str(tau_json)
    assert res["rounds"]["eagle"]["verify_tokens"] == 17 and res["rounds"]["eagle"]["tree"]
    assert res["rounds"]["mtp"]["verify_tokens"] == 8 and not res["rounds"]["mtp"]["tree"]
    assert sorted(res["projected_speedup"]) == sorted(DRAFTERS)
    for name, proj in res["projected_speedup"].items():
        assert proj == pytest.approx(res["tau"][name] * res["step_1_ms"] / res["round_ms"][name], rel=1e-12)
    assert "projected speedup" in printed
    if res["plain_round_ms"] is not None:  # an engine with plain-decoding rounds: the same projection over them
        assert res["rounds"]["plain"]["verify_tokens"] == 1 and res["rounds"]["plain"]["tau_untrained"] == 1.0
        for name, proj in res["projected_speedup_vs_plain_round"].items():
            assert proj == pytest.approx(res["tau"][name] * res["plain_round_ms"] / res["round_ms"][name], rel=1e-12)


def test_pick_tau_says_where_the_tree_differs():
    bench = load_bench("realistic")
    data = {"settings": {"device": "cpu"}, "drafters": {"eagle": {"tau": 4.0}, "mtp": {"tau": 3.0},
                                                        "mtp:topk=2:num_nodes=16": {"tau": 3.3}}}
    tau, key, note = bench.pick_tau(data, "eagle", {"topk": 8, "num_nodes": 48})  # a GPU round, a CPU file
    assert (tau, key) == (4.0, "eagle") and "topk 2, 16 nodes" in note and "topk 8, 48 nodes" in note
    assert bench.pick_tau(data, "eagle", {"topk": 2, "num_nodes": 16}) == (4.0, "eagle", None)
    assert bench.pick_tau(data, "mtp", {}) == (3.0, "mtp", None)
    assert bench.pick_tau(data, "mtp", {"topk": 2, "num_nodes": 16}) == (3.3, "mtp:topk=2:num_nodes=16", None)
    assert bench.pick_tau(data, "dspark", {})[0] is None
    assert bench.projected({"mtp": 3.0}, 2.0, {"mtp": 4.0, "eagle": 5.0}) == {"mtp": 1.5, "eagle": None}


def test_budget_spent_still_writes_the_json(tmp_path):
    bench = load_bench("realistic")
    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    try:
        assert bench.main(FAST + ["--budget-s", "0", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    assert res["budget_exhausted"] and res["round_ms"] == {} and res["projected_speedup"] == {}
    assert sorted(res["skipped"]) == sorted(DRAFTERS + ["plain"])
