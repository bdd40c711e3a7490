"""The transformers backend: transformers' own forward and DynamicCache (any architecture it knows)."""

from __future__ import annotations

import copy
import inspect

import torch

from runtime.backends.base import check_truncation
from runtime.kernels import decode_threads, torch_threads


class TransformersCache:
    """A transformers DynamicCache plus the number of tokens it holds."""

    def __init__(self, config) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache(config=config)
        self.length = 0

    def __len__(self) -> int:
        return self.length


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a module that shares its weights but has its own module, parameter and buffer tables."""
    clone = copy.copy(module)
    # copy.copy shares nn.Module's internal dicts; replace them before assigning anything.
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def truncated_body(body: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A shallow copy of a transformers decoder that runs only its first `layers` layers.

    Weights are shared with `body`; the copy gets its own module table and config so that
    neither the original's layer list nor the cache layout it implies changes.
    """
    check_truncation(layers, body.config.num_hidden_layers)
    clone = _shallow_copy(body)
    clone.layers = torch.nn.ModuleList(list(body.layers)[:layers])
    config = copy.deepcopy(body.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    clone.config = config
    return clone


TREES_REFUSED = "token trees (swarm:..., mjsd:...) run on the decoder ladder; use --backend lean|native"


class TransformersTarget:
    """Backend over a transformers causal LM (float32 on CPU; bf16/fp16 on a GPU)."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module, eos_token_ids: set[int] | frozenset[int], body: torch.nn.Module | None = None) -> None:
        self.model = model.eval()
        self.body = body if body is not None else model.get_decoder()
        self.config = self.body.config
        head = model.get_output_embeddings()
        self.head_weight = head.weight.detach()
        self.head_bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
        self.vocab_size, self.hidden_size = self.head_weight.shape
        self.eos_token_ids = frozenset(eos_token_ids)
        # transformers 5 names the forward's cache `cache` and warns on every call given `past_key_values`
        self._cache_keyword = "cache" if "cache" in inspect.signature(self.body.forward).parameters else "past_key_values"
        # GGUF-dequantized weights (qwen2.5-coder) hold subnormal floats that make x86 matmuls
        # ~10x slower; flushing them to zero changes values below 1e-38 only, like llama.cpp does.
        torch.set_flush_denormal(True)
        if getattr(model.config, "final_logit_softcapping", None):
            raise ValueError("models with final logit soft-capping are not supported yet (gemma2); use gemma3, qwen2 or llama")

    @property
    def num_layers(self) -> int:
        return len(self.body.layers)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: TransformersCache) -> torch.Tensor:
        """Append tokens [T] to the cache and return final-normed hidden states [T, d] (torch's ops, on the decoding threads)."""
        with torch_threads(decode_threads()):
            out = self.body(input_ids=tokens.view(1, -1), use_cache=True, **{self._cache_keyword: cache.inner})
        cache.length += tokens.numel()
        return out.last_hidden_state[0]

    def new_cache(self) -> TransformersCache:
        return TransformersCache(self.config)

    def crop(self, cache: TransformersCache, length: int) -> None:
        """Roll the cache back to its first `length` tokens."""
        if length < cache.length:
            cache.inner.crop(length - cache.length)  # negative: remove that many (sliding layers need it)
            cache.length = length

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, cache, start: int | None = None) -> torch.Tensor:
        """Token trees need per-node attention this backend does not have."""
        raise ValueError(TREES_REFUSED)

    def compact(self, cache, start: int, nodes: list[int]) -> None:
        raise ValueError(TREES_REFUSED)

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows [k, d] of the input-embedding table (unscaled, as stored)."""
        return self.model.get_input_embeddings().weight.detach()[ids]

    def truncated(self, layers: int) -> "TransformersTarget":
        """The first `layers` layers + final norm of transformers' decoder, weights shared."""
        return TransformersTarget(self.model, self.eos_token_ids, truncated_body(self.body, layers))
