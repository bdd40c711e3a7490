"""mjsd: beam drafts verified by joint likelihood (NOT distribution-preserving; runtime.loops.mjsd)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.drafters import DrafterSpec, parse_drafter
from runtime.drafters.arguments import number_text
from runtime.drafters.beam import BeamDrafts
from runtime.loops.mjsd import stream_mjsd
from runtime.methods.arguments import count, loop_words, own_options
from runtime.methods.build import target_head
from runtime.methods.registry import MethodEntry, register_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.methods.tree import backend_drafter, check_tree_target, tree_depth
from runtime.session import Session

BEAM_SOURCES = ("layers", "int8", "gp", "model")  # drafters whose backend takes token trees
MJSD_EXAMPLE = "mjsd:int8, mjsd:layers:6:beam=4:tau=0.1 or mjsd:int8:gamma=5"


def _tau(value: str) -> float | None:
    """a threshold in [0, 1)"""
    return float(value) if 0.0 <= float(value) < 1.0 else None


@dataclass(frozen=True)
class MjsdOptions:
    """mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G]: M beams, joint-ratio threshold T, G deep."""

    drafter: DrafterSpec
    beam: int = 4
    tau: float = 0.1
    gamma: int | None = None  # the depth; None: DEFAULT_GAMMA

    @classmethod
    def parse(cls, args: list[str]) -> MjsdOptions:
        rest, loop, own = own_options("mjsd", args, {"beam": count(1, 16), "tau": _tau}, MJSD_EXAMPLE)
        if not rest or rest[0] not in BEAM_SOURCES:
            raise ValueError(f"mjsd needs a drafter whose backend takes token trees ({', '.join(BEAM_SOURCES)}); "
                             f"e.g. {MJSD_EXAMPLE}")
        return cls(parse_drafter(":".join(rest)), **own, **loop)

    def format(self) -> tuple[str, ...]:
        return (*self.drafter.format(), *loop_words(self.gamma), f"beam={self.beam}", f"tau={number_text(self.tau)}")

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        check_tree_target(session)
        head = target_head(session, spec)
        drafts = BeamDrafts(backend_drafter(session, spec, self.drafter, head), self.beam)
        depth = tree_depth(self.gamma)

        def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
            return stream_mjsd(session.target, head, drafts, prompt, n, params, generator, gamma=depth, tau=self.tau,
                               min_new_tokens=min_new_tokens, stop=stop)

        return stream


register_method(MethodEntry(
    "mjsd", MjsdOptions,
    "mjsd:DRAFTER[:beam=M][:tau=T][:gamma=G] (MJSD beam drafts, joint acceptance; changes the output by design)",
    distribution_preserving=False))
