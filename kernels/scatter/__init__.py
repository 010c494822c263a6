from .naive import masked_scatter

__all__ = ["masked_scatter"]
