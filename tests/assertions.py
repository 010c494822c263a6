"""The tests' comparisons: one `assert_close` with a dtype tolerance table, a relative error, the sample counts and
chi-square goodness-of-fit of the sampling tests, and the tree walks the tree checks build their expectations on."""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# (rtol, atol) per dtype. fp32/fp64 entries are for results computed in a different op order;
# results computed in the same op order are compared bitwise (`exact=True`).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """`(rtol, atol)` for `dtype` from the table."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance for {dtype}; known: {sorted(map(str, TOLERANCES))}")
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 exact: bool = False, msg: str = "") -> None:
    """Compare `actual` to `expected` with the tolerance of `dtype` (default: `expected.dtype`).

    `exact=True` demands bitwise equality (NaNs at the same places count as equal).
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if exact:
        same = (actual == expected) | (actual.isnan() & expected.isnan())
        if not bool(same.all()):
            diff = (actual.double() - expected.double()).abs().nan_to_num(float("inf"))
            raise AssertionError(f"{msg}: not bitwise equal; {int((~same).sum())} elements differ, "
                                 f"max abs diff {diff.max().item():.3e}")
        return
    rtol, atol = tolerance(dtype or expected.dtype)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{msg}: {m}")


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max(|e|.max(), tiny): one scalar relative error for a whole tensor."""
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    e = expected.double()
    denom = e.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return ((actual.double() - e).abs().max() / denom).item()


def tree_node_sequences(prefix: torch.Tensor, tokens: torch.Tensor, parent: list[int]) -> list[torch.Tensor]:
    """Per tree node, the token sequence it stands for: `prefix [P]` then the tokens on its root path.
    `tokens [T]`, `parent[i] < i` (-1 = root)."""
    return [torch.cat([prefix, tokens[root_path(parent, node)]]) for node in range(len(parent))]


def root_path(parent: list[int], node: int) -> list[int]:
    """Node indices from the root down to `node` (`parent[i] < i`, -1 = root)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parent[node]
    return path[::-1]


def count_samples(engine, n: int, seed: int, *, prompt: list[int], vocab: int, new: int, batch: int,
                  stats=("proposed", "accepted", "drafter_failures"), **params) -> tuple[torch.Tensor, dict]:
    """Counts `[vocab ** new]` of the first `new` tokens of `n` sampled continuations of `prompt` (`n // batch` calls
    of `batch` copies, seeds `seed`, `seed + 1`, ...; `params` go to `generate`), and the draft stats `stats`
    summed: the sampled side of `chi2_gof` against the target's exact joint."""
    counts = torch.zeros(vocab ** new, dtype=torch.long)
    place = vocab ** torch.arange(new - 1, -1, -1)
    totals = dict.fromkeys(stats, 0)
    prompts = torch.tensor(prompt).expand(batch, -1)
    params = {"top_k": 0, **params}  # `SamplingParams`' default, as the exact joint uses (transformers' is 50)
    for call in range(n // batch):
        out = engine.generate(prompts, max_new_tokens=new, do_sample=True, seed=seed + call, eos_token_id=None,
                              **params)
        tokens = out.sequences[:, len(prompt):]
        assert tokens.shape == (batch, new) and bool(((tokens >= 0) & (tokens < vocab)).all())
        counts += torch.bincount((tokens * place).sum(1), minlength=vocab ** new)
        for k in totals:
            totals[k] += getattr(out.stats, k)
    return counts, totals


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper `alpha` quantile of chi-square(df), Wilson-Hilferty approximation."""
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def chi2_gof(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of `counts` against `probs` (flat, same length).

    Cells of probability 0 must be empty. Cells expecting fewer than 5 are pooled into one; if the pool
    still expects fewer than 5 it joins the smallest remaining cell.
    """
    counts, probs = counts.double().flatten(), probs.double().flatten()
    assert counts[probs == 0].sum() == 0, "an outcome of probability 0 under the target was emitted"
    exp = probs * counts.sum()
    live = probs > 0
    big = live & (exp >= 5)
    obs_cells, exp_cells = list(counts[big]), list(exp[big])
    small = live & ~big
    if small.any():
        pool_o, pool_e = counts[small].sum(), exp[small].sum()
        if pool_e < 5 and exp_cells:
            j = min(range(len(exp_cells)), key=lambda i: float(exp_cells[i]))
            pool_o, pool_e = pool_o + obs_cells.pop(j), pool_e + exp_cells.pop(j)
        obs_cells.append(pool_o)
        exp_cells.append(pool_e)
    o, e = torch.stack(obs_cells), torch.stack(exp_cells)
    return float(((o - e) ** 2 / e).sum()), len(obs_cells) - 1


class RecordedOps(TorchDispatchMode):
    """Inside it, every aten op run is recorded with the shapes of its tensor arguments (`ops`): two runs that
    record the same list did the same work on the same shapes."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        self.ops.append((str(func), tuple(tuple(a.shape) for a in leaves if isinstance(a, torch.Tensor))))
        return func(*args, **kwargs)
