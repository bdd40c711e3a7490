"""The compiled one-call layer (runtime/kernels/csrc/layer_plan.h) computes the step-by-step ladder's bits.

The same target with plans on and off (every layer's `compiled` set to False): a prefill longer than
SKINNY_MAX_ROWS (the step-by-step path either way), one-token steps, a verify chain and a token
tree; hidden states and cached K/V torch.equal. Tiny gemma3 (sliding window, head norms, GELU),
qwen2 (biases, grouped KV heads, SiLU) and llama on the lean backend; real gemma3-270m and
qwen2.5-coder on the native one (block weights).
"""

from __future__ import annotations

import pytest
import torch

from runtime.backends.lean import lean_target
from runtime.backends.native import native_target
from factories import needs_compiled_kernels, tiny_causal_lm

pytestmark = needs_compiled_kernels

TREE_PARENTS = [-1, 0, 0, 1, 3, -1]  # two root children, a path three deep under the first


def run_ladder(target, prompt: torch.Tensor, steps: list[int], plans: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Hidden states [P + S + 5 + 6, d] of prefill, steps, a 5-token chain and a 6-node tree; the cached K/V."""
    for layer in target.decoder.layers:
        layer.compiled = None if plans else False
    cache = target.new_cache()
    rows = [target.forward(prompt, cache)]
    rows += [target.forward(torch.tensor([token]), cache) for token in steps]
    rows.append(target.forward(torch.tensor(steps[:5]), cache))
    rows.append(target.forward_tree(torch.tensor(steps[:6]), torch.tensor(TREE_PARENTS), cache))
    if plans:
        assert all(layer.compiled for layer in target.decoder.layers), "every layer should have run as its plan"
    return torch.cat(rows), [buffer[:, : cache.length] for buffer in cache.keys + cache.values]


def check_plans_match(target, prompt: torch.Tensor, steps: list[int]) -> None:
    hidden, kv = run_ladder(target, prompt, steps, plans=True)
    reference, reference_kv = run_ladder(target, prompt, steps, plans=False)
    assert torch.equal(hidden, reference)
    assert all(torch.equal(a, b) for a, b in zip(kv, reference_kv))


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "llama"])
def test_plan_matches_the_step_by_step_ladder(arch: str) -> None:
    target = lean_target(tiny_causal_lm(arch), set())
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(target.vocab_size, (24,), generator=gen)
    check_plans_match(target, prompt, torch.randint(target.vocab_size, (12,), generator=gen).tolist())


def test_a_transformed_projection_keeps_the_step_by_step_path() -> None:
    decoder = lean_target(tiny_causal_lm("llama"), set()).decoder
    wrapped = decoder.map_projections(lambda name, index, projection: (lambda x: projection(x)))
    assert wrapped.layers[0].plan(decoder.num_heads, decoder.kv_heads, decoder.head_dim) is None
    assert decoder.layers[0].plan(decoder.num_heads, decoder.kv_heads, decoder.head_dim) is not None


@pytest.mark.real_model
@pytest.mark.parametrize("fixture", ["real_gemma", "real_qwen"])
def test_plan_matches_the_ladder_on_real_native_models(fixture: str, request) -> None:
    loaded = request.getfixturevalue(fixture)
    target = native_target(loaded.gguf_path, loaded.config, set())
    prompt = loaded.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", return_tensors="pt").input_ids[0]
    check_plans_match(target, prompt, prompt[:12].tolist())
