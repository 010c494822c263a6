"""`python -m specdec demo`: a tiny saved Kimi-Linear model and tokenizer, run in a subprocess as a user would.

The demo checks its speculative output against transformers' own greedy `generate` itself; the JSON test also
compares it with that oracle computed here, in-process, independently of the command. Each run works in a
temporary directory, where the demo writes its picture (`specdec-demo.png` by default); the picture's numbers are
checked against the ones the demo printed, and its drawing against the numbers it was given.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_harness import ROOT, assert_argument_error, bad_arguments, run_specdec
from tiny_models import torch_fallbacks

from specdec import plot

FAMILY = "kimi_linear"  # the saved model (conftest's `saved_tiny`: directory, model, tokenizer)
SEED = 0  # model weights; a greedy near-tie between the two sides would be fixed here, not by a looser check
PROMPT = "def wrap(text, width=70):\n    lines = []\n    for line in text.splitlines():\n"
NEW = 16


def run_demo(*args, cwd, timeout=120):
    return run_specdec("demo", *args, timeout=timeout, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def assert_picture(path: Path, drafters: dict) -> None:
    """The demo's picture at `path` holds the numbers of `drafters` (the demo's JSON), in their order; without
    matplotlib there is none."""
    if not plot.available():
        assert not path.exists()
        return
    shown = plot.read_numbers(path)
    assert list(shown) == list(drafters)
    assert shown == {k: {key: d[key] for key in plot.KEYS} for k, d in drafters.items()}


@pytest.fixture
def prompts_file(tmp_path):
    """A prompt file for --prompts: two code prompts and a prose one."""
    records = [{"id": "prose-0", "kind": "prose", "source": "topic:x", "prompt": "The wrap function returns a list"},
               {"id": "code-0", "kind": "code", "source": "a.py", "prompt": PROMPT},
               {"id": "code-1", "kind": "code", "source": "b.py", "prompt": "def fill(text, width=70):\n    return"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_json_is_lossless_and_has_the_numbers(saved_tiny, tmp_path):
    path, model, tokenizer = saved_tiny
    proc = run_demo("--model", path, "--drafter", "ngram", "--prompt", PROMPT, "--max-new-tokens", NEW, "--json",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)  # one JSON object, nothing else on stdout (no streamed text)
    assert out["identical"] is True and out["first_difference"] is None
    assert out["identical_plain_specdec"] is True
    assert out["drafter"] == "ngram" and out["drafter_dir"] is None and out["prompt_id"] == "custom"
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch_fallbacks(), torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out["tokens"] == ref[0, ids.shape[1]:].tolist()
    assert out["new_tokens"] == len(out["tokens"]) > 0 and out["prompt_tokens"] == ids.shape[1]
    assert out["tau"] >= 1 and 0 <= out["alpha"] <= 1 and len(out["per_position"]) <= 7
    assert out["rounds"] >= 1 and out["accepted"] <= out["proposed"]
    for key in ("tokens_per_s_spec", "tokens_per_s_plain", "tokens_per_s_transformers", "speedup",
                "speedup_vs_transformers"):
        assert out[key] > 0, key
    # the speedup is the ratio of the pooled tokens/s (one prompt: of its median tokens/s)
    assert out["speedup"] == pytest.approx(out["tokens_per_s_spec"] / out["tokens_per_s_plain"])
    # transformers' own generate, timed in the same interleave, pooled the same way
    assert out["speedup_vs_transformers"] == pytest.approx(out["tokens_per_s_spec"] / out["tokens_per_s_transformers"])
    assert out["threads"] == 1 and out["repeats"] == 3 and out["prompt_ids"] == ["custom"]
    (p,) = out["prompts"]
    assert len(p["seconds_spec"]) == len(p["seconds_plain"]) == len(p["seconds_transformers"]) == 3  # interleaved
    assert len(out["speedup_per_repeat"]) == 3 and isinstance(out["noisy"], bool) and out["spread"] >= 0
    assert list(out["drafters"]) == ["ngram"]  # no trained drafters shipped with this model
    assert out["drafters"]["ngram"]["per_position"] == out["per_position"]
    # the picture, at the default path in the working directory, shows the numbers the JSON reports
    picture = tmp_path / "specdec-demo.png"
    assert out["plot"] == (str(picture) if plot.available() else None)
    assert_picture(picture, out["drafters"])
    if not plot.available():
        assert proc.stderr.strip().splitlines()[-1] == f"[demo] no picture: {plot.MISSING}"


def test_auto_picks_the_shipped_drafter_and_streams(saved_tiny, tmp_path, prompts_file):
    from specdec.draft.registry import build_drafter_net, save_drafter

    path, model, _ = saved_tiny
    shipped = tmp_path / "model"
    shutil.copytree(path, shipped)
    torch.manual_seed(0)
    for kind in ("eagle", "mtp"):  # untrained: no speedup, still lossless
        save_drafter(build_drafter_net(kind, model), shipped / "drafters" / kind)
    (shipped / "drafters" / "dspark").mkdir()  # no weights: not shipped, so auto prefers eagle, then mtp
    picture = tmp_path / "pictures" / "demo.png"
    picture.parent.mkdir()
    proc = run_demo("--model", shipped, "--max-new-tokens", 12, "--prompts", prompts_file, "--plot", picture,
                    cwd=tmp_path)  # auto, code prompts
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith(PROMPT)  # the first code prompt of the file, streamed with its continuation
    assert "prompt code-0" in text and "drafter eagle" in text and "prompts: code-0 code-1," in text
    assert "torch threads 1" in text  # a tiny model: one thread
    assert "tau" in text and "alpha" in text and "acceptance per draft position" in text
    assert "transformers generate" in text and "specdec without drafts" in text
    assert "speedup" in text and ("pooled over 2 held-out prompts" in text or "timing is noisy on this machine" in text)
    assert "identical to transformers' greedy output, token for token: yes on all 2 prompt(s)" in text
    table = text[text.index("drafters side by side"):].splitlines()[2:]  # after the header lines
    assert [ln.split()[1] for ln in table[:3]] == ["eagle", "ngram", "mtp"]  # the chosen one first
    assert all(ln.split()[6] == "yes" for ln in table[:3]), table  # each lossless vs plain decode
    # the last line says where the picture is; it shows each drafter's printed tau and speedup
    if plot.available():
        assert table[3] == f"[demo] picture of the drafters (acceptance per draft position, speedup): {picture}"
        shown = plot.read_numbers(picture)
        assert list(shown) == ["eagle", "ngram", "mtp"]
        for ln in table[:3]:
            _, name, tau, _, _, speedup = ln.split()[:6]
            assert (f"{shown[name]['tau']:.2f}", f"{shown[name]['speedup']:.2f}x") == (tau, speedup)
            assert 1 <= len(shown[name]["per_position"]) <= 7
    else:
        assert table[3] == f"[demo] no picture: {plot.MISSING}" and not picture.exists()
    assert len(table) == 4


def test_prompt_id(saved_tiny, prompts_file, tmp_path):
    path, _, tokenizer = saved_tiny
    work = tmp_path / "work"
    work.mkdir()
    proc = run_demo("--model", path, "--drafter", "ngram", "--prompt-id", "prose-0", "--max-new-tokens", 4,
                    "--no-stream", "--json", "--prompts", prompts_file, "--no-plot", cwd=work)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_id"] == "prose-0" and out["identical"] is True
    assert out["prompt_tokens"] == len(tokenizer("The wrap function returns a list").input_ids)
    assert out["plot"] is None and list(work.iterdir()) == []  # --no-plot: no picture
    proc = run_demo("--model", path, "--prompt-id", "code-9", "--prompts", prompts_file, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "--prompt-id" in proc.stderr and "code-9" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, flag", [
    (["--model", "{missing}"], "--model"),
    (["--model", "{empty}"], "--model"),  # a directory without a model
    (["--model", "{model}", "--drafter", "dspark"], "--drafter"),  # none shipped
    (["--model", "{model}", "--drafter", "medusa"], "--drafter"),
    (["--model", "{model}", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--model", "{model}", "--prompt", "x", "--prompt-id", "code-0"], "--prompt-id"),
    (["--model", "{model}", "--prompt", ""], "--prompt"),
    (["--model", "{model}", "--repeats", "2"], "--repeats"),  # a median needs at least 3
    (["--model", "{model}", "--threads", "0"], "--threads"),
    (["--model", "{model}", "--num-prompts", "0"], "--num-prompts"),
    (["--model", "{model}", "--prompts", "{missing}"], "--prompts"),
    (["--model", "{model}", "--plot", "{missing}/demo.png"], "--plot"),  # no such directory
])
def test_bad_arguments_exit_2(saved_tiny, tmp_path, args, flag):
    proc = run_demo(*bad_arguments(args, saved_tiny[0], tmp_path), timeout=60, cwd=tmp_path)
    assert_argument_error(proc, "demo", flag)




def test_picture_draws_its_numbers_readably(tmp_path):
    """`specdec.plot.figure`, as the demo and bench/accept_rate.py draw it: each drafter's line covers exactly the
    positions it reached (no point past them), each bar is its speedup, and no two tick labels overlap, long
    drafter names included."""
    if not plot.available():
        assert plot.MISSING.startswith("matplotlib is not installed")
        return
    drafters = {"dspark": {"per_position": [0.75, 0.8, 0.875, 0.9, 0.5, 0.625, 1.0], "tau": 4.5, "speedup": 2.25,
                           "tokens_per_s": 250.0},
                "eagle:num_nodes=12:topk=4": {"per_position": [0.5, 0.25, 0.125], "tau": 1.9, "speedup": 0.75,
                                              "tokens_per_s": 80.0},
                "ngram": {"per_position": [0.5], "tau": 1.5, "speedup": 1.25, "tokens_per_s": 130.0}}
    fig = plot.figure(drafters, "a title " * 40)  # a long title is wrapped, not cut
    pos_ax, speed_ax = fig.axes
    lines = pos_ax.get_lines()
    assert [ln.get_label() for ln in lines] == list(drafters)
    for ln, d in zip(lines, drafters.values()):
        assert list(ln.get_xdata()) == list(range(1, len(d["per_position"]) + 1))
        assert list(ln.get_ydata()) == d["per_position"]
    assert list(pos_ax.get_xticks()) == list(range(1, 8)) and pos_ax.get_xlim() == (0.5, 7.5)
    bars = speed_ax.patches
    assert [b.get_width() for b in bars] == [d["speedup"] for d in drafters.values()]
    assert [t.get_text() for t in speed_ax.get_yticklabels()] == list(drafters)
    labels = [t.get_text() for t in speed_ax.texts]
    assert labels == [" 2.25x  (tau 4.50)", " 0.75x  (tau 1.90)", " 1.25x  (tau 1.50)"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    for axis, xy in ((pos_ax.xaxis, 0), (pos_ax.yaxis, 1), (speed_ax.xaxis, 0), (speed_ax.yaxis, 1)):
        lo, hi = sorted(axis.get_view_interval())  # the labels drawn: those of ticks inside the axes
        boxes = [t.get_window_extent(renderer) for t in axis.get_ticklabels()
                 if t.get_text() and lo <= t.get_position()[xy] <= hi]
        assert boxes
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        assert all(figure_box.contains(b.x0, b.y0) and figure_box.contains(b.x1, b.y1) for b in boxes)
    for text in [*speed_ax.texts, fig._suptitle]:  # the bar labels and the wrapped title stay inside the picture
        b = text.get_window_extent(renderer)
        assert figure_box.contains(b.x0, b.y0) and figure_box.contains(b.x1, b.y1), text.get_text()
    path = tmp_path / "p.png"
    plot.write(drafters, path, "title")
    assert plot.read_numbers(path) == {k: {key: d[key] for key in plot.KEYS} for k, d in drafters.items()}


def test_held_out_prompts_ship_with_the_package(tmp_path):
    """The demo's prompts are package data (declared in pyproject, identical to the benchmark's), and the demo
    finds them from any working directory: the same prompts and figures in a checkout and in an install."""
    import fnmatch
    import tomllib

    import specdec

    pkg = Path(specdec.__file__).resolve().parent
    shipped = pkg / "embedded" / "prompts.jsonl"
    assert shipped.read_bytes() == (ROOT / "bench" / "data" / "prompts.jsonl").read_bytes()
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["specdec"]
    assert any(fnmatch.fnmatch("embedded/prompts.jsonl", pat) for pat in patterns), patterns
    # the embedded model from an empty working directory: tiny settings, no table
    proc = run_demo("--max-new-tokens", 2, "--num-prompts", 3, "--no-compare", "--json", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["prompts_file"]).resolve() == shipped.resolve()
    assert out["prompt_ids"] == ["code-0", "code-1", "code-2"] and out["identical"] is True
    assert out["threads"] == 1 and list(out["drafters"]) == [out["drafter"]]


def test_speedup_beside_a_busy_neighbour(tmp_path):
    """The embedded model and its shipped drafter, with a CPU-bound process running beside the demo on this
    2-core machine: warm-up, one torch thread and interleaved repeats keep the measured speedup above 1x (a test
    of the ratio spec / plain decode, both timed under the same load, not of absolute time)."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = run_demo("--num-prompts", 2, "--max-new-tokens", 24, "--repeats", 3, "--no-compare", "--json",
                        cwd=tmp_path, timeout=600)
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["identical"] is True and out["threads"] == 1
    assert out["speedup"] > 1.0, (out["speedup"], out["speedup_per_repeat"], out["spread"])
