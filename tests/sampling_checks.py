"""A statistical check of exact sampling through a built method: the token a verify round decides over a draft."""

from __future__ import annotations

import torch

from runtime.common.sampling import SamplingParams
from runtime.heads import FullHead
from runtime.methods import build_method


def assert_second_token_follows_the_target(session, method: str, prompt: list[int], runs: int = 3000,
                                           temperature: float = 0.7) -> None:
    """The second new token of `method` (the one the first verify round decides, over the drafter's draft)
    follows the target's exact marginal sum_x1 p(x1) p(x2 | x1): a chi-square test over `runs` seeded runs
    (EOS banned in both); every run must have drafted, or there is nothing to test."""
    from scipy.stats import chisquare

    target, params = session.target, SamplingParams(temperature=temperature)
    full = FullHead(target.head_weight, target.head_bias)

    def probs(context: list[int]) -> torch.Tensor:
        """The warped target distribution after `context`, EOS banned (the runs' min-response guard) [V]."""
        logits = full.logits(target.forward(torch.tensor(context), target.new_cache())[-1:])[0]
        logits[list(target.eos_token_ids)] = float("-inf")
        return torch.softmax(logits / temperature, 0)

    first = probs(prompt)
    marginal = sum(first[x] * probs(prompt + [x]) for x in range(first.numel()) if first[x] > 1e-6)  # [V]
    built = build_method(session, method)
    counts, drafting_runs = torch.zeros_like(marginal), 0
    for seed in range(runs):
        # three tokens: the prefill's, then one round that drafts (two would leave it nothing to draft)
        tokens, stats = built.decode(torch.tensor(prompt), 3, params, torch.Generator().manual_seed(seed), min_new_tokens=3)
        counts[tokens[1]] += 1
        drafting_runs += stats.spec.drafted > 0
    assert drafting_runs == runs, f"{method} drafted in {drafting_runs} of {runs} runs"
    expected = marginal.double() / marginal.double().sum() * runs
    big = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().view(1)])
    if wanted[-1] < 5:  # too rare to test alone: fold into the largest bin
        observed[observed.argmax()] += observed[-1]
        wanted[wanted.argmax()] += wanted[-1]
        observed, wanted = observed[:-1], wanted[:-1]
    assert chisquare(observed.numpy(), wanted.numpy()).pvalue > 1e-3
