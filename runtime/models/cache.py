"""The model cache: converted model directories, each published by one atomic rename.

An entry is `<cache>/models/<key>/`: config.json, safetensors weights, the tokenizer, the
provenance file and, for a packaged model, the assembled and verified .gguf itself (the native
backend reads it). Work happens in a temporary sibling named with the writer's pid, so a killed
import leaves nothing that looks like an entry, and the next import deletes its leftovers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from safetensors import SafetensorError

from artifacts.format import TMP_PREFIX
from artifacts.atomic import atomic_write_json, current_umask, fsync_dir, fsync_file, remove_dead_leftovers
from artifacts.writing import io_error
from runtime.models.registry import ModelError

CACHE_ENV = "SPECVOCAB_CACHE"
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)  # the write errors a cache folder with room would not give
PROVENANCE_FILE = "specvocab_model.json"


def cache_root() -> Path:
    """Return the root of specvocab's cache ($SPECVOCAB_CACHE or ~/.cache/specvocab)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specvocab"


def models_dir() -> Path:
    """Return the directory holding one converted model directory per name."""
    return cache_root() / "models"


def read_config(path: Path) -> dict[str, Any]:
    """Return `<path>/config.json` as a dict; ModelError (one line) if it is missing or not JSON."""
    config = path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(
            f"{path} has no config.json; pass a Hugging Face model directory, a .gguf file or a packaged name"
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"{config} is damaged or truncated ({e}); restore it, or re-save the model with save_pretrained") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ModelError(f"{config} has no model_type; restore it, or re-save the model with save_pretrained")
    return data


def read_provenance(path: Path) -> dict[str, Any]:
    """Return the provenance record of a directory we converted, or {} for any other."""
    try:
        record = json.loads((path / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_provenance(path: Path, record: dict[str, Any]) -> None:
    """Write the provenance record of a converted directory (atomically: entries may be read meanwhile)."""
    atomic_write_json(path / PROVENANCE_FILE, record)


def update_provenance(path: Path, **fields: Any) -> None:
    """Add fields to a published entry's provenance; best effort (a read-only cache keeps its record)."""
    try:
        write_provenance(path, {**read_provenance(path), **fields})
    except OSError:
        pass


def is_cached(target: Path) -> bool:
    """Return whether a usable cache entry exists; ModelError if one exists but is damaged."""
    if not target.exists():
        return False
    # Entries appear only by atomic rename, so a damaged one was changed by hand.
    damaged = not (target / "config.json").is_file() or not any(target.glob("*.safetensors"))
    if not damaged:
        try:
            read_config(target)
        except ModelError:
            damaged = True
    if damaged:
        raise ModelError(f"cached model {target} is incomplete; delete that folder and run again to rebuild it")
    return True


@contextmanager
def staging(target: Path, log) -> Iterator[Path]:
    """Yield a private work dir beside `target`; on success publish work/model as target by rename."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_dead_leftovers(target.parent)
        work = Path(tempfile.mkdtemp(prefix=_prefix(target.name), dir=target.parent))
    except OSError as e:
        raise ModelError(f"cannot write the model cache {target.parent} ({e.strerror or e}); "
                         f"make it writable or set {CACHE_ENV} to a writable folder") from None
    try:
        yield work
        _fsync_tree(work / "model")
        try:
            os.rename(work / "model", target)
        except OSError:
            if not is_cached(target):  # else another process published it first: keep theirs
                raise
        fsync_dir(target.parent)
        log(f"cached at {target}")
    except (OSError, SafetensorError) as e:  # the assembled file or the weights failed to write: a full disk?
        error = e if isinstance(e, OSError) else io_error(e, target.parent)
        if error is None:
            raise
        raise full_cache_error(error, target.parent) or error from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def full_cache_error(error: OSError, folder: Path) -> ModelError | None:
    """The one-line error for a write into the cache that found no room (a full disk, a quota), else None."""
    if error.errno not in NO_ROOM:
        return None
    return ModelError(f"cannot write the model cache {folder} ({error.strerror}); "
                      f"free space there or set {CACHE_ENV} to a folder with room, then run again")


def publish_file(entry: Path, name: str, write) -> Path:
    """Create `<entry>/<name>` by write(tmp) into a temporary sibling and one rename; return its path.

    For files added to an entry after it was published (the .gguf of an entry made before it was
    kept): a concurrent reader sees the file whole or not at all.
    """
    remove_dead_leftovers(entry)
    tmp = entry / f"{_prefix(name)}{os.urandom(4).hex()}"
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, entry / name)
    finally:
        tmp.unlink(missing_ok=True)
    return entry / name


def _prefix(name: str) -> str:
    """Temporary-name prefix recording this process's pid (the scheme of artifacts.atomic.writer_pid)."""
    return f"{TMP_PREFIX}{os.getpid()}-{name}-"


def _fsync_tree(path: Path) -> None:
    """Give every file under `path` the umask's mode (some writers make 0600) and flush it to disk,
    so the rename publishes durable data that other users may read."""
    mode = 0o666 & ~current_umask()
    for f in path.rglob("*"):
        if f.is_file():
            os.chmod(f, mode)
            fsync_file(f)
