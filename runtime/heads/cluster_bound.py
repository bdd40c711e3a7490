"""Cluster bound (CSV-Decode): one upper bound per cluster of LM-head rows.

For a cluster c with centroid mu_c of the raw rows and Euclidean radius R_c, Cauchy-Schwarz gives
<W_i, h> <= <mu_c, h> + R_c |h| for every row i in c. With the unit direction u_c and the
angular radius theta_c (largest angle between a row and u_c) it also holds that
<W_i, h> <= max_i |W_i| |h| cos(max(0, angle(h, u_c) - theta_c)). Both are evaluated in float64
and the smaller is kept; a float32 rounding slack covers the exact logits they are compared with.
Bias: the m largest biases of each cluster are always opened, the bound uses the (m+1)-th.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.heads.opened import Opened, exact_logits
from runtime.heads.screen_bound import dot_rounding_gamma


# Adaptive budget constants from CSV-Decode (Runtime Optimization paragraph).
_ALPHA = 0.01
_TARGET_FALLBACK = 0.02


def concatenated_ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Indices of the ranges [start, start + length) laid end to end."""
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.long)
    # output_size spares repeat_interleave its own pass over `lengths` to size the output.
    shifts = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths, output_size=total)
    return torch.arange(total) + shifts


@dataclass
class ClusterState:
    """Cluster upper bounds for one batch of hidden states."""

    hidden: torch.Tensor  # [B, d]
    upper: torch.Tensor  # [B, C] float64 upper bound on every logit in the cluster

    def rows(self, start: int, end: int) -> "ClusterState":
        """The state of rows start..end - 1 alone."""
        return ClusterState(self.hidden[start:end], self.upper[start:end])


class ClusterBound:
    """Algorithm 1 of CSV-Decode: open clusters in descending bound order until top-k is certified."""

    name = "cluster"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tensors: dict[str, torch.Tensor],
        first_open: int = 16,
        max_open_fraction: float = 0.25,
        adaptive_budget: bool = False,
    ) -> None:
        self.weight = weight  # [V, d]
        self.bias = bias  # [V] or None
        self.permutation = tensors["permutation"].long()  # [V] token ids grouped by cluster
        self.offsets = tensors["offsets"].long()  # [C + 1]
        self.sizes = self.offsets[1:] - self.offsets[:-1]  # [C]
        self.cluster_of_token = torch.empty_like(self.permutation)  # [V]
        self.cluster_of_token[self.permutation] = torch.repeat_interleave(torch.arange(len(self.sizes)), self.sizes)
        self.centroids = tensors["centroids"].double()  # [C, d]
        self.radii = tensors["radii"].double()  # [C]
        self.directions = tensors["directions"].double()  # [C, d] unit vectors
        self.angular_radii = tensors["angular_radii"].double()  # [C]
        self.max_norms = tensors["max_norms"].double()  # [C]
        self.row_norms = None  # the clusters stage stores no per-row norms
        self.bias_rest_max = tensors["bias_rest_max"].double() if bias is not None else None  # [C]
        self.bias_top_ids = tensors["bias_top_ids"].long() if bias is not None else None  # [C, m], -1 = none
        self.slack = dot_rounding_gamma(weight.shape[1]) * self.max_norms * (1 + 1e-6)  # [C]
        self.first_open = first_open
        self.budget_fraction = max_open_fraction
        self.adaptive_budget = adaptive_budget

    def prepare(self, hidden: torch.Tensor) -> ClusterState:
        """Upper bounds [B, C] for a batch of hidden states [B, d]."""
        h = hidden.double()  # [B, d]
        hnorm = h.norm(dim=1)  # [B]
        euclid = h @ self.centroids.T + self.radii[None] * hnorm[:, None]  # [B, C]
        cos = (h @ self.directions.T / hnorm[:, None]).clamp(-1, 1)  # [B, C]
        gap = (torch.arccos(cos) - self.angular_radii[None]).clamp(min=0)  # [B, C]
        angular = self.max_norms[None] * hnorm[:, None] * torch.cos(gap)  # [B, C]
        upper = torch.minimum(euclid, angular) + self.slack[None] * hnorm[:, None]
        upper = upper * (1 + 1e-9) + 1e-9  # float64 rounding of the bound itself
        if self.bias_rest_max is not None:
            upper = upper + self.bias_rest_max[None]
        return ClusterState(hidden, upper)

    def _cluster_tokens(self, clusters: torch.Tensor) -> torch.Tensor:
        """Token ids of the given clusters, concatenated."""
        return self.permutation[concatenated_ranges(self.offsets[clusters], self.sizes[clusters])]

    def _scaled_bounds(self, state: ClusterState, row: int, temperature: float, noise: torch.Tensor | None):
        upper = state.upper[row] / temperature if temperature > 0 else state.upper[row].clone()
        if noise is not None:
            noise_max = torch.full((len(self.sizes),), float("-inf"), dtype=torch.float64)
            noise_max.scatter_reduce_(0, self.cluster_of_token, noise.double(), reduce="amax")
            upper = upper + noise_max
        return upper  # [C]

    @property
    def max_open_tokens(self) -> int:
        return int(self.budget_fraction * self.weight.shape[0])

    def open_topk(
        self, state: ClusterState, row: int, k: int, temperature: float, noise: torch.Tensor | None
    ) -> Opened:
        """Open clusters in descending bound order, doubling the batch, until top-k is certified.

        Not certified when certification would open more than the budget (the caller falls back).
        """
        opened = self._open_topk(state, row, k, temperature, noise)
        if self.adaptive_budget:
            self._adapt_budget(fell_back=not opened.certified)
        return opened

    def _adapt_budget(self, fell_back: bool) -> None:
        """CSV-Decode's K_max(t+1) = K_max(t) (1 + alpha (rho_target - rho_fall(t))), alpha 0.01, rho 0.02."""
        self.budget_fraction *= 1 + _ALPHA * (_TARGET_FALLBACK - float(fell_back))
        self.budget_fraction = min(1.0, max(1.0 / self.weight.shape[0], self.budget_fraction))

    def _open_topk(
        self, state: ClusterState, row: int, k: int, temperature: float, noise: torch.Tensor | None
    ) -> Opened:
        upper = self._scaled_bounds(state, row, temperature, noise)  # [C]
        order = torch.argsort(upper, descending=True)
        hidden = state.hidden[row]
        ids = self._always_open()
        logits = exact_logits(self.weight, self.bias, hidden, ids)
        opened_clusters, target = 0, self.first_open
        while True:
            new = order[opened_clusters:target]
            new_ids = self._cluster_tokens(new)
            if self.bias_top_ids is not None:
                new_ids = new_ids[~torch.isin(new_ids, ids)]
            ids = torch.cat([ids, new_ids])
            logits = torch.cat([logits, exact_logits(self.weight, self.bias, hidden, new_ids)])
            opened_clusters = target
            if ids.numel() >= k:
                scores = self._scores(logits, ids, temperature, noise)
                next_bound = upper[order[opened_clusters]] if opened_clusters < len(order) else float("-inf")
                if torch.topk(scores, k).values[-1] >= next_bound:
                    return Opened(ids, logits, certified=True)
            target = min(2 * target, len(order))
            if int(self.sizes[order[:target]].sum()) > self.max_open_tokens:
                return Opened(ids, logits, certified=False)  # the next batch would exceed the budget

    def _always_open(self) -> torch.Tensor:
        if self.bias_top_ids is None:
            return torch.empty(0, dtype=torch.long)
        ids = self.bias_top_ids.flatten()
        return torch.unique(ids[ids >= 0])

    @staticmethod
    def _scores(logits: torch.Tensor, ids: torch.Tensor, temperature: float, noise: torch.Tensor | None):
        scores = logits / temperature if temperature > 0 else logits
        return scores + noise[ids] if noise is not None else scores

    def tail_logsumexp(self, state: ClusterState, row: int, opened: torch.Tensor, temperature: float) -> float:
        """Upper bound on log sum over unopened tokens of exp(l_i / T): |c| exp(U_c / T) per cluster."""
        unopened_per_cluster = self.sizes.clone()
        unopened_per_cluster.scatter_add_(0, self.cluster_of_token[opened], -torch.ones_like(opened))
        mask = unopened_per_cluster > 0
        if not bool(mask.any()):
            return float("-inf")
        terms = state.upper[row][mask] / temperature + torch.log(unopened_per_cluster[mask].double())
        return float(torch.logsumexp(terms, 0)) + 1e-9

    def required_open(self, state: ClusterState, row: int, logits: torch.Tensor, k: int) -> int:
        """Tokens in clusters whose bound reaches the true k-th logit: what certifying top-k must open."""
        kth = torch.topk(logits, k).values[-1].double()
        return int(self.sizes[state.upper[row] >= kth].sum())
