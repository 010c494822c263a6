from .naive import recurrent_delta_rule, short_conv

__all__ = ["recurrent_delta_rule", "short_conv"]
