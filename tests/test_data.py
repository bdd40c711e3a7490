"""Prompt sources: HumanEval, the truncated ShareGPT dump, prompt files."""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import pytest

from runtime.text import data

# Multi-byte characters, nesting and numbers exercise chunk boundaries.
ITEMS = [{"id": i, "text": "é€😀" * i, "nested": [1.5, None, True]} for i in range(12)]
ITEMS += [7, "x", 123456]


PARTS = [json.dumps(x, ensure_ascii=False).encode() for x in ITEMS]
RAW = b"[\n" + b",\n".join(PARTS) + b"\n]"
# Byte offset just past each element in RAW.
ENDS = [2 + sum(len(p) for p in PARTS[: i + 1]) + 2 * i for i in range(len(PARTS))]


def _expected_before(cut: int) -> list:
    """Return the elements a reader of RAW[:cut] can know are complete."""
    # A number that ends exactly at the cut might have had more digits.
    return [x for x, end in zip(ITEMS, ENDS) if end < cut or (end == cut and not isinstance(x, int))]


def test_humaneval_prompts_are_the_164_tasks_in_order():
    prompts = data.humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert "def truncate_number(" in prompts[2]
    assert data.humaneval_prompts(3) == prompts[:3]


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 1 << 20])
def test_json_array_stream_yields_every_element_of_a_complete_array(chunk_size):
    assert list(data.iter_json_array(io.BytesIO(RAW), chunk_size)) == ITEMS


def test_json_array_stream_stops_cleanly_at_every_truncation_point(tmp_path: Path):
    path = tmp_path / "cut.json"
    for cut in range(1, len(RAW)):
        path.write_bytes(RAW[:cut])
        with path.open("rb") as f:
            assert list(data.iter_json_array(f, chunk_size=7)) == _expected_before(cut), cut


def test_json_array_stream_does_not_yield_a_number_that_may_be_cut():
    assert list(data.iter_json_array(io.BytesIO(b"[1, 2, 12"))) == [1, 2]
    assert list(data.iter_json_array(io.BytesIO(b"[1, 2, 12]"))) == [1, 2, 12]


@pytest.mark.parametrize("raw", [b"", b"   ", b'{"a": 1}', b"nope"])
def test_json_array_stream_refuses_what_is_not_an_array(raw):
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(data.iter_json_array(io.BytesIO(raw)))


def test_sharegpt_stream_yields_complete_conversations_and_stops_at_the_truncation():
    shipped = resources.files(data.SHAREGPT_PACKAGE).joinpath("data", data.SHAREGPT_FILE)
    assert not shipped.read_bytes().rstrip().endswith(b"]"), "the shipped file is no longer truncated"
    conversations = list(data.sharegpt_conversations())
    assert 17_000 < len(conversations) < 18_000
    for c in (conversations[0], conversations[-1]):
        assert isinstance(c["id"], str)
        assert all({"from", "value"} <= turn.keys() for turn in c["conversations"])
    assert [c["id"] for c in data.sharegpt_conversations(limit=3)] == [c["id"] for c in conversations[:3]]


def test_sharegpt_prompts_are_deterministic_bounded_and_skippable():
    first = data.sharegpt_prompts(8)
    assert len(first) == 8
    assert all(0 < len(p) <= data.MAX_PROMPT_CHARS and p == p.strip() for p in first)
    assert data.sharegpt_prompts(8) == first
    assert data.sharegpt_prompts(3, skip=5) == first[5:]


def test_prompts_from_file_reads_a_list_of_text_objects(tmp_path: Path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b", "extra": 1}]))
    assert data.prompts_from_file(path) == ["a", "b"]
    assert data.load_prompts(str(path), 1) == ["a"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "cannot read prompts"),
        ('{"text": "a"}', "JSON list"),
        ('[{"text": "a"}, {"prompt": "b"}]', "item 1"),
        ('[{"text": 3}]', "item 0"),
    ],
)
def test_prompts_from_file_rejects_bad_files(tmp_path: Path, content: str, message: str):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        data.prompts_from_file(path)


def test_load_prompts_sources(tmp_path: Path):
    assert data.load_prompts("humaneval", 2) == data.humaneval_prompts(2)
    assert data.load_prompts("sharegpt", 2) == data.sharegpt_prompts(2)
    with pytest.raises(ValueError, match="unknown prompt source"):
        data.load_prompts(str(tmp_path / "missing.json"), 2)
    with pytest.raises(ValueError, match="cannot read prompts"):
        data.prompts_from_file(tmp_path / "missing.json")


def test_a_prompts_pipe_is_read_once(tmp_path: Path):
    """`--prompts <(...)`: a pipe gives its bytes to one reader; the checks and the run share that one read."""
    import os
    import threading

    from runtime.cli.values import PromptSource

    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    opened = []

    def writer(text: str) -> None:
        with open(fifo, "w") as f:  # blocks until a reader opens the pipe
            opened.append(text)
            f.write(text)

    threading.Thread(target=writer, args=('[{"text": "def f(x):"}, {"text": "hi"}]',), daemon=True).start()
    source = PromptSource().convert(str(fifo), None, None)
    # A second read would get only what this late writer sends: no prompts, and a failed parse.
    threading.Thread(target=writer, args=("",), daemon=True).start()
    assert data.load_prompts(source, 5) == ["def f(x):", "hi"] and source == str(fifo)
    assert opened == ['[{"text": "def f(x):"}, {"text": "hi"}]']
    with open(fifo) as f:  # let the second writer finish
        f.read()
