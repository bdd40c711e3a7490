"""The target's perplexity of a method's output: one teacher-forced forward per prompt, after the timed runs.

perplexity = exp(sum of -log p(output token | prompt, earlier output tokens) / number of output tokens),
over all prompts of a method (token-weighted: long outputs weigh more), under the target's own
distribution (temperature 1, no top-k / top-p, no EOS guard), whatever sampling the method decoded
with. The forward is the session's target backend over prompt + output in one call and the logits
come from the full head in chunks of SKINNY_MAX_ROWS rows, so two methods that produced the same
tokens get the same bits: for exact greedy methods the figure equals ar's exactly. A bench therefore
scores each distinct (prompt, output) once, whichever methods produced it (`perplexities`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import torch
from tqdm import tqdm

from runtime.kernels import SKINNY_MAX_ROWS


@torch.inference_mode()
def output_nll(target, head, prompt: torch.Tensor, output: Sequence[int]) -> float:
    """Summed negative log-likelihood (nats) of `output` after `prompt` [P] under the target and `head`."""
    if not output:
        return 0.0
    ids = torch.cat([prompt.view(-1), torch.as_tensor(list(output), dtype=torch.long)])  # [P + n]
    hidden = target.forward(ids, target.new_cache()).float()  # [P + n, d]
    rows = hidden[prompt.numel() - 1 : ids.numel() - 1]  # [n, d]: the positions that predict the output
    scored = torch.as_tensor(list(output), dtype=torch.long)  # [n]
    nll = 0.0
    for start, chunk in zip(range(0, len(rows), SKINNY_MAX_ROWS), rows.split(SKINNY_MAX_ROWS)):
        logprobs = torch.log_softmax(head.logits(chunk).double(), dim=-1)  # [c, V]
        picked = logprobs.gather(1, scored[start : start + len(chunk)].unsqueeze(1))  # [c, 1]
        nll -= picked.sum().item()
    return nll


def perplexities(target, head, prompts: Sequence[torch.Tensor],
                 outputs_by_method: Sequence[Sequence[Sequence[int]]]) -> list[float | None]:
    """Per method, exp of the mean NLL per output token over all prompts (None when it has no output token),
    with a progress bar. An output several methods gave for the same prompt is scored once: its NLL has the
    same bits whoever produced it."""
    keys = [[(i, tuple(output)) for i, output in enumerate(outputs)] for outputs in outputs_by_method]
    distinct = list(dict.fromkeys(key for method in keys for key in method if key[1]))
    nll = {}
    for i, output in tqdm(distinct, desc="perplexity", unit="forward", file=sys.stderr):
        nll[i, output] = output_nll(target, head, prompts[i], output)
    scores = []
    for method in keys:
        count = sum(len(output) for _, output in method)
        scores.append(math.exp(sum(nll[key] for key in method if key[1]) / count) if count else None)
    return scores
