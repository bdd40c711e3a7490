"""Row-wise head calls a server may run for several requests at once: `rowwise(fn, x)` is fn(x).

A call is row-wise when each row of its result belongs to the same row of x [B, ...] and a request
may take its rows from a call over more rows without changing its tokens: the LM head's logits are
row-invariant bit for bit (runtime.kernels.linear at any row count), and a certified head's bound is
sound whatever rows share its screen (its intervals may move with the batch, the exact token it
certifies does not). Results are split back by rows: a tensor (or tuple of tensors) along its first
dim, anything else through its `rows(start, end)`.

In a plain process `rowwise` calls fn at once. In the server each request's loop runs inside
`posting(post)` (on its own thread, runtime.serve.fiber): the call is handed to the scheduler, which
runs every request's call on the same fn as one call over all their rows (run_calls).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

_posting = threading.local()


@dataclass(eq=False)
class RowCall:
    """One request's call: fn over its rows x [B, ...], and its part of the result once run."""

    fn: Callable[[torch.Tensor], object]
    x: torch.Tensor  # [B, ...]
    key: object = None  # calls with equal keys compute the same function (None: fn itself)
    result: object = None
    error: Exception | None = None  # what fn raised (the call then fails in the request's loop)
    done: bool = False


def rowwise(fn: Callable[[torch.Tensor], object], x: torch.Tensor, key: object = None):
    """fn(x), or, inside `posting`, what the scheduler's one call over several requests' rows gives for x's rows.
    key: equal for calls whose fns compute the same function (default: fn, e.g. one bound's method)."""
    post = getattr(_posting, "post", None)
    if post is None:
        return fn(x)
    call = RowCall(fn, x, fn if key is None else key)
    post(call)
    if call.error is not None:
        raise call.error
    return call.result


def logits_key(weight, bias) -> tuple:
    """The key of linear(x, weight, bias) calls: any head over these very tensors computes the same logits."""
    return ("logits", id(weight), id(bias))


@contextmanager
def posting(post: Callable[[RowCall], object]) -> Iterator[None]:
    """Hand this thread's rowwise calls to `post` (which returns their results) while inside."""
    _posting.post = post
    try:
        yield
    finally:
        _posting.post = None


def rows_of(result, start: int, end: int):
    """Rows start..end - 1 of a row-wise result (a tensor, a tuple of them, or an object with `rows`)."""
    if isinstance(result, torch.Tensor):
        return result[start:end]
    if isinstance(result, tuple):
        return tuple(rows_of(part, start, end) for part in result)
    return result.rows(start, end)


def run_calls(calls: list[RowCall], fused: bool = True) -> list[int]:
    """Run every call, those on the same fn as one call over their rows (fused); the requests' calls per fn call."""
    groups: dict[object, list[RowCall]] = {}
    for call in calls:
        groups.setdefault((call.fn if call.key is None else call.key) if fused else id(call), []).append(call)
    for group in groups.values():
        try:
            result, start = group[0].fn(torch.cat([call.x for call in group]) if len(group) > 1 else group[0].x), 0
            for call in group:
                call.result = rows_of(result, start, start + call.x.shape[0])
                start += call.x.shape[0]
        except Exception as e:  # noqa: BLE001 - raised again in each request's loop, which decides
            for call in group:
                call.error = e
        for call in group:
            call.done = True
    return [len(group) for group in groups.values()]
