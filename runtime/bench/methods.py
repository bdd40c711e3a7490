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


def _shortlist_options(args: list[str], known: tuple[str, ...]) -> tuple[str, dict[str, str], list[str]]:
    """Split 'layers:N[:key=value...]' or 'int8[:key=value...]' (DynaSpec, FR-Spec) into the drafter
    ("layers:N" or "int8"), the known options and the rest."""
    if args[:1] == ["int8"]:
        drafter, tail = "int8", args[1:]
    elif len(args) >= 2 and args[0] == "layers" and args[1].isdigit():
        drafter, tail = f"layers:{args[1]}", args[2:]
    else:
        raise ValueError("dynaspec and frspec take a layers:N or int8 drafter, screenspec a layers:N one, e.g. "
                         "dynaspec:layers:16, dynaspec:int8, frspec:layers:16:26214 or screenspec:layers:16")
    options, rest = {}, []
    for part in tail:
        key, _, value = part.partition("=")
        if value and key in known:
            options[key] = value
        else:
            rest.append(part)
    return drafter, options, rest


def _switch(options: dict[str, str], key: str) -> bool:
    """A 0|1 option, 1 when absent."""
    value = options.get(key, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{key} takes 0 or 1, got {value!r}")
    return value == "1"


def _shortlisted(session: Session, drafter, head, gamma: int, adaptive: bool, certified: bool) -> Decoder:
    """Speculative decoding with a shortlist-head drafter; +csv verifies with the certified head."""
    from runtime.drafters.dynaspec import with_shortlist_stats

    target_head = session.certified_head("screen") if certified else session.full_head()
    return with_shortlist_stats(lambda prompt, n, params, gen, guard=0: generate_speculative(
        session.target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive,
        min_new_tokens=guard), head)


def _dynaspec(session: Session, args: list[str]) -> Decoder:
    """dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:router=onnx|torch][:overlap=0|1][:context=0|1][:gamma=G][:adaptive][+csv]:
    the layers:N or int8 drafter with a router-chosen shortlist head (K clusters, default 16), full
    verification (+csv: the certified head). The router must have been trained on the drafter's hidden
    state (layers:N, or final for int8). overlap=1 (the default: measured 5 % faster on 2 cores) runs
    the router in a second thread beside the drafter's forward; overlap=0 runs it in line. context=1
    (the default) also keeps the sequence's own tokens in the shortlist; context=0 is seed 001's head."""
    from runtime.drafters.dynaspec import RoutedInt8Drafter, RoutedLayerDrafter, RouterStage

    kind, options, rest = _shortlist_options(args, ("k", "schedule", "router", "overlap", "context"))
    drafter_args, gamma, adaptive, certified = _spec_options(rest)
    if drafter_args:
        raise ValueError("dynaspec options are k=K, schedule=fixed|position, router=onnx|torch, overlap=0|1, "
                         f"context=0|1, gamma=G, adaptive and the suffix +csv; got {':'.join(args)}")
    stage = RouterStage.load(session.artifact)
    stage.check_hidden(kind, "final" if kind == "int8" else kind)
    head = stage.cluster_head(session.target, _switch(options, "context"))
    routing = (stage.runner(options.get("router", "onnx")), int(options.get("k", 16)),
               options.get("schedule", "fixed"), _switch(options, "overlap"))
    if kind == "int8":
        drafter = RoutedInt8Drafter(session.target, head, *routing)
    else:
        drafter = RoutedLayerDrafter(session.target, int(kind.split(":")[1]), head, *routing)
    return _shortlisted(session, drafter, head, gamma, adaptive, certified)


def _frspec(session: Session, args: list[str]) -> Decoder:
    """frspec:layers:N|int8:TOKENS[:context=0|1][:gamma=G][:adaptive][+csv]: the layers:N or int8 drafter
    whose head scores only the TOKENS most frequent next tokens of the router's training traces
    (FR-Spec), full verification (+csv: the certified head); context=1 (the default) also keeps the
    sequence's own tokens, context=0 is FR-Spec's static list."""
    from runtime.drafters.dynaspec import RouterStage, ShortlistInt8Drafter, ShortlistLayerDrafter

    kind, options, rest = _shortlist_options(args, ("context",))
    size, *rest = rest or [""]
    if not size.isdigit():
        raise ValueError("frspec needs a shortlist size: frspec:layers:N:TOKENS, e.g. frspec:layers:6:26214")
    drafter_args, gamma, adaptive, certified = _spec_options(rest)
    if drafter_args:
        raise ValueError(f"frspec options are context=0|1, gamma=G, adaptive and the suffix +csv; got {':'.join(args)}")
    head = RouterStage.load(session.artifact).frequent_head(session.target, int(size), _switch(options, "context"))
    if kind == "int8":
        drafter = ShortlistInt8Drafter(session.target, head)
    else:
        drafter = ShortlistLayerDrafter(session.target, int(kind.split(":")[1]), head)
    return _shortlisted(session, drafter, head, gamma, adaptive, certified)


def _screenspec(session: Session, args: list[str]) -> Decoder:
    """screenspec:layers:N[:gamma=G][:adaptive]: the layers:N drafter whose head is the int8 screening
    copy (approximate logits, no certification: verification is full-vocabulary)."""
    kind, _, rest = _shortlist_options(args, ())
    drafter_args, gamma, adaptive, certified = _spec_options(rest)
    if kind == "int8" or certified or drafter_args:
        raise ValueError(f"screenspec takes a layers:N drafter (spec:int8 already drafts with the screening head), "
                         f"options gamma=G and adaptive; got {':'.join(args)}")
    layers = int(kind.split(":")[1])
    target = session.target
    head = ScreenDraftHead(session.screen_bound())
    drafter = LayerDrafter(target, layers, head)
    target_head = session.full_head()
    return lambda prompt, n, params, gen, guard=0: generate_speculative(
        target, target_head, drafter, prompt, n, params, gen, gamma=gamma, adaptive=adaptive, min_new_tokens=guard)


METHODS["dynaspec"] = _dynaspec
METHODS["frspec"] = _frspec
METHODS["screenspec"] = _screenspec
