"""swarm: token trees (the OneDecode table's or a drafter's K candidates per slot, the lookup
drafter's K continuations, or EAGLE-2's trees over the draft head), one target forward each."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.drafters import DrafterSpec, parse_drafter
from runtime.drafters.eagle_trees import EagleTrees
from runtime.drafters.layers import BackendDrafter, SlotTrees
from runtime.drafters.lookup import LookupTrees
from runtime.drafters.onedecode import OneDecodeDrafter, OneDecodeTable, TableTrees
from runtime.loops.speculative import DEFAULT_GAMMA
from runtime.loops.tree_speculative import stream_tree
from runtime.methods.arguments import count, loop_words, own_options
from runtime.methods.build import draft_context, drafter_head, target_head
from runtime.methods.registry import MethodEntry, register_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.session import Session

TREE_SOURCES = ("onedecode", "lookup", "layers", "int8", "gp", "model", "eagle")  # a top-K per slot or node, or lookup's K continuations
SWARM_EXAMPLE = "swarm:onedecode:4, swarm:lookup:4:nodes=12, swarm:int8:4:nodes=32, swarm:eagle:2:nodes=6 or swarm:layers:6:2:gamma=5"
DEFAULT_NODES = 16


@dataclass(frozen=True)
class SwarmOptions:
    """swarm:onedecode:K | swarm:DRAFTER:K[:gamma=G][:nodes=N]: K candidates per slot, G deep, N nodes."""

    drafter: DrafterSpec | None  # None: the OneDecode table's own top-K (stage onedecode)
    k: int
    nodes: int = DEFAULT_NODES
    gamma: int | None = None  # the depth; None: DEFAULT_GAMMA

    @classmethod
    def parse(cls, args: list[str]) -> SwarmOptions:
        rest, loop, own = own_options("swarm", args, {"nodes": count(1, 64)}, SWARM_EXAMPLE)
        if len(rest) < 2 or count(1, 16)(rest[-1]) is None:
            raise ValueError(f"swarm needs a drafter and K candidates per slot or lookup continuations (1..16): {SWARM_EXAMPLE}")
        name = rest[0]
        if name not in TREE_SOURCES:
            raise ValueError(f"swarm's trees come from {', '.join(TREE_SOURCES)}, not {name!r}; e.g. {SWARM_EXAMPLE}")
        if name == "onedecode" and len(rest) > 2:
            raise ValueError(f"swarm:onedecode takes no table options (the tree ranks by confidence), not {':'.join(rest[1:-1])}")
        drafter = None if name == "onedecode" else parse_drafter(":".join(rest[:-1]))
        return cls(drafter, int(rest[-1]), own.get("nodes", DEFAULT_NODES), **loop)

    def format(self) -> tuple[str, ...]:
        source = ("onedecode",) if self.drafter is None else self.drafter.format()
        return (*source, str(self.k), *loop_words(self.gamma), f"nodes={self.nodes}")

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        check_tree_target(session)
        head = target_head(session, spec)
        trees = self._trees(session, spec, head)
        depth = tree_depth(self.gamma)

        def stream(prompt, n, params, generator, min_new_tokens=0, stop=None):
            return stream_tree(session.target, head, trees, prompt, n, params, generator, depth=depth, budget=self.nodes,
                               min_new_tokens=min_new_tokens, stop=stop)

        return stream

    def _trees(self, session: Session, spec: MethodSpec, head):
        """The tree drafter: the table's, lookup's continuations, or a model drafter's top-K per slot."""
        if self.drafter is None:
            if session.artifact is None:
                raise ValueError("swarm:onedecode needs the artifact whose stage onedecode holds the table; "
                                 "run: prep bake-onedecode ART --traces TR")
            return TableTrees(OneDecodeDrafter(OneDecodeTable.load(session.artifact)), self.k)
        if self.drafter.name == "lookup":
            return LookupTrees(self.drafter.build(draft_context(session, None)), self.k)  # lookup has no head
        if self.drafter.name == "eagle":
            options = self.drafter.options
            chain_only = [word for word, given in (("lookup", options.lookup), ("conf=P", options.confidence),
                                                   ("head=H", options.head_drafts)) if given]
            if chain_only:
                raise ValueError(f"swarm:eagle's trees rank nodes by the head's path score and take their depth from "
                                 f"gamma=G; drop {', '.join(chain_only)} (e.g. swarm:eagle:2:nodes=6)")
            return EagleTrees(self.drafter.build(draft_context(session, None)), self.k)  # the head is its own
        return SlotTrees(backend_drafter(session, spec, self.drafter, head), self.k)


def tree_depth(gamma: int | None) -> int:
    """How deep a tree or MJSD method drafts: its gamma=G, else DEFAULT_GAMMA (unlike a chain's, not cut
    to what the kernel path's verifier pays for)."""
    return DEFAULT_GAMMA if gamma is None else gamma


def check_tree_target(session: Session) -> None:
    """Token trees run on the decoder ladder (lean, native) only."""
    from runtime.backends.hf import (
        TREES_REFUSED,  # transformers' backend: loaded only to say why not
    )
    from runtime.backends.target import DecoderTarget

    if not isinstance(session.target, DecoderTarget):
        raise ValueError(TREES_REFUSED)


def backend_drafter(session: Session, spec: MethodSpec, drafter: DrafterSpec, head) -> BackendDrafter:
    """`drafter`, built as for spec:DRAFTER; a model-backed one (layers, int8, gp, model)."""
    built = drafter.build(draft_context(session, drafter_head(session, spec, drafter, head)))
    if not isinstance(built, BackendDrafter):
        raise ValueError(f"{spec.name} needs a drafter that runs a model (layers:N, int8, gp, model:), not {drafter}")
    return built


register_method(MethodEntry(
    "swarm", SwarmOptions,
    "swarm:onedecode:K|swarm:DRAFTER:K[:gamma=G][:nodes=N][+csv[:screen4|cluster]] (SWARM token trees: "
    "K candidates per slot or lookup continuations, G deep, N nodes, one target forward)", suffix=True))
