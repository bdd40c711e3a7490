"""`runtime serve` as a command: its help and option errors, and a real process that stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner

from factories import tiny_artifact
from runtime.cli import main


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-cli")
    return tiny_artifact(tiny_model_dir, root), root / "cache"


def test_help_names_the_options_and_shows_examples():
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--method", "--threads", "--max-batch", "--max-queue", "--timeout", "--api-key"):
        assert option in result.output
    assert "curl" in result.output and "127.0.0.1" in result.output


@pytest.mark.parametrize("args, says", [(["--method", "warp"], "unknown method"), (["--port", "70000"], "--port"),
                                        (["--max-batch", "0"], "--max-batch"), (["--method", "llamacpp"], "not served"),
                                        (["--timeout", "-1"], "--timeout")])
def test_a_bad_option_is_one_line(artifact, args, says):
    result = CliRunner().invoke(main, ["serve", str(artifact[0]), *args])
    assert result.exit_code in (1, 2) and says in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_server_answers_then_stops_cleanly_on_sigterm(artifact):
    path, cache = artifact
    env = {**os.environ, "SPECVOCAB_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(path), "--port", "0", "--threads", "1"],
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any("serving" in line for line in lines):
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            lines.append(process.stderr.readline())
        url = re.search(r"http://\S+/v1", lines[-1]).group(0)
        answer = httpx.post(url + "/completions", json={"model": path.name, "prompt": "w5 w9", "max_tokens": 3,
                                                        "temperature": 0}, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=30)[1]
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM
    assert rest.strip().splitlines()[-1] == "Error: interrupted (SIGTERM); the server stopped; requests still open got a 503 error"
    assert "Traceback" not in rest
