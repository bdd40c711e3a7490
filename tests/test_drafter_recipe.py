"""`prep all --with-drafter`: a recipe's [drafter] data (the target's responses, raw text), their features and the head."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from prep import recipes
from prep.cli import main as prep_main
from prep.drafter_recipe import RESPONSES_MAX_TOKENS, feature_sets, features_budget, training_precision
from prep.drafter_train import mlp_width
from prep.router_trainer import StepBar
from prep.trace_files import INDEX_FILE
from runtime.session import open_session
from factories import prep_ok, save_tiny_model_dir

TINY_DRAFTER = recipes.DrafterRecipe(draft_vocab=48, epochs=1, responses=("pyfunctions:3",), corpora=("pystdlib:600",),
                                     precision="32-true")


def test_prep_all_with_drafter_runs_the_recipe_and_a_rerun_keeps_it(tmp_path, monkeypatch):
    """Responses, their features and raw text become folders under --features, the head trains on them
    all; a rerun reuses every file and keeps the stage."""
    model = save_tiny_model_dir(tmp_path / "model", layers=6)
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(
        cluster=recipes.ClusterRecipe(clusters=8, iterations=2, top_m_bias=3), drafter=TINY_DRAFTER))
    art, features = tmp_path / "art", tmp_path / "features"
    out = prep_ok(["all", model, "-o", art, "--with-drafter", "--features", features])
    responses = json.loads((features / "responses-pyfunctions-3.json").read_text())
    assert len(responses) == 3
    raw = json.loads((features / "pystdlib" / INDEX_FILE).read_text())
    assert sum(shard["tokens"] for shard in raw["shards"]) == 600
    assert json.loads((features / "self-pyfunctions" / INDEX_FILE).read_text())["feature_layers"]
    params = open_session(art, backend="lean", progress=False).artifact.stage_params("drafter")
    assert params["draft_vocab"] == 48 and sorted(params["features"]) == sorted(
        str(features / name) for name in ("self-pyfunctions", "pystdlib"))
    assert "drafter: validation top-1 by draft step" in out and "responses" in out and "training" in out
    assert "stages clusters, drafter, screen" in out

    written = (features / "responses-pyfunctions-3.json").stat().st_mtime_ns
    again = prep_ok(["all", model, "-o", art, "--with-drafter", "--features", features])
    assert "drafter: already built with these parameters, kept" in again
    assert (features / "responses-pyfunctions-3.json").stat().st_mtime_ns == written


def test_an_interrupted_training_resumes_from_its_last_epoch(tmp_path, monkeypatch):
    """Ctrl-C in the second epoch keeps the first epoch's checkpoint; the same command then resumes
    from it (other settings would start over) and the head gets every step."""
    model = save_tiny_model_dir(tmp_path / "model", layers=6)
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(
        cluster=recipes.ClusterRecipe(clusters=8, iterations=2, top_m_bias=3),
        drafter=recipes.DrafterRecipe(**{**TINY_DRAFTER.__dict__, "epochs": 2})))
    art, features = tmp_path / "art", tmp_path / "features"
    command = ["all", str(model), "-o", str(art), "--with-drafter", "--features", str(features)]

    def interrupt(self, trainer, module):
        if trainer.current_epoch == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as mp:
        mp.setattr(StepBar, "on_train_epoch_start", interrupt, raising=False)
        stopped = CliRunner().invoke(prep_main, command)
    assert stopped.exit_code != 0 and "rerun the same command to resume" in stopped.output
    assert "Traceback" not in stopped.output
    checkpoints = features / "drafter-train" / "checkpoints"
    first_epoch = [p.name for p in checkpoints.glob("epoch=0-*.ckpt")]
    assert first_epoch and (checkpoints / "last.ckpt").resolve().name == first_epoch[0]

    out = prep_ok(command)
    assert f"drafter: resuming from {checkpoints / first_epoch[0]}" in out
    params = open_session(art, backend="lean", progress=False).artifact.stage_params("drafter")
    steps_per_epoch = int(first_epoch[0].split("step=")[1].split(".")[0])
    assert params["optimizer_steps"] == 2 * steps_per_epoch and params["epochs"] == 2


@pytest.mark.parametrize("drafter, fix", [
    (recipes.DrafterRecipe(responses=("humaneval:10",)), "responses: 'humaneval:10' should be NAME:PROMPTS"),
    (recipes.DrafterRecipe(responses=(), corpora=("humaneval:1000",)), "corpora: 'humaneval:1000' should be NAME:TOKENS"),
    (recipes.DrafterRecipe(responses=("sharegpt:0",)), "PROMPTS >= 1"),
    (recipes.DrafterRecipe(responses=("sharegpt:\u00b2",)), "PROMPTS >= 1"),
    (recipes.DrafterRecipe(responses=("sharegpt:5", "sharegpt:6")), "each name at most once"),
    (recipes.DrafterRecipe(responses=(), corpora=()), "names no training data"),
])
def test_a_bad_drafter_recipe_is_refused_before_any_work(drafter, fix, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(drafter=drafter))
    result = CliRunner().invoke(prep_main, ["all", str(tiny_model_dir), "-o", str(tmp_path / "art"), "--with-drafter"])
    assert result.exit_code != 0 and fix in result.output and "Traceback" not in result.output
    assert not (tmp_path / "art").exists() and not (tmp_path / "features").exists()


def test_the_heads_mlp_width_is_a_fraction_of_the_targets_in_whole_blocks():
    assert [mlp_width(4864, 0.25), mlp_width(1536, 0.25), mlp_width(2048, 0.25), mlp_width(4864, 1.0)] == [1216, 384, 512, 4864]
    assert mlp_width(100, 0.5) == 64 and mlp_width(64, 0.1) == 32  # whole blocks of 32, at least one
    assert recipes.parse_recipe({"drafter": {"mlp_width": 0.5}}).drafter.mlp_width == 0.5
    for bad in (0.0, 1.5, -0.25):
        with pytest.raises(recipes.RecipeError, match=rf"\[drafter\]: mlp_width = {bad} should be a fraction"):
            recipes.parse_recipe({"drafter": {"mlp_width": bad}})


def test_the_drafter_data_are_recipe_lists_and_features_go_beside_the_artifact(tmp_path, monkeypatch):
    with pytest.raises(recipes.RecipeError, match=r"responses = 'sharegpt:5' should be a list of str"):
        recipes.parse_recipe({"drafter": {"responses": "sharegpt:5"}})
    parsed = recipes.parse_recipe({"drafter": {"responses": ["sharegpt:5"], "corpora": ["pystdlib:100"]}}).drafter
    assert parsed.responses == ("sharegpt:5",) and parsed.corpora == ("pystdlib:100",)
    assert [s.folder.name for s in feature_sets(parsed, tmp_path)] == ["self-sharegpt", "pystdlib"]
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(prep_main, ["all", "m", "-o", "art", "--with-drafter", "--features", "art"])
    assert result.exit_code != 0 and "features go in a folder of their own" in result.output


def test_features_by_hand_trace_what_the_recipes_folders_hold():
    """prep traces --features' default budget: a file whole, a raw corpus at the recipe's [drafter] budget, else the router's."""
    router = recipes.RouterRecipe(max_tokens=40_000)
    drafter = recipes.DrafterRecipe(corpora=("sharegpt:60000",))
    assert features_budget(drafter, router, "feat/responses-sharegpt-150.json") == RESPONSES_MAX_TOKENS
    assert features_budget(drafter, router, "sharegpt") == 60_000
    assert features_budget(drafter, router, "pystdlib") == 40_000
    assert features_budget(drafter, router, "humaneval") == 40_000


def test_auto_precision_is_bf16_on_a_gpu_and_where_the_cpu_has_avx512_bf16_without_amx(monkeypatch):
    from lightning.pytorch.accelerators import CUDAAccelerator

    auto = recipes.DrafterRecipe().precision
    assert auto == "auto"
    zen4, amx, avx2 = frozenset({"avx2", "avx512_bf16"}), frozenset({"avx2", "avx512_bf16", "amx_bf16"}), frozenset({"avx2"})
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    assert training_precision(auto, "cpu", zen4) == "bf16-mixed"
    assert training_precision(auto, "cpu", amx) == "32-true"  # as fast, 2.7x less memory (docs/draft-head.md)
    assert training_precision(auto, "cpu", avx2) == "32-true"
    assert training_precision(auto, "auto", amx) == "32-true"
    assert training_precision(auto, "gpu", avx2) == "32-true"  # Apple's MPS: as before
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    assert training_precision(auto, "gpu", avx2) == "bf16-mixed"
    assert training_precision(auto, "auto", amx) == "bf16-mixed"
    assert training_precision(auto, "cpu", amx) == "32-true"  # the CPU asked for, a GPU or not
    assert training_precision("bf16-mixed", "cpu", avx2) == "bf16-mixed"  # a named precision is kept
    assert training_precision("32-true", "gpu", zen4) == "32-true"
