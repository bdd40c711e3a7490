"""Drafters for speculative decoding: one protocol (propose, observe), several ways to guess ahead.

DRAFTERS is the drafter registry: a drafter is one `register_drafter` call with its name, a parser
of the arguments after the name (cheap: no model is touched, so bad names fail before a model
loads), a builder and a help line. `runtime.methods` reads it for `spec:DRAFTER...` and for
`runtime generate --drafter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.common.checks import is_digits
from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.eagle import EagleDrafter, build_eagle, parse_eagle
from runtime.drafters.gp import GP_HELP, GPDrafter, GPStage, parse_gp
from runtime.drafters.int8 import Int8Drafter
from runtime.drafters.layers import LayerDrafter
from runtime.drafters.model import ModelDrafter, load_model_drafter
from runtime.drafters.lookup import LookupDrafter
from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.onedecode import ONEDECODE_HELP, build_onedecode, parse_onedecode
from runtime.drafters.shortlist_names import build_shortlisted, parse_shortlisted


@dataclass
class DraftContext:
    """What a drafter builder may use: the target backend, the drafter's own head, the artifact, the model."""

    target: object  # the TargetModel the drafter guesses for
    head: object | None  # the drafter's own LM head (DrafterEntry.head says which kind), None for "none"
    artifact: object | None = None  # the session's Artifact (stages gp, router)
    target_info: object | None = None  # the target's ModelInfo (model:NAME checks its tokenizer against it)


@dataclass(frozen=True)
class DrafterEntry:
    """One registered drafter.

    parse: arguments after the name -> canonical arguments (ValueError naming the fix);
    build: (context, canonical arguments) -> Drafter;
    head: which own head the method builder gives it: "own" (the target head's family: full, or
    certified with the target's bound), "screen" (the int8 screening copy) or "none" (it brings its own);
    alone: it has a backend of its own and can decode without a verifier (`no-verifier`).
    """

    name: str
    parse: Callable[[list[str]], tuple[str, ...]]
    build: Callable[[DraftContext, tuple[str, ...]], Drafter]
    help: str
    head: str = "own"
    alone: bool = False


DRAFTERS: dict[str, DrafterEntry] = {}


def register_drafter(entry: DrafterEntry) -> DrafterEntry:
    """Add a drafter to the registry (its name must be new)."""
    if entry.name in DRAFTERS:
        raise ValueError(f"drafter {entry.name!r} is already registered")
    if entry.head not in ("own", "screen", "none"):
        raise ValueError(f"drafter head must be own, screen or none, not {entry.head!r}")
    DRAFTERS[entry.name] = entry
    return entry


def drafters_help() -> str:
    """The registered drafters, one help line each (for --help texts and errors)."""
    return ", ".join(entry.help for entry in DRAFTERS.values())


def parse_drafter(text: str) -> tuple[str, tuple[str, ...]]:
    """'NAME[:ARG...]' -> (name, canonical arguments); an unknown name lists the registered ones."""
    name, *args = text.strip().split(":")
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {text.strip()!r}; use {drafters_help()}")
    return name, DRAFTERS[name].parse(args)


def build_drafter(text: str, target, head=None, artifact=None, target_info=None) -> Drafter:
    """A drafter from its name (`drafters_help`); `head` is the drafter's own LM head, not the target's,
    so the drafter's rows do not count as the target's."""
    name, args = parse_drafter(text)
    return DRAFTERS[name].build(DraftContext(target, head, artifact, target_info), args)


def _integer(value: str, what: str, example: str, low: int = 1) -> int:
    """A positive integer argument, or a one-line error naming the fix."""
    if not is_digits(value) or int(value) < low:
        raise ValueError(f"{what} takes an integer >= {low}, not {value!r}; e.g. {example}")
    return int(value)


def _max_ngram(name: str, example: int) -> Callable[[list[str]], tuple[str, ...]]:
    """The parser of NAME[:MAX_NGRAM] (ngram, lookup): at most one positive integer."""
    def parse(args: list[str]) -> tuple[str, ...]:
        if len(args) > 1:
            raise ValueError(f"{name} takes at most one argument (the longest n-gram), not {':'.join(args)!r}; "
                             f"e.g. {name}:{example}")
        return tuple(str(_integer(a, f"{name}:MAX_NGRAM", f"{name}:{example}")) for a in args)

    return parse


def _layers(args: list[str]) -> tuple[str, ...]:
    if len(args) != 1:
        raise ValueError(f"layers takes one layer count, layers:N, not layers:{':'.join(args)}; e.g. layers:6")
    return (str(_integer(args[0], "layers:N", "layers:6")),)


def _gp(args: list[str]) -> tuple[str, ...]:
    parse_gp(args)
    return tuple(args)


def _model(args: list[str]) -> tuple[str, ...]:
    path = ":".join(args)
    if not path:
        raise ValueError("model: needs a model, e.g. model:path/to/smaller-model or model:file.gguf")
    return (path,)


def _none(name: str) -> Callable[[list[str]], tuple[str, ...]]:
    def parse(args: list[str]) -> tuple[str, ...]:
        if args:
            raise ValueError(f"{name} takes no argument, not {name}:{':'.join(args)}")
        return ()

    return parse


def _need_artifact(context: DraftContext, name: str):
    if context.artifact is None:
        raise ValueError(f"the {name} drafter needs the artifact whose stages it reads")
    return context.artifact


def _build_model(context: DraftContext, args: tuple[str, ...]) -> Drafter:
    if context.target_info is None:
        raise ValueError("model:NAME|PATH needs the target's ModelInfo to check the drafter's tokenizer")
    return load_model_drafter(args[0], context.target_info, context.target.vocab_size)


register_drafter(DrafterEntry(
    "ngram", _max_ngram("ngram", 3), lambda c, a: NgramDrafter(*(int(x) for x in a)),
    "ngram[:MAX_NGRAM] (prompt lookup)", head="none"))
register_drafter(DrafterEntry(
    "lookup", _max_ngram("lookup", 4), lambda c, a: LookupDrafter(*(int(x) for x in a)),
    "lookup[:MAX_NGRAM] (prompt lookup plus the session's earlier sequences; an n-token match drafts at most n)",
    head="none"))
register_drafter(DrafterEntry(
    "layers", _layers, lambda c, a: LayerDrafter(c.target, int(a[0]), c.head),
    "layers:N (the target's first N layers)"))
register_drafter(DrafterEntry(
    "gp", _gp, lambda c, a: GPDrafter(c.target, GPStage.load(_need_artifact(c, "gp")), *parse_gp(list(a)), c.head),
    GP_HELP, alone=True))
register_drafter(DrafterEntry(
    "model", _model, _build_model, "model:NAME|PATH (a model with the target's tokenizer)", head="none"))
register_drafter(DrafterEntry(
    "int8", _none("int8"), lambda c, a: Int8Drafter(c.target, c.head),
    "int8 (the target with int8 weights and the int8 screening head)", head="screen", alone=True))
for _name, _help in (("dynaspec", "dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:context=0|1] (router-"
                                  "shortlisted head)"),
                     ("frspec", "frspec:layers:N|int8:TOKENS[:context=0|1] (most-frequent-tokens head)")):
    register_drafter(DrafterEntry(
        _name, lambda args, name=_name: parse_shortlisted(name, args),
        lambda c, a, name=_name: build_shortlisted(name, a, c.target, _need_artifact(c, name)),
        _help, head="none"))

register_drafter(DrafterEntry("onedecode", parse_onedecode, build_onedecode, ONEDECODE_HELP, head="none"))
register_drafter(DrafterEntry(
    "eagle", parse_eagle, lambda c, a: build_eagle(c.target, c.artifact, a),
    "eagle[:frspec=N][:lookup] (the trained EAGLE-3 head of stage drafter, on the target's own features; "
    "lookup: prompt lookup first)", head="none"))


__all__ = [
    "DRAFTERS", "DraftContext", "Drafter", "DrafterEntry", "EagleDrafter", "GPDrafter", "Int8Drafter", "LayerDrafter", "LookupDrafter",
    "ModelDrafter", "NgramDrafter", "Proposal", "build_drafter", "drafters_help", "load_model_drafter", "parse_drafter",
    "register_drafter",
]
