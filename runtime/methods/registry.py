"""The method registry: a method is a name bound to its options type (parse, format, build) and its claims.

A method's module defines its options as a frozen dataclass and registers it with `register_method`
right below; `runtime.methods` imports every method module, so the registry is full once it is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol


class MethodOptions(Protocol):
    """A method's typed arguments (a frozen dataclass): parsed from the words after its name, formatted back, built.

    The options of a method that drafts carry `drafter` (a DrafterSpec, or None for a table of its own),
    of one that can decode without the target `verifier`, and of one that runs on another backend
    `backend` (MethodSpec reads them).
    """

    @classmethod
    def parse(cls, args: list[str]) -> MethodOptions:
        """The words after the method's name -> options, or a one-line ValueError naming the fix."""
        ...

    def format(self) -> tuple[str, ...]:
        """The canonical words after the name (parse(format()) == self)."""
        ...

    def build(self, session, spec):
        """The method's Streamer (runtime.methods.streamer) over `session` (a Session); `spec`, its MethodSpec
        (runtime.methods.spec, which reads this registry), carries the target head and its budgets."""
        ...


def full_head(options: MethodOptions) -> str:
    """The target head of a method whose name does not choose one: the full head."""
    return "full"


@dataclass(frozen=True)
class MethodEntry:
    """One registered method.

    suffix: it takes +csv[:BOUND] (the certified head verifies its drafts); head: the target head its
    options choose when no suffix does (csv's bound); bench_only: a reference that `runtime generate`
    does not run (e.g. another program's decoder).
    """

    name: str
    options: type[MethodOptions]
    help: str
    distribution_preserving: bool = True
    bench_only: bool = False
    suffix: bool = False
    head: Callable[[MethodOptions], str] = field(default=full_head)


@dataclass(frozen=True)
class MethodAlias:
    """A name that stands for a method's first argument: `dynaspec:X` is `spec:dynaspec:X`."""

    name: str
    method: str
    help: str


METHODS: dict[str, MethodEntry] = {}
ALIASES: dict[str, MethodAlias] = {}


def register_method(entry: MethodEntry) -> MethodEntry:
    """Add a method to the registry (its name must be new)."""
    if entry.name in METHODS or entry.name in ALIASES:
        raise ValueError(f"method {entry.name!r} is already registered")
    METHODS[entry.name] = entry
    return entry


def register_alias(alias: MethodAlias) -> MethodAlias:
    """Add an alias of a registered method (its name must be new)."""
    if alias.name in METHODS or alias.name in ALIASES or alias.method not in METHODS:
        raise ValueError(f"alias {alias.name!r} must be a new name for a registered method, not {alias.method!r}")
    ALIASES[alias.name] = alias
    return alias
