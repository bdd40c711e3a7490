"""The result of opening part of the vocabulary: which tokens, and their exact logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import take_rows


@dataclass
class Opened:
    """Tokens whose exact logits were computed, and whether they certify the request."""

    ids: torch.Tensor  # [n] token ids
    logits: torch.Tensor  # [n] exact logits (bias included)
    certified: bool


def exact_logits(
    weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Exact float32 logits [n] of tokens `ids` for one hidden state [d]."""
    logits = take_rows(weight, ids) @ hidden  # [n]
    return logits + bias[ids] if bias is not None else logits
