from .naive import chunk_delta_rule, wy_terms

__all__ = ["chunk_delta_rule", "wy_terms"]
