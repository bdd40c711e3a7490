"""The write side of an artifact: output-directory checks, staged files, and the all-or-nothing swap."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from artifacts.atomic import current_umask, fsync_dir, fsync_file, pause_point
from artifacts.errors import ArtifactError, NotAnArtifact
from artifacts.format import MANIFEST_FILE, tensor_filename
from artifacts.manifest import FileRecord, Manifest, check_plain_filename, file_record
from artifacts.schema import SCHEMAS

STAGE_NAME = re.compile(r"[a-z][a-z0-9_]*")
# How safetensors reports a failed write (a full disk, a read-only place): the OS error number is in its message.
SAFETENSORS_IO_ERROR = re.compile(r"I/O error: .*\(os error (\d+)\)")


def check_output_dir(path: Path, force: bool = False) -> None:
    """Refuse an output path that is a file, or a non-artifact directory holding stage-named files."""
    if path.exists() and not path.is_dir():
        raise NotAnArtifact(path, "not a directory")
    if (path / MANIFEST_FILE).exists() or not path.is_dir() or force:
        return
    names = {tensor_filename(s.name) for s in SCHEMAS.values()} | {f for s in SCHEMAS.values() for f in s.files}
    taken = sorted(p.name for p in path.iterdir() if p.name in names)
    if taken:
        raise ArtifactError(f"{path} is not a specvocab artifact but holds {', '.join(taken)}; "
                            "choose another -o, or pass --force to replace those files")


def json_params(params: dict[str, Any]) -> dict[str, Any]:
    """Return params as they will read back from JSON; fail before anything is written."""
    if not isinstance(params, dict):
        raise TypeError(f"stage params must be a dict, got {type(params).__name__}")
    try:
        return json.loads(json.dumps(params, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(f"stage params must be plain JSON (no NaN, tensors or objects): {e}") from e


def check_new_stage(manifest: Manifest, name: str, filenames: list[str]) -> None:
    """Raise ValueError for a bad stage name or a file name that is unsafe or taken."""
    if not STAGE_NAME.fullmatch(name):
        raise ValueError(f"stage name {name!r} must be lower_snake_case")
    if len(set(filenames)) != len(filenames):
        raise ValueError(f"stage {name!r} lists a file twice: {filenames}")
    for filename in filenames:
        check_plain_filename(filename)
        for other, record in manifest.stages.items():
            if other != name and filename in record.files:
                raise ValueError(f"{filename!r} already belongs to stage {other!r}")


def write_files(
    dest: Path, name: str, tensors: dict[str, torch.Tensor], extra_files: dict[str, bytes]
) -> dict[str, FileRecord]:
    """Write and fsync a stage's files into `dest`; return their records, tensors file first."""
    dest.mkdir()
    tensor_path = dest / tensor_filename(name)
    save_tensors({key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}, tensor_path)
    for filename, data in extra_files.items():
        (dest / filename).write_bytes(data)
    share_files(dest)
    return {filename: file_record(dest / filename) for filename in [tensor_path.name, *extra_files]}


def share_files(folder: Path) -> None:
    """Give every file in `folder` mode 0666 minus the umask, then fsync it: safetensors creates 0600, and
    what prep writes (an artifact, an exported checkpoint) is shared data."""
    mode = 0o666 & ~current_umask()
    for path in folder.iterdir():
        os.chmod(path, mode)
        fsync_file(path)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file; a failed write (a full disk) raises the OSError it is, which prep reports in one line."""
    try:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    except safetensors.SafetensorError as e:
        error = io_error(e, path)
        if error is None:
            raise
        raise error from None


def io_error(error: Exception, path: Path) -> OSError | None:
    """The OSError behind a safetensors write failure, or None for a failure of another kind."""
    match = SAFETENSORS_IO_ERROR.search(str(error))
    return None if match is None else OSError(int(match[1]), os.strerror(int(match[1])), str(path))


def swap_in(
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
        pause_point(f"stage-placed:{new_names[0].split('.')[0]}")  # new files in place, manifest not yet committed
        commit()
    except BaseException:
        for filename in placed:
            (art / filename).unlink(missing_ok=True)
        for filename in moved:
            os.replace(backup / filename, art / filename)
        fsync_dir(art)
        raise
