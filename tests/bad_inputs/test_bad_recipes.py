"""Bad recipe files: refused in one line naming the key (or section) and the valid ones, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from bad_helpers import prep_fails
from prep import recipes


@pytest.fixture
def recipe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "recipes"
    folder.mkdir()
    monkeypatch.setattr(recipes, "RECIPES_DIR", folder)
    return folder


@pytest.mark.parametrize("text, says", [
    ("[cluster]\nclusterz = 8\n", "[cluster]: unknown key 'clusterz'; valid keys: clusters, iterations, top_m_bias"),
    ("[routr]\nwidth = 8\n", "unknown section or key 'routr'; valid: model, [cluster], [drafter], [router], [screen]"),
    ("[drafter]\nlr = 1\n", "[drafter]: lr = 1 should be float"),
    ("[router]\nwidth = \"wide\"\n", "[router]: width = 'wide' should be int"),
    ("[cluster]\nclusters = true\n", "clusters = True should be int"),
    ("[screen4]\nin_all = 1\n", "in_all = 1 should be bool"),
    ("cluster = 8\n", "cluster must be a [cluster] section"),
    ("[cluster\nclusters = 8\n", "is not valid TOML"),
], ids=["unknown-key", "unknown-section", "wrong-type", "int-for-float", "bool-for-int", "int-for-bool", "section-not-a-table", "not-toml"])
def test_a_bad_recipe(recipe_dir: Path, tmp_path: Path, text: str, says: str):
    (recipe_dir / "tiny-model.toml").write_text(text)
    prep_fails(["cluster", "tiny-model", "-o", tmp_path / "out"], says, unchanged=(recipe_dir,))
    assert not (tmp_path / "out").exists()


def test_a_toml_beside_a_model_path_is_not_a_recipe(tmp_path: Path):
    (tmp_path / "model.toml").write_text("[cluster]\nclusterz = 8\n")
    assert recipes.load_recipe(str(tmp_path / "model")) == recipes.DEFAULTS


def test_the_shipped_recipes_load():
    for path in sorted(recipes.RECIPES_DIR.glob("*.toml")):
        recipe = recipes.load_recipe(path.stem)
        assert recipe.model == path.stem and recipe != recipes.DEFAULTS


def test_a_recipes_drafter_section_shapes_the_head_it_trains():
    from prep.drafter_train import DrafterConfig

    recipe = recipes.parse_recipe({"drafter": {"draft_vocab": 4096, "epochs": 6}})
    config = DrafterConfig.from_recipe(recipe.drafter, seed=3)
    assert (config.draft_vocab, config.epochs, config.steps, config.lr, config.seed) == (4096, 6, 3, 5e-4, 3)
    assert DrafterConfig.from_recipe(recipes.DEFAULTS.drafter) == DrafterConfig()
