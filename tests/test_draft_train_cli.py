"""`python -m specdec draft-train` as a user runs it: train, then continue from the result with `--init`."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny

from specdec.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_cli")
    save_tiny(root / "target", "kimi_linear")
    data = root / "data.txt"
    data.write_text(inspect.getsource(textwrap) * 2)
    return root


def _run(root, capsys, *extra):
    """(exit status, the summary line as JSON); an argument error is status 2 with nothing read from stdout."""
    threads = torch.get_num_threads()
    try:
        rc = main(["draft-train", "--target", str(root / "target"), "--data", str(root / "data.txt"), "--seq-len",
                   "32", "--batch-size", "2", "--val-every", "100", *map(str, extra)])
    finally:
        torch.set_num_threads(threads)
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1]) if rc == 0 else None


def test_init_continues_from_a_trained_drafter(setup, capsys):
    root = setup
    rc, first = _run(root, capsys, "--drafter", "mtp", "--steps", 4, "--lr", "3e-3", "--out", root / "a")
    assert rc == 0 and first["val_loss_end"] < first["val_loss_start"]
    # lr 0: the continued run starts from the saved (best) checkpoint (same validation windows) and changes nothing
    rc, second = _run(root, capsys, "--drafter", "mtp", "--steps", 2, "--lr", 0, "--init", root / "a",
                      "--out", root / "b")
    assert rc == 0
    assert second["val_loss_start"] == pytest.approx(first["val_loss_best"], rel=1e-6)
    a, b = load_file(root / "a" / "model.safetensors"), load_file(root / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_errors(setup, capsys):
    root = setup
    if not (root / "a").is_dir():
        _run(root, capsys, "--drafter", "mtp", "--steps", 1, "--out", root / "a")
    for init, msg in ((root / "missing", "--init"), (root / "a", "holds a mtp drafter, not eagle")):
        rc, _ = _run(root, capsys, "--drafter", "eagle", "--steps", 1, "--init", init, "--out", root / "c")
        assert rc == 2 and msg in capsys.readouterr().err
    assert not (root / "c").exists()


def test_module_entry_point():
    """`python -m specdec draft-train` reaches the command (in specdec/cli: draft/ does not import the runner)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "specdec", "draft-train", "--help"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: specdec draft-train") and "--init DIR" in proc.stdout


def test_best_checkpoint_is_the_best_validation_step(setup, capsys):
    """`--out` holds the weights of the validation with the highest tau = 1 + sum_i prod_{j<=i} per_position[j]
    (the first on ties), recomputed here from the printed per-position acceptance; the weights at every
    validation are snapshotted through the log callback."""
    from specdec.cli.draft_train import train
    from specdec.draft.registry import build_drafter_net, own_state_dict, save_drafter
    from transformers import AutoModelForCausalLM
    root = setup
    target = AutoModelForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    ids = torch.randint(3, target.config.vocab_size, (1500,), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = build_drafter_net("eagle", target, ttt_steps=1)
    snaps = []

    def log(line):
        entry = json.loads(line)
        snaps.append((entry, {k: v.clone() for k, v in own_state_dict(net).items()}))
    out = root / "best"
    train(target, ids, "eagle", net=net, steps=12, lr=0.3, seq_len=24, batch_size=2, val_every=1, progress=False,
          log=log, on_best=lambda n, e: save_drafter(n, str(out)))
    taus = []
    for entry, _ in snaps:
        tau, run = 1.0, 1.0
        for a in entry["per_position"]:
            run *= a
            tau += run
        taus.append(tau)
    best = max(range(len(taus)), key=lambda i: (taus[i], -i))
    assert best != len(taus) - 1, taus  # the run got worse after its best step, so the choice matters
    saved = load_file(out / "model.safetensors")
    assert all(torch.equal(saved[k], snaps[best][1][k]) for k in saved)
    assert not all(torch.equal(saved[k], snaps[-1][1][k]) for k in saved)


def test_config_overrides(setup, capsys):
    """`--config KEY=VALUE` sets a config field: of a fresh drafter, or of an --init one whose weights still fit
    (the training depth); a field that changes the weights' shapes or does not exist is an argument error."""
    root = setup
    if not (root / "a").is_dir():
        _run(root, capsys, "--drafter", "mtp", "--steps", 1, "--out", root / "a")
    rc, _ = _run(root, capsys, "--drafter", "mtp", "--steps", 1, "--lr", 0, "--init", root / "a", "--config",
                 "train_depth=3", "--out", root / "deep")
    cfg = json.load(open(root / "deep" / "config.json"))
    assert rc == 0 and cfg["train_depth"] == 3
    a, b = load_file(root / "a" / "model.safetensors"), load_file(root / "deep" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same weights, a new depth
    # more blocks: the grown drafter starts from the same function (lr 0: same validation loss), old weights kept
    rc, grown = _run(root, capsys, "--drafter", "mtp", "--steps", 1, "--lr", 0, "--init", root / "a", "--config",
                     "num_layers=2", "--out", root / "grown")
    assert rc == 0 and json.load(open(root / "grown" / "config.json"))["num_layers"] == 2
    g = load_file(root / "grown" / "model.safetensors")
    assert all(torch.equal(a[k], g[k]) for k in a) and any(k.startswith("layers.1.") for k in g)
    rc, again = _run(root, capsys, "--drafter", "mtp", "--steps", 1, "--lr", 0, "--init", root / "a",
                     "--out", root / "same")
    assert grown["val_loss_start"] == pytest.approx(again["val_loss_start"], rel=1e-6)
    rc, _ = _run(root, capsys, "--drafter", "dspark", "--steps", 1, "--config", "markov_rank=8", "--out", root / "r8")
    assert rc == 0 and json.load(open(root / "r8" / "config.json"))["markov_rank"] == 8
    for extra, msg in ((["--init", root / "a", "--config", "intermediate_size=8"], "--config"),
                       (["--config", "bogus=1"], "'bogus' is not a mtp config field"),
                       (["--config", "train_depth"], "expected KEY=VALUE")):
        rc, _ = _run(root, capsys, "--drafter", "mtp", "--steps", 1, *extra, "--out", root / "c")
        assert rc == 2 and msg in capsys.readouterr().err


def test_stop_at_then_resume_is_the_uninterrupted_run(setup, capsys, tmp_path):
    """`--stop-at 3` of a 6-step run, then the same command without it (resumed from `--checkpoint`), ends with the
    weights of the 6 steps run at once (bitwise: the schedule spans --steps either way); `--last` holds the end
    weights, which differ from the 3-step ones."""
    root = setup
    common = ["--drafter", "mtp", "--steps", 6, "--lr", "3e-3", "--val-every", 2]
    rc, whole = _run(root, capsys, *common, "--out", tmp_path / "w", "--last", tmp_path / "w_last")
    assert rc == 0
    ck = tmp_path / "state.pt"
    rc, part = _run(root, capsys, *common, "--out", tmp_path / "p", "--checkpoint", ck, "--stop-at", 3,
                    "--last", tmp_path / "p3")
    assert rc == 0 and torch.load(ck, weights_only=True)["step"] == 3  # plain data: loads without running code
    rc, rest = _run(root, capsys, *common, "--out", tmp_path / "p", "--checkpoint", ck, "--last", tmp_path / "p6")
    assert rc == 0 and torch.load(ck, weights_only=True)["step"] == 6
    w, p3, p6 = (load_file(tmp_path / d / "model.safetensors") for d in ("w_last", "p3", "p6"))
    assert all(torch.equal(w[k], p6[k]) for k in w)
    assert not all(torch.equal(w[k], p3[k]) for k in w)
    rc, _ = _run(root, capsys, *common, "--out", tmp_path / "x", "--stop-at", 7)
    assert rc == 2 and "stop_at: expected an int in [1, steps=6]" in capsys.readouterr().err


RAN = []  # what unpickling a `_Payload` ran


def _record(tag):
    RAN.append(tag)
    return tag


class _Payload:
    """Unpickling it calls `_record`: the stand-in for the code a crafted file would run."""

    def __reduce__(self):
        return (_record, ("payload",))


def test_files_holding_objects_are_refused_unrun(setup, capsys, tmp_path):
    """`--checkpoint` and `--cache` load with `weights_only=True`: a checkpoint holding a pickled object is an
    argument error naming the file, a cache holding one is computed again, and the object's code never runs. The
    files a run writes itself load that way (resume: `test_stop_at_then_resume_is_the_uninterrupted_run`)."""
    root = setup
    evil = tmp_path / "evil.pt"
    torch.save({"kind": "mtp", "steps": 2, "step": 1, "net": _Payload(), "key": _Payload()}, evil)
    assert torch.load(evil, weights_only=False)["net"] == "payload" and RAN == ["payload", "payload"]  # teeth
    RAN.clear()
    rc, _ = _run(root, capsys, "--drafter", "mtp", "--steps", 2, "--checkpoint", evil, "--out", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and f"checkpoint: {str(evil)!r} holds objects other than tensors" in err, err
    assert "_record" in err and RAN == [] and not (tmp_path / "o").exists()
    # a cache: refused, computed again (and saved as plain data), then read back by the next run
    cache = tmp_path / "cache.pt"
    cache.write_bytes(evil.read_bytes())
    opts = ["--drafter", "mtp", "--steps", 2, "--lr", 0, "--cache-batches", 2, "--cache", cache]
    rc, first = _run(root, capsys, *opts, "--out", tmp_path / "c1")
    assert rc == 0 and RAN == []
    state = torch.load(cache, weights_only=True)
    assert len(state["batches"]) == 2 and set(state["batches"][0]) == {"tokens", "logits", "hidden", "features"}
    written = os.stat(cache)
    rc, second = _run(root, capsys, *opts, "--out", tmp_path / "c2")
    again = os.stat(cache)
    assert rc == 0 and (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)  # not rewritten
    assert second["val_loss_end"] == first["val_loss_end"]
