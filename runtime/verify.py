"""Verifiers for speculative decoding: pure functions from target and draft distributions to a verdict.

Glossary (vLLM's, used across runtime/speculative.py and runtime/drafters/):
- p: the target model's distribution, one row per verified position; q: the drafter's.
- draft: the k tokens the drafter proposed after the last accepted token.
- accepted: the leading drafts the verifier keeps.
- recovered: the token the verifier draws in place of the first rejected draft.
- bonus: the token drawn from p after the last draft when every draft is accepted.
Each round therefore appends accepted + 1 tokens. p has k + 1 rows: row i is the target's
distribution after the context plus drafts[:i], so row k scores the bonus position.

Exactness (Leviathan et al. 2023, Chen et al. 2023): accepting x with probability
min(1, p(x) / q(x)) and otherwise sampling from norm(max(0, p - q)) yields exactly p. Warping
(temperature, top-k, top-p) is part of p and q, so `warp` must be applied to both the same way.

EOS-aware min-response guard (seed 002): instruct models' greedy choice right after the user turn
is often EOS, and a greedy drafter then ends the answer at once. A `TokenBan` sets the banned ids'
logits to -inf for the first response positions, on the target's side (`select_allowed`,
`mask_banned`) and the drafter's alike, so p and q are the guarded distributions and the loops stay
exact with respect to them: greedy speculative output equals greedy generate_ar with the same guard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.heads.sampling import SamplingParams, allowed_mask, gumbel_noise, sample_full


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: how many drafts passed and what to append."""

    drafted: int
    accepted: int
    tokens: list[int]  # accepted drafts, then one recovered or bonus token

    @property
    def bonus(self) -> bool:
        """Every draft passed, so the last token came from the target's extra position."""
        return self.accepted == self.drafted


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


def sample_from(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to nonnegative weights [V], by inverting the float64 CDF.

    torch.multinomial is ~25x slower on a 262k vocabulary (12 ms against 0.5 ms on this CPU).
    """
    cdf = weights.double().cumsum(0)  # [V]
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    # right=True picks the first index whose CDF exceeds u, so zero-weight tokens (flat steps) never
    # win; the clamp covers u * total rounding up to total itself.
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] that the heads' sampler draws from, for logits [n, V].

    Temperature, then top-k, then top-p, with the same tie and boundary rules as
    runtime.heads.sampling; greedy parameters give a point mass on the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    scaled = logits / params.temperature
    if params.top_k or params.top_p < 1.0:
        keep = torch.stack([allowed_mask(row, params) for row in scaled])  # [n, V]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.softmax(scaled, dim=-1)


# --- EOS guard ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenBan:
    """Token ids excluded from every context position before `until` (an absolute context length)."""

    ids: frozenset[int] = frozenset()
    until: int = 0

    @classmethod
    def min_response(cls, eos_ids, prompt_length: int, min_new_tokens: int) -> "TokenBan":
        """No EOS among the first `min_new_tokens` tokens after a prompt of `prompt_length` tokens."""
        return cls(frozenset(eos_ids), prompt_length + max(min_new_tokens, 0))

    def rows(self, start: int, n: int) -> int:
        """How many of the n positions start, start + 1, ... are guarded (always a leading run)."""
        return max(0, min(self.until - start, n)) if self.ids else 0


NO_BAN = TokenBan()


def mask_banned(logits: torch.Tensor, banned, rows: int) -> torch.Tensor:
    """logits [n, V] with the `banned` ids at -inf on the first `rows` rows (a copy when it changes)."""
    if not banned or rows <= 0:
        return logits
    masked = logits.clone()
    masked[:rows, sorted(banned)] = float("-inf")
    return masked


def select_allowed(
    head, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, banned, rows: int | None = None
) -> torch.Tensor:
    """head.select [B] for hidden [B, d] as if the `banned` ids' logits were -inf on the first `rows` rows.

    rows None: every row. The head decides first; when its token is not banned it is also the
    choice without the banned ids (greedy: the argmax; temperature: the Gumbel-max winner under the
    same noise). Otherwise, and always under top-k / top-p / epsilon, whose allowed set moves when
    a token is banned, the guarded rows are decided again on masked full logits with the same
    noise, redrawn from the generator state the head started from. The generator ends where the
    head left it.
    """
    rows = hidden.shape[0] if rows is None else min(rows, hidden.shape[0])
    if not banned or rows <= 0:
        return head.select(hidden, params, generator)
    source = generator if generator is not None else torch.default_generator
    state = None if params.greedy else source.get_state()
    tokens = head.select(hidden, params, generator)  # [B]
    argmax_rule = params.greedy or not (params.top_k or params.top_p < 1.0 or params.epsilon is not None)
    redo = [r for r in range(rows) if not argmax_rule or int(tokens[r]) in banned]
    if not redo:
        return tokens
    noise = None
    if state is not None:
        after = source.get_state()
        source.set_state(state)
        noise = gumbel_noise(hidden.shape[0], head.vocab_size, generator)  # [B, V], as the head drew it
        source.set_state(after)
    logits = mask_banned(head.logits(hidden[redo]), banned, len(redo))  # [len(redo), V]
    for i, r in enumerate(redo):
        tokens[r] = sample_full(logits[i], params, None if noise is None else noise[r])
    head.stats.recomputed_tokens += len(redo) * head.vocab_size
    return tokens
