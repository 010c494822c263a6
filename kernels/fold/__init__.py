from .naive import exact_fold

__all__ = ["exact_fold"]
