"""Run methods interleaved on the same prompts and aggregate what each did."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from runtime.bench.energy import EnergyMeter
from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats, HeadStats, SpecStats
from runtime.methods import Method, preserves_distribution

REFERENCE = "ar"


@dataclass
class MethodResult:
    """Everything one method produced over all prompts."""

    name: str
    distribution_preserving: bool = True
    outputs: list[list[int]] = field(default_factory=list)
    runs: list[DecodeStats] = field(default_factory=list)
    joules: list[float] = field(default_factory=list)  # per run, whole decode call; empty without counters
    energy_unavailable: str | None = None  # why there are no joules ("not available: ...")
    perplexity: float | None = None  # the target's, of `outputs` (runtime.bench.perplexity), set after the runs

    @property
    def head(self) -> HeadStats:
        total = HeadStats()
        for run in self.runs:
            total.add(run.head)
        return total

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens over decode seconds, summed over prompts (long prompts weigh more)."""
        seconds = sum(run.seconds_decode for run in self.runs)
        return sum(run.decode_tokens for run in self.runs) / seconds if seconds else 0.0


def run_bench(
    methods: list[Method],
    prompts: list[torch.Tensor],
    max_new_tokens: int,
    params: SamplingParams,
    seed: int,
    warmup_tokens: int = 8,
    min_new_tokens: int = 0,
    meter: EnergyMeter | None = None,
    fresh: Callable[[Method], Method] | None = None,
) -> list[MethodResult]:
    """Warm every method up, then for each prompt run every method (rotating the order).

    The warm-up decodes the first half of the first prompt, so a drafter that remembers its session
    (lookup) has seen none of the outputs it is timed on.

    min_new_tokens: the EOS min-response guard, passed to every method (bench --chat).
    meter: the energy counters read around each decode call (default: this machine's).
    fresh: gives the Method a prompt runs with: a new one (a new drafter session, as each `runtime
    generate` process and each served request starts), or None to keep each method's session
    across the prompts (lookup then drafts from the earlier prompts' outputs too).
    """
    meter = EnergyMeter() if meter is None else meter
    warmup = prompts[0][: max(1, prompts[0].numel() // 2)]
    for method in methods:
        method.decode(warmup, warmup_tokens, params, torch.Generator().manual_seed(seed), min_new_tokens)
    results = {m.name: MethodResult(m.name, preserves_distribution(m.spec, params), energy_unavailable=meter.reason)
               for m in methods}
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", file=sys.stderr)
    for index, prompt in enumerate(prompts):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            # Same seed per prompt for every method: exact samplers must then agree token for token.
            generator = torch.Generator().manual_seed(seed + index)
            run = method if fresh is None else fresh(method)
            before = meter.read()
            tokens, stats = run.decode(prompt, max_new_tokens, params, generator, min_new_tokens)
            joules = meter.joules_since(before)
            results[method.name].outputs.append(tokens)
            results[method.name].runs.append(stats)
            if joules is not None:
                results[method.name].joules.append(joules)
            bar.update(1)
    bar.close()
    return [results[m.name] for m in methods]


def summarize(results: list[MethodResult], params: SamplingParams) -> list[dict]:
    """Per-method JSON rows with the fields the README and issues quote."""
    reference = next((r for r in results if r.name == REFERENCE), None)
    rows = []
    for result in results:
        head = result.head
        certifies = head.certified + head.fallbacks > 0  # the full head certifies nothing
        row = {
            "method": result.name,
            "tokens_per_s": result.tokens_per_s,
            "speedup_vs_ar": result.tokens_per_s / reference.tokens_per_s if reference and reference.tokens_per_s else None,
            # Methods that do not preserve the target's distribution make no identity claim.
            "distribution_preserving": result.distribution_preserving,
            "identical_to_greedy": _identical_fraction(result, reference) if params.greedy and result.distribution_preserving else None,
            "identical_to_ar": _identical_fraction(result, reference),
            "new_tokens": sum(run.new_tokens for run in result.runs),
            "certification_rate": head.certification_rate if certifies else None,
            "fallback_rate": head.fallback_rate if certifies else None,
            "near_tie_rate": head.near_ties / head.rows if certifies and head.rows else None,
            "recomputed_fraction": head.recomputed_fraction,
            # Only the cluster bound reports what certification would have needed.
            "required_open_fraction": head.required_open_fraction if head.required_open_tokens else None,
            **_speculative_fields(result, reference),
            "shortlist_fraction": _shortlist_fraction(result),
            "perplexity": result.perplexity,
            # Whole decode calls (prefill included) per new token; null with the reason where no counter is readable.
            "joules_per_token": _joules_per_token(result),
            "energy_unavailable": result.energy_unavailable,
        }
        rows.append({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})
    return rows


def _speculative_fields(result: MethodResult, reference: MethodResult | None) -> dict:
    """mean_accepted_length, acceptance_rate and acceptance by draft position, T_D (ms per drafted token)
    and its share of an ar step in this run, T_V (ms per verify round) and the GP paper's predicted
    tokens/s over all prompts, for methods that draft."""
    specs = [run.spec for run in result.runs if run.spec is not None]
    if not specs:
        return {}
    total = SpecStats.combined(specs)
    counts = {"mean_accepted_length": total.mean_accepted_length, "acceptance_rate": total.acceptance_rate,
              "acceptance_by_position": total.acceptance_per_position}
    if total.seconds_verify <= 0:  # counts without phase times: llama.cpp's own speculation (llamacpp:bin:eagle3)
        return {**counts, "draft_share_of_ar_step": None, "draft_ms_per_token": None, "verify_ms_per_round": None,
                "predicted_tokens_per_s": None}
    step_ms = 1e3 / reference.tokens_per_s if reference is not None and reference.tokens_per_s else None
    draft_ms = 1e3 * total.seconds_draft_per_token
    return {
        **counts,
        "draft_share_of_ar_step": draft_ms / step_ms if step_ms and total.drafted else None,
        "draft_ms_per_token": draft_ms,
        "verify_ms_per_round": 1e3 * total.seconds_verify_per_round,
        "predicted_tokens_per_s": total.predicted_tokens_per_s,
    }


def _joules_per_token(result: MethodResult) -> float | None:
    """Measured joules over every run of the method per new token (None without counters or tokens)."""
    tokens = sum(run.new_tokens for run in result.runs)
    return sum(result.joules) / tokens if result.joules and tokens else None


def _shortlist_fraction(result: MethodResult) -> float | None:
    """Mean drafter shortlist size over V (shortlisted drafters only: dynaspec, frspec)."""
    heads = [run.shortlist for run in result.runs if run.shortlist is not None]
    if not heads:
        return None
    total = HeadStats()
    for head in heads:
        total.add(head)
    return total.recomputed_fraction


def _identical_fraction(result: MethodResult, reference: MethodResult | None) -> float | None:
    """Fraction of prompts whose tokens equal the reference method's."""
    if reference is None:
        return None
    same = sum(a == b for a, b in zip(result.outputs, reference.outputs))
    return same / len(result.outputs) if result.outputs else None
