"""Load a model's tokenizer: AutoTokenizer's result, from a JSON cache beside a model-cache entry.

transformers 5 builds GemmaTokenizer and Qwen2Tokenizer by json.load-ing tokenizer.json in Python
twice (once for its added tokens) and rebuilding the `tokenizers` backend from the vocab and merges:
2.8 s for gemma3-270m's 33 MB file, against one Rust parse of the finished backend. So the first
load of an entry saves that finished backend (`<key>.backend.json`) and the keyword arguments the
class was built with (`init_kwargs`, `<key>.json`) in the entry's `specvocab_tokenizer/` folder,
and later loads build the same class from them with `tokenizer_file=`, the constructor's own path
for a ready backend.

Why the cached load returns the same tokenizer:
- the key is the sha256 of every file transformers may read (all of the entry but weights and
  specvocab's own files), the entry's path and the transformers and tokenizers versions: an edited
  file or an upgrade finds no record, never a stale one;
- a record is published only after a load from it reproduced AutoTokenizer's tokenizer exactly
  (`same_tokenizer`: class, backend serialization, every attribute); a class that does not survive
  the round trip keeps loading through AutoTokenizer;
- the record appears by atomic rename after its backend file, so a reader sees both whole or neither.
Directories outside the model cache (a user's Hugging Face folder) are loaded by AutoTokenizer and
never written to. Records of other keys (another transformers version sharing the cache) are kept.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from artifacts.atomic import atomic_write
from artifacts.format import TMP_PREFIX
from runtime.models.cache import models_dir
from runtime.models.registry import ModelError, file_sha256, first_line

CACHE_FOLDER = "specvocab_tokenizer"
FORMAT = 1
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")
# GemmaTokenizer and Qwen2Tokenizer keep their constructor's vocab and merges as attributes, read
# only in __init__; the cached load passes them inside the backend instead.
CONSTRUCTOR_INPUTS = ("_vocab", "_merges")
NO_CHAT_TEMPLATE = "has no chat template; drop --chat (chat=True)"  # after the model's or tokenizer's name


def load_tokenizer(path: Path) -> Any:
    """The tokenizer AutoTokenizer.from_pretrained(path) returns; from the cache when `path` is a cache entry."""
    from transformers import AutoTokenizer

    if path.parent.resolve() != models_dir().resolve():  # not a cache entry: leave the folder alone
        return AutoTokenizer.from_pretrained(path)
    folder, key = path / CACHE_FOLDER, cache_key(path)
    record = _read_record(folder / f"{key}.json")
    if record is not None:
        return _build(record, folder / f"{key}.backend.json")
    tokenizer = AutoTokenizer.from_pretrained(path)
    _publish(folder, key, tokenizer)
    return tokenizer


def has_chat_template(path: Path) -> bool:
    """Whether AutoTokenizer.from_pretrained(path) carries a chat template, read from the files it takes one
    from (chat_template.jinja, additional_chat_templates/*.jinja, tokenizer_config.json's chat_template)
    without building the tokenizer, which takes seconds for a large vocabulary: `--chat` is checked before a model loads."""
    templates = [path / "chat_template.jinja", *(path / "additional_chat_templates").glob("*.jinja")]
    if any(file.is_file() and file.stat().st_size for file in templates):
        return True
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as e:
        raise ModelError(f"{path / 'tokenizer_config.json'} cannot be read ({first_line(e)}); re-save the tokenizer") from None
    return isinstance(config, dict) and bool(config.get("chat_template"))


def cache_key(path: Path) -> str:
    """sha256 of what the tokenizer is built from: the entry's path, the library versions, the files."""
    import tokenizers
    import transformers

    digest = hashlib.sha256(json.dumps([FORMAT, str(path), transformers.__version__, tokenizers.__version__]).encode())
    for file in _sources(path):
        digest.update(json.dumps([file.relative_to(path).as_posix(), file_sha256(file)]).encode())
    return digest.hexdigest()


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two transformers tokenizers are the same: class, backend serialization and attributes."""
    def attributes(tokenizer: Any) -> dict[str, str]:
        skipped = ("_tokenizer", *CONSTRUCTOR_INPUTS)
        return {name: repr(value) for name, value in vars(tokenizer).items() if name not in skipped}

    return (type(a) is type(b) and attributes(a) == attributes(b)
            and a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str())


def _sources(path: Path) -> list[Path]:
    """The files of an entry transformers may read for its tokenizer: all but weights and specvocab's own."""
    def ours(file: Path) -> bool:
        return file.relative_to(path).parts[0].startswith(("specvocab_", TMP_PREFIX))

    return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix not in WEIGHT_SUFFIXES and not ours(f))


def _read_record(file: Path) -> dict[str, Any] | None:
    """A published record, or None when there is none under this key."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelError(f"{file} is damaged ({first_line(e)}); delete {file.parent}") from None


def _record(tokenizer: Any) -> dict[str, Any]:
    """The class name and constructor arguments of a tokenizer, as JSON values."""
    init_kwargs = tokenizer.convert_added_tokens(tokenizer.init_kwargs, save=True)  # AddedToken -> dict
    return {"class": type(tokenizer).__name__, "init_kwargs": init_kwargs}


def _build(record: dict[str, Any], backend: Path) -> Any:
    """The tokenizer of a record, its backend read from `backend`."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    cls = tokenizer_class_from_name(record["class"])
    if cls is None:
        raise ModelError(f"this transformers has no tokenizer class {record['class']}; delete {backend.parent}")
    kwargs = cls.convert_added_tokens(record["init_kwargs"], save=False)
    if "added_tokens_decoder" in kwargs:  # JSON made its integer keys strings
        kwargs["added_tokens_decoder"] = {int(i): token for i, token in kwargs["added_tokens_decoder"].items()}
    try:
        return cls(tokenizer_file=str(backend), **kwargs)
    except Exception as e:  # tokenizers reports a bad file as a bare Exception
        raise ModelError(f"{backend} cannot be read ({first_line(e)}); delete {backend.parent}") from None


def _publish(folder: Path, key: str, tokenizer: Any) -> None:
    """Write the record of `tokenizer` under `key` if a load from it reproduces `tokenizer`; best effort."""
    try:
        text = json.dumps(_record(tokenizer))
    except (TypeError, ValueError):  # init_kwargs that JSON cannot hold: no cache
        return
    backend = folder / f"{key}.backend.json"
    try:
        folder.mkdir(exist_ok=True)
        atomic_write(backend, lambda tmp: tokenizer.backend_tokenizer.save(str(tmp), pretty=False))
        if _round_trips(json.loads(text), backend, tokenizer):
            atomic_write(folder / f"{key}.json", lambda tmp: tmp.write_text(text, encoding="utf-8"))
        else:
            backend.unlink()
    except OSError:  # a read-only cache: load through AutoTokenizer every time
        pass


def _round_trips(record: dict[str, Any], backend: Path, tokenizer: Any) -> bool:
    """Whether building `record` over `backend` gives back `tokenizer` exactly."""
    try:
        return same_tokenizer(_build(record, backend), tokenizer)
    except ModelError:  # a class this round trip does not fit
        return False
