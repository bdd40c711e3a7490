"""The lean backend: the decoder ladder over a transformers model's own fp32 weights.

transformers' forward spends ~15 ms of a gemma3-270m step on mask building, cache bookkeeping
and dispatch, and a forward over n new tokens grows much faster than its weight traffic. The
ladder (runtime.backends.decoder) runs the same arithmetic with fused q/k/v and gate/up weights
and the skinny kernel; activations and rotary tables are the model's own modules, norms and
attention the ladder's fixed-order kernels, so the numerics match transformers up to float32
accumulation order (checked in tests/test_lean.py).
"""

from __future__ import annotations

import torch

from runtime.backends.base import eos_ids
from runtime.backends.decoder import Decoder
from runtime.backends.layers import DecoderLayer, Projection, RMSNorm, UnsupportedModel, check_supported, layer_type
from runtime.backends.target import DecoderTarget


def _decoder_layer(layer: torch.nn.Module, config, index: int, gemma: bool) -> DecoderLayer:
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    biases = [p.bias for p in projections]
    qkv_bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if qkv_bias is None and any(b is not None for b in biases):
        raise UnsupportedModel("q/k/v projections with partial biases are not supported; use --backend transformers")
    kind = layer_type(config, index)
    window = getattr(attn, "sliding_window", None) if kind == "sliding_attention" else None

    def norm(module: torch.nn.Module | None) -> RMSNorm | None:
        return RMSNorm.of_module(module, gemma) if module is not None else None

    return DecoderLayer(
        input_norm=norm(layer.input_layernorm),
        qkv=Projection(torch.cat([p.weight.detach() for p in projections]).contiguous(), qkv_bias),
        q_norm=norm(getattr(attn, "q_norm", None)),
        k_norm=norm(getattr(attn, "k_norm", None)),
        o=Projection(attn.o_proj.weight.detach(), attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None),
        post_attention_norm=norm(layer.post_attention_layernorm) if gemma else None,
        pre_mlp_norm=norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
        post_mlp_norm=norm(layer.post_feedforward_layernorm) if gemma else None,
        gate_up=Projection(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous()),
        down=Projection(mlp.down_proj.weight.detach()),
        activation=mlp.act_fn,
        scaling=float(attn.scaling),
        window=int(window) if window else None,
        rope=kind,
    )


def lean_decoder(model: torch.nn.Module) -> Decoder:
    """The ladder over `model`'s decoder (weights shared with the model, q/k/v and gate/up fused)."""
    config = model.config
    check_supported(config)
    body = model.get_decoder()
    gemma = config.model_type.startswith("gemma")
    layers = [_decoder_layer(layer, config, i, gemma) for i, layer in enumerate(body.layers)]
    final = RMSNorm.of_module(body.norm, gemma)
    return Decoder(config, body.embed_tokens, layers, final, body.rotary_emb, body.layers[0].self_attn.head_dim)


def lean_target(model: torch.nn.Module, eos_token_ids: set[int] | frozenset[int]) -> DecoderTarget:
    """TargetModel over a transformers model's fp32 weights on the ladder."""
    model.eval()
    torch.set_flush_denormal(True)  # as runtime.backends.hf: GGUF-dequantized subnormals stall x86 matmuls
    head = model.get_output_embeddings()
    bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
    embedding = model.get_input_embeddings().weight.detach()
    return DecoderTarget("lean", lean_decoder(model), embedding, head.weight.detach(), bias, eos_token_ids)


def model_eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """End-of-sequence ids of a loaded transformers model and its tokenizer."""
    return eos_ids(model.config, getattr(model, "generation_config", None), tokenizer)
