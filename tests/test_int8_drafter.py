"""The int8 self-drafter: its projections, its agreement with the target, and exactness of what it drafts."""

from __future__ import annotations

import pytest
import torch

from runtime.loops.decode import generate_ar
from runtime.drafters import build_drafter
from runtime.drafters.int8 import Int8Drafter, Int8Projection, int8_copy
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams
from runtime.backends.layers import Projection
from runtime.backends.lean import lean_target
from runtime.loops.speculative import generate_speculative
from runtime.backends.hf import TransformersTarget
from factories import tiny_causal_lm


def test_int8_projection_is_close_and_uses_dense_weights_for_long_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    dense = Projection(torch.randn(96, 64, generator=g), torch.randn(96, generator=g))
    quantized = Int8Projection(dense)
    assert quantized.qweight.dtype == torch.int8
    x = torch.randn(3, 64, generator=g)
    error = (quantized(x) - dense(x)).abs().max()
    # Per-row int8 rounding: |error| <= sum_j |x_j| * scale / 2 per row.
    assert error <= (x.abs().sum(dim=1).max() * quantized.scales.max() / 2).item()
    assert error > 0  # it really is the int8 copy
    long = torch.randn(40, 64, generator=g)
    torch.testing.assert_close(quantized(long), dense(long))


def test_int8_copy_shares_everything_but_the_projections() -> None:
    target = lean_target(tiny_causal_lm("gemma3"), set())
    copy = int8_copy(target)
    assert copy.layers[0].input_norm is target.layers[0].input_norm
    assert isinstance(copy.layers[0].gate_up, Int8Projection)
    assert isinstance(target.layers[0].gate_up, Projection)  # the target keeps its float weights
    tokens = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(1))
    exact = target.forward(tokens, target.new_cache())
    assert torch.allclose(copy.forward(tokens, copy.new_cache()), exact)  # a long prefill runs the dense weights
    cache = copy.new_cache()
    steps = torch.cat([copy.forward(tokens[i : i + 1], cache) for i in range(24)])
    assert not torch.equal(steps, exact)
    assert torch.nn.functional.cosine_similarity(steps, exact).min() > 0.99


def test_int8_drafter_needs_the_lean_backend() -> None:
    model = tiny_causal_lm("qwen2")
    target = TransformersTarget(model, set())
    with pytest.raises(ValueError, match="lean or native backend"):
        Int8Drafter(target, FullHead(target.head_weight))


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_int8_drafts_are_accepted_and_greedy_output_is_the_target_s(arch: str, temperature: float) -> None:
    target = lean_target(tiny_causal_lm(arch), set())
    head = FullHead(target.head_weight, target.head_bias)
    drafter = build_drafter("int8", target, FullHead(target.head_weight, target.head_bias))
    prompt = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=temperature)
    drafted, stats = generate_speculative(target, head, drafter, prompt, 32, params, torch.Generator().manual_seed(3), gamma=4)
    assert stats.spec.acceptance_rate > 0.5
    if temperature == 0.0:
        plain, _ = generate_ar(target, head, prompt, 32, params, torch.Generator())
        assert drafted == plain


@pytest.mark.real_model
def test_int8_drafter_on_real_gemma_keeps_greedy_tokens(gemma_session) -> None:
    """gemma3-270m on the lean backend, int8 drafter with the int8 screening head: same tokens as plain decoding."""
    from runtime.heads.screen_draft import ScreenDraftHead

    target = lean_target(gemma_session.model.model, gemma_session.target.eos_token_ids)
    head = FullHead(target.head_weight)
    drafter = Int8Drafter(target, ScreenDraftHead(gemma_session.screen_bound()))
    for text in ("def quicksort(items):\n", "The capital of France is"):
        prompt = gemma_session.tokenizer(text, return_tensors="pt").input_ids[0]
        plain, _ = generate_ar(target, head, prompt, 24, SamplingParams(), torch.Generator())
        drafted, stats = generate_speculative(target, head, drafter, prompt, 24, SamplingParams(), torch.Generator(), gamma=4)
        assert drafted == plain
        assert stats.spec.acceptance_rate > 0.6
