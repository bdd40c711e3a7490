"""A traces folder on disk (prep traces' output): its index, its shards, and the one run that may write it.

Every reader goes through `read_index` and `shard_tensors`, so a damaged folder (an index that is
not JSON or not of the index's shape, a shard file missing, truncated or failing the sha256 its
index entry records) is refused in one line naming the file and the fix; `traces_of`, the check every
consumer runs first, also refuses an unfinished folder (an interrupted run). `writing_traces` refuses
a folder that cannot hold traces (a file, a specvocab artifact) and holds the folder's writer lock,
so two traces runs never write one folder.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import safetensors
import torch

from artifacts.atomic import atomic_write
from artifacts.format import MANIFEST_FILE
from artifacts.manifest import FileRecord, file_problem, file_record
from prep.folders import locked_folder
from runtime.text.data import SPLITS

INDEX_FILE = "index.json"
TRACES_FORMAT = 1
SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def rebuild_fix(out: Path | str) -> str:
    """How to replace a traces folder that cannot be used as it is."""
    return f"rebuild it with `prep traces MODEL -o {out} --force`, or delete {out}"


def read_index(out: str | Path) -> dict:
    """The index of a traces folder; ValueError naming the fix when it is missing, damaged or of another format."""
    path = Path(out) / INDEX_FILE
    if not path.is_file():
        raise ValueError(f"{out} holds no traces ({INDEX_FILE} missing); run: prep traces MODEL --corpus sharegpt -o {out}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e}); {rebuild_fix(out)}") from None
    problem = _index_problem(index)
    if problem:
        raise ValueError(f"{path} is not a traces index ({problem}); {rebuild_fix(out)}")
    return index


def _index_problem(index) -> str | None:
    """What keeps `index` from being a traces index readers can use, or None."""
    if not isinstance(index, dict):
        return f"a JSON {type(index).__name__}, not an object"
    if index.get("format") != TRACES_FORMAT:
        return f"format {index.get('format')!r}, this version reads {TRACES_FORMAT}"
    if not isinstance(index.get("model"), str) or not isinstance(index.get("vocab_size"), int):
        return "no model name or vocabulary size"
    shards = index.get("shards")
    if not isinstance(shards, list) or not all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and SHARD_NAME.fullmatch(e["file"]) for e in shards
    ):
        return 'its "shards" are not a list of {"file": "shard-NNNNN.safetensors", ...} entries'
    if not all(_checksum_fields(e) is not None for e in shards):
        return "a shard's sha256 and bytes are not text and an integer >= 0, nor both absent"
    if not isinstance(index.get("finished", True), bool):  # absent in folders written before it was recorded
        return '"finished" is not true or false'
    return None


def _checksum_fields(entry: dict) -> tuple | None:
    """(sha256, bytes) of a shard entry, () when it records neither (written before they were), None when malformed."""
    sha, size = entry.get("sha256"), entry.get("bytes")
    if sha is None and size is None:
        return ()
    return (sha, size) if isinstance(sha, str) and type(size) is int and size >= 0 else None


def traces_of(out: str | Path, model_name: str, vocab_size: int) -> dict:
    """The index of a finished traces folder made by `model_name`, else a ValueError naming the fix.

    An unfinished folder (its run stopped, or still going) and another model's traces are refused.
    """
    index = read_index(out)
    if not index.get("finished", True):
        written = len(index["shards"])
        raise ValueError(f"{out} holds unfinished traces ({written} shard{'s' * (written != 1)} so far: its run stopped or is "
                         "still going); once no run writes there, rerun the command that wrote them (prep traces, or "
                         f"prep all --with-router) to finish, or delete {out}")
    if index["model"] != model_name or index["vocab_size"] != vocab_size:
        raise ValueError(f"{out} holds traces of {index['model']} (vocabulary {index['vocab_size']}), not of "
                         f"{model_name} ({vocab_size}); run: prep traces {model_name} -o NEW_DIR, then pass --traces NEW_DIR")
    return index


def write_index(out: Path, index: dict) -> None:
    atomic_write(out / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=1) + "\n"))


def complete_shards(index: dict) -> list[dict]:
    """The index entries of its complete shards, in order."""
    return [e for e in index["shards"] if e.get("complete")]


# The fields of a shard's index entry that record its file: a checksum and a size (entries written
# before them have neither, and their files are read unchecked).
CHECKSUM_FIELDS = ("sha256", "bytes")


def shard_checksum(path: Path) -> dict:
    """The CHECKSUM_FIELDS of a written shard file, for its index entry."""
    record = file_record(path)
    return {"sha256": record.sha256, "bytes": record.size}


def shard_problem(path: Path, entry: dict) -> str | None:
    """What is wrong with a shard file against its index entry (missing, or another sha256 or size), or None."""
    recorded = _checksum_fields(entry)
    if not recorded:  # written before shards carried checksums: only its presence can be checked
        return None if path.is_file() else f"{path.name} is missing"
    return file_problem(path, FileRecord(sha256=recorded[0], size=recorded[1]))


def _damaged_shard(path: Path, out: str | Path, what: str) -> ValueError:
    """The one-line error for a shard that is missing or damaged, naming the rerun that redoes it."""
    return ValueError(f"{path} is {what}; rerun the prep traces command that wrote {out} "
                      f"(it redoes missing and damaged shards), or delete {out}")


def shard_tensors(out: str | Path, entry: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of one shard, by its index entry, after its checksum where one is recorded.

    ValueError naming the fix when the file is missing, damaged or lacks one of the keys.
    """
    path = Path(out) / entry["file"]
    problem = shard_problem(path, entry)
    if problem is not None:
        raise _damaged_shard(path, out, "missing" if not path.is_file() else f"damaged ({problem})")
    try:
        with safetensors.safe_open(str(path), framework="pt") as shard:
            missing = [k for k in keys if k not in shard.keys()]
            if missing:
                raise ValueError(f"{out} has no {', '.join(missing)}; rerun prep traces into a new directory "
                                 "(with the matching --drafter-layers)")
            return {k: shard.get_tensor(k) for k in keys}
    except (safetensors.SafetensorError, OSError) as e:
        raise _damaged_shard(path, out, "missing" if isinstance(e, FileNotFoundError) else f"damaged ({e})") from None


def shard_intact(path: Path, entry: dict) -> bool:
    """Whether a shard file matches its index entry and its header covers the file.

    The entry's checksum is compared where it records one; a truncated file's header does not cover it.
    """
    if shard_problem(path, entry) is not None:
        return False
    try:
        with safetensors.safe_open(str(path), framework="pt"):
            return True
    except (safetensors.SafetensorError, OSError):
        return False


def load_traces(out: str | Path, keys: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """The index and the named tensors of every complete shard, concatenated (other tensors are not read)."""
    index = read_index(out)
    entries = complete_shards(index)
    if not entries:
        raise ValueError(f"{out} has no complete shard; rerun prep traces to finish it")
    parts = [shard_tensors(out, entry, keys) for entry in entries]
    return index, {k: torch.cat([p[k] for p in parts]) for k in keys}


def require_split(out: str | Path, split: torch.Tensor, name: str) -> torch.Tensor:
    """The rows [N] (bool) of split `name`; ValueError naming the fix when the traces have none."""
    rows = split == SPLITS.index(name)
    if not rows.any():
        raise ValueError(f"the traces at {out} have no {name} rows; trace more text: rerun prep traces "
                         "into that folder with a larger --max-tokens")
    return rows


def check_traces_folder(out: str | Path, option: str) -> None:
    """Refuse, before any work, a traces folder that is a file or a specvocab artifact (traces go in their own folder)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file; traces go in a folder: choose another {option}")
    if (path / MANIFEST_FILE).exists():
        raise ValueError(f"{path} is a specvocab artifact; traces go in a folder of their own: "
                         f"choose another {option}, such as traces/{path.name}")


@contextmanager
def writing_traces(out: str | Path, option: str = "-o") -> Iterator[Path]:
    """Check, make and lock a traces folder for the block; remove the folders it made if no shard got written."""
    path = Path(out)
    check_traces_folder(path, option)

    def busy(pid: int) -> ValueError:
        return ValueError(f"{path} is being written by another prep run (pid {pid}); wait for it to finish, "
                          f"or choose another {option}")

    with locked_folder(path, option, busy):
        yield path


def remove_unlisted_shards(out: Path, index: dict) -> None:
    """Delete the shard files the index does not list (a rebuild's leftovers of the traces it replaced)."""
    listed = {e["file"] for e in index["shards"]}
    for path in out.iterdir():
        if SHARD_NAME.fullmatch(path.name) and path.name not in listed:
            path.unlink()
