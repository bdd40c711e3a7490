"""dynaspec: and frspec: drafter names, parsed and built: `dynaspec:DRAFTER[:options]`, `frspec:DRAFTER:TOKENS`.

DRAFTER is `layers:N` or `int8`. The router (`dynaspec`) must have been trained on the hidden state
the drafter gives it: `layers:N`, or `final` for `int8`. Options:

- k=K clusters per draft token (default 16); schedule=fixed|position (DynaSpec's k_c(t));
  router=onnx|torch (the engine that runs the router; ONNX Runtime by default); overlap=0|1
  (default 1: the router runs in a second thread beside the drafter's forward);
- context=0|1 (default 1): the sequence's own tokens are in the shortlist too; 0 is the papers' head.

Parsing (`parse_shortlisted`) touches no model, so a bad name fails before one loads. The drafters
themselves are in runtime.drafters.dynaspec, their shortlist head in runtime.heads.shortlist.
"""

from __future__ import annotations

from artifacts import Artifact
from runtime.common.checks import is_digits
from runtime.drafters.dynaspec import (
    RoutedInt8Drafter, RoutedLayerDrafter, RouterStage, ShortlistInt8Drafter, ShortlistLayerDrafter,
)
from runtime.drafters.router import ENGINES, SCHEDULES
from runtime.backends.base import TargetModel

SHORTLIST_HELP = "dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:context=0|1] or frspec:layers:N|int8:TOKENS[:context=0|1]"
DEFAULTS = {"k": "16", "schedule": "fixed", "router": "onnx", "overlap": "1", "context": "1"}
CHOICES = {"schedule": tuple(SCHEDULES), "router": ENGINES, "overlap": ("0", "1"), "context": ("0", "1")}


def parse_shortlisted(name: str, args: list[str]) -> tuple[str, ...]:
    """Check a dynaspec / frspec drafter's arguments; canonical form: (kind, [TOKENS,] key=value for every option)."""
    kind, args = _drafter_kind(args)
    known = tuple(DEFAULTS) if name == "dynaspec" else ("context",)
    options, rest = _options(args, known)
    for key, value in options.items():
        if key in CHOICES and value not in CHOICES[key]:
            raise ValueError(f"{key} takes {' or '.join(CHOICES[key])}, got {value!r} in {name}:{':'.join([kind] + args)}")
    if name == "frspec":
        if len(rest) != 1 or not is_digits(rest[0]) or int(rest[0]) < 1:
            raise ValueError(f"frspec takes a shortlist size and context=0|1: frspec:{kind}:TOKENS, e.g. "
                             f"frspec:layers:16:26214; got {':'.join([name, kind] + args)!r}")
        return (kind, rest[0], f"context={options.get('context', DEFAULTS['context'])}")
    if rest:
        raise ValueError(f"dynaspec options are k=K, schedule=fixed|position, router=onnx|torch, overlap=0|1 and "
                         f"context=0|1; got {':'.join(rest)!r}")
    k = options.get("k", DEFAULTS["k"])
    if not is_digits(k) or int(k) < 1:
        raise ValueError(f"dynaspec k takes an integer >= 1 (clusters per draft token), got {k!r}; e.g. k=8")
    return (kind, *(f"{key}={options.get(key, default)}" for key, default in DEFAULTS.items()))


def build_shortlisted(name: str, args: tuple[str, ...], target: TargetModel, artifact: Artifact):
    """The drafter named by `name` and parse_shortlisted's canonical `args`; its ShortlistHead is `drafter.head`."""
    kind = args[0]
    options = dict(part.split("=", 1) for part in args if "=" in part)
    context = options["context"] == "1"
    stage = RouterStage.load(artifact)
    if name == "frspec":
        head = stage.frequent_head(target, int(args[1]), context)
        return ShortlistInt8Drafter(target, head) if kind == "int8" else ShortlistLayerDrafter(target, _depth(kind), head)
    stage.check_hidden(kind)
    head = stage.cluster_head(target, context)
    routing = (stage.runner(options["router"]), int(options["k"]), options["schedule"], options["overlap"] == "1")
    if kind == "int8":
        return RoutedInt8Drafter(target, head, *routing)
    return RoutedLayerDrafter(target, _depth(kind), head, *routing)


def _drafter_kind(args: list[str]) -> tuple[str, list[str]]:
    """("layers:N" or "int8", the arguments after it)."""
    if args[:1] == ["int8"]:
        return "int8", args[1:]
    if len(args) >= 2 and args[0] == "layers" and is_digits(args[1]):
        return f"layers:{args[1]}", args[2:]
    raise ValueError(f"dynaspec and frspec take a layers:N or int8 drafter; use {SHORTLIST_HELP}")


def _depth(kind: str) -> int:
    return int(kind.removeprefix("layers:"))


def _options(args: list[str], known: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """The key=value arguments whose key is known, and the rest."""
    options, rest = {}, []
    for part in args:
        key, _, value = part.partition("=")
        if value and key in known:
            options[key] = value
        else:
            rest.append(part)
    return options, rest


__all__ = ["SHORTLIST_HELP", "build_shortlisted", "parse_shortlisted"]
