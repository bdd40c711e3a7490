"""runtime serve on the real gemma3-270m and qwen2.5-coder: greedy and seeded answers, five requests sharing
every forward, equal the same request alone."""

from __future__ import annotations

import threading

import httpx
import pytest

from runtime.api import Engine
from serve_factories import alone, model_name, running, wait_until

pytestmark = pytest.mark.real_model

PROMPTS = ["def fib(n):", "Write a haiku about rain.", "class Stack:\n    def push(self, item):",
           "The capital of France is", "import numpy as np\n\ndef softmax(x):"]


@pytest.mark.parametrize("session", ["gemma_session", "qwen_session"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}], ids=["greedy", "seeded"])
def test_real_answers_under_load_equal_their_runs_alone(request, session, sampling):
    engine = Engine(request.getfixturevalue(session))
    expected = [alone(engine, p, max_tokens=20, temperature=sampling["temperature"], seed=sampling.get("seed", 0))
                for p in PROMPTS]
    bodies = [{"model": model_name(engine), "prompt": p, "max_tokens": 20, "return_token_ids": True, **sampling}
              for p in PROMPTS]
    answers: list = [None] * len(bodies)
    with running(engine, start=False) as (url, scheduler):
        def post(i: int) -> None:
            answers[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=300).json()

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        wait_until(lambda: scheduler.pending == len(bodies))
        scheduler.start()
        for thread in threads:
            thread.join()
        assert scheduler.metrics.peak_batch_size == scheduler.metrics.peak_fused == len(bodies)
    assert [a["choices"][0]["token_ids"] for a in answers] == expected
