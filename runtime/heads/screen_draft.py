"""Screening draft head: the int8 screening copy of the LM head, used as a drafter's head.

A drafter needs no certified logits: verification scores every token with the full head, so a
draft from approximate logits costs acceptance, never exactness. The head scores the whole
vocabulary through the screening kernel (runtime.kernels.screen_gemv, the one ScreenBound uses),
about a quarter of the full head's weight bytes, and recomputes nothing.
"""

from __future__ import annotations

import torch

from runtime.common.sampling import SamplingParams, sample_rows
from runtime.heads.screen_bound import ScreenBound
from runtime.common.stats import HeadStats


class ScreenDraftHead:
    """Approximate logits [B, V] from the int8 head copy; greedy picks their argmax."""

    def __init__(self, bound: ScreenBound) -> None:
        self.bound = bound  # its int8 rows, scales and bias; its radii are not needed
        self.vocab_size = bound.qweight.shape[0]
        self.stats = HeadStats(vocab_size=self.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Screening logits [B, V] for hidden states [B, d] (bias included)."""
        self.stats.rows += hidden.shape[0]
        return self.bound.prepare(hidden.float()).center

    def select(
        self, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Next token per row [B] for hidden states [B, d], chosen on the screening logits."""
        logits = self.logits(hidden)  # [B, V]
        if params.greedy:
            return logits.argmax(dim=1)
        return sample_rows(logits, params, generator)
