"""The Python API (runtime.api): streaming generation equals the loops' output, early close stops, bench rows."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from factories import tiny_engine
from runtime import api
from runtime.kernels import decode_threads, thread_stats, threads_restored
from runtime.kernels.build import usable_cores
from runtime.loops.decode import generate_ar
from runtime.methods import parse_method
from runtime.common.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("api"))


def test_generate_streams_the_tokens_plain_decoding_gives(engine):
    ids = engine.encode("w5 w9 w31 w5 w9")
    expected, _ = generate_ar(engine.session.target, engine.session.full_head(), ids, 12)
    for method in ("ar", "csv", "spec:ngram:gamma=3+csv", "spec:layers:1", None):  # None: default_method()
        run = engine.generate("w5 w9 w31 w5 w9", method=method, max_new_tokens=12)
        assert list(run) == expected and run.stats.new_tokens == len(expected)
        assert run.text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    assert engine.method("spec:layers:1") is engine.method("spec:layers:1")  # built once per name


def test_two_spellings_of_a_method_share_its_stream_and_keep_their_names(engine):
    short, long = engine.method("spec:lookup+csv"), engine.method("spec:lookup+csv:screen")
    assert short.stream is long.stream  # one lookup session and one draft budget, not two
    assert (short.name, long.name) == ("spec:lookup+csv", "spec:lookup+csv:screen")
    assert engine.method("spec:lookup+csv") is short
    run = engine.generate("w5 w9 w31 w5 w9", method="spec:lookup+csv:screen", max_new_tokens=8)
    assert list(run) == list(engine.generate("w5 w9 w31 w5 w9", method="ar", max_new_tokens=8))
    assert str(engine.default_method()) == "spec:lookup+csv:screen"  # the tiny artifact has the int8 screen, no screen4


def test_sampled_generation_is_reproducible_and_closing_early_stops(engine):
    params = SamplingParams(temperature=0.8)
    first = engine.generate([5, 9, 31], "spec:ngram", params, max_new_tokens=16, seed=3).wait().tokens
    assert first == engine.generate([5, 9, 31], "spec:ngram", params, max_new_tokens=16, seed=3).wait().tokens
    run = engine.generate([5, 9, 31], "csv", max_new_tokens=64)
    stream = iter(run)
    head = [next(stream) for _ in range(3)]
    stream.close()
    assert run.tokens == head
    with pytest.raises(RuntimeError, match="stopped before its end"):
        run.wait()


def test_a_finished_generation_iterates_to_nothing_more(engine):
    run = engine.generate("w5 w9 w31 w5 w9", method="spec:ngram", max_new_tokens=12)
    tokens = list(run)
    assert run.wait().tokens == tokens and list(run) == [] and run.stats.new_tokens == len(tokens)


def test_decoding_runs_in_the_iterating_thread(engine, monkeypatch):
    # A loop on another Python thread gets a second OpenMP pool, and libgomp then stops spinning
    # (runtime.loops.decode): every forward must run on the thread that iterates.
    target, threads = engine.session.target, set()
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: (threads.add(threading.get_ident()), forward(*a, **k))[1])
    for method in ("ar", "spec:ngram:gamma=3+csv"):
        assert list(engine.generate("w5 w9 w31 w5 w9", method=method, max_new_tokens=12))
    assert threads == {threading.get_ident()}


def test_errors_surface_where_the_caller_iterates(engine):
    with pytest.raises(ValueError, match="unknown method"):
        engine.generate("hi", method="warp")
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], method="ar")


def test_bench_puts_ar_first_and_reports_identity_and_peak_rss(engine):
    record = engine.bench(["csv", "spec:ngram"], ["w5 w9 w31 w5 w9", "hi w7 w8 w7 w8"], max_new_tokens=8)
    assert [row["method"] for row in record["methods"]] == ["ar", "csv", "spec:ngram"]
    assert all(row["identical_to_greedy"] == 1.0 and row["distribution_preserving"] for row in record["methods"])
    assert record["setup"]["n"] == 2 and record["setup"]["peak_rss_mib"] > 0
    with pytest.raises(ValueError, match="'spec:ngram' is listed twice"):  # two runs would be reported as one row
        engine.bench(["spec:ngram", "spec:ngram"], ["hi w7 w8"], max_new_tokens=2)
    with pytest.raises(ValueError, match="'csv:screen' names the same method as 'csv'"):
        engine.bench(["csv", parse_method("csv:screen")], ["hi w7 w8"], max_new_tokens=2)


def test_bench_starts_every_prompt_fresh_unless_the_session_is_kept(engine):
    # A prompt run twice: a fresh lookup session drafts the second run as it did the first; a kept one
    # drafts the first run's output from memory, so it accepts more.
    def lookup_row(**options):
        record = engine.bench(["spec:lookup"], ["w3 w4 w11 w3 w4 w12"] * 2, max_new_tokens=24, **options)
        return record["setup"]["drafter_session"], record["methods"][1]

    alone = engine.bench(["spec:lookup"], ["w3 w4 w11 w3 w4 w12"], max_new_tokens=24)["methods"][1]
    (fresh_note, fresh), (kept_note, kept) = lookup_row(), lookup_row(keep_session=True)
    assert (fresh_note, kept_note) == ("new per prompt", "kept across prompts")
    assert fresh["mean_accepted_length"] == alone["mean_accepted_length"]
    assert kept["mean_accepted_length"] > fresh["mean_accepted_length"]
    assert fresh["identical_to_greedy"] == kept["identical_to_greedy"] == 1.0


def test_set_threads():
    with threads_restored():
        assert api.set_threads(1) == 1 == decode_threads()
        assert api.set_threads() == usable_cores() == decode_threads()
        with pytest.raises(ValueError, match="the cores this process may use"):
            api.set_threads(100_000)  # more threads than cores only stall each other


def test_a_session_decodes_each_step_on_its_own_threads_and_puts_the_default_back(engine):
    seen = []

    def stream():
        for token in (5, 9):
            seen.append((decode_threads(), bool(thread_stats().get("adaptive"))))
            yield token
        return [5, 9], None

    with threads_restored():
        default = (api.set_threads(), bool(thread_stats().get("adaptive")))  # every core; adaptive with kernels
        run = api.Generation(engine.tokenizer, stream(), None, replace(engine.session, threads=1).decoding)
        assert list(run) == [5, 9] and seen == [(1, False), (1, False)]
        assert (decode_threads(), bool(thread_stats().get("adaptive"))) == default


def test_load_records_the_threads_on_the_session(engine, monkeypatch):
    root = engine.session.artifact.path.parent
    monkeypatch.setenv("SPECVOCAB_CACHE", str(root / "cache"))
    with threads_restored():
        default = api.set_threads()
        one = api.load(engine.session.artifact.path, threads=1, progress=False)
        assert (one.session.threads, engine.session.threads) == (1, None)
        ids = engine.encode("w5 w9 w31 w5 w9")
        assert list(one.generate(ids, method="spec:layers:1", max_new_tokens=8)) == list(engine.generate(ids, max_new_tokens=8))
        assert decode_threads() == default
