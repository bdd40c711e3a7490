"""One forward over several sequences' rows (Decoder.forward_feeds): each sequence's hidden states and
KV cache are torch.equal to its forward alone, for one-token steps, verify chains, token-tree nodes and
a prefill chunk of more than SKINNY_MAX_ROWS tokens side by side, on tiny gemma3 (sliding window),
qwen2 and llama (lean) and on real gemma3-270m (native).
"""

from __future__ import annotations

import pytest
import torch

from factories import needs_compiled_kernels, tiny_causal_lm
from runtime.backends.lean import lean_target

ARCHS = ("gemma3", "qwen2", "llama")
# (prefix length, what is fed): a chain of n tokens, or a tree given by its parents.
FEEDS = [(5, ("chain", 1)), (9, ("chain", 5)), (3, ("tree", [-1, -1, 0, 0, 1, 2])), (12, ("chain", 1)),
         (0, ("chain", 40)), (7, ("chain", 16))]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_target(request):
    return lean_target(tiny_causal_lm(request.param), set())


def _prefilled(target, prefix: torch.Tensor):
    cache = target.new_cache()
    if prefix.numel():
        target.forward(prefix, cache)
    return cache


def _cases(vocab: int, seed: int) -> list[tuple[torch.Tensor, str, torch.Tensor, object]]:
    """(prefix [P], kind, tokens [T], parents or None) per FEEDS entry, random tokens."""
    generator = torch.Generator().manual_seed(seed)
    cases = []
    for length, (kind, shape) in FEEDS:
        count = shape if kind == "chain" else len(shape)
        prefix, tokens = torch.randint(vocab, (length,), generator=generator), torch.randint(vocab, (count,), generator=generator)
        cases.append((prefix, kind, tokens, torch.tensor(shape) if kind == "tree" else None))
    return cases


def check_fused(target, cases) -> None:
    """forward_feeds over every case at once against each case's own forward (hidden states and cache)."""
    decoder = target.decoder
    alone, caches = [], []
    for prefix, kind, tokens, parents in cases:
        cache = _prefilled(target, prefix)
        hidden = target.forward(tokens, cache) if kind == "chain" else target.forward_tree(tokens, parents, cache)
        alone.append((hidden, cache))
        caches.append(_prefilled(target, prefix))
    feeds = [decoder.chain_feed(tokens, cache) if kind == "chain" else decoder.tree_feed(tokens, parents, cache)
             for (_, kind, tokens, parents), cache in zip(cases, caches)]
    fused = decoder.forward_feeds(feeds)
    for i, ((hidden, reference), got, cache) in enumerate(zip(alone, fused, caches)):
        assert torch.equal(got, hidden), f"feed {i}: {FEEDS[i]}"
        assert cache.length == reference.length
        for mine, theirs in zip(cache.keys + cache.values, reference.keys + reference.values):
            assert torch.equal(mine[:, : cache.length], theirs[:, : cache.length]), f"feed {i}: cache"


@needs_compiled_kernels
def test_fused_rows_equal_each_sequence_alone(tiny_target):
    check_fused(tiny_target, _cases(tiny_target.vocab_size, 0))


@needs_compiled_kernels
def test_one_step_rows_of_many_sequences_equal_their_steps_alone(tiny_target):
    """Twenty one-token steps (more rows than one skinny kernel call takes) in one forward."""
    generator = torch.Generator().manual_seed(1)
    cases = [(torch.randint(tiny_target.vocab_size, (3 + i,), generator=generator), "chain",
              torch.randint(tiny_target.vocab_size, (1,), generator=generator), None) for i in range(20)]
    check_fused(tiny_target, cases)


@pytest.mark.real_model
@needs_compiled_kernels
def test_real_fused_rows_equal_each_sequence_alone(gemma_session):
    check_fused(gemma_session.target, _cases(gemma_session.target.vocab_size, 2))
