"""OTT-OD (the GP paper's OneDecode drafter): drafts are table lookups keyed by the last one or two
tokens, O(1) per drafted token, no model forward.

The table (stage `onedecode`, baked by `prep bake-onedecode` from the target's own top-8
predictions) maps a key to up to K next tokens, best first, each with a confidence: the mean target
probability of that token over the key's occurrences in the traces. Drafts are deterministic, so
they verify as point masses (Proposal.probs None): verification, and with it exactness, is the
loop's as for any drafter. The confidence only decides how far to draft; it is never used as q.
TableTrees gives the table's top-K at every node as a token tree (swarm:onedecode:K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artifacts import Artifact
from artifacts.format import Stage
from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.drafters.base import Drafter, Proposal, Verdict, empty_proposal
from runtime.drafters.trees import TokenTree, build_tree
from runtime.drafters.arguments import number_text, unit_number
from runtime.drafters.registry import DraftContext

# Tensor names of stage `onedecode`; LEVELS[0] is keyed by the last token, LEVELS[1] by the last two.
# <level>.keys [n] (single) or [n, 2] (pair) int64, sorted; <level>.tokens [n, K] int64, best
# first, -1 padding; <level>.confidence [n, K] float32 (0 padding); <level>.hits [n, K] int32 (how
# often the candidate was the target's top-1 there); <level>.count [n] int32 (occurrences of the key).
SINGLE, PAIR = "single", "pair"
LEVELS = (SINGLE, PAIR)
FIELDS = ("keys", "tokens", "confidence", "hits", "count")
DEFAULT_THRESHOLD = 0.25  # a starting point, not a measured optimum: `runtime bench` decides


def tensor_name(level: str, field: str) -> str:
    """Name of one tensor of stage `onedecode`, e.g. pair.tokens."""
    return f"{level}.{field}"


Candidates = tuple[list[int], list[float]]  # tokens best first, their confidences


@dataclass(frozen=True)
class OneDecodeTable:
    """The baked table as dictionaries: O(1) lookups by the last token or the last two."""

    single: dict[int, Candidates]
    pair: dict[tuple[int, int], Candidates]
    top_k: int

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "OneDecodeTable":
        """The table from stage `onedecode`'s tensors (see FIELDS)."""
        missing = [tensor_name(l, f) for l in LEVELS for f in FIELDS if tensor_name(l, f) not in tensors]
        if missing:
            raise ValueError(f"stage onedecode lacks {', '.join(missing)}; rebake it: prep bake-onedecode ART --traces TR --force")
        levels = {}
        for level in LEVELS:
            keys = tensors[tensor_name(level, "keys")].tolist()
            tokens = tensors[tensor_name(level, "tokens")].tolist()
            conf = tensors[tensor_name(level, "confidence")].tolist()
            levels[level] = {
                (tuple(key) if level == PAIR else key): _trim(row, c) for key, row, c in zip(keys, tokens, conf)
            }
        return cls(levels[SINGLE], levels[PAIR], int(tensors[tensor_name(SINGLE, "tokens")].shape[1]))

    @classmethod
    def load(cls, artifact: Artifact) -> "OneDecodeTable":
        """Stage `onedecode` of an artifact (MissingStage names the prep command)."""
        return cls.from_tensors(artifact.read_stage(Stage.ONEDECODE))

    def lookup(self, context: list[int]) -> Candidates | None:
        """Candidates after `context`: the two-token key's if baked, else the last token's, else None."""
        if not context:
            return None
        if len(context) >= 2:
            found = self.pair.get((context[-2], context[-1]))
            if found is not None:
                return found
        return self.single.get(context[-1])


def _trim(tokens: list[int], conf: list[float]) -> Candidates:
    """A table row without its padding (token -1)."""
    n = next((i for i, t in enumerate(tokens) if t < 0), len(tokens))
    return tokens[:n], conf[:n]


class OneDecodeDrafter:
    """Chain lookups (two-token key first, then one-token) while the best candidate's confidence is at
    least `threshold`, up to k tokens. A miss stops the chain; FirstProposal adds fallbacks."""

    def __init__(self, table: OneDecodeTable, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"the onedecode threshold is a probability in [0, 1], got {threshold}")
        self.table, self.threshold = table, threshold

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Nothing to prepare: the table is fixed and the loop cuts banned point-mass drafts."""

    def propose(self, context: list[int], k: int) -> Proposal:
        """Up to k table tokens, each the best candidate after the context plus the drafts before it."""
        # Only the last two tokens matter, so the chain extends a two-token window, not the context.
        window = list(context[-2:])
        drafts: list[int] = []
        while len(drafts) < k:
            found = self.table.lookup(window)
            if found is None or not found[0] or found[1][0] < self.threshold:
                break
            drafts.append(found[0][0])
            window = [window[-1], drafts[-1]] if window else [drafts[-1]]
        return Proposal(torch.tensor(drafts, dtype=torch.long)) if drafts else empty_proposal()

    def observe(self, verdict: Verdict) -> None:
        """Nothing to learn: the table is fixed."""

    def top_k(self, context: list[int], k: int) -> Candidates:
        """Up to k candidates for the next slot (best first, with confidences), for token trees."""
        found = self.table.lookup(context)
        if found is None:
            return [], []
        return found[0][:k], found[1][:k]

    def tree(self, context: list[int], k: int, depth: int, budget: int) -> TokenTree:
        """SWARM's token tree after `context`: the table's top-k at every node, the `budget` most
        confident nodes (runtime.drafters.trees.build_tree), at most `depth` deep. Confidences only rank
        candidates; verification treats them as deterministic (runtime.loops.verify_tree)."""
        window = list(context[-2:])
        return build_tree(lambda path: self.top_k((window + path)[-2:], k), k, depth, budget)


class TableTrees:
    """SWARM over the OneDecode table: its top-K at every node (OTT-SWARM)."""

    def __init__(self, table: OneDecodeDrafter, k: int) -> None:
        held = table.table.top_k
        if k > held:  # the table would silently give fewer
            raise ValueError(f"swarm:onedecode:{k} asks for {k} candidates per slot, but this artifact's table holds "
                             f"{held} per key (prep bake-onedecode --top-k): use swarm:onedecode:{held}")
        self.table, self.k = table, k

    def reset(self, prompt, params, generator, ban=NO_BAN) -> None:
        """Nothing to prepare: the table is fixed."""

    def tree(self, context: list[int], depth: int, budget: int) -> TokenTree:
        return self.table.tree(context, self.k, depth, budget)

    def observe(self, verdict: Verdict) -> None:
        """Nothing to learn."""


class FirstProposal:
    """Drafters asked in order; the first non-empty proposal is the round's, and only the drafter
    that made it observes the verdict (model drafters resync their caches from the context).

    With an NgramDrafter first and the table second this is llama.cpp's lookup decoding order
    (context cache, then the static cache); with the table first the n-gram drafter is a fallback.
    """

    def __init__(self, drafters: list[Drafter]) -> None:
        if not drafters:
            raise ValueError("FirstProposal needs at least one drafter")
        self.drafters = drafters
        self.last: Drafter | None = None
        self.sources = [0] * len(drafters)  # proposals made by each drafter

    def reset(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None, ban: TokenBan = NO_BAN
    ) -> None:
        """Reset every drafter."""
        self.last = None
        for drafter in self.drafters:
            drafter.reset(prompt, params, generator, ban)

    def propose(self, context: list[int], k: int) -> Proposal:
        """The first drafter's proposal that has tokens, or an empty one."""
        self.last = None
        for i, drafter in enumerate(self.drafters):
            proposal = drafter.propose(context, k)
            if proposal.tokens.numel():
                self.last = drafter
                self.sources[i] += 1
                return proposal
        return empty_proposal()

    def observe(self, verdict: Verdict) -> None:
        """Pass the verdict to the drafter whose proposal it judged."""
        if self.last is not None:
            self.last.observe(verdict)


# --- by name: onedecode[:threshold=T][:fallback=ngram|int8|none][:context=first] -------------------

ONEDECODE_HELP = ("onedecode[:threshold=T][:fallback=ngram|int8|none][:context=first] (OneDecode table lookups, "
                  "stage onedecode; context=first: the context's n-grams before the table)")
FALLBACKS = ("none", "ngram", "int8")


@dataclass(frozen=True)
class OnedecodeOptions:
    """onedecode[:threshold=T][:fallback=ngram|int8|none][:context=first]: the table's confidence
    threshold, the drafter asked after a miss, and whether the context's n-grams go first."""

    threshold: float = DEFAULT_THRESHOLD
    fallback: str = "none"
    context_first: bool = False

    @classmethod
    def parse(cls, args: list[str]) -> OnedecodeOptions:
        options = {"threshold": str(DEFAULT_THRESHOLD), "fallback": "none"}
        for arg in args:
            key, eq, value = arg.partition("=")
            if not eq or key not in ("threshold", "fallback", "context"):
                raise ValueError(f"unknown onedecode option {arg!r}; use {ONEDECODE_HELP}")
            options[key] = value
        threshold = unit_number(options["threshold"])
        if threshold is None:
            raise ValueError(f"onedecode's threshold is a confidence in [0, 1], not {options['threshold']!r}; e.g. threshold=0.3")
        if options["fallback"] not in FALLBACKS:
            raise ValueError(f"onedecode's fallback is one of {', '.join(FALLBACKS)}, not {options['fallback']!r}")
        if options.get("context", "first") != "first":
            raise ValueError(f"onedecode's context option takes only 'first', not {options['context']!r}")
        if "context" in options and options["fallback"] == "ngram":
            raise ValueError("context=first already asks the n-gram drafter (before the table); drop fallback=ngram")
        return cls(threshold, options["fallback"], "context" in options)

    def format(self) -> tuple[str, ...]:
        words = (f"threshold={number_text(self.threshold)}", f"fallback={self.fallback}")
        return words + (("context=first",) if self.context_first else ())

    def build(self, context: DraftContext) -> Drafter:
        from runtime.drafters.ngram import NgramDrafter

        if context.artifact is None:
            raise ValueError("the onedecode drafter needs the artifact whose stage onedecode holds the table; "
                             "run: prep bake-onedecode ART --traces TR")
        drafters: list[Drafter] = [OneDecodeDrafter(OneDecodeTable.load(context.artifact), self.threshold)]
        if self.context_first:
            drafters.insert(0, NgramDrafter())
        if self.fallback == "ngram":
            drafters.append(NgramDrafter())
        elif self.fallback == "int8":
            drafters.append(_int8_fallback(context))
        return drafters[0] if len(drafters) == 1 else FirstProposal(drafters)


def _int8_fallback(context: DraftContext) -> Drafter:
    """The int8 self-drafter with the int8 screening head of the artifact's `screen` stage."""
    from runtime.drafters.int8 import Int8Drafter
    from runtime.heads.screen_bound import ScreenBound
    from runtime.heads.screen_draft import ScreenDraftHead

    target = context.target
    bound = ScreenBound.from_stage(target.head_weight, target.head_bias, context.artifact.read_stage(Stage.SCREEN))
    return Int8Drafter(target, ScreenDraftHead(bound))
