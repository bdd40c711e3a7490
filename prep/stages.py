"""Prep stages end to end: load the model once, build each stage, write it into the artifact."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from artifacts import Artifact, StageExists
from artifacts.format import Stage
from prep.cluster import build_clusters
from prep.screen import build_screen
from runtime.models import LoadedModel, load_model


def created_by() -> str:
    """This package's name and version, recorded in every manifest."""
    try:
        return f"specvocab {version('specvocab')}"
    except PackageNotFoundError:
        return "specvocab (source tree)"


@dataclass
class HeadSource:
    """The LM head of a loaded model, and the artifact to write into."""

    model: LoadedModel
    artifact: Artifact

    @property
    def weight(self) -> torch.Tensor:
        return self.model.model.get_output_embeddings().weight.detach().float()  # [V, d]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.model.model.get_output_embeddings(), "bias", None)
        return None if bias is None else bias.detach().float()


def open_for_writing(model_spec: str, out: str, stages: list[str], force: bool) -> HeadSource:
    """Load the model and create/open the artifact; refuse existing stages before any long work."""
    loaded = load_model(model_spec)
    artifact = Artifact.create(out, loaded.info, created_by())
    for stage in stages:
        if artifact.has_stage(stage) and not force:
            raise StageExists(artifact.path, stage)
    return HeadSource(loaded, artifact)


def write_clusters(source: HeadSource, clusters: int, iterations: int, top_m: int, seed: int, force: bool) -> dict:
    """Build and write stage `clusters`; returns its params."""
    tensors, params = build_clusters(source.weight, source.bias, clusters, iterations, top_m, seed)
    source.artifact.write_stage(Stage.CLUSTERS, tensors, params, force=force)
    return params


def write_screen(source: HeadSource, group_size: int | None, force: bool) -> dict:
    """Build and write stage `screen`; group_size None = measure per-row vs grouped and choose."""
    tensors, params = build_screen(source.weight, group_size)
    source.artifact.write_stage(Stage.SCREEN, tensors, params, force=force)
    print(f"screen: int8, group size {params['group_size']}, mean error norm {params['mean_error_norm']:.4g}", file=sys.stderr)
    return params
