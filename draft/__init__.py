"""Drafters: ngram (prompt lookup), model (a small causal LM), `NoDraft` (none: plain decoding), and the trained
kinds `mtp`, `eagle`, `dspark` (`specdec.draft.mtp` / `.eagle` / `.dspark`, built or loaded through
`specdec.draft.registry`); `make_drafter` builds the one an engine asks for."""

from .base import DraftBlock, Drafter, NoDraft, TargetView
from .factory import make_drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftBlock", "Drafter", "ModelDrafter", "NgramDrafter", "NoDraft", "TargetView", "make_drafter"]
