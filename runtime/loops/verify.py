"""Verifiers for speculative decoding: pure functions from target and draft distributions to a verdict.

Glossary (vLLM's, used across runtime/loops/speculative.py and runtime/drafters/):
- p: the target model's distribution, one row per verified position; q: the drafter's.
- draft: the k tokens the drafter proposed after the last accepted token.
- accepted: the leading drafts the verifier keeps.
- recovered: the token the verifier draws in place of the first rejected draft.
- bonus: the token drawn from p after the last draft when every draft is accepted.
Each round therefore appends accepted + 1 tokens. p has k + 1 rows: row i is the target's
distribution after the context plus drafts[:i], so row k scores the bonus position.

Exactness (Leviathan et al. 2023, Chen et al. 2023): accepting x with probability
min(1, p(x) / q(x)) and otherwise sampling from norm(max(0, p - q)) yields exactly p. Warping
(temperature, top-k, top-p) is part of p and q, so `runtime.common.sampling.warp` must be applied to both the same way.

Sampling (warping, Gumbel noise, the EOS guard's bans) lives in runtime/common/sampling.py; this module keeps
the verifiers only.
"""

from __future__ import annotations

import torch

from runtime.common.sampling import sample_from
from runtime.drafters.base import Verdict


def verify_greedy(target_tokens: torch.Tensor, draft: torch.Tensor) -> Verdict:
    """Keep the longest draft prefix equal to the target's choices, then the target's next token.

    target_tokens: [k + 1] the target's greedy token at each verified position; draft: [k].
    """
    k = draft.numel()
    matches = (target_tokens[:k] == draft).long()  # [k]
    accepted = int(matches.cumprod(0).sum())
    return Verdict(k, accepted, draft[:accepted].tolist() + [int(target_tokens[accepted])])


def verify_exact(
    p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, generator: torch.Generator | None
) -> Verdict:
    """Modified rejection sampling: the appended tokens follow p exactly, whatever q is.

    p: [k + 1, V] warped target probabilities; q: [k, V] warped draft probabilities the drafts were
    sampled from, or None for drafters without a distribution (n-gram, tables), which verify as a
    point mass on each drafted token; draft: [k].
    """
    k = draft.numel()
    rows = torch.arange(k)
    p_draft = p[rows, draft].tolist()
    q_draft = [1.0] * k if q is None else q[rows, draft].tolist()
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    # Accept while u < p(x) / q(x), written without the division (q(x) = 0 cannot occur for a
    # sampled draft, and must not crash if it does).
    accepted = 0
    while accepted < k and u[accepted] * q_draft[accepted] < p_draft[accepted]:
        accepted += 1
    if accepted == k:
        last = sample_from(p[k], generator)
    else:
        last = sample_from(_residual(p[accepted], None if q is None else q[accepted], int(draft[accepted])), generator)
    return Verdict(k, accepted, draft[:accepted].tolist() + [last])


def _residual(p: torch.Tensor, q: torch.Tensor | None, drafted: int) -> torch.Tensor:
    """Unnormalized norm(max(0, p - q)) [V] for one rejected position (q None: point mass on `drafted`)."""
    if q is None:
        residual = p.clone()
        residual[drafted] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    # A rejection implies p(x) < q(x), hence positive residual mass; rounding can still cancel it
    # when p and q agree to the last bit, and then p itself is the right distribution.
    return residual if float(residual.sum()) > 0 else p
