"""Sampling, shared by every head, verifier, drafter and loop: parameters, warping, Gumbel noise, bans.

Every head samples the same way: draw one Gumbel noise value per vocabulary entry from the
caller's generator and take the argmax of logits / T + noise over the allowed tokens. That
is an exact sample from softmax(logits / T) restricted to the allowed set, and it means two
heads given the same generator state pick the same token whenever they agree on the logits.
`warp` gives the same distribution explicitly (probabilities), for verifiers and drafters that
need q or p as a whole.

EOS-aware min-response guard (the GP paper): instruct models' greedy choice right after the user
turn is often EOS, and a greedy drafter then ends the answer at once. A `TokenBan` sets the banned
ids' logits to -inf for the first response positions, on the target's side (`select_allowed`,
`mask_banned`) and the drafter's alike, so p and q are the guarded distributions and the loops stay
exact with respect to them: greedy speculative output equals greedy generate_ar with the same guard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from runtime.common.checks import is_number, require, require_count


# The largest seed the runtime takes (the CLI's --seed and the API's seed=); torch.Generator.manual_seed
# would also take up to 2**64 - 1, and negative seeds, which it wraps around.
MAX_SEED = 2**63 - 1
# The smallest temperature above 0 (greedy): below it sampling is greedy in all but name, and near 1e-38
# logits / temperature overflow float32 (1e-38 ended a text after one token).
MIN_TEMPERATURE = 1e-6
# With chat, no EOS among the response's first this many tokens unless asked otherwise (--min-response-tokens,
# min_response_tokens=): an instruct model's first token is otherwise sometimes its end.
MIN_RESPONSE_TOKENS = 4


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token: greedy when temperature is 0."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k restriction (nor is a k of at least the vocabulary: for_vocab)
    top_p: float = 1.0  # 1.0 = no nucleus restriction
    epsilon: float | None = None  # certified heads only: allow total variation <= epsilon

    def __post_init__(self) -> None:
        require(is_number(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE), "temperature",
                f"0 (greedy) or a finite number >= {MIN_TEMPERATURE:g} (below it sampling is greedy in all but name)",
                self.temperature)
        require_count("top_k", self.top_k, 0, why=" (0 = off)")
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a finite number in (0, 1] (1 = off)", self.top_p)
        require(self.epsilon is None or (is_number(self.epsilon) and 0 < self.epsilon < 1), "epsilon",
                "None or a finite number in (0, 1) (the total variation a csv head may allow)", self.epsilon)
        shaping = (("top_k", self.top_k), ("top_p", self.top_p < 1), ("epsilon", self.epsilon is not None))
        unused = [name for name, on in shaping if on]
        if self.temperature == 0 and unused:  # greedy would silently ignore them
            flags, one = ", ".join(f"--{n.replace('_', '-')}" for n in unused), len(unused) == 1
            raise ValueError(f"{' and '.join(unused)} ({flags}) appl{'ies' if one else 'y'} to sampling, but temperature 0 "
                             f"is greedy: give a temperature above 0 (--temperature) or drop {'it' if one else 'them'}")
        if self.epsilon is not None and (self.top_k or self.top_p < 1):
            raise ValueError("epsilon applies to plain temperature sampling: drop top_k and top_p (--top-k, --top-p) "
                             "or epsilon")
        # Plain Python numbers from here on: a numpy scalar would reach the bench's JSON record as itself.
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("epsilon", float)):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, kind(getattr(self, name)))

    def for_vocab(self, vocab_size: int) -> "SamplingParams":
        """These parameters over a vocabulary of `vocab_size` tokens: a top_k of at least it cuts nothing (0)."""
        return replace(self, top_k=0) if self.top_k >= vocab_size else self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Sorted prefixes tried, shortest first, for a nucleus (and by the certified head for its top sets).
TOP_SET_SIZES = (64, 1024, 16384)


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
    params = params.for_vocab(V)
    if not (params.top_k or params.top_p < 1.0):
        return torch.ones(V, dtype=torch.bool)
    if params.top_k:
        values, ids = torch.topk(scaled_logits, params.top_k)  # [k] descending
        if params.top_p < 1.0:
            ids = ids[: nucleus_size(values, params.top_p, float(torch.logsumexp(values.double(), 0)))]
    else:
        ids = _nucleus(scaled_logits, params.top_p)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[ids] = True
    return keep


def _nucleus(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Ids of the top-p nucleus of softmax(scaled_logits [V]), from the shortest sorted prefix that holds it.

    A prefix's cumulative sums are the full sort's first ones, so this is the full sort's nucleus; a
    full sort of a large vocabulary costs about a forward (docs/certified-head.md, "Top-p without a full sort").
    """
    V = scaled_logits.numel()
    log_z = float(torch.logsumexp(scaled_logits.double(), 0))
    for size in (size for size in TOP_SET_SIZES if size < V):
        values, ids = torch.topk(scaled_logits, size)  # [size] descending
        n = nucleus_size(values, top_p, log_z)
        if n < size:  # the cumulative mass reached top_p inside this prefix
            return ids[:n]
    values, ids = torch.sort(scaled_logits, descending=True)  # [V]
    return ids[: nucleus_size(values, top_p, log_z)]


def first_argmax(values: torch.Tensor) -> int:
    """torch.argmax of a 1-D tensor (the first largest value; a NaN counts as largest), by torch.max over
    dim 0, which returns the same index in a third of argmax's time on one core (a 262k vocabulary: 0.10
    against 0.32 ms, on every greedy step of the full head; Intel Xeon with AMX, torch 2.13)."""
    return int(torch.max(values, 0).indices)


def sample_full(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> int:
    """Pick a token from full logits [V] with Gumbel noise [V] (argmax when greedy)."""
    if params.greedy:
        return first_argmax(logits)
    scaled = logits / params.temperature
    perturbed = scaled + noise
    if params.top_k or params.top_p < 1.0:
        perturbed = perturbed.masked_fill(~allowed_mask(scaled, params), float("-inf"))
    return first_argmax(perturbed)


def sample_rows(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row [B] of full logits [B, V]: Gumbel-max with noise drawn from `generator`."""
    noise = None if params.greedy else gumbel_noise(logits.shape[0], logits.shape[1], generator)  # [B, V]
    tokens = [sample_full(logits[b], params, None if noise is None else noise[b]) for b in range(len(logits))]
    return torch.tensor(tokens, dtype=torch.long)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] that the heads' sampler draws from, for logits [n, V].

    Temperature, then top-k, then top-p, with the same tie and boundary rules as `sample_full`;
    greedy parameters give a point mass on the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(logits.dtype)
    scaled = logits / params.temperature
    if params.top_k or params.top_p < 1.0:
        keep = torch.stack([allowed_mask(row, params) for row in scaled])  # [n, V]
        scaled = scaled.masked_fill(~keep, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def joint_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities [n, V] MJSD's joint ratio uses, for both models: warped when sampling, the plain
    softmax (temperature 1) when greedy, where a point mass would make the ratio plain greedy verification."""
    return torch.softmax(logits.double(), dim=-1) if params.greedy else warp(logits, params).double()


def sample_from(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn in proportion to nonnegative weights [V], by inverting the float64 CDF.

    One cumulative sum and one binary search: torch.multinomial was an order of magnitude slower on a
    262k vocabulary (docs/certified-head.md, "Top-p without a full sort").
    """
    cdf = weights.double().cumsum(0)  # [V]
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    # right=True picks the first index whose CDF exceeds u, so zero-weight tokens (flat steps) never
    # win; the clamp covers u * total rounding up to total itself.
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.numel() - 1))


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
