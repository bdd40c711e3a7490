"""Constants of the on-disk artifact format (v2), declared once for prep and runtime.

An artifact is a directory holding `manifest.json` plus one `<stage>.safetensors`
file per stage and, for some stages, extra files such as `router.onnx`.
"""

FORMAT_VERSION = 2
# v1 differs only in the model's `source`, one string there; it is read and upgraded on the next write.
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
TENSOR_SUFFIX = ".safetensors"
# Temporary files and directories inside an artifact start with this prefix, so
# a leftover from an interrupted write is recognisable and never a stage file.
TMP_PREFIX = ".tmp-"


class ManifestKey:
    """Top-level keys of manifest.json."""

    FORMAT_VERSION = "format_version"
    CREATED_BY = "created_by"
    MODEL = "model"
    STAGES = "stages"


class ModelKey:
    """Keys of the manifest's `model` object."""

    NAME = "name"
    SOURCE = "source"
    ARCHITECTURE = "architecture"
    VOCAB_SIZE = "vocab_size"
    HIDDEN_SIZE = "hidden_size"
    FINGERPRINT = "fingerprint"


class SourceKey:
    """Keys of the model's `source` object (format v2; v1 held one string)."""

    KIND = "kind"
    NAME = "name"
    PATH = "path"
    GGUF_SHA256 = "gguf_sha256"
    ALL = (KIND, NAME, PATH, GGUF_SHA256)


class FingerprintKey:
    """Keys of the model's `fingerprint` object."""

    LM_HEAD_SHA256 = "lm_head_sha256"
    VOCAB_SHA256 = "vocab_sha256"


class StageKey:
    """Keys of one entry of the manifest's `stages` object."""

    PARAMS = "params"
    CREATED_AT = "created_at"
    FILES = "files"


class FileKey:
    """Keys of one entry of a stage's `files` object."""

    SHA256 = "sha256"
    SIZE = "size"


class Stage:
    """Names of the stages prep writes; each is stored as `<name>.safetensors`."""

    CLUSTERS = "clusters"
    SCREEN = "screen"
    SCREEN4 = "screen4"
    ROUTER = "router"
    GP = "gp"
    ONEDECODE = "onedecode"
    DRAFTER = "drafter"
    DRAFTER_ROUTER = "drafter_router"


def tensor_filename(stage: str) -> str:
    """Return the name of the safetensors file that holds a stage's tensors."""
    return f"{stage}{TENSOR_SUFFIX}"
