"""dynaspec: and frspec: drafter names, parsed and built: `dynaspec:DRAFTER[:options]`, `frspec:DRAFTER:TOKENS`.

DRAFTER is `layers:N` or `int8`. The router (`dynaspec`) must have been trained on the hidden state
the drafter gives it: `layers:N`, or `final` for `int8`. Options:

- k=K clusters per draft token (default 16); schedule=fixed|position (DynaSpec's k_c(t));
  router=onnx|torch (the engine that runs the router; ONNX Runtime by default); overlap=0|1
  (default 1: the router runs in a second thread beside the drafter's forward);
- context=0|1 (default 1): the sequence's own tokens are in the shortlist too; 0 is the papers' head.

Parsing (`DynaspecOptions.parse`, `FrspecOptions.parse`) touches no model, so a bad name fails before
one loads. The drafters themselves are in runtime.drafters.dynaspec, their shortlist head in
runtime.heads.shortlist.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.common.checks import is_digits
from runtime.drafters.dynaspec import (
    RoutedInt8Drafter, RoutedLayerDrafter, RouterStage, ShortlistInt8Drafter, ShortlistLayerDrafter,
)
from runtime.drafters.router import ENGINES, SCHEDULES
from runtime.drafters.arguments import need_artifact
from runtime.drafters.registry import DraftContext

SHORTLIST_HELP = "dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:context=0|1] or frspec:layers:N|int8:TOKENS[:context=0|1]"
DEFAULTS = {"k": "16", "schedule": "fixed", "router": "onnx", "overlap": "1", "context": "1"}
CHOICES = {"schedule": tuple(SCHEDULES), "router": ENGINES, "overlap": ("0", "1"), "context": ("0", "1")}


@dataclass(frozen=True)
class DynaspecOptions:
    """dynaspec:layers:N|int8[:k=K][:schedule=S][:router=R][:overlap=0|1][:context=0|1] (module docstring)."""

    layers: int | None  # the layers:N drafter; None: int8
    k: int = 16
    schedule: str = "fixed"
    router: str = "onnx"
    overlap: bool = True
    context: bool = True

    @classmethod
    def parse(cls, args: list[str]) -> DynaspecOptions:
        layers, options, rest = _parse("dynaspec", args, tuple(DEFAULTS))
        if rest:
            raise ValueError(f"dynaspec options are k=K, schedule=fixed|position, router=onnx|torch, overlap=0|1 and "
                             f"context=0|1; got {':'.join(rest)!r}")
        options = {**DEFAULTS, **options}
        if not is_digits(options["k"]) or int(options["k"]) < 1:
            raise ValueError(f"dynaspec k takes an integer >= 1 (clusters per draft token), got {options['k']!r}; e.g. k=8")
        return cls(layers, int(options["k"]), options["schedule"], options["router"], options["overlap"] == "1",
                   options["context"] == "1")

    def format(self) -> tuple[str, ...]:
        return (*_kind_words(self.layers), f"k={self.k}", f"schedule={self.schedule}", f"router={self.router}",
                f"overlap={int(self.overlap)}", f"context={int(self.context)}")

    def build(self, context: DraftContext):
        """The routed drafter; its ShortlistHead is `drafter.head`."""
        target = context.target
        stage = RouterStage.load(need_artifact(context, "dynaspec"))
        stage.check_hidden("int8" if self.layers is None else f"layers:{self.layers}")
        head = stage.cluster_head(target, self.context)
        routing = (stage.runner(self.router), self.k, self.schedule, self.overlap)
        if self.layers is None:
            return RoutedInt8Drafter(target, head, *routing)
        return RoutedLayerDrafter(target, self.layers, head, *routing)


@dataclass(frozen=True)
class FrspecOptions:
    """frspec:layers:N|int8:TOKENS[:context=0|1]: the drafter, the shortlist size, the sequence's own tokens too."""

    layers: int | None  # the layers:N drafter; None: int8
    tokens: int
    context: bool = True

    @classmethod
    def parse(cls, args: list[str]) -> FrspecOptions:
        layers, options, rest = _parse("frspec", args, ("context",))
        if len(rest) != 1 or not is_digits(rest[0]) or int(rest[0]) < 1:
            raise ValueError(f"frspec takes a shortlist size and context=0|1: frspec:{':'.join(_kind_words(layers))}:TOKENS, "
                             f"e.g. frspec:layers:16:26214; got {':'.join(['frspec', *args])!r}")
        return cls(layers, int(rest[0]), options.get("context", DEFAULTS["context"]) == "1")

    def format(self) -> tuple[str, ...]:
        return (*_kind_words(self.layers), str(self.tokens), f"context={int(self.context)}")

    def build(self, context: DraftContext):
        """The shortlisted drafter; its ShortlistHead is `drafter.head`."""
        target = context.target
        head = RouterStage.load(need_artifact(context, "frspec")).frequent_head(target, self.tokens, self.context)
        if self.layers is None:
            return ShortlistInt8Drafter(target, head)
        return ShortlistLayerDrafter(target, self.layers, head)


def _parse(name: str, args: list[str], known: tuple[str, ...]) -> tuple[int | None, dict[str, str], list[str]]:
    """(the layers:N drafter's N or None for int8, the known key=value options checked, the other arguments)."""
    layers, after = _drafter_kind(args)
    options, rest = {}, []
    for part in after:
        key, _, value = part.partition("=")
        if value and key in known:
            options[key] = value
        else:
            rest.append(part)
    for key, value in options.items():
        if key in CHOICES and value not in CHOICES[key]:
            raise ValueError(f"{key} takes {' or '.join(CHOICES[key])}, got {value!r} in {name}:{':'.join(args)}")
    return layers, options, rest


def _drafter_kind(args: list[str]) -> tuple[int | None, list[str]]:
    """(N of a layers:N drafter, or None for int8; the arguments after it)."""
    if args[:1] == ["int8"]:
        return None, args[1:]
    if len(args) >= 2 and args[0] == "layers" and is_digits(args[1]):
        return int(args[1]), args[2:]
    raise ValueError(f"dynaspec and frspec take a layers:N or int8 drafter; use {SHORTLIST_HELP}")


def _kind_words(layers: int | None) -> tuple[str, ...]:
    return ("int8",) if layers is None else ("layers", str(layers))


__all__ = ["SHORTLIST_HELP", "DynaspecOptions", "FrspecOptions"]
