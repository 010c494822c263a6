import os
import sys
from pathlib import Path

import torch

# Triton runs CPU tensors only in its interpreter, so without a GPU the tests turn it on; with a GPU the kernels
# compile for real on CUDA tensors. The flag must be set before any `@triton.jit` decorator runs, i.e. before any
# kernel module is imported (importing torch and asking for CUDA loads no triton). An exported value wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
# fresh examples on every run (`HYPOTHESIS_PROFILE=explore pytest --hypothesis-seed=N ...`): to search further
settings.register_profile("explore", deadline=None, max_examples=25, derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny models gain nothing from intra-op threads, and OpenMP barriers stall badly on a busy machine.
torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, whatever an earlier test left set; restored after it. Modules of tiny-model
    round checks take it for every test: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# the values triton itself reads as true
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")
# Where a Triton kernel can run: the interpreter takes CPU tensors, compiled kernels take CUDA tensors; None on a
# machine with neither (TRITON_INTERPRET=0 exported and no GPU).
TRITON_DEVICE = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)


@pytest.fixture(scope="session")
def triton_device() -> str:
    """The device every test that runs a Triton kernel builds its tensors (inputs, state pools) on: "cuda" with a GPU
    and the interpreter off, "cpu" under TRITON_INTERPRET=1. Session-scoped, so hypothesis tests may take it."""
    if TRITON_DEVICE is None:  # guards a missing GPU: only TRITON_INTERPRET=0 exported on a machine without one
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
    return TRITON_DEVICE


@pytest.fixture(scope="module")
def target(request):
    """The tiny float64 model (seed 0) of the test module's `FAMILY`, one per module: the target its generation tests
    wrap and compare with `tiny_models.greedy_reference` (tests never modify it). A module with another target
    defines its own `target` fixture."""
    from tiny_models import tiny_model  # here, not at the top: kernel-only test runs need no transformers

    return tiny_model(request.module.FAMILY, seed=0)


@pytest.fixture(scope="module")
def saved_tiny(request, tmp_path_factory):
    """A tiny float32 model of the test module's `FAMILY` (weights seeded with its `SEED`) and its tokenizer, saved
    with `save_pretrained` once per module, for the commands run on it as a user would (`tiny_models.save_tiny`)
    -> (directory, model, tokenizer)."""
    from tiny_models import save_tiny

    family = request.module.FAMILY
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    model, tokenizer = save_tiny(path, family, seed=request.module.SEED)
    return path, model, tokenizer


BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (fp32, eval), its directory, and the held-out bench prompts cut to 32 tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(BENCH))
    from common import PROMPTS, load_prompts, resolve_model_dir

    model_dir = resolve_model_dir("embedded")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [r["prompt"] for r in load_prompts(PROMPTS, ["code", "prose"], None)]
    return model, model_dir, [tok(t)["input_ids"][:32] for t in texts]
