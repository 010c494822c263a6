"""Drafters: ngram (prompt lookup), model (a small causal LM), and the trained kinds `mtp`, `eagle`, `dspark`
(`specdec.draft.mtp` / `.eagle` / `.dspark`, built or loaded through `specdec.draft.common`)."""

from .base import DraftBlock, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftBlock", "Drafter", "ModelDrafter", "NgramDrafter"]
