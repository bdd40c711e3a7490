"""Artifact factories the tests share: a tiny ModelInfo, stage data fitting each stage's schema, snapshots.

A plain module, as factories.py is; the `art` fixture built on them (an artifact with one
clusters stage) lives in conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from artifacts.schema import schema_of
from artifacts import ModelInfo, ModelSource, Stage, tensor_sha256, vocab_sha256

VERSION = "specvocab 0.1.0-test"


def make_model(seed: int = 0, name: str = "tiny") -> ModelInfo:
    """Return the ModelInfo of a tiny random model whose head depends on `seed`."""
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(32, 8, generator=gen)  # [V, d]
    vocab = {f"tok{i}": i for i in range(32)}
    return ModelInfo(
        name=name,
        source=ModelSource("hf-dir", path=f"/models/{name}"),
        architecture="llama",
        vocab_size=32,
        hidden_size=8,
        lm_head_sha256=tensor_sha256(head),
        vocab_sha256=vocab_sha256(vocab),
    )


PATTERN_EXAMPLES = {  # one tensor per name pattern of the stages that have them
    Stage.GP: {"weights.0.qkv": (8, 4), "weights.0.qkv.energy": (4,)},
    Stage.ROUTER: {"router.net.0.weight": (4, 16), "router.net.0.bias": (4,)},
}


def _size(dim: str) -> int:
    """A size for one symbolic dimension, for V=32, d=8 and every other symbol 4."""
    symbol, _, plus = dim.partition("+")
    base = int(symbol) if symbol.isdigit() else {"V": 32, "d": 8, "*": 3}.get(symbol, 4)
    return base + int(plus or 0)


def stage_data(stage: str, seed: int = 0, **params) -> tuple[dict[str, torch.Tensor], dict, dict[str, bytes]]:
    """Tensors, params and extra files that fit `stage`'s schema for make_model() (values random)."""
    schema = schema_of(stage)
    gen = torch.Generator().manual_seed(seed)
    shapes = {n: [_size(d) for d in spec.shape] for n, spec in schema.tensors.items()}
    shapes.update(PATTERN_EXAMPLES.get(stage, {}))
    dtypes = {n: spec.dtype for n, spec in schema.tensors.items()}
    tensors = {n: (torch.randn(shape, generator=gen) * 10).to(getattr(torch, dtypes.get(n, "float32")))
               for n, shape in shapes.items()}
    extra = {f: f"{f} {seed}".encode() for f in schema.files}
    return tensors, {**{k: 1 for k in schema.params}, **params}, extra


def cluster_tensors() -> dict[str, torch.Tensor]:
    """Valid clusters-stage tensors (several dtypes)."""
    return stage_data(Stage.CLUSTERS)[0]


CLUSTER_PARAMS = {**stage_data(Stage.CLUSTERS)[1], "k": 4, "metric": "cosine"}


def snapshot(path: Path) -> dict[str, bytes]:
    """Return every file under `path` (relative name -> bytes), to compare states."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
