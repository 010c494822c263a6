"""Every static step of a round can be captured by a CUDA graph: no host read and no host data inside it.

With `cuda_graph=True` (specdec/graphs.py) the engine captures each batch bucket's device step, the drafter's
`draft_step` (eagle, mtp, dspark) with verify + accept (`RoundStep.device_step`), and its commit
(`RoundStep.commit_step`). A capture refuses a read back to the host (`.item()`, `nonzero`, a boolean mask, ...)
and a copy of pageable host memory to the device ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless
the CPU tensor is pinned"); a failed capture leaves that bucket eager for good. On a CPU neither shows, so
bench/syncs.py's `CaptureCheck` follows host data from where it is made and names the source line of each
violation. Kernel ops run as on a GPU (`gpu_view`: the Triton wrappers' host side, then the torch reference
unchecked).

Each drafter runs on the embedded model with static shapes in the buckets 1, 2 and 4 (3 requests: one padding
row), with its GPU-default draft shape and its CPU one: eagle's default trees (`DEFAULT_TREE`, top-8 x 48 nodes on
a GPU, top-2 x 16 on a CPU), and mtp's and dspark's default chain, their default tree (top-2, 16 nodes) and a tree
of eagle's GPU size. ngram drafts on the host, before the step: its verify, accept and commit are checked.
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
syncs = pytest.importorskip("syncs")  # bench/syncs.py

import specdec  # noqa: E402
from specdec.draft.eagle_drafter import DEFAULT_TREE  # noqa: E402
from specdec.tensors import per_tensor  # noqa: E402

BIG_TREE = dict(topk=8, num_nodes=48)  # eagle's GPU default, for the heads too
DRAFTS = {  # id -> (drafter, options, verify window)
    "ngram": ("ngram", {}, 8),
    "mtp-chain": ("mtp", {}, 8),  # the heads' default on every device
    "mtp-tree16": ("mtp", dict(topk=2), 17),
    "mtp-tree48": ("mtp", BIG_TREE, 49),
    "dspark-chain": ("dspark", {}, 8),
    "dspark-tree16": ("dspark", dict(topk=2), 17),
    "dspark-tree48": ("dspark", BIG_TREE, 49),
    "eagle-gpu": ("eagle", DEFAULT_TREE["cuda"], 49),
    "eagle-cpu": ("eagle", DEFAULT_TREE["cpu"], 17),
}
STEPS = ("_draft_step", "_verify_step", "_commit_step")
ROUNDS = 2
# `per_tensor`'s memo compares CPU tensors only (CUDA tensors bypass it): its `torch.equal` never runs on a GPU
CPU_ONLY = [c for c in per_tensor.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "same"]


@pytest.mark.parametrize("requests", [1, 2, 3], ids=["bucket1", "bucket2", "bucket4"])
@pytest.mark.parametrize("draft", list(DRAFTS))
def test_static_steps_are_capture_safe(embedded, draft, requests):
    """Greedy generation with static shapes, every round's draft, verify (with accept) and commit step under
    `CaptureCheck`: no violation in any of them."""
    model, model_dir, prompts = embedded
    name, options, window = DRAFTS[draft]
    drafter = name if name == "ngram" else str(model_dir / "drafters" / name)
    # cpu_linear: the aten linears a GPU runs (oneDNN's copies are checked against the weights on first use)
    engine = specdec.wrap(model, drafter=drafter, max_batch_size=4, static_shapes=True, cpu_linear="aten",
                          **options)
    assert engine.runner.num_verify_tokens == window
    check = syncs.CaptureCheck(cpu_only=CPU_ONLY)
    rounds = dict.fromkeys(STEPS, 0)
    done = engine._done
    # a bucket's first round runs eagerly, its second is captured, later ones replay the capture: two rounds
    engine._done = lambda request: rounds["_commit_step"] >= ROUNDS or done(request)
    for step in STEPS:
        inner = getattr(engine.round_step, step[1:])

        def checked(*a, _inner=inner, _step=step, **k):
            check.phase = _step[1:]
            rounds[_step] += 1
            with check.checking():
                return _inner(*a, **k)
        setattr(engine.round_step, step[1:], checked)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a drafter failing inside its step would warn
        with syncs.gpu_view(check):
            out = engine.generate([prompts[i] for i in range(requests)], max_new_tokens=48, eos_token_id=None)
    assert out.stats.drafter_failures == 0
    assert rounds["_verify_step"] == rounds["_commit_step"] == ROUNDS, rounds
    assert rounds["_draft_step"] == (0 if name == "ngram" else rounds["_verify_step"]), rounds
    assert not check.violations(), "a CUDA-graph capture of these steps would fail:\n" + "\n".join(check.violations())


def _flagged(fn) -> list[str]:
    check = syncs.CaptureCheck()
    with torch.inference_mode(), check.checking():
        fn()
    return check.violations()


X = torch.zeros(4, 3, dtype=torch.long)
ROWS = torch.tensor([0, 2])
# each as a capture on CUDA takes or refuses it
REFUSED = {  # a host read, or a copy of pageable host memory to the device
    "scalar through a tensor index": lambda: X.__setitem__(ROWS, 0),
    "scalar into one element": lambda: X.__setitem__((0, 0), 5),  # (a 0-dim destination: a copy, not a fill)
    "torch.tensor(list)": lambda: torch.tensor([1, 2], device=X.device),
    "torch.tensor(scalar, device)": lambda: torch.tensor(3, device=X.device),
    "a host arange as an index": lambda: X[torch.arange(2)],
    "a host tensor moved": lambda: torch.zeros(2, dtype=torch.long).to(X.device),
    "a host scalar copied into one element": lambda: X[0, 0].copy_(torch.tensor(5)),
    "item": lambda: X.sum().item(),
    "tolist": lambda: X.tolist(),
    "cpu": lambda: X.cpu(),
    "to cpu": lambda: X.to("cpu"),
    "nonzero": lambda: X.nonzero(),
    "boolean mask": lambda: X[X > 0],
    "repeat_interleave without output_size": lambda: torch.repeat_interleave(ROWS),
}
ALLOWED = {  # Python scalars passed by value, device-made tensors, host work
    "scalar through a slice": lambda: X.__setitem__((slice(None), 0), 1),
    "scalar operand": lambda: torch.where(X > 0, 0, X) + 1,
    "device factory": lambda: X[torch.arange(2, device=X.device)],
    "scalar fill": lambda: X.fill_(0),
    "scalar through index_fill_": lambda: X.index_fill_(0, ROWS, 0),
    "host 0-dim operand": lambda: X + torch.tensor(5),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(ROWS, ROWS, output_size=2),
    "host work": lambda: int(torch.arange(3).sum()),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_check_flags_what_a_capture_refuses(what):
    assert _flagged(REFUSED[what]), what


@pytest.mark.parametrize("what", list(ALLOWED))
def test_check_allows_what_a_capture_takes(what):
    assert not _flagged(ALLOWED[what]), what
