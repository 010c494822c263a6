from .naive import short_conv_verify, verify_delta_rule

__all__ = ["short_conv_verify", "verify_delta_rule"]
