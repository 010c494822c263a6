"""specdec.verify"""

from .accept import accept_chain_greedy, accept_chain_sampling, accept_tree_greedy, accept_tree_sampling
from .sampling import SamplingParams, probs_from_logits, sample_token

__all__ = ["SamplingParams", "probs_from_logits", "sample_token", "accept_chain_greedy", "accept_chain_sampling",
           "accept_tree_greedy", "accept_tree_sampling"]
