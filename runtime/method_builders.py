"""Build a parsed MethodSpec into a runnable Method over a session: heads, drafter and loop, chosen once.

The builders registered in runtime.methods: `autoregressive` (ar, csv), `speculative` (spec,
dynaspec, frspec, screenspec), `tree` (swarm) and `mjsd`. The target head and the drafter's own head are chosen here only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats
from runtime.drafters import DRAFTERS, DraftContext
from runtime.drafters.dynaspec import ShortlistDrafting
from runtime.heads import CertifiedHead, FullHead
from runtime.heads.screen_draft import ScreenDraftHead
from runtime.loops.decode import TokenStream, drive, stream_ar
from runtime.loops.speculative import DEFAULT_GAMMA, DraftBudget, stream_speculative
from runtime.methods import MethodSpec, parse_method
from runtime.session import Session
from runtime.text.stopping import StopStrings


class Streamer(Protocol):
    """(prompt [P], max new tokens, sampling, generator, min_new_tokens: the EOS guard, stop strings) ->
    a token stream (runtime.loops.decode): each new token as it is appended, then (tokens, stats)."""

    def __call__(
        self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, generator: torch.Generator | None,
        min_new_tokens: int = 0, stop: StopStrings | None = None,
    ) -> TokenStream: ...


@dataclass
class Method:
    """A named way of decoding, runnable on token ids."""

    name: str
    stream: Streamer
    spec: MethodSpec | None = None

    def decode(self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, generator: torch.Generator | None,
               min_new_tokens: int = 0, stop: StopStrings | None = None) -> tuple[list[int], DecodeStats]:
        """Decode to the end: the new tokens and the stats (the stream, run out)."""
        return drive(self.stream(prompt, max_new_tokens, params, generator, min_new_tokens, stop))


def build_method(session: Session, spec: MethodSpec | str) -> Method:
    """The Method a spec (or a name in the grammar of runtime.methods) names, over `session`."""
    from runtime.methods import METHODS

    spec = parse_method(spec) if isinstance(spec, str) else spec
    return Method(str(spec), METHODS[spec.name].build(session, spec), spec)


def target_head(session: Session, spec: MethodSpec):
    """The head the target decides with: the full head, or the certified head over spec.bound."""
    if not spec.certified:
        return session.full_head()
    return session.certified_head(spec.bound, max_open_fraction=spec.cluster_budget, adaptive_budget=spec.adaptive_budget)


def drafter_head(session: Session, spec: MethodSpec, head):
    """The drafter's own head (its rows must not count as the target's): the target head's family
    sharing its bound, or the int8 screening copy; None for drafters that bring their own."""
    kind = spec.draft_head or DRAFTERS[spec.drafter.name].head
    if kind == "screen":
        return ScreenDraftHead(session.screen_bound())
    if kind == "own":
        return CertifiedHead(head.weight, head.bias, head.bound) if spec.certified else session.full_head()
    return None


def autoregressive(session: Session, spec: MethodSpec) -> Streamer:
    """ar / csv: one target forward and one head call per token."""
    # ar:BACKEND: the same model on another backend (its fp32 weights are loaded if that backend needs them).
    target = session.target if spec.backend is None else session.target_on(spec.backend)
    head = target_head(session, spec) if spec.backend is None else FullHead(target.head_weight, target.head_bias)

    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        return stream_ar(target, head, prompt, n, params, generator, min_new_tokens, stop)

    return stream


def llamacpp(session: Session, spec: MethodSpec) -> Streamer:
    """llama.cpp's plain (llamacpp:lookup: prompt lookup) decoding of the session model's GGUF, with this
    process's thread count; llamacpp:bin: by llama.cpp's own llama-server binary."""
    from runtime.llamacpp.bindings import LlamaCppDecoder

    if spec.options == ("bin",):
        from runtime.llamacpp.server import LlamaServerDecoder

        return LlamaServerDecoder(session.model.gguf_path, session.target.eos_token_ids)
    lookup = int(spec.options[1]) if spec.options else None
    return LlamaCppDecoder(session.model.gguf_path, session.target.eos_token_ids, lookup_tokens=lookup)


def speculative(session: Session, spec: MethodSpec) -> Streamer:
    """spec and its aliases: the drafter proposes, the target verifies (or, without a verifier, the
    drafter's own backend decodes alone with the drafter's head)."""
    head = target_head(session, spec)
    own = drafter_head(session, spec, head)
    context = DraftContext(session.target, own, session.artifact, session.model.info)
    drafter = DRAFTERS[spec.drafter.name].build(context, spec.drafter.args)
    shortlist = drafter.head if isinstance(drafter, ShortlistDrafting) else None
    budget = DraftBudget()  # like the lookup drafter's session, it learns across this method's calls

    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        before = None if shortlist is None else replace(shortlist.stats)
        if spec.verifier:
            tokens, stats = yield from stream_speculative(
                session.target, head, drafter, prompt, n, params, generator, gamma=spec.gamma, adaptive=spec.adaptive,
                min_new_tokens=min_new_tokens, stop=stop, budget=budget)
        else:
            tokens, stats = yield from stream_ar(drafter.backend, own, prompt, n, params, generator, min_new_tokens, stop)
        if shortlist is not None:
            stats.shortlist = shortlist.stats.since(before)
        return tokens, stats

    return stream


def _tree_target(session: Session) -> None:
    """Token trees run on the decoder ladder (lean, native) only."""
    from runtime.backends.hf import TREES_REFUSED
    from runtime.backends.target import DecoderTarget

    if not isinstance(session.target, DecoderTarget):
        raise ValueError(TREES_REFUSED)


def _backend_drafter(session: Session, spec: MethodSpec, head):
    """The spec's drafter, built as for spec:DRAFTER; a model-backed one (layers, int8, gp, model)."""
    from runtime.drafters.layers import BackendDrafter

    context = DraftContext(session.target, drafter_head(session, spec, head), session.artifact, session.model.info)
    drafter = DRAFTERS[spec.drafter.name].build(context, spec.drafter.args)
    if not isinstance(drafter, BackendDrafter):
        raise ValueError(f"{spec.name} needs a drafter that runs a model (layers:N, int8, gp, model:), not {spec.drafter}")
    return drafter


def _depth(spec: MethodSpec) -> int:
    """How deep a tree or MJSD method drafts: its gamma=G, else DEFAULT_GAMMA (unlike a chain's, not cut
    to what the kernel path's verifier pays for)."""
    return DEFAULT_GAMMA if spec.gamma is None else spec.gamma


def tree(session: Session, spec: MethodSpec) -> Streamer:
    """swarm: token trees (the OneDecode table's or a drafter's K candidates per slot, or the lookup
    drafter's K continuations), one target forward each."""
    from runtime.drafters.layers import SlotTrees
    from runtime.drafters.lookup import LookupTrees
    from runtime.drafters.onedecode import OneDecodeDrafter, OneDecodeTable, TableTrees
    from runtime.loops.tree_speculative import stream_tree

    _tree_target(session)
    head = target_head(session, spec)
    k, budget = int(spec.options[0]), int(spec.options[1].removeprefix("nodes="))
    if spec.drafter.name == "onedecode":
        if session.artifact is None:
            raise ValueError("swarm:onedecode needs the artifact whose stage onedecode holds the table; "
                             "run: prep bake-onedecode ART --traces TR")
        drafter = TableTrees(OneDecodeDrafter(OneDecodeTable.load(session.artifact)), k)
    elif spec.drafter.name == "lookup":
        context = DraftContext(session.target, None, session.artifact, session.model.info)  # lookup has no head
        drafter = LookupTrees(DRAFTERS["lookup"].build(context, spec.drafter.args), k)
    else:
        drafter = SlotTrees(_backend_drafter(session, spec, head), k)

    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        return stream_tree(session.target, head, drafter, prompt, n, params, generator, depth=_depth(spec), budget=budget,
                           min_new_tokens=min_new_tokens, stop=stop)

    return stream


def mjsd(session: Session, spec: MethodSpec) -> Streamer:
    """mjsd: beam drafts verified by joint likelihood (NOT distribution-preserving; runtime.loops.mjsd)."""
    from runtime.drafters.beam import BeamDrafts
    from runtime.loops.mjsd import stream_mjsd

    _tree_target(session)
    head = target_head(session, spec)
    options = dict(option.split("=") for option in spec.options)
    drafts = BeamDrafts(_backend_drafter(session, spec, head), int(options["beam"]))

    def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
        return stream_mjsd(session.target, head, drafts, prompt, n, params, generator, gamma=_depth(spec),
                           tau=float(options["tau"]), min_new_tokens=min_new_tokens, stop=stop)

    return stream
