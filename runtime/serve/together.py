"""Decode many prompts at once in this process: the server's continuous batching, without the server.

For offline jobs (prep responses): each plan becomes a Job on a Scheduler run on this thread until every
one has ended, so each plan gets exactly the tokens it gets alone (runtime.serve.scheduler says why)
while up to `max_batch` of them share each target forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.api import Engine, Plan
from runtime.serve.scheduler import Delta, Failed, Finished, Job, Scheduler


def generate_together(engine: Engine, plans: Sequence[Plan], max_batch: int) -> list[list[int]]:
    """Each plan's new tokens, in the plans' order, decoding up to `max_batch` of them at a time.

    A plan the scheduler fails (a method the session cannot build, an internal error) raises its message
    as a ValueError once the others are done."""
    tokens: list[list[int]] = [[] for _ in plans]
    ended: list[Finished | Failed | None] = [None] * len(plans)
    scheduler = Scheduler(engine, max_batch=max_batch, max_queue=max(1, len(plans)))
    for i, plan in enumerate(plans):
        def emit(event, i=i) -> None:
            if isinstance(event, Delta):
                tokens[i].extend(event.tokens)
            elif isinstance(event, (Finished, Failed)):
                ended[i] = event

        scheduler.submit(Job(lambda _engine, plan=plan: plan, emit, timeout_s=math.inf))
    scheduler.run(keep_going=lambda: not all(ended))
    failed = next((event for event in ended if isinstance(event, Failed)), None)
    if failed is not None:
        raise ValueError(failed.message)
    return tokens
