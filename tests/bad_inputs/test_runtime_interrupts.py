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
    monkeypatch.setattr("runtime.cli.describe.describe_artifact", interrupt)
    line = runtime_fails([command[0], art, *command[1:]], "Error: interrupted", code=130, unchanged=(art,))
    assert ("nothing is written" in line) == command[0].startswith("bench")


def test_sigterm_during_a_bench_run_is_ctrl_c_with_its_own_exit_code(art: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    import os
    import signal
    import time

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at once
        raise AssertionError("SIGTERM did not interrupt the run")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("runtime.bench.runner.run_bench", killed)
    runtime_fails(["bench", art, "--prompts", "humaneval", "-n", 1, "--methods", "ar", "--max-new-tokens", 2,
                   "--json", tmp_path / "out" / "b.json"], "Error: interrupted (SIGTERM); nothing is written",
                  code=128 + signal.SIGTERM, unchanged=(art,))
    assert signal.getsignal(signal.SIGTERM) == before and not (tmp_path / "out").exists()


def test_a_full_standard_output_is_one_line(art: Path):
    import subprocess
    import sys

    from bad_helpers import REPO, error_line

    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "runtime", "inspect", str(art)], cwd=REPO, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert error_line(done.stderr) == ("Error: No space left on device (writing the output); free space or choose "
                                       "another place for the output, then rerun the command")


def test_a_closed_standard_output_still_gets_the_record_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`runtime bench ... | true`: the table cannot be printed, the files are written all the same."""
    import errno

    from runtime.cli import values

    def closed(message=None, **kwargs):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    written = []
    monkeypatch.setattr(values.click, "echo", closed)
    with pytest.raises(BrokenPipeError):
        values.print_and_write("| ar | 1.00x |", lambda: written.append("the record"), "--json")
    assert written == ["the record"]
