"""The native backend on the real packaged models: bit-identical hidden states and tokens to the lean backend.

The lean backend runs gguf-py's dequantization of the file (what transformers loads); the native
backend reads the same file's blocks. Over a real prompt's prefill and 128 decode steps both must
give torch.equal hidden states, and plain greedy decoding the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from runtime.backends.lean import lean_target
from runtime.backends.native import native_target
from runtime.heads import FullHead
from runtime.loops.decode import generate_ar

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
STEPS = 128

pytestmark = pytest.mark.real_model


def _pair(loaded):
    lean = lean_target(loaded.model, set())
    native = native_target(loaded.gguf_path, loaded.config, set())
    return lean, native


def _decode_hidden(target, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Hidden states [1 + STEPS, d]: the prompt's last position, then one step per given token."""
    cache = target.new_cache()
    rows = [target.forward(prompt, cache)[-1:]]
    rows += [target.forward(torch.tensor([token]), cache) for token in tokens]
    return torch.cat(rows)


@pytest.mark.parametrize("fixture", ["real_gemma", "real_qwen"])
def test_native_matches_lean_bit_for_bit_over_128_steps(fixture, request) -> None:
    loaded = request.getfixturevalue(fixture)
    assert loaded.gguf_path is not None and loaded.gguf_path.suffix == ".gguf"
    lean, native = _pair(loaded)
    prompt = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    tokens, _ = generate_ar(lean, FullHead(lean.head_weight, lean.head_bias), prompt, STEPS)
    native_tokens, _ = generate_ar(native, FullHead(native.head_weight, native.head_bias), prompt, STEPS)
    assert native_tokens == tokens  # greedy ar identical on both backends
    steps = tokens[: STEPS - 1]
    assert torch.equal(_decode_hidden(native, prompt, steps), _decode_hidden(lean, prompt, steps))
    # Verify-sized forwards (batch invariance) on the native backend: each row is its one-token value.
    cache = native.new_cache()
    native.forward(prompt, cache)
    block = native.forward(torch.tensor(steps[:8]), cache)
    assert torch.equal(block, _decode_hidden(native, prompt, steps[:8])[1:])


def test_traces_read_the_features_the_runtime_decodes_with(real_gemma) -> None:
    """prep traces' teacher is the native backend: a text's features are bit for bit the residual streams a
    decoding cache taps (what the EAGLE-3 head reads at run time), and its top tokens are transformers'."""
    from prep.traces import trace_text, teacher_target
    from runtime.backends.hf import TransformersTarget

    teacher = teacher_target(real_gemma)
    assert teacher.name == "native"
    ids = real_gemma.tokenizer(PROMPT * 3)["input_ids"]
    layers = [2, 9, 15]
    traced = trace_text(teacher, ids, [9], layers)
    cache = teacher.new_cache()
    cache.tap(tuple(layers))
    hidden = teacher.forward(torch.tensor(ids), cache)
    assert torch.equal(traced["features"], cache.features[: len(ids)].to(torch.bfloat16))
    assert torch.equal(traced["hidden"], hidden.to(torch.float16))
    reference = trace_text(TransformersTarget(real_gemma.model, set()), ids, [9], layers)
    assert torch.equal(traced["top1"], reference["top1"])
    assert torch.allclose(traced["hidden_layers_9"].float(), reference["hidden_layers_9"].float(), rtol=0.02, atol=0.02)
