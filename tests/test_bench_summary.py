"""`runtime bench-summary`: the headline table read back from bench records, and where they came from."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.bench import provenance
from runtime.bench.summary import SummaryError, headline_row, page_with_summary, reference_line, summary_markdown
from runtime.cli import main as runtime_main


def row(method: str, tok_s: float, preserving: bool = True, identical: float | None = 1.0) -> dict:
    return {"method": method, "tokens_per_s": tok_s, "distribution_preserving": preserving, "identical_to_ar": identical}


def record(model: str = "m", prompts: str = "humaneval", threads: int = 1, **setup) -> dict:
    methods = [row("ar", 20.0), row("llamacpp", 16.0, preserving=False, identical=0.5), row("spec:lookup+csv", 36.0),
               row("mjsd:int8", 50.0, preserving=False, identical=0.25), row("spec:ngram", 30.0, identical=11 / 12)]
    return {"command": "runtime bench ...", "methods": methods,
            "setup": {"model": model, "prompts": prompts, "n": 12, "max_new_tokens": 128, "threads": threads,
                      "temperature": 0.0, "peak_rss_mib": 1536.0, "screen_kernel": "avx2", "backend": "native", **setup}}


def test_the_best_exact_method_leaves_out_what_does_not_preserve_the_distribution():
    cells = headline_row(record())
    assert cells["best"] == "`spec:lookup+csv` 36.0"  # not the faster MJSD, which is not exact
    assert cells["best_vs_llamacpp"] == pytest.approx(36 / 16) and cells["ar_vs_llamacpp"] == pytest.approx(20 / 16)
    assert cells["exact_identical"] == "2 of 3"  # spec:ngram differed on a prompt: counted, not hidden
    assert cells["llamacpp_identical"] == 0.5 and cells["rss"] == 1.5
    assert cells["cell"] == "m, HumanEval (12 × 128)"


def test_llamacpps_fastest_variant_gets_its_own_columns(tmp_path: Path):
    plain, with_lookup = record(), record()
    with_lookup["methods"].append(row("llamacpp:lookup:4", 18.0, preserving=False, identical=0.25))
    assert headline_row(plain)["llamacpp_fastest"] is None  # plain llama.cpp alone: no extra columns
    cells = headline_row(with_lookup)
    assert cells["llamacpp_fastest"] == "`llamacpp:lookup:4` 18.0 (25%)"
    assert cells["best_vs_llamacpp_fastest"] == pytest.approx(36 / 18) and cells["best_vs_llamacpp"] == pytest.approx(36 / 16)
    paths = [tmp_path / "plain.json", tmp_path / "lookup.json"]
    for path, rec in zip(paths, (plain, with_lookup)):
        path.write_text(json.dumps(rec))
    assert "llama.cpp's fastest" not in summary_markdown(paths[:1]) and "llama.cpp's fastest" in summary_markdown(paths)


@pytest.mark.parametrize("binary, faster", [(18.0, "llamacpp:bin"), (15.0, "llamacpp")])
def test_ratios_are_against_the_faster_of_the_wrapper_and_the_binary(tmp_path: Path, binary: float, faster: str):
    """llama.cpp's own binary and llama-cpp-python's loop both ran: the headline is against the faster, naming both."""
    rec = record(llamacpp_bin_build="llama-server b1-0c1e570: CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 |")
    rec["methods"].append(row("llamacpp:bin", binary, preserving=False, identical=0.75))
    cells = headline_row(rec)
    fast = max(binary, 16.0)
    assert cells["llamacpp"] == fast and cells["ar_vs_llamacpp"] == pytest.approx(20 / fast)
    assert cells["best_vs_llamacpp"] == pytest.approx(36 / fast)
    other = "`llamacpp` 16.0" if faster == "llamacpp:bin" else f"`llamacpp:bin` {binary:.1f}"
    assert cells["llamacpp_as"] == f"`{faster}` ({other})"
    assert cells["llamacpp_identical"] == (0.75 if faster == "llamacpp:bin" else 0.5)
    assert cells["llamacpp_fastest"] is None  # two plain runs are not a variant
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rec))
    assert "llama-server b1-0c1e570 (SSE3 AVX2)" in summary_markdown([path])
    assert headline_row(record())["llamacpp_as"] == "`llamacpp`"  # the wrapper alone


def test_bench_prints_the_headline_against_the_faster_llamacpp_row():
    rec = record()
    rec["methods"].append(row("llamacpp:bin", 18.0, preserving=False, identical=0.75))
    assert reference_line(rec) == ("against llama.cpp, `llamacpp:bin` (`llamacpp` 16.0) 18.0 tok/s: native `ar` 1.11x, "
                                   "best exact `spec:lookup+csv` 36.0 2.00x")
    rec["methods"] = [r for r in rec["methods"] if not r["method"].startswith("llamacpp")]
    assert reference_line(rec) is None  # no llama.cpp row: nothing to say


def test_a_rate_of_zero_is_a_run_without_a_decode_step():
    """--max-new-tokens 1 records 0 tok/s (no decode step): summarized, with no ratio to it."""
    rec = record()
    rec["methods"][1] = row("llamacpp", 0.0, preserving=False, identical=0.5)
    cells = headline_row(rec)
    assert cells["llamacpp"] == 0.0 and cells["ar_vs_llamacpp"] is None and cells["best_vs_llamacpp"] is None


def test_llamacpp_variants_without_a_recorded_identity(tmp_path: Path):
    """Rows without identical_to_ar (an older record) still summarize: the cell just has no share."""
    rec = record()
    rec["methods"] += [{"method": "llamacpp:lookup", "tokens_per_s": 18.0, "distribution_preserving": False}]
    assert headline_row(rec)["llamacpp_fastest"] == "`llamacpp:lookup` 18.0"


def test_summary_sorts_cells_and_names_each_records_provenance(tmp_path: Path):
    paths = []
    for name, rec in {"b.json": record("qwen", "sharegpt", 2, code="abc1234", cpu="AMD EPYC; avx512f"),
                      "a.json": record("qwen", "humaneval", 1)}.items():
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(rec))
    text = summary_markdown(paths)
    lines = text.splitlines()
    assert "HumanEval" in lines[2] and "ShareGPT held-out" in lines[3]
    assert f"- {tmp_path / 'b.json'}: code abc1234; CPU AMD EPYC; avx512f; kernels avx2" in text
    assert f"- {tmp_path / 'a.json'}: code not recorded; CPU not recorded" in text


@pytest.mark.parametrize("content, fragment", [
    ("not json", "cannot be read (not JSON)"),
    (json.dumps({"methods": []}), "not a runtime bench record"),
    (json.dumps({**record(), "methods": [{"method": "ar"}]}), "methods without method and tokens_per_s"),
    (json.dumps(record(temperature=0.7)), "was sampled (temperature 0.7)"),
    (json.dumps(record(peak_rss_mib="big")), 'setup.peak_rss_mib is "big", not a number'),
    (json.dumps(record(peak_rss_mib=[1])), "setup.peak_rss_mib is [1], not a number"),
    (json.dumps(record(threads="two")), 'setup.threads is "two", not an integer'),
    (json.dumps(record(llamacpp_build=5)), "setup.llamacpp_build is 5, not text"),
    (json.dumps({**record(), "methods": [row("ar", 20.0), row("llamacpp", -1.0, preserving=False)]}),
     "llamacpp.tokens_per_s is -1.0, not a finite rate >= 0 (0: no decode step)"),
    (json.dumps({**record(), "methods": [row("ar", 20.0), row("llamacpp", 16.0, preserving=False, identical=1.5)]}),
     "llamacpp.identical_to_ar is 1.5, not a share in [0, 1]"),
    (json.dumps(record(peak_rss_mib=float("nan"))), "setup.peak_rss_mib is NaN, not a finite number >= 0"),
    (json.dumps({**record(), "methods": [row("ar", True)]}), "ar.tokens_per_s is true, not a number"),
    (json.dumps({**record(), "methods": [row("ar", 20.0), {**row("llamacpp", 16.0, preserving=False), "identical_to_ar": "yes"}]}),
     'llamacpp.identical_to_ar is "yes", not a number'),
], ids=["not-json", "no-setup", "row-without-speed", "sampled", "rss-text", "rss-list", "threads-text", "build-number",
        "negative-speed", "identity-above-1", "rss-nan", "speed-bool", "identity-text"])
def test_a_file_that_is_not_a_greedy_bench_record_is_a_one_line_error(tmp_path: Path, content: str, fragment: str):
    path = tmp_path / "r.json"
    path.write_text(content)
    result = CliRunner().invoke(runtime_main, ["bench-summary", str(path)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0] and "runtime bench" in errors[0], result.output


def test_code_version_is_this_checkouts_commit_or_none_outside_git(tmp_path: Path, monkeypatch):
    head = subprocess.run(["git", "-C", str(provenance.PACKAGE_ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not running from a git checkout")
    assert provenance.code_version().split("+")[0] == head.stdout.strip()
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", tmp_path)  # an installed copy: no checkout around it
    assert provenance.code_version() is None


def test_page_gets_the_table_between_its_markers_and_nothing_else_changes(tmp_path: Path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record()))
    page = tmp_path / "page.md"
    page.write_text("# Machine\n\nbefore\n<!-- bench-summary: transcribed by hand -->\n| old |\n<!-- /bench-summary -->\nafter\n")
    result = CliRunner().invoke(runtime_main, ["bench-summary", str(path), "--page", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    assert text.startswith("# Machine\n\nbefore\n<!-- bench-summary: runtime bench-summary ") and text.endswith(
        "<!-- /bench-summary -->\nafter\n")
    assert summary_markdown([path]) in text and "| old |" not in text
    assert page_with_summary(text, summary_markdown([path]), [path]) == text  # regenerating changes nothing


@pytest.mark.parametrize("page", ["no markers\n", "<!-- bench-summary -->\n<!-- /bench-summary -->\n" * 2])
def test_a_page_without_exactly_one_block_is_refused(page: str):
    with pytest.raises(SummaryError, match="not 1; put the two marker lines"):
        page_with_summary(page, "| t |", [])
