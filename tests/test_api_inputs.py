"""Misuse of the Python API (runtime.api) beyond the values tests/bad_inputs/test_bad_api.py covers: prompts that
are not one sequence, text no tokenizer encodes, non-bool flags, numpy numbers, paths that are not paths, two
iterators over one generation; every one a one-line error raised before any method is built.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from factories import tiny_engine
from runtime import api
from runtime.common.sampling import SamplingParams

PROMPT = "w5 w9 w31 w5 w9"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("api-inputs"))


@pytest.fixture
def nothing_built(monkeypatch):
    """Building a method is an error: the checks under test must come before it (building can take seconds)."""
    def build(session, spec):
        raise AssertionError(f"{spec} was built before the arguments were checked")

    monkeypatch.setattr(api, "build_method", build)


def test_a_prompt_of_ids_is_one_sequence(engine, nothing_built):
    with pytest.raises(TypeError, match=re.escape("a prompt is text or a sequence of token ids (integers), got 5")):
        engine.generate(5, "spec:int8")  # not a one-token prompt
    for batch, shape in ((torch.tensor([[5, 9], [31, 5]]), [2, 2]), ([[[5, 9, 31]]], [1, 1, 3])):
        with pytest.raises(ValueError, match=re.escape(f"a prompt is one sequence of token ids, [P] or [1, P], got "
                                                       f"shape {shape}: generate one prompt at a time")):
            engine.generate(batch, "spec:int8")  # not the rows run one after another
    with pytest.raises(TypeError, match="a prompt is text or a sequence of token ids"):
        engine.bench("spec:int8", [5], max_new_tokens=2)


def test_a_prompt_of_one_row_is_that_row(engine):
    expected = engine.generate([5, 9, 31], "ar", max_new_tokens=6).wait().tokens
    assert engine.generate(torch.tensor([[5, 9, 31]]), "ar", max_new_tokens=6).wait().tokens == expected


def test_empty_text_is_refused(engine, nothing_built):
    # gemma3-270m's tokenizer adds BOS: "" decoded from BOS alone; the CLI refuses an empty --prompt
    says = "the prompt is empty text; give some text (or token ids: [BOS] alone starts from nothing)"
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.generate("", "spec:int8")
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.bench("spec:int8", [PROMPT, ""], max_new_tokens=2)


def test_text_with_a_lone_surrogate_is_refused(engine, nothing_built):
    says = "holds a lone surrogate '\\udcff' at character 3, not text a tokenizer encodes; decode its bytes as UTF-8"
    with pytest.raises(ValueError, match=re.escape(f"the prompt {says}")):  # was transformers' TypeError
        engine.generate("w5 \udcff", "spec:int8")
    with pytest.raises(ValueError, match=re.escape(f"a stop string {says}")):  # could never match: never stopped
        engine.generate(PROMPT, "spec:int8", stop=["w9", "w5 \udcff"])


@pytest.mark.parametrize("chat", ["no", None, 1], ids=["text", "none", "int"])
def test_chat_is_true_or_false(engine, nothing_built, chat):
    says = f"chat must be True or False, got {chat!r}"  # "no" was read as True
    for call in (lambda: engine.generate(PROMPT, "spec:int8", chat=chat), lambda: engine.encode(PROMPT, chat),
                 lambda: engine.bench("spec:int8", PROMPT, max_new_tokens=2, chat=chat)):
        with pytest.raises(ValueError, match=re.escape(says)):
            call()


def test_malformed_chat_messages_are_named_in_the_error(engine, nothing_built):
    with pytest.raises(ValueError, match=re.escape("messages in the chat template; got "
                                                   "[{'role': 'user', 'text': 'hi'}]")):
        engine.generate([{"role": "user", "text": "hi"}], "spec:int8", chat=True)


def test_prompts_and_stops_are_checked_before_any_method_is_built(engine, nothing_built):
    vocab = engine.session.target.vocab_size
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.generate([5, vocab], "spec:int8")
    with pytest.raises(ValueError, match="stop strings must be non-empty text"):
        engine.generate(PROMPT, "spec:int8", stop="")
    with pytest.raises(ValueError, match="leaves room for"):
        engine.bench(["spec:int8"], [PROMPT], max_new_tokens=engine.context_length)


def test_numpy_numbers_are_taken_as_python_numbers(engine):
    expected = engine.generate(PROMPT, "ar", SamplingParams(temperature=0.5, top_k=5), max_new_tokens=4, seed=3)
    params = SamplingParams(temperature=np.float64(0.5), top_k=np.int64(5), top_p=np.float32(1.0))
    assert [type(getattr(params, f)) for f in ("temperature", "top_k", "top_p")] == [float, int, float]
    run = engine.generate(PROMPT, "ar", params, max_new_tokens=np.int64(4), seed=np.int64(3))  # torch refused the seed
    assert run.wait().tokens == expected.wait().tokens
    record = engine.bench("ar", PROMPT, max_new_tokens=np.int64(2), seed=np.int64(3),
                          sampling=SamplingParams(temperature=np.float32(0.5)))
    setup = json.loads(json.dumps(record))["setup"]  # a numpy number is not JSON
    assert (setup["max_new_tokens"], setup["seed"], setup["temperature"]) == (2, 3, float(np.float32(0.5)))


@pytest.mark.parametrize("arguments, error, says", [
    ({"artifact": None}, TypeError, "artifact is the path of an artifact directory, a non-empty str or Path; got None"),
    ({"artifact": ""}, TypeError, "artifact is the path of an artifact directory, a non-empty str or Path; got ''"),
    ({"model": ""}, TypeError,
     "model is a packaged name, a model directory or a .gguf path (None: the artifact's own), a non-empty str or Path; "
     "got ''"),
    ({"model": 5}, TypeError, "model is a packaged name"),
    ({"progress": "no"}, ValueError, "progress must be True or False, got 'no'"),
], ids=["artifact-none", "artifact-empty", "model-empty", "model-int", "progress-text"])
def test_load_checks_its_arguments_before_reading_anything(engine, monkeypatch, tmp_path, arguments, error, says):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path))  # should a load start anyway, it stays here
    with pytest.raises(error, match=re.escape(says)):
        api.load(**{"artifact": engine.session.artifact.path, **arguments})


def test_two_iterators_over_one_generation(engine):
    expected = engine.generate(PROMPT, "ar", max_new_tokens=8).wait().tokens
    run = engine.generate(PROMPT, "ar", max_new_tokens=8)
    first = iter(run)
    assert next(first) == expected[0]
    assert run.wait().tokens == expected  # wait() runs the rest on a second iterator
    assert list(first) == [] and run.tokens == expected
    run = engine.generate(PROMPT, "ar", max_new_tokens=8)
    first, second = iter(run), iter(run)
    next(first), next(second)
    first.close()  # ends the loop for both
    with pytest.raises(RuntimeError, match="this generation was stopped before its end"):
        next(second)
    assert run.tokens == expected[:2]


def test_min_response_tokens_without_chat_is_refused(engine, nothing_built):
    # it guards a chat response's first tokens: without chat it was ignored (the CLI refuses it too)
    says = "min_response_tokens must be left at None without chat=True"
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.generate(PROMPT, "spec:int8", min_response_tokens=8)
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.bench("spec:int8", PROMPT, max_new_tokens=2, min_response_tokens=0)


def test_min_response_tokens_defaults_to_off_without_chat(engine):
    record = engine.bench("ar", PROMPT, max_new_tokens=2)
    assert record["setup"]["min_response_tokens"] == 0  # off without chat; 4 with it (tests/test_bench_chat.py)
