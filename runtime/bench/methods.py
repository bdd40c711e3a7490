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


def _shortlist_options(args: list[str], known: tuple[str, ...]) -> tuple[int, dict[str, str], list[str]]:
    """Split 'layers:N[:key=value...]' (DynaSpec, FR-Spec) into N, the known options and the rest."""
    if len(args) < 2 or args[0] != "layers" or not args[1].isdigit():
        raise ValueError("dynaspec, frspec and screenspec take a layers:N drafter, e.g. dynaspec:layers:16, "
                         "frspec:layers:16:26214 or screenspec:layers:16")
    options, rest = {}, []
    for part in args[2:]:
        key, _, value = part.partition("=")
        if value and key in known:
            options[key] = value
        else:
            rest.append(part)
    return int(args[1]), options, rest


def _dynaspec(session: Session, args: list[str]) -> Decoder:
    """dynaspec:layers:N[:k=K][:schedule=fixed|position][:router=onnx|torch][:overlap=0|1][:gamma=G][:adaptive]:
    the layers:N drafter with a router-chosen shortlist head (K clusters, default 16), full verification;
    overlap=1 (the default: measured 5 % faster on 2 cores) runs the router in a second thread beside the
    drafter's forward; overlap=0 runs it in line."""
    from runtime.drafters.dynaspec import RoutedLayerDrafter, RouterStage, with_shortlist_stats

    layers, options, rest = _shortlist_options(args, ("k", "schedule", "router", "overlap"))
    drafter_args, gamma, adaptive, certified = _spec_options(rest)
    if certified or drafter_args or options.get("overlap", "1") not in ("0", "1"):
        raise ValueError("dynaspec options are k=K, schedule=fixed|position, router=onnx|torch, overlap=0|1, gamma=G, "
                         f"adaptive; got {':'.join(args)}")
    stage = RouterStage.load(session.artifact)
    stage.check_hidden(layers)
    head = stage.cluster_head(session.target)
    drafter = RoutedLayerDrafter(session.target, layers, head, stage.runner(options.get("router", "onnx")),
                                 int(options.get("k", 16)), options.get("schedule", "fixed"), options.get("overlap", "1") == "1")
    target_head = session.full_head()
    return with_shortlist_stats(lambda prompt, n, params, gen, guard=0: generate_speculative(
        session.target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive,
        min_new_tokens=guard), head)


def _frspec(session: Session, args: list[str]) -> Decoder:
    """frspec:layers:N:TOKENS[:gamma=G][:adaptive]: the layers:N drafter whose head scores only the
    TOKENS most frequent next tokens of the router's training traces (FR-Spec), full verification."""
    from runtime.drafters.dynaspec import RouterStage, with_shortlist_stats

    layers, _, rest = _shortlist_options(args, ())
    if not rest or not rest[0].isdigit():
        raise ValueError("frspec needs a shortlist size: frspec:layers:N:TOKENS, e.g. frspec:layers:6:26214")
    drafter_args, gamma, adaptive, certified = _spec_options(rest[1:])
    if certified or drafter_args:
        raise ValueError(f"frspec options are gamma=G and adaptive; got {':'.join(args)}")
    head = RouterStage.load(session.artifact).frequent_head(session.target, int(rest[0]))
    drafter = LayerDrafter(session.target, layers, head)
    target_head = session.full_head()
    return with_shortlist_stats(lambda prompt, n, params, gen, guard=0: generate_speculative(
        session.target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive,
        min_new_tokens=guard), head)


def _screenspec(session: Session, args: list[str]) -> Decoder:
    """screenspec:layers:N[:gamma=G][:adaptive]: the layers:N drafter whose head is the int8 screening
    copy (approximate logits, no certification: verification is full-vocabulary)."""
    layers, _, rest = _shortlist_options(args, ())
    drafter_args, gamma, adaptive, certified = _spec_options(rest)
    if certified or drafter_args:
        raise ValueError(f"screenspec options are gamma=G and adaptive; got {':'.join(args)}")
    target = session.target
    head = ScreenDraftHead(session.screen_bound())
    drafter = LayerDrafter(target, layers, head)
    target_head = session.full_head()
    return lambda prompt, n, params, gen, guard=0: generate_speculative(
        target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive, min_new_tokens=guard)


METHODS["dynaspec"] = _dynaspec
METHODS["frspec"] = _frspec
METHODS["screenspec"] = _screenspec
