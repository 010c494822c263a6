"""What the bench scripts share: the package from a bare checkout, the held-out prompts, model and drafter
directories, facts about the machine, device syncs, spreads, left-padded batches, and one script loaded as a module.

A script run as `python bench/NAME.py` has this folder first on `sys.path`; one loaded from elsewhere (the tests,
`gpu_check.py`) puts it there for its own `import common` only (see any script's header).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PROMPTS = BENCH / "data" / "prompts.jsonl"

# A bare checkout (no `pip install -e .`): its top-level folders are subpackages of `specdec`, as pyproject's
# package-dir maps them. Never the checkout root on sys.path: its `kernels` and `verify` would shadow packages.
if importlib.util.find_spec("specdec") is None:
    _spec = importlib.util.spec_from_file_location("specdec", ROOT / "specdec" / "__init__.py",
                                                   submodule_search_locations=[str(ROOT / "specdec"), str(ROOT)])
    sys.modules["specdec"] = _mod = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)

import specdec  # noqa: E402

# the package's own model, from wherever `specdec` is imported (bench/ab.py's old side: the old revision's)
EMBEDDED = Path(specdec.__file__).resolve().parent / "embedded"


# ---- inputs ------------------------------------------------------------------------------------------
def resolve_model_dir(model: str) -> Path:
    """`"embedded"` (the package's model) or a `save_pretrained` directory; FileNotFoundError otherwise."""
    if model == "embedded":
        if not (EMBEDDED / "config.json").is_file():
            raise FileNotFoundError(f"the embedded model is not at {EMBEDDED} (no config.json); train it with "
                                    f"`python -m specdec train-embedded`")
        return EMBEDDED
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"no such model directory: {model}")
    return path


def input_args(parser, model: str, prompts: str | None = None) -> Path:
    """`resolve_model_dir(model)` for a script's `--model`, and a check that its `--prompts` file (when given)
    exists: a `parser.error` naming the argument otherwise."""
    try:
        model_dir = resolve_model_dir(model)
    except FileNotFoundError as e:
        parser.error(f"--model: {e}")
    if prompts is not None and not os.path.isfile(prompts):
        parser.error(f"--prompts: no such file: {prompts}")
    return model_dir


def resolve_drafter(model_dir: Path, name: str) -> tuple[str | None, str | None]:
    """-> (the `drafter=` argument for `specdec.wrap`, None) or (None, why it is skipped)."""
    if name in ("ngram", "native"):  # built in: prompt lookup; the checkpoint's own MTP layers
        return name, None
    path = model_dir / "drafters" / name
    if not path.is_dir():
        return None, f"no trained drafter at {path}"
    if not (path / "config.json").is_file():
        return None, f"{path} has no config.json (not a trained drafter)"
    return str(path), None


def parse_drafter(spec: str) -> tuple[str, dict]:
    """`NAME[:key=value...]` -> (NAME, options for `specdec.wrap`), e.g. `eagle:num_nodes=16:topk=4`.
    Values are ints or floats where they parse as such. Raises ValueError naming the bad part."""
    name, *parts = spec.split(":")
    opts: dict = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not eq or not key.isidentifier() or not val:
            raise ValueError(f"{spec!r}: expected NAME[:key=value...], got the part {part!r}")
        for cast in (int, float):
            try:
                opts[key] = cast(val)
                break
            except ValueError:
                continue
        else:
            opts[key] = val
    if not name:
        raise ValueError(f"{spec!r}: no drafter name before ':'")
    return name, opts


def load_prompts(path: str | Path, kinds: list[str], limit: int | None) -> list[dict]:
    """Prompts of `kinds` from a JSONL file of `{"id", "kind", "source", "prompt"}`, at most `limit`, round-robin
    over the kinds (file order within a kind). Raises ValueError naming the bad line."""
    from specdec.draft.data import json_lines

    by_kind: dict[str, list[dict]] = {k: [] for k in kinds}
    for n, rec in json_lines(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f"{path}:{n}: expected an object with a string 'prompt'")
        rec.setdefault("id", f"line-{n}")
        if rec.get("kind") in by_kind:
            by_kind[rec["kind"]].append(rec)
    out: list[dict] = []
    queues = [list(v) for v in by_kind.values()]
    while any(queues) and (limit is None or len(out) < limit):
        for q in queues:
            if q and (limit is None or len(out) < limit):
                out.append(q.pop(0))
    return out


def split_list(text: str) -> list[str]:
    """`"a, b,,c"` -> `["a", "b", "c"]`: a comma-separated option."""
    return [x.strip() for x in text.split(",") if x.strip()]


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids, attention mask), both `[B, width]` on the CPU: each prompt right-aligned, so that every row
    continues at the same position (how transformers' `generate` takes a batch)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def tree_parents(n: int, topk: int = 8) -> list[int]:
    """Parent list of an `n`-node EAGLE-like top-k tree: [-1, 0, 0, ...], topological (parent[i] < i)."""
    if n < 1 or topk < 1:
        raise ValueError(f"tree_parents: expected n >= 1 and topk >= 1, got n={n}, topk={topk}")
    parent, prev = [-1], [0]
    while len(parent) < n:
        level = []
        for j in range(topk):
            if len(parent) >= n:
                break
            # depth 1: all children of the anchor; deeper: the first half of the previous depth, 2 children each
            p = prev[0] if prev == [0] else prev[min(j // 2, len(prev) - 1)]
            parent.append(p)
            level.append(len(parent) - 1)
        prev = level
    return parent


# ---- timing ------------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for `device`'s queued work before a clock is read (nothing off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def spread(times: list[float]) -> float:
    """(p90 - p10) / median of a sample; 0 for fewer than two values."""
    if len(times) < 2:
        return 0.0
    q = statistics.quantiles(times, n=10, method="inclusive")
    med = statistics.median(times)
    return (q[-1] - q[0]) / med if med > 0 else 0.0


def max_over_min(values: list[float]) -> float:
    """max / min of a sample (NaN when its minimum is not positive)."""
    return max(values) / min(values) if min(values) > 0 else float("nan")


# ---- facts about the run -----------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    import transformers
    info = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": device, "gpu": None, "cuda": torch.version.cuda}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


# ---- scripts -----------------------------------------------------------------------------------------
def load_script(name: str):
    """`bench/<name>.py` as a fresh module named `bench_<name>` (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def state_tile(tile: str | None):
    """Every state kernel launched in this process with the tile `tile` (`BVxWARPS`: kernels/triton_utils.py's
    `SPECDEC_STATE_TILE`), or with the package's own tiles for None; the variable as it was after."""
    from specdec.kernels.triton_utils import TILE_ENV

    before = os.environ.pop(TILE_ENV, None)
    if tile:
        os.environ[TILE_ENV] = tile
    try:
        yield
    finally:
        os.environ.pop(TILE_ENV, None)
        if before is not None:
            os.environ[TILE_ENV] = before


def token_lengths(parser, text: str, least: int, why: str) -> list[int]:
    """`--tokens`: a comma list of ints, each >= `least` (`why` says what sets that bound); a parser error else."""
    try:
        lengths = [int(x) for x in split_list(text)]
    except ValueError:
        parser.error(f"--tokens: expected a comma list of ints, got {text!r}")
    if not lengths or min(lengths) < least:
        parser.error(f"--tokens: expected lengths >= {why}, got {text!r}")
    return lengths


def trained_drafters(parser, model_dir: Path, names: str, missing: str) -> dict[str, str]:
    """`--drafters`: name -> the trained drafter directory of each (`resolve_drafter`); `missing`: the error's words
    for a name that is not one."""
    out = {}
    for name in split_list(names):
        path, why = resolve_drafter(model_dir, name)
        if path is None or path == name:
            parser.error(f"--drafters: {why or f'{name!r} {missing}'}")
        out[name] = path
    return out


def load_cpu_model(model_dir: Path, threads: int):
    """The model of `model_dir` in float32 on the CPU with `threads` torch threads (transformers' progress bars off,
    fla's CPU warning silenced)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")  # fla on CPU
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
