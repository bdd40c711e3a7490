"""manifest.json: typed records, parsing with validation, and atomic writes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from artifacts.atomic import atomic_write_json
from artifacts.errors import NotAnArtifact, UnknownFormatVersion
from artifacts.fingerprint import ModelInfo
from artifacts.format import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    READABLE_VERSIONS,
    TMP_PREFIX,
    FileKey,
    ManifestKey,
    StageKey,
)

_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileRecord:
    """Checksum and byte size of one file of a stage."""

    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        """Return the manifest form of this record."""
        return {FileKey.SHA256: self.sha256, FileKey.SIZE: self.size}

    @classmethod
    def from_json(cls, d: Any) -> FileRecord:
        """Parse one `files` entry; ValueError says what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"file entry should be an object, got {d!r}")
        sha, size = d.get(FileKey.SHA256), d.get(FileKey.SIZE)
        if not isinstance(sha, str) or type(size) is not int or size < 0:
            raise ValueError(f"file entry needs a sha256 string and a byte size, got {d!r}")
        return cls(sha256=sha, size=size)


@dataclass
class StageRecord:
    """Parameters, creation time and files of one stage."""

    params: dict[str, Any]
    created_at: str
    files: dict[str, FileRecord]

    def to_json(self) -> dict[str, Any]:
        """Return the manifest form of this record."""
        return {
            StageKey.PARAMS: self.params,
            StageKey.CREATED_AT: self.created_at,
            StageKey.FILES: {name: rec.to_json() for name, rec in self.files.items()},
        }

    @classmethod
    def from_json(cls, d: Any) -> StageRecord:
        """Parse one `stages` entry; ValueError says what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"stage entry should be an object, got {d!r}")
        params = d.get(StageKey.PARAMS)
        created_at = d.get(StageKey.CREATED_AT)
        files = d.get(StageKey.FILES)
        if not isinstance(params, dict) or not isinstance(created_at, str) or not isinstance(files, dict):
            raise ValueError("stage entry needs params (object), created_at (string) and files (object)")
        for name in files:
            check_plain_filename(name)
        return cls(params, created_at, {name: FileRecord.from_json(rec) for name, rec in files.items()})


@dataclass
class Manifest:
    """The parsed content of manifest.json."""

    created_by: str
    model: ModelInfo
    stages: dict[str, StageRecord] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        """Return the JSON object written to manifest.json."""
        return {
            ManifestKey.FORMAT_VERSION: self.format_version,
            ManifestKey.CREATED_BY: self.created_by,
            ManifestKey.MODEL: self.model.to_json(),
            ManifestKey.STAGES: {name: rec.to_json() for name, rec in self.stages.items()},
        }

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Parse a format-v1 manifest object; ValueError says what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"manifest should be an object, got {type(d).__name__}")
        created_by = d.get(ManifestKey.CREATED_BY)
        model = d.get(ManifestKey.MODEL)
        stages = d.get(ManifestKey.STAGES)
        if not isinstance(created_by, str) or not isinstance(stages, dict):
            raise ValueError("manifest needs created_by (string) and stages (object)")
        return cls(
            created_by=created_by,
            model=ModelInfo.from_json(model),
            stages={name: StageRecord.from_json(rec) for name, rec in stages.items()},
        )


def check_plain_filename(name: str) -> None:
    """Raise ValueError unless `name` is a plain file name inside the artifact dir."""
    # Manifest file names are joined to the artifact path and may be replaced on
    # --force, so a name like "../x" must never get that far.
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise ValueError(f"{name!r} is not a plain file name")
    if name == MANIFEST_FILE or name.startswith(TMP_PREFIX):
        raise ValueError(f"{name!r} is reserved")


def utc_now() -> str:
    """Return the current time as ISO-8601 UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def file_record(path: Path) -> FileRecord:
    """Hash a file from disk and return its checksum and size."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return FileRecord(sha256=h.hexdigest(), size=size)


def file_problem(path: Path, expected: FileRecord) -> str | None:
    """Return what is wrong with a file compared with its record, or None if it matches."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        size = path.stat().st_size
        # Size first: it is free and catches truncation without reading the file.
        if size != expected.size:
            return f"{path.name} has {size} bytes, expected {expected.size}"
        if file_record(path).sha256 != expected.sha256:
            return f"{path.name} fails its sha256 checksum"
    except OSError as e:
        return f"{path.name} cannot be read ({e.strerror or e})"
    return None


def read_manifest(path: Path) -> Manifest:
    """Read and validate `<path>/manifest.json` (NotAnArtifact, UnknownFormatVersion)."""
    if not path.exists():
        raise NotAnArtifact(path, "no such directory")
    if not path.is_dir():
        raise NotAnArtifact(path, "not a directory")
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        raise NotAnArtifact(path, f"no {MANIFEST_FILE}")
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotAnArtifact(path, f"{MANIFEST_FILE} is not valid JSON: {e}", damaged=True) from e
    if not isinstance(data, dict) or ManifestKey.FORMAT_VERSION not in data:
        raise NotAnArtifact(path, f"{MANIFEST_FILE} has no {ManifestKey.FORMAT_VERSION}", damaged=True)
    version = data[ManifestKey.FORMAT_VERSION]
    if type(version) is not int:  # no version of specvocab writes one that is not an integer
        raise NotAnArtifact(path, f"{MANIFEST_FILE} has format_version {version!r}, not an integer", damaged=True)
    # Checked before anything else: another version may lay out the rest differently.
    if version not in READABLE_VERSIONS:
        raise UnknownFormatVersion(path, version)
    try:
        return Manifest.from_json(data)
    except ValueError as e:
        raise NotAnArtifact(path, f"{MANIFEST_FILE} is malformed: {e}", damaged=True) from e


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Replace `<path>/manifest.json` atomically: temp file, fsync, rename, fsync dir."""
    atomic_write_json(path / MANIFEST_FILE, manifest.to_json())


def read_verified(path: Path, expected: FileRecord) -> tuple[bytes | None, str | None]:
    """Read a file once and check those very bytes against its record: (bytes, None) or (None, problem)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"{path.name} is missing"
    except OSError as e:
        return None, f"{path.name} cannot be read ({e.strerror or e})"
    if len(data) != expected.size:
        return None, f"{path.name} has {len(data)} bytes, expected {expected.size}"
    if hashlib.sha256(data).hexdigest() != expected.sha256:
        return None, f"{path.name} fails its sha256 checksum"
    return data, None
