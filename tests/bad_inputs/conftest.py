"""The bad-input suite's fixtures: tiny random models, a built tiny artifact, and checks every case shares.

Every case asserts the exit code, no traceback, one line of error that names the fix, and that
nothing was damaged: the artifact's bytes and the (private) model cache are compared before and after.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bad_helpers import TINY_CLUSTERS, save_tiny_model
from prep.cli import main as prep_main


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad-tiny") / "tiny", seed=0)


@pytest.fixture(scope="session")
def other_model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad-other") / "other", seed=1)


@pytest.fixture(autouse=True)
def own_cache(private_cache: Path) -> Path:
    """Every case gets the root conftest's private model cache, compared before and after, never the user's."""
    return private_cache


@pytest.fixture(scope="session")
def built_artifact(tiny_model: Path, tmp_path_factory) -> Path:
    """A tiny artifact with stages clusters and screen, built once by `prep cluster`."""
    out = tmp_path_factory.mktemp("bad-art") / "art"
    result = CliRunner().invoke(prep_main, ["cluster", str(tiny_model), "-o", str(out), *TINY_CLUSTERS])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def art(built_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the built artifact, to damage."""
    return Path(shutil.copytree(built_artifact, tmp_path / "art"))
