"""Kernels: pure-torch references and Triton kernels behind one dispatcher."""

from .chunk import chunk_delta_rule
from .common import kda_gate
from .dispatch import exact_fold, fast_rebuild, masked_scatter, pick, short_conv_verify, verify_delta_rule
from .recurrent import recurrent_delta_rule, short_conv

__all__ = ["verify_delta_rule", "short_conv_verify", "exact_fold", "fast_rebuild", "masked_scatter",
           "recurrent_delta_rule", "chunk_delta_rule", "short_conv", "pick", "kda_gate"]
