"""The serve scheduler, stepped by hand: chunked prefill, cancellation within a step, timeouts, the queue bound."""

from __future__ import annotations

import pytest

from factories import tiny_engine
from runtime.backends.decoder import PREFILL_CHUNK
from runtime.kernels import SKINNY_MAX_ROWS
from runtime.common.sampling import SamplingParams
from runtime.serve.scheduler import Delta, Failed, Finished, Job, Scheduler, Started
from runtime.serve.together import generate_together
from serve_factories import alone

PROMPT = "w5 w9 w31 w5 w9 w17"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("scheduler"))


def _job(events: list, prompt=PROMPT, max_tokens: int = 8, timeout_s: float = 60.0, **sampling) -> Job:
    def prepare(engine):
        return engine.prepare(prompt, "spec:lookup+csv", SamplingParams(**sampling), max_tokens)

    return Job(prepare, events.append, timeout_s)


def _until_finished(scheduler: Scheduler, events: list) -> None:
    while not events or not isinstance(events[-1], (Finished, Failed)):
        scheduler.step()


def test_a_long_prompt_is_prefilled_one_chunk_per_step_beside_a_decoding_request(engine):
    prompt = " ".join(f"w{4 + (i * 7) % 250}" for i in range(2 * PREFILL_CHUNK + 100))
    scheduler = Scheduler(engine)
    short, long = [], []
    scheduler.submit(_job(short, max_tokens=30))
    scheduler.step()  # the short request's prompt forward
    scheduler.submit(_job(long, prompt=prompt, max_tokens=6))
    rows = []
    for _ in range(3):  # the long prompt's three chunks (256, 256, 100), one per step, beside the short one's rows
        before = scheduler.metrics.forward_rows
        scheduler.step()
        rows.append(scheduler.metrics.forward_rows - before)
        assert not any(isinstance(e, Delta) for e in long)
    assert [r - r % PREFILL_CHUNK if r > PREFILL_CHUNK else r for r in rows][:2] == [PREFILL_CHUNK] * 2
    assert all(r > chunk for r, chunk in zip(rows, (PREFILL_CHUNK, PREFILL_CHUNK, 100)))  # the short one's rows too
    assert scheduler.metrics.forwards == 4  # one forward per step
    _until_finished(scheduler, long)
    _until_finished(scheduler, short)
    assert [t for e in long if isinstance(e, Delta) for t in e.tokens] == alone(engine, prompt, "spec:lookup+csv", max_tokens=6)
    assert [t for e in short if isinstance(e, Delta) for t in e.tokens] == alone(engine, PROMPT, "spec:lookup+csv", max_tokens=30)


def test_prefill_chunks_beyond_the_budget_wait_for_the_next_step(engine):
    prompts = [" ".join(f"w{4 + (i * k) % 250}" for i in range(PREFILL_CHUNK + 50)) for k in (3, 5)]
    scheduler = Scheduler(engine)
    events = [[], []]
    for prompt, sink in zip(prompts, events):
        scheduler.submit(_job(sink, prompt=prompt, max_tokens=4))
    scheduler.step()
    assert scheduler.metrics.forward_rows == PREFILL_CHUNK  # one chunk: the second waits
    scheduler.step()
    assert scheduler.metrics.forward_rows == PREFILL_CHUNK + 50  # the first's rest: 50 + 256 would pass the budget
    scheduler.step()
    # the second's first chunk, and the first's first verify round (a few rows)
    assert 2 * PREFILL_CHUNK + 50 < scheduler.metrics.forward_rows <= 2 * PREFILL_CHUNK + 50 + SKINNY_MAX_ROWS
    for prompt, sink in zip(prompts, events):
        _until_finished(scheduler, sink)
        assert [t for e in sink if isinstance(e, Delta) for t in e.tokens] == alone(engine, prompt, "spec:lookup+csv", max_tokens=4)


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


def test_prompts_decoded_together_get_the_tokens_each_gets_alone(engine):
    prompts = [PROMPT, "w7 w8 w7 w8 w7", "w40 w41", "w3 w3 w3 w3 w3 w3", "w99"]
    plans = [engine.prepare(p, "spec:lookup+csv", SamplingParams(), 5 + 3 * i) for i, p in enumerate(prompts)]
    together = generate_together(engine, plans, max_batch=2)  # 2 at a time: the rest join as others end
    assert together == [alone(engine, p, "spec:lookup+csv", max_tokens=5 + 3 * i) for i, p in enumerate(prompts)]
    assert [len(tokens) for tokens in together] == [5, 8, 11, 14, 17]


def test_a_plan_the_scheduler_fails_is_raised_once_the_others_are_done(engine):
    plans = [engine.prepare(PROMPT, "spec:lookup+csv", SamplingParams(), 4),
             engine.prepare(PROMPT, "spec:eagle+csv", SamplingParams(), 4)]  # the tiny artifact has no draft head
    with pytest.raises(ValueError, match="drafter"):
        generate_together(engine, plans, max_batch=2)
