"""Build a parsed MethodSpec into a runnable Method over a session, and the heads its builders share.

Each method's options build its own stream (`spec.options.build`); the target head and the drafter's
own head are chosen here only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.loops.decode import drive
from runtime.drafters import DraftContext, DrafterSpec
from runtime.heads import CertifiedHead
from runtime.heads.screen_draft import ScreenDraftHead
from runtime.methods.grammar import parse_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.common.sampling import SamplingParams
from runtime.session import Session
from runtime.common.stats import DecodeStats
from runtime.text.stopping import StopStrings


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
    spec = parse_method(spec) if isinstance(spec, str) else spec
    return Method(str(spec), spec.options.build(session, spec), spec)


def target_head(session: Session, spec: MethodSpec):
    """The head the target decides with: the full head, or the certified head over spec.bound."""
    if not spec.certified:
        return session.full_head()
    return session.certified_head(spec.bound, max_open_fraction=spec.cluster_budget, adaptive_budget=spec.adaptive_budget)


def drafter_head(session: Session, spec: MethodSpec, drafter: DrafterSpec, head, kind: str | None = None):
    """The drafter's own head (its rows must not count as the target's): `kind`, else the drafter's
    registered kind: "own", the target head's family sharing its bound; "screen", the int8 screening
    copy; "none", None (the drafter brings its own)."""
    kind = kind or drafter.entry.head
    if kind == "screen":
        return ScreenDraftHead(session.screen_bound())
    if kind == "own":
        return CertifiedHead(head.weight, head.bias, head.bound) if spec.certified else session.full_head()
    return None


def draft_context(session: Session, own_head) -> DraftContext:
    """What a drafter is built from over `session`, with the drafter's own head `own_head`."""
    return DraftContext(session.target, own_head, session.artifact, session.model.info, session.once)
