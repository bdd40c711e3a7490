"""Bench methods by name: each is a decoder over the session's target with some head (or drafter).

Adding a method = one entry in METHODS: a name prefix and a factory from (session, arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.decode import generate_ar
from runtime.drafters import LayerDrafter, NgramDrafter, load_model_drafter
from runtime.drafters.gp import GPDrafter, GPStage, parse_gp
from runtime.drafters.int8 import Int8Drafter
from runtime.heads import CertifiedHead
from runtime.heads.screen_draft import ScreenDraftHead
from runtime.heads.sampling import SamplingParams
from runtime.session import BOUNDS, Session
from runtime.speculative import generate_speculative
from runtime.stats import DecodeStats
from runtime.target import TorchTarget

# (prompt [P], max new tokens, sampling, generator, min_new_tokens: the EOS guard) -> tokens, stats
Decoder = Callable[[torch.Tensor, int, SamplingParams, torch.Generator, int], tuple[list[int], DecodeStats]]


@dataclass
class Method:
    """A named way of decoding, runnable on token ids."""

    name: str
    decode: Decoder


def _ar(session: Session, args: list[str]) -> Decoder:
    """ar: plain decoding on the session's backend; ar:transformers: on transformers' forward (a reference)."""
    if args not in ([], ["transformers"]):
        raise ValueError(f"method 'ar' takes no argument or 'transformers', not ar:{':'.join(args)}")
    target = TorchTarget(session.target.model, session.target.eos_token_ids) if args else session.target
    head = session.full_head()
    return lambda prompt, n, params, gen, guard=0: generate_ar(target, head, prompt, n, params, gen, min_new_tokens=guard)


def _csv(session: Session, args: list[str]) -> Decoder:
    bound = args[0] if args else "screen"
    if len(args) > 1 or bound not in BOUNDS:
        raise ValueError(f"method 'csv' takes one bound: csv:screen or csv:cluster, not csv:{':'.join(args)}")
    head = session.certified_head(bound)
    return lambda prompt, n, params, gen, guard=0: generate_ar(session.target, head, prompt, n, params, gen,
                                                               min_new_tokens=guard)


METHODS: dict[str, Callable[[Session, list[str]], Decoder]] = {"ar": _ar, "csv": _csv}


def _spec_options(args: list[str]) -> tuple[list[str], int, bool, bool]:
    """Split spec arguments into (drafter arguments, gamma, adaptive, certified target head)."""
    text = ":".join(args)
    certified = text.endswith("+csv")
    parts = [part for part in text.removesuffix("+csv").split(":") if part]
    gamma, adaptive, drafter_args = 4, False, []
    for part in parts:
        if part == "adaptive":
            adaptive = True
        elif part.startswith("gamma="):
            gamma = int(part.removeprefix("gamma="))
        elif "=" in part:
            raise ValueError(f"unknown spec option {part!r}; known: gamma=G, adaptive")
        else:
            drafter_args.append(part)
    return drafter_args, gamma, adaptive, certified


def _spec(session: Session, args: list[str]) -> Decoder:
    """spec:DRAFTER[:gamma=G][:adaptive][+csv]: DRAFTER is ngram[:MAX_NGRAM], layers:N, gp:RANK[:act],
    model:NAME|PATH (a packaged name, HF directory or .gguf with the target's tokenizer) or int8 (the
    target with int8 weights and the int8 screening head); +csv verifies with the certified (screen) head."""
    drafter_args, gamma, adaptive, certified = _spec_options(args)
    head = session.certified_head("screen") if certified else session.full_head()
    match drafter_args:
        case ["ngram"]:
            drafter = NgramDrafter()
        case ["ngram", n]:
            drafter = NgramDrafter(max_ngram=int(n))
        case ["layers", n]:
            # A head of its own (sharing the bound), so the drafter's rows do not count as the target's.
            own = CertifiedHead(head.weight, head.bias, head.bound) if certified else session.full_head()
            drafter = LayerDrafter(session.target, int(n), own)
        case ["gp", *gp_args]:
            rank, kind = parse_gp(gp_args)
            own = CertifiedHead(head.weight, head.bias, head.bound) if certified else session.full_head()
            drafter = GPDrafter(session.target, GPStage.load(session.artifact), rank, kind, own)
        case ["model", *path]:
            drafter = load_model_drafter(":".join(path), session.model.info, session.target.vocab_size)
        case ["int8"]:
            drafter = Int8Drafter(session.target, ScreenDraftHead(head.bound if certified else session.screen_bound()))
        case _:
            raise ValueError(f"unknown drafter {':'.join(drafter_args)!r}; use spec:ngram, spec:ngram:N, spec:layers:N, "
                             "spec:gp:RANK[:act], spec:model:NAME|PATH or spec:int8 (options :gamma=G, :adaptive; suffix +csv for the certified "
                             "target head)")
    return lambda prompt, n, params, gen, guard=0: generate_speculative(
        session.target, head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive, min_new_tokens=guard
    )


METHODS["spec"] = _spec


def build_method(session: Session, spec: str) -> Method:
    """Parse 'name[:arg[:arg...]]' into a Method; unknown names list the known ones."""
    name, *args = spec.strip().split(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {spec!r}; known: {', '.join(sorted(METHODS))} (e.g. ar,csv:screen,csv:cluster)")
    return Method(spec.strip(), METHODS[name](session, args))


def _shortlisted(session: Session, name: str, args: list[str]) -> Decoder:
    """dynaspec / frspec (runtime.drafters.shortlisted) plus gamma=G, adaptive and +csv (the certified
    target head): speculative decoding with a shortlist-head drafter, full-vocabulary verification."""
    from runtime.drafters.dynaspec import with_shortlist_stats
    from runtime.drafters.shortlisted import build_shortlist_drafter

    text = ":".join(args)
    parts = [part for part in text.removesuffix("+csv").split(":") if part]
    loop = [part for part in parts if part == "adaptive" or part.startswith("gamma=")]
    _, gamma, adaptive, _ = _spec_options(loop)
    drafter, head = build_shortlist_drafter(":".join([name] + [p for p in parts if p not in loop]),
                                            session.target, session.artifact)
    target_head = session.certified_head("screen") if text.endswith("+csv") else session.full_head()
    return with_shortlist_stats(lambda prompt, n, params, gen, guard=0: generate_speculative(
        session.target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive,
        min_new_tokens=guard), head)


def _screenspec(session: Session, args: list[str]) -> Decoder:
    """screenspec:layers:N[:gamma=G][:adaptive]: the layers:N drafter whose head is the int8 screening
    copy (approximate logits, no certification: verification is full-vocabulary)."""
    if len(args) < 2 or args[0] != "layers" or not args[1].isdigit():
        raise ValueError("screenspec takes a layers:N drafter, e.g. screenspec:layers:16 (spec:int8 already "
                         "drafts with the screening head)")
    layers = int(args[1])
    drafter_args, gamma, adaptive, certified = _spec_options(args[2:])
    if certified or drafter_args:
        raise ValueError(f"screenspec options are gamma=G and adaptive; got {':'.join(args)}")
    target = session.target
    head = ScreenDraftHead(session.screen_bound())
    drafter = LayerDrafter(target, layers, head)
    target_head = session.full_head()
    return lambda prompt, n, params, gen, guard=0: generate_speculative(
        target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive, min_new_tokens=guard)


METHODS["dynaspec"] = lambda session, args: _shortlisted(session, "dynaspec", args)
METHODS["frspec"] = lambda session, args: _shortlisted(session, "frspec", args)
METHODS["screenspec"] = _screenspec
