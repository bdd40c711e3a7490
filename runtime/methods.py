"""Decoding methods by name: one grammar, parsed once into a MethodSpec, built into a runnable Method.

Grammar (what `runtime generate --method`, `runtime bench --methods` and `runtime.api` accept):

    ar | ar:BACKEND                                  plain decoding (ar:transformers: on transformers' forward)
    llamacpp[:lookup[:K]|:bin]                       llama.cpp's plain (or prompt lookup) decoding of the same GGUF (a
                                                     reference); :bin: by llama.cpp's own llama-server binary
    csv | csv:screen | csv:screen4 | csv:cluster     the certified head (CSV-Decode and our screens)
    spec:DRAFTER[:gamma=G][:adaptive][:no-verifier][+csv[:screen|screen4|cluster]]
    dynaspec:... | frspec:...                        spec with that shortlisted drafter (same options)
    screenspec:layers:N[:gamma=G][:adaptive]         layers:N drafting with the int8 screening head
    swarm:onedecode:K | swarm:DRAFTER:K[:gamma=G][:nodes=N][+csv[:screen4|cluster]]
                                                     SWARM token trees: K candidates per slot (lookup: K
                                                     continuations), depth G, N nodes
    mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G]          MJSD beam drafts (NOT distribution-preserving)

DRAFTER is any registered drafter (runtime.drafters.DRAFTERS). Without gamma=G, spec drafts 4 tokens
per round (adapting within 1..8), or fewer where the verifier pays for fewer: 1 on the AVX2 kernels
(runtime.kernels.PAYING_DRAFTS), and only the positions whose recent drafts were accepted often
enough to pay for their verify rows (runtime.loops.speculative.DraftBudget); with gamma=G every round
drafts what the drafter finds, up to G. Trees and MJSD go 4 deep. Adding a method is one
`register_method` call (name, parser, builder, help line, whether it preserves the target's
distribution); the builders live in runtime.method_builders.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from runtime.common.checks import comma_items, is_digits
from runtime.drafters import DRAFTERS, drafters_help, parse_drafter
from runtime.method_spec import (HEADS, METHODS, NOT_PRESERVING, DrafterSpec, MethodEntry, MethodSpec, canonical, marked,
                                  preserves_distribution, register_method)
from runtime.loops.speculative import MAX_GAMMA

LOOP_OPTIONS = ("gamma", "adaptive", "no-verifier")  # spec options the loop takes (loop_options), each at most once
DEFAULT_METHOD_HELP = ("the fastest exact method the artifact and CPU allow: spec:lookup+csv:screen4, else "
                       "spec:lookup+csv, else spec:lookup")


def default_method(bound: str | None) -> MethodSpec:
    """The method run when none is named: the lookup drafter (the fastest drafter on every packaged
    model, docs/results/) verified through the certified head with `bound` (screen4 or screen), or
    through the full head when the artifact has no screening stage (bound None)."""
    return parse_method(f"spec:lookup+csv:{bound}" if bound else "spec:lookup")


def methods_help() -> str:
    """The registered methods and drafters, for --help texts."""
    lines = [marked(entry.help, entry.distribution_preserving) for entry in METHODS.values()]
    return "; ".join(lines) + ". DRAFTER: " + drafters_help() + "."


def parse_method(text: str) -> MethodSpec:
    """One method name in the grammar above -> MethodSpec; every mistake is a one-line ValueError naming the fix."""
    text = text.strip()
    base, plus, suffix = text.partition("+")
    head = None
    if plus:
        head = {"csv": "csv:screen", **{h: h for h in HEADS if h != "full"}}.get(suffix)
        if head is None:
            raise ValueError(f"unknown suffix +{suffix} in {text!r}; use +csv (screen bound), +csv:screen4 or +csv:cluster")
    name, *args = base.split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {text!r}; known: {', '.join(METHODS)} (e.g. ar,csv:screen,spec:ngram)")
    return replace(METHODS[name].parse(args, head), text=text)


def parse_methods(text: str) -> list[MethodSpec]:
    """--methods' comma-separated names (comma_items), each parsed, no method under two spellings (check_distinct)."""
    return check_distinct([parse_method(name) for name in comma_items(text, "--methods", "ar,csv:screen")])


def check_distinct(specs: list[MethodSpec]) -> list[MethodSpec]:
    """`specs`, or a ValueError naming a method listed twice (also under two spellings).

    A bench runs each method once per prompt, and two runs of one method would be reported as one.
    """
    first_text: dict[MethodSpec, str] = {}
    for spec in specs:
        key, text = replace(spec, text=""), spec.text or canonical(spec)  # the method, whatever its spelling
        if key in first_text:
            same = "is listed twice" if first_text[key] == text else f"names the same method as {first_text[key]!r}"
            raise ValueError(f"{text!r} {same}; list each method once")
        first_text[key] = text
    return specs


def loop_options(args: list[str]) -> tuple[list[str], dict]:
    """Split spec arguments into the drafter's and the loop's (gamma=G, adaptive, no-verifier)."""
    rest, loop, given = [], {}, set()
    for part in args:
        option = part.partition("=")[0]
        if option in LOOP_OPTIONS and option in given:
            raise ValueError(f"{option} is given twice; give each option once")
        given.add(option)
        if part == "adaptive":
            loop["adaptive"] = True
        elif part == "no-verifier":
            loop["verifier"] = False
        elif part.startswith("gamma="):
            value = part.removeprefix("gamma=")
            if not is_digits(value) or not 1 <= int(value) <= MAX_GAMMA:
                raise ValueError(f"gamma takes an integer in 1..{MAX_GAMMA}, not {value!r}; e.g. spec:ngram:gamma=6")
            loop["gamma"] = int(value)
        else:
            rest.append(part)
    return rest, loop


def _refuse_csv_suffix(name: str, head: str | None) -> None:
    """ValueError for a +csv suffix on a method that takes none."""
    if head is not None:
        raise ValueError(f"+csv applies to drafting methods (spec, dynaspec, frspec), not to {name}; use csv for "
                         "the certified head alone")


def _ar(args: list[str], head: str | None) -> MethodSpec:
    """ar, or ar:BACKEND: plain decoding on another backend of the same model (a same-run reference)."""
    from runtime.backends import BACKENDS

    _refuse_csv_suffix("ar", head)
    backends = [b for b in BACKENDS if b != "auto"]
    if len(args) > 1 or (args and args[0] not in backends):
        raise ValueError(f"method 'ar' takes no argument or a backend ({', '.join('ar:' + b for b in backends)}), "
                         f"not ar:{':'.join(args)}")
    return MethodSpec("ar", backend=args[0] if args else None)


def _csv(args: list[str], head: str | None) -> MethodSpec:
    _refuse_csv_suffix("csv", head)
    bound = args[0] if args else "screen"
    if len(args) > 1 or f"csv:{bound}" not in HEADS:
        raise ValueError(f"method 'csv' takes one bound: csv:screen, csv:screen4 or csv:cluster, not csv:{':'.join(args)}")
    return MethodSpec("csv", head=f"csv:{bound}")


def _spec(args: list[str], head: str | None, name: str = "spec") -> MethodSpec:
    rest, loop = loop_options(args)
    if not rest:
        raise ValueError(f"spec needs a drafter: spec:DRAFTER, DRAFTER one of {drafters_help()}")
    drafter = DrafterSpec(*parse_drafter(":".join(rest)))
    if not loop.get("verifier", True) and not DRAFTERS[drafter.name].alone:
        alone = ", ".join(n for n, e in DRAFTERS.items() if e.alone)
        raise ValueError(f"no-verifier (generate --no-verifier) decodes with the drafter's own backend alone; the {drafter.name} drafter has "
                         f"none (drafters that do: {alone}), e.g. spec:gp:256:no-verifier")
    if not loop.get("verifier", True) and head is not None:  # no target forward: no head to verify with
        raise ValueError(f"no-verifier decodes with the drafter alone, so a +csv head would verify nothing; drop the +csv "
                         f"suffix: {':'.join([name, *args])}")
    return MethodSpec(name, head=head or "full", drafter=drafter, **loop)


def _screenspec(args: list[str], head: str | None) -> MethodSpec:
    _refuse_csv_suffix("screenspec", head)
    rest, loop = loop_options(args)
    if len(rest) != 2 or rest[0] != "layers" or not is_digits(rest[1]) or not loop.get("verifier", True):
        raise ValueError("screenspec takes a layers:N drafter and gamma=G, adaptive, e.g. screenspec:layers:16 "
                         "(spec:int8 already drafts with the screening head)")
    return MethodSpec("screenspec", drafter=DrafterSpec("layers", (rest[1],)), draft_head="screen", **loop)


TREE_SOURCES = ("onedecode", "lookup", "layers", "int8", "gp", "model")  # a top-K per slot, or lookup's K continuations
BEAM_SOURCES = ("layers", "int8", "gp", "model")  # drafters whose backend takes token trees


def _own_options(name: str, args: list[str], allowed: dict[str, Callable[[str], object]], example: str) -> tuple[list[str], dict, dict]:
    """Split arguments into the drafter's, the loop's (gamma=G only) and the method's own KEY=VALUE options."""
    rest, loop = loop_options(args)
    if set(loop) - {"gamma"}:
        raise ValueError(f"{name} takes gamma=G (the draft depth), not adaptive or no-verifier; e.g. {example}")
    own, drafter = {}, []
    for part in rest:
        key, eq, value = part.partition("=")
        if eq and key in allowed:
            if key in own:
                raise ValueError(f"{name}'s {key} is given twice; give each option once, e.g. {example}")
            try:
                own[key] = allowed[key](value)
            except ValueError:
                own[key] = None
            if own[key] is None:
                raise ValueError(f"{name}'s {key} takes {allowed[key].__doc__}, not {value!r}; e.g. {example}")
        else:
            drafter.append(part)
    return drafter, loop, own


def _count(low: int, high: int) -> Callable[[str], int | None]:
    def parse(value: str) -> int | None:
        return int(value) if is_digits(value) and low <= int(value) <= high else None

    parse.__doc__ = f"an integer in {low}..{high}"
    return parse


def _tau(value: str) -> float | None:
    """a threshold in [0, 1)"""
    return float(value) if 0.0 <= float(value) < 1.0 else None


def _swarm(args: list[str], head: str | None) -> MethodSpec:
    """swarm:onedecode:K | swarm:DRAFTER:K [:gamma=G] [:nodes=N]: token trees of K candidates per slot."""
    example = "swarm:onedecode:4, swarm:lookup:4:nodes=12, swarm:int8:4:nodes=32 or swarm:layers:6:2:gamma=5"
    rest, loop, own = _own_options("swarm", args, {"nodes": _count(1, 64)}, example)
    if len(rest) < 2 or _count(1, 16)(rest[-1]) is None:
        raise ValueError(f"swarm needs a drafter and K candidates per slot or lookup continuations (1..16): {example}")
    name = rest[0]
    if name not in TREE_SOURCES:
        raise ValueError(f"swarm's trees come from {', '.join(TREE_SOURCES)}, not {name!r}; e.g. {example}")
    if name == "onedecode" and len(rest) > 2:
        raise ValueError(f"swarm:onedecode takes no table options (the tree ranks by confidence), not {':'.join(rest[1:-1])}")
    drafter = DrafterSpec("onedecode") if name == "onedecode" else DrafterSpec(*parse_drafter(":".join(rest[:-1])))
    return MethodSpec("swarm", head=head or "full", drafter=drafter, options=(rest[-1], f"nodes={own.get('nodes', 16)}"),
                      **loop)


def _mjsd(args: list[str], head: str | None) -> MethodSpec:
    """mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G]: MJSD, not distribution-preserving."""
    example = "mjsd:int8, mjsd:layers:6:beam=4:tau=0.1 or mjsd:int8:gamma=5"
    if head is not None:
        raise ValueError("+csv does not apply to mjsd: its joint ratio needs the target's full probabilities")
    rest, loop, own = _own_options("mjsd", args, {"beam": _count(1, 16), "tau": _tau}, example)
    if not rest or rest[0] not in BEAM_SOURCES:
        raise ValueError(f"mjsd needs a drafter whose backend takes token trees ({', '.join(BEAM_SOURCES)}); e.g. {example}")
    drafter = DrafterSpec(*parse_drafter(":".join(rest)))
    return MethodSpec("mjsd", drafter=drafter, options=(f"beam={own.get('beam', 4)}", f"tau={own.get('tau', 0.1):g}"),
                      **loop)


def _builder(name: str) -> Callable:
    """The builder `name` of runtime.method_builders, imported when a method is built (it imports the loops)."""

    def build(session, spec: MethodSpec):
        from runtime import method_builders

        return getattr(method_builders, name)(session, spec)

    return build


register_method(MethodEntry("ar", _ar, _builder("autoregressive"), "ar[:native|lean|transformers] (plain decoding; ar:BACKEND: on another backend, a same-run reference)"))
register_method(MethodEntry("csv", _csv, _builder("autoregressive"), "csv[:screen|screen4|cluster] (certified head)"))
register_method(MethodEntry("spec", _spec, _builder("speculative"),
                            "spec:DRAFTER[:gamma=G][:adaptive][:no-verifier][+csv[:screen4|cluster]] (speculative decoding)"))
for _name in ("dynaspec", "frspec"):
    register_method(MethodEntry(
        _name, lambda args, head, name=_name: _spec([name, *args], head, name="spec"), _builder("speculative"),
        f"{_name}:... (= spec:{_name}:...)"))
register_method(MethodEntry("screenspec", _screenspec, _builder("speculative"),
                            "screenspec:layers:N[:gamma=G][:adaptive] (layers:N with the int8 screening head)"))
register_method(MethodEntry("swarm", _swarm, _builder("tree"),
                            "swarm:onedecode:K|swarm:DRAFTER:K[:gamma=G][:nodes=N][+csv[:screen4|cluster]] (SWARM token trees: "
                            "K candidates per slot or lookup continuations, G deep, N nodes, one target forward)"))
register_method(MethodEntry("mjsd", _mjsd, _builder("mjsd"),
                            "mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G] (MJSD beam drafts, joint acceptance; changes the "
                            "output by design)", distribution_preserving=False))


LLAMACPP_LOOKUP_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default: what a user gets unasked


def _llamacpp(args: list[str], head: str | None) -> MethodSpec:
    """llamacpp | llamacpp:lookup[:K] | llamacpp:bin: llama.cpp's plain decoding through llama-cpp-python,
    its prompt lookup decoding with K draft tokens per round, or plain decoding by llama.cpp's own
    llama-server binary."""
    _refuse_csv_suffix("llamacpp", head)
    if not args:
        return MethodSpec("llamacpp")
    if args == ["bin"]:
        return MethodSpec("llamacpp", options=("bin",))
    tokens = _count(1, 32)(args[1]) if len(args) == 2 else LLAMACPP_LOOKUP_TOKENS
    if args[0] != "lookup" or len(args) > 2 or tokens is None:
        raise ValueError(f"method 'llamacpp' takes nothing, lookup[:K] (K draft tokens, 1..32) or bin, not "
                         f"llamacpp:{':'.join(args)}; e.g. llamacpp, llamacpp:lookup:4 or llamacpp:bin")
    return MethodSpec("llamacpp", options=("lookup", str(tokens)))


# llama.cpp quantizes activations: its text is the model's only up to rounding, so it makes no identity claim.
register_method(MethodEntry("llamacpp", _llamacpp, _builder("llamacpp"),
                            "llamacpp[:lookup[:K]|:bin] (llama.cpp's plain decoding of the same GGUF: the reference users "
                            f"compare with; lookup: llama-cpp-python's prompt lookup decoding, K draft tokens "
                            f"(default {LLAMACPP_LOOKUP_TOKENS}); both need the llamacpp extra; bin: llama.cpp's own "
                            "llama-server binary, from SPECVOCAB_LLAMACPP_BIN or PATH)", distribution_preserving=False))


__all__ = ["HEADS", "METHODS", "NOT_PRESERVING", "DrafterSpec", "MethodEntry", "MethodSpec", "canonical", "check_distinct", "loop_options",
           "marked", "methods_help", "parse_method", "parse_methods", "preserves_distribution", "register_method"]
