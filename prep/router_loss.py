"""Router training losses: which clusters count as right for a position, and how wrong scores cost.

- "ce": cross-entropy on the cluster of the target's top-1 (DynaSpec).
- "multilabel": binary cross-entropy against every cluster holding one of the target's top
  tokens with probability >= MIN_PROB (the top-1's cluster always): a shortlist that covers the
  runner-up tokens as well serves sampled drafts, where the target's mass is spread.

Validation recall is measured on the top-1's cluster for both, so the two compare directly.
"""

from __future__ import annotations

import torch

LOSSES = ("ce", "multilabel")
MIN_PROB = 0.05


def positive_clusters(labels: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor) -> torch.Tensor:
    """Clusters [N, K] of the top tokens [N, K] (best first) that count as right; -1 marks none.

    Column 0 is the top-1's cluster whatever its probability.
    """
    clusters = labels[top_ids.long()]  # [N, K]
    keep = top_probs.float() >= MIN_PROB
    keep[:, 0] = True
    return torch.where(keep, clusters, torch.full_like(clusters, -1))


def router_loss(kind: str, scores: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Loss of scores [B, M] against positives [B, K] (column 0: the top-1's cluster)."""
    if kind == "ce":
        return torch.nn.functional.cross_entropy(scores, positives[:, 0])
    if kind == "multilabel":
        target = torch.zeros_like(scores)  # [B, M] multi-hot
        rows, cols = torch.nonzero(positives >= 0, as_tuple=True)
        target[rows, positives[rows, cols]] = 1.0
        # Summed over clusters: a mean over M = 256 would shrink the few positives' gradient 256x.
        return torch.nn.functional.binary_cross_entropy_with_logits(scores, target, reduction="sum") / len(scores)
    raise ValueError(f"unknown router loss {kind!r}; use {' or '.join(LOSSES)}")
