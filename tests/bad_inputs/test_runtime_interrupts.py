"""Ctrl-C in `runtime`: one line and exit 130 (the shell's code for SIGINT), never click's bare "Aborted!";
a measuring command says that no partial record was written, and none was."""

from __future__ import annotations

from pathlib import Path

import pytest

from bad_helpers import runtime_fails


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["runtime.bench.runner.run_bench", "runtime.bench.report.plot_png"],
                         ids=["while-it-runs", "while-its-plot-is-drawn"])
def test_ctrl_c_during_a_bench_run_writes_no_record(art: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str):
    monkeypatch.setattr(where, interrupt)
    line = runtime_fails(["bench", art, "--prompts", "humaneval", "-n", 1, "--methods", "ar", "--max-new-tokens", 2,
                          "--json", tmp_path / "out" / "b.json"],
                         "interrupted; nothing is written (a record holds whole runs only): rerun the command", code=130,
                         unchanged=(art,))
    assert line.startswith("Error: ") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["generate", "--prompt", "w3 w4"], ["bench-verify", "--max-n", 2],
                                     ["bench-screen", "--positions", 4], ["inspect"]])
def test_ctrl_c_while_the_model_loads_is_one_line(art: Path, monkeypatch: pytest.MonkeyPatch, command: list):
    monkeypatch.setattr("runtime.api.load", interrupt)
    monkeypatch.setattr("runtime.describe.describe_artifact", interrupt)
    line = runtime_fails([command[0], art, *command[1:]], "Error: interrupted", code=130, unchanged=(art,))
    assert ("nothing is written" in line) == command[0].startswith("bench")
