"""The words method options share: the loop's (gamma=G, adaptive, no-verifier) and a method's own KEY=VALUE."""

from __future__ import annotations

from typing import Callable

from runtime.common.checks import is_digits
from runtime.loops.speculative import MAX_GAMMA

LOOP_OPTIONS = ("gamma", "adaptive", "no-verifier")  # each at most once


def loop_options(args: list[str]) -> tuple[list[str], dict]:
    """Split arguments into the drafter's and the loop's ({gamma: G, adaptive: True, verifier: False})."""
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


def loop_words(gamma: int | None, adaptive: bool = False, verifier: bool = True) -> tuple[str, ...]:
    """The loop's options as canonical words: gamma=G, adaptive, no-verifier (those given)."""
    return (f"gamma={gamma}",) * (gamma is not None) + ("adaptive",) * adaptive + ("no-verifier",) * (not verifier)


def own_options(name: str, args: list[str], allowed: dict[str, Callable[[str], object]],
                example: str) -> tuple[list[str], dict, dict]:
    """Split arguments into the drafter's, the loop's (gamma=G only) and the method's own KEY=VALUE options."""
    rest, loop = loop_options(args)
    if set(loop) - {"gamma"}:
        raise ValueError(f"{name} takes gamma=G (the draft depth), not adaptive or no-verifier; e.g. {example}")
    drafter, own = key_values(name, rest, allowed, example)
    return drafter, loop, own


def key_values(name: str, args: list[str], allowed: dict[str, Callable[[str], object]],
               example: str) -> tuple[list[str], dict]:
    """Split arguments into the rest and a method's own KEY=VALUE options, each parsed by allowed[KEY] (whose
    docstring names what it takes; None: refused) and given at most once."""
    own, rest = {}, []
    for part in args:
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
            rest.append(part)
    return rest, own


def count(low: int, high: int) -> Callable[[str], int | None]:
    """A parser of an integer in low..high (None outside it)."""
    def parse(value: str) -> int | None:
        return int(value) if is_digits(value) and low <= int(value) <= high else None

    parse.__doc__ = f"an integer in {low}..{high}"
    return parse
