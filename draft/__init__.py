"""Drafters: ngram (prompt lookup), model (a small causal LM), `NoDraft` (none: plain decoding), and the trained
kinds `mtp`, `eagle`, `dspark`, `native` (their nets and training in `specdec.draft.mtp` / `.eagle` / `.dspark` /
`.native`, built or loaded through `specdec.draft.registry`; their drafters, on `head.HeadDrafter`, in
`specdec.draft.mtp_drafter` etc.); `make_drafter` builds the one an engine asks for."""

from .base import Contexts, DraftBlock, Drafter, NoDraft, Observation, TargetView
from .factory import make_drafter
from .follower import Follower
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["Contexts", "DraftBlock", "Drafter", "Follower", "ModelDrafter", "NgramDrafter", "NoDraft", "Observation",
           "TargetView", "make_drafter"]
