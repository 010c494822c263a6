from .naive import fast_rebuild

__all__ = ["fast_rebuild"]
