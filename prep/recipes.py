"""Recipes: one TOML per packaged model saying which parameters each prep stage uses."""

from __future__ import annotations

import tomllib
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# Used for models without a recipe (a local directory or .gguf file).
DEFAULTS = {
    "cluster": {"clusters": 1024, "iterations": 10, "top_m_bias": 3},
    "screen": {"group_size": "auto"},
    # DynaSpec: prep traces + prep train-router (prep all --with-router). drafter_layers: the layers:N
    # hidden states the traces also store (0: none); hidden: the router's input, final (the int8
    # drafter's), layers:N, or auto (the traces' only drafter depth, else final).
    "router": {
        "corpus": "sharegpt", "max_tokens": 40_000, "max_tokens_per_text": 512, "drafter_layers": 0,
        "hidden": "auto", "clusters": 256, "width": 512, "max_steps": 1000, "batch_size": 256, "loss": "ce",
    },
}


def recipe_hidden(cfg: dict) -> str | None:
    """The router's hidden input from a `[router]` section; None = the traces decide (auto)."""
    return None if cfg["hidden"] == "auto" else cfg["hidden"]


def load_recipe(model: str) -> dict:
    """The recipe of a packaged model merged over the defaults; defaults alone for other models."""
    recipe = {stage: dict(values) for stage, values in DEFAULTS.items()}
    path = RECIPES_DIR / f"{model}.toml"
    if path.is_file():
        with path.open("rb") as f:
            for stage, values in tomllib.load(f).items():
                if isinstance(values, dict):
                    recipe.setdefault(stage, {}).update(values)
    return recipe
