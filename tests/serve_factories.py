"""A real server on an ephemeral port over a tiny engine, and what a fresh `runtime generate` gives."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx

from runtime.api import Engine, Generation
from runtime.common.sampling import SamplingParams
from runtime.methods import build_method
from runtime.serve.app import create_app
from runtime.serve.scheduler import Scheduler
from runtime.serve.server import listen, start_http

CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}hi{% endif %}"


@contextmanager
def running(engine: Engine, start: bool = True, max_batch: int = 8, max_queue: int = 64, **app_options):
    """(base URL, scheduler) of a server on 127.0.0.1 (any free port), its scheduler on a thread when `start`."""
    scheduler = Scheduler(engine, max_batch, max_queue)
    app = create_app(scheduler, model_name(engine), str(engine.default_method(serving=True)), **app_options)
    sock = listen("127.0.0.1", 0)
    server, thread = start_http(app, sock)
    if start:
        scheduler.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", scheduler
    finally:
        scheduler.stop()
        server.should_exit = True
        thread.join(10)


def model_name(engine: Engine) -> str:
    return engine.session.model.info.name


def alone(engine: Engine, prompt, method=None, max_tokens: int = 16, temperature: float = 0.0, seed: int = 0,
          stop=(), chat: bool = False, top_p: float = 1.0) -> list[int]:
    """The tokens a fresh `runtime generate` run gives: the method built anew, as in a new process."""
    plan = engine.prepare(prompt, method, SamplingParams(temperature, 0, top_p), max_tokens, chat, None, stop, seed)
    return Generation(engine.tokenizer, plan.stream(build_method(engine.session, plan.spec))).wait().tokens


def post_all(url: str, bodies: list[dict], path: str = "/v1/completions") -> list[dict]:
    """POST every body at once (one thread each); the JSON answers in order."""
    answers: list = [None] * len(bodies)

    def post(i: int) -> None:
        answers[i] = httpx.post(url + path, json=bodies[i], timeout=60).json()

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def posted_in_one_batch(url: str, scheduler: Scheduler, bodies: list[dict]) -> list[dict]:
    """POST every body at once to a server whose scheduler is not started yet, start it once all of them
    wait (so they are admitted in one step), and return the JSON answers in order."""
    answers: list = []
    poster = threading.Thread(target=lambda: answers.extend(post_all(url, bodies)))
    poster.start()
    wait_until(lambda: scheduler.pending == len(bodies))  # all queued before the scheduler runs: one batch
    scheduler.start()
    poster.join()
    return answers


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def sse_payloads(response: httpx.Response) -> list:
    """The data of every SSE event of a streamed response: JSON objects, and the final '[DONE]'."""
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            payloads.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"not an SSE data line: {line!r}"
    return payloads
