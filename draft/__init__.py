"""Drafters: ngram (prompt lookup), model (a small causal LM)."""

from .base import DraftBlock, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftBlock", "Drafter", "ModelDrafter", "NgramDrafter"]
