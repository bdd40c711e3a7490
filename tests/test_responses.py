"""prep responses: the prompt sources of the self-distillation text, and the corpus file it writes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from prep.cli import main as prep_main
from prep import responses
from prep.responses import (FUNCTIONS_PER_FILE, ROUNDS_PER_TASK, function_prompts, partial_path, training_prompts,
                            write_responses)
from runtime.serve import together
from factories import prep_ok, save_tiny_model_dir, tiny_artifact

SOURCE = '''"""A module."""
import os
from typing import List

X = 1


def documented(a: int) -> int:
    """Return a plus one.

    >>> documented(1)
    2
    """
    return a + 1


def bare(a):
    return a


class Thing:
    def method(self):
        """A method: not top level."""
        return 1


async def later(items: List[str]) -> str:
    """Join the items."""
    return "".join(items)


def third():
    """Past FUNCTIONS_PER_FILE."""
    return 3
'''


def test_function_prompts_are_a_signature_and_its_docstring_after_the_files_imports():
    prompts = list(function_prompts([SOURCE, "def broken(:\n", "def only():\n    \"\"\"No body after it.\"\"\"\n"]))
    assert len(prompts) == FUNCTIONS_PER_FILE == 2
    first, second = prompts
    assert first == ('import os\nfrom typing import List\n\n\ndef documented(a: int) -> int:\n    """Return a plus one.\n\n'
                     '    >>> documented(1)\n    2\n    """\n')
    assert second.endswith('async def later(items: List[str]) -> str:\n    """Join the items."""\n')
    assert "return" not in first + second  # the body is the target's to write


def test_the_packaged_function_prompts_come_from_the_standard_library():
    prompts = training_prompts("pyfunctions", 5)
    assert len(prompts) == 5 and not any(chat for _, chat in prompts)
    assert all("def " in text and ('"""' in text or "'''" in text) for text, _ in prompts)


def test_an_unknown_source_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="sharegpt or pystdlib or pyfunctions"):
        training_prompts("humaneval", 3)


def test_responses_writes_prompt_and_response_and_keeps_an_existing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model_dir(tmp_path / "model")
    art = tiny_artifact(model, tmp_path)
    out = tmp_path / "responses.json"
    said = prep_ok(["responses", art, "--source", "pyfunctions", "-n", 3, "--max-new-tokens", 4, "-o", out])
    texts = json.loads(out.read_text())
    assert len(texts) == 3 and "wrote" in said and "3 texts" in said
    assert all(text["text"].strip() for text in texts)
    before = out.read_text()
    refused = CliRunner().invoke(prep_main, ["responses", str(art), "-n", "1", "-o", str(out)])
    assert refused.exit_code != 0 and "--force" in refused.output and out.read_text() == before


class Interrupted(Exception):
    """Stands for the Ctrl-C that stops a run part way."""


def interrupt_after(monkeypatch, calls: int) -> None:
    """Make prep.responses' decoding (one call a task of ROUNDS_PER_TASK batches) raise Interrupted on the call after `calls`."""
    made = []

    def counted(*args, **kwargs):
        if len(made) == calls:
            raise Interrupted
        made.append(1)
        return together.generate_together(*args, **kwargs)

    monkeypatch.setattr(responses, "generate_together", counted)


def test_an_interrupted_run_resumes_its_finished_responses_and_writes_what_one_run_writes(tmp_path, monkeypatch):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    whole, resumed = tmp_path / "whole.json", tmp_path / "resumed.json"
    tokens = write_responses(api.load(art), "pyfunctions", 4, 4, whole)
    interrupt_after(monkeypatch, 1)
    with pytest.raises(Interrupted):  # one prompt at a time: a task of ROUNDS_PER_TASK prompts, then the interrupt
        write_responses(api.load(art), "pyfunctions", 4, 4, resumed, batch=1)
    assert not resumed.exists() and len(partial_path(resumed).read_text().splitlines()) == 1 + ROUNDS_PER_TASK
    with partial_path(resumed).open("a") as f:
        f.write('{"text": "cut by the interr')  # a torn last line is dropped, not read
    interrupt_after(monkeypatch, 1)
    assert write_responses(api.load(art), "pyfunctions", 4, 4, resumed, batch=1) == tokens  # the task left
    assert resumed.read_text() == whole.read_text() and not partial_path(resumed).exists()


def test_a_partial_file_of_other_settings_is_started_over(tmp_path, monkeypatch, capsys):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    out = tmp_path / "responses.json"
    interrupt_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        write_responses(api.load(art), "pyfunctions", 3, 4, out, batch=1)
    interrupt_after(monkeypatch, 1)
    write_responses(api.load(art), "pyfunctions", 2, 4, out, batch=1)  # another count: all 2 anew, one task
    assert "responses of other settings, started over" in capsys.readouterr().err
    assert len(json.loads(out.read_text())) == 2


def test_responses_on_two_processes_are_the_ones_one_process_writes(tmp_path, monkeypatch):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    alone, shared = tmp_path / "alone.json", tmp_path / "shared.json"
    tokens = write_responses(api.load(art), "pyfunctions", 5, 6, alone, batch=1)
    assert write_responses(api.load(art), "pyfunctions", 5, 6, shared, workers=2, batch=2) == tokens
    assert shared.read_text() == alone.read_text() and not partial_path(shared).exists()


def test_responses_decoded_together_are_the_ones_decoded_one_by_one(tmp_path, monkeypatch):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    engine = api.load(tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path))
    one, three = tmp_path / "one.json", tmp_path / "three.json"
    tokens = write_responses(engine, "pyfunctions", 7, 6, one, batch=1)
    assert write_responses(engine, "pyfunctions", 7, 6, three, batch=3) == tokens  # 3 at a time, 6 a task
    assert three.read_text() == one.read_text()

