"""Int8 self-drafter: the whole target, every projection an int8 weight-only copy, on the target's ladder.

A decode step here is bound by weight bytes, so the target's own layers with int8 weights (per-row
scales, fp32 activations, the screening kernel) draft at about a quarter of the fp32 target's weight
traffic and agree with it on almost every token. Paired with the int8 screening head
(ScreenDraftHead) the drafter reads ~1/4 of the fp32 target's bytes per token. On the native backend
the target's own blocks are already 4-8 bits, so an int8 copy reads more than the target does: it
runs there for comparison, but it cannot pay. Verification stays with the target, so the output is
the target's, whatever the drafter proposes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.backends.target import DecoderTarget
from runtime.common.numerics import quantize_rows_int8
from runtime.drafters.layers import BackendDrafter
from runtime.drafters.arguments import no_arguments
from runtime.drafters.registry import DraftContext
from runtime.kernels import SKINNY_MAX_ROWS, screen_gemv


class Int8Projection:
    """x W^T + b with W rounded to int8 per row; long prompts use the original projection."""

    def __init__(self, original: Callable, weight: torch.Tensor | None = None) -> None:
        """weight: original.dense() when the caller already has it (a native projection dequantizes to make it)."""
        weight = original.dense() if weight is None else weight  # [out, in]
        self.qweight, scales = quantize_rows_int8(weight.float())  # [out, in] int8, [out]
        self.scales = scales[:, None].contiguous()  # [out, 1]
        self.bias = original.bias
        # A prompt's worth of rows is compute-bound in the GEMV kernel; the original weights are faster there.
        self.original = original

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SKINNY_MAX_ROWS:
            return self.original(x)
        y = screen_gemv(self.qweight, self.scales, x)  # [T, out]
        return y + self.bias if self.bias is not None else y

    def dense(self) -> torch.Tensor:
        return self.qweight.float() * self.scales


def int8_copy(target: DecoderTarget) -> DecoderTarget:
    """The target over a decoder whose projections are int8 copies (embeddings, norms, rotary shared)."""
    def transform(name: str, index: int, projection: Callable) -> Callable:
        weight = projection.dense()  # [out, in]
        quantizable = weight.shape[1] % 16 == 0  # the kernel's vector width
        return Int8Projection(projection, weight) if quantizable else projection

    return target.with_decoder(target.decoder.map_projections(transform))


class Int8Drafter(BackendDrafter):
    """Drafts with int8_copy(target) and its own head, keeping its own KV cache (see BackendDrafter)."""

    def __init__(self, target, head) -> None:
        if not isinstance(target, DecoderTarget):
            raise ValueError("the int8 drafter runs on the lean or native backend; use --backend auto, lean or native")
        super().__init__(int8_copy(target), head)


@dataclass(frozen=True)
class Int8Options:
    """int8 takes no argument."""

    @classmethod
    def parse(cls, args: list[str]) -> Int8Options:
        no_arguments("int8", args)
        return cls()

    def format(self) -> tuple[str, ...]:
        return ()

    def build(self, context: DraftContext) -> Int8Drafter:
        return Int8Drafter(context.target, context.head)
