"""`prep`: read a causal LM once and write versioned artifacts for the runtime."""

from __future__ import annotations

from pathlib import Path

import click

from artifacts.format import TMP_PREFIX
from runtime.cli.group import OneLineGroup
from runtime.cli.group import clean_errors as runtime_clean_errors
from runtime.cli.values import Integer
from runtime.models import DEFAULT_MODEL

SEED = Integer(0, 2**32 - 1)  # the seeds numpy, faiss and Lightning take
# The MODEL argument of the commands that read a model: a packaged name, a model directory or a .gguf
# file; its usage line names the default taken when it is left out.
model_argument = click.argument("model", default=DEFAULT_MODEL, metavar=f"[MODEL (default {DEFAULT_MODEL})]")


STAGES_KEPT = "stages already written are kept: rerun the same command to finish"


def clean_errors(command=None, *, interrupted: str = STAGES_KEPT):
    """runtime's one-line errors and interrupts, with prep's line for OS errors (a full disk, a read-only place).

    An interrupt's line says `interrupted`: what the command keeps, and how to go on
    (`@clean_errors(interrupted=...)` for another).
    """
    return runtime_clean_errors(command, interrupted=interrupted, os_error=write_error_line)


def write_error_line(error: OSError) -> str:
    """prep's line for a failed write: the error, the folder it names, and the fix."""
    where = f" ({written_place(error.filename)})" if error.filename else ""
    return f"{error.strerror or error}{where}; free space or choose a writable place, then rerun the same command"


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
