"""Drafters for speculative decoding: one protocol (propose, observe), several ways to guess ahead."""

from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.layers import LayerDrafter
from runtime.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "LayerDrafter", "NgramDrafter", "Proposal"]
