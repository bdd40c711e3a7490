"""Bad `prep` flag values: refused in one line, before any artifact is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from bad_helpers import TINY_CLUSTERS, prep_fails, snapshot


@pytest.mark.parametrize("flags, says", [
    (["--clusters", "0"], "--clusters and --iterations must be at least 1"),
    (["--clusters", "-5"], "must be at least 1"),
    (["--clusters", "100000"], "between 1 and the vocabulary size 256"),
    (["--iterations", "0", "--clusters", "8"], "must be at least 1"),
    (["--group-size", "abc", "--clusters", "8"], "use 'auto', 'row' or an integer"),
    (["--group-size", "-3", "--clusters", "8"], "must be positive"),
    (["--group-size", "48", "--clusters", "8"], "must divide the hidden size 64"),
    (["--clusters", "x"], "is not a valid integer"),
], ids=["clusters-0", "clusters-negative", "clusters-above-vocab", "iterations-0", "group-not-a-number",
        "group-negative", "group-not-dividing", "clusters-not-int"])
def test_bad_cluster_flags(tmp_path: Path, tiny_model: Path, flags: list[str], says: str):
    code = 1 if "vocabulary" in says or "divide" in says else 2  # flag values click checks exit 2 (usage errors)
    prep_fails(["cluster", tiny_model, "-o", tmp_path / "new" / "nested" / "out", *flags], says, code=code)
    assert not (tmp_path / "new").exists()  # refused after the model load too: the folders it made are gone
    (tmp_path / "empty").mkdir()  # a folder of the user's: kept, and left as it was
    prep_fails(["cluster", tiny_model, "-o", tmp_path / "empty", *flags], says, code=code)
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())


def test_a_rerun_with_other_parameters_needs_force(art: Path, tiny_model: Path):
    prep_fails(["cluster", tiny_model, "-o", art, "--clusters", "16", "--iterations", "2"],
               "already has a 'clusters' stage built with clusters_requested=8 (asked 16)", "--force", unchanged=(art,))


def test_gp_basis_on_a_missing_artifact(tmp_path: Path):
    prep_fails(["gp-basis", tmp_path / "nope"], "not a specvocab artifact", "no such directory")


def test_gp_basis_rank_zero(art: Path):
    prep_fails(["gp-basis", art, "--rank", "0"], "Invalid value for '--rank': give an integer >= 1", code=2, unchanged=(art,))


def test_train_router_on_a_plain_directory(tmp_path: Path):
    prep_fails(["train-router", tmp_path, "--traces", tmp_path], "no manifest.json")


def test_train_router_without_traces(art: Path, tmp_path: Path):
    prep_fails(["train-router", art, "--traces", tmp_path / "none"], "holds no traces", "prep traces", unchanged=(art,))


def test_a_rerun_with_the_same_parameters_changes_nothing(art: Path, tiny_model: Path):
    from click.testing import CliRunner

    from prep.cli import main

    before = snapshot(art)
    result = CliRunner().invoke(main, ["cluster", str(tiny_model), "-o", str(art), *TINY_CLUSTERS])
    assert result.exit_code == 0 and "already built with these parameters, kept" in result.output
    assert snapshot(art) == before


DEPTHS = "--drafter-layers (or the recipe's drafter_layers) must be depths >= 1 such as 16 or 15,16 (or 0 alone for none)"


@pytest.mark.parametrize("layers, says", [
    ("4,4", "'4,4' lists '4' twice; list each once: --drafter-layers 4"),
    ("4, 1,4 ", "lists '4' twice; list each once: --drafter-layers 4,1"),
    ("4,,1", "'4,,1' has an empty item (a stray comma?); write --drafter-layers 4,1"),
    ("4, ,1", "has an empty item (a stray comma?); write --drafter-layers 4,1"),
    ("4,", "'4,' has an empty item (a stray comma?); write --drafter-layers 4"),
    (",", "',' names nothing; e.g. --drafter-layers 15,16"),
    ("0,4", f"{DEPTHS}, got '0,4'"),
    ("-3", f"{DEPTHS}, got '-3'"),
    ("\u0664", DEPTHS),
], ids=["twice", "twice-with-spaces", "empty-item", "blank-item", "trailing-comma", "comma-alone", "zero-in-list", "negative",
        "non-ascii-digit"])
def test_bad_drafter_layers(tmp_path: Path, tiny_model: Path, layers: str, says: str):
    """prep traces --drafter-layers: depths >= 1 in ASCII digits, each once, or 0 alone; refused before any trace."""
    prep_fails(["traces", tiny_model, "-o", tmp_path / "traces", "--drafter-layers", layers], says)
    assert not (tmp_path / "traces").exists()
