"""transformers' pure-torch paths for the hybrid families (fla's Triton kernels do not run on CPU)."""

from __future__ import annotations

import contextlib
import importlib

FAMILIES = ("kimi_linear", "qwen3_next", "qwen3_5")


@contextlib.contextmanager
def torch_fallbacks(*families: str):
    """Route transformers' linear-attention layers to its own pure-torch code: swap each hub/fla-backed
    function of the modeling module for its `__wrapped__` original, restored on exit. Needed to run the
    transformers model's own forward (training, reference outputs) on CPU when fla is installed."""
    swaps = []
    for fam in families or FAMILIES:
        mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        for name, fn in list(vars(mod).items()):
            orig = getattr(fn, "__wrapped__", None)
            if callable(fn) and orig is not None and getattr(fn, "__module__", None) == mod.__name__:
                swaps.append((mod, name, fn))
                setattr(mod, name, orig)
    try:
        yield
    finally:
        for mod, name, fn in swaps:
            setattr(mod, name, fn)
