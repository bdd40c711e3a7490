"""The suffix drafter: greedy identity with plain decoding on a tiny random Llama (exact), the longest
matching suffix chosen over lookup's short n-gram vote, its frequency score, its session, its options."""

from __future__ import annotations

import re

import pytest
import torch

from runtime.backends.hf import TransformersTarget
from runtime.loops.decode import generate_ar
from runtime.drafters import LookupDrafter, SuffixDrafter, parse_drafter
from runtime.drafters.suffix import MAX_MATCH, MIN_PROB
from runtime.heads import FullHead
from runtime.methods import canonical, parse_method
from runtime.common.sampling import SamplingParams
from runtime.loops.speculative import generate_speculative
from runtime.loops.verify import Verdict

PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 30)), [3], [201, 17, 88, 4, 150, 9, 63, 240, 31, 77, 120, 5]]


@pytest.mark.parametrize("gamma, adaptive", [(4, False), (8, False), (2, True)])
def test_greedy_equals_plain_decoding(tiny_llama, gamma, adaptive):
    target = TransformersTarget(tiny_llama, set())  # no EOS: every run produces its full token budget
    head = FullHead(target.head_weight, target.head_bias)
    drafter, accepted = SuffixDrafter(), 0  # one session over all prompts, as a built method keeps it
    for prompt in PROMPTS:
        tokens, stats = generate_speculative(target, head, drafter, torch.tensor(prompt), 24, gamma=gamma, adaptive=adaptive)
        assert tokens == generate_ar(target, head, torch.tensor(prompt), 24)[0]
        accepted += stats.spec.accepted
    assert accepted > 0, "no draft was ever accepted: the loop never exercised multi-token appends"


def test_the_longest_shared_suffix_drafts_where_lookup_votes():
    # "3 4 5 6" occurs three times: once after "1 2" going on 7 9, twice after other tokens going on 8 9.
    # The context ends "1 2 3 4 5 6": the occurrence sharing six tokens drafts, up to six tokens.
    context = [1, 2, 3, 4, 5, 6, 7, 9, 20, 3, 4, 5, 6, 8, 9, 21, 3, 4, 5, 6, 8, 9, 22, 1, 2, 3, 4, 5, 6]
    assert SuffixDrafter().propose(context, 8).tokens.tolist() == [7, 9, 20, 3, 4, 5]
    assert LookupDrafter().propose(context, 8).tokens.tolist() == [8, 9]  # lookup: the 4-gram's majority
    assert SuffixDrafter().propose(context, 2).tokens.tolist() == [7, 9]  # at most k
    # Compared 4 back, all three match: the majority's 8 9, then a tie of one each goes to the newest (22 1).
    assert SuffixDrafter(max_match=4).propose(context, 8).tokens.tolist() == [8, 9, 22, 1]
    assert SuffixDrafter().propose([5, 9, 5], 8).tokens.tolist() == [9]  # a one-token match drafts one
    assert SuffixDrafter().propose([1, 2], 0).tokens.numel() == 0 and SuffixDrafter().propose([1, 2], 4).tokens.numel() == 0


def test_the_draft_goes_on_while_the_frequency_score_holds():
    # "9 1 2" four times before the context's own: 3 follows three of them (share 3/4), then 4 follows
    # two of those three (score 3/4 * 2/3 = 1/2), then 9 both (1/2); the match is 3 tokens: 3 drafted.
    context = [9, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 6, 9, 1, 2]
    assert SuffixDrafter(min_prob=0.5).propose(context, 8).tokens.tolist() == [3, 4, 9]
    assert SuffixDrafter(min_prob=0.6).propose(context, 8).tokens.tolist() == [3]
    assert SuffixDrafter(min_prob=0.8).propose(context, 8).tokens.numel() == 0


def test_earlier_sequences_of_the_session_draft():
    drafter = SuffixDrafter()
    drafter.reset([10, 11, 12], SamplingParams(), None)
    drafter.propose([10, 11, 12, 13], 4)
    drafter.observe(Verdict(drafted=0, accepted=0, tokens=[14, 15, 16, 17]))
    drafter.reset([7, 8], SamplingParams(), None)
    assert drafter.history == [[10, 11, 12, 13, 14, 15, 16, 17]]
    assert drafter.propose([7, 11, 12, 13], 8).tokens.tolist() == [14, 15, 16]  # three tokens shared: three drafted


@pytest.mark.parametrize("text, fix", [("suffix:match=0", "integer >= 1"), ("suffix:prob=2", "in [0, 1]"),
                                       ("suffix:prob=x", "in [0, 1]"), ("suffix:8", "match=N and prob=P"),
                                       ("suffix:match=4:match=5", "at most once")])
def test_bad_options_are_one_line_errors(text, fix):
    with pytest.raises(ValueError, match=re.escape(fix)) as error:
        parse_drafter(text)
    assert "\n" not in str(error.value)


def test_its_name_is_a_typed_value():
    spec = parse_method("spec:suffix:prob=0.25:gamma=6+csv")
    assert (spec.drafter.options.max_match, spec.drafter.options.min_prob) == (MAX_MATCH, 0.25)
    assert canonical(spec) == f"spec:suffix:match={MAX_MATCH}:prob=0.25:gamma=6+csv:screen"
    assert str(parse_drafter("suffix")) == f"suffix:match={MAX_MATCH}:prob={MIN_PROB:g}"
