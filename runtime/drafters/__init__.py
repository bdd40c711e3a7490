"""Drafters for speculative decoding: one protocol (propose, observe), several ways to guess ahead.

DRAFTERS is the drafter registry (runtime.drafters.registry): a drafter is its module (the Drafter,
and a frozen options dataclass that parses the arguments after the name, formats them back and builds
the drafter) plus one `register_drafter` line below, with its name, help line and head kind.
`runtime.methods` reads the registry for `spec:DRAFTER...`.
"""

from __future__ import annotations


from runtime.drafters.base import Drafter, Proposal
from runtime.drafters.eagle import EagleDrafter, EagleOptions
from runtime.drafters.gp import GP_HELP, GPDrafter, GPOptions
from runtime.drafters.int8 import Int8Drafter, Int8Options
from runtime.drafters.layers import LayerDrafter, LayersOptions
from runtime.drafters.lookup import LookupDrafter, LookupOptions
from runtime.drafters.model import ModelDrafter, ModelOptions, load_model_drafter
from runtime.drafters.ngram import NgramDrafter, NgramOptions
from runtime.drafters.onedecode import ONEDECODE_HELP, OnedecodeOptions
from runtime.drafters.registry import (DRAFTERS, DraftContext, DrafterEntry, DrafterSpec, build_drafter, drafters_help,
                                       parse_drafter, register_drafter)
from runtime.drafters.shortlist_names import DynaspecOptions, FrspecOptions
from runtime.drafters.suffix import SUFFIX_HELP, SuffixDrafter, SuffixOptions

register_drafter(DrafterEntry("ngram", NgramOptions, "ngram[:MAX_NGRAM] (prompt lookup)", head="none"))
register_drafter(DrafterEntry(
    "lookup", LookupOptions,
    "lookup[:MAX_NGRAM] (prompt lookup plus the session's earlier sequences; an n-token match drafts at most n)",
    head="none"))
register_drafter(DrafterEntry("suffix", SuffixOptions, SUFFIX_HELP, head="none"))
register_drafter(DrafterEntry("layers", LayersOptions, "layers:N (the target's first N layers)"))
register_drafter(DrafterEntry("gp", GPOptions, GP_HELP, alone=True))
register_drafter(DrafterEntry("model", ModelOptions, "model:NAME|PATH (a model with the target's tokenizer)", head="none"))
register_drafter(DrafterEntry("int8", Int8Options, "int8 (the target with int8 weights and the int8 screening head)",
                              head="screen", alone=True))
register_drafter(DrafterEntry(
    "dynaspec", DynaspecOptions,
    "dynaspec:layers:N|int8[:k=K][:schedule=fixed|position][:context=0|1] (router-shortlisted head)", head="none"))
register_drafter(DrafterEntry("frspec", FrspecOptions, "frspec:layers:N|int8:TOKENS[:context=0|1] (most-frequent-tokens head)",
                              head="none"))
register_drafter(DrafterEntry("onedecode", OnedecodeOptions, ONEDECODE_HELP, head="none"))
register_drafter(DrafterEntry(
    "eagle", EagleOptions,
    "eagle[:from=ART][:frspec=N|dynaspec=K][:conf=P][:head=H][:lookup] (the trained EAGLE-3 head of stage drafter, on the "
    "target's own features; from=ART: the head of another artifact of the model; frspec=N: its N most chosen rows; "
    "dynaspec=K: the rows of the router's top K clusters (stage drafter_router); conf=P: end a chain where the head's "
    "confidence falls below P, 0.4 measured best; head=H: the head drafts at most H a round; lookup: prompt lookup "
    "first, its matches at full length)", head="none"))


__all__ = [
    "DRAFTERS", "DraftContext", "Drafter", "DrafterEntry", "DrafterSpec", "EagleDrafter", "GPDrafter", "Int8Drafter",
    "LayerDrafter", "LookupDrafter", "ModelDrafter", "NgramDrafter", "Proposal", "SuffixDrafter", "build_drafter",
    "drafters_help", "load_model_drafter", "parse_drafter", "register_drafter",
]
