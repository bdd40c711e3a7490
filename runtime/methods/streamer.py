"""The Streamer protocol: what a method's options build, a function that decodes one prompt as a token stream."""

from __future__ import annotations

from typing import Protocol

import torch

from runtime.loops.decode import TokenStream
from runtime.common.sampling import SamplingParams
from runtime.text.stopping import StopStrings


class Streamer(Protocol):
    """(prompt [P], max new tokens, sampling, generator, min_new_tokens: the EOS guard, stop strings) ->
    a token stream (runtime.loops.decode): each new token as it is appended, then (tokens, stats)."""

    def __call__(
        self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, generator: torch.Generator | None,
        min_new_tokens: int = 0, stop: StopStrings | None = None,
    ) -> TokenStream: ...
