"""llamacpp: llama.cpp's decoding of the session model's GGUF, the reference users compare with."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.llamacpp.bindings import LlamaCppDecoder
from runtime.llamacpp.server import LlamaServerDecoder
from runtime.methods.arguments import count
from runtime.methods.registry import MethodEntry, register_method
from runtime.methods.spec import MethodSpec
from runtime.methods.streamer import Streamer
from runtime.session import Session

LLAMACPP_LOOKUP_TOKENS = 10  # llama-cpp-python's LlamaPromptLookupDecoding default: what a user gets unasked


@dataclass(frozen=True)
class LlamacppOptions:
    """llamacpp | llamacpp:lookup[:K] | llamacpp:bin: llama.cpp's plain decoding through llama-cpp-python,
    its prompt lookup decoding with K draft tokens per round, or plain decoding by llama.cpp's own
    llama-server binary."""

    lookup: int | None = None  # draft tokens per round of prompt lookup; None: plain decoding
    binary: bool = False  # by the llama-server binary

    @classmethod
    def parse(cls, args: list[str]) -> LlamacppOptions:
        if not args:
            return cls()
        if args == ["bin"]:
            return cls(binary=True)
        tokens = count(1, 32)(args[1]) if len(args) == 2 else LLAMACPP_LOOKUP_TOKENS
        if args[0] != "lookup" or len(args) > 2 or tokens is None:
            raise ValueError(f"method 'llamacpp' takes nothing, lookup[:K] (K draft tokens, 1..32) or bin, not "
                             f"llamacpp:{':'.join(args)}; e.g. llamacpp, llamacpp:lookup:4 or llamacpp:bin")
        return cls(lookup=tokens)

    def format(self) -> tuple[str, ...]:
        if self.binary:
            return ("bin",)
        return () if self.lookup is None else ("lookup", str(self.lookup))

    def build(self, session: Session, spec: MethodSpec) -> Streamer:
        """With this process's thread count."""
        if self.binary:
            return LlamaServerDecoder(session.model.gguf_path, session.target.eos_token_ids)
        return LlamaCppDecoder(session.model.gguf_path, session.target.eos_token_ids, lookup_tokens=self.lookup)


# llama.cpp quantizes activations: its text is the model's only up to rounding, so it makes no identity claim.
register_method(MethodEntry(
    "llamacpp", LlamacppOptions,
    "llamacpp[:lookup[:K]|:bin] (llama.cpp's plain decoding of the same GGUF: the reference users compare with; lookup: "
    f"llama-cpp-python's prompt lookup decoding, K draft tokens (default {LLAMACPP_LOOKUP_TOKENS}); both need the "
    "llamacpp extra; bin: llama.cpp's own llama-server binary, from SPECVOCAB_LLAMACPP_BIN or PATH)",
    distribution_preserving=False))
