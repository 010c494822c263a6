"""specdec.verify: acceptance rules and their record, sampling."""

from .accept import accept_chain_greedy, accept_chain_sampling, accept_round, accept_tree_greedy, accept_tree_sampling
from .record import Acceptance
from .sampling import SamplingParams, probs_from_logits, sample_token

__all__ = ["Acceptance", "SamplingParams", "probs_from_logits", "sample_token", "accept_chain_greedy",
           "accept_chain_sampling", "accept_round", "accept_tree_greedy", "accept_tree_sampling"]
