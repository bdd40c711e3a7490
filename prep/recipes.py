"""Recipes: one TOML per packaged model saying which parameters each prep stage uses, read into dataclasses.

A recipe file has sections [cluster], [screen], [screen4], [router] and [drafter] (and a top-level `model`); every key
of a section is a field of that section's dataclass below, and a key that is not is an error naming
the valid ones. Command-line flags override recipe values through `overridden` only: a flag left at
None means "the recipe's value".
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(ValueError):
    """A recipe file that cannot be used (unknown key, wrong type)."""


@dataclass(frozen=True)
class ClusterRecipe:
    """[cluster]: LM-head spherical k-means (the cluster bound)."""

    clusters: int = 1024
    iterations: int = 10
    top_m_bias: int = 3


@dataclass(frozen=True)
class ScreenRecipe:
    """[screen]: the int8 screening head."""

    group_size: str | int = "auto"  # auto (measured at prep time), row, or a group size such as 32


@dataclass(frozen=True)
class Screen4Recipe:
    """[screen4]: the 4-bit screening head with a low-rank correction (prep.screen4)."""

    # basis directions of the hidden states whose share of the error is stored: a higher rank leaves less
    # of the vocabulary to recompute (docs/certified-head.md)
    rank: int = 32
    # columns per float16 scale and minimum, 32 or 64: 64 screens faster, one float scaling per 64 columns
    # at 0.56 bytes per weight (docs/certified-head.md)
    group: int = 64
    texts: int = 48  # ShareGPT train-split conversations (<= 256 tokens each) the basis comes from
    # whether `prep all` builds it: false where +csv:screen4 loses to +csv, so that `runtime generate`'s
    # default method (the best bound the artifact has) does not pick it (`prep screen4` still builds it)
    in_all: bool = True


@dataclass(frozen=True)
class RouterRecipe:
    """[router]: DynaSpec traces (prep traces) and router training (prep train-router)."""

    corpus: str = "sharegpt"
    max_tokens: int = 40_000
    max_tokens_per_text: int = 512
    drafter_layers: int | str = 0  # layers:N hidden states the traces also store: 16, "15,16"; 0 = none
    hidden: str = "auto"  # the router's input: final (the int8 drafter's), layers:N, or auto (the traces decide)
    clusters: int = 256
    width: int = 512
    max_steps: int = 1000
    batch_size: int = 256
    loss: str = "ce"

    @property
    def router_hidden(self) -> str | None:
        """The router's hidden input; None = the traces decide (auto)."""
        return None if self.hidden == "auto" else self.hidden


@dataclass(frozen=True)
class DrafterRecipe:
    """[drafter]: the EAGLE-3 draft head's training (prep train-drafter)."""

    draft_vocab: int = 16_384  # the target's most chosen tokens the head's LM head keeps (FR-Spec style)
    steps: int = 3  # training-time-test depth: draft steps unrolled
    epochs: int = 2
    lr: float = 5e-4
    # The head's MLP width as a fraction of the target's, in whole Q8_0 blocks of 32 (prep.drafter_train.mlp_width).
    # A quarter validated as the full width did on qwen2.5-coder's recipe data, and its cold draft step streams
    # ~40 % of the bytes (docs/draft-head.md, "A narrower MLP").
    mlp_width: float = 0.25
    # `prep all --with-drafter`'s data (prep.drafter_recipe): the target's own greedy responses, "SOURCE:PROMPTS"
    # (sharegpt, pystdlib, pyfunctions), and raw text, "CORPUS:TOKENS" (sharegpt, pystdlib; never HumanEval)
    responses: tuple[str, ...] = ("pyfunctions:100", "sharegpt:100")
    corpora: tuple[str, ...] = ()
    precision: str = "auto"  # Lightning's; auto: bf16-mixed on a CUDA GPU or a CPU with AVX512-BF16 but no AMX, else 32-true

    def __post_init__(self) -> None:
        if not 0 < self.mlp_width <= 1:
            raise ValueError(f"mlp_width = {self.mlp_width!r} should be a fraction of the target's MLP width in (0, 1]")


@dataclass(frozen=True)
class Recipe:
    """A model's recipe: one dataclass per section."""

    model: str | None = None
    cluster: ClusterRecipe = field(default_factory=ClusterRecipe)
    screen: ScreenRecipe = field(default_factory=ScreenRecipe)
    screen4: Screen4Recipe = field(default_factory=Screen4Recipe)
    router: RouterRecipe = field(default_factory=RouterRecipe)
    drafter: DrafterRecipe = field(default_factory=DrafterRecipe)


# Used for models without a recipe (a local directory or .gguf file), and under every recipe file.
DEFAULTS = Recipe()


def load_recipe(model: str) -> Recipe:
    """The recipe of a packaged model over DEFAULTS; DEFAULTS alone for other models (a directory or a .gguf)."""
    path = RECIPES_DIR / f"{model}.toml"
    if Path(model).name != model or not path.is_file():  # a path never names a recipe (nor a .toml beside it)
        return DEFAULTS
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path} is not valid TOML ({e}); fix the file") from None
    return parse_recipe(data, str(path))


def parse_recipe(data: dict[str, Any], where: str = "the recipe") -> Recipe:
    """A Recipe from a TOML table: sections over DEFAULTS' sections, every key and type checked."""
    sections = {f.name for f in dataclasses.fields(Recipe)} - {"model"}
    unknown = sorted(set(data) - sections - {"model"})
    if unknown:
        raise RecipeError(f"{where}: unknown section or key {', '.join(repr(k) for k in unknown)}; valid: model, "
                          f"{', '.join(f'[{s}]' for s in sorted(sections))}")
    values: dict[str, Any] = {"model": data.get("model", DEFAULTS.model)}
    for name in sections:
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise RecipeError(f"{where}: {name} must be a [{name}] section, not a {type(table).__name__}")
        values[name] = _section(getattr(DEFAULTS, name), table, f"{where} [{name}]")
    return Recipe(**values)


def overridden(section, **flags):
    """`section` with each flag that is not None in place of the recipe's value (the one place flags meet recipes)."""
    return dataclasses.replace(section, **{key: value for key, value in flags.items() if value is not None})


def _section(defaults, table: dict[str, Any], where: str):
    """`defaults` (a section dataclass) with the table's values, each key known and of its field's type."""
    hints = get_type_hints(type(defaults))
    known = [f.name for f in dataclasses.fields(defaults)]
    values = dict(table)
    for key, value in table.items():
        if key not in known:
            raise RecipeError(f"{where}: unknown key {key!r}; valid keys: {', '.join(known)}")
        if get_origin(hints[key]) is tuple:  # tuple[T, ...]: a TOML list of T
            item = get_args(hints[key])[0]
            if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
                raise RecipeError(f"{where}: {key} = {value!r} should be a list of {item.__name__}")
            values[key] = tuple(value)
            continue
        allowed = tuple(getattr(hints[key], "__args__", (hints[key],)))
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):  # True is an int too
            kinds = " or ".join(t.__name__ for t in allowed)
            raise RecipeError(f"{where}: {key} = {value!r} should be {kinds}")
    try:
        return dataclasses.replace(defaults, **values)
    except ValueError as e:  # a value its section refuses (DrafterRecipe.__post_init__)
        raise RecipeError(f"{where}: {e}") from None
