"""The on-disk contract between prep and runtime: versioned artifact directories.

This package depends only on torch and safetensors, never on runtime or prep.
"""

from artifacts.errors import (
    ArtifactError,
    ArtifactLocked,
    ChecksumMismatch,
    MissingStage,
    ModelMismatch,
    NotAnArtifact,
    SchemaMismatch,
    StageExists,
    UnknownFormatVersion,
)
from artifacts.fingerprint import ModelInfo, ModelSource, same_model, tensor_sha256, vocab_sha256
from artifacts.format import FORMAT_VERSION, MANIFEST_FILE, ManifestKey, Stage
from artifacts.store import Artifact

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "Artifact",
    "ArtifactError",
    "ArtifactLocked",
    "ChecksumMismatch",
    "ManifestKey",
    "MissingStage",
    "ModelInfo",
    "ModelMismatch",
    "ModelSource",
    "NotAnArtifact",
    "SchemaMismatch",
    "Stage",
    "StageExists",
    "UnknownFormatVersion",
    "same_model",
    "tensor_sha256",
    "vocab_sha256",
]
