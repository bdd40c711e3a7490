"""Concurrent writers, interrupted `prep cluster` runs (kill -9 and Ctrl-C at several points) and a full disk.

A run with $SPECVOCAB_PAUSE_AT=<point> stops itself there (artifacts.atomic.pause_point), so the
test kills it at exactly that point. After any interruption: the artifact reads as valid (the old
state or the new), no temporary is left once a rerun has run, and rerunning the same command
finishes what is missing without --force.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from artifacts import Artifact
from artifacts.atomic import LOCK_FILE, PAUSE_ENV
from bad_helpers import TINY_CLUSTERS, error_line, prep_fails, prep_process, snapshot


def wait_stopped(proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until the process has stopped itself at its pause point."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the prep run never reached its pause point")


def interrupted_run(tiny_model: Path, out: Path, point: str, sig: int) -> subprocess.CompletedProcess:
    """Run `prep cluster` until `point`, then deliver `sig` (SIGKILL, or SIGINT and let it go on)."""
    proc = prep_process(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS], {PAUSE_ENV: point})
    wait_stopped(proc)
    proc.send_signal(sig)
    if sig != signal.SIGKILL:
        proc.send_signal(signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def rerun_completes(tiny_model: Path, out: Path) -> None:
    from click.testing import CliRunner

    from prep.cli import main

    result = CliRunner().invoke(main, ["cluster", str(tiny_model), "-o", str(out), *TINY_CLUSTERS])
    assert result.exit_code == 0, result.output
    art = Artifact.open(out)
    assert art.stages == ["clusters", "screen"] and art.verify() == []
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporaries, no lock


@pytest.mark.parametrize("point", ["stage-staged:clusters", "stage-placed:clusters", "stage-staged:screen",
                                   "stage-placed:screen"])
def test_kill_9_then_rerun_finishes(tmp_path: Path, tiny_model: Path, point: str):
    out = tmp_path / "art"
    done = interrupted_run(tiny_model, out, point, signal.SIGKILL)
    assert done.returncode == -signal.SIGKILL
    art = Artifact.open(out)  # the manifest is whole: the stages before the kill, nothing half-recorded
    assert art.stages == ([] if point.endswith("clusters") else ["clusters"])
    assert art.verify() == []  # the dead writer's temporaries are no problem (and are removed)
    rerun_completes(tiny_model, out)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "sigterm", "sighup"])
@pytest.mark.parametrize("point", ["stage-staged:clusters", "stage-placed:screen"])
def test_an_interrupt_is_one_line_and_leaves_only_committed_stages(tmp_path: Path, tiny_model: Path, point: str, sig: int):
    """Ctrl-C, a plain `kill` (SIGTERM) and a closed terminal (SIGHUP) clean up alike, exit 128 + the signal."""
    out = tmp_path / "art"
    done = interrupted_run(tiny_model, out, point, sig)
    assert done.returncode == 128 + sig
    line = error_line(done.stderr)
    assert "interrupted" in line and "rerun the same command" in line
    assert (signal.Signals(sig).name in line) == (sig != signal.SIGINT)
    if point.endswith("clusters"):  # interrupted before its first stage: the folder it made is gone
        assert not out.exists()
    else:
        art = Artifact.open(out)
        assert art.verify() == [] and art.stages == ["clusters"]
        assert not (out / LOCK_FILE).exists()
    rerun_completes(tiny_model, out)


def test_a_second_writer_is_refused_at_once(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "art"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_FILE).write_text(f"{holder.pid}\n")
        before = snapshot(out)
        started = time.monotonic()
        proc = prep_process(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS])
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1
        line = error_line(stderr)
        assert f"being written by another prep run (pid {holder.pid})" in line and "another directory" in line
        assert time.monotonic() - started < 60  # refused before any model load or k-means
        assert snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_dead_writers_lock_and_leftovers_are_cleaned(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "art"
    out.mkdir()
    dead = 2**22 + 1  # above Linux's pid_max: no process has it
    (out / LOCK_FILE).write_text(f"{dead}\n")
    (out / f".tmp-{dead}-0000-clusters").mkdir()
    (out / f".tmp-{dead}-0000-clusters" / "clusters.safetensors").write_bytes(b"half")
    rerun_completes(tiny_model, out)


def test_two_concurrent_runs_one_wins_one_is_refused(tmp_path: Path, tiny_model: Path):
    out = tmp_path / "art"
    first = prep_process(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS], {PAUSE_ENV: "stage-staged:clusters"})
    wait_stopped(first)  # holds the lock, mid-write
    second = prep_process(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS])
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 1 and f"(pid {first.pid})" in error_line(stderr)
    first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    assert Artifact.open(out).stages == ["clusters", "screen"]


def test_a_reader_during_a_forced_rewrite_sees_old_or_new(tmp_path: Path, tiny_model: Path, built_artifact: Path):
    """A reader whose manifest is older than the stage file waits for the live writer, then reads the new stage."""
    import shutil

    out = Path(shutil.copytree(built_artifact, tmp_path / "art"))
    reader = Artifact.open(out)  # manifest read before the rewrite
    old = reader.read_stage("clusters")["radii"]
    writer = prep_process(["cluster", tiny_model, "-o", out, "--clusters", "4", "--iterations", "2", "--force"],
                          {PAUSE_ENV: "stage-placed:clusters"})
    wait_stopped(writer)  # new clusters file in place, manifest still the old one
    os.kill(writer.pid, signal.SIGCONT)
    tensors = reader.read_stage("clusters")  # retries while the writer is alive, then sees the new manifest
    assert writer.wait(timeout=120) == 0
    assert tensors["radii"].shape != old.shape and reader.stage_params("clusters")["clusters_requested"] == 4


@pytest.mark.parametrize("existing", [False, True], ids=["new", "forced-rewrite"])
def test_a_full_disk_is_one_line_naming_the_folder_and_loses_nothing(tmp_path: Path, tiny_model: Path, built_artifact: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, existing: bool):
    """safetensors reports ENOSPC as its own error: prep names the artifact's folder (not the temporary, gone by
    then) and the fix, leaves no new folder, and a forced rewrite keeps the old stages whole."""
    import shutil

    import safetensors
    import safetensors.torch

    def disk_full(tensors, filename, metadata=None):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    out = Path(shutil.copytree(built_artifact, tmp_path / "art")) if existing else tmp_path / "art"
    before = snapshot(out) if existing else None
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    line = prep_fails(["cluster", tiny_model, "-o", out, *TINY_CLUSTERS, *(["--force"] if existing else [])],
                      f"No space left on device ({out}); free space or choose a writable place, then rerun the same command")
    assert ".tmp-" not in line
    if existing:
        assert snapshot(out) == before and Artifact.open(out).stages == ["clusters", "screen"]
    else:
        assert not out.exists()
