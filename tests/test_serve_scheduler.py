"""The serve scheduler, stepped by hand: chunked prefill, cancellation within a step, timeouts, the queue bound."""

from __future__ import annotations

import pytest

from factories import tiny_engine
from runtime.backends.decoder import PREFILL_CHUNK
from runtime.sampling import SamplingParams
from runtime.serve.scheduler import Delta, Failed, Finished, Job, Scheduler, Sequence, Started
from serve_factories import alone

PROMPT = "w5 w9 w31 w5 w9 w17"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("scheduler"))


def _job(events: list, prompt=PROMPT, max_tokens: int = 8, timeout_s: float = 60.0, **sampling) -> Job:
    def prepare(engine):
        return engine.prepare(prompt, "spec:lookup+csv", SamplingParams(**sampling), max_tokens)

    return Job(prepare, events.append, timeout_s)


def test_a_long_prompt_is_prefilled_one_chunk_per_step_with_the_same_tokens(engine):
    prompt = " ".join(f"w{4 + (i * 7) % 250}" for i in range(2 * PREFILL_CHUNK + 100))
    plan = engine.prepare(prompt, "spec:lookup+csv", SamplingParams(), 6)
    sequence = Sequence(engine, Job(None, None, 60.0), plan)
    assert [sequence.advance(), sequence.advance()] == [None, None]  # two whole chunks, one per step
    assert sequence.prefill.cache.length == 2 * PREFILL_CHUNK
    tokens = []
    while not isinstance(event := sequence.advance(), Finished):
        tokens.extend(event.tokens)
    assert tokens == alone(engine, prompt, "spec:lookup+csv", max_tokens=6)


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(engine):
    scheduler = Scheduler(engine, max_batch=4)
    kept, dropped = [], []
    assert scheduler.submit(_job(kept, max_tokens=40)) and scheduler.submit(_job(dropped, max_tokens=40))
    scheduler.step()
    assert scheduler.active == 2 and isinstance(dropped[0], Started)
    scheduler.cancel(2)
    scheduler.step()
    assert scheduler.active == 1
    count = len(dropped)
    while scheduler.active:
        scheduler.step()
    assert len(dropped) == count  # nothing more after the cancel
    assert isinstance(kept[-1], Finished) and kept[-1].completion_tokens == 40


def test_a_request_past_its_timeout_fails_with_504_waiting_or_decoding(engine):
    scheduler = Scheduler(engine)
    waiting, decoding = [], []
    scheduler.submit(_job(waiting, timeout_s=0.0))
    job = _job(decoding, max_tokens=500)
    scheduler.submit(job)
    scheduler.step()
    scheduler.step()
    assert isinstance(waiting[-1], Failed) and waiting[-1].status == 504
    assert scheduler.active == 1 and isinstance(decoding[-1], Delta)
    job.timeout_s = 0.0
    scheduler.step()
    assert isinstance(decoding[-1], Failed) and decoding[-1].status == 504 and scheduler.active == 0


def test_the_queue_bound_refuses_and_stopping_fails_what_waits(engine):
    scheduler = Scheduler(engine, max_batch=1, max_queue=2)
    events = [[], [], []]
    assert [scheduler.submit(_job(e)) for e in events] == [True, True, False]
    scheduler.stop()
    scheduler.run()  # returns at once (stopping), failing what was queued
    assert all(isinstance(e[-1], Failed) and e[-1].status == 503 for e in events[:2])
    assert not scheduler.submit(_job([]))


def test_a_bad_request_fails_when_planned_and_frees_its_queue_place(engine):
    scheduler = Scheduler(engine, max_queue=1)
    events = []
    scheduler.submit(_job(events, temperature=-1.0))
    scheduler.step()
    assert isinstance(events[0], Failed) and events[0].status == 400 and "temperature" in events[0].message
    assert scheduler.pending == 0 and scheduler.submit(_job([]))


def test_stop_strings_end_the_text_before_them(engine):
    tokens = alone(engine, PROMPT, "spec:lookup+csv", max_tokens=10)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text.split()[2]
    scheduler = Scheduler(engine)
    events = []
    scheduler.submit(Job(lambda e: e.prepare(PROMPT, "spec:lookup+csv", SamplingParams(), 10, stop=[stop]),
                         events.append, 60.0))
    while not events or not isinstance(events[-1], Finished):
        scheduler.step()
    sent = "".join(e.text for e in events if isinstance(e, Delta)) + events[-1].rest
    assert sent == events[-1].text == text[: text.index(stop)] and events[-1].reason == "stop"
