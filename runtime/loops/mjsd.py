"""MJSD (Qin et al., "Multi-Token Joint Speculative Decoding"): beam drafts, joint-likelihood acceptance.

NOT distribution-preserving, by design: the output follows neither the target's distribution nor its
greedy choices. It trades that for output perplexity (the paper reports ~21 % lower than greedy) and
speed. Never count it among the exact methods.

One round (Algorithm 1 of the paper):
1. Beam search of width M over gamma tokens in a backend drafter (int8, layers:N, ...): each step
   feeds the surviving beams' last tokens to the drafter as new nodes of one token tree
   (TargetModel.forward_tree), so a step costs one drafter forward of M rows, every beam's next
   distribution at once (runtime.drafters.beam.beam_search ranks the extensions).
2. The target scores the best beam only: the acceptance rule looks at nothing else, so a chain
   forward over [last] + best beam gives every row it needs (the same bits a tree forward over all
   beams would give that path's nodes, at gamma + 1 rows instead of the tree's).
3. runtime.loops.verify_tree.verify_joint keeps the longest prefix x_{1:j} with min(1, p(x_{1:j}) /
   q(x_{1:j})) > tau (strict, every prefix tested, as in the paper's pseudocode), then one token from
   the target after it.

Which p and q: with sampling parameters both are warped by them (the paper warps with top-20, top-p
0.9) and the extra token is drawn from the warped p. With greedy parameters a one-hot p would make
the rule plain greedy verification, so the ratio uses the unwarped softmax (temperature 1) of both
models and the extra token is the target's argmax (the paper's argmax-warped MJGD).
"""

from __future__ import annotations

import time

import torch

from runtime.drafters.beam import BeamDraft, beam_search
from runtime.drafters.layers import BackendDrafter
from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan, mask_banned, warp
from runtime.loops.decode import TokenStream, drive
from runtime.loops.speculative import DEFAULT_GAMMA, Round, stream_rounds
from runtime.common.stats import DecodeStats, SpecStats
from runtime.text.stopping import StopStrings
from runtime.backends.base import TargetModel
from runtime.loops.verify import Verdict
from runtime.loops.verify_tree import verify_joint

DEFAULT_WIDTH = 4
DEFAULT_TAU = 0.1  # the paper's setting for every dataset (Appendix D)


def joint_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities MJSD's joint ratio uses [n, V]: warped when sampling, the plain softmax when greedy."""
    return torch.softmax(logits.double(), dim=-1) if params.greedy else warp(logits, params).double()


class BeamDrafts:
    """Beam drafts from a backend drafter; its cache keeps the best beam's fed prefix after a search."""

    def __init__(self, drafter: BackendDrafter, width: int = DEFAULT_WIDTH) -> None:
        if width < 1:
            raise ValueError(f"MJSD needs a beam width >= 1, got {width}")
        self.drafter, self.width = drafter, width
        self.params, self.ban = SamplingParams(), NO_BAN

    def reset(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None,
              ban: TokenBan = NO_BAN) -> None:
        self.params, self.ban = params, ban
        self.drafter.reset(prompt, params, generator, ban)

    @torch.inference_mode()
    def draft(self, context: list[int], gamma: int) -> BeamDraft:
        """Width-M beam search over gamma tokens after `context` (one drafter tree forward per step)."""
        drafter = self.drafter
        hidden = {(): drafter.feed(drafter._sync(context))[0]}  # prefix -> the drafter's hidden state [d] after it
        start = drafter.cache.length
        nodes: dict[tuple[int, ...], int] = {}  # prefix -> its node in the drafter's tree
        parents: list[int] = []

        def next_log_probs(beams: list[list[int]]) -> torch.Tensor:
            new = [tuple(beam) for beam in beams if tuple(beam) not in hidden]
            if new:
                for beam in new:
                    nodes[beam] = len(parents)
                    parents.append(nodes[beam[:-1]] if len(beam) > 1 else -1)
                fed = drafter.backend.forward_tree(torch.tensor([beam[-1] for beam in new]), torch.tensor(parents),
                                                   drafter.cache, start)  # [n, d]
                hidden.update(zip(new, fed))
            rows = torch.stack([hidden[tuple(beam)] for beam in beams])  # [B, d]
            guarded = self.ban.rows(len(context) + len(beams[0]), 1) * len(beams)
            logits = mask_banned(drafter.head.logits(rows), self.ban.ids, guarded)  # [B, V]
            return torch.log(joint_probs(logits, self.params))

        beam = beam_search(next_log_probs, self.width, gamma)
        # Keep the best beam's fed prefix (all its tokens but the last) for the next round's sync.
        best = beam.beams[0] if beam.beams else []
        kept = [nodes[tuple(best[: i + 1])] for i in range(len(best) - 1)]
        drafter.backend.compact(drafter.cache, start, kept)
        drafter.cached.extend(best[: len(kept)])
        return beam


def generate_mjsd(*args, **kwargs) -> tuple[list[int], DecodeStats]:
    """stream_mjsd (same arguments) run to its end: the new tokens and the stats."""
    return drive(stream_mjsd(*args, **kwargs))


def stream_mjsd(
    target: TargetModel,
    head,
    drafts: BeamDrafts,
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
