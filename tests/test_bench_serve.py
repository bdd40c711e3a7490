"""runtime bench-serve: its clients against a real server over a tiny engine, its figures, its bad inputs."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from factories import tiny_engine
from runtime.bench.load import Outcome, percentile, run_level, summarize
from runtime.cli import main
from runtime.cli.bench_serve import load_server
from serve_factories import model_name, running

PROMPTS = ["w5 w9 w31 w5 w9 w17", "w40 w41 w42", "hi w100"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("bench-serve"))


def test_clients_stream_every_request_and_the_probe_text_holds_under_load(engine):
    with running(engine) as (url, scheduler):
        rows = load_server("ours", url, PROMPTS, [1, 3], 12, 6, 60.0)
        outcomes, wall = run_level(url, model_name(engine), PROMPTS, 2, 12, 4, 60.0)
    assert [row["concurrency"] for row in rows] == [1, 3]
    for row in rows:
        assert row["requests"] == 7 and row["errors"] == 0 and row["probe_same_as_alone"] is True
        assert row["completion_tokens"] == 7 * 12 and row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert len(outcomes) == 4 and all(o.error is None and o.tokens == 12 and o.text for o in outcomes)
    assert sorted(o.prompt for o in outcomes) == [0, 0, 1, 2]  # the prompts in turn
    assert scheduler.metrics.peak_fused == 3  # the level of three clients shared forwards


def test_a_refused_request_counts_as_an_error(engine):
    with running(engine) as (url, _):
        outcomes, wall = run_level(url, "no-such-model", PROMPTS, 1, 4, 2, 60.0)
    summary = summarize(outcomes, wall)
    assert summary["errors"] == 2 and summary["error_examples"] == ["HTTP 404"] and summary["ttft_p50_s"] is None


def test_figures_from_outcomes():
    outcomes = [Outcome(0, None, 0.5, 2.5, 11, "a"), Outcome(1, None, 1.0, 2.0, 6, "b"), Outcome(2, "HTTP 503", None, 0.1, 0, "")]
    summary = summarize(outcomes, 4.0)
    assert summary["aggregate_tokens_per_s"] == 17 / 4.0 and summary["errors"] == 1
    assert summary["per_request_tokens_per_s"] == pytest.approx((10 / 2.0 + 5 / 1.0) / 2)
    assert summary["ttft_p50_s"] == 0.75 and percentile([1.0, 2.0, 3.0], 0.99) == pytest.approx(2.98)


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0,2"], "client counts from 1"),
    (["--concurrency", "1,1"], "--concurrency"),
    (["--servers", "vllm"], "name ours and/or llama-server"),
    (["--requests", "0"], "--requests"),
    (["--duration", "0"], "--duration"),
    (["--json", "out.md"], "ending in .json"),
])
def test_bad_options_fail_in_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["bench-serve", str(tmp_path / "art"), "--json", str(tmp_path / "s.json"), *args])
    assert result.exit_code != 0 and message in result.output and len(result.output.strip().splitlines()) == 1
