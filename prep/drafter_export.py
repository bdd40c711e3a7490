"""`prep export-drafter`: stage `drafter` as the EAGLE-3 checkpoint folder vLLM, SGLang and llama.cpp's converter load.

The folder holds `config.json` (a one-layer `LlamaForCausalLMEagle3`: the head's shape, its draft
vocabulary, and the target layers whose inputs it reads, as vLLM's `eagle_config`) and
`model.safetensors` (the head's weights in bfloat16 under the checkpoint names the stage already
uses, with `d2t` / `t2d`; `embed_tokens` is left out, so loaders take the target's table, as the
head was trained on it). The folder is written beside its place and renamed into it whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from artifacts.atomic import fsync_dir, tmp_name
from artifacts.writing import save_tensors, share_files
from artifacts.format import Stage
from runtime.drafters.eagle import CHECKPOINT_NAMES
from runtime.drafters.eagle_head import NORM_EPS, EagleConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def checkpoint_config(config: EagleConfig, max_positions: int) -> dict:
    """config.json of the head: a LlamaConfig with the EAGLE-3 fields the loaders read."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": NORM_EPS,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": max_positions,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(config.feature_layers)},
        # llama.cpp's converter reads the layer ids at the top level (vLLM and SGLang: under eagle_config);
        # without them it assumes (2, N/2, N-3), wrong for a head trained on other layers.
        "eagle_aux_hidden_state_layer_ids": list(config.feature_layers),
    }


def export_drafter(artifact, out: str | Path, force: bool = False) -> Path:
    """Write the artifact's stage drafter as a checkpoint folder at `out` (refused if it exists, unless `force`)."""
    out = Path(out)
    if out.exists() and not force:
        raise ValueError(f"{out} exists; choose another -o, or pass --force to replace it")
    params = artifact.stage_params(Stage.DRAFTER)
    config = EagleConfig.from_params(params)
    tensors = artifact.read_stage(Stage.DRAFTER)
    weights = {name: tensors[name].to(torch.bfloat16) if tensors[name].is_floating_point() else tensors[name]
               for name in CHECKPOINT_NAMES.values()}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / tmp_name(out.name)
    staging.mkdir()
    try:
        save_tensors(weights, staging / WEIGHTS_FILE, metadata={"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(checkpoint_config(config, params["max_positions"]), indent=2) + "\n")
        share_files(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(out.parent)
    return out
