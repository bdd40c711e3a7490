"""Shortlisted drafters by name: `dynaspec:DRAFTER[:options]` and `frspec:DRAFTER:TOKENS[:context=0|1]`.

DRAFTER is `layers:N` or `int8`. The router (`dynaspec`) must have been trained on the hidden state
the drafter gives it: `layers:N`, or `final` for `int8`. Options:

- k=K clusters per draft token (default 16); schedule=fixed|position (seed 001's k_c(t));
  router=onnx|torch (ONNX Runtime by default); overlap=0|1 (default 1: the router runs in a
  second thread beside the drafter's forward);
- context=0|1 (default 1): the sequence's own tokens are in the shortlist too; 0 is the papers' head.
"""

from __future__ import annotations

from artifacts import Artifact
from runtime.drafters.dynaspec import (
    RoutedInt8Drafter, RoutedLayerDrafter, RouterStage, ShortlistInt8Drafter, ShortlistLayerDrafter,
)
from runtime.target import TorchTarget

SHORTLIST_HELP = "dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:context=0|1] or frspec:layers:N|int8:TOKENS[:context=0|1]"
ROUTING_OPTIONS = ("k", "schedule", "router", "overlap", "context")


def build_shortlist_drafter(spec: str, target: TorchTarget, artifact: Artifact):
    """The drafter named by `spec` (see the module docstring) and its ShortlistHead (the bench counts its rows)."""
    name, *args = spec.strip().split(":")
    if name not in ("dynaspec", "frspec"):
        raise ValueError(f"not a shortlisted drafter: {spec!r}; use {SHORTLIST_HELP}")
    kind, args = _drafter_kind(args)
    options, rest = _options(args, ROUTING_OPTIONS if name == "dynaspec" else ("context",))
    context = _switch(options, "context")
    stage = RouterStage.load(artifact)
    if name == "frspec":
        if len(rest) != 1 or not rest[0].isdigit():
            raise ValueError(f"frspec takes a shortlist size and context=0|1: frspec:{kind}:TOKENS, e.g. "
                             f"frspec:layers:16:26214; got {spec!r}")
        head = stage.frequent_head(target, int(rest[0]), context)
        drafter = ShortlistInt8Drafter(target, head) if kind == "int8" else ShortlistLayerDrafter(target, _depth(kind), head)
        return drafter, head
    if rest:
        raise ValueError(f"dynaspec options are k=K, schedule=fixed|position, router=onnx|torch, overlap=0|1 and "
                         f"context=0|1; got {':'.join(rest)!r} in {spec!r}")
    stage.check_hidden(kind)
    head = stage.cluster_head(target, context)
    routing = (stage.runner(options.get("router", "onnx")), int(options.get("k", 16)),
               options.get("schedule", "fixed"), _switch(options, "overlap"))
    if kind == "int8":
        return RoutedInt8Drafter(target, head, *routing), head
    return RoutedLayerDrafter(target, _depth(kind), head, *routing), head


def _drafter_kind(args: list[str]) -> tuple[str, list[str]]:
    """("layers:N" or "int8", the arguments after it)."""
    if args[:1] == ["int8"]:
        return "int8", args[1:]
    if len(args) >= 2 and args[0] == "layers" and args[1].isdigit():
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


def _switch(options: dict[str, str], key: str) -> bool:
    """A 0|1 option, 1 when absent."""
    value = options.get(key, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{key} takes 0 or 1, got {value!r}")
    return value == "1"


__all__ = ["SHORTLIST_HELP", "build_shortlist_drafter"]
