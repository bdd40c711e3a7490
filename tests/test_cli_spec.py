"""`runtime generate --method spec` on a tiny random Llama directory (CliRunner, in process): the
speculative text equals plain decoding's for every drafter and target head, and the drafting stats
are printed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from factories import tiny_artifact
from runtime.cli import main as runtime_main
from runtime.kernels import kernel_name
from runtime.kernels.build import cpu_description

# The tiny tokenizer is word-level: the template joins the turns and ends with a generation prompt.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}hi{% endif %}"
PROMPT = "hi w5 w9 w5 w9 w5"
pytestmark = pytest.mark.usefixtures("private_cache")  # conftest: never the user's model cache


def invoke(args: list) -> Result:
    return CliRunner().invoke(runtime_main, [str(a) for a in args])


@pytest.fixture(scope="module")
def artifact(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """`prep cluster` on a copy of the tiny model whose tokenizer has a chat template."""
    root = tmp_path_factory.mktemp("cli-spec")
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return tiny_artifact(model, root)


def generate(artifact: Path, *extra) -> Result:
    result = invoke(["generate", artifact, "--prompt", PROMPT, "--max-new-tokens", 12, *extra])
    assert result.exit_code == 0, result.output
    return result


SPEC_RUNS = {
    "ngram": ["--drafter", "ngram"],
    "ngram2-gamma2": ["--drafter", "ngram:2", "--gamma", "2"],
    "layers1-adaptive": ["--drafter", "layers:1", "--adaptive"],
    "layers1-csv": ["--drafter", "layers:1", "--target-head", "csv"],
    "ngram-csv-cluster": ["--drafter", "ngram", "--target-head", "csv", "--bound", "cluster"],
}


@pytest.mark.parametrize("extra", SPEC_RUNS.values(), ids=SPEC_RUNS.keys())
def test_generate_spec_prints_the_same_text_as_ar(artifact: Path, extra):
    reference = generate(artifact, "--method", "ar").stdout
    assert reference.strip(), "the tiny model produced no text: the comparison tests nothing"
    result = generate(artifact, "--method", "spec", *extra)
    assert result.stdout == reference
    drafter = extra[1]
    assert f"[spec:{drafter}" in result.stderr
    for fragment in ("tok/s decode", "mean accepted length", "acceptance", "predicted"):
        assert fragment in result.stderr, fragment
    if "csv" in extra:
        assert "+csv:" in result.stderr


@pytest.mark.parametrize("extra", SPEC_RUNS.values(), ids=SPEC_RUNS.keys())
def test_the_alias_flags_name_their_method_spelling_and_it_runs_the_same(artifact: Path, extra):
    """Deprecated for one release: the note's --method spelling runs the same method, token for token."""
    aliased = generate(artifact, "--method", "spec", *extra)
    note = next(line for line in aliased.stderr.splitlines() if "deprecated" in line)
    assert extra[0] in note and "removed in the next release" in note
    spelled = note.rpartition("--method ")[2]
    assert generate(artifact, "--method", spelled).stdout == aliased.stdout
    assert "deprecated" not in generate(artifact, "--method", spelled).stderr


def test_generate_spec_with_chat_and_the_guard_matches_ar(artifact: Path):
    for guard in ("0", "4"):
        chat = ["--chat", "--min-response-tokens", guard]
        reference = generate(artifact, "--method", "ar", *chat).stdout
        for drafter in ("ngram", "layers:1"):
            assert generate(artifact, "--method", "spec", "--drafter", drafter, *chat).stdout == reference


def test_generate_spec_sampled_runs(artifact: Path):
    first = generate(artifact, "--method", "spec", "--drafter", "layers:1", "--temperature", "0.8", "--seed", "3")
    again = generate(artifact, "--method", "spec", "--drafter", "layers:1", "--temperature", "0.8", "--seed", "3")
    assert first.stdout == again.stdout and first.stdout.strip()


@pytest.mark.parametrize("extra, fragment", [
    (["--drafter", "draft-model"], "unknown drafter"),
    (["--drafter", "layers:2"], "layers:N"),  # the tiny model has 2 layers: N must be below that
    (["--gamma", "0"], "gamma"),
    (["--bound", "cluster"], "--bound goes with --method csv or --target-head csv"),  # not silently dropped
    (["--cluster-budget", "0.1"], "--cluster-budget and --adaptive-budget go with the cluster bound"),
    (["--target-head", "csv", "--adaptive-budget"], "go with the cluster bound"),  # +csv:screen has no budget
], ids=["unknown", "too-deep", "gamma", "bound-without-certified-head", "budget-without-cluster-bound",
        "adaptive-budget-on-the-screen"])
def test_generate_spec_bad_options_are_clean_errors(artifact: Path, extra, fragment):
    result = invoke(["generate", artifact, "--method", "spec", *extra, "--prompt", "hi", "--max-new-tokens", 2])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output


def test_bench_verify_prints_the_ratio_table(artifact: Path, tmp_path: Path):
    words = " ".join(f"w{4 + i % 200}" for i in range(60))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": words}]))
    for head in ("full", "csv"):
        out = tmp_path / f"verify-{head}.json"  # a run never replaces an earlier one's record
        result = invoke(["bench-verify", artifact, "--head", head, "--prompts", prompts, "--context", 20,
                         "--max-n", 4, "--repeats", 2, "--json", out])
        assert result.exit_code == 0, result.output
        assert "T_V(n) / T_V(1)" in result.stdout and "| 4 |" in result.stdout
        assert "best gamma" in result.stdout
        record = json.loads(out.read_text())
        assert [row["n"] for row in record["rows"]] == [1, 2, 3, 4] and record["rows"][0]["ratio"] == 1.0
        assert record["setup"]["head"] == ("full" if head == "full" else "csv:screen")
        assert record["setup"]["cpu"] == cpu_description() and "code" in record["setup"]  # which machine and commit
        assert record["setup"]["screen_kernel"] == kernel_name() and f"({kernel_name()} kernels)" in result.stdout  # which path ran
    short = invoke(["bench-verify", artifact, "--prompts", prompts, "--context", 100])
    assert short.exit_code != 0 and "--context" in short.output and "Traceback" not in short.output


def test_bench_verify_says_what_its_full_head_rows_mean(artifact: Path, tmp_path: Path, monkeypatch):
    """A near-tie in the fixed text sends a row to the full head in every repeat: the table gets the
    column and a line saying why those T_V(n) are high and how to move the text."""
    import runtime.bench.verify_cost as verify_cost_module

    timed = verify_cost_module.verify_cost

    def with_a_near_tie(*args, **kwargs):
        rows = timed(*args, **kwargs)
        rows[1]["head_fallbacks"] = 1.0  # n = 2: one row per forward to the full head
        return rows

    monkeypatch.setattr(verify_cost_module, "verify_cost", with_a_near_tie)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": " ".join(f"w{4 + i % 200}" for i in range(60))}]))
    result = invoke(["bench-verify", artifact, "--head", "csv", "--prompts", prompts, "--context", 20,
                     "--max-n", 2, "--repeats", 1])
    assert result.exit_code == 0, result.output
    assert "| full-head rows |" in result.stdout
    note = next(line for line in result.stdout.splitlines() if line.startswith("full-head rows:"))
    assert "near-tie" in note and "--context" in note


def test_bench_rows_carry_draft_verify_cost_and_predicted_throughput(artifact: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": PROMPT}, {"text": "w7 w8 hi w7 w8"}]))
    out = tmp_path / "b.json"
    result = invoke(["bench", artifact, "--prompts", prompts, "--methods", "ar,spec:ngram", "-n", 2,
                     "--max-new-tokens", 12, "--json", out])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(out.read_text())["methods"]}
    assert rows["spec:ngram"]["identical_to_greedy"] == 1.0
    assert rows["spec:ngram"]["predicted_tokens_per_s"] > 0
    assert rows["spec:ngram"]["verify_ms_per_round"] > 0 and rows["spec:ngram"]["draft_ms_per_token"] >= 0
    assert "predicted_tokens_per_s" not in rows["ar"] and "verify_ms_per_round" not in rows["ar"]
    table = out.with_suffix(".md").read_text()
    assert "predicted tok/s" in table and "T_D ms" in table and "T_V ms" in table
