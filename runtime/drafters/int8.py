"""Int8 self-drafter: the whole target, every projection an int8 weight-only copy, on the lean backend.

A decode step here is bound by weight bytes, so the target's own layers with int8 weights (per-row
scales, fp32 activations, the screening kernel) draft at about a quarter of its weight traffic and
agree with it on almost every token. Paired with the int8 screening head (ScreenDraftHead) the
drafter reads ~1/4 of the target's bytes per token. Verification stays full precision, so the
output is the target's, whatever the drafter proposes.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from runtime.drafters.layers import BackendDrafter
from runtime.kernels import SKINNY_MAX_ROWS, screen_gemv
from runtime.lean import LeanTarget, Projection


class Int8Projection:
    """x W^T + b with W rounded to int8 per row (scale = max |W_i| / 127); long prompts use W itself."""

    def __init__(self, dense: Projection) -> None:
        weight = dense.weight.float()  # [out, in]
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # [out]
        self.qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()  # [out, in]
        self.scales = scales[:, None].contiguous()  # [out, 1]
        self.bias = dense.bias
        # A prompt's worth of rows is compute-bound in the GEMV kernel; the dense weights are faster there.
        self.dense = dense

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SKINNY_MAX_ROWS:
            return self.dense(x)
        y = screen_gemv(self.qweight, self.scales, x)  # [T, out]
        return y + self.bias if self.bias is not None else y


def _quantizable(projection: Projection) -> bool:
    return projection.weight.shape[1] % 16 == 0  # the kernel's vector width


def int8_copy(target: LeanTarget) -> LeanTarget:
    """A LeanTarget sharing the target's embeddings, norms and rotary tables, with int8 projections."""
    clone = copy.copy(target)
    clone.layers = [
        dataclasses.replace(
            layer,
            **{
                name: Int8Projection(getattr(layer, name))
                for name in ("qkv", "o", "gate_up", "down")
                if _quantizable(getattr(layer, name))
            },
        )
        for layer in target.layers
    ]
    return clone


class Int8Drafter(BackendDrafter):
    """Drafts with int8_copy(target) and its own head, keeping its own lean KV cache (see BackendDrafter)."""

    def __init__(self, target, head) -> None:
        if not isinstance(target, LeanTarget):
            raise ValueError("the int8 drafter runs on the lean backend; use --backend auto or lean")
        self.backend = int8_copy(target)
        super().__init__(target.body, head)
