"""The values of the method grammar: MethodSpec (what to decode with), DrafterSpec, and the METHODS registry.

runtime.methods holds the grammar and each method's parser, which fill the registry and produce
these values; `canonical` writes a spec back as a name. runtime.methods re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.common.sampling import SamplingParams
from runtime.heads import BOUNDS

HEADS = ("full", *(f"csv:{bound}" for bound in BOUNDS))
NOT_PRESERVING = "not distribution-preserving"  # said beside every name of such a method (help, generate, bench)


@dataclass(frozen=True)
class DrafterSpec:
    """A registered drafter and its canonical arguments."""

    name: str
    args: tuple[str, ...] = ()

    def __str__(self) -> str:
        return ":".join((self.name, *self.args))


@dataclass(frozen=True)
class MethodSpec:
    """What to decode with: target head, drafter, loop options and backend override."""

    name: str  # the registered method that builds it
    head: str = "full"  # the target's head: full, csv:screen, csv:screen4 or csv:cluster
    drafter: DrafterSpec | None = None
    gamma: int | None = None  # tokens drafted per target forward (the starting value when adaptive); None: the default
    adaptive: bool = False
    verifier: bool = True  # False: the drafter's backend decodes alone (its own text, not the target's)
    draft_head: str | None = None  # None: the drafter's registered head; "screen": the int8 screening copy
    backend: str | None = None  # a backend (TargetModel implementation) other than the session's
    cluster_budget: float = 0.25  # csv:cluster: largest fraction of the vocabulary opened before falling back
    adaptive_budget: bool = False  # csv:cluster: adapt that budget as CSV-Decode does
    text: str = ""  # the name as given (bench rows are keyed by it)
    options: tuple[str, ...] = ()  # a method's own canonical arguments (swarm: K, nodes=N; mjsd: beam=M, tau=T; llamacpp: lookup, K or bin)

    @property
    def certified(self) -> bool:
        return self.head != "full"

    @property
    def bound(self) -> str:
        """The certified head's bound family: screen, screen4 or cluster."""
        return self.head.removeprefix("csv:") if self.certified else "screen"

    @property
    def distribution_preserving(self) -> bool:
        """Whether outputs follow the target's distribution (greedy: its exact tokens)."""
        return METHODS[self.name].distribution_preserving and self.verifier

    def __str__(self) -> str:
        return self.text or canonical(self)


@dataclass(frozen=True)
class MethodEntry:
    """One registered method.

    parse: (arguments after the name, target head from a +csv suffix or None) -> MethodSpec;
    build: (session, spec) -> Streamer (runtime.method_builders.Streamer);
    bench_only: a reference that `runtime generate` does not run (e.g. another program's decoder).
    """

    name: str
    parse: Callable[[list[str], str | None], MethodSpec]
    build: Callable
    help: str
    distribution_preserving: bool = True
    bench_only: bool = False


METHODS: dict[str, MethodEntry] = {}


def register_method(entry: MethodEntry) -> MethodEntry:
    """Add a method to the registry (its name must be new)."""
    if entry.name in METHODS:
        raise ValueError(f"method {entry.name!r} is already registered")
    METHODS[entry.name] = entry
    return entry


def canonical(spec: MethodSpec) -> str:
    """The name in the grammar that parses back to `spec` (budgets and backend overrides aside)."""
    if spec.drafter is None:
        if spec.name == "llamacpp":
            return ":".join([spec.name, *spec.options])
        return spec.name if spec.name == "ar" and spec.backend is None else (
            f"ar:{spec.backend}" if spec.name == "ar" else spec.head)
    options = [f"gamma={spec.gamma}"] * (spec.gamma is not None) + ["adaptive"] * spec.adaptive + ["no-verifier"] * (not spec.verifier)
    if spec.name == "screenspec":
        return ":".join(["screenspec", str(spec.drafter), *options])
    suffix = f"+{spec.head}" if spec.certified else ""
    if spec.name in ("swarm", "mjsd"):  # swarm:DRAFTER:K:gamma=G:nodes=N, mjsd:DRAFTER:gamma=G:beam=M:tau=T
        first = int(spec.name == "swarm")
        return ":".join([spec.name, str(spec.drafter), *spec.options[:first], *options, *spec.options[first:]]) + suffix
    return ":".join(["spec", str(spec.drafter), *options]) + suffix


def preserves_distribution(spec: "MethodSpec | None", params: SamplingParams) -> bool:
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
