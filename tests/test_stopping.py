"""Stop strings on the tiny random Llama directory and its word-level tokenizer: the incremental
tail-window check stops where a full decode of the response first contains the stop string, and
plain and speculative decoding return the same tokens wherever that falls (prefill token, accepted
draft, recovered or bonus token).
"""

from __future__ import annotations

import pytest
import torch

from factories import tiny_artifact
from runtime.loops.decode import generate_ar
from runtime.drafters import LayerDrafter, NgramDrafter
from runtime.heads import FullHead
from runtime.loops.speculative import generate_speculative
from runtime.text.stopping import StopStrings
from runtime.backends.hf import TransformersTarget

NEW_TOKENS = 20
PROMPT = [5, 6, 7, 8] * 5


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(target without EOS, tokenizer) from the tiny model directory."""
    from runtime.models import load_model

    loaded = load_model(str(tiny_model_dir), progress=False)
    return TransformersTarget(loaded.model, set()), loaded.tokenizer


def first_hit(tokenizer, tokens: list[int], stops: list[str]) -> int | None:
    """The slow reference: the first t whose full decode of tokens[:t + 1] contains a stop string."""
    for t in range(len(tokens)):
        text = tokenizer.decode(tokens[: t + 1], skip_special_tokens=True)
        if any(stop in text for stop in stops):
            return t
    return None


def completing_at(tokenizer, reference: list[int], i: int) -> str:
    """The shortest tail of decode(reference[:i + 1]) made of whole tokens that is not in the text before i."""
    before = tokenizer.decode(reference[:i])
    for j in range(i, -1, -1):
        text = tokenizer.decode(reference[j : i + 1])
        if text not in before:
            return text
    raise AssertionError("the full text is always new")


def stop_cases(tokenizer, reference: list[int]) -> list[list[str]]:
    """Stop strings that first complete at every position, and a word's tail that crosses a token
    boundary beside a string that never occurs."""
    cases = []
    for i in range(len(reference)):
        word = tokenizer.decode(reference[i : i + 1])
        cases += [[completing_at(tokenizer, reference, i)], ["never-there", word[1:] + " "]]
    return cases


def test_stop_strings_match_a_full_decode_at_every_position(tiny):
    target, tokenizer = tiny
    head = FullHead(target.head_weight, target.head_bias)
    reference = generate_ar(target, head, torch.tensor(PROMPT), NEW_TOKENS)[0]
    positions, accepted = set(), 0
    for stops in stop_cases(tokenizer, reference):
        hit = first_hit(tokenizer, reference, stops)
        expected = reference if hit is None else reference[: hit + 1]
        stop = StopStrings(tokenizer, stops)
        assert generate_ar(target, head, torch.tensor(PROMPT), NEW_TOKENS, stop=stop)[0] == expected, stops
        for drafter in (NgramDrafter(), LayerDrafter(target, 1, FullHead(target.head_weight, target.head_bias))):
            tokens, stats = generate_speculative(target, head, drafter, torch.tensor(PROMPT), NEW_TOKENS, gamma=4,
                                                 stop=stop)
            assert tokens == expected, (stops, type(drafter).__name__)
            accepted += stats.spec.accepted
        positions.add(hit)
    assert set(range(len(reference))) <= positions, "some position never ended a run"
    assert accepted > 0, "no draft was accepted: stops inside accepted runs were never exercised"


def test_window_grows_over_tokens_that_decode_to_nothing(tiny):
    """Special tokens are skipped in the decoded text, so the window must reach past them."""
    _, tokenizer = tiny
    stop = StopStrings(tokenizer, ["w5 w6"])
    eos = tokenizer.eos_token_id
    assert stop.hit([5, 6])
    assert stop.hit([5] + [eos] * 40 + [6])  # the skipped EOS tokens leave "w5 w6"
    assert not stop.hit([5, 7, 6]) and not stop.hit([])


def test_empty_stop_strings_are_refused(tiny):
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(tiny[1], ["w5", ""])
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(tiny[1], [])


def test_generate_cli_stops_at_the_stop_text(tiny_model_dir, tmp_path, monkeypatch):
    """`runtime generate --stop` ends the printed text at the stop text, plain and speculative alike."""
    from click.testing import CliRunner

    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(tiny_model_dir, tmp_path)

    def generate(*extra) -> str:
        result = CliRunner().invoke(runtime_main, ["generate", str(art), "--method", "ar", "--prompt", "w5 w6 w7 w8",
                                                   "--max-new-tokens", "12", *extra])
        assert result.exit_code == 0, result.output
        return result.stdout

    text = generate().strip()
    stop = " ".join(text.split()[3:5])  # whole words: the cut falls on a token boundary
    expected = text[: text.index(stop) + len(stop)]
    assert len(expected) < len(text)
    for method in (["--method", "ar"], ["--method", "spec", "--drafter", "layers:1"]):
        assert generate(*method, "--stop", "never", "--stop", stop).strip() == expected
    assert generate("--stop", "\\n") == generate()  # the escape reads as a newline, which never occurs
