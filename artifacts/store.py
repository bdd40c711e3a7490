"""Artifact: open, create, read and atomically write the stages of an artifact directory."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from artifacts.atomic import WriterLock, pause_point, is_dead_leftover, remove_dead_leftovers, tmp_name
from artifacts.errors import ArtifactLocked, ChecksumMismatch, MissingStage, ModelMismatch, SchemaMismatch, StageExists
from artifacts.fingerprint import ModelInfo, same_model
from artifacts.format import MANIFEST_FILE, tensor_filename
from artifacts.manifest import (
    Manifest,
    StageRecord,
    file_problem,
    read_manifest,
    read_verified,
    utc_now,
    write_manifest,
)
from artifacts.schema import schema_of
from artifacts.writing import check_new_stage, json_params, swap_in, write_files, check_output_dir

READ_RETRIES = 8  # a reader that sees a file newer than its manifest waits up to ~2.5 s for the writer


class Artifact:
    """An artifact directory: manifest.json plus one safetensors file per stage."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        """Wrap an already validated manifest; call `create` or `open` instead."""
        self.path = path
        self._manifest = manifest

    @classmethod
    def create(cls, path: Path | str, model: ModelInfo, created_by: str, force: bool = False) -> Artifact:
        """Open the artifact at `path` for `model`, making the directory and manifest if absent.

        A directory that is not an artifact but holds files with stage names is refused unless
        `force`: they are someone else's, and writing a stage would replace them.
        """
        path = Path(path)
        if (path / MANIFEST_FILE).exists():
            artifact = cls.open(path)
            artifact.check_model(model)
            return artifact
        check_output_dir(path, force)
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

    def tensors_sha256(self, name: str) -> str:
        """Return the recorded sha256 of a stage's tensor file: what a stage built on it names it by."""
        return self._stage(name).files[tensor_filename(name)].sha256

    def check_model(self, model: ModelInfo) -> None:
        """Raise ModelMismatch unless `model` is the model this artifact was built for."""
        if not same_model(self.model, model):
            raise ModelMismatch(self.path, self.model, model)

    @contextmanager
    def writing(self) -> Iterator[Artifact]:
        """Hold the artifact's writer lock for a whole prep command; refuse at once if another writer has it.

        Taking the lock also deletes the temporaries left by dead writers (killed prep runs).
        """
        lock = WriterLock(self.path)
        if lock.holder() == os.getpid():  # already held by this process: reentrant
            yield self
            return
        holder = lock.acquire()
        if holder is not None:
            raise ArtifactLocked(self.path, holder)
        try:
            remove_dead_leftovers(self.path)
            self._manifest = read_manifest(self.path)
            yield self
        finally:
            lock.release()

    def write_stage(
        self,
        name: str,
        tensors: dict[str, torch.Tensor],
        params: dict[str, Any],
        extra_files: dict[str, bytes] | None = None,
        force: bool = False,
    ) -> None:
        """Write `<name>.safetensors` plus extra files and record them, all or nothing.

        The tensors and params are checked against the stage's schema first. Files are written into
        a temporary directory inside the artifact, synced, renamed into place, and committed by
        rewriting the manifest. If any step fails, the previous files and manifest are restored.
        """
        extra_files = dict(extra_files or {})
        schema = schema_of(name)
        params = json_params(params)
        problem = schema.problem(tensors, params, self.model.vocab_size, self.model.hidden_size)
        if problem is None and set(extra_files) != set(schema.files):
            problem = f"has files {sorted(extra_files)}, expected {sorted(schema.files)}"
        if problem is not None:
            raise ValueError(f"stage {name!r} {problem}")
        filenames = [tensor_filename(name), *extra_files]
        with self.writing():
            # Re-read from disk so a stage written through another handle is kept.
            manifest = read_manifest(self.path)
            check_new_stage(manifest, name, filenames)
            if name in manifest.stages and not force:
                raise StageExists(self.path, name)
            old = manifest.stages.get(name)
            old_names = set(old.files) if old else set()
            staging = Path(tempfile.mkdtemp(prefix=tmp_name(name) + "-", dir=self.path))
            try:
                files = write_files(staging / "new", name, tensors, extra_files)
                pause_point(f"stage-staged:{name}")  # files written in the temporary dir, nothing replaced yet
                manifest.stages[name] = StageRecord(params=params, created_at=utc_now(), files=files)
                swap_in(self.path, staging, filenames, old_names, lambda: write_manifest(self.path, manifest))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            self._manifest = manifest

    def read_stage(self, name: str) -> dict[str, torch.Tensor]:
        """Load a stage's tensors on CPU from bytes that passed their checksum, checked against the schema.

        Raises MissingStage if the stage is absent, ChecksumMismatch if a file of the stage is
        missing, altered or unreadable, SchemaMismatch if its contents do not fit the stage.
        """
        filename = tensor_filename(name)
        data = self._verified_bytes(name, filename)
        try:
            tensors = safetensors.torch.load(data)
        except (safetensors.SafetensorError, ValueError) as e:
            raise ChecksumMismatch(self.path, name, f"{filename} cannot be read ({e})", self.model.name) from e
        params = self._stage(name).params
        problem = schema_of(name).problem(tensors, params, self.model.vocab_size, self.model.hidden_size)
        if problem is not None:
            raise SchemaMismatch(self.path, name, f"{filename} {problem}", self.model.name)
        return tensors

    def stage_file(self, name: str, filename: str) -> Path:
        """Return the path of one file of a stage, e.g. router.onnx, after checking it."""
        if filename not in self._stage(name).files:
            what = f"no file {filename!r} in stage {name!r}"
            raise MissingStage(self.path, name, self.model.name, what=what)
        self._verified_bytes(name, filename)
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
        """Return one problem per leftover of a dead writer that could not be deleted (a read-only artifact).

        A live writer's temporaries are its work in progress, and a dead writer's are deleted here
        (or by the next writer), so neither makes the artifact invalid.
        """
        if WriterLock(self.path).holder() is None:
            try:
                remove_dead_leftovers(self.path)
            except OSError:
                pass
        return [
            f"{entry.name} is left over from an interrupted write; delete it"
            for entry in sorted(self.path.iterdir())
            if is_dead_leftover(entry.name)
        ]

    def _stage(self, name: str) -> StageRecord:
        """Return a stage's record, or raise MissingStage naming the prep command."""
        try:
            return self._manifest.stages[name]
        except KeyError:
            raise MissingStage(self.path, name, self.model.name) from None

    def _verified_bytes(self, name: str, filename: str) -> bytes:
        """Return the bytes of one file of a stage, after checking every file of the stage.

        A writer replaces files first and the manifest last, so a reader may see a file newer than
        its manifest: it then re-reads the manifest, and waits while a live writer holds the lock,
        before calling a mismatch corruption. The bytes returned are the bytes that were hashed.
        """
        for attempt in range(READ_RETRIES):
            record = self._stage(name)
            if filename not in record.files:
                problem = f"the manifest records no checksum for {filename}"
                raise ChecksumMismatch(self.path, name, problem, self.model.name)
            data, problem = read_verified(self.path / filename, record.files[filename])
            for other in record.files:
                if problem is None and other != filename:
                    problem = self.check_file(name, other)
            if problem is None:
                return data  # type: ignore[return-value]
            fresh = read_manifest(self.path)
            changed = fresh.stages.get(name) != record
            self._manifest = fresh
            if not changed and WriterLock(self.path).holder() is None:
                break
            if not changed:
                time.sleep(min(0.02 * 2**attempt, 1.0))
        raise ChecksumMismatch(self.path, name, problem, self.model.name)
