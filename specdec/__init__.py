"""specdec: lossless speculative decoding for hybrid linear-attention LLMs.

    engine = specdec.wrap(model, drafter="ngram")
    out = engine.generate(input_ids, max_new_tokens=64)

Importing this package has no side effects: no device probing, no environment changes.
"""

__version__ = "0.1.0"


def wrap(model, config=None, **options):
    """See `specdec.engine.wrap`."""
    from .engine import wrap as _wrap
    return _wrap(model, config, **options)


def __getattr__(name):
    if name == "SpecConfig":  # imported on use: importing specdec stays free of torch work
        from .config import SpecConfig
        return SpecConfig
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


__all__ = ["wrap", "SpecConfig", "__version__"]
