"""Exactness on real models: greedy speculative decoding equals plain greedy decoding token for token
on gemma3-270m and qwen2.5-coder-0.5b-instruct for every drafter, with the full and the certified
(screen) target head; stop strings end both at the same token; and the verifier's first-token law on
the real gemma p and a real draft q is p (total variation < 0.01 at 2*10^4 samples).
"""

from __future__ import annotations

import pytest
import torch

from runtime.loops.decode import generate_ar
from runtime.drafters import LayerDrafter, NgramDrafter
from runtime.heads import CertifiedHead
from runtime.text.prompting import encode_prompt
from runtime.loops.speculative import generate_speculative
from runtime.text.stopping import StopStrings
from runtime.common.sampling import SamplingParams, warp
from runtime.loops.verify import verify_exact

pytestmark = pytest.mark.real_model

NEW_TOKENS = 24
GUARD = 4  # the min-response guard on chat prompts, as `runtime generate --chat`
# (text, chat): qwen is an instruct model, so one of its prompts goes through the chat template.
PROMPTS = {
    "gemma": [("def fibonacci(n):", False), ("The three primary colors are", False)],
    "qwen": [("def quicksort(arr):", False), ("Write a haiku about rain.", True)],
}
LAYERS_DEEP = "layers:deep"  # the target's layer count - 2: drafts that get accepted


def plain_runs(session, prompts) -> list[tuple[torch.Tensor, int, list[int]]]:
    """(prompt ids, guard, plain greedy tokens) per prompt."""
    runs = []
    for text, chat in prompts:
        ids = encode_prompt(session.tokenizer, text, chat)
        guard = GUARD if chat else 0
        runs.append((ids, guard, generate_ar(session.target, session.full_head(), ids, NEW_TOKENS,
                                             min_new_tokens=guard)[0]))
    return runs


@pytest.fixture(scope="module")
def gemma_runs(gemma_session):
    return plain_runs(gemma_session, PROMPTS["gemma"])


@pytest.fixture(scope="module")
def qwen_runs(qwen_session):
    return plain_runs(qwen_session, PROMPTS["qwen"])


def make_drafter(spec: str, session, target_head):
    """ngram, or layers:deep with a head instance of its own (sharing a certified head's bound)."""
    if spec == "ngram":
        return NgramDrafter()
    certified = isinstance(target_head, CertifiedHead)
    own = CertifiedHead(target_head.weight, target_head.bias, target_head.bound) if certified else session.full_head()
    return LayerDrafter(session.target, session.target.num_layers - 2, own)


def check_identity(session, runs, drafter: str, certified: bool) -> None:
    """generate_speculative's greedy tokens equal the plain runs' for every prompt."""
    head = session.certified_head("screen") if certified else session.full_head()
    accepted = 0
    for ids, guard, expected in runs:
        tokens, stats = generate_speculative(session.target, head, make_drafter(drafter, session, head), ids,
                                             NEW_TOKENS, gamma=4, min_new_tokens=guard)
        assert tokens == expected, session.tokenizer.decode(ids)
        accepted += stats.spec.accepted
    if drafter == LAYERS_DEEP:
        assert accepted > 0, "the deep layer drafter was never accepted: multi-token appends went untested"


@pytest.mark.parametrize("certified", [False, True], ids=["full", "csv"])
@pytest.mark.parametrize("drafter", ["ngram", LAYERS_DEEP])
def test_gemma_greedy_speculative_equals_plain_decoding(gemma_session, gemma_runs, drafter, certified):
    check_identity(gemma_session, gemma_runs, drafter, certified)


# qwen runs ~2x slower than gemma: each drafter and each target head once.
@pytest.mark.parametrize("drafter, certified", [("ngram", False), (LAYERS_DEEP, True)], ids=["ngram-full", "layers-csv"])
def test_qwen_greedy_speculative_equals_plain_decoding(qwen_session, qwen_runs, drafter, certified):
    check_identity(qwen_session, qwen_runs, drafter, certified)


def test_stop_string_ends_plain_and_speculative_decoding_at_the_same_token(gemma_session):
    session = gemma_session
    ids, target = encode_prompt(session.tokenizer, "def fibonacci(n):"), session.target
    reference = generate_ar(target, session.full_head(), ids, NEW_TOKENS)[0]
    text = session.tokenizer.decode(reference, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # mid-response, wherever the token boundaries fall
    cut = next(t for t in range(len(reference))
               if stop in session.tokenizer.decode(reference[: t + 1], skip_special_tokens=True))
    assert cut < len(reference) - 1
    stops = StopStrings(session.tokenizer, [stop])
    assert generate_ar(target, session.full_head(), ids, NEW_TOKENS, stop=stops)[0] == reference[: cut + 1]
    head = session.full_head()
    tokens, _ = generate_speculative(target, head, make_drafter(LAYERS_DEEP, session, head), ids, NEW_TOKENS, stop=stops)
    assert tokens == reference[: cut + 1]


# --- the verifier on a real p and q -------------------------------------------------------------

DISTRIBUTION_PROMPT = "def add(a, b):\n    return a"  # peaked enough for TV < 0.01 at 2*10^4 samples


# At 0.7 p is nearly two tokens (0.84 / 0.16), so TV is one binomial deviation (sd 0.0052 at 5*10^3):
# the 0.01 bound at 2*10^4 scaled by sqrt(4) keeps ~4 sd of margin at a quarter of the cost.
@pytest.mark.parametrize("temperature, samples, tolerance", [(1.0, 20_000, 0.01), (0.7, 5_000, 0.02)])
def test_first_token_follows_the_target_on_a_real_model(gemma_session, temperature, samples, tolerance):
    """verify_exact with gemma3-270m's p and the layers:16 drafter's q (TV(p, q) ~ 0.2): the first
    appended token's empirical law is within 0.01 of p at 2*10^4 samples (at 0.7: 0.02 at 5*10^3),
    and clearly farther from q."""
    session = gemma_session
    target, params = session.target, SamplingParams(temperature=temperature)
    ids = encode_prompt(session.tokenizer, DISTRIBUTION_PROMPT)
    hidden = target.forward(ids, target.new_cache())[-1:]  # [1, d]
    p = warp(session.full_head().logits(hidden), params)[0]  # [V]
    drafter = make_drafter(LAYERS_DEEP, session, session.full_head())
    q = warp(drafter.head.logits(drafter.feed(ids.tolist())), params)[0]  # [V]
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, samples, replacement=True, generator=gen)  # [N], each a draft from q
    p_rows, q_rows = torch.stack([p, p]), q[None]  # [2, V], [1, V]: row 1 (bonus) scores the second token only
    first = torch.tensor([verify_exact(p_rows, q_rows, drafts[i : i + 1], gen).tokens[0] for i in range(samples)])
    empirical = torch.bincount(first, minlength=p.numel()).double() / samples
    p, q = p.double(), q.double()
    tv_p, tv_q = 0.5 * float((empirical - p).abs().sum()), 0.5 * float((empirical - q).abs().sum())
    assert tv_p < tolerance, (tv_p, tolerance)
    assert 0.5 * float((p - q).abs().sum()) > 0.1  # q is a different law: the test can tell them apart
    assert tv_q > 5 * tolerance, (tv_q, tv_p)
