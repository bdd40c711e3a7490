"""Drafters for speculative decoding: one protocol (propose, observe), several ways to guess ahead."""

from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.gp import GP_HELP, GPDrafter, GPStage, parse_gp
from runtime.drafters.int8 import Int8Drafter
from runtime.drafters.layers import LayerDrafter
from runtime.drafters.model import ModelDrafter, load_model_drafter
from runtime.drafters.ngram import NgramDrafter

DRAFTERS_HELP = (
    f"ngram, ngram:MAX_NGRAM, layers:N, {GP_HELP}, model:NAME|PATH (a model with the target's tokenizer), "
    "int8 (the target with int8 weights), dynaspec:layers:N|int8[:k=K] (router-shortlisted head) or "
    "frspec:layers:N|int8:TOKENS (most-frequent-tokens head)"
)


def build_drafter(spec: str, target, head, artifact=None, target_info=None) -> Drafter:
    """A drafter from its command-line name (DRAFTERS_HELP); `head` is the drafter's own LM head
    (layers:N), not the target's, so the drafter's rows do not count as the target's; dynaspec and
    frspec drafters make their own shortlist head from the artifact's router stage.

    target_info: the target's ModelInfo, which model:NAME|PATH checks the drafter's tokenizer against.
    """
    match spec.strip().split(":"):
        case ["ngram"]:
            return NgramDrafter()
        case ["ngram", n] if n.isdigit():
            return NgramDrafter(max_ngram=int(n))
        case ["layers", n] if n.isdigit():
            return LayerDrafter(target, int(n), head)
        case ["gp", *args]:
            if artifact is None:
                raise ValueError("gp:RANK needs the artifact whose stage gp holds the bases")
            rank, kind = parse_gp(args)
            return GPDrafter(target, GPStage.load(artifact), rank, kind, head)
        case ["int8"]:
            return Int8Drafter(target, head)
        case ["dynaspec" | "frspec", *_]:
            if artifact is None:
                raise ValueError("dynaspec and frspec need the artifact whose stage router holds the router")
            from runtime.drafters.shortlisted import build_shortlist_drafter

            return build_shortlist_drafter(spec, target, artifact)[0]
        case ["model", *path]:
            if target_info is None:
                raise ValueError("model:NAME|PATH needs the target's ModelInfo to check the drafter's tokenizer")
            return load_model_drafter(":".join(path), target_info, target.vocab_size)
        case _:
            raise ValueError(f"unknown drafter {spec!r}; use {DRAFTERS_HELP}")


__all__ = [
    "DRAFTERS_HELP", "Drafter", "GPDrafter", "Int8Drafter", "LayerDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "build_drafter",
    "load_model_drafter",
]
