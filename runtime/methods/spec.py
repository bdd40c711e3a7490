"""The value a method name parses to: MethodSpec (what to decode with), and `canonical`, its name back.

`canonical` writes the registered name, then the words of the method's options (their `format`),
then the +HEAD suffix for methods that take one.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.drafters import DrafterSpec
from runtime.heads import BOUNDS
from runtime.methods.registry import METHODS, MethodOptions
from runtime.common.sampling import SamplingParams

HEADS = ("full", *(f"csv:{bound}" for bound in BOUNDS))
NOT_PRESERVING = "not distribution-preserving"  # said beside every name of such a method (help, generate, bench)


@dataclass(frozen=True)
class MethodSpec:
    """What to decode with: the registered method, its typed options, the target head and its budgets."""

    name: str  # the registered method
    options: MethodOptions  # the method's own typed options (runtime.methods.registry.MethodOptions)
    head: str = "full"  # the target's head: full, csv:screen, csv:screen4 or csv:cluster
    cluster_budget: float = 0.25  # csv:cluster: largest fraction of the vocabulary opened before falling back
    adaptive_budget: bool = False  # csv:cluster: adapt that budget as CSV-Decode does
    text: str = ""  # the name as given (bench rows are keyed by it)

    @property
    def certified(self) -> bool:
        return self.head != "full"

    @property
    def bound(self) -> str:
        """The certified head's bound family: screen, screen4 or cluster."""
        return self.head.removeprefix("csv:") if self.certified else "screen"

    @property
    def drafter(self) -> DrafterSpec | None:
        """The drafter of a method that drafts with a registered one, else None."""
        return getattr(self.options, "drafter", None)

    @property
    def backend(self) -> str | None:
        """A backend other than the session's that the method runs on (ar:BACKEND), else None."""
        return getattr(self.options, "backend", None)

    @property
    def verifier(self) -> bool:
        """Whether the target verifies (False: spec's no-verifier, the drafter decodes alone)."""
        return getattr(self.options, "verifier", True)

    @property
    def distribution_preserving(self) -> bool:
        """Whether outputs follow the target's distribution (greedy: its exact tokens)."""
        return METHODS[self.name].distribution_preserving and self.verifier

    def __str__(self) -> str:
        return self.text or canonical(self)


def canonical(spec: MethodSpec) -> str:
    """The name in the grammar that parses back to `spec` (budgets aside)."""
    suffix = f"+{spec.head}" if spec.certified and METHODS[spec.name].suffix else ""
    return ":".join((spec.name, *spec.options.format())) + suffix


def preserves_distribution(spec: MethodSpec | None, params: SamplingParams) -> bool:
    """Whether `spec` under `params` follows the target's distribution (greedy: its exact tokens).

    The method's own claim (None: a plain Method, which makes it), unless its certified head samples
    within total variation epsilon (`params.epsilon` at a temperature above 0; the full head ignores it).
    """
    if spec is None:
        return True
    return spec.distribution_preserving and not (spec.certified and params.epsilon is not None and not params.greedy)


def marked(name: str, preserving: bool) -> str:
    """A method's name, with [NOT_PRESERVING] after it when it does not preserve the target's distribution."""
    return name if preserving else f"{name} [{NOT_PRESERVING}]"
