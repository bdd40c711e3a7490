"""Bad values given to the Python API (runtime.api, SamplingParams): one-line errors naming the fix, raised
before any decoding, never a traceback from deep inside torch; and a top-k of at least the vocabulary,
which cuts nothing in every head.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from factories import tiny_engine
from runtime import api
from runtime.kernels import decode_threads, threads_restored
from runtime.kernels.build import usable_cores
from runtime.common.sampling import SamplingParams
from runtime.methods import build_method

PROMPT = "w5 w9 w31 w5 w9"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("bad-api"))


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# --- top-k of at least the vocabulary --------------------------------------------------------


def test_a_top_k_of_at_least_the_vocabulary_cuts_nothing_in_any_head(engine):
    ids, vocab = engine.encode(PROMPT), engine.session.target.vocab_size

    def tokens(method: str, top_k: int) -> list[int]:
        # A fresh Method each time: a speculative method's draft budget learns across its calls.
        params = SamplingParams(temperature=0.7, top_k=top_k)
        return build_method(engine.session, method).decode(ids, 16, params, torch.Generator().manual_seed(1))[0]

    ar = tokens("ar", 0)
    assert ar != build_method(engine.session, "ar").decode(ids, 16, SamplingParams(), None)[0]  # it did sample
    for top_k in (vocab, vocab + 1, 10**9):
        for method in ("ar", "csv:screen", "csv:cluster"):  # the certified heads draw the full head's tokens
            assert tokens(method, top_k) == ar, (method, top_k)
    # A speculative loop draws its own way: its certified heads are checked against its full head.
    spec = tokens("spec:ngram", 0)
    assert tokens("spec:ngram", vocab - 1) != spec  # the cut matters here, so no cut is a real claim
    for method in ("spec:ngram", "spec:ngram+csv", "spec:ngram+csv:cluster"):
        assert tokens(method, vocab + 1) == spec, method


# --- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize("values, says", [
    ({"temperature": math.nan}, "temperature must be 0 (greedy) or a finite number >= 1e-06 (below it sampling is greedy in all but name), got nan"),
    ({"temperature": math.inf}, "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    ({"temperature": -0.5}, "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    ({"temperature": "0.7"}, "temperature must be 0 (greedy) or a finite number >= 1e-06 (below it sampling is greedy in all but name), got '0.7'"),
    ({"temperature": True}, "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    ({"top_k": 1.5}, "top_k must be an integer >= 0 (0 = off), got 1.5"),
    ({"top_k": True}, "top_k must be an integer >= 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_p": 0}, "top_p must be a finite number in (0, 1] (1 = off), got 0"),
    ({"top_p": math.nan}, "top_p must be a finite number in (0, 1]"),
    ({"epsilon": 1.0}, "epsilon must be None or a finite number in (0, 1)"),
    ({"epsilon": math.nan}, "epsilon must be None or a finite number in (0, 1)"),
    ({"temperature": 1.0, "top_k": 5, "epsilon": 0.1}, "epsilon applies to plain temperature sampling"),
    ({"temperature": 1.0, "top_p": 0.9, "epsilon": 0.1}, "epsilon applies to plain temperature sampling"),
    ({"top_k": 5}, "top_k (--top-k) applies to sampling, but temperature 0 is greedy"),
    ({"top_k": 5, "top_p": 0.9}, "top_k and top_p (--top-k, --top-p) apply to sampling, but temperature 0"),
], ids=["temperature-nan", "temperature-inf", "temperature-negative", "temperature-text", "temperature-bool",
        "top-k-fraction", "top-k-bool", "top-k-negative", "top-p-0", "top-p-nan", "epsilon-1", "epsilon-nan",
        "epsilon-with-top-k", "epsilon-with-top-p", "top-k-when-greedy", "top-k-and-top-p-when-greedy"])
def test_bad_sampling_params(values: dict, says: str):
    with pytest.raises(ValueError) as error:
        SamplingParams(**values)
    assert says in one_line(error)


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, None, 0.7], ids=["dict", "none", "number"])
def test_sampling_that_is_not_sampling_params(engine, sampling):
    with pytest.raises(TypeError) as error:
        engine.generate(PROMPT, "ar", sampling=sampling)
    assert "sampling must be a runtime.common.sampling.SamplingParams" in one_line(error)


@pytest.mark.parametrize("method", ["ar", "spec:ngram", "spec:ngram+csv"])
def test_epsilon_is_refused_where_no_csv_method_uses_it(engine, method: str):
    eps = SamplingParams(temperature=0.7, epsilon=0.1)
    with pytest.raises(ValueError) as error:
        engine.generate(PROMPT, method, eps)
    assert f"epsilon (--epsilon) applies to method csv only (its certified head), not {method}" in one_line(error)
    with pytest.raises(ValueError, match="applies to method csv only"):
        engine.bench([method], [PROMPT], max_new_tokens=2, sampling=eps)
    assert len(engine.generate(PROMPT, "csv", eps, max_new_tokens=3).wait().tokens) == 3


# --- strings where lists are expected ----------------------------------------------------------


def test_a_bare_stop_string_is_one_stop_string(engine):
    expected = engine.generate(PROMPT, "ar", max_new_tokens=12).wait().tokens
    stop = engine.tokenizer.decode(expected[2:3])  # "wN": as characters, its "w" would end at the first token
    end = next(i for i in range(len(expected)) if stop in engine.tokenizer.decode(expected[: i + 1]))
    assert end >= 1
    for given in (stop, [stop], (stop,)):
        assert engine.generate(PROMPT, "ar", max_new_tokens=12, stop=given).wait().tokens == expected[: end + 1]
    with pytest.raises(ValueError) as error:
        engine.generate(PROMPT, "ar", stop=[5])
    assert "stop must be a string or a list of strings" in one_line(error)


def test_a_bare_prompt_or_method_string_in_bench_is_one(engine):
    record = engine.bench("spec:ngram", PROMPT, max_new_tokens=2)
    assert record["setup"]["n"] == 1 and [row["method"] for row in record["methods"]] == ["ar", "spec:ngram"]
    with pytest.raises(ValueError) as error:
        engine.bench(["ar"], 5, max_new_tokens=2)
    assert "prompts must be a string or a list, got 5" in one_line(error)


# --- prompts, counts, methods ------------------------------------------------------------------


def test_token_ids_outside_the_vocabulary(engine):
    vocab = engine.session.target.vocab_size
    cases = (([5, vocab], vocab, 1), ([-1, 5], -1, 0), (torch.tensor([[5, 9, vocab + 7]]), vocab + 7, 2))
    for ids, bad, position in cases:
        with pytest.raises(ValueError) as error:
            engine.generate(ids, "ar")
        assert (f"token id {bad} (position {position}) is outside the model's vocabulary of {vocab} tokens; "
                f"give ids in 0..{vocab - 1}") in one_line(error)


@pytest.mark.parametrize("prompt", [[5.0, 9.0], [True], None, {"ids": [5]}], ids=["floats", "bools", "none", "dict"])
def test_a_prompt_that_is_neither_text_nor_token_ids(engine, prompt):
    with pytest.raises(TypeError) as error:
        engine.generate(prompt, "ar")
    assert "a prompt is text or a sequence of token ids (integers)" in one_line(error)


@pytest.mark.parametrize("arguments, says", [
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer >= 1, got 1.5"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer >= 1, got True"),
    ({"min_response_tokens": -1}, "min_response_tokens must be an integer >= 0 (0 = off), got -1"),
    ({"seed": 1.5}, "seed must be an integer in 0..9223372036854775807, got 1.5"),
    ({"seed": -1}, "seed must be an integer in 0..9223372036854775807, got -1"),
], ids=["max-new-tokens-fraction", "max-new-tokens-0", "max-new-tokens-bool", "min-response-negative",
        "seed-fraction", "seed-negative"])
def test_bad_counts(engine, arguments: dict, says: str):
    with pytest.raises(ValueError) as error:
        engine.generate(PROMPT, "ar", **arguments)
    assert says in one_line(error)
    with pytest.raises(ValueError, match=re.escape(says)):
        engine.bench(["ar"], [PROMPT], **{"max_new_tokens": 2, **arguments})


@pytest.mark.parametrize("method", [5, 2.0, ["ar"]], ids=["int", "float", "list"])
def test_a_method_that_is_neither_a_name_nor_a_method_spec(engine, method):
    with pytest.raises(TypeError) as error:
        engine.generate(PROMPT, method)
    says = "a method is a name in the grammar of runtime.methods (e.g. 'csv', 'spec:int8+csv') or a MethodSpec"
    assert says in one_line(error)
    with pytest.raises(TypeError, match="a method is a name"):
        engine.bench([method], [PROMPT], max_new_tokens=2)


# --- threads -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, usable_cores() + 1],
                         ids=["0", "negative", "fraction", "bool", "above-cores"])
def test_bad_thread_counts(threads):
    before = (decode_threads(), torch.get_num_threads())
    for call in (lambda: api.set_threads(threads), lambda: api.load("no-such-artifact", threads=threads)):
        with pytest.raises(ValueError) as error:
            call()
        assert f"threads must be an integer in 1..{usable_cores()} (the cores this process may use)" in one_line(error)
    assert (decode_threads(), torch.get_num_threads()) == before


def test_no_thread_count_means_every_core():
    with threads_restored():
        assert api.set_threads(None) == usable_cores() == decode_threads()
