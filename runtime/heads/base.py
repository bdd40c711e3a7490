"""The LMHead and Bound protocols, and the one place heads read rows of the head weight.

A head weight W [V, d] is an fp32 tensor today and may be a block-quantized QuantMatrix (the
native backend's GGUF rows) tomorrow, so heads never index it directly: all logits go through
`runtime.kernels.linear(x, W)` and a few rows through `runtime.kernels.take_rows(W, ids)`.

Heads keep no per-call state: everything one `select` call needs lives in its local variables,
so one head may serve several loops (a target and its drafter share a bound, never a call).
Their only mutable field is `stats`, counters that only grow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from runtime.kernels import take_rows  # fp32 rows [n, d] for ids [n]; a QuantMatrix dequantizes just those
from runtime.common.sampling import SamplingParams
from runtime.common.stats import HeadStats

if TYPE_CHECKING:
    from runtime.heads.opened import Opened

_NORM_CHUNK = 16384  # rows per chunk when row norms are computed from a (possibly quantized) head


def row_norms(weight) -> torch.Tensor:
    """|W_i| [V] in float32, accumulated in float64 one chunk of rows at a time (no float64 copy of the head)."""
    rows = weight.shape[0]
    return torch.cat([
        torch.linalg.vector_norm(take_rows(weight, torch.arange(start, min(start + _NORM_CHUNK, rows))), dim=1,
                                 dtype=torch.float64).float()
        for start in range(0, rows, _NORM_CHUNK)
    ])


class LMHead(Protocol):
    """A head in full-vocabulary index space: full logits on demand, and the next token per row."""

    vocab_size: int
    stats: HeadStats

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] for hidden states [B, d] (-inf where a shortlist head scores nothing)."""
        ...

    def select(self, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
        """Next token per row [B] for hidden states [B, d], Gumbel-max with noise from `generator`."""
        ...


class Bound(Protocol):
    """A sound bound family for CertifiedHead: screen (int8 copy + error radius) or cluster (CSV-Decode)."""

    name: str
    row_norms: torch.Tensor | None  # [V] |W_i| rounded up to float32, where the bound's stage stores them

    def prepare(self, hidden: torch.Tensor):
        """Per-batch state for hidden states [B, d] (it keeps `hidden`)."""
        ...

    def open_topk(self, state, row: int, k: int, temperature: float, noise: torch.Tensor | None) -> Opened:
        """Exact logits of every token that may be among the top k of l/T + noise, and whether that is certified."""
        ...

    def tail_logsumexp(self, state, row: int, opened: torch.Tensor, temperature: float) -> float:
        """Upper bound on log sum over the unopened tokens of exp(l_i / T)."""
        ...

    def required_open(self, state, row: int, logits: torch.Tensor, k: int) -> int | None:
        """Tokens certification of top-k would have had to open given the exact logits [V] (None: not tracked)."""
        ...
