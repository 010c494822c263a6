"""`bench/tp.py` on the embedded model at tiny settings (two gloo ranks): every configuration timed
`--repeats` times, tokens per second the medians', tp = 2 identical to tp = 1, and every round's collectives the
layers' all-reduces plus the block broadcast and the fault vote."""

import json
import statistics
from pathlib import Path

import pytest
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


class _FakeRank:
    """A worker that measured (rank 0 writes the rows) and then exits with `rc`, as one that aborts in teardown."""
    ROW = dict(drafter="ngram", batch=1, new_tokens=6, samples_s={}, identical=True, collectives_per_round=[18],
               reduces_per_forward=16, tau=1.0, rounds=6, allreduce_us=300.0,
               tokens_per_s={"tp1 x1 thread": 10.0, "tp1 x2 threads": 12.0, "tp2": 5.0},
               spread={"tp1 x1 thread": 0.01, "tp1 x2 threads": 0.01, "tp2": 0.01})

    def __init__(self, cmd, rc, write, **kw):
        job, rank = Path(cmd[3]), int(cmd[4])
        if rank == 0 and write:
            (job.parent / "rows.json").write_text(json.dumps([self.ROW]))
        self.returncode = rc[rank]

    def communicate(self, timeout=None):
        return "", "Loading weights: 100%\nterminate called without an active exception" if self.returncode else ""


@pytest.mark.parametrize("write", [True, False])
def test_a_rank_failing_after_the_measurements(monkeypatch, capsys, write):
    """A rank that exits abnormally once rank 0 has written the rows (after the last collective, so both ranks
    measured everything) is reported and the rows stand; one that fails before them fails the run."""
    tp = load_bench("tp")
    real = tp.subprocess.Popen
    monkeypatch.setattr(tp.subprocess, "Popen", lambda cmd, **kw: _FakeRank(cmd, (0, -6), write, **kw)
                        if "--worker" in cmd else real(cmd, **kw))
    argv = ["--drafters", "ngram", "--batches", "1", "--max-new-tokens", "6", "--prompt-tokens", "16"]
    if not write:
        with pytest.raises(RuntimeError, match=r"a rank failed: rank 1 \(-6\)"):
            tp.main(argv)
        return
    res = tp.main(argv)
    assert res["rows"][0]["ratio_tp2_over_tp1_1thread"] == 0.5 and res["teardown_failures"] == ["rank 1 (-6):"]
    assert "failed in its teardown" in capsys.readouterr().err
