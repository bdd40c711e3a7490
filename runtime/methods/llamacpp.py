"""llamacpp: llama.cpp's decoding of the session model's GGUF, the reference users compare with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.drafters.arguments import number_text, unit_number
from runtime.llamacpp.bindings import LlamaCppDecoder
from runtime.llamacpp.server import Eagle3Draft, LlamaServerDecoder
from runtime.methods.arguments import count, key_values
from runtime.methods.registry import MethodEntry, register_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.session import Session

LLAMACPP_LOOKUP_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default: what a user gets unasked


BIN_EXAMPLE = "llamacpp:bin, llamacpp:bin:eagle3=heads/qwen.gguf or llamacpp:bin:eagle3=heads/qwen.gguf:n=4"


def _head_path(value: str) -> Path | None:
    """a path to the head's GGUF"""
    return Path(value) if value else None


def _probability(value: str) -> float | None:
    """a number in [0, 1]"""
    return unit_number(value)


@dataclass(frozen=True)
class LlamacppOptions:
    """llamacpp | llamacpp:lookup[:K] | llamacpp:bin[:eagle3=HEAD[:n=N][:pmin=P]]: llama.cpp's plain decoding
    through llama-cpp-python, its prompt lookup decoding with K draft tokens per round, or llama.cpp's own
    llama-server binary: plain decoding, or its EAGLE-3 speculation with the head HEAD.gguf (our exported head,
    converted by llama.cpp's convert_hf_to_gguf.py), N tokens drafted a round (--spec-draft-n-max) and drafts
    below probability P cut (--spec-draft-p-min); N and P default to llama.cpp's own defaults."""

    lookup: int | None = None  # draft tokens per round of prompt lookup; None: plain decoding
    binary: bool = False  # by the llama-server binary
    eagle3: Eagle3Draft | None = None  # llama-server's EAGLE-3 speculation (binary only)

    @classmethod
    def parse(cls, args: list[str]) -> LlamacppOptions:
        if not args:
            return cls()
        if args[0] == "bin":
            return cls(binary=True, eagle3=_eagle3(args[1:]))
        tokens = count(1, 32)(args[1]) if len(args) == 2 else LLAMACPP_LOOKUP_TOKENS
        if args[0] != "lookup" or len(args) > 2 or tokens is None:
            raise ValueError(f"method 'llamacpp' takes nothing, lookup[:K] (K draft tokens, 1..32) or bin, not "
                             f"llamacpp:{':'.join(args)}; e.g. llamacpp, llamacpp:lookup:4 or llamacpp:bin")
        return cls(lookup=tokens)

    def format(self) -> tuple[str, ...]:
        if not self.binary:
            return () if self.lookup is None else ("lookup", str(self.lookup))
        draft, words = self.eagle3, ["bin"]
        if draft is not None:
            words.append(f"eagle3={draft.head}")
            if draft.max_drafts is not None:
                words.append(f"n={draft.max_drafts}")
            if draft.min_probability is not None:
                words.append(f"pmin={number_text(draft.min_probability)}")
        return tuple(words)

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        """With this process's thread count."""
        if self.binary:
            return LlamaServerDecoder(session.model.gguf_path, session.target.eos_token_ids, eagle3=self.eagle3)
        return LlamaCppDecoder(session.model.gguf_path, session.target.eos_token_ids, lookup_tokens=self.lookup)


def _eagle3(args: list[str]) -> Eagle3Draft | None:
    """llamacpp:bin's options (eagle3=HEAD, n=N, pmin=P, each at most once), or a one-line error naming the fix."""
    rest, given = key_values("llamacpp:bin", args, {"eagle3": _head_path, "n": count(1, 32), "pmin": _probability},
                             BIN_EXAMPLE)
    if rest:
        raise ValueError(f"llamacpp:bin takes eagle3=HEAD.gguf, n=N and pmin=P, each at most once, not "
                         f"{rest[0]!r}; e.g. {BIN_EXAMPLE}")
    if not given:
        return None
    if "eagle3" not in given:
        raise ValueError(f"llamacpp:bin's n and pmin set llama.cpp's EAGLE-3 drafting; name its head with eagle3=HEAD.gguf, "
                         f"e.g. {BIN_EXAMPLE}")
    return Eagle3Draft(given["eagle3"], given.get("n"), given.get("pmin"))


# llama.cpp quantizes activations: its text is the model's only up to rounding, so it makes no identity claim.
register_method(MethodEntry(
    "llamacpp", LlamacppOptions,
    "llamacpp[:lookup[:K]|:bin[:eagle3=HEAD.gguf[:n=N][:pmin=P]]] (llama.cpp's plain decoding of the same GGUF: the reference users compare with; lookup: "
    f"llama-cpp-python's prompt lookup decoding, K draft tokens (default {LLAMACPP_LOOKUP_TOKENS}); both need the "
    "llamacpp extra; bin: llama.cpp's own llama-server binary, from SPECVOCAB_LLAMACPP_BIN or PATH; bin:eagle3=HEAD.gguf"
    "[:n=N][:pmin=P]: that binary's EAGLE-3 speculation with a converted head, N drafts a round, cut below P)",
    distribution_preserving=False))
