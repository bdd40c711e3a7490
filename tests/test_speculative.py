"""Speculative decoding loop and drafters on a tiny random Llama: greedy identity with generate_ar,
EOS and token limits at any position, KV-cache rollback, the certified head as verifier head, the
EOS min-response guard, and sampling exactness of the whole loop on a mock Markov target.
"""

from __future__ import annotations

import pytest
import torch

from prep.screen import build_screen
from runtime.decode import generate_ar
from runtime.drafters import LayerDrafter, NgramDrafter, Proposal
from runtime.methods import DrafterSpec, parse_method
from runtime.heads import CertifiedHead, FullHead, ScreenBound
from runtime.speculative import drop_banned, generate_speculative, next_gamma
from runtime.backends.hf import TransformersTarget
from runtime.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, sample_from, warp
from runtime.verify import Verdict

NEW_TOKENS = 24
PROMPTS = {
    "repetitive": [5, 6, 7, 8] * 5,
    "counting": list(range(10, 30)),
    "one-token": [3],
    "random": [201, 17, 88, 4, 150, 9, 63, 240, 31, 77, 120, 5],
}


@pytest.fixture(scope="module")
def tiny_model(tiny_llama) -> torch.nn.Module:
    """The shared tiny Llama (conftest); random models fall into loops n-grams can draft."""
    return tiny_llama


@pytest.fixture(scope="module")
def target(tiny_model) -> TransformersTarget:
    return TransformersTarget(tiny_model, set())  # no EOS: every run produces its full token budget


def full_head(target: TransformersTarget) -> FullHead:
    return FullHead(target.head_weight, target.head_bias)


def certified_head(target: TransformersTarget) -> CertifiedHead:
    tensors, _ = build_screen(target.head_weight, group_size=0, progress=False)
    bound = ScreenBound.from_stage(target.head_weight, target.head_bias, tensors)
    return CertifiedHead(target.head_weight, target.head_bias, bound)


def make_drafter(spec: str, target: TransformersTarget):
    if spec == "ngram":
        return NgramDrafter()
    return LayerDrafter(target, int(spec.split(":")[1]), full_head(target))


def ar_tokens(target: TransformersTarget, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return generate_ar(target, full_head(target), torch.tensor(prompt), n)[0]


# --- greedy identity ------------------------------------------------------------------------

LOOPS = {
    "ngram": ("ngram", 4, False),
    "ngram-gamma1": ("ngram", 1, False),
    "ngram-adaptive": ("ngram", 2, True),
    "layers1": ("layers:1", 4, False),
    "layers1-adaptive": ("layers:1", 3, True),
}


@pytest.mark.parametrize("drafter, gamma, adaptive", LOOPS.values(), ids=LOOPS.keys())
def test_greedy_equals_generate_ar(target, drafter, gamma, adaptive):
    accepted = 0
    for name, prompt in PROMPTS.items():
        tokens, stats = generate_speculative(
            target, full_head(target), make_drafter(drafter, target), torch.tensor(prompt), NEW_TOKENS,
            gamma=gamma, adaptive=adaptive,
        )
        assert tokens == ar_tokens(target, prompt), name
        assert stats.new_tokens == NEW_TOKENS and stats.forwards <= NEW_TOKENS
        assert stats.spec.accepted <= stats.spec.drafted <= stats.spec.drafts * 8
        accepted += stats.spec.accepted
    assert accepted > 0, "no draft was ever accepted: the loop never exercised multi-token appends"


def test_ngram_drafts_cut_target_forwards_on_repetitive_text(target):
    _, stats = generate_speculative(target, full_head(target), NgramDrafter(), torch.tensor(PROMPTS["repetitive"]), 40)
    assert stats.forwards < 25  # 40 tokens, ~2 per forward
    assert stats.spec.mean_accepted_length > 1.8
    assert stats.to_json()["spec"]["mean_accepted_length"] == stats.spec.mean_accepted_length


@pytest.mark.parametrize("drafter", ["ngram", "layers:1"])
def test_certified_target_head_keeps_greedy_identical(target, drafter):
    head = certified_head(target)
    for name, prompt in PROMPTS.items():
        draft = make_drafter(drafter, target)
        tokens, stats = generate_speculative(target, head, draft, torch.tensor(prompt), NEW_TOKENS)
        assert tokens == ar_tokens(target, prompt), name
        assert stats.head.rows >= stats.forwards - 1 and stats.head.certified > 0


def test_eos_at_any_position(tiny_model, target):
    """Every token of a run, taken as the EOS, must end speculative and plain decoding at the same place
    (as an accepted draft, a recovered token or a bonus token)."""
    prompt = torch.tensor(PROMPTS["repetitive"])
    reference = ar_tokens(target, PROMPTS["repetitive"], 30)
    for eos in sorted(set(reference)):
        stopping = TransformersTarget(tiny_model, {eos})
        expected = reference[: reference.index(eos) + 1]
        for drafter in (NgramDrafter(), make_drafter("layers:1", stopping)):
            tokens, _ = generate_speculative(stopping, full_head(stopping), drafter, prompt, 30)
            assert tokens == expected, (eos, type(drafter).__name__)


def test_token_limit_at_any_position(target):
    prompt = PROMPTS["counting"]
    reference = ar_tokens(target, prompt, 12)
    for n in range(0, 13):
        tokens, stats = generate_speculative(target, full_head(target), NgramDrafter(), torch.tensor(prompt), n)
        assert tokens == reference[:n] and stats.new_tokens == n


# --- EOS min-response guard -----------------------------------------------------------------

GUARD = 4


def test_guard_keeps_eos_out_of_the_first_tokens_of_generate_ar(tiny_model):
    prompt = PROMPTS["random"]
    reference = ar_tokens(TransformersTarget(tiny_model, set()), prompt, 12)
    stopping = TransformersTarget(tiny_model, {reference[0]})  # the first greedy token ends the answer at once
    assert generate_ar(stopping, full_head(stopping), torch.tensor(prompt), 12)[0] == reference[:1]
    guarded, stats = generate_ar(stopping, full_head(stopping), torch.tensor(prompt), 12, min_new_tokens=GUARD)
    assert len(guarded) > GUARD and reference[0] not in guarded[:GUARD]
    # The first guarded token is the runner-up of the unguarded logits.
    hidden = stopping.forward(torch.tensor(prompt), stopping.new_cache())[-1:]
    assert guarded[0] == int(full_head(stopping).logits(hidden)[0].topk(2).indices[1])


@pytest.mark.parametrize("drafter", ["ngram", "layers:1"])
@pytest.mark.parametrize("head_kind", ["full", "csv"])
def test_guarded_speculative_equals_guarded_generate_ar(tiny_model, drafter, head_kind):
    """Greedy identity with the guard on, whichever early token plays EOS (so the guard must fire
    in the prefill token, in accepted drafts, in recovered and in bonus tokens)."""
    fired = 0
    for name in ("repetitive", "random"):
        prompt = PROMPTS[name]
        reference = ar_tokens(TransformersTarget(tiny_model, set()), prompt, 30)
        for eos in sorted(set(reference[:8])):
            stopping = TransformersTarget(tiny_model, {eos})
            head = full_head(stopping) if head_kind == "full" else certified_head(stopping)
            expected = generate_ar(stopping, full_head(stopping), torch.tensor(prompt), 30, min_new_tokens=GUARD)[0]
            tokens, stats = generate_speculative(stopping, head, make_drafter(drafter, stopping), torch.tensor(prompt),
                                                 30, gamma=3, min_new_tokens=GUARD)
            assert tokens == expected, (name, eos)
            assert eos not in tokens[:GUARD]
            fired += eos in reference[:GUARD]
    assert fired > 0


def test_drop_banned_cuts_point_mass_drafts_only():
    ban = TokenBan(frozenset({9}), until=12)
    draft = Proposal(torch.tensor([4, 9, 5, 9]))
    assert drop_banned(draft, ban, 10).tokens.tolist() == [4]  # positions 10, 11 guarded; 9 at 11 is cut
    assert drop_banned(draft, ban, 11) is draft  # only position 11 is guarded, and it drafts 4
    assert drop_banned(Proposal(torch.tensor([9, 4])), ban, 11).tokens.tolist() == []
    assert drop_banned(draft, ban, 12) is draft  # past the guard
    sampled = Proposal(torch.tensor([9]), torch.full((1, 16), 1 / 16))
    assert drop_banned(sampled, ban, 10) is sampled  # q-drafters ban inside q


@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-q", "point-mass"])
def test_guarded_sampled_loop_follows_the_guarded_target(point_mass):
    """With EOS banned for 2 tokens, tokens 1..3 follow rows of P_b, P_b^2, P_b^2 P (P_b = the chain
    with EOS masked out), and EOS never comes first or second."""
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(V, V, generator=gen) * 2
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    start = 0
    eos = int(target_logits[start].argmax())  # the most likely first token is the EOS
    target, drafter = MarkovTarget(target_logits), MarkovDrafter(draft_logits, point_mass)
    target.eos_token_ids = frozenset({eos})
    head, n = FullHead(target.head_weight), 2000
    runs = [generate_speculative(target, head, drafter, torch.tensor([start]), 3, params, gen, gamma=2,
                                 min_new_tokens=2)[0] for _ in range(n)]
    assert all(len(run) == 3 and eos not in run[:2] for run in runs)
    samples = torch.tensor(runs)  # [n, 3]
    P, P_b = warp(target_logits, params), warp(mask_banned(target_logits, {eos}, V), params)
    law = P_b[start]
    for position, step in enumerate([P_b, P, None]):
        empirical = torch.bincount(samples[:, position], minlength=V).double() / n
        distance = 0.5 * float((empirical - law.double()).abs().sum())
        assert distance < float((law.double() * (1 - law.double()) / n).sqrt().sum()), position
        if step is not None:
            law = law @ step


# --- rollback -------------------------------------------------------------------------------


class RecordingTarget:
    """Delegates to a target and keeps the caches it hands out, so a test can inspect them afterwards."""

    def __init__(self, target: TransformersTarget) -> None:
        self.target = target
        self.caches = []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def new_cache(self):
        cache = self.target.new_cache()
        self.caches.append(cache)
        return cache


@pytest.mark.parametrize("drafter", ["ngram", "layers:1"])
# The tiny model's logits spread ~0.2, so only a low temperature lets sampled n-gram drafts pass.
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.05, top_k=20)], ids=["greedy", "sampled"]
)
def test_rollback_keeps_caches_consistent(target, drafter, params):
    """After partial acceptances both caches hold exactly the kept tokens: the incremental hidden
    state of the next token equals a fresh forward over everything."""
    prompt = PROMPTS["random"]
    recording, draft = RecordingTarget(target), make_drafter(drafter, target)
    gen = torch.Generator().manual_seed(0)
    tokens, stats = generate_speculative(recording, full_head(target), draft, torch.tensor(prompt), 40, params, gen)
    assert 0 < stats.spec.accepted < stats.spec.drafted, "the run must include partial acceptances"
    context = prompt + tokens
    cache = recording.caches[0]
    assert len(cache) == cache.inner.get_seq_length() == len(context) - 1
    incremental = target.forward(torch.tensor(context[-1:]), cache)[-1]
    fresh = target.forward(torch.tensor(context), target.new_cache())[-1]
    assert torch.allclose(incremental, fresh, atol=1e-4)
    if isinstance(draft, LayerDrafter):
        assert draft.cached == context[: len(draft.cached)]
        assert len(draft.cache) == draft.cache.inner.get_seq_length() == len(draft.cached)
        draft.propose(context, 1)  # brings its cache to exactly the context
        incremental = draft.feed([7])[-1]
        fresh = draft.backend.forward(torch.tensor(context + [7]), draft.backend.new_cache())[-1]
        assert torch.allclose(incremental, fresh, atol=1e-4)


def test_sampled_generation_is_reproducible(target):
    params = SamplingParams(temperature=0.8, top_p=0.9)
    runs = [
        generate_speculative(target, full_head(target), make_drafter("layers:1", target),
                             torch.tensor(PROMPTS["random"]), 16, params, torch.Generator().manual_seed(4))[0]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and len(runs[0]) == 16


# --- drafters -------------------------------------------------------------------------------


def test_layer_drafter_shares_weights_and_leaves_the_target_intact(target):
    body = target.truncated(1).body
    assert len(body.layers) == 1 and body.config.num_hidden_layers == 1
    assert len(target.body.layers) == 2 and target.body.config.num_hidden_layers == 2
    assert body.layers[0].mlp.up_proj.weight.data_ptr() == target.body.layers[0].mlp.up_proj.weight.data_ptr()
    assert body.norm is target.body.norm and body.embed_tokens is target.body.embed_tokens
    with pytest.raises(ValueError, match="layers:N"):
        target.truncated(2)


def test_ngram_drafter_prefers_the_longest_most_recent_match():
    drafter = NgramDrafter(max_ngram=3, max_draft=3)
    # "1 2 3" occurred twice; the latest occurrence continues with 7 8 9.
    assert drafter.propose([1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 0, 2, 3], 8).tokens.tolist() == [7, 8, 9]
    # Only the 1-gram "3" matches (its latest occurrence is followed by 6).
    assert drafter.propose([3, 5, 3, 6, 3], 4).tokens.tolist() == [6, 3]
    assert drafter.propose([1, 2, 3], 4).tokens.numel() == 0
    assert drafter.propose([1, 2, 1, 2], 0).tokens.numel() == 0
    assert NgramDrafter(max_ngram=2, min_ngram=2).propose([3, 5, 3, 6, 3], 4).tokens.numel() == 0


@pytest.mark.parametrize(
    "name, drafter, gamma, adaptive, head",
    [
        ("spec:ngram", ("ngram", ()), 4, False, "full"),
        ("spec:ngram+csv", ("ngram", ()), 4, False, "csv:screen"),
        ("spec:layers:2+csv", ("layers", ("2",)), 4, False, "csv:screen"),
        ("spec:layers:2:gamma=6:adaptive+csv", ("layers", ("2",)), 6, True, "csv:screen"),
        ("spec:ngram:3+csv:cluster", ("ngram", ("3",)), 4, False, "csv:cluster"),
    ],
)
def test_bench_spec_arguments(name, drafter, gamma, adaptive, head):
    spec = parse_method(name)
    assert (spec.drafter, spec.gamma, spec.adaptive, spec.head) == (DrafterSpec(*drafter), gamma, adaptive, head)


def test_adaptive_gamma_steps_and_bounds():
    assert next_gamma(4, Verdict(4, 4, [0] * 5)) == 5
    assert next_gamma(4, Verdict(4, 1, [0] * 2)) == 3
    assert next_gamma(8, Verdict(8, 8, [0] * 9)) == 8
    assert next_gamma(1, Verdict(1, 0, [0])) == 1
    assert next_gamma(3, Verdict(0, 0, [0])) == 3  # nothing drafted: nothing learned


# --- sampling exactness of the loop, on a mock Markov target --------------------------------

V = 12


class MarkovTarget:
    """A TargetModel whose hidden state is the one-hot token, so a head with weight L^T gives the
    logits row L[token]: the next-token law depends on the previous token only and is known exactly."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.head_weight = logits.T.contiguous()  # [V, V]
        self.head_bias = None
        self.vocab_size = self.hidden_size = logits.shape[0]
        self.eos_token_ids = frozenset()

    def new_cache(self) -> list[int]:
        return []

    def forward(self, tokens: torch.Tensor, cache: list[int]) -> torch.Tensor:
        cache.extend(tokens.tolist())
        return torch.nn.functional.one_hot(tokens, self.vocab_size).float()  # [T, V]

    def crop(self, cache: list[int], length: int) -> None:
        del cache[length:]


class MarkovDrafter:
    """Drafts from another Markov chain, sampled (with q) or as its argmax chain (point masses)."""

    def __init__(self, logits: torch.Tensor, point_mass: bool) -> None:
        self.logits, self.point_mass = logits, point_mass

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        self.q, self.generator, self.ban = warp(self.logits, params), generator, ban
        # The guard bans ids from q, as a model drafter does (point masses are cut by the loop).
        self.q_banned = warp(mask_banned(self.logits, ban.ids, V), params)

    def propose(self, context: list[int], k: int) -> Proposal:
        tokens, rows = [context[-1]], []
        for i in range(k):
            q = self.q_banned if self.ban.rows(len(context) + i, 1) else self.q
            row = self.logits[tokens[-1]] if self.point_mass else q[tokens[-1]]
            tokens.append(int(row.argmax()) if self.point_mass else sample_from(row, self.generator))
            rows.append(q[tokens[-2]])
        probs = None if self.point_mass or not rows else torch.stack(rows)
        return Proposal(torch.tensor(tokens[1:], dtype=torch.long), probs)

    def observe(self, verdict) -> None:
        pass


@pytest.mark.parametrize(
    "params, point_mass, gamma",
    [(SamplingParams(temperature=0.8, top_k=6, top_p=0.9), False, 3), (SamplingParams(temperature=1.0), True, 2)],
    ids=["top-k+top-p", "point-mass"],
)
def test_sampled_loop_follows_the_target(params, point_mass, gamma):
    """Tokens 1..3 of generate_speculative follow rows of P, P^2, P^3 (P = warped target chain)
    within sampling error."""
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(V, V, generator=gen) * 2
    draft_logits = target_logits + torch.randn(V, V, generator=gen)
    target, drafter = MarkovTarget(target_logits), MarkovDrafter(draft_logits, point_mass)
    head, n, start = FullHead(target.head_weight), 2000, 0
    samples = torch.tensor([
        generate_speculative(target, head, drafter, torch.tensor([start]), 3, params, gen, gamma=gamma)[0]
        for _ in range(n)
    ])  # [n, 3]
    P = warp(target_logits, params)
    law = P[start]
    for position in range(3):
        empirical = torch.bincount(samples[:, position], minlength=V).double() / n
        distance = 0.5 * float((empirical - law.double()).abs().sum())
        assert distance < float((law.double() * (1 - law.double()) / n).sqrt().sum()), position
        law = law @ P
