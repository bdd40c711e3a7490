"""prep responses: the prompt sources of the self-distillation text, and the corpus file it writes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from prep.cli import main as prep_main
from prep.responses import FUNCTIONS_PER_FILE, function_prompts, partial_path, training_prompts, write_responses
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


def interrupted_after(engine, calls: int):
    """The engine, its generate raising Interrupted on the call after `calls`."""
    generate, made = engine.generate, []

    def counted(*args, **kwargs):
        if len(made) == calls:
            raise Interrupted
        made.append(1)
        return generate(*args, **kwargs)

    engine.generate = counted
    return engine


def test_an_interrupted_run_resumes_its_finished_responses_and_writes_what_one_run_writes(tmp_path, monkeypatch):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    whole, resumed = tmp_path / "whole.json", tmp_path / "resumed.json"
    tokens = write_responses(api.load(art), "pyfunctions", 4, 4, whole)
    with pytest.raises(Interrupted):
        write_responses(interrupted_after(api.load(art), 2), "pyfunctions", 4, 4, resumed)
    assert not resumed.exists() and len(partial_path(resumed).read_text().splitlines()) == 1 + 2  # settings + 2
    with partial_path(resumed).open("a") as f:
        f.write('{"text": "cut by the interr')  # a torn last line is dropped, not read
    assert write_responses(interrupted_after(api.load(art), 2), "pyfunctions", 4, 4, resumed) == tokens  # 2 left
    assert resumed.read_text() == whole.read_text() and not partial_path(resumed).exists()


def test_a_partial_file_of_other_settings_is_started_over(tmp_path, monkeypatch, capsys):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    out = tmp_path / "responses.json"
    with pytest.raises(Interrupted):
        write_responses(interrupted_after(api.load(art), 1), "pyfunctions", 3, 4, out)
    write_responses(interrupted_after(api.load(art), 2), "pyfunctions", 2, 4, out)  # another count: all 2 anew
    assert "responses of other settings, started over" in capsys.readouterr().err
    assert len(json.loads(out.read_text())) == 2


def test_responses_on_two_processes_are_the_ones_one_process_writes(tmp_path, monkeypatch):
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(save_tiny_model_dir(tmp_path / "model"), tmp_path)
    alone, shared = tmp_path / "alone.json", tmp_path / "shared.json"
    tokens = write_responses(api.load(art), "pyfunctions", 5, 6, alone)
    assert write_responses(api.load(art), "pyfunctions", 5, 6, shared, workers=2) == tokens
    assert shared.read_text() == alone.read_text() and not partial_path(shared).exists()

