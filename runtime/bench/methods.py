"""Bench methods by name: each is a decoder over the session's target with some head (or drafter).

Adding a method = one entry in METHODS: a name prefix and a factory from (session, arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.decode import generate_ar
from runtime.heads.sampling import SamplingParams
from runtime.session import BOUNDS, Session
from runtime.stats import DecodeStats

Decoder = Callable[[torch.Tensor, int, SamplingParams, torch.Generator], tuple[list[int], DecodeStats]]


@dataclass
class Method:
    """A named way of decoding, runnable on token ids."""

    name: str
    decode: Decoder


def _ar(session: Session, args: list[str]) -> Decoder:
    if args:
        raise ValueError("method 'ar' takes no arguments")
    head = session.full_head()
    return lambda prompt, n, params, gen: generate_ar(session.target, head, prompt, n, params, gen)


def _csv(session: Session, args: list[str]) -> Decoder:
    bound = args[0] if args else "screen"
    if len(args) > 1 or bound not in BOUNDS:
        raise ValueError(f"method 'csv' takes one bound: csv:screen or csv:cluster, not csv:{':'.join(args)}")
    head = session.certified_head(bound)
    return lambda prompt, n, params, gen: generate_ar(session.target, head, prompt, n, params, gen)


METHODS: dict[str, Callable[[Session, list[str]], Decoder]] = {"ar": _ar, "csv": _csv}


def build_method(session: Session, spec: str) -> Method:
    """Parse 'name[:arg[:arg...]]' into a Method; unknown names list the known ones."""
    name, *args = spec.strip().split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {spec!r}; known: {', '.join(sorted(METHODS))} (e.g. ar,csv:screen,csv:cluster)")
    return Method(spec.strip(), METHODS[name](session, args))
