"""Readers of an EAGLE-3 checkpoint folder, written from vLLM's and SGLang's loaders, for the export tests.

vLLM (`Eagle3LlamaForCausalLM.load_weights`, vllm/model_executor/models/llama_eagle3.py) and SGLang
(`LlamaForCausalLMEagle3.load_weights`, python/sglang/srt/models/llama_eagle3.py) allocate a
one-layer Llama from config.json and map the checkpoint's names onto it: `d2t` becomes the draft ->
target id map, `t2d` is skipped, q/k/v and gate/up are loaded as shards of fused qkv_proj and
gate_up_proj, and every other name is prefixed with `model.` (vLLM also renames `midlayer.` to
`layers.0.`). vLLM raises on a name it has no parameter for and on a parameter left unloaded; SGLang
drops an unknown name silently, which is why these readers check that every tensor lands somewhere.
"""

from __future__ import annotations

import torch

STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
           (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
EMBEDDING = "model.embed_tokens.weight"  # optional: without it both share the target's table


def layer_params(config: dict, layer: str) -> dict[str, dict]:
    """The parameters a one-layer LlamaForCausalLMEagle3 allocates from config.json: name -> {shard: shape}."""
    d, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or d // heads  # both loaders: config.head_dim, else hidden / heads
    width, target = config["intermediate_size"], config.get("target_hidden_size", d)
    return {
        "model.fc.weight": {None: (d, 3 * target)},
        f"{layer}.self_attn.qkv_proj.weight": {"q": (heads * head_dim, 2 * d), "k": (kv * head_dim, 2 * d),
                                               "v": (kv * head_dim, 2 * d)},
        f"{layer}.self_attn.o_proj.weight": {None: (d, heads * head_dim)},
        f"{layer}.mlp.gate_up_proj.weight": {0: (width, d), 1: (width, d)},
        f"{layer}.mlp.down_proj.weight": {None: (d, width)},
        f"{layer}.input_layernorm.weight": {None: (d,)},
        f"{layer}.hidden_norm.weight": {None: (d,)},
        f"{layer}.post_attention_layernorm.weight": {None: (d,)},
        "model.norm.weight": {None: (d,)},
        "lm_head.weight": {None: (config["draft_vocab_size"], d)},
        EMBEDDING: {None: (config["vocab_size"], d)},
    }


def stacked(name: str) -> tuple[str, object]:
    """(name with a q/k/v or gate/up projection renamed to its fused parameter, the shard id or None)."""
    for param, weight, shard in STACKED:
        if weight in name:
            return name.replace(weight, param), shard
    return name, None


def place(params: dict[str, dict], loaded: dict[str, set], name: str, shard, tensor: torch.Tensor) -> None:
    """Load tensor into param `name`'s shard, as the loaders' weight_loader does: the shapes must agree."""
    assert name in params, f"no parameter {name}"
    assert tuple(tensor.shape) == params[name][shard], f"{name} shard {shard}: {tuple(tensor.shape)} != {params[name][shard]}"
    loaded.setdefault(name, set()).add(shard)


def unloaded(params: dict[str, dict], loaded: dict[str, set]) -> list[str]:
    """The parameters (or shards) no tensor filled, the optional embedding aside."""
    return [f"{name} {sorted(map(str, set(shards) - loaded.get(name, set())))}" for name, shards in params.items()
            if name != EMBEDDING and set(shards) != loaded.get(name, set())]


def vllm_read(config: dict, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """vLLM's load: every tensor to its parameter, every parameter filled; returns draft_id_to_target_id [Vd]."""
    assert config["num_hidden_layers"] == 1 and config["eagle_config"].get("use_aux_hidden_state", True)
    params = {**layer_params(config, "model.layers.0"), "draft_id_to_target_id": {None: (config["draft_vocab_size"],)}}
    loaded: dict[str, set] = {}
    for name, tensor in weights.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        place(params, loaded, *stacked(name.replace("midlayer.", "layers.0.")), tensor)
    assert not unloaded(params, loaded), unloaded(params, loaded)
    return weights["d2t"]


def sglang_read(config: dict, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """SGLang's load, with its silent drops made failures; returns hot_token_id, the target id of each draft row [Vd]."""
    assert not config["tie_word_embeddings"], "SGLang would use embed_tokens as the LM head and ignore lm_head"
    assert config["draft_vocab_size"] is not None, "SGLang would load the target's full LM head instead"
    params = layer_params(config, "model.midlayer")
    loaded: dict[str, set] = {}
    hot = None
    for name, tensor in weights.items():
        if "d2t" in name:
            hot = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        name, shard = stacked(name)
        place(params, loaded, name if name in params else f"model.{name}", shard, tensor)
    assert not unloaded(params, loaded), unloaded(params, loaded)
    assert hot is not None, "no d2t: SGLang would draft over target ids 0..Vd-1"
    return hot
