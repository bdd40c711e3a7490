"""The plain LM head: every logit, every step. The reference every fast head is checked against."""

from __future__ import annotations

import torch

from runtime.common.sampling import SamplingParams, sample_rows
from runtime.kernels import linear
from runtime.heads.rowwise import logits_key, rowwise
from runtime.common.stats import HeadStats


class FullHead:
    """Full-vocabulary head: logits = h W^T + b."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [V, d]
        self.bias = bias  # [V] or None
        self.vocab_size = weight.shape[0]
        self.stats = HeadStats(vocab_size=self.vocab_size)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [B, V] for hidden states [B, d] (a row-wise call: runtime.heads.rowwise)."""
        return rowwise(self._logits, hidden, logits_key(self.weight, self.bias))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, self.bias)  # [B, V]

    def select(
        self, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Next token per row [B] for hidden states [B, d]."""
        tokens = sample_rows(self.logits(hidden), params, generator)  # [B]
        self.stats.rows += len(tokens)
        self.stats.recomputed_tokens += len(tokens) * self.vocab_size
        return tokens
