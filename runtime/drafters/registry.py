"""The drafter registry: a drafter is a name bound to its options type, which parses, formats and builds it.

A DrafterSpec is a parsed drafter name: the registered name and its typed options. Parsing touches no
model, so a bad name fails before a model loads; `DrafterSpec.build` makes the Drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

from runtime.drafters.base import Drafter

HEAD_KINDS = ("own", "screen", "none")


@dataclass
class DraftContext:
    """What a drafter builder may use: the target backend, the drafter's own head, the artifact, the model."""

    target: object  # the TargetModel the drafter guesses for
    head: object | None  # the drafter's own LM head (DrafterEntry.head says which kind), None for "none"
    artifact: object | None = None  # the session's Artifact (stages gp, router)
    target_info: object | None = None  # the target's ModelInfo (model:NAME checks its tokenizer against it)
    once: Callable[[Hashable, Callable[[], object]], object] = lambda key, make: make()  # Session.once: built once per session


class DrafterOptions(Protocol):
    """A drafter's typed arguments (a frozen dataclass): parsed from the words after its name, formatted back, built."""

    @classmethod
    def parse(cls, args: list[str]) -> DrafterOptions:
        """The words after the drafter's name -> options, or a one-line ValueError naming the fix."""
        ...

    def format(self) -> tuple[str, ...]:
        """The canonical words after the name (parse(format()) == self)."""
        ...

    def build(self, context: DraftContext) -> Drafter:
        """The drafter these options name."""
        ...


@dataclass(frozen=True)
class DrafterEntry:
    """One registered drafter.

    head: which own head the method builder gives it: "own" (the target head's family: full, or
    certified with the target's bound), "screen" (the int8 screening copy) or "none" (it brings its own);
    alone: it has a backend of its own and can decode without a verifier (`no-verifier`).
    """

    name: str
    options: type[DrafterOptions]
    help: str
    head: str = "own"
    alone: bool = False


DRAFTERS: dict[str, DrafterEntry] = {}


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter name: the registered drafter and its typed options."""

    name: str
    options: DrafterOptions

    @property
    def entry(self) -> DrafterEntry:
        return DRAFTERS[self.name]

    def build(self, context: DraftContext) -> Drafter:
        return self.options.build(context)

    def format(self) -> tuple[str, ...]:
        """The name and its canonical arguments, as grammar words."""
        return (self.name, *self.options.format())

    def __str__(self) -> str:
        return ":".join(self.format())


def register_drafter(entry: DrafterEntry) -> DrafterEntry:
    """Add a drafter to the registry (its name must be new)."""
    if entry.name in DRAFTERS:
        raise ValueError(f"drafter {entry.name!r} is already registered")
    if entry.head not in HEAD_KINDS:
        raise ValueError(f"drafter head must be {', '.join(HEAD_KINDS)}, not {entry.head!r}")
    DRAFTERS[entry.name] = entry
    return entry


def drafters_help() -> str:
    """The registered drafters, one help line each (for --help texts and errors)."""
    return ", ".join(entry.help for entry in DRAFTERS.values())


def parse_drafter(text: str) -> DrafterSpec:
    """'NAME[:ARG...]' -> DrafterSpec; an unknown name lists the registered ones."""
    name, *args = text.strip().split(":")
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {text.strip()!r}; use {drafters_help()}")
    return DrafterSpec(name, DRAFTERS[name].options.parse(args))


def build_drafter(text: str, target, head=None, artifact=None, target_info=None) -> Drafter:
    """A drafter from its name (`drafters_help`); `head` is the drafter's own LM head, not the target's,
    so the drafter's rows do not count as the target's."""
    return parse_drafter(text).build(DraftContext(target, head, artifact, target_info))
