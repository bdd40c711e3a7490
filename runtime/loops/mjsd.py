"""MJSD (Qin et al., "Multi-Token Joint Speculative Decoding"): beam drafts, joint-likelihood acceptance.

NOT distribution-preserving, by design: the output follows neither the target's distribution nor its
greedy choices. It trades that for output perplexity (the paper reports ~21 % lower than greedy) and
speed. Never count it among the exact methods.

One round (Algorithm 1 of the paper):
1. A BeamDrafter's beam search of width M over gamma tokens (runtime.drafters.beam.BeamDrafts, over a
   backend drafter: int8, layers:N, ...): each step feeds the surviving beams' last tokens to the
   drafter as new nodes of one token tree (TargetModel.forward_tree), so a step costs one drafter
   forward of M rows, every beam's next distribution at once.
2. The target scores the best beam only: the acceptance rule looks at nothing else, so a chain
   forward over [last] + best beam gives every row it needs (the same bits a tree forward over all
   beams would give that path's nodes, at gamma + 1 rows instead of the tree's).
3. runtime.loops.verify_tree.verify_joint keeps the longest prefix x_{1:j} with min(1, p(x_{1:j}) /
   q(x_{1:j})) > tau (strict, every prefix tested, as in the paper's pseudocode), then one token from
   the target after it.

Which p and q: with sampling parameters both are warped by them (the paper warps with top-20, top-p
0.9) and the extra token is drawn from the warped p. With greedy parameters a one-hot p would make
the rule plain greedy verification, so the ratio uses the unwarped softmax (temperature 1) of both
models and the extra token is the target's argmax (the paper's argmax-warped MJGD); both are
runtime.common.sampling.joint_probs.
"""

from __future__ import annotations

import time

import torch

from runtime.common.sampling import SamplingParams, TokenBan, joint_probs, mask_banned
from runtime.drafters.base import BeamDrafter, Verdict
from runtime.loops.decode import TokenStream, drive
from runtime.loops.rounds import Round, stream_rounds
from runtime.loops.speculative import DEFAULT_GAMMA
from runtime.common.stats import DecodeStats, SpecStats
from runtime.text.stopping import StopStrings
from runtime.backends.base import TargetModel
from runtime.loops.verify_tree import verify_joint

DEFAULT_TAU = 0.1  # the paper's setting for every dataset (Appendix D)


def generate_mjsd(*args, **kwargs) -> tuple[list[int], DecodeStats]:
    """stream_mjsd (same arguments) run to its end: the new tokens and the stats."""
    return drive(stream_mjsd(*args, **kwargs))


def stream_mjsd(
    target: TargetModel,
    head,
    drafts: BeamDrafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    params: SamplingParams = SamplingParams(),
    generator: torch.Generator | None = None,
    gamma: int = DEFAULT_GAMMA,
    tau: float = DEFAULT_TAU,
    min_new_tokens: int = 0,
    stop: StopStrings | None = None,
) -> TokenStream:
    """MJSD decoding (not distribution-preserving): beam drafts of gamma tokens, joint acceptance at tau.

    Arguments and stream as runtime.loops.speculative.stream_speculative.
    """
    if gamma < 1 or not 0.0 <= tau < 1.0:
        raise ValueError(f"MJSD needs gamma >= 1 and tau in [0, 1), got {gamma} and {tau}")

    def begin(cache, ban: TokenBan, spec: SpecStats) -> Round:
        drafts.reset(prompt.tolist(), params, generator, ban)
        # Greedy: the extra token is the argmax, so verify_joint's own draw is thrown away; it draws
        # from a private generator to leave the caller's random state alone.
        draw = generator if not params.greedy else torch.Generator().manual_seed(0)

        def one_round(context: list[int], left: int) -> Verdict:
            t0 = time.perf_counter()
            levels = min(gamma, left - 1)
            beam = drafts.draft(context, levels) if levels > 0 else None
            best = torch.tensor(beam.beams[0] if beam else [], dtype=torch.long)  # [k]
            log_q = beam.tree.scores[beam.tree.path(beam.best)] if beam else torch.zeros(0)  # [k] joint log q
            t1 = time.perf_counter()
            hidden = target.forward(torch.cat([torch.tensor([context[-1]]), best]), cache)  # [k + 1, d]
            logits = mask_banned(head.logits(hidden), ban.ids, ban.rows(len(context), hidden.shape[0]))  # [k + 1, V]
            verdict = verify_joint(joint_probs(logits, params), log_q, best, tau, draw)
            if params.greedy:
                verdict = Verdict(verdict.drafted, verdict.accepted,
                                  verdict.tokens[:-1] + [int(logits[verdict.accepted].argmax())])
            target.crop(cache, len(context) + verdict.accepted)
            t2 = time.perf_counter()
            spec.seconds_draft += t1 - t0
            spec.seconds_verify += t2 - t1
            return verdict

        return one_round

    return stream_rounds(target, head, prompt, max_new_tokens, params, generator, begin, min_new_tokens, stop)
