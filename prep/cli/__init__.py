"""`prep`: read a causal LM once and write versioned artifacts for the runtime."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from artifacts.format import TMP_PREFIX
from runtime.cli import OneLineGroup
from runtime.cli import clean_errors as runtime_clean_errors
from runtime.cli.values import Integer
from runtime.models import DEFAULT_MODEL

SEED = Integer(0, 2**32 - 1)  # the seeds numpy, faiss and Lightning take
# The MODEL argument of the commands that read a model: a packaged name, a model directory or a .gguf
# file; its usage line names the default taken when it is left out.
model_argument = click.argument("model", default=DEFAULT_MODEL, metavar=f"[MODEL (default {DEFAULT_MODEL})]")


STAGES_KEPT = "stages already written are kept: rerun the same command to finish"


def clean_errors(command=None, *, interrupted: str = STAGES_KEPT):
    """runtime's one-line errors, plus OS errors (a full disk, a read-only place) and Ctrl-C.

    Ctrl-C's line says `interrupted`: what the command keeps, and how to go on
    (`@clean_errors(interrupted=...)` for another).
    """
    if command is None:
        return functools.partial(clean_errors, interrupted=interrupted)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return runtime_clean_errors(command, interrupted=interrupted)(*args, **kwargs)
        except OSError as e:
            where = f" ({written_place(e.filename)})" if e.filename else ""
            raise click.ClickException(f"{e.strerror or e}{where}; free space or choose a writable place, "
                                       "then rerun the same command") from None

    return wrapper


def written_place(filename) -> str:
    """The path to name for a failed write: the folder holding a temporary, not the temporary (gone by now)."""
    parts = Path(filename).parts
    first = next((i for i, part in enumerate(parts) if part.startswith(TMP_PREFIX)), None)
    return str(Path(*parts[:first])) if first is not None else str(filename)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Prepare artifacts for a model: clusters, screening head, and more.

    \b
    prep import gemma3-270m
    prep cluster gemma3-270m -o art/g270
    prep all gemma3-270m -o art/g270
    """


from prep.cli import drafter_stages, head_stages  # noqa: E402,F401  (the commands register on `main`)

__all__ = ["clean_errors", "main"]
