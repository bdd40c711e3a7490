"""Sampling parameters and Gumbel-max sampling shared by every head.

Every head samples the same way: draw one Gumbel noise value per vocabulary entry from the
caller's generator and take the argmax of logits / T + noise over the allowed tokens. That
is an exact sample from softmax(logits / T) restricted to the allowed set, and it means two
heads given the same generator state pick the same token whenever they agree on the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token: greedy when temperature is 0."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k restriction
    top_p: float = 1.0  # 1.0 = no nucleus restriction
    epsilon: float | None = None  # certified heads only: allow total variation <= epsilon

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.epsilon is not None and not 0 < self.epsilon < 1:
            raise ValueError("epsilon must be in (0, 1)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def gumbel_noise(rows: int, vocab: int, generator: torch.Generator | None) -> torch.Tensor:
    """Standard Gumbel noise [rows, vocab] drawn from `generator`."""
    u = torch.rand(rows, vocab, generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    return -torch.log(-torch.log(u))


def nucleus_size(sorted_logits: torch.Tensor, top_p: float, log_z: float) -> int:
    """Smallest n whose n largest probabilities sum to at least top_p.

    sorted_logits: [n] descending, already divided by the temperature; log_z: log partition
    function of the distribution the nucleus is taken from.
    """
    cumulative = torch.cumsum(torch.exp(sorted_logits.double() - log_z), dim=0)
    below = int((cumulative < top_p).sum())
    return min(below + 1, sorted_logits.numel())


def allowed_mask(scaled_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tokens that top-k then top-p keep, on full logits [V] already divided by temperature."""
    V = scaled_logits.numel()
    keep = torch.ones(V, dtype=torch.bool)
    values, ids = torch.sort(scaled_logits, descending=True)
    if params.top_k:
        values, ids = values[: params.top_k], ids[: params.top_k]
    if params.top_p < 1.0:
        n = nucleus_size(values, params.top_p, float(torch.logsumexp(values.double(), 0)))
        values, ids = values[:n], ids[:n]
    if params.top_k or params.top_p < 1.0:
        keep = torch.zeros(V, dtype=torch.bool)
        keep[ids] = True
    return keep


def sample_full(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> int:
    """Pick a token from full logits [V] with Gumbel noise [V] (argmax when greedy)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    perturbed = scaled + noise
    if params.top_k or params.top_p < 1.0:
        perturbed = perturbed.masked_fill(~allowed_mask(scaled, params), float("-inf"))
    return int(torch.argmax(perturbed))
