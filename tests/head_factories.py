"""Head factories the tests share: screen and cluster bounds over a TinyHead, its exact logits, hidden-state sets.

A plain module, as factories.py is; cluster_tensors caches per head (k-means is the slow part).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from factories import TinyHead, random_hidden
from prep.cluster import build_clusters
from prep.screen import quantize_int8
from runtime.heads import ClusterBound, ScreenBound
from runtime.heads.screen_bound import MAX_OPEN_FRACTION


def screen_bound(head: TinyHead, group_size: int = 0, max_open_fraction: float = MAX_OPEN_FRACTION) -> ScreenBound:
    return ScreenBound.from_stage(head.weight, head.bias, quantize_int8(head.weight, group_size), max_open_fraction)


_CLUSTER_CACHE: dict[tuple, dict] = {}


def cluster_tensors(head: TinyHead, clusters: int = 64) -> dict[str, torch.Tensor]:
    """Stage `clusters` tensors for a head, built once per head (k-means is the slow part)."""
    key = (tuple(head.weight[:2, :4].flatten().tolist()), head.bias is not None, tuple(head.weight.shape), clusters)
    if key not in _CLUSTER_CACHE:
        _CLUSTER_CACHE[key] = build_clusters(head.weight, head.bias, clusters, iterations=10, top_m=3, seed=0,
                                             progress=False)[0]
    return _CLUSTER_CACHE[key]


def cluster_bound(head: TinyHead, max_open_fraction: float = 1.0) -> ClusterBound:
    return ClusterBound(head.weight, head.bias, cluster_tensors(head), max_open_fraction=max_open_fraction)


def exact_logits(head: TinyHead, hidden: torch.Tensor) -> torch.Tensor:
    """The reference logits [B, V]: float32 F.linear, as the full head computes them."""
    return F.linear(hidden, head.weight, head.bias)


def hidden_sets(head: TinyHead) -> dict[str, torch.Tensor]:
    """Hidden states of realistic norm (with outlier coordinates), of very large norm, and small."""
    gen = torch.Generator().manual_seed(7)
    d = head.weight.shape[1]
    return {
        "norm-100": head.hidden,
        "norm-1e4": random_hidden(8, d, gen, norm=1e4),
        "norm-1": random_hidden(8, d, gen, norm=1.0),
    }
