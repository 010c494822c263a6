"""Pick the Triton kernel or the torch reference for each op.

Triton runs when the tensors are on CUDA, or everywhere when the environment sets
`SPECDEC_FORCE_TRITON=1` (the CPU tests do that under `TRITON_INTERPRET=1`). fp64 always goes to the
reference (the kernels compute in fp32). The Triton modules are imported on first use only, so
importing `specdec.kernels` never imports triton.

The mamba2 rule (`rule="mamba2"`) takes the same Triton kernels (a constexpr flag of each); its torch side is the
per-token recurrence (`verify/naive.py`) and the reference fold.

The torch side of `verify_delta_rule` is the chunk form (`verify/chunk.py`: one WY chunk per round, no
per-token loop), fp64 included, so the float64 property tests check the path the CPU runs; the per-token
recurrence (`verify/naive.py`) is the independent oracle the tests compare it with.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from .fold.naive import exact_fold as _ref_exact_fold
from .rebuild.naive import fast_rebuild as _ref_fast_rebuild
from .scatter.naive import masked_scatter as _ref_masked_scatter
from .verify.chunk import verify_delta_rule as _ref_verify_delta_rule
from .verify.naive import short_conv_verify as _ref_short_conv_verify
from .verify.naive import verify_delta_rule as _ref_verify_recurrent

# op name -> (reference, Triton module relative to this package)
OPS = {
    "verify_delta_rule": (_ref_verify_delta_rule, ".verify.triton"),
    "short_conv_verify": (_ref_short_conv_verify, ".verify.triton"),
    "exact_fold": (_ref_exact_fold, ".fold.triton"),
    "fast_rebuild": (_ref_fast_rebuild, ".rebuild.triton"),
    "masked_scatter": (_ref_masked_scatter, ".scatter.triton"),
}


def force_triton() -> bool:
    return os.environ.get("SPECDEC_FORCE_TRITON", "") == "1"


def triton_impl(name: str):
    """The Triton implementation of op `name` (imports its module)."""
    if name not in OPS:
        raise ValueError(f"name: unknown op {name!r}; known: {sorted(OPS)}")
    return getattr(importlib.import_module(OPS[name][1], __package__), name)


def reference_impl(name: str):
    """The torch reference of op `name`."""
    if name not in OPS:
        raise ValueError(f"name: unknown op {name!r}; known: {sorted(OPS)}")
    return OPS[name][0]


def uses_triton(*tensors) -> bool:
    """Whether `pick` chooses the Triton kernels for these tensors."""
    flat = _tensors(tensors)
    return not any(t.dtype == torch.float64 for t in flat) and (force_triton() or any(t.is_cuda for t in flat))


def _tensors(tensors) -> list[torch.Tensor]:
    flat = []
    for t in tensors:
        if isinstance(t, (tuple, list)):
            flat.extend(x for x in t if isinstance(x, torch.Tensor))
        elif isinstance(t, torch.Tensor):
            flat.append(t)
    return flat


def pick(name: str, *tensors):
    """Triton for CUDA tensors (or with SPECDEC_FORCE_TRITON=1), else the reference; fp64 -> reference.

    `tensors` may hold None and tuples of tensors (rings); only tensors are looked at.
    """
    return triton_impl(name) if uses_triton(*tensors) else reference_impl(name)


# the reference of each op that takes the mamba2 rule, where the Triton kernel does not run (the chunk-form
# verify is delta-rule only: the CPU runs the per-token recurrence); on CUDA tensors (or forced) the rule runs
# the Triton kernels like the delta rule (their MAMBA2 flag)
MAMBA2_REFS = {"verify_delta_rule": _ref_verify_recurrent, "exact_fold": _ref_exact_fold}


def _dispatched(name: str):
    ref = reference_impl(name)

    @functools.wraps(ref)
    def op(*args, **kwargs):
        rule = kwargs.get("rule", "delta")
        if rule != "delta":
            if name not in MAMBA2_REFS:
                raise ValueError(f"rule: {name} takes no rule, got {rule!r}")
            impl = triton_impl(name) if uses_triton(*args, *kwargs.values()) else MAMBA2_REFS[name]
            return impl(*args, **kwargs)
        kwargs.pop("rule", None)  # the delta rule is every kernel's default
        return pick(name, *args, *kwargs.values())(*args, **kwargs)

    doc = MAMBA2_REFS.get(name, ref).__doc__ or ""  # the per-token reference's: the chunk form refers to it
    op.__doc__ = doc + "\n    Dispatched: Triton on CUDA tensors (see specdec.kernels.dispatch).\n"
    return op


verify_delta_rule = _dispatched("verify_delta_rule")
short_conv_verify = _dispatched("short_conv_verify")
exact_fold = _dispatched("exact_fold")
fast_rebuild = _dispatched("fast_rebuild")
masked_scatter = _dispatched("masked_scatter")

__all__ = ["OPS", "pick", "triton_impl", "reference_impl", "force_triton", "verify_delta_rule",
           "short_conv_verify", "exact_fold", "fast_rebuild", "masked_scatter"]
