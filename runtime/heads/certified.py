"""CertifiedHead (CSV-Decode): exact decisions from a few exact logits plus sound upper bounds.

Modes, given a bound family (screen or cluster) that can open the tokens that might matter:
- greedy: certify top-1 of the logits;
- temperature T (no top-k / top-p): Gumbel-max, certify top-1 of l/T + g — an exact sample;
- top-k: certify the top-k set, sample inside it (top-p inside it too, exactly);
- top-p: certify the top-K set and bound the unopened mass; exact when the nucleus is decided;
- epsilon: sample from the opened set once the unopened mass is certified <= epsilon (TV <= epsilon).
When a bound cannot certify within its budget the head falls back to the full head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.heads.base import Bound, row_norms
from runtime.heads.opened import Opened
from runtime.kernels import linear
from runtime.common.numerics import dot_rounding_gamma
from runtime.heads.rowwise import logits_key, rowwise
from runtime.common.sampling import TOP_SET_SIZES, SamplingParams, gumbel_noise, nucleus_size, sample_full
from runtime.common.stats import HeadStats


@dataclass(frozen=True)
class _Row:
    """One row of one select call: the bound's batch state, the row index, |h| and the row's noise."""

    state: object
    index: int
    hidden_norm: float
    noise: torch.Tensor | None  # [V] Gumbel noise, None when greedy


class CertifiedHead:
    """LM head that computes exact logits only where a sound bound says they can matter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bound: Bound) -> None:
        self.weight = weight  # [V, d] (rows read through runtime.heads.base)
        self.bias = bias  # [V] or None
        self.bound = bound  # ScreenBound or ClusterBound
        self.vocab_size = weight.shape[0]
        self.stats = HeadStats(vocab_size=self.vocab_size)
        # Two float32 evaluations of one logit (ours on gathered rows, the full head's GEMV) differ by at
        # most 2 gamma |W_i| |h|; a decision closer than that goes to the full head, so both agree. The
        # screens' stages store |W_i| (rounded up: still sound), which saves dequantizing the head here.
        norms = bound.row_norms if bound.row_norms is not None else row_norms(weight)  # [V]
        self.tie_coefficients = 4 * dot_rounding_gamma(weight.shape[1]) * norms  # [V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [B, V] (used by verifiers that need whole distributions; a row-wise call: runtime.heads.rowwise)."""
        return rowwise(self._logits, hidden, logits_key(self.weight, self.bias))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, self.bias)  # [B, V]

    def select(
        self, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Next token per row [B] for hidden states [B, d]; same tokens as FullHead for the same generator."""
        params = params.for_vocab(self.vocab_size)  # a top-k no smaller than V keeps every token, as FullHead's does
        state = rowwise(self.bound.prepare, hidden)  # sound for these rows whatever rows share the call
        noise = None if params.greedy else gumbel_noise(hidden.shape[0], self.vocab_size, generator)  # [B, V]
        hidden_norms = hidden.double().norm(dim=1).tolist()  # [B]
        tokens = []
        for index in range(hidden.shape[0]):
            row = _Row(state, index, hidden_norms[index], None if noise is None else noise[index])
            token, opened = self._select_row(row, params)
            self.stats.rows += 1
            self.stats.recomputed_tokens += opened
            if token is None:
                token = self._fallback(row, params)
            else:
                self.stats.certified += 1
            tokens.append(token)
        return torch.tensor(tokens, dtype=torch.long)

    def _select_row(self, row: _Row, params: SamplingParams) -> tuple[int | None, int]:
        """(token, tokens opened) for one row; token is None when certification failed."""
        if params.greedy:
            return self._argmax(row, self.bound.open_topk(row.state, row.index, 1, 0.0, None), 1.0)
        if params.epsilon is not None:
            return self._epsilon(row, params)
        if params.top_k:
            return self._top_k(row, params)
        if params.top_p < 1.0:
            return self._top_p(row, params)
        opened = self.bound.open_topk(row.state, row.index, 1, params.temperature, row.noise)
        return self._argmax(row, opened, params.temperature)

    def _argmax(self, row: _Row, opened: Opened, temperature: float, keep: torch.Tensor | None = None):
        """Gumbel-max (or plain argmax) over opened tokens, optionally restricted to positions `keep`.

        Returns no token when the winner's margin is within float32 rounding (the caller falls back).
        """
        if not opened.certified:
            return None, int(opened.ids.numel())
        ids, logits = opened.ids, opened.logits
        if keep is not None:
            ids, logits = ids[keep], logits[keep]
        noise = row.noise
        scores = logits / temperature if noise is not None else logits
        if noise is not None:
            scores = scores + noise[ids]
        if not self._decisive(scores, ids, row.hidden_norm, temperature if noise is not None else 1.0):
            self.stats.near_ties += 1
            return None, int(opened.ids.numel())
        return int(ids[torch.argmax(scores)]), int(opened.ids.numel())

    def _decisive(self, scores: torch.Tensor, ids: torch.Tensor, hidden_norm: float, temperature: float) -> bool:
        """Whether the best score beats the runner-up by more than float32 rounding could move them."""
        if scores.numel() < 2:
            return True
        top = torch.topk(scores, 2)
        margin = self.tie_coefficients[ids[top.indices]].sum() * hidden_norm / temperature
        return bool(top.values[0] - top.values[1] > margin)

    def _top_k(self, row: _Row, params: SamplingParams):
        opened = self.bound.open_topk(row.state, row.index, params.top_k, 0.0, None)
        if not opened.certified:
            return None, int(opened.ids.numel())
        positions = torch.topk(opened.logits, params.top_k).indices  # exact top-k, certified
        if params.top_p < 1.0:
            scaled = opened.logits[positions] / params.temperature  # already sorted descending
            n = nucleus_size(scaled, params.top_p, float(torch.logsumexp(scaled.double(), 0)))
            positions = positions[:n]
        return self._argmax(row, opened, params.temperature, keep=positions)

    def _top_p(self, row: _Row, params: SamplingParams):
        opened_total = 0
        for size in TOP_SET_SIZES:
            size = min(size, self.vocab_size)
            opened = self.bound.open_topk(row.state, row.index, size, 0.0, None)
            opened_total = int(opened.ids.numel())
            if not opened.certified:
                return None, opened_total
            values, positions = torch.topk(opened.logits / params.temperature, size)
            log_z_low = float(torch.logsumexp((opened.logits / params.temperature).double(), 0))
            tail = self.bound.tail_logsumexp(row.state, row.index, opened.ids, params.temperature)
            log_z_high = float(torch.logaddexp(torch.tensor(log_z_low), torch.tensor(tail)))
            # A larger partition function only lowers probabilities, so it needs at least as many tokens.
            n_low = nucleus_size(values, params.top_p, log_z_low)
            n_high = nucleus_size(values, params.top_p, log_z_high)
            reached = float(torch.exp(torch.logsumexp(values[:n_high].double(), 0) - log_z_high)) >= params.top_p
            if n_low == n_high and reached:
                return self._argmax(row, opened, params.temperature, keep=positions[:n_low])
        return None, opened_total

    def _epsilon(self, row: _Row, params: SamplingParams):
        opened_total = 0
        for size in TOP_SET_SIZES:
            opened = self.bound.open_topk(row.state, row.index, min(size, self.vocab_size), 0.0, None)
            opened_total = int(opened.ids.numel())
            if not opened.certified:
                return None, opened_total
            log_z_opened = float(torch.logsumexp((opened.logits / params.temperature).double(), 0))
            tail = self.bound.tail_logsumexp(row.state, row.index, opened.ids, params.temperature)
            # Restricting to the opened set moves tail / (Z_opened + tail) of mass: that is the TV distance.
            if tail == float("-inf") or tail - float(torch.logaddexp(torch.tensor(log_z_opened), torch.tensor(tail))) <= math.log(params.epsilon):
                return self._argmax(row, opened, params.temperature)
        return None, opened_total

    def _fallback(self, row: _Row, params: SamplingParams) -> int:
        """Full head for one row; records what certification would have needed (bounds that track it)."""
        logits = self.logits(row.state.hidden[row.index : row.index + 1])[0]  # [V]
        self.stats.fallbacks += 1
        self.stats.recomputed_tokens += self.vocab_size
        required = self.bound.required_open(row.state, row.index, logits, params.top_k or 1)
        if required is not None:
            self.stats.required_open_tokens += required
        return sample_full(logits, params, row.noise)
