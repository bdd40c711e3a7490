"""Decoding speed under each thread setting, on a quiet machine and beside busy-loop processes.

A user's machine is rarely idle: a browser or a build holds a core. `runtime bench-threads` runs
each method at each thread setting (the default, which may stand its extra threads down, and fixed
counts), interleaved on the same prompts, once per background load: N processes spinning
`while True: pass`, started by the bench and always stopped by it. The figure that matters is each
setting's speed over the fastest fixed count's in the same load (docs/contention.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from runtime.common.sampling import SamplingParams
from runtime.kernels import thread_stats
from runtime.methods import Method, MethodSpec

BUSY_LOOP = "while True: pass"
SETTLE_SECONDS = 0.5  # the busy loops start and the scheduler spreads them before the first timed run
DEFAULT = "default"  # the thread setting set_threads(None) gives


@contextmanager
def busy_loops(processes: int) -> Iterator[list[int]]:
    """`processes` busy-loop processes beside the block (their pids); stopped on leaving it, Ctrl-C included."""
    started = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL) for _ in range(processes)]
    try:
        if started:
            time.sleep(SETTLE_SECONDS)
        yield [p.pid for p in started]
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()


@dataclass
class Cell:
    """One (load, method, thread setting): its runs' decode tokens and seconds, tokens, pool counters."""

    load: int
    method: str
    threads: str
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    fallbacks: int = 0  # the kernels' pool stood its workers down this many times (default setting)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_contention(specs: list[MethodSpec], build: Callable[[MethodSpec], Method], prompts: list[torch.Tensor],
                   max_new_tokens: int, settings: list[str], loads: list[int], set_threads, seed: int = 0,
                   warmup_tokens: int = 8) -> list[Cell]:
    """Every (method, setting) on every prompt, the order rotated per prompt, once per background load.

    build(spec) gives a new Method: every run decodes with its own, as `runtime generate` and each
    served request do (a drafter that remembers its session, lookup, would otherwise draft a prompt's
    output from another setting's run of the same prompt, or from the earlier prompts). settings: DEFAULT or a thread count as text; set_threads(None | int)
    applies one (runtime.api.set_threads). Greedy decoding: every cell's tokens must equal the first
    cell's (threads never change outputs).
    """
    cells: list[Cell] = []
    bar = tqdm(total=len(loads) * len(prompts) * len(specs) * len(settings), desc="bench-threads", unit="run", file=sys.stderr)
    params = SamplingParams()
    try:
        for load in loads:
            with busy_loops(load):
                combos = [(build(spec), s) for spec in specs for s in settings]
                here = {(m.name, s): Cell(load, m.name, s) for m, s in combos}
                for method, setting in combos:  # warm-up: kernels built, caches touched, at this load
                    set_threads(None if setting == DEFAULT else int(setting))
                    method.decode(prompts[0][: max(1, prompts[0].numel() // 2)], warmup_tokens, params, None)
                for index, prompt in enumerate(prompts):
                    shift = index % len(combos)
                    for method, setting in combos[shift:] + combos[:shift]:
                        set_threads(None if setting == DEFAULT else int(setting))
                        before = thread_stats().get("fallbacks", 0)
                        tokens, stats = build(method.spec).decode(prompt, max_new_tokens, params, torch.Generator().manual_seed(seed))
                        cell = here[(method.name, setting)]
                        cell.tokens += stats.decode_tokens
                        cell.seconds += stats.seconds_decode
                        cell.outputs.append(tokens)
                        cell.fallbacks += thread_stats().get("fallbacks", 0) - before
                        bar.update(1)
                cells.extend(here.values())
    finally:
        bar.close()
        set_threads(None)
    return cells


def rows(cells: list[Cell]) -> list[dict]:
    """JSON rows: tok/s, and the ratio to the fastest fixed thread count of the same load and method."""
    out = []
    for cell in cells:
        fixed = [c.tokens_per_s for c in cells if (c.load, c.method) == (cell.load, cell.method) and c.threads != DEFAULT]
        reference = next(c for c in cells if c.method == cell.method)
        out.append({
            "background_load": cell.load, "method": cell.method, "threads": cell.threads,
            "tokens_per_s": cell.tokens_per_s,
            "vs_best_fixed": cell.tokens_per_s / max(fixed) if fixed and max(fixed) > 0 else None,
            "fallbacks": cell.fallbacks,
            "same_tokens": cell.outputs == reference.outputs,
        })
    return out


def markdown(table_rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    lines = ["| busy-loop processes | method | threads | tok/s | vs fastest fixed count | fallbacks | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in table_rows:
        ratio = "-" if r["vs_best_fixed"] is None else f"{r['vs_best_fixed']:.2f}"
        lines.append(f"| {r['background_load']} | {r['method']} | {r['threads']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['fallbacks']} | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)
