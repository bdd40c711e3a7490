"""The result of opening part of the vocabulary: which tokens, and their exact logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.kernels import take_rows

# Rows dequantized at a time: 1024 rows of float32 (a few MB on the packaged heads) stay in cache
# while their dot products read them back; gathered all at once, they left the cache before being
# read (docs/certified-head.md, "A screen's opening budget"). The bits do not depend on the chunk.
GATHER_CHUNK_ROWS = 1024


@dataclass
class Opened:
    """Tokens whose exact logits were computed, and whether they certify the request."""

    ids: torch.Tensor  # [n] token ids
    logits: torch.Tensor  # [n] exact logits (bias included)
    certified: bool


def exact_logits(
    weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Exact float32 logits [n] of tokens `ids` for one hidden state [d], gathered in cache-sized chunks."""
    logits = torch.cat([take_rows(weight, part) @ hidden for part in ids.split(GATHER_CHUNK_ROWS)])  # [n]
    return logits + bias[ids] if bias is not None else logits
