"""Speculative decoding loop and drafters on a tiny random Llama: greedy identity with generate_ar,
EOS and token limits at any position, KV-cache rollback, the certified head as verifier head, and the
EOS min-response guard.
"""

from __future__ import annotations

import pytest
import torch

from prep.screen import build_screen
from runtime.loops.decode import generate_ar
from runtime.drafters import LayerDrafter, LookupDrafter, NgramDrafter
from runtime.methods import parse_method
from runtime.heads import CertifiedHead, FullHead, ScreenBound
from runtime.drafters.base import Proposal
from runtime.loops.speculative import (BUDGET_PROBE_EVERY, DEFAULT_GAMMA, MAX_GAMMA, DraftBudget, first_gamma,
                                  generate_speculative, next_gamma)
from runtime.backends.hf import TransformersTarget
from runtime.backends.lean import lean_target
from runtime.common.sampling import SamplingParams
from runtime.drafters.base import Verdict

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
    if spec == "lookup":
        return LookupDrafter()
    return LayerDrafter(target, int(spec.split(":")[1]), full_head(target))


def ar_tokens(target: TransformersTarget, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return generate_ar(target, full_head(target), torch.tensor(prompt), n)[0]


# --- greedy identity ------------------------------------------------------------------------

LOOPS = {
    "ngram": ("ngram", 4, False),
    "ngram-gamma1": ("ngram", 1, False),
    "ngram-adaptive": ("ngram", 2, True),
    "lookup-adaptive": ("lookup", 4, True),
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


def test_lookup_drafts_at_most_the_match_length_and_prefers_the_context():
    drafter = LookupDrafter(max_ngram=4)
    # "1 2 3" (3 tokens) occurred before: at most 3 tokens follow it.
    assert drafter.propose([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], 8).tokens.tolist() == [4, 5, 6]
    assert drafter.propose([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3], 2).tokens.tolist() == [4, 5]  # and at most k
    assert drafter.propose([5, 9, 5], 8).tokens.tolist() == [9]  # a 1-token match drafts one
    assert drafter.propose([1, 2], 0).tokens.numel() == 0


def test_lookup_remembers_earlier_sequences_of_its_session():
    drafter = LookupDrafter(max_ngram=4)
    params = SamplingParams()
    drafter.reset([10, 11, 12], params, None)
    drafter.propose([10, 11, 12, 13], 4)  # the loop's context: the prompt plus the first token
    drafter.observe(Verdict(drafted=0, accepted=0, tokens=[14, 15, 16]))
    assert drafter.history == []  # remembered at the next reset
    drafter.reset([7, 8], params, None)
    assert drafter.history == [[10, 11, 12, 13, 14, 15, 16]]
    assert drafter.propose([7, 8, 12, 13], 4).tokens.tolist() == [14, 15]  # "12 13": a 2-token match
    assert drafter.propose([7, 8, 9, 13], 4).tokens.numel() == 0  # one token is not enough outside the context
    assert drafter.propose([12, 13, 7, 12, 13], 4).tokens.tolist() == [7, 12]  # the context before the session


def test_lookup_occurrences_vote_on_the_draft():
    drafter = LookupDrafter(max_ngram=2)
    # "1 2" three times in the context: twice followed by 3 4, once (the newest) by 3 5. Every
    # occurrence agrees on 3; then 4 has two of the three votes, not more than 2/3: the draft stops.
    context = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert drafter.propose(context, 4).tokens.tolist() == [3]
    # A fourth "1 2 3 4" gives 4 three votes of four: past 2/3, so it is drafted too.
    assert drafter.propose([1, 2, 3, 4, 9] + context, 4).tokens.tolist() == [3, 4]
    # The majority beats the newest: two occurrences go on with 7, the newest with 8; then 1 is unanimous.
    assert drafter.propose([1, 2, 7, 1, 1, 2, 7, 1, 1, 2, 8, 1, 1, 2], 4).tokens.tolist() == [7, 1]
    # A tie goes to the first listed: one context occurrence (two votes) against two in the session.
    drafter.reset([6, 1, 2, 5, 0], SamplingParams(), None)
    drafter.reset([6, 1, 2, 5, 0], SamplingParams(), None)
    drafter.reset([0], SamplingParams(), None)
    assert drafter.propose([1, 2, 3, 9, 1, 2], 4).tokens.tolist() == [3, 9]  # then only the context votes
    # The session alone: its two occurrences agree.
    assert drafter.propose([8, 1, 2], 4).tokens.tolist() == [5, 0]
    # A longer match drafts alone: "0 1 2" occurs once, so the other "1 2"s do not vote.
    longer = LookupDrafter(max_ngram=3)
    assert longer.propose([0, 1, 2, 9, 1, 2, 3, 1, 2, 3, 0, 1, 2], 4).tokens.tolist() == [9, 1, 2]


def test_lookup_history_keeps_the_newest_tokens_within_its_limit():
    drafter = LookupDrafter(max_ngram=2, max_history_tokens=10)
    for first in range(5):
        drafter.reset([100 + first, 1, 2, 3], SamplingParams(), None)
        drafter.reset([0], SamplingParams(), None)
    assert sum(len(s) for s in drafter.history) <= 10 and drafter.history[-1] == [104, 1, 2, 3]
    assert [100, 1, 2, 3] not in drafter.history
    assert drafter.propose([9, 104, 1], 2).tokens.tolist() == [2, 3]
    assert drafter.propose([9, 100, 1], 2).tokens.numel() == 0  # dropped, and "1" alone is not looked up


def test_lookup_continuations_longest_match_first_newest_first_and_distinct():
    drafter = LookupDrafter(max_ngram=3)
    drafter.reset([1, 2, 3, 40, 41, 42], SamplingParams(), None)
    drafter.reset([0], SamplingParams(), None)  # the session now holds 1 2 3 40 41 42
    context = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 3, 6, 6, 2, 3]
    # "2 3" (the longest match: "6 2 3" is new) in the context, newest first; then the session's "2 3";
    # then "3" alone in the context: "6 6 2" is new, its other two occurrences repeat what was found
    assert drafter.continuations(context, 3, 8) == [[7, 8, 3], [9, 9, 5], [40, 41, 42], [6, 6, 2]]
    assert drafter.continuations(context, 3, 2) == [[7, 8, 3], [9, 9, 5]]
    assert drafter.continuations(context, 1, 8) == [[7], [9], [40], [6]]  # depth 1: "7" and "9" once each
    assert drafter.continuations([5, 6], 4, 4) == []


@pytest.mark.parametrize(
    "name, drafter, gamma, adaptive, head",
    [
        ("spec:ngram", "ngram", None, False, "full"),
        ("spec:ngram+csv", "ngram", None, False, "csv:screen"),
        ("spec:layers:2+csv", "layers:2", None, False, "csv:screen"),
        ("spec:layers:2:gamma=6:adaptive+csv", "layers:2", 6, True, "csv:screen"),
        ("spec:ngram:3+csv:cluster", "ngram:3", None, False, "csv:cluster"),
    ],
)
def test_bench_spec_arguments(name, drafter, gamma, adaptive, head):
    spec = parse_method(name)
    options = spec.options
    assert (str(options.drafter), options.gamma, options.adaptive, spec.head) == (drafter, gamma, adaptive, head)


def test_adaptive_gamma_steps_and_bounds():
    assert next_gamma(4, Verdict(4, 4, [0] * 5)) == 5
    assert next_gamma(4, Verdict(4, 1, [0] * 2)) == 3
    assert next_gamma(8, Verdict(8, 8, [0] * 9)) == 8
    assert next_gamma(1, Verdict(1, 0, [0])) == 1
    assert next_gamma(3, Verdict(0, 0, [0])) == 3  # nothing drafted: nothing learned


def test_a_named_gamma_is_kept_and_the_default_is_default_gamma():
    assert first_gamma(None) == DEFAULT_GAMMA
    assert first_gamma(1) == 1
    assert first_gamma(MAX_GAMMA) == MAX_GAMMA
    with pytest.raises(ValueError, match="1..8"):
        first_gamma(9)


def test_every_kernel_path_drafts_past_one_token_without_a_named_gamma(tiny_model, monkeypatch: pytest.MonkeyPatch):
    """No kernel path caps the default draft length (AVX2's one-draft cap measured slower on the AMD EPYC
    Zen 3 and the Xeon with AMX once AVX2 verified 4-6 rows in one pass): a spec method without gamma=G
    drafts several tokens a round where the drafter finds them, on AVX2 as on AVX-512. Outputs stay
    generate_ar's."""
    import runtime.kernels as kernels

    target = lean_target(tiny_model, set())
    head = full_head(target)
    prompt = torch.tensor(PROMPTS["repetitive"])  # the n-gram drafter always finds a match here
    reference = generate_ar(target, head, prompt, NEW_TOKENS)[0]
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    for path in ("avx2", "avx512"):
        monkeypatch.setattr(kernels, "kernel_name", lambda path=path: path)
        for adaptive in (False, True):
            tokens, stats = generate_speculative(target, head, NgramDrafter(), prompt, NEW_TOKENS, adaptive=adaptive)
            assert tokens == reference
            assert len(stats.spec.drafted_per_position) > 1, (path, adaptive)  # some round drafted two or more


# --- draft budget ---------------------------------------------------------------------------


def test_draft_budget_cuts_positions_that_stop_paying_and_measures_them_again():
    budget = DraftBudget(4)
    assert budget.allowed(4) == 4 and budget.allowed(2) == 2  # a new budget drafts what is asked
    for _ in range(30):  # the first draft always accepted, the others never
        budget.record(Verdict(4, 1, [0, 0]))
    kept = [budget.allowed(4) for _ in range(2 * BUDGET_PROBE_EVERY)]
    assert sorted(set(kept)) == [1, 2] and kept.count(2) == 2  # every BUDGET_PROBE_EVERY-th cut round probes one more
    assert budget.allowed(1) == 1  # the first position still pays
    recovered = None
    for round_ in range(12 * BUDGET_PROBE_EVERY):  # now every draft is accepted
        k = budget.allowed(4)
        budget.record(Verdict(k, k, [0] * (k + 1)))
        if k == 4:
            recovered = round_
            break
    assert recovered is not None and recovered < 8 * BUDGET_PROBE_EVERY, recovered


class WrongDrafter:
    """Drafts k tokens after the context, the first always differing from the target's next token."""

    def __init__(self, prompt: list[int], reference: list[int], vocab: int) -> None:
        self.prompt, self.reference, self.vocab = prompt, reference, vocab

    def reset(self, prompt, params, generator, ban=None) -> None:
        pass

    def propose(self, context: list[int], k: int) -> Proposal:
        right = self.reference[len(context) - len(self.prompt)]
        return Proposal(torch.tensor([(right + 1) % self.vocab] * k, dtype=torch.long))

    def observe(self, verdict: Verdict) -> None:
        pass


def test_a_draft_budget_stops_drafting_what_is_never_accepted(target):
    """Without gamma=G the loop stops paying verify rows for drafts that fail (probing now and then),
    and a budget given to several calls keeps what it learned; the tokens stay generate_ar's."""
    prompt = PROMPTS["random"]
    n = 128
    reference = ar_tokens(target, prompt, n + 1)
    drafter = WrongDrafter(prompt, reference, target.head_weight.shape[0])
    head = full_head(target)
    fixed, fixed_stats = generate_speculative(target, head, drafter, torch.tensor(prompt), n, gamma=4)
    budget = DraftBudget()
    first, first_stats = generate_speculative(target, head, drafter, torch.tensor(prompt), n, budget=budget)
    again, again_stats = generate_speculative(target, head, drafter, torch.tensor(prompt), n, budget=budget)
    assert fixed == first == again == reference[:n]
    assert fixed_stats.spec.drafted == sum(min(4, n - 2 - i) for i in range(n - 1))  # 4 a round, fewer at the end
    assert first_stats.spec.drafted < fixed_stats.spec.drafted / 2
    assert again_stats.spec.drafted <= (n - 1) // BUDGET_PROBE_EVERY + 1  # only the probes, one token each
