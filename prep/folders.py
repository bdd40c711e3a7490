"""Output folders of prep commands (an artifact, a traces folder): made, locked for one writer, removed if left empty.

A command that makes its output folder (and any missing parents) and then fails, is refused, or is
stopped before writing anything removes the folders it made while they are empty; a folder that
was there before is the user's and stays.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from artifacts import ArtifactError
from artifacts.atomic import WriterLock, remove_dead_leftovers
from artifacts.errors import broken_link


@contextmanager
def locked_folder(path: Path, option: str, busy: Callable[[int], Exception]) -> Iterator[Path]:
    """Make `path` (missing parents too), check it is writable and hold its writer lock for the block.

    `option` is the flag that named the folder (for the error line); `busy(pid)` is the error for a
    folder another live prep run is writing. On exit the lock is released, then the folders this
    call made are removed while empty.
    """
    made = missing_folders(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(path))
    except OSError as e:
        remove_empty(made)
        if (broken := broken_link(path)) is not None:
            raise ArtifactError(f"cannot write to {path}: {broken}; fix or remove the link, or choose another {option}") from None
        raise ArtifactError(f"cannot write to {path} ({e.strerror or e}); choose a writable {option}") from None
    lock = WriterLock(path)
    holder = lock.acquire()
    if holder is not None:
        raise busy(holder)
    try:
        remove_dead_leftovers(path)  # a killed run's temporaries: we hold the lock, so they are dead
        yield path
    finally:
        lock.release()
        remove_empty(made)


def missing_folders(path: Path) -> list[Path]:
    """The folders `path.mkdir(parents=True)` would make: `path` and its missing parents, deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    return missing


def remove_empty(folders: list[Path]) -> None:
    """Remove the folders (deepest first) while they are empty; stop at the first that holds something."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # something else is there (or it never got made): leave it and its parents
