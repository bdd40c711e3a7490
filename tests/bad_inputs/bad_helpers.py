"""Checks every bad-input case shares: no traceback, one error line naming the fix, nothing changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from prep.cli import main as prep_main
from runtime.cli import main as runtime_main

TINY_CLUSTERS = ["--clusters", "8", "--iterations", "2"]
REPO = Path(__file__).resolve().parents[2]


def snapshot(*paths: Path) -> dict[str, bytes]:
    """Every file under the paths (name -> bytes), to show that nothing changed."""
    files = {}
    for root in paths:
        for p in sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file():
                files[str(p)] = p.read_bytes()
    return files


def error_line(output: str) -> str:
    """The one error line of a command's output (asserting that there is exactly one and no traceback)."""
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, output
    return lines[0]


def prep_fails(args: list[str], *must_say: str, code: int = 1, unchanged: tuple[Path, ...] = ()) -> str:
    """Run `prep ARGS` in-process; assert exit code, one error line saying `must_say`, no damage."""
    return command_fails(prep_main, args, *must_say, code=code, unchanged=unchanged)


def runtime_fails(args: list, *must_say: str, code: int = 1, unchanged: tuple[Path, ...] = ()) -> str:
    """Run `runtime ARGS` in-process; assert exit code, one error line saying `must_say`, no damage."""
    return command_fails(runtime_main, args, *must_say, code=code, unchanged=unchanged)


def command_fails(command, args: list, *must_say: str, code: int, unchanged: tuple[Path, ...]) -> str:
    """Run a click command in-process; assert exit code, one error line saying `must_say`, no damage."""
    before = snapshot(*unchanged)
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    line = error_line(result.output)
    for text in must_say:
        assert text in line, line
    assert snapshot(*unchanged) == before
    return line


def prep_process(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `prep ARGS` as its own process (for kills and locks)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "prep", *map(str, args)], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
