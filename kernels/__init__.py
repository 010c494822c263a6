"""Kernels: pure-torch references and Triton kernels behind one dispatcher."""

if __name__ == "kernels":
    # Imported as a top-level `kernels`: the checkout root is on sys.path (`python -m specdec ...` run from it), and
    # this folder stands in the way of the PyPI package `kernels`, which transformers imports when it is installed.
    # Hand the import the real package; where there is none, be what a folder without `__init__.py` would be: an
    # empty namespace (no `__file__`, no version, nothing under it), which is how transformers' probe tells a
    # folder on sys.path from an installed package. Raising here broke every transformers model import from the
    # checkout root where `kernels` is not installed (transformers 5.17 probes for it at load and does not catch it).
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))  # (real paths: a symlinked checkout)
    _spec = _machinery.PathFinder.find_spec("kernels", [p for p in _sys.path if _os.path.realpath(p or ".") != _root])
    if _spec is None:
        del __file__
        __path__ = []
    else:
        _real = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _real  # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_real)
else:
    from .chunk import chunk_delta_rule
    from .common import kda_gate
    from .dispatch import exact_fold, fast_rebuild, masked_scatter, pick, short_conv_verify, verify_delta_rule
    from .recurrent import recurrent_delta_rule, short_conv

    __all__ = ["verify_delta_rule", "short_conv_verify", "exact_fold", "fast_rebuild", "masked_scatter",
               "recurrent_delta_rule", "chunk_delta_rule", "short_conv", "pick", "kda_gate"]
