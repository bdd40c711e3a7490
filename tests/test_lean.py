"""The lean backend against transformers' forward (tiny random gemma3 / qwen2 / llama and real gemma3-270m),
its rollback, the skinny GEMM kernel, and greedy identity of speculative decoding on the lean backend."""

from __future__ import annotations

import warnings

import pytest
import torch

from runtime.backends import choose_backend, make_target
from runtime.loops.decode import generate_ar
from runtime.drafters import NgramDrafter
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams
from runtime.kernels import SKINNY_MAX_ROWS, kernel_name, linear
from runtime.backends.layers import UnsupportedModel
from runtime.backends.lean import lean_target
from runtime.loops.speculative import generate_speculative
from runtime.backends.hf import TransformersTarget
from factories import TINY_ARCHS, tiny_causal_lm




def hidden_in_chunks(target: TransformersTarget, tokens: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Feed tokens in chunks of the given sizes; the hidden states [T_i, d] of each chunk."""
    cache, out, start = target.new_cache(), [], 0
    for size in sizes:
        out.append(target.forward(tokens[start : start + size], cache))
        start += size
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lean_matches_transformers_across_chunks_and_windows(arch: str) -> None:
    """Prefill, single steps and multi-token steps past the sliding window agree with transformers."""
    model = tiny_causal_lm(arch)
    tokens = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(0))
    sizes = [9, 1, 4, 1, 1, 8, 6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cache goes under the keyword this transformers takes: no deprecation
        reference = hidden_in_chunks(TransformersTarget(model, set()), tokens, sizes)
    lean = hidden_in_chunks(lean_target(model, set()), tokens, sizes)
    for ref, ours in zip(reference, lean):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_lean_crop_rolls_back_exactly() -> None:
    """After a crop, re-feeding other tokens gives what a fresh cache gives."""
    target = lean_target(tiny_causal_lm("gemma3"), set())
    tokens = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(5))
    cache = target.new_cache()
    target.forward(tokens[:12], cache)
    target.forward(torch.tensor([7, 8, 9]), cache)  # rejected drafts
    target.crop(cache, 12)
    assert len(cache) == 12
    after_crop = target.forward(tokens[12:], cache)
    fresh = hidden_in_chunks(target, tokens, [12, 8])[1]
    torch.testing.assert_close(after_crop, fresh, rtol=0, atol=0)


def test_lean_cache_grows_past_its_initial_capacity() -> None:
    model = tiny_causal_lm("llama")
    tokens = torch.randint(0, 128, (700,), generator=torch.Generator().manual_seed(6))
    reference = hidden_in_chunks(TransformersTarget(model, set()), tokens, [600, 1, 99])
    lean = hidden_in_chunks(lean_target(model, set()), tokens, [600, 1, 99])
    for ref, ours in zip(reference, lean):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_backend_choice_and_errors() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    llama = tiny_causal_lm("llama")
    assert choose_backend("auto", None, llama.config) == "lean"  # an HF model: no GGUF to read natively
    assert make_target("lean", config=llama.config, eos_token_ids=set(), model=llama).name == "lean"
    assert make_target("transformers", config=llama.config, eos_token_ids=set(), model=llama).name == "transformers"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModel, match="--backend transformers"):
        lean_target(gpt2, set())
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("onnx", None, llama.config)


@pytest.mark.parametrize("rows,out,d", [(1, 37, 640), (3, 1001, 900), (SKINNY_MAX_ROWS, 64, 48), (5, 8, 16)])
def test_skinny_linear_matches_torch_and_is_batch_invariant(rows: int, out: int, d: int) -> None:
    """Close to F.linear, and each row's result does not depend on how many rows share the call."""
    g = torch.Generator().manual_seed(rows * out)
    x, w, b = torch.randn(rows, d, generator=g), torch.randn(out, d, generator=g), torch.randn(out, generator=g)
    together = linear(x, w, b)  # [rows, out]
    torch.testing.assert_close(together, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
    alone = torch.cat([linear(x[i : i + 1], w, b) for i in range(rows)])
    if kernel_name() != "torch":  # every compiled path: one summation order whatever the row count
        assert torch.equal(together, alone)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_greedy_speculative_equals_plain_on_lean_backend(arch: str) -> None:
    target = lean_target(tiny_causal_lm(arch), set())
    head = FullHead(target.head_weight, target.head_bias)
    prompt = torch.tensor([5, 6, 7, 5, 6, 7, 5, 6, 9, 10, 11, 5, 6, 7])
    params, generator = SamplingParams(), torch.Generator()
    plain, _ = generate_ar(target, head, prompt, 24, params, generator)
    drafted, stats = generate_speculative(target, head, NgramDrafter(), prompt, 24, params, generator, gamma=4)
    assert drafted == plain
    assert stats.spec.drafted > 0


@pytest.mark.real_model
def test_lean_matches_transformers_on_real_gemma(real_gemma) -> None:
    """Real gemma3-270m: the hidden states of a prompt and of 1- and 5-token steps agree; so do greedy tokens."""
    ids = real_gemma.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids[0]
    reference = TransformersTarget(real_gemma.model, set())
    lean = lean_target(real_gemma.model, set())
    tokens = torch.cat([ids, torch.tensor([1000, 2000, 3000, 4000, 5000, 6000])])
    sizes = [len(ids), 1, 5]
    for ref, ours in zip(hidden_in_chunks(reference, tokens, sizes), hidden_in_chunks(lean, tokens, sizes)):
        torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    head = FullHead(reference.head_weight)
    plain_lean, _ = generate_ar(lean, head, ids, 24, SamplingParams(), torch.Generator())
    plain_ref, _ = generate_ar(reference, head, ids, 24, SamplingParams(), torch.Generator())
    assert plain_lean == plain_ref
