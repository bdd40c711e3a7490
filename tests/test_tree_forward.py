"""Tree forwards on the decoder ladder: every node's hidden state is torch.equal to a chain forward over
its path (fresh cache: the prefix, then the path), for trees of several shapes (K = 2, 4, 8; up to 32
nodes, fed in one call or in parts), on tiny gemma3 (sliding window 6, cut inside deep paths), qwen2
(grouped KV heads, biases) and llama, and on real gemma3-270m over the native backend. After
compaction to one path, the next forward equals the chain's too.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.backends.lean import lean_target
from runtime.drafters.trees import TokenTree, build_tree
from factories import needs_compiled_kernels, tiny_causal_lm

ARCHS = ("gemma3", "qwen2", "llama")
SHAPES = [(2, 4, 7), (4, 3, 16), (8, 2, 24), (2, 9, 18), (4, 8, 32)]  # (K, depth, node budget)


def random_tree(vocab: int, k: int, depth: int, budget: int, seed: int) -> TokenTree:
    """A best-first tree of the given shape with random candidates and confidences."""

    def expand(path: list[int]) -> tuple[list[int], list[float]]:
        rng = random.Random(hash((seed, tuple(path))))
        return rng.sample(range(vocab), k), sorted((rng.random() for _ in range(k)), reverse=True)

    tree = build_tree(expand, k, depth, budget)
    assert tree.size == budget
    return tree


def chain_hidden(target, prefix: torch.Tensor, path_tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Hidden states [d', d] of a chain forward over the path after the prefix, and its cache."""
    cache = target.new_cache()
    target.forward(prefix, cache)
    return target.forward(path_tokens, cache), cache


@pytest.fixture(scope="module", params=ARCHS)
def tiny_target(request):
    return lean_target(tiny_causal_lm(request.param), set())


def check_tree(target, prefix: torch.Tensor, tree: TokenTree, parts: int = 1) -> None:
    """Tree forward (in `parts` calls) against chain forwards over every leaf's path."""
    cache = target.new_cache()
    target.forward(prefix, cache)
    start = cache.length
    bounds = torch.linspace(0, tree.size, parts + 1).long().tolist()
    hidden = torch.cat([target.forward_tree(tree.tokens[a:b], tree.parents[:b], cache, start)
                        for a, b in zip(bounds, bounds[1:])])  # [N, d]
    assert cache.length == start + tree.size
    for path in tree.paths():
        reference, _ = chain_hidden(target, prefix, tree.tokens[path])
        assert torch.equal(hidden[path], reference), f"path {path}"


@needs_compiled_kernels
@pytest.mark.parametrize("k, depth, budget", SHAPES)
def test_tree_nodes_equal_chain_forwards(tiny_target, k, depth, budget) -> None:
    prefix = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(budget))
    check_tree(tiny_target, prefix, random_tree(128, k, depth, budget, seed=k * 100 + depth))


@needs_compiled_kernels
def test_tree_fed_in_parts_equals_one_call(tiny_target) -> None:
    """Nodes fed over several calls (beam search grows a tree step by step) attend to earlier calls' nodes."""
    prefix = torch.arange(3, 12)
    check_tree(tiny_target, prefix, random_tree(128, 4, 5, 20, seed=7), parts=3)


@needs_compiled_kernels
def test_chain_shaped_tree_equals_forward(tiny_target) -> None:
    """A one-path tree is a chain: forward_tree gives forward's bits, rows and cache alike."""
    prefix, path = torch.arange(5, 25), torch.tensor([9, 4, 77, 12, 3])
    reference, chain_cache = chain_hidden(tiny_target, prefix, path)
    cache = tiny_target.new_cache()
    tiny_target.forward(prefix, cache)
    assert torch.equal(tiny_target.forward_tree(path, TokenTree.chain(path).parents, cache), reference)
    for mine, theirs in zip(cache.keys + cache.values, chain_cache.keys + chain_cache.values):
        assert torch.equal(mine[:, : cache.length], theirs[:, : cache.length])


@needs_compiled_kernels
@pytest.mark.parametrize("pick", ["deepest", "last", "first"])
def test_compact_then_forward_equals_chain(tiny_target, pick) -> None:
    """After keeping one path's K/V, the cache is the chain's (bit for bit) and the next forward agrees."""
    prefix = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(3))
    tree = random_tree(128, 4, 6, 24, seed=11)
    depths = tree.depths()
    node = {"deepest": int(depths.argmax()), "last": tree.size - 1, "first": 0}[pick]
    path = tree.path(node)
    cache = tiny_target.new_cache()
    tiny_target.forward(prefix, cache)
    tiny_target.forward_tree(tree.tokens, tree.parents, cache)
    tiny_target.compact(cache, prefix.numel(), path)
    assert cache.length == prefix.numel() + len(path)
    follow = torch.tensor([5, 61, 2])
    _, chain_cache = chain_hidden(tiny_target, prefix, tree.tokens[path])
    for mine, theirs in zip(cache.keys + cache.values, chain_cache.keys + chain_cache.values):
        assert torch.equal(mine[:, : cache.length], theirs[:, : cache.length])
    assert torch.equal(tiny_target.forward(follow, cache), tiny_target.forward(follow, chain_cache))


def test_compact_refuses_nodes_outside_the_tree(tiny_target) -> None:
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.arange(4), cache)
    tiny_target.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, -1]), cache)
    with pytest.raises(ValueError, match="compact keeps cached tree nodes"):
        tiny_target.compact(cache, 4, [2])


def test_forward_tree_refuses_children_before_parents(tiny_target) -> None:
    cache = tiny_target.new_cache()
    tiny_target.forward(torch.arange(4), cache)
    with pytest.raises(ValueError, match="parents first"):
        tiny_target.forward_tree(torch.tensor([1, 2]), torch.tensor([1, -1]), cache)


def test_transformers_backend_refuses_trees() -> None:
    from runtime.backends.hf import TransformersTarget

    target = TransformersTarget(tiny_causal_lm("llama"), set())
    with pytest.raises(ValueError, match="--backend lean|native"):
        target.forward_tree(torch.tensor([1]), torch.tensor([-1]), target.new_cache())


@needs_compiled_kernels
@pytest.mark.real_model
def test_real_gemma_native_tree_equals_chains(real_gemma) -> None:
    """gemma3-270m on the native backend (the GGUF's own blocks): a 16-node tree over a real prompt."""
    from runtime.backends.native import native_target

    target = native_target(real_gemma.gguf_path, real_gemma.config, set())
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    prefix = torch.tensor(real_gemma.tokenizer(prompt)["input_ids"])
    check_tree(target, prefix, random_tree(target.vocab_size, 4, 5, 16, seed=5))
