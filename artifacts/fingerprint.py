"""Model identity: what an artifact was built for, and how to tell two models apart."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from artifacts.format import FingerprintKey, ModelKey, SourceKey

SOURCE_KINDS = ("packaged", "gguf", "hf-dir")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights came from: a packaged name, a user's .gguf file, or a model directory."""

    kind: str  # one of SOURCE_KINDS
    name: str = ""  # packaged: the registry name
    path: str = ""  # gguf / hf-dir: the absolute path the user gave
    gguf_sha256: str = ""  # packaged / gguf: sha256 of the .gguf file

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(f"source kind should be one of {', '.join(SOURCE_KINDS)}, got {self.kind!r}")

    @property
    def model_argument(self) -> str:
        """The model argument (`--model`) that loads this model again."""
        return self.name if self.kind == "packaged" else self.path

    def __str__(self) -> str:
        sha = f" (gguf sha256 {self.gguf_sha256[:16]}…)" if self.gguf_sha256 else ""
        return f"{self.kind} {self.model_argument}{sha}"

    def to_json(self) -> dict[str, str]:
        """Return the manifest's `source` object (empty fields left out)."""
        fields = {SourceKey.KIND: self.kind, SourceKey.NAME: self.name, SourceKey.PATH: self.path,
                  SourceKey.GGUF_SHA256: self.gguf_sha256}
        return {k: v for k, v in fields.items() if v}

    @classmethod
    def from_json(cls, d: Any) -> ModelSource:
        """Parse a `source` object, or the v1 string form (`packaged:N gguf-sha256:H`, `gguf:P sha256:H`,
        `hf-dir:P`); ValueError says what is wrong."""
        if isinstance(d, str):
            return _legacy_source(d)
        if not isinstance(d, dict):
            raise ValueError(f"field 'source' should be an object, got {d!r}")
        unknown = set(d) - set(SourceKey.ALL)
        if unknown or not all(isinstance(v, str) for v in d.values()):
            raise ValueError(f"field 'source' has unknown keys or non-string values: {d!r}")
        return cls(d.get(SourceKey.KIND, ""), d.get(SourceKey.NAME, ""), d.get(SourceKey.PATH, ""),
                   d.get(SourceKey.GGUF_SHA256, ""))


def _legacy_source(text: str) -> ModelSource:
    """Parse the one-string provenance of format v1 (and of model caches written before v2)."""
    kind, _, rest = text.partition(":")
    if kind == "packaged":
        name, _, sha = rest.partition(" gguf-sha256:")
        return ModelSource("packaged", name=name, gguf_sha256=sha)
    if kind == "gguf":
        path, _, sha = rest.rpartition(" sha256:")
        return ModelSource("gguf", path=path, gguf_sha256=sha)
    if kind == "hf-dir":
        return ModelSource("hf-dir", path=rest)
    # Hand-made v1 manifests held a bare path: treat it as a model directory.
    return ModelSource("hf-dir", path=text)


@dataclass(frozen=True)
class ModelInfo:
    """Provenance and fingerprint of the model an artifact belongs to."""

    name: str
    source: ModelSource
    architecture: str
    vocab_size: int
    hidden_size: int
    lm_head_sha256: str
    vocab_sha256: str

    @property
    def fingerprint_prefix(self) -> str:
        """Return a short, human-readable form of the fingerprint for messages."""
        return f"{self.lm_head_sha256[:12]}/{self.vocab_sha256[:12]}"

    def to_json(self) -> dict[str, Any]:
        """Return the manifest's `model` object."""
        return {
            ModelKey.NAME: self.name,
            ModelKey.SOURCE: self.source.to_json(),
            ModelKey.ARCHITECTURE: self.architecture,
            ModelKey.VOCAB_SIZE: self.vocab_size,
            ModelKey.HIDDEN_SIZE: self.hidden_size,
            ModelKey.FINGERPRINT: {
                FingerprintKey.LM_HEAD_SHA256: self.lm_head_sha256,
                FingerprintKey.VOCAB_SHA256: self.vocab_sha256,
            },
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelInfo:
        """Parse a manifest's `model` object; ValueError says which field is wrong."""
        fingerprint = _field(d, ModelKey.FINGERPRINT, dict)
        return cls(
            name=_field(d, ModelKey.NAME, str),
            source=ModelSource.from_json(d.get(ModelKey.SOURCE)),
            architecture=_field(d, ModelKey.ARCHITECTURE, str),
            vocab_size=_size(d, ModelKey.VOCAB_SIZE),
            hidden_size=_size(d, ModelKey.HIDDEN_SIZE),
            lm_head_sha256=_field(fingerprint, FingerprintKey.LM_HEAD_SHA256, str),
            vocab_sha256=_field(fingerprint, FingerprintKey.VOCAB_SHA256, str),
        )


def _size(d: Any, key: str) -> int:
    """Return d[key] if it is an integer >= 1 (a vocabulary or hidden size), else raise ValueError."""
    value = _field(d, key, int)
    if value < 1:
        raise ValueError(f"field {key!r} should be a size >= 1, got {value!r}")
    return value


def _field(d: Any, key: str, kind: type) -> Any:
    """Return d[key] if it exists and has type `kind`, else raise ValueError."""
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"missing field {key!r}")
    value = d[key]
    # bool is an int subclass, but `true` is never a valid size.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {key!r} should be {kind.__name__}, got {value!r}")
    return value


def tensor_sha256(t: torch.Tensor) -> str:
    """Return the sha256 of a tensor's dtype, shape and raw bytes (contiguous, on CPU).

    The same weights in another dtype hash differently, so hash the LM head in
    the dtype both prep and runtime load it in.
    """
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(json.dumps({"dtype": str(t.dtype), "shape": list(t.shape)}).encode())
    # Viewing as bytes works for every dtype, including bfloat16 that numpy lacks.
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def vocab_sha256(vocab: dict[str, int]) -> str:
    """Return the sha256 of the JSON of the vocabulary's sorted (token, id) pairs."""
    pairs = sorted(vocab.items())
    # ensure_ascii keeps the bytes well defined even for lone surrogates in tokens.
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=True).encode("ascii")).hexdigest()


def same_model(a: ModelInfo, b: ModelInfo) -> bool:
    """Return whether two models share weights and tokenizer (names may differ)."""
    return (
        a.lm_head_sha256 == b.lm_head_sha256
        and a.vocab_sha256 == b.vocab_sha256
        and a.vocab_size == b.vocab_size
        and a.hidden_size == b.hidden_size
    )
