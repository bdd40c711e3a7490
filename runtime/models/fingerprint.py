"""The ModelInfo fields a model's own files determine: its architecture, head shape and the hashes of its head and vocabulary."""

from __future__ import annotations

from typing import Any

import torch

from artifacts.fingerprint import tensor_sha256, vocab_sha256

INFO_FIELDS = ("architecture", "vocab_size", "hidden_size", "lm_head_sha256", "vocab_sha256")


def fingerprint_fields(architecture: str, head: torch.Tensor, tokenizer: Any) -> dict[str, Any]:
    """The ModelInfo fields a model's files determine; vocab_size is the LM head's row count."""
    head = head.detach().float()  # [V, d], hashed in the dtype prep and runtime load it in
    return {
        "architecture": architecture,
        "vocab_size": head.shape[0],
        "hidden_size": head.shape[1],
        "lm_head_sha256": tensor_sha256(head),
        "vocab_sha256": vocab_sha256(tokenizer.get_vocab()),
    }
