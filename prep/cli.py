"""`prep`: read a causal LM once and write versioned artifacts for the runtime."""

from __future__ import annotations

import functools
import sys

import click

from artifacts import ArtifactError
from artifacts.format import Stage
from prep import stages
from prep.recipes import load_recipe
from runtime.models import DEFAULT_MODEL, ModelError, resolve_model


def clean_errors(command):
    """Turn expected failures into one-line click errors (exit 1, no traceback)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ArtifactError, ModelError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Prepare artifacts for a model: clusters, screening head, and more.

    \b
    prep import gemma3-270m
    prep cluster gemma3-270m -o art/g270
    prep all gemma3-270m -o art/g270
    """


@main.command("import")
@click.argument("model", default=DEFAULT_MODEL)
@clean_errors
def import_model(model: str) -> None:
    """Resolve and convert a model once (cached as a safetensors directory).

    \b
    prep import gemma3-270m
    prep import ./my-model.gguf
    """
    resolved = resolve_model(model)
    click.echo(f"{resolved.name}: {resolved.path}")


@main.command("cluster")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-o", "--out", required=True, help="Artifact directory to create or add to.")
@click.option("--clusters", type=int, default=None, help="Number of k-means clusters (default: the recipe's).")
@click.option("--iterations", type=int, default=None, help="k-means iterations (default: the recipe's).")
@click.option("--group-size", default=None, help="Screening scale group: 'auto', 'row' or a size such as 32.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite stages that already exist.")
@clean_errors
def cluster(model: str, out: str, clusters, iterations, group_size, seed: int, force: bool) -> None:
    """Build the `clusters` (cluster bound) and `screen` (int8 screening bound) stages.

    \b
    prep cluster gemma3-270m -o art/g270
    prep cluster qwen2.5-coder-0.5b-instruct -o art/qwen --clusters 1024 --force
    """
    recipe = load_recipe(model)
    source = stages.open_for_writing(model, out, [Stage.CLUSTERS, Stage.SCREEN], force)
    cfg = recipe["cluster"]
    stages.write_clusters(
        source,
        clusters or cfg["clusters"],
        iterations or cfg["iterations"],
        cfg["top_m_bias"],
        seed,
        force,
    )
    stages.write_screen(source, parse_group_size(group_size or recipe["screen"]["group_size"]), force)
    click.echo(f"wrote stages clusters, screen to {source.artifact.path}")


@main.command("all")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-o", "--out", required=True, help="Artifact directory to create or complete.")
@click.option("--force", is_flag=True, help="Rebuild stages that already exist.")
@clean_errors
def all_stages(model: str, out: str, force: bool) -> None:
    """Run the model's recipe end to end; stages already built are kept (use --force to rebuild).

    \b
    prep all gemma3-270m -o art/g270
    prep all qwen2.5-coder-0.5b-instruct -o art/qwen --force
    """
    recipe = load_recipe(model)
    source = stages.open_for_writing(model, out, [], force)
    todo = [stage for stage in (Stage.CLUSTERS, Stage.SCREEN) if force or not source.artifact.has_stage(stage)]
    for stage in {Stage.CLUSTERS, Stage.SCREEN} - set(todo):
        click.echo(f"{stage}: already built, kept (pass --force to rebuild)", err=True)
    if Stage.CLUSTERS in todo:
        cfg = recipe["cluster"]
        stages.write_clusters(source, cfg["clusters"], cfg["iterations"], cfg["top_m_bias"], 0, force)
    if Stage.SCREEN in todo:
        stages.write_screen(source, parse_group_size(recipe["screen"]["group_size"]), force)
    click.echo(f"{source.artifact.path}: stages {', '.join(source.artifact.stages)}")


def parse_group_size(value) -> int | None:
    """'auto' -> None (measure), 'row' -> 0 (per-row scales), else a positive integer."""
    if value in ("auto", None):
        return None
    if value == "row":
        return 0
    try:
        size = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: use 'auto', 'row' or an integer such as 32") from None
    if size <= 0:
        raise click.BadParameter("the group size must be positive")
    return size


if __name__ == "__main__":
    sys.exit(main())
