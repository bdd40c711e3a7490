"""Artifact: open, create, read and atomically write the stages of an artifact directory."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from artifacts.errors import ChecksumMismatch, MissingStage, ModelMismatch, NotAnArtifact, StageExists
from artifacts.fingerprint import ModelInfo, same_model
from artifacts.format import MANIFEST_FILE, TMP_PREFIX, tensor_filename
from artifacts.manifest import (
    FileRecord,
    Manifest,
    StageRecord,
    check_plain_filename,
    file_problem,
    file_record,
    fsync_dir,
    fsync_file,
    read_manifest,
    utc_now,
    write_manifest,
)

_STAGE_NAME = re.compile(r"[a-z][a-z0-9_]*")


class Artifact:
    """An artifact directory: manifest.json plus one safetensors file per stage."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        """Wrap an already validated manifest; call `create` or `open` instead."""
        self.path = path
        self._manifest = manifest

    @classmethod
    def create(cls, path: Path | str, model: ModelInfo, created_by: str) -> Artifact:
        """Open the artifact at `path` for `model`, making the directory and manifest if absent."""
        path = Path(path)
        if (path / MANIFEST_FILE).exists():
            artifact = cls.open(path)
            artifact.check_model(model)
            return artifact
        if path.exists() and not path.is_dir():
            raise NotAnArtifact(path, "not a directory")
        path.mkdir(parents=True, exist_ok=True)
        manifest = Manifest(created_by=created_by, model=model)
        write_manifest(path, manifest)
        return cls(path, manifest)

    @classmethod
    def open(cls, path: Path | str) -> Artifact:
        """Open an existing artifact (NotAnArtifact, UnknownFormatVersion)."""
        path = Path(path)
        return cls(path, read_manifest(path))

    @property
    def manifest(self) -> Manifest:
        """The parsed manifest, as of the last open or write through this object."""
        return self._manifest

    @property
    def model(self) -> ModelInfo:
        """The model this artifact was built for."""
        return self._manifest.model

    @property
    def stages(self) -> list[str]:
        """Names of the stages present, sorted."""
        return sorted(self._manifest.stages)

    def has_stage(self, name: str) -> bool:
        """Return whether the stage is present."""
        return name in self._manifest.stages

    def stage_params(self, name: str) -> dict[str, Any]:
        """Return a copy of the parameters a stage was built with (MissingStage)."""
        return copy.deepcopy(self._stage(name).params)

    def check_model(self, model: ModelInfo) -> None:
        """Raise ModelMismatch unless `model` is the model this artifact was built for."""
        if not same_model(self.model, model):
            raise ModelMismatch(self.path, self.model, model)

    def write_stage(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        params: dict[str, Any],
        extra_files: dict[str, bytes] | None = None,
        force: bool = False,
    ) -> None:
        """Write `<name>.safetensors` plus extra files and record them, all or nothing.

        Files are written into a temporary directory inside the artifact, synced,
        renamed into place, and committed by rewriting the manifest. If any step
        fails, the previous files and manifest are restored.
        """
        extra_files = dict(extra_files or {})
        filenames = [tensor_filename(name), *extra_files]
        params = _json_params(params)
        # Re-read from disk so a stage written through another handle is kept.
        manifest = read_manifest(self.path)
        _check_new_stage(manifest, name, filenames)
        if name in manifest.stages and not force:
            raise StageExists(self.path, name)
        old = manifest.stages.get(name)
        old_names = set(old.files) if old else set()
        staging = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.path))
        try:
            files = _write_files(staging / "new", name, tensors, extra_files)
            manifest.stages[name] = StageRecord(params=params, created_at=utc_now(), files=files)
            _swap_in(self.path, staging, filenames, old_names, lambda: write_manifest(self.path, manifest))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._manifest = manifest

    def read_stage(self, name: str, verify: bool = True) -> dict[str, torch.Tensor]:
        """Load a stage's tensors on CPU, checking every file of the stage first.

        Raises MissingStage if the stage is absent, ChecksumMismatch if a file
        is missing, altered or unreadable.
        """
        self._stage(name)
        if verify:
            self._verify_stage(name)
        filename = tensor_filename(name)
        try:
            return safetensors.torch.load_file(self.path / filename, device="cpu")
        except (safetensors.SafetensorError, OSError) as e:
            problem = f"{filename} cannot be read ({e})"
            raise ChecksumMismatch(self.path, name, problem, self.model.name) from e

    def stage_file(self, name: str, filename: str) -> Path:
        """Return the path of one file of a stage, e.g. router.onnx, after checking it."""
        if filename not in self._stage(name).files:
            what = f"no file {filename!r} in stage {name!r}"
            raise MissingStage(self.path, name, self.model.name, what=what)
        problem = self.check_file(name, filename)
        if problem:
            raise ChecksumMismatch(self.path, name, problem, self.model.name)
        return self.path / filename

    def check_file(self, name: str, filename: str) -> str | None:
        """Return what is wrong with one recorded file of a stage, or None if it is intact."""
        return file_problem(self.path / filename, self._stage(name).files[filename])

    def verify(self) -> list[str]:
        """Return human-readable problems with the stage files (empty if all are intact)."""
        problems = [
            f"stage {name!r}: {problem}"
            for name in self.stages
            for filename in self._manifest.stages[name].files
            if (problem := self.check_file(name, filename))
        ]
        return problems + self.leftover_problems()

    def leftover_problems(self) -> list[str]:
        """Return one problem per temporary file or directory left by an interrupted write."""
        return [
            f"{entry.name} is left over from an interrupted write; delete it"
            for entry in sorted(self.path.iterdir())
            if entry.name.startswith(TMP_PREFIX)
        ]

    def _stage(self, name: str) -> StageRecord:
        """Return a stage's record, or raise MissingStage naming the prep command."""
        try:
            return self._manifest.stages[name]
        except KeyError:
            raise MissingStage(self.path, name, self.model.name) from None

    def _verify_stage(self, name: str) -> None:
        """Raise ChecksumMismatch for the first bad file of a stage."""
        for filename in self._stage(name).files:
            problem = self.check_file(name, filename)
            if problem:
                raise ChecksumMismatch(self.path, name, problem, self.model.name)


def _json_params(params: dict[str, Any]) -> dict[str, Any]:
    """Return params as they will read back from JSON; fail before anything is written."""
    if not isinstance(params, dict):
        raise TypeError(f"stage params must be a dict, got {type(params).__name__}")
    try:
        return json.loads(json.dumps(params, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"stage params must be plain JSON (no NaN, tensors or objects): {e}") from e


def _check_new_stage(manifest: Manifest, name: str, filenames: list[str]) -> None:
    """Raise ValueError for a bad stage name or a file name that is unsafe or taken."""
    if not _STAGE_NAME.fullmatch(name):
        raise ValueError(f"stage name {name!r} must be lower_snake_case")
    if len(set(filenames)) != len(filenames):
        raise ValueError(f"stage {name!r} lists a file twice: {filenames}")
    for filename in filenames:
        check_plain_filename(filename)
        for other, record in manifest.stages.items():
            if other != name and filename in record.files:
                raise ValueError(f"{filename!r} already belongs to stage {other!r}")


def _write_files(
    dest: Path, name: str, tensors: dict[str, torch.Tensor], extra_files: dict[str, bytes]
) -> dict[str, FileRecord]:
    """Write and fsync a stage's files into `dest`; return their records, tensors file first."""
    dest.mkdir()
    tensor_path = dest / tensor_filename(name)
    safetensors.torch.save_file(
        {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}, str(tensor_path)
    )
    fsync_file(tensor_path)
    for filename, data in extra_files.items():
        with open(dest / filename, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return {filename: file_record(dest / filename) for filename in [tensor_path.name, *extra_files]}


def _swap_in(
    art: Path, staging: Path, new_names: list[str], old_names: set[str], commit: Callable[[], None]
) -> None:
    """Move staged files into `art` and commit; on any failure, put the old files back."""
    backup = staging / "old"
    backup.mkdir()
    moved: list[str] = []
    placed: list[str] = []
    try:
        # Old files of the stage, and strays at the new names, go aside so they
        # can be restored; once committed they are deleted with the staging dir.
        for filename in sorted(old_names | set(new_names)):
            if (art / filename).exists():
                os.replace(art / filename, backup / filename)
                moved.append(filename)
        for filename in new_names:
            os.replace(staging / "new" / filename, art / filename)
            placed.append(filename)
        fsync_dir(art)
        commit()
    except BaseException:
        for filename in placed:
            (art / filename).unlink(missing_ok=True)
        for filename in moved:
            os.replace(backup / filename, art / filename)
        fsync_dir(art)
        raise
