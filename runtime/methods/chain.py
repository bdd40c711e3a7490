"""spec (and its aliases dynaspec, frspec) and screenspec: a drafter proposes a chain, the target verifies it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.loops.decode import stream_ar
from runtime.drafters import DRAFTERS, DrafterSpec, drafters_help, parse_drafter
from runtime.drafters.dynaspec import ShortlistDrafting
from runtime.drafters.layers import LayersOptions
from runtime.methods.arguments import loop_options, loop_words
from runtime.methods.build import draft_context, drafter_head, target_head
from runtime.methods.registry import MethodAlias, MethodEntry, register_alias, register_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.session import Session
from runtime.loops.speculative import DraftBudget, stream_speculative


@dataclass(frozen=True)
class SpecOptions:
    """spec:DRAFTER[:gamma=G][:adaptive][:no-verifier]: the drafter and the loop's options."""

    drafter: DrafterSpec
    gamma: int | None = None  # tokens drafted per target forward (the starting value when adaptive); None: the default
    adaptive: bool = False
    verifier: bool = True  # False: the drafter's backend decodes alone (its own text, not the target's)

    @classmethod
    def parse(cls, args: list[str]) -> SpecOptions:
        rest, loop = loop_options(args)
        if not rest:
            raise ValueError(f"spec needs a drafter: spec:DRAFTER, DRAFTER one of {drafters_help()}")
        drafter = parse_drafter(":".join(rest))
        if not loop.get("verifier", True) and not drafter.entry.alone:
            alone = ", ".join(n for n, e in DRAFTERS.items() if e.alone)
            raise ValueError(f"no-verifier (generate --no-verifier) decodes with the drafter's own backend alone; the "
                             f"{drafter.name} drafter has none (drafters that do: {alone}), e.g. spec:gp:256:no-verifier")
        return cls(drafter, **loop)

    def format(self) -> tuple[str, ...]:
        return (*self.drafter.format(), *loop_words(self.gamma, self.adaptive, self.verifier))

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        return _chain(session, spec, self.drafter, None, self.gamma, self.adaptive, self.verifier)


@dataclass(frozen=True)
class ScreenspecOptions:
    """screenspec:layers:N[:gamma=G][:adaptive]: the target's first N layers drafting with the int8 screening head."""

    layers: int
    gamma: int | None = None
    adaptive: bool = False

    @classmethod
    def parse(cls, args: list[str]) -> ScreenspecOptions:
        rest, loop = loop_options(args)
        if rest[:1] != ["layers"] or not loop.get("verifier", True):
            raise ValueError("screenspec takes a layers:N drafter and gamma=G, adaptive, e.g. screenspec:layers:16 "
                             "(spec:int8 already drafts with the screening head)")
        return cls(LayersOptions.parse(rest[1:]).layers, **loop)

    def format(self) -> tuple[str, ...]:
        return ("layers", str(self.layers), *loop_words(self.gamma, self.adaptive))

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        drafter = DrafterSpec("layers", LayersOptions(self.layers))
        return _chain(session, spec, drafter, "screen", self.gamma, self.adaptive, True)


def _chain(session: Session, spec: MethodSpec, drafter_spec: DrafterSpec, head_kind: str | None, gamma: int | None,
           adaptive: bool, verifier: bool) -> Streamer:
    """The drafter proposes, the target verifies (or, without a verifier, the drafter's own backend
    decodes alone with the drafter's head)."""
    head = target_head(session, spec)
    own = drafter_head(session, spec, drafter_spec, head, head_kind)
    drafter = drafter_spec.build(draft_context(session, own))
    shortlist = drafter.head if isinstance(drafter, ShortlistDrafting) else None
    budget = DraftBudget()  # like the lookup drafter's session, it learns across this method's calls

    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        before = None if shortlist is None else replace(shortlist.stats)
        if verifier:
            tokens, stats = yield from stream_speculative(
                session.target, head, drafter, prompt, n, params, generator, gamma=gamma, adaptive=adaptive,
                min_new_tokens=min_new_tokens, stop=stop, budget=budget)
        else:
            tokens, stats = yield from stream_ar(drafter.backend, own, prompt, n, params, generator, min_new_tokens, stop)
        if shortlist is not None:
            stats.shortlist = shortlist.stats.since(before)
        return tokens, stats

    return stream


register_method(MethodEntry(
    "spec", SpecOptions, "spec:DRAFTER[:gamma=G][:adaptive][:no-verifier][+csv[:screen4|cluster]] (speculative decoding)",
    suffix=True))
register_alias(MethodAlias("dynaspec", "spec", "dynaspec:... (= spec:dynaspec:...)"))
register_alias(MethodAlias("frspec", "spec", "frspec:... (= spec:frspec:...)"))
register_method(MethodEntry("screenspec", ScreenspecOptions,
                            "screenspec:layers:N[:gamma=G][:adaptive] (layers:N with the int8 screening head)"))
