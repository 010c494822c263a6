"""Kernels: pure-torch references and Triton kernels behind one dispatcher."""

from .fold import exact_fold
from .rebuild import fast_rebuild
from .recurrent import recurrent_delta_rule, short_conv
from .scatter import masked_scatter
from .verify import short_conv_verify, verify_delta_rule

__all__ = ["exact_fold", "fast_rebuild", "masked_scatter", "recurrent_delta_rule", "short_conv",
           "short_conv_verify", "verify_delta_rule"]
