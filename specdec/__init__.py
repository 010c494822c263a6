"""specdec: lossless speculative decoding for hybrid linear-attention LLMs.

Importing this package has no side effects: no device probing, no environment changes.
"""

__version__ = "0.1.0"
