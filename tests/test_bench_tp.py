"""`bench/tp.py` on the embedded model at tiny settings (two gloo ranks): every configuration timed
`--repeats` times, tokens per second the medians', tp = 2 identical to tp = 1, and every round's collectives the
layers' all-reduces plus the block broadcast and the fault vote."""

import json
import statistics

from bench_scripts import load_bench


def test_tiny_run(tmp_path):
    out = tmp_path / "tp.json"
    res = load_bench("tp").main(["--drafters", "ngram", "--batches", "1,2", "--max-new-tokens", "6",
                                 "--prompt-tokens", "16", "--repeats", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        for config, samples in r["samples_s"].items():
            assert len(samples) == 3
            assert r["tokens_per_s"][config] == r["new_tokens"] / statistics.median(samples)
        assert r["identical"] is True
        assert r["collectives_per_round"] == [r["reduces_per_forward"] + 2]
        # the embedded Kimi-Linear: 8 layers, each a mixer or an attention, and an MLP
        assert r["reduces_per_forward"] == 16
