"""Screening bound (ours): an int8 copy of the head gives approximate logits with a sound error radius.

For row i with float32 weights W_i, int8 copy Q(W_i) and hidden state h:

    |fl(<W_i, h>) - fl(<Q(W_i), h>)| <= (e_i + gamma * (|Q(W_i)| + |W_i|)) * |h| = c_i * |h|

where e_i = |W_i - Q(W_i)| (computed in float64, rounded up at prep time) and
gamma = n u / (1 - n u) is the standard bound on float32 dot-product rounding with
n = d + 2 operations per term.

With per-row scales on AVX-512 the screen runs in integers: h is split exactly as 2^e a + r with a
int16, <Q(W_i), h> = <Q(W_i), 2^e a> + <Q(W_i), r>, the first an exact integer dot product and the
second at most |Q(W_i)| |r| (Cauchy-Schwarz), a term added to the radius. Elsewhere h stays float32
and there is no activation term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.common.numerics import FLOAT64_SLACK, dot_rounding_gamma, round_up_to_float32  # noqa: F401 (re-exported for heads)

from runtime.heads.opened import Opened, exact_logits
from runtime.kernels import hugepages, kernel_name, screen_gemv, screen_gemv_int16, screen_radius, screen_select

# Past this share of the vocabulary, recomputing the candidates costs more than the full head's one
# GEMV, so the row goes to the full head (a fallback): a candidate row is gathered and dequantized
# alone, a full-head row streams. Set just under the measured break-even, far above what greedy
# decoding opens (docs/certified-head.md, "A screen's opening budget").
MAX_OPEN_FRACTION = 1 / 8

# Relative slack for the few float32 roundings after the dot products (radius scaling,
# the +/- of center and radius, division by the temperature, adding noise).
_SLACK = 2.0**-18


def screen_coefficients(
    error_norms: torch.Tensor, qrow_norms: torch.Tensor, row_norms: torch.Tensor, d: int
) -> torch.Tensor:
    """Per-row radius coefficient c_i [V] in float32, rounded up from float64."""
    gamma = dot_rounding_gamma(d)
    return round_up_to_float32(error_norms.double() + gamma * (qrow_norms.double() + row_norms.double()))


def open_budget(vocab_size: int, max_open_fraction: float) -> int:
    """The most candidates a screen recomputes for one row (at least one)."""
    return max(1, int(max_open_fraction * vocab_size))


@dataclass
class ScreenState:
    """Approximate logits for one batch of hidden states, and what their radii are made of:
    radius_i = coefficients_i |h| + remainder_coefficients_i remainder_norm (+ slack)."""

    hidden: torch.Tensor  # [B, d]
    center: torch.Tensor  # [B, V] screening logits (bias included)
    hidden_norm: torch.Tensor  # [B] float64 |h|, rounded up
    remainder_norm: torch.Tensor | None  # [B] float64 |r| of the int16 split (screen4: see there), None with float32 activations
    coefficients: torch.Tensor  # [V] float32, the screen's factor of |h|
    remainder_coefficients: torch.Tensor  # [V] float32, its factor of remainder_norm

    def rows(self, start: int, end: int) -> "ScreenState":
        """The state of rows start..end - 1 alone (the per-token factors are shared)."""
        part = slice(start, end)
        remainder = self.remainder_norm[part] if self.remainder_norm is not None else None
        return ScreenState(self.hidden[part], self.center[part], self.hidden_norm[part], remainder, self.coefficients,
                           self.remainder_coefficients)


class ScreenBound:
    """Per-token intervals from the int8 screening head; candidates are recomputed exactly."""

    name = "screen"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        coefficients: torch.Tensor,
        qrow_norms: torch.Tensor,
        row_norms: torch.Tensor | None = None,
        max_open_fraction: float = MAX_OPEN_FRACTION,
    ) -> None:
        self.weight = weight  # [V, d] float32, the exact head
        self.bias = bias  # [V] or None
        self.qweight = hugepages.resident(qweight.contiguous())  # [V, d] int8, streamed every step: huge pages
        self.scales = scales.float().contiguous()  # [V, G]
        self.coefficients = coefficients.float()  # [V]
        self.qrow_norms = qrow_norms.float().contiguous()  # [V] |Q(W_i)|, rounded up
        self.remainder_coefficients = self.qrow_norms  # [V] the factor of the state's remainder_norm in the radius
        self.row_norms = None if row_norms is None else row_norms.float().contiguous()  # [V] |W_i|, rounded up
        self.max_open_tokens = open_budget(qweight.shape[0], max_open_fraction)  # candidates recomputed at most
        kernel_name()  # build / load the kernel now, not inside the first timed decode step

    @classmethod
    def from_stage(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, tensors: dict, max_open_fraction: float = MAX_OPEN_FRACTION
    ) -> "ScreenBound":
        """Build from the tensors of an artifact's `screen` stage."""
        coef = screen_coefficients(tensors["error_norms"], tensors["qrow_norms"], tensors["row_norms"], weight.shape[1])
        return cls(weight, bias, tensors["qweight"], tensors["scales"], coef, tensors["qrow_norms"], tensors["row_norms"],
                   max_open_fraction)

    def prepare(self, hidden: torch.Tensor) -> ScreenState:
        """Screen a batch of hidden states [B, d]."""
        split = screen_gemv_int16(self.qweight, self.scales, hidden)
        if split is not None and bool(torch.isfinite(split[1]).all()):
            center, remainder = split  # [B, V], [B]
        else:  # no integer path here, or a non-finite hidden state: float32 activations
            center, remainder = screen_gemv(self.qweight, self.scales, hidden), None
        if self.bias is not None:
            center = center + self.bias
        hnorm = hidden.double().norm(dim=1) * (1 + FLOAT64_SLACK)  # [B]; float32 rounding is in _SLACK
        return ScreenState(hidden, center, hnorm, remainder, self.coefficients, self.remainder_coefficients)

    def _remainder_term(self, state: ScreenState, row: int) -> tuple[torch.Tensor | None, float]:
        """(coefficients [V], norm) of one row's remainder term (the int16 split: |Q(W_i)| and |r|), or
        (None, 0) with float32 activations."""
        if state.remainder_norm is None:
            return None, 0.0
        return state.remainder_coefficients, float(state.remainder_norm[row])

    def open_topk(
        self, state: ScreenState, row: int, k: int, temperature: float, noise: torch.Tensor | None
    ) -> Opened:
        """Recompute every token whose upper bound reaches the k-th best lower bound of l/T + noise; not
        certified (nothing recomputed: the caller falls back to the full head) past `max_open_tokens`."""
        qrow_norms, remainder = self._remainder_term(state, row)
        ids = screen_select(
            state.center[row], state.coefficients, float(state.hidden_norm[row]), _SLACK, temperature, noise, k,
            qrow_norms, remainder,
        )
        if ids.numel() > self.max_open_tokens:
            return Opened(ids[:0], torch.empty(0), certified=False)
        return Opened(ids, exact_logits(self.weight, self.bias, state.hidden[row], ids), certified=True)

    def radius(self, state: ScreenState, row: int) -> torch.Tensor:
        """Sound bound [V] on |exact logit - screening logit| for one row."""
        qrow_norms, remainder = self._remainder_term(state, row)
        hidden_norm = float(state.hidden_norm[row])
        return screen_radius(state.center[row], state.coefficients, hidden_norm, _SLACK, qrow_norms, remainder)

    def required_open(self, state: ScreenState, row: int, logits: torch.Tensor, k: int) -> None:
        """Not tracked: past its budget the screen gives up before recomputing anything."""
        return None

    def tail_logsumexp(self, state: ScreenState, row: int, opened: torch.Tensor, temperature: float) -> float:
        """Upper bound on log sum over unopened tokens of exp(l_i / T)."""
        upper = (state.center[row] + self.radius(state, row)).double() / temperature
        upper[opened] = float("-inf")
        return float(torch.logsumexp(upper, 0)) + 1e-9
