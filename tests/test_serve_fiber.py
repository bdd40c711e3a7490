"""Fiber: turns pass strictly between the resumer and the body; closing unwinds a suspended body."""

from __future__ import annotations

import threading

import pytest

from runtime.serve.fiber import Fiber


def test_values_pass_both_ways_and_the_result_comes_back():
    def body(suspend):
        return [suspend(1), suspend(2)]

    fiber = Fiber(body)
    assert fiber.resume() == 1 and fiber.resume("a") == 2
    assert fiber.resume("b") is None and fiber.done and fiber.result == ["a", "b"]
    with pytest.raises(RuntimeError, match="ended"):
        fiber.resume()


def test_closing_unwinds_the_body_and_ends_its_thread():
    cleaned = threading.Event()

    def body(suspend):
        try:
            while True:
                suspend(None)
        finally:
            cleaned.set()

    fiber = Fiber(body)
    fiber.resume()
    fiber.close()
    assert cleaned.is_set() and fiber.done and fiber.error is None
    fiber._thread.join(5)
    assert not fiber._thread.is_alive()


def test_an_error_in_the_body_is_handed_to_the_resumer():
    def body(suspend):
        suspend(None)
        raise ValueError("bad")

    fiber = Fiber(body)
    fiber.resume()
    fiber.resume()
    assert fiber.done and isinstance(fiber.error, ValueError)


def test_a_fiber_never_resumed_closes_without_a_thread():
    fiber = Fiber(lambda suspend: None)
    fiber.close()
    assert fiber.done and fiber._thread is None


def test_row_calls_on_one_fn_run_once_over_their_rows_and_split_back():
    import torch

    from runtime.heads.rowwise import RowCall, run_calls

    seen = []

    def double(x):
        seen.append(x.shape[0])
        return x * 2, x.sum(dim=1)

    def fail(x):
        raise ValueError("bad rows")

    calls = [RowCall(double, torch.ones(2, 3)), RowCall(double, torch.full((1, 3), 3.0)), RowCall(fail, torch.ones(1, 3))]
    assert sorted(run_calls(calls)) == [1, 2] and seen == [3]
    assert torch.equal(calls[1].result[0], torch.full((1, 3), 6.0)) and torch.equal(calls[0].result[1], torch.full((2,), 3.0))
    assert all(call.done for call in calls) and isinstance(calls[2].error, ValueError) and calls[0].error is None
    seen.clear()
    run_calls(calls[:2], fused=False)
    assert seen == [2, 1]
