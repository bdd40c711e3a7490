"""`prep import`, `cluster` and `all`: convert a model, build the certified head's stages, run a recipe end to end."""

from __future__ import annotations

from pathlib import Path

import click

from artifacts import Artifact
from artifacts.format import Stage
from prep import stages
from prep.cli import SEED, clean_errors, main, model_argument
from prep.recipes import load_recipe, overridden
from prep.screen import check_group_size
from prep.screen4 import check_screen4_shape
from runtime.models import resolve_model


@main.command("import")
@model_argument
@clean_errors(interrupted="nothing half-converted is kept in the model cache: rerun the same command")
def import_model(model: str) -> None:
    """Resolve and convert a model once (cached as a safetensors directory).

    \b
    prep import gemma3-270m
    prep import ./my-model.gguf
    """
    resolved = resolve_model(model)
    click.echo(f"{resolved.name}: {resolved.path}")


@main.command("cluster")
@model_argument
@click.option("-o", "--out", required=True, help="Artifact directory to create or add to.")
@click.option("--clusters", type=int, default=None, help="Number of k-means clusters (default: the recipe's).")
@click.option("--iterations", type=int, default=None, help="k-means iterations (default: the recipe's).")
@click.option("--group-size", default=None, help="Screening scale group: 'auto', 'row' or a size such as 32.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Overwrite stages that already exist.")
@clean_errors
def cluster(model: str, out: str, clusters, iterations, group_size, seed: int, force: bool) -> None:
    """Build the `clusters` (cluster bound) and `screen` (int8 screening bound) stages.

    \b
    prep cluster gemma3-270m -o art/g270
    prep cluster qwen2.5-coder-0.5b-instruct -o art/qwen --clusters 1024 --force
    """
    recipe = load_recipe(model)
    cfg = overridden(recipe.cluster, clusters=clusters, iterations=iterations)
    clusters, iterations = cfg.clusters, cfg.iterations
    group = parse_group_size(overridden(recipe.screen, group_size=group_size).group_size)
    if clusters < 1 or iterations < 1:
        raise click.BadParameter("--clusters and --iterations must be at least 1")
    requested = {Stage.CLUSTERS: stages.cluster_request(clusters, iterations, cfg.top_m_bias, seed),
                 Stage.SCREEN: stages.screen_request(group)}
    with stages.output_artifact(out, force) as path:
        todo = stages.plan(stages.existing(path, model), requested, force)
        if todo:
            source = stages.open_for_writing(model, path, force)
            if group:
                check_group_size(group, source.artifact.model.hidden_size)
        if Stage.CLUSTERS in todo:
            stages.write_clusters(source, clusters, iterations, cfg.top_m_bias, seed, force)
        if Stage.SCREEN in todo:
            stages.write_screen(source, group, force)
    click.echo(f"{path}: stages {', '.join(todo) or 'none'} written, {', '.join(sorted(set(requested) - set(todo))) or 'none'} kept")


@main.command("screen4")
@model_argument
@click.option("-o", "--out", required=True, help="Artifact directory to create or add to.")
@click.option("--rank", type=int, default=None, help="Hidden-state basis directions whose error share is stored (default: the recipe's).")
@click.option("--group", type=int, default=None, help="Columns per scale and minimum, 32 or 64 (default: the recipe's).")
@click.option("--texts", type=int, default=None, help="ShareGPT train-split conversations for the basis (default: the recipe's).")
@click.option("--force", is_flag=True, help="Overwrite the stage if it exists.")
@clean_errors
def screen4(model: str, out: str, rank, group, texts, force: bool) -> None:
    """Build the `screen4` stage: a 4-bit screening head with a low-rank correction (`+csv:screen4`).

    \b
    prep screen4 gemma3-270m -o art/g270
    """
    cfg = overridden(load_recipe(model).screen4, rank=rank, group=group, texts=texts)
    if cfg.texts < 1:
        raise click.BadParameter("--texts must be at least 1")
    with stages.output_artifact(out, force) as path:
        todo = stages.plan(stages.existing(path, model), {Stage.SCREEN4: stages.screen4_request(cfg.rank, cfg.group)}, force)
        if todo:
            source = stages.open_for_writing(model, path, force)
            check_screen4_shape(source.artifact.model.hidden_size, cfg.rank, cfg.group)
            stages.write_screen4(source, cfg.rank, cfg.group, cfg.texts, force)
    click.echo(f"{path}: stage screen4 {'written' if todo else 'kept'}")


@main.command("all")
@model_argument
@click.option("-o", "--out", required=True, help="Artifact directory to create or complete.")
@click.option("--with-router", is_flag=True, help="Also run the recipe's prep traces + prep train-router (gemma3-270m: ~6 min on 2 cores).")
@click.option("--traces", "traces_dir", default=None, help="Traces directory for --with-router (default: traces/NAME for -o art/NAME).")
@click.option("--with-drafter", is_flag=True,
              help="Also train the recipe's EAGLE-3 draft head: the target's own responses, their features, training "
                   "(stage drafter; qwen2.5-coder: 23 min on 2 Zen 5 cores; 50 on 2 cores of the Intel Xeon with AMX "
                   "before its features were traced on the native backend).")
@click.option("--features", "features_dir", default=None,
              help="Data folder for --with-drafter: responses and features, reused on a rerun (default: features/NAME for -o art/NAME).")
@click.option("--force", is_flag=True, help="Rebuild stages that already exist.")
@clean_errors(interrupted="built stages, responses files and complete feature shards are kept: rerun the same command to resume")
def all_stages(model: str, out: str, with_router: bool, traces_dir, with_drafter: bool, features_dir, force: bool) -> None:
    """Run the model's recipe end to end; stages already built are kept (use --force to rebuild).

    \b
    prep all gemma3-270m -o art/g270
    prep all gemma3-270m -o art/g270 --with-router
    prep all qwen2.5-coder-0.5b-instruct -o art/qwen --with-drafter
    prep all qwen2.5-coder-0.5b-instruct -o art/qwen --force
    """
    recipe = load_recipe(model)
    cfg, low_bit = recipe.cluster, recipe.screen4
    group = parse_group_size(recipe.screen.group_size)
    requested = {Stage.CLUSTERS: stages.cluster_request(cfg.clusters, cfg.iterations, cfg.top_m_bias, 0),
                 Stage.SCREEN: stages.screen_request(group)}
    if low_bit.in_all:
        requested[Stage.SCREEN4] = stages.screen4_request(low_bit.rank, low_bit.group)
    if with_router:
        from prep.trace_files import check_traces_folder
        from prep.traces import check_corpus

        requested[Stage.ROUTER] = {}
        traces_dir = traces_dir or str(Path("traces") / Path(out).name)
        if Path(traces_dir).resolve() == Path(out).resolve():
            raise click.UsageError(f"--traces {traces_dir} is the artifact's own folder (-o); traces go in a folder "
                                   f"of their own, e.g. --traces traces/{Path(out).name}")
        check_traces_folder(traces_dir, "--traces")
        check_corpus(recipe.router.corpus)
    if with_drafter:
        from prep.drafter_recipe import feature_sets

        requested[Stage.DRAFTER] = {"draft_vocab": recipe.drafter.draft_vocab}
        features_dir = features_dir or str(Path("features") / Path(out).name)
        if Path(features_dir).resolve() == Path(out).resolve():
            raise click.UsageError(f"--features {features_dir} is the artifact's own folder (-o); features go in a folder "
                                   f"of their own, e.g. --features features/{Path(out).name}")
        feature_sets(recipe.drafter, features_dir)  # a bad [drafter] section is refused before any work
    with stages.output_artifact(out, force) as path:
        todo = stages.plan(stages.existing(path, model), requested, force)
        if not todo:
            click.echo(f"{path}: stages {', '.join(Artifact.open(path).stages)}")
            return
        source = stages.open_for_writing(model, path, force)
        if Stage.CLUSTERS in todo:
            stages.write_clusters(source, cfg.clusters, cfg.iterations, cfg.top_m_bias, 0, force)
        if Stage.SCREEN in todo:
            stages.write_screen(source, group, force)
        if Stage.SCREEN4 in todo:
            try:
                check_screen4_shape(source.artifact.model.hidden_size, low_bit.rank, low_bit.group)
            except ValueError as e:
                click.echo(f"screen4: skipped ({e})", err=True)
            else:
                stages.write_screen4(source, low_bit.rank, low_bit.group, low_bit.texts, force)
        if Stage.ROUTER in todo:
            from prep.router_train import router_from_recipe

            params = router_from_recipe(source.model, source.artifact, recipe.router, traces_dir, force)
            click.echo(f"router: recall@16 {params['validation'].get('val/recall@16', float('nan')):.3f}, "
                       f"traces in {traces_dir}", err=True)
        if Stage.DRAFTER in todo:
            from prep.drafter_recipe import build_drafter

            params = build_drafter(source.artifact, source.model, recipe.drafter, recipe.router, features_dir, force)
            top1 = " / ".join(f"{params['validation'][f'val/top1@{j}']:.1%}" for j in range(recipe.drafter.steps))
            took = ", ".join(f"{part} {seconds / 60:.1f} min" for part, seconds in params["recipe_seconds"].items())
            click.echo(f"drafter: validation top-1 by draft step {top1}; {took}; features in {features_dir}", err=True)
    click.echo(f"{path}: stages {', '.join(Artifact.open(path).stages)}")  # the drafter's was written by its own session


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
