"""Prep stages end to end: check the output first, load the model once, build each missing stage.

`output_artifact` is the one helper for an output directory: it refuses an unusable `-o` in one
line before any work (a file, an unwritable place, a non-artifact folder holding stage files, a
directory another prep run is writing), and holds the artifact's writer lock for the whole
command. `plan` makes a rerun of an interrupted command finish what is missing: a stage already
built with the requested parameters is kept, one built with others needs --force.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from artifacts import Artifact, ArtifactError, ArtifactLocked, StageExists
from artifacts.format import MANIFEST_FILE, Stage
from artifacts.manifest import read_manifest
from artifacts.writing import check_output_dir
from prep.cluster import build_clusters
from prep.folders import locked_folder
from prep.trace_files import INDEX_FILE as TRACES_INDEX
from prep.screen import build_screen
from prep.screen4 import build_screen4, calibration_hidden
from runtime.backends.hf import TransformersTarget
from runtime.models import LoadedModel, load_model


def created_by() -> str:
    """This package's name and version, recorded in every manifest."""
    try:
        return f"specvocab {version('specvocab')}"
    except PackageNotFoundError:
        return "specvocab (source tree)"


@contextmanager
def output_artifact(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Check and lock the output directory before any work; remove what it made if no stage gets built.

    If no stage was built when the command ends (it failed, was interrupted, or refused a value once the
    model was known), the manifest it wrote is removed, and the folders it made (the leaf and any missing
    parents) while they are empty.
    """
    path = Path(out)
    had_manifest = (path / MANIFEST_FILE).exists()
    if not had_manifest and (path / TRACES_INDEX).is_file():  # even with --force: traces would be lost among stages
        raise ArtifactError(f"{path} holds traces ({TRACES_INDEX}); an artifact goes in a folder of its own: choose another -o")
    try:
        check_output_dir(path, force)
    except OSError as e:  # an unreadable folder
        raise ArtifactError(f"cannot read {path} ({e.strerror or e}); choose a readable -o") from None
    with locked_folder(path, "-o", lambda pid: ArtifactLocked(path, pid)):
        try:
            yield path
        finally:
            if not had_manifest:
                _remove_unbuilt_manifest(path)


def _remove_unbuilt_manifest(path: Path) -> None:
    """Remove the manifest this command wrote in `path` if it records no stage."""
    try:
        if (path / MANIFEST_FILE).exists() and not read_manifest(path).stages:
            (path / MANIFEST_FILE).unlink()
    except (ArtifactError, OSError):
        return  # something else is there: leave it


@contextmanager
def adding_stage(artifact: str | Path, stage: str, force: bool) -> Iterator[Artifact]:
    """Open an existing artifact to add `stage` to: refuse an existing stage (without --force) or
    another live writer before any work, and hold the writer lock meanwhile."""
    art = Artifact.open(artifact)
    if art.has_stage(stage) and not force:
        raise StageExists(art.path, stage)
    with output_artifact(art.path, force):
        yield art


def existing(out: str | Path, model_spec: str) -> Artifact | None:
    """The artifact at `out` if there is one, checked against the model's fingerprint without loading its
    weights (so a rerun with nothing missing skips the model load, and another model is still refused)."""
    if not (Path(out) / MANIFEST_FILE).is_file():
        return None
    artifact = Artifact.open(out)
    artifact.check_model(load_model(model_spec, weights=False).info)
    return artifact


def plan(artifact: Artifact | None, requested: dict[str, dict[str, Any]], force: bool) -> list[str]:
    """The stages to build: missing ones, or all with --force; a stage built with other parameters is refused."""
    todo = []
    for stage, params in requested.items():
        if artifact is None or force or not artifact.has_stage(stage):
            todo.append(stage)
            continue
        built = artifact.stage_params(stage)
        differ = {k: (built.get(k), v) for k, v in params.items() if built.get(k) != v}
        if differ:
            what = ", ".join(f"{k}={old!r} (asked {new!r})" for k, (old, new) in differ.items())
            raise ArtifactError(f"artifact {artifact.path} already has a {stage!r} stage built with {what}; "
                                "pass --force to rebuild it")
        print(f"{stage}: already built with these parameters, kept (pass --force to rebuild)", file=sys.stderr)
    return todo


def cluster_request(clusters: int, iterations: int, top_m: int, seed: int) -> dict[str, Any]:
    """The `clusters` params that identify a build (compared with a built stage's on a rerun)."""
    return {"clusters_requested": clusters, "iterations": iterations, "top_m_bias": top_m, "seed": seed}


def screen_request(group_size: int | None) -> dict[str, Any]:
    """The `screen` params that identify a build: None (auto) accepts whichever layout was measured."""
    if group_size is None:
        return {}
    return {"per_row": True} if group_size == 0 else {"per_row": False, "group_size": group_size}


def screen4_request(rank: int, group: int) -> dict[str, Any]:
    """The `screen4` params that identify a build."""
    return {"rank": rank, "group_size": group}


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


def open_for_writing(model_spec: str, out: str | Path, force: bool = False) -> HeadSource:
    """Load the model and create/open the artifact at `out` (call inside output_artifact)."""
    loaded = load_model(model_spec)
    return HeadSource(loaded, Artifact.create(out, loaded.info, created_by(), force=force))


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


def write_screen4(source: HeadSource, rank: int, group: int, texts: int, force: bool) -> dict:
    """Build and write stage `screen4` (4-bit screen, low-rank correction from calibration hidden states)."""
    target = TransformersTarget(source.model.model, frozenset())
    hidden = calibration_hidden(target, source.model.tokenizer, texts=texts, progress=True)  # [N, d]
    tensors, params = build_screen4(source.weight, hidden, rank, group, progress=True)
    source.artifact.write_stage(Stage.SCREEN4, tensors, params, force=force)
    print(f"screen4: 4-bit in groups of {group}, rank {rank} from {params['calibration_positions']} hidden states, "
          f"mean relative error {params['mean_relative_error']:.4g}", file=sys.stderr)
    return params
