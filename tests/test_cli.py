"""The `prep` and `runtime` command lines on a tiny random Llama directory (CliRunner, in process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from prep.cli import main as prep_main
from runtime.cli import main as runtime_main

STAGE_FILES = ("clusters.safetensors", "screen.safetensors")
pytestmark = pytest.mark.usefixtures("private_cache")  # conftest: never the user's model cache


def invoke(command, args: list[str]) -> Result:
    return CliRunner().invoke(command, [str(a) for a in args])


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `path`: bytes and modification time, to prove nothing was rewritten."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def assert_clean_error(result: Result, *fragments: str) -> str:
    """A non-zero exit through click (no traceback) whose `Error:` message is one line naming the fragments."""
    assert result.exit_code != 0, result.output
    assert isinstance(result.exception, SystemExit), f"uncaught {result.exception!r}"
    assert "Traceback" not in result.output and "Usage:" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def artifact(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """`prep cluster` run once on the tiny model; tests that damage it work on a copy."""
    out = tmp_path_factory.mktemp("cli") / "art"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(out.parent / "cache"))
        result = invoke(prep_main, ["cluster", tiny_model_dir, "-o", out, "--clusters", 8])
    assert result.exit_code == 0, result.output
    assert "stages clusters, screen written" in result.output
    return out


@pytest.fixture
def artifact_copy(artifact: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    return copy


def test_prep_cluster_writes_both_stages(artifact: Path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"clusters", "screen"}
    assert manifest["stages"]["clusters"]["params"]["clusters_requested"] == 8
    assert manifest["model"]["vocab_size"] == 256 and manifest["model"]["hidden_size"] == 64
    for name in STAGE_FILES:
        assert (artifact / name).stat().st_size > 0


def test_prep_cluster_refuses_to_overwrite_without_force(tiny_model_dir: Path, artifact_copy: Path):
    before = snapshot(artifact_copy)
    same = invoke(prep_main, ["cluster", tiny_model_dir, "-o", artifact_copy, "--clusters", 8])
    assert same.exit_code == 0 and "kept" in same.output, same.output  # same parameters: the stages are kept
    result = invoke(prep_main, ["cluster", tiny_model_dir, "-o", artifact_copy, "--clusters", 4])
    assert_clean_error(result, "--force")
    assert snapshot(artifact_copy) == before

    forced = invoke(prep_main, ["cluster", tiny_model_dir, "-o", artifact_copy, "--clusters", 4, "--force"])
    assert forced.exit_code == 0, forced.output
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    assert manifest["stages"]["clusters"]["params"]["clusters_requested"] == 4


def test_inspect_shows_both_stages(artifact: Path):
    result = invoke(runtime_main, ["inspect", artifact])
    assert result.exit_code == 0, result.output
    assert "[clusters]" in result.output and "[screen]" in result.output
    assert "stages: clusters, screen" in result.output
    assert "valid: yes" in result.output and "checksum ok" in result.output


def test_inspect_check_model_accepts_the_right_model(artifact: Path):
    result = invoke(runtime_main, ["inspect", artifact, "--check-model"])
    assert result.exit_code == 0, result.output
    assert "valid: yes" in result.output and "model check: " in result.output and "matches its fingerprint" in result.output
    assert "model check" not in invoke(runtime_main, ["inspect", artifact]).output  # nothing compared: nothing claimed


def corrupt(path: Path) -> None:
    """Flip one byte in the middle of a file (size unchanged: only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupted_stage_is_refused(artifact_copy: Path):
    corrupt(artifact_copy / "screen.safetensors")
    inspected = invoke(runtime_main, ["inspect", artifact_copy])
    assert inspected.exit_code != 0
    assert "valid: no" in inspected.output and "screen" in inspected.output
    assert "Traceback" not in inspected.output

    generated = invoke(runtime_main, ["generate", artifact_copy, "--method", "csv", "--prompt", "hi",
                                      "--max-new-tokens", 4])
    assert_clean_error(generated, "screen", "--force")


def test_generate_csv_prints_the_same_text_as_ar(artifact: Path):
    outputs = {}
    for method in ("ar", "csv", "ar:transformers"):
        result = invoke(runtime_main, ["generate", artifact, "--method", method, "--prompt", "hi",
                                       "--max-new-tokens", 4, "--backend", "lean"])
        assert result.exit_code == 0, result.output
        outputs[method] = result.stdout
        assert f"[{'csv:screen' if method == 'csv' else method}]" in result.stderr
        # the backend that decoded: ar:transformers overrides --backend
        assert f"({'transformers' if method == 'ar:transformers' else 'lean'} backend, " in result.stderr
    assert outputs["csv"] == outputs["ar"]
    assert outputs["ar"].strip(), "the tiny model produced no text: the comparison tests nothing"


def test_generate_of_one_token_reports_no_decode_speed(artifact: Path):
    result = invoke(runtime_main, ["generate", artifact, "--method", "spec:ngram", "--prompt", "hi", "--max-new-tokens", 1])
    assert result.exit_code == 0, result.output
    assert "] 1 token, no decode step: the prefill gave it (" in result.stderr and "tok/s" not in result.stderr


def test_generate_reports_certification_only_for_a_certified_head(artifact: Path):
    """A method on the full head certifies nothing: no "certified 0.0% ... recomputed 100%" line for it."""
    for method, certified in (("spec:ngram", False), ("ar", False), ("spec:ngram+csv", True), ("csv", True)):
        result = invoke(runtime_main, ["generate", artifact, "--method", method, "--prompt", "hi", "--max-new-tokens", 4])
        assert result.exit_code == 0, result.output
        stats = next(line for line in result.stderr.splitlines() if "tok/s decode" in line)
        assert ("certified" in stats and "recomputed" in stats) == certified, stats


def test_chat_without_a_chat_template_is_refused_before_the_model_loads(artifact: Path, tmp_path: Path, monkeypatch):
    import runtime.models
    from runtime import api

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --chat was checked")

    monkeypatch.setattr(runtime.models, "load_model", never)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": "hi"}]))
    for command in (["generate", artifact, "--chat", "--prompt", "hi"],
                    ["bench", artifact, "--chat", "--prompts", prompts, "-n", 1, "--json", tmp_path / "b.json"]):
        assert_clean_error(invoke(runtime_main, command), "has no chat template; drop --chat")
    with pytest.raises(ValueError, match="has no chat template"):
        api.load(artifact, progress=False, chat=True)


def test_generate_cluster_bound_matches_ar(artifact: Path):
    outputs = [
        invoke(runtime_main, ["generate", artifact, *extra, "--prompt", "hi w5 w9", "--max-new-tokens", 4]).stdout
        for extra in (["--method", "ar"], ["--method", "csv", "--bound", "cluster"],
                      ["--method", "csv:cluster", "--cluster-budget", "0.5", "--adaptive-budget"])
    ]
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].strip()


def test_prep_screen4_adds_its_stage_and_csv_screen4_prints_what_ar_prints(tiny_model_dir: Path, artifact_copy: Path):
    result = invoke(prep_main, ["screen4", tiny_model_dir, "-o", artifact_copy, "--rank", 16, "--texts", 2])
    assert result.exit_code == 0, result.output
    assert "stage screen4 written" in result.output
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    assert set(manifest["stages"]) == {"clusters", "screen", "screen4"}
    assert manifest["stages"]["screen4"]["params"]["rank"] == 16 and manifest["stages"]["screen4"]["params"]["group_size"] == 64
    outputs = {}
    methods = ("ar", "csv:screen4", "spec:ngram+csv:screen4", "swarm:lookup:2+csv:screen4")
    for method in methods:
        run = invoke(runtime_main, ["generate", artifact_copy, "--method", method, "--prompt", "hi w5 w9", "--max-new-tokens", 6])
        assert run.exit_code == 0, run.output
        outputs[method] = run.stdout
    assert outputs["ar"].strip() and all(outputs[method] == outputs["ar"] for method in methods)


def test_generate_without_a_method_runs_the_fastest_exact_one(tiny_model_dir: Path, artifact_copy: Path, monkeypatch):
    """No --method: spec:lookup verified through the best screen the artifact and CPU allow; ar's text."""
    prompt = ["--prompt", "hi w5 w9 hi w5 w9", "--max-new-tokens", 8]
    reference = invoke(runtime_main, ["generate", artifact_copy, "--method", "ar", *prompt]).stdout
    assert reference.strip(), "the tiny model produced no text: the comparison tests nothing"
    labels = {}
    for case in ("int8 screen", "screen4", "screen4, no kernel"):
        if case == "screen4":
            assert invoke(prep_main, ["screen4", tiny_model_dir, "-o", artifact_copy, "--rank", 16, "--texts", 2]).exit_code == 0
        if case == "screen4, no kernel":
            monkeypatch.setattr("runtime.session.screen4_pays", lambda: False)
        run = invoke(runtime_main, ["generate", artifact_copy, *prompt])
        assert run.exit_code == 0, run.output
        assert run.stdout == reference
        stats = [line for line in run.stderr.splitlines() if not line.startswith("[specvocab]")]  # not the loading line
        labels[case] = stats[0].split("]")[0] + "]"
    from runtime.kernels import screen4_pays

    assert labels == {"int8 screen": "[spec:lookup+csv:screen]", "screen4, no kernel": "[spec:lookup+csv:screen]",
                      "screen4": "[spec:lookup+csv:screen4]" if screen4_pays() else "[spec:lookup+csv:screen]"}


def test_prep_all_leaves_out_screen4_where_the_recipe_says_so(tiny_model_dir: Path, tmp_path: Path, monkeypatch):
    from prep import recipes

    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(cluster=recipes.ClusterRecipe(clusters=8, iterations=2),
                                                            screen4=recipes.Screen4Recipe(in_all=False)))
    result = invoke(prep_main, ["all", tiny_model_dir, "-o", tmp_path / "art"])
    assert result.exit_code == 0, result.output
    assert set(json.loads((tmp_path / "art" / "manifest.json").read_text())["stages"]) == {"clusters", "screen"}


def test_csv_screen4_without_its_stage_names_the_prep_command(artifact: Path):
    result = invoke(runtime_main, ["generate", artifact, "--method", "csv:screen4", "--prompt", "hi", "--max-new-tokens", 2])
    assert_clean_error(result, "screen4", "prep screen4")


def test_csv_screen4_without_its_kernel_names_the_int8_screen(tiny_model_dir: Path, artifact_copy: Path, monkeypatch):
    assert invoke(prep_main, ["screen4", tiny_model_dir, "-o", artifact_copy, "--rank", 16, "--texts", 2]).exit_code == 0
    monkeypatch.setattr("runtime.session.has_screen4_kernel", lambda: False)  # a CPU without the AVX-512 or AVX2 paths
    result = invoke(runtime_main, ["generate", artifact_copy, "--method", "spec:ngram+csv:screen4", "--prompt", "hi", "--max-new-tokens", 2])
    assert_clean_error(result, "needs the AVX-512 or AVX2 kernels", "use +csv")


def test_prep_screen4_refuses_a_group_it_cannot_take(tiny_model_dir: Path, artifact_copy: Path):
    before = snapshot(artifact_copy)
    result = invoke(prep_main, ["screen4", tiny_model_dir, "-o", artifact_copy, "--rank", 16, "--group", 48])
    assert_clean_error(result, "--group must be one of 32, 64")
    assert snapshot(artifact_copy) == before


def write_prompts(path: Path, items) -> Path:
    path.write_text(json.dumps(items))
    return path


def test_csv_with_epsilon_says_it_is_not_distribution_preserving(artifact: Path, tmp_path: Path):
    """Sampling within total variation epsilon is labelled wherever the method appears: generate, bench."""
    sampled = ["--temperature", 1, "--epsilon", 0.2]
    result = invoke(runtime_main, ["generate", artifact, "--method", "csv", "--prompt", "hi", "--max-new-tokens", 4, *sampled])
    assert result.exit_code == 0, result.output
    assert "[csv:screen, not distribution-preserving (epsilon 0.2)]" in result.stderr
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi w5 w6"}])
    out = tmp_path / "b.json"
    result = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "ar,csv", "-n", 1,
                                   "--max-new-tokens", 4, "--json", out, *sampled])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(out.read_text())["methods"]}
    assert rows["ar"]["distribution_preserving"] and not rows["csv"]["distribution_preserving"]
    assert "| csv [not distribution-preserving] |" in result.output


def test_bench_writes_json_markdown_and_png(artifact: Path, tmp_path: Path):
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi w5 w6"}, {"text": "w7 w8 hi"}])
    out = tmp_path / "out" / "b.json"
    result = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "ar,csv:screen,csv:cluster",
                                   "-n", 2, "--max-new-tokens", 4, "--json", out])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    rows = {row["method"]: row for row in record["methods"]}
    assert list(rows) == ["ar", "csv:screen", "csv:cluster"]
    assert record["setup"]["n"] == 2
    for name, row in rows.items():
        for field in ("tokens_per_s", "speedup_vs_ar", "identical_to_greedy", "certification_rate",
                      "fallback_rate", "recomputed_fraction"):
            assert field in row, (name, field)
        assert row["identical_to_greedy"] == 1.0, name
        assert row["tokens_per_s"] > 0
    for name in ("csv:screen", "csv:cluster"):
        row = rows[name]
        assert 0 <= row["certification_rate"] <= 1 and 0 <= row["fallback_rate"] <= 1
        assert row["certification_rate"] + row["fallback_rate"] == pytest.approx(1.0)
    assert rows["ar"]["certification_rate"] in (None, 0.0)  # the full head certifies nothing
    assert rows["ar"]["speedup_vs_ar"] == 1.0
    assert rows["ar"]["recomputed_fraction"] == 1.0
    assert rows["csv:screen"]["certification_rate"] == 1.0
    markdown = out.with_suffix(".md").read_text()
    assert "csv:screen" in markdown and "csv:cluster" in markdown and "| method |" in markdown
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from runtime.bench.provenance import provenance

    assert {key: record["setup"][key] for key in ("code", "cpu", "screen_kernel")} == provenance()  # where the figures come from
    summary = invoke(runtime_main, ["bench-summary", out])
    assert summary.exit_code == 0, summary.output
    assert "| 3 of 3 |" in summary.stdout and f"- {out}: code" in summary.stdout  # ar and both csv bounds = ar
    again = ["bench", artifact, "--prompts", prompts, "--methods", "ar", "-n", 3, "--max-new-tokens", 2, "--json", out]
    assert_clean_error(invoke(runtime_main, again), "exists (an earlier run's output)", "--force")
    assert json.loads(out.read_text()) == record  # refused: the earlier record is kept
    replaced = invoke(runtime_main, [*again, "--force"])
    assert replaced.exit_code == 0, replaced.output
    assert [row["method"] for row in json.loads(out.read_text())["methods"]] == ["ar"]
    assert "holds 2 prompts, fewer than -n 3; running those" in replaced.stderr


@pytest.mark.parametrize("content, fragment", [
    ("not json", "cannot read prompts"),
    (json.dumps({"text": "hi"}), "JSON list"),
    (json.dumps([{"prompt": "hi"}]), "item 0"),
], ids=["not-json", "not-a-list", "no-text-field"])
def test_bench_bad_prompts_file_is_a_clean_error(artifact: Path, tmp_path: Path, content: str, fragment: str):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(content)
    result = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "ar", "-n", 1,
                                   "--max-new-tokens", 2, "--json", tmp_path / "b.json"])
    assert_clean_error(result, fragment)
    assert not (tmp_path / "b.json").exists()


def test_bench_unknown_method_is_a_clean_error(artifact: Path, tmp_path: Path):
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi"}])
    result = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "ar,warp", "-n", 1,
                                   "--max-new-tokens", 2, "--json", tmp_path / "b.json"])
    assert_clean_error(result, "unknown method", "warp")
    bad_bound = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "csv:fast", "-n", 1,
                                      "--max-new-tokens", 2, "--json", tmp_path / "b.json"])
    assert_clean_error(bad_bound, "csv:screen")


@pytest.mark.parametrize("command, name, args, says", [
    (runtime_main, "runtime", ["bench", "--bogus"], "No such option '--bogus'. See runtime bench --help."),
    (runtime_main, "runtime", ["nonesuch"], "No such command 'nonesuch'. See runtime --help."),
    (prep_main, "prep", ["all", "--ouT", "x"], "Did you mean '--out'? See prep all --help."),
])
def test_a_usage_error_is_one_line_naming_the_commands_help(command, name: str, args: list[str], says: str):
    result = CliRunner().invoke(command, args, prog_name=name)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [assert_clean_error(result, says)]


@pytest.mark.parametrize("command", [runtime_main, prep_main])
def test_a_bare_command_shows_its_help(command):
    assert "Commands:" in CliRunner().invoke(command, []).output


@pytest.mark.parametrize("name", ["import", "cluster", "screen4", "all", "traces"])
def test_prep_usage_names_the_default_model(name: str):
    """MODEL may be left out: each usage line says which model is then read."""
    from runtime.models import DEFAULT_MODEL

    usage = CliRunner().invoke(prep_main, [name, "--help"], prog_name="prep").output.splitlines()[0]
    assert usage == f"Usage: prep {name} [OPTIONS] [MODEL (default {DEFAULT_MODEL})]"


def test_generate_on_a_missing_artifact_is_a_clean_error(tmp_path: Path):
    result = invoke(runtime_main, ["generate", tmp_path / "nowhere", "--prompt", "hi", "--max-new-tokens", 2])
    assert_clean_error(result)


@pytest.mark.parametrize("parse, text, value", [
    ("formats", " q4_0 , q8_row", ["q4_0", "q8_row"]),
    ("trees", " 4 , 8,32 ", (4, 8, 32)),
    ("trees", "none", ()),
    ("drafter-layers", " 15 , 16 ", (15, 16)),
    ("drafter-layers", 16, (16,)),
    ("drafter-layers", "0", ()),
    ("drafter-layers", "", ()),
], ids=["formats", "trees", "trees-none", "layers", "layers-from-a-recipe", "layers-none", "layers-empty"])
def test_comma_separated_values_ignore_spaces(parse: str, text, value):
    """--formats, --trees and --drafter-layers read each item stripped (refusals: tests/bad_inputs)."""
    from prep.traces import parse_layers
    from runtime.cli.bench import _screen_formats, _tree_sizes

    assert {"formats": _screen_formats, "trees": _tree_sizes, "drafter-layers": parse_layers}[parse](text) == value


def test_bench_screen_says_when_the_prompts_hold_fewer_positions(artifact: Path, tmp_path: Path):
    """Fewer hidden states than --positions: screened anyway, with a note saying how many (as bench's -n)."""
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi w5 w9 w31"}])
    result = invoke(runtime_main, ["bench-screen", artifact, "--prompts", prompts, "--positions", 500, "--formats", "q4_0"])
    assert result.exit_code == 0, result.output
    assert "fewer than --positions 500; screening those" in result.stderr and "| q4_0 |" in result.stdout


def test_bench_threads_compares_settings_per_background_load(artifact: Path, tmp_path: Path):
    """Every (load, method, setting) row, the same tokens in each, the busy loops gone afterwards."""
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi w5 w6"}])
    out = tmp_path / "threads.json"
    result = invoke(runtime_main, ["bench-threads", artifact, "--prompts", prompts, "--methods", "ar,default", "-n", 1,
                                   "--max-new-tokens", 3, "--thread-settings", "default,1", "--background-load", "0,1",
                                   "--json", out])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert [(r["background_load"], r["threads"]) for r in rows] == [(load, s) for load in (0, 1) for _ in range(2) for s in ("default", "1")]
    assert all(r["same_tokens"] for r in rows)
    assert all(r["vs_best_fixed"] == 1.0 for r in rows if r["threads"] == "1")  # the only fixed count is its own best
    assert record["setup"]["background_load"] == [0, 1] and "| busy-loop processes |" in result.output


def test_bench_threads_gives_every_run_its_own_method(artifact: Path):
    """A lookup drafter remembers its session: a run that reused another setting's Method (or the one of
    the prompt before) would draft from that run's output (a memorised, not a measured, speed)."""
    from runtime.kernels import threads_restored
    from runtime import api
    from runtime.bench.contention import run_contention
    from runtime.methods import build_method

    engine = api.load(artifact)
    built = []

    def build(spec):
        built.append(build_method(engine.session, spec))
        return built[-1]

    ids = [engine.encode("hi w5 w6 w5 w6"), engine.encode("hi w7 w5 w6 w5")]
    with threads_restored():
        cells = run_contention([api.as_method_spec("spec:lookup")], build, ids, 4, ["default", "1"], [0, 0], api.set_threads)
    # One per (load, setting) for the warm-up, then one per (load, setting, prompt) run.
    assert len(built) == 4 + 8 and len({id(m) for m in built}) == 12
    assert len(cells) == 4 and all(cell.outputs == cells[0].outputs for cell in cells)


def test_bench_records_its_background_load(artifact: Path, tmp_path: Path):
    prompts = write_prompts(tmp_path / "prompts.json", [{"text": "hi w5 w6"}])
    out = tmp_path / "b.json"
    result = invoke(runtime_main, ["bench", artifact, "--prompts", prompts, "--methods", "ar", "-n", 1,
                                   "--max-new-tokens", 2, "--background-load", 1, "--json", out])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["setup"]["background_load"] == 1


@pytest.mark.parametrize("option, value, fragment", [
    ("--thread-settings", "default,0", "neither 'default' nor a thread count"),
    ("--thread-settings", "1,1", "twice"),
    ("--background-load", "0,x", "numbers of busy-loop processes"),
])
def test_bench_threads_bad_settings_are_clean_errors_before_loading(artifact: Path, option: str, value: str, fragment: str):
    assert_clean_error(invoke(runtime_main, ["bench-threads", artifact, option, value]), fragment)
