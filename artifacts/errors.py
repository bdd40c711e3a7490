"""Errors raised for bad artifacts; each message is one line that names the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from artifacts.format import MANIFEST_FILE, READABLE_VERSIONS, Stage

if TYPE_CHECKING:
    from artifacts.fingerprint import ModelInfo

# The prep command that builds each stage, for messages; {model} and {artifact}
# are filled in where known. Stages without an entry come from a full recipe.
PREP_COMMANDS = {
    Stage.CLUSTERS: "prep cluster {model} -o {artifact}",
    Stage.SCREEN4: "prep screen4 {model} -o {artifact}",
    Stage.ROUTER: "prep train-router {artifact} --traces TRACES",
    Stage.GP: "prep gp-basis {artifact} --rank RANK",
    Stage.ONEDECODE: "prep bake-onedecode {artifact} --traces TRACES",
    Stage.DRAFTER: "prep train-drafter {artifact} --features FEATURES",
}
RECIPE_COMMAND = "prep all {model} -o {artifact}"


def prep_command(stage: str, artifact: Path | str, model: str = "MODEL") -> str:
    """Return the prep command line that (re)builds `stage` in `artifact`."""
    return PREP_COMMANDS.get(stage, RECIPE_COMMAND).format(model=model, artifact=artifact)


class ArtifactError(Exception):
    """Base of every artifact error; str(e) is the full one-line message."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.splitlines()))


def broken_link(path: Path) -> str | None:
    """'it is a link to X, which does not exist' for a dangling symlink, else None: how messages name one."""
    if path.is_symlink() and not path.exists():
        return f"it is a link to {os.readlink(path)}, which does not exist"
    return None


class NotAnArtifact(ArtifactError):
    """The path is missing, or its manifest is missing or damaged.

    When `damaged`, building into the same directory would meet the same manifest, so the fix names a new one.
    """

    def __init__(self, path: Path | str, reason: str, damaged: bool = False) -> None:
        self.path = Path(path)
        if damaged:
            fix = (f"restore its {MANIFEST_FILE}, or remove the directory, or build into a new one with "
                   f"`{RECIPE_COMMAND.format(model='MODEL', artifact='NEWDIR')}`")
        elif self.path.suffix == ".gguf" and self.path.is_file():  # a model file given where its artifact goes
            fix = f"build an artifact from it with `{RECIPE_COMMAND.format(model=path, artifact='ART')}`, then pass ART"
        elif self.path.is_file() and (self.path.parent / MANIFEST_FILE).is_file():  # a file inside an artifact
            fix = f"pass the artifact's folder, {self.path.parent}"
        elif (broken := broken_link(self.path)) is not None:
            fix = f"{broken}: fix or remove the link"
        else:
            fix = f"check the path, or build one with `{RECIPE_COMMAND.format(model='MODEL', artifact=path)}`"
        super().__init__(f"{path} is not a specvocab artifact ({reason}); {fix}")


class UnknownFormatVersion(ArtifactError):
    """The manifest declares a format version this package cannot read."""

    def __init__(self, path: Path | str, found: object) -> None:
        self.path = Path(path)
        self.found = found
        super().__init__(
            f"{Path(path) / MANIFEST_FILE} has format_version {found!r}, but this "
            f"specvocab reads {' and '.join(map(str, READABLE_VERSIONS))}; upgrade specvocab or rebuild "
            f"with `{RECIPE_COMMAND.format(model='MODEL', artifact='NEWDIR')}`"
        )


class StageProblem(ArtifactError):
    """A stage that is there but unusable; the fix is to rebuild it (ChecksumMismatch, SchemaMismatch)."""

    def __init__(self, path: Path | str, stage: str, problem: str, model: str = "MODEL") -> None:
        self.path = Path(path)
        self.stage = stage
        super().__init__(
            f"artifact {path}, stage {stage!r}: {problem}; rebuild the stage with "
            f"`{prep_command(stage, path, model)} --force`"
        )


class ChecksumMismatch(StageProblem):
    """A stage file is missing, truncated or altered since it was written."""


class MissingStage(ArtifactError):
    """The artifact has no such stage (or no such file in a stage)."""

    def __init__(self, path: Path | str, stage: str, model: str = "MODEL", what: str = "") -> None:
        self.path = Path(path)
        self.stage = stage
        missing = what or f"no {stage!r} stage"
        super().__init__(f"artifact {path} has {missing}; run `{prep_command(stage, path, model)}`")


class StageExists(ArtifactError):
    """A write would replace a stage that is already there."""

    def __init__(self, path: Path | str, stage: str) -> None:
        self.path = Path(path)
        self.stage = stage
        super().__init__(f"artifact {path} already has a {stage!r} stage; pass --force to overwrite")


class ModelMismatch(ArtifactError):
    """The artifact was built for another model than the one asked for."""

    def __init__(self, path: Path | str, built_for: ModelInfo, requested: ModelInfo) -> None:
        self.path = Path(path)
        self.built_for = built_for
        self.requested = requested
        super().__init__(
            f"artifact {path} was built for {built_for.name} (fingerprint "
            f"{built_for.fingerprint_prefix}), not {requested.name} (fingerprint "
            f"{requested.fingerprint_prefix}); rebuild with "
            f"`{prep_command(Stage.CLUSTERS, 'NEWDIR', requested.name)}`"
        )


class SchemaMismatch(StageProblem):
    """A stage's contents do not fit its schema (names, dtypes, shapes, parameters)."""


class ArtifactLocked(ArtifactError):
    """Another live process is writing into the artifact."""

    def __init__(self, path: Path | str, pid: int) -> None:
        self.path = Path(path)
        self.pid = pid
        super().__init__(
            f"{path} is being written by another prep run (pid {pid}); wait for it to finish, "
            "or write to another directory with -o"
        )
