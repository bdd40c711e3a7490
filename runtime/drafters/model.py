"""Another model as the drafter: a smaller causal LM with the target's tokenizer, its own KV cache and head.

No two packaged models share a tokenizer (gemma3-270m, qwen2.5-coder-0.5b-instruct and
smollm2-135m-instruct each have their own), so `model:` takes a local Hugging Face directory or
.gguf of the target's family (e.g. a smaller Qwen2.5 for a larger one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artifacts.fingerprint import ModelInfo
from runtime.drafters.layers import BackendDrafter
from runtime.drafters.registry import DraftContext
from runtime.heads import FullHead


def head_in_target_space(weight: torch.Tensor, bias: torch.Tensor | None, vocab_size: int) -> FullHead:
    """The drafter model's LM head with exactly the target's `vocab_size` rows.

    Models of one family pad their heads differently past the tokenizer (Qwen2.5: 151936 rows for
    0.5B, 152064 for 7B): extra rows are dropped, missing ones get bias -inf so they are never drafted.
    """
    rows = weight.shape[0]
    if rows >= vocab_size:
        return FullHead(weight[:vocab_size], None if bias is None else bias[:vocab_size])
    weight = torch.cat([weight, weight.new_zeros(vocab_size - rows, weight.shape[1])])  # [V, d]
    bias = weight.new_zeros(rows) if bias is None else bias
    return FullHead(weight, torch.cat([bias, bias.new_full((vocab_size - rows,), float("-inf"))]))


def check_same_tokenizer(drafter: ModelInfo, target: ModelInfo) -> None:
    """ValueError unless the two models' tokenizer vocabularies (token -> id maps) are identical."""
    if drafter.vocab_sha256 != target.vocab_sha256:
        raise ValueError(
            f"drafter {drafter.name} has another tokenizer than the target {target.name} (vocabulary fingerprints "
            f"{drafter.vocab_sha256[:12]} and {target.vocab_sha256[:12]}); model:NAME needs a model with the target's "
            "tokenizer, e.g. a smaller model of the same family as a Hugging Face directory or .gguf "
            "(no two packaged models share a tokenizer)"
        )


class ModelDrafter(BackendDrafter):
    """Drafts with a separate causal LM: its backend, its KV cache and its full head (see BackendDrafter).

    backend: the drafter model on the lean backend (transformers' for other architectures), whose
    fp32 head can be cut or padded to the target's rows.
    """

    def __init__(self, backend, vocab_size: int) -> None:
        super().__init__(backend, head_in_target_space(backend.head_weight, backend.head_bias, vocab_size))


def load_model_drafter(spec: str, target: ModelInfo, vocab_size: int, progress: bool = True) -> ModelDrafter:
    """Load the model `spec` (a packaged name, HF directory or .gguf) and draft with it for a target
    whose model is `target` and whose head has `vocab_size` rows; refuses another tokenizer."""
    from runtime.backends import SUPPORTED_TYPES, make_target
    from runtime.models import load_model

    if not spec:
        raise ValueError("model: needs a model, e.g. model:path/to/smaller-model or model:file.gguf")
    loaded = load_model(spec, progress=progress)
    check_same_tokenizer(loaded.info, target)
    kind = "lean" if loaded.config.model_type in SUPPORTED_TYPES else "transformers"
    return ModelDrafter(make_target(kind, config=loaded.config, eos_token_ids=set(), model=loaded.model), vocab_size)


@dataclass(frozen=True)
class ModelOptions:
    """model:NAME|PATH: a packaged name, a Hugging Face directory or a .gguf file (':' may appear in a path)."""

    path: str

    @classmethod
    def parse(cls, args: list[str]) -> ModelOptions:
        path = ":".join(args)
        if not path:
            raise ValueError("model: needs a model, e.g. model:path/to/smaller-model or model:file.gguf")
        return cls(path)

    def format(self) -> tuple[str, ...]:
        return (self.path,)

    def build(self, context: DraftContext) -> ModelDrafter:
        if context.target_info is None:
            raise ValueError("model:NAME|PATH needs the target's ModelInfo to check the drafter's tokenizer")
        return load_model_drafter(self.path, context.target_info, context.target.vocab_size)
