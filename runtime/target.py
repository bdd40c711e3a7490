"""TargetModel: the backend interface the decoding loops run on, and its torch/transformers backend.

A backend turns tokens into final-normed hidden states [T, d] and keeps its own KV cache; the
LM head lives apart (runtime.heads) so the loops can swap a full head for a certified one.
Rollback is cropping the cache to a length.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    """Per-sequence attention cache owned by a backend."""

    def __len__(self) -> int: ...


class TargetModel(Protocol):
    """A causal LM as the decoding loops see it."""

    vocab_size: int
    hidden_size: int
    head_weight: torch.Tensor  # [V, d]
    head_bias: torch.Tensor | None  # [V]
    eos_token_ids: frozenset[int]

    def new_cache(self) -> KVCache: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return their final-normed hidden states [T, d]."""
        ...

    def crop(self, cache: KVCache, length: int) -> None:
        """Drop everything after the first `length` cached tokens."""
        ...


class TorchCache:
    """A transformers DynamicCache plus the number of tokens it holds."""

    def __init__(self, config) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache(config=config)
        self.length = 0

    def __len__(self) -> int:
        return self.length


class TorchTarget:
    """Backend over a transformers causal LM (float32 on CPU; bf16/fp16 on a GPU)."""

    def __init__(self, model: torch.nn.Module, eos_token_ids: set[int] | frozenset[int]) -> None:
        self.model = model.eval()
        self.body = model.get_decoder()
        head = model.get_output_embeddings()
        self.head_weight = head.weight.detach()
        self.head_bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
        self.vocab_size, self.hidden_size = self.head_weight.shape
        self.eos_token_ids = frozenset(eos_token_ids)
        # GGUF-dequantized weights (qwen2.5-coder) hold subnormal floats that make x86 matmuls
        # ~10x slower; flushing them to zero changes values below 1e-38 only, like llama.cpp does.
        torch.set_flush_denormal(True)
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError("models with final logit soft-capping are not supported yet (gemma2); use gemma3, qwen2 or llama")

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: TorchCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return final-normed hidden states [T, d]."""
        out = self.body(input_ids=tokens.view(1, -1), past_key_values=cache.inner, use_cache=True)
        cache.length += tokens.numel()
        return out.last_hidden_state[0]

    def new_cache(self) -> TorchCache:
        return TorchCache(self.model.config)

    def crop(self, cache: TorchCache, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        if length < cache.length:
            cache.inner.crop(length - cache.length)  # negative: remove that many (sliding layers need it)
            cache.length = length


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids from the generation config, model config and tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    for token in ("<end_of_turn>", "<|im_end|>", "<|endoftext|>"):
        token_id = tokenizer.convert_tokens_to_ids(token) if token in tokenizer.get_vocab() else None
        if token_id is not None:
            ids.add(int(token_id))
    return ids
