"""`runtime inspect`: what an artifact holds, and whether it is valid (for its model)."""

from __future__ import annotations

import sys

import click

from runtime.cli.group import clean_errors, main


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--check-model", is_flag=True, help="Also load the model and compare fingerprints.")
@clean_errors
def inspect(artifact, check_model) -> None:
    """Show an artifact's stages, parameters and sizes, and whether it is valid.

    \b
    runtime inspect art/g270
    runtime inspect art/g270 --check-model
    """
    from runtime.cli.describe import describe_artifact

    model_info = None
    if check_model:
        from artifacts import Artifact
        from runtime.models import load_model
        from runtime.session import model_spec_of

        model_info = load_model(model_spec_of(Artifact.open(artifact)), progress=False).info
    report, valid = describe_artifact(artifact, model_info)
    click.echo(report)
    if not valid:
        sys.exit(1)
