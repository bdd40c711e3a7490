"""Stage `clusters`: spherical k-means of LM-head row directions, with sound radii and bias tables."""

from __future__ import annotations

import math
import sys
import time

import faiss
import numpy as np
import torch
from tqdm import tqdm

from runtime.common.fds import fd_redirected
from runtime.common.numerics import round_up_to_float32

_CHUNK = 16384


def spherical_kmeans(weight: torch.Tensor, clusters: int, iterations: int, seed: int, progress: bool) -> torch.Tensor:
    """Cluster label [V] per row from faiss spherical k-means of the unit row directions."""
    directions = torch.nn.functional.normalize(weight.float(), dim=1).numpy()
    kmeans = faiss.Kmeans(
        directions.shape[1], clusters, niter=iterations, spherical=True, seed=seed, verbose=progress,
        max_points_per_centroid=max(1, math.ceil(directions.shape[0] / clusters)),
    )
    started = time.perf_counter()
    with fd_redirected(1, 2):  # faiss's C++ progress lines go to stderr, not into the command's output
        kmeans.train(directions)
    _, labels = kmeans.index.search(directions, 1)
    if progress:
        print(f"k-means: {clusters} clusters in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return torch.from_numpy(labels[:, 0].astype(np.int64))


def _compact(labels: torch.Tensor) -> torch.Tensor:
    """Relabel so cluster ids are 0..C-1 with no empty cluster."""
    _, compact = torch.unique(labels, return_inverse=True)
    return compact


def cluster_geometry(weight: torch.Tensor, labels: torch.Tensor, progress: bool) -> dict[str, torch.Tensor]:
    """Centroids, Euclidean / angular radii and max row norms per cluster, in float64, rounded up."""
    V, d = weight.shape
    C = int(labels.max()) + 1
    sizes = torch.bincount(labels, minlength=C).double()
    sums = torch.zeros(C, d, dtype=torch.float64)
    unit_sums = torch.zeros(C, d, dtype=torch.float64)
    chunks = range(0, V, _CHUNK)
    for start in tqdm(chunks, desc="centroids", disable=not progress, unit="chunk"):
        rows, lab = weight[start : start + _CHUNK].double(), labels[start : start + _CHUNK]
        sums.index_add_(0, lab, rows)
        unit_sums.index_add_(0, lab, torch.nn.functional.normalize(rows, dim=1))
    centroids = sums / sizes[:, None]
    directions = torch.nn.functional.normalize(unit_sums, dim=1)
    radii = torch.zeros(C, dtype=torch.float64)
    min_cos = torch.ones(C, dtype=torch.float64)
    max_norms = torch.zeros(C, dtype=torch.float64)
    for start in tqdm(chunks, desc="radii", disable=not progress, unit="chunk"):
        rows, lab = weight[start : start + _CHUNK].double(), labels[start : start + _CHUNK]
        norms = rows.norm(dim=1)
        radii.scatter_reduce_(0, lab, (rows - centroids[lab]).norm(dim=1), reduce="amax")
        cos = ((rows * directions[lab]).sum(1) / norms.clamp(min=1e-300)).clamp(-1, 1)
        min_cos.scatter_reduce_(0, lab, cos, reduce="amin")
        max_norms.scatter_reduce_(0, lab, norms, reduce="amax")
    # Widen by a relative 1e-12 so float64 rounding of the sums above cannot make a bound too small.
    angular = torch.arccos(min_cos) * (1 + 1e-12) + 1e-12
    return {
        # Kept in float64: the radii are measured from these exact vectors.
        "centroids": centroids,
        "radii": round_up_to_float32(radii * (1 + 1e-12)),
        "directions": directions,
        "angular_radii": round_up_to_float32(angular),
        "max_norms": round_up_to_float32(max_norms * (1 + 1e-12)),
    }


def bias_tables(bias: torch.Tensor | None, labels: torch.Tensor, top_m: int) -> dict[str, torch.Tensor]:
    """Per cluster: the ids of its top_m biases (-1 padded) and the largest bias among the rest."""
    C = int(labels.max()) + 1
    if bias is None:
        return {}
    top_ids = torch.full((C, top_m), -1, dtype=torch.long)
    rest_max = torch.full((C,), float("-inf"), dtype=torch.float32)
    order = torch.argsort(bias.float(), descending=True, stable=True)
    ordered_labels = labels[order]
    rank = torch.zeros(C, dtype=torch.long)
    for token, cluster in zip(order.tolist(), ordered_labels.tolist()):
        r = int(rank[cluster])
        if r < top_m:
            top_ids[cluster, r] = token
        elif r == top_m:
            rest_max[cluster] = bias[token]
        rank[cluster] += 1
    return {"bias_top_ids": top_ids, "bias_rest_max": rest_max}


def build_clusters(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    clusters: int,
    iterations: int = 10,
    top_m: int = 3,
    seed: int = 0,
    progress: bool = True,
):
    """Tensors and params of stage `clusters`."""
    if not 1 <= clusters <= weight.shape[0]:
        raise ValueError(f"--clusters must be between 1 and the vocabulary size {weight.shape[0]}")
    started = time.perf_counter()
    labels = _compact(spherical_kmeans(weight, clusters, iterations, seed, progress))
    permutation = torch.argsort(labels, stable=True)
    sizes = torch.bincount(labels)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)])
    tensors = {
        "labels": labels,
        "permutation": permutation,
        "offsets": offsets,
        "sizes": sizes,
        **cluster_geometry(weight, labels, progress),
        **bias_tables(bias, labels, top_m),
    }
    params = {
        "clusters_requested": clusters,
        "clusters": int(len(sizes)),
        "iterations": iterations,
        "seed": seed,
        "top_m_bias": top_m,
        "has_bias": bias is not None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    return tensors, params
