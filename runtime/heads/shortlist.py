"""Shortlist head: a drafter's LM head that scores only a subset of the vocabulary.

Two uses: DynaSpec, where a router picks token clusters per step and the shortlist is
the union of those clusters plus the always-kept ids (EOS, special tokens); and FR-Spec, a static
list of the most frequent tokens. Tokens outside the shortlist get logit -inf, so draft
probabilities are normalized on the shortlist. Only drafters use it: verification keeps the full
vocabulary, so the output stays exact whatever the shortlist misses.

With `context=True` the tokens of the sequence so far (prompt and drafts, told through
`add_context`) are in the shortlist too: a router that sees one token and one hidden state cannot
know which rare words the prompt holds, and copying them is what a drafter's accepted tokens
often are (on held-out ShareGPT, ~90 % of the layers:16 drafter's accepted tokens are in the
top-16 clusters, ~100 % with the context added).

The head's rows are stored grouped by cluster (one sorted copy, made once), so a chosen cluster
is one contiguous slice and a step costs one small matmul per chosen cluster, no gather; context
rows are copied once, when their token first appears, into a buffer of their own.
"""

from __future__ import annotations

import torch

from runtime.common.sampling import SamplingParams, sample_rows
from runtime.common.stats import HeadStats
from runtime.kernels import take_rows


class ShortlistHead:
    """Logits on a shortlist of clusters, in full-vocabulary index space.

    labels: [V] cluster id in 0..M-1 per token, or -1 for tokens no cluster holds (never scored
    unless always-kept). always_ids: tokens scored at every step whatever the clusters.
    context: the sequence's own tokens (`add_context`) are scored at every step too.
    stats.recomputed_fraction is the mean shortlist size over V (a token counted once).
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, always_ids: torch.Tensor,
        context: bool = False,
    ):
        self.vocab_size = weight.shape[0]
        self.full_weight, self.full_bias = weight, bias
        self.clusters = int(labels.max()) + 1 if labels.numel() and int(labels.max()) >= 0 else 0
        groups = labels.clone()
        groups[always_ids] = self.clusters  # the always-kept ids form the last group, never a cluster's
        kept = torch.nonzero(groups >= 0).squeeze(1)
        order = kept[torch.argsort(groups[kept], stable=True)]
        self.ids = order  # [n] token id of each sorted row
        self.weight = take_rows(weight, order).contiguous()  # [n, d] fp32 rows grouped by cluster
        self.bias = None if bias is None else bias.index_select(0, order).contiguous()
        sizes = torch.bincount(groups[kept], minlength=self.clusters + 1)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes, 0)]).tolist()
        # Group of every token, with index clusters + 1 for tokens in no group (never chosen).
        self.groups = torch.where(groups >= 0, groups, self.clusters + 1)  # [V]
        self.context = context
        self.stats = HeadStats(vocab_size=self.vocab_size)
        self._empty_context()
        self.choose([])

    @classmethod
    def static(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, context: bool = False
    ) -> "ShortlistHead":
        """A fixed shortlist (FR-Spec): `ids` (plus the context, with context=True), whatever is chosen."""
        if ids.numel() == 0:
            raise ValueError("a static shortlist needs at least one token")
        return cls(weight, bias, torch.full((weight.shape[0],), -1, dtype=torch.long), ids, context)

    def clear_context(self) -> None:
        """Forget the sequence's tokens (a new sequence starts)."""
        self._empty_context()
        self._refresh()

    def _empty_context(self) -> None:
        self.context_seen: set[int] = set()
        self.context_ids = torch.empty(0, dtype=torch.long)  # [c] in first-seen order
        self.context_rows = torch.empty((16, self.full_weight.shape[1]))  # [capacity, d] fp32

    def add_context(self, tokens: list[int]) -> None:
        """The sequence now holds `tokens`: score them at every step from now on (with context=True)."""
        if not self.context:
            return
        new = [t for t in dict.fromkeys(tokens) if t not in self.context_seen]
        if not new:
            return
        self.context_seen.update(new)
        ids = torch.tensor(new, dtype=torch.long)
        start, end = len(self.context_ids), len(self.context_ids) + len(new)
        if end > len(self.context_rows):  # grow by doubling: one copy per doubling, not per token
            rows = self.context_rows.new_empty((max(end, 2 * len(self.context_rows)), self.context_rows.shape[1]))
            rows[:start] = self.context_rows[:start]
            self.context_rows = rows
        self.context_rows[start:end] = take_rows(self.full_weight, ids)
        self.context_ids = torch.cat([self.context_ids, ids])
        self._refresh()

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
        self.chosen = torch.zeros(self.clusters + 2, dtype=torch.bool)  # [M + 2] by group id
        self.chosen[groups] = True
        self._refresh()

    def _refresh(self) -> None:
        """Rebuild the shortlist ids [n] (cluster slices, then the context) and its distinct size."""
        parts = [self.ids[s:e] for s, e in self.slices] + [self.context_ids]
        self.shortlist = torch.cat(parts)
        # A context token whose group is chosen is scored twice (same logit); it counts once.
        self.size = int(self.shortlist.numel()) - int(self.chosen[self.groups[self.context_ids]].sum())

    def shortlist_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact logits [B, n] of the shortlist tokens (self.shortlist order) for hidden [B, d]."""
        parts = [torch.nn.functional.linear(
            hidden, self.weight[s:e], None if self.bias is None else self.bias[s:e]) for s, e in self.slices]
        c = len(self.context_ids)
        if c:
            bias = None if self.full_bias is None else self.full_bias[self.context_ids]  # [c]: a few floats, no buffer
            parts.append(torch.nn.functional.linear(hidden, self.context_rows[:c], bias))
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
        return sample_rows(self.logits(hidden), params, generator)  # [B]
