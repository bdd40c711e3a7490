"""Bad `runtime` flag values, prompts and output paths: one line naming the fix, before the model loads.

Every case here runs with the model load replaced by a failure (`no_model_load`): a case that got as
far as loading the model would end in that AssertionError instead of a clean exit, so each error
below is shown to come before the 10-15 s load. The artifact, the input files and the model cache
are compared before and after, and no output file appears.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bad_helpers import runtime_fails

USAGE = 2  # click's exit code for a bad option value


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flag error")

    monkeypatch.setattr("runtime.api.load", refuse)


def generate(art: Path, *flags) -> list:
    return ["generate", art, "--prompt", "w3 w4", *flags]


@pytest.mark.parametrize("flags, says", [
    (["--temperature", "nan"], "temperature must be 0 (greedy) or a finite number >= 1e-06 (below it sampling is greedy in all but name), got nan"),
    (["--temperature", "inf"], "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    (["--temperature", "-0.5"], "0 (greedy) or a finite number >= 1e-06 (below it sampling is greedy in all but name), got -0.5"),
    (["--temperature", "1e-38"], "(below it sampling is greedy in all but name), got 1e-38"),
    (["--top-p", "0"], "top_p must be a finite number in (0, 1] (1 = off)"),
    (["--top-p", "1.5"], "a finite number in (0, 1]"),
    (["--top-k", "-1"], "top_k must be an integer >= 0 (0 = off), got -1"),
    (["--top-k", "1.5"], "top_k must be an integer >= 0 (0 = off), got '1.5'"),
    (["--max-new-tokens", "0"], "give an integer >= 1"),
    (["--max-new-tokens", "-1"], "give an integer >= 1"),
    (["--epsilon", "1"], "a finite number in (0, 1)"),
    (["--seed", "-1"], "give an integer in [0,"),
    (["--seed", str(2**64)], "give an integer in [0,"),
    (["--threads", "0"], "give an integer in [1,"),
    (["--threads", "100000"], "(the cores this process may use)"),
    (["--threads", "\u0661"], "give an integer in [1,"),
    (["--top-k", "\u0663"], "top_k must be an integer >= 0 (0 = off), got '\u0663'"),
    (["--temperature", "\u0660.5"], "temperature must be 0 (greedy) or a finite number >= 1e-06"),
    (["--cluster-budget", "nan"], "give a finite number in (0, 1]"),
    (["--gamma", "9", "--method", "spec"], "give an integer in [1, 8]"),
    (["--stop", "\\x"], "bad escape '\\x'"),
    (["--stop", "end\\q"], "allowed escapes"),
    (["--stop", ""], "is empty"),
], ids=["temperature-nan", "temperature-inf", "temperature-negative", "temperature-tiny", "top-p-0", "top-p-above-1", "top-k-negative", "top-k-fraction",
        "max-new-tokens-0", "max-new-tokens-negative", "epsilon-1", "seed-negative", "seed-overflow", "threads-0", "threads-above-cores",
        "threads-arabic-indic-digit", "top-k-arabic-indic-digit", "temperature-arabic-indic-digit",
        "cluster-budget-nan", "gamma-above-max", "stop-bad-hex-escape", "stop-unknown-escape", "stop-empty"])
def test_bad_generate_values(art: Path, flags: list[str], says: str):
    line = runtime_fails(generate(art, *flags), says, code=USAGE, unchanged=(art,))
    assert f"'{flags[0]}'" in line  # the option is named


@pytest.mark.parametrize("method, says", [
    ("spec:ngram:gamma=abc", "gamma takes an integer in 1..8, not 'abc'"),
    ("spec:ngram:gamma=0", "gamma takes an integer in 1..8"),
    ("spec:layers:abc", "layers:N takes an integer >= 1"),
    ("dynaspec:int8:k=abc", "k takes an integer >= 1"),
    ("warp", "unknown method 'warp'"),
    ("csv+csv", "+csv applies to drafting methods"),
    ("spec:int8:no-verifier+csv", "a +csv head would verify nothing; drop the +csv suffix: spec:int8:no-verifier"),
], ids=["gamma-not-int", "gamma-0", "layers-not-int", "dynaspec-k-not-int", "unknown-method", "csv-plus-csv", "no-verifier-plus-csv"])
def test_bad_method_names(art: Path, method: str, says: str):
    line = runtime_fails(generate(art, "--method", method), says, code=USAGE, unchanged=(art,))
    assert "invalid literal" not in line and "'--method'" in line  # the option is named, as bench's --methods


def test_a_bad_method_made_by_the_alias_flags_names_the_method_they_made(art: Path):
    """The flags write the method together, so the error shows what they wrote, not one flag as the culprit."""
    runtime_fails(generate(art, "--method", "spec", "--drafter", "warp"), "unknown drafter", "made: spec:warp", code=USAGE,
                  unchanged=(art,))
    line = runtime_fails(generate(art, "--method", "spec", "--drafter", "gp:256", "--no-verifier", "--target-head", "csv"),
                         "drop the +csv suffix: spec:gp:256:no-verifier", code=USAGE, unchanged=(art,))
    assert "made: spec:gp:256:no-verifier+csv:screen" in line and "'--drafter'" not in line


def test_sampling_options_without_a_temperature(art: Path):
    """Greedy decoding would ignore them: refused before the model loads, not silently dropped."""
    runtime_fails(generate(art, "--method", "csv", "--top-p", "0.9"),
                  "top_p (--top-p) applies to sampling, but temperature 0 is greedy: give a temperature above 0",
                  unchanged=(art,))


def test_epsilon_without_a_csv_method_is_refused_before_the_model_loads(art: Path):
    sampled = ["--temperature", "0.7", "--epsilon", "0.1"]
    runtime_fails(generate(art, "--method", "spec:ngram+csv", *sampled),
                  "epsilon (--epsilon) applies to method csv only (its certified head), not spec:ngram+csv", unchanged=(art,))
    runtime_fails(generate(art, *sampled), "not the default method", unchanged=(art,))
    runtime_fails(["bench", art, "--methods", "ar,spec:ngram", "--json", art.parent / "b.json", *sampled], "not ar, spec:ngram",
                  unchanged=(art,))


def test_epsilon_with_top_k_or_top_p(art: Path):
    for flag in (["--top-k", "5"], ["--top-p", "0.9"]):
        runtime_fails(generate(art, "--method", "csv", "--temperature", "0.7", "--epsilon", "0.1", *flag),
                      "epsilon applies to plain temperature sampling: drop top_k and top_p (--top-k, --top-p) or epsilon",
                      unchanged=(art,))


def test_a_non_utf8_byte_in_prompt(art: Path):
    # A byte that is not UTF-8 in argv reaches Python as a lone surrogate (surrogateescape).
    runtime_fails(["generate", art, "--prompt", "w3 \udcff w4"], "'--prompt'", "not UTF-8", "--prompt-file",
                  code=USAGE, unchanged=(art,))


def test_an_empty_prompt(art: Path):
    runtime_fails(["generate", art, "--prompt", ""], "--prompt is empty", code=USAGE, unchanged=(art,))


@pytest.mark.parametrize("content, says", [
    (b"w3 w4 \x00\x01\x02 w5", "is a binary file (a NUL byte at offset 6)"),
    ("w3 caf\u00e9 w4".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 6); save it as UTF-8"),
], ids=["binary", "latin-1"])
def test_a_prompt_file_that_is_not_utf8(art: Path, tmp_path: Path, content: bytes, says: str):
    path = tmp_path / "prompt.txt"
    path.write_bytes(content)
    line = runtime_fails(["generate", art, "--prompt-file", path], says, code=USAGE, unchanged=(art, tmp_path))
    assert "'--prompt-file'" in line and str(path) in line


def test_a_prompt_file_that_is_a_directory(art: Path, tmp_path: Path):
    runtime_fails(["generate", art, "--prompt-file", tmp_path], "is a directory; give a text file", code=USAGE)


def test_a_missing_prompt_file(art: Path, tmp_path: Path):
    runtime_fails(["generate", art, "--prompt-file", tmp_path / "nope.txt"], "No such file", "check the path", code=USAGE)


def bench(art: Path, tmp_path: Path, *flags) -> list:
    return ["bench", art, "--methods", "ar", "--max-new-tokens", 2, "--json", tmp_path / "out" / "b.json", *flags]


@pytest.mark.parametrize("content, says", [
    (b"[]", "holds no prompts ([]); add at least one"),
    (b"not json", "not JSON"),
    (json.dumps({"text": "w3"}).encode(), "should hold a JSON list"),
    (json.dumps([{"txt": "w3"}]).encode(), "item 0 should be an object with a string \"text\" field"),
    (b"[{\"text\": \"w3\xff\"}]", "is not UTF-8 text (byte 0xff"),
    (json.dumps([{"text": "w3"}, {"text": ""}]).encode(), "item 1 has an empty \"text\"; give it some text"),
], ids=["empty-list", "not-json", "not-a-list", "no-text-field", "not-utf8", "empty-text"])
def test_bad_prompts_files(art: Path, tmp_path: Path, content: bytes, says: str):
    prompts = tmp_path / "prompts.json"
    prompts.write_bytes(content)
    line = runtime_fails(bench(art, tmp_path, "--prompts", prompts), says, code=USAGE, unchanged=(art, tmp_path))
    assert "'--prompts'" in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, says", [
    (["-n", "0"], "give an integer >= 1"),
    (["-n", "-1"], "give an integer >= 1"),
    (["--prompts", "nothing-here.json"], "neither humaneval nor sharegpt nor an existing file"),
    (["--methods", ","], "',' names nothing; e.g. --methods ar,csv:screen"),
    (["--methods", ""], "'' names nothing; e.g. --methods ar,csv:screen"),
    (["--methods", "ar,,csv"], "'ar,,csv' has an empty item (a stray comma?); write --methods ar,csv"),
    (["--methods", "ar, ,csv"], "'ar, ,csv' has an empty item (a stray comma?); write --methods ar,csv"),
    (["--methods", "ar,"], "'ar,' has an empty item (a stray comma?); write --methods ar"),
    (["--methods", "ar,spec:ngram:gamma=x"], "gamma takes an integer"),
    (["--methods", "ar,spec:ngram,spec:ngram"], "lists 'spec:ngram' twice; list each once: --methods ar,spec:ngram"),
    (["--methods", "ar, ar "], "lists 'ar' twice; list each once: --methods ar"),
    (["--methods", "ar,csv,csv:screen"], "'csv:screen' names the same method as 'csv'"),
    (["--methods", "ar,spec:ngram:gamma=6:gamma=3"], "gamma is given twice"),
    (["--methods", "ar,swarm:lookup:4:nodes=8:nodes=9"], "swarm's nodes is given twice"),
    (["--json", "."], "it names a directory; give a file path"),
    (["--json", ""], "it names a directory; give a file path"),
    (["--json", "run.md"], "the .md output goes beside the JSON and would replace it"),
], ids=["n-0", "n-negative", "prompts-missing", "methods-comma-alone", "methods-empty", "methods-empty-item", "methods-blank-item",
        "methods-trailing-comma", "methods-bad-gamma", "methods-twice", "methods-twice-with-spaces", "methods-same-twice",
        "option-twice", "own-option-twice", "json-dot", "json-empty", "json-named-like-its-table"])
def test_bad_bench_values(art: Path, tmp_path: Path, flags: list[str], says: str):
    runtime_fails(bench(art, tmp_path, *flags), says, code=USAGE, unchanged=(art,))
    assert not (tmp_path / "out").exists()


def test_bench_never_replaces_an_earlier_run_without_force(art: Path, tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "b.md").write_text("an earlier run's table")
    runtime_fails(bench(art, tmp_path), f"{out / 'b.md'} exists (an earlier run's output)", "--force", code=USAGE,
                  unchanged=(tmp_path,))
    runtime_fails(["bench-verify", art, "--json", out / "b.md"], "exists", "--force", code=USAGE, unchanged=(tmp_path,))


@pytest.mark.parametrize("command", ["bench", "bench-verify", "bench-screen"])
@pytest.mark.parametrize("name", ["manifest.json", "screen.safetensors"])
def test_an_output_never_replaces_an_artifacts_file_even_with_force(art: Path, command: str, name: str):
    runtime_fails([command, art, "--json", art / name, "--force"], f"cannot write {art / name}: it is a file of the "
                  f"artifact in {art}; choose another path", code=USAGE, unchanged=(art,))


@pytest.mark.parametrize("command", ["bench", "bench-verify"])
def test_a_json_path_ending_in_a_slash_is_a_folder(art: Path, tmp_path: Path, command: str):
    runtime_fails([command, art, "--json", f"{tmp_path / 'out'}/"], "it names a directory; give a file path", code=USAGE,
                  unchanged=(art, tmp_path))
    assert not (tmp_path / "out").exists()


def test_bench_json_under_a_file(art: Path, tmp_path: Path):
    (tmp_path / "file").write_text("keep")
    line = runtime_fails(["bench", art, "--methods", "ar", "--json", tmp_path / "file" / "b.json"],
                         "is not a directory", "choose a writable path", code=USAGE, unchanged=(art, tmp_path))
    assert "'--json'" in line


def test_bench_json_beside_a_directory_named_like_its_plot(art: Path, tmp_path: Path):
    (tmp_path / "b.png").mkdir()  # write_reports would fail on b.png only after the whole run
    runtime_fails(["bench", art, "--methods", "ar", "--json", tmp_path / "b.json"], f"cannot write {tmp_path / 'b.png'}",
                  "it is a directory", code=USAGE, unchanged=(art, tmp_path))
    assert not (tmp_path / "b.json").exists()


def test_bench_verify_json_that_is_a_directory(art: Path, tmp_path: Path):
    runtime_fails(["bench-verify", art, "--json", tmp_path], "it is a directory", code=USAGE, unchanged=(art,))


@pytest.mark.parametrize("command, flags, says", [
    ("bench-verify", ["--context", "0"], "give an integer >= 1"),
    ("bench-verify", ["--max-n", "-2"], "give an integer in [1, 16]"),
    ("bench-verify", ["--max-n", "1000"], "give an integer in [1, 16]"),
    ("bench-kernels", ["--repeats", "0"], "give an integer >= 1"),
    ("bench-kernels", ["--prompt", "def \udcfe"], "not UTF-8"),
    ("bench-kernels", ["--prompt", ""], "is empty; give some text"),
    ("bench-kernels", ["--threads", "-1"], "give an integer in [1,"),
], ids=["verify-context-0", "verify-max-n-negative", "verify-max-n-above-16", "kernels-repeats-0", "kernels-prompt-not-utf8",
    "kernels-prompt-empty", "kernels-threads"])
def test_bad_bench_verify_and_kernels_values(art: Path, command: str, flags: list[str], says: str):
    runtime_fails([command, art, *flags], says, code=USAGE, unchanged=(art,))


def test_min_response_tokens_without_chat_is_refused(art: Path, tmp_path: Path):
    """It applies to a chat response's first tokens; without --chat it would be ignored without a word."""
    runtime_fails(generate(art, "--min-response-tokens", "5"), "--min-response-tokens applies with --chat", code=USAGE,
                  unchanged=(art,))
    runtime_fails(bench(art, tmp_path, "--min-response-tokens", "0"), "add --chat or drop it", code=USAGE, unchanged=(art,))
    assert not (tmp_path / "out").exists()


def test_bench_verify_bound_without_the_certified_head_is_refused(art: Path):
    runtime_fails(["bench-verify", art, "--bound", "cluster"], "--bound goes with --head csv", code=USAGE, unchanged=(art,))


@pytest.mark.parametrize("formats, says", [
    ("q4_0,q4_0", "lists 'q4_0' twice; list each once: --formats q4_0"),
    ("q4_0, q4_0 ", "lists 'q4_0' twice; list each once: --formats q4_0"),
    ("q4_0,,q8_row", "has an empty item (a stray comma?); write --formats q4_0,q8_row"),
    ("q4_0, ,q8_row", "has an empty item (a stray comma?); write --formats q4_0,q8_row"),
    ("q4_0,", "has an empty item (a stray comma?); write --formats q4_0"),
    (",", "names nothing; e.g. --formats q4_0,q8_row"),
    ("", "names nothing; e.g. --formats q4_0,q8_row"),
    ("q4_0,q3", "unknown format 'q3'; choose from q4_0, q4_1"),
], ids=["twice", "twice-with-spaces", "empty-item", "blank-item", "trailing-comma", "comma-alone", "empty", "unknown"])
def test_bad_bench_screen_formats(art: Path, formats: str, says: str):
    line = runtime_fails(["bench-screen", art, "--formats", formats], says, code=USAGE, unchanged=(art,))
    assert "Invalid value for --formats:" in line


@pytest.mark.parametrize("trees, says", [
    ("4,4", "lists '4' twice; list each once: --trees 4"),
    ("4, 8,4 ", "lists '4' twice; list each once: --trees 4,8"),
    ("4,,8", "has an empty item (a stray comma?); write --trees 4,8"),
    ("4, ,8", "has an empty item (a stray comma?); write --trees 4,8"),
    ("4,", "has an empty item (a stray comma?); write --trees 4"),
    (",", "names nothing; e.g. --trees 4,8,16"),
    ("", "names nothing; e.g. --trees 4,8,16"),
    ("4,x", "'x' is not a node count in 1..64; e.g. --trees 4,8,16, or --trees none"),
    ("0", "'0' is not a node count in 1..64"),
    ("65", "'65' is not a node count in 1..64"),
    ("\u0664", "is not a node count in 1..64"),
], ids=["twice", "twice-with-spaces", "empty-item", "blank-item", "trailing-comma", "comma-alone", "empty", "not-a-number",
        "zero", "above-64", "non-ascii-digit"])
def test_bad_bench_verify_trees(art: Path, trees: str, says: str):
    line = runtime_fails(["bench-verify", art, "--trees", trees], says, code=USAGE, unchanged=(art,))
    assert "Invalid value for --trees:" in line
