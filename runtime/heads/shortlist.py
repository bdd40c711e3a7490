"""Shortlist head: a drafter's LM head that scores only a subset of the vocabulary.

Two uses: DynaSpec (seed 001), where a router picks token clusters per step and the shortlist is
the union of those clusters plus the always-kept ids (EOS, special tokens); and FR-Spec, a static
list of the most frequent tokens. Tokens outside the shortlist get logit -inf, so draft
probabilities are normalized on the shortlist. Only drafters use it: verification keeps the full
vocabulary, so the output stays exact whatever the shortlist misses.

The head's rows are stored grouped by cluster (one sorted copy, made once), so a chosen cluster
is one contiguous slice and a step costs one small matmul per chosen cluster, no gather.
"""

from __future__ import annotations

import torch

from runtime.heads.sampling import SamplingParams, gumbel_noise, sample_full
from runtime.stats import HeadStats


class ShortlistHead:
    """Logits on a shortlist of clusters, in full-vocabulary index space.

    labels: [V] cluster id in 0..M-1 per token, or -1 for tokens no cluster holds (never scored
    unless always-kept). always_ids: tokens scored at every step whatever the clusters.
    stats.recomputed_fraction is the mean shortlist size over V.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, always_ids: torch.Tensor):
        self.vocab_size = weight.shape[0]
        self.clusters = int(labels.max()) + 1 if labels.numel() and int(labels.max()) >= 0 else 0
        groups = labels.clone()
        groups[always_ids] = self.clusters  # the always-kept ids form the last group, never a cluster's
        kept = torch.nonzero(groups >= 0).squeeze(1)
        order = kept[torch.argsort(groups[kept], stable=True)]
        self.ids = order  # [n] token id of each sorted row
        self.weight = weight.index_select(0, order).contiguous()  # [n, d] rows grouped by cluster
        self.bias = None if bias is None else bias.index_select(0, order).contiguous()
        sizes = torch.bincount(groups[kept], minlength=self.clusters + 1)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)]).tolist()
        self.stats = HeadStats(vocab_size=self.vocab_size)
        self.choose([])

    @classmethod
    def static(cls, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> "ShortlistHead":
        """A fixed shortlist (FR-Spec): exactly `ids`, whatever is chosen."""
        if ids.numel() == 0:
            raise ValueError("a static shortlist needs at least one token")
        return cls(weight, bias, torch.full((weight.shape[0],), -1, dtype=torch.long), ids)

    def choose(self, clusters) -> None:
        """Score clusters `clusters` (ids in 0..M-1) plus the always-kept ids from now on."""
        groups = sorted({int(c) for c in clusters}) + [self.clusters]
        # Adjacent groups merge into one slice: fewer, larger matmuls.
        slices: list[list[int]] = []
        for g in groups:
            start, end = self.offsets[g], self.offsets[g + 1]
            if slices and slices[-1][1] == start:
                slices[-1][1] = end
            elif end > start:
                slices.append([start, end])
        self.slices = [(s, e) for s, e in slices]
        self.shortlist = torch.cat([self.ids[s:e] for s, e in self.slices]) if self.slices else self.ids[:0]
        self.size = int(self.shortlist.numel())

    def shortlist_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact logits [B, n] of the shortlist tokens (self.shortlist order) for hidden [B, d]."""
        parts = [torch.nn.functional.linear(
            hidden, self.weight[s:e], None if self.bias is None else self.bias[s:e]) for s, e in self.slices]
        self.stats.rows += hidden.shape[0]
        self.stats.recomputed_tokens += hidden.shape[0] * self.size
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, V]: exact on the shortlist, -inf elsewhere."""
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"))
        full[:, self.shortlist] = self.shortlist_logits(hidden)
        return full

    def select(
        self, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Next token per row [B] for hidden [B, d], chosen within the shortlist."""
        if params.greedy:
            return self.shortlist[self.shortlist_logits(hidden).argmax(dim=1)]
        logits = self.logits(hidden)  # [B, V]
        noise = gumbel_noise(hidden.shape[0], self.vocab_size, generator)
        return torch.tensor([sample_full(logits[b], params, noise[b]) for b in range(len(logits))], dtype=torch.long)
