"""runtime serve: a request's tokens are the ones it gets alone, whatever else runs; the API's shapes."""

from __future__ import annotations


import httpx
import pytest

from factories import tiny_engine
from serve_factories import CHAT_TEMPLATE, alone, model_name, posted_in_one_batch, running, sse_payloads, wait_until

TARGET = "w5 w9 w31 w5 w9 w17"
# Concurrent others: prompts and lengths that differ from the target's and from each other.
OTHERS = [("w40 w41 w42", 30), ("w7 w7 w7 w7 w8 w9 w10 w11 w12", 9), ("hi w100", 41), ("w200 w3 w60 w61 w60", 17),
          ("w11", 25), ("w90 w91 w92 w93 w94 w95 w96 w97 w98 w99 w98 w97", 33), ("w50 w51 w50 w51", 12)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    engine = tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("serve"))
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    return engine


def _load(engine, url: str, scheduler, others: int, extra: dict) -> list[dict]:
    """The target request among `others` concurrent ones, all admitted in the same step; their answers."""
    bodies = [{"prompt": TARGET, "max_tokens": 24, **extra}]
    bodies += [{"prompt": p, "max_tokens": n, **extra} for p, n in OTHERS[:others]]
    for body in bodies:
        body.update(model=model_name(engine), return_token_ids=True)
    answers = posted_in_one_batch(url, scheduler, bodies)
    assert scheduler.metrics.peak_batch_size == len(bodies)  # they really ran together
    assert scheduler.metrics.peak_fused == len(bodies)  # in one forward
    assert scheduler.metrics.peak_head_fused == len(bodies)  # and one head call
    return answers


@pytest.mark.parametrize("extra", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}, {"temperature": 0.7, "top_p": 0.9,
                                   "seed": 5}], ids=["greedy", "sampled", "nucleus"])
def test_tokens_under_load_equal_the_tokens_alone(engine, extra):
    expected = alone(engine, TARGET, max_tokens=24, temperature=extra["temperature"], seed=extra.get("seed", 0),
                     top_p=extra.get("top_p", 1.0))
    others = [alone(engine, p, max_tokens=n, temperature=extra["temperature"], seed=extra.get("seed", 0),
                    top_p=extra.get("top_p", 1.0)) for p, n in OTHERS]
    for count in (0, 1, 3, 7):
        with running(engine, start=False) as (url, scheduler):
            answers = _load(engine, url, scheduler, count, extra)
        assert answers[0]["choices"][0]["token_ids"] == expected, f"with {count} others"
        for answer, tokens in zip(answers[1:], others):
            assert answer["choices"][0]["token_ids"] == tokens
    assert len(set(map(tuple, [expected, *others]))) == len(others) + 1  # distinct requests, not one answer repeated


@pytest.mark.parametrize("method", ["ar", "csv", "spec:layers:1", "spec:ngram:gamma=3+csv", "swarm:lookup:2+csv",
                                    "mjsd:layers:1:tau=0.5"])
def test_every_method_under_load_equals_its_run_alone(engine, method):
    expected = alone(engine, TARGET, method, max_tokens=24)
    if not method.startswith("mjsd"):  # greedy: every exact method says what ar says (mjsd is not exact by design)
        assert expected == alone(engine, TARGET, "ar", max_tokens=24)
    with running(engine, start=False) as (url, scheduler):
        answers = _load(engine, url, scheduler, 3, {"temperature": 0, "method": method})
    assert answers[0]["choices"][0]["token_ids"] == expected


def test_a_long_prompt_prefills_in_chunks_and_keeps_its_tokens(engine):
    prompt = " ".join(f"w{4 + (i * 7) % 250}" for i in range(700))  # three chunks of 256 tokens
    expected = alone(engine, prompt, max_tokens=12)
    with running(engine) as (url, scheduler):
        answer = httpx.post(url + "/v1/completions", json={"model": model_name(engine), "prompt": prompt, "max_tokens": 12,
                                                          "temperature": 0, "return_token_ids": True}, timeout=60).json()
    assert answer["choices"][0]["token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == engine.encode(prompt).numel() == 700


def test_completion_fields_usage_and_finish_reason(engine):
    tokens = alone(engine, TARGET, max_tokens=10)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    with running(engine) as (url, _):
        answer = httpx.post(url + "/v1/completions", json={"model": model_name(engine), "prompt": TARGET,
                                                          "max_tokens": 10, "temperature": 0}, timeout=60).json()
        stop = text.split()[3]
        stopped = httpx.post(url + "/v1/completions", json={"model": model_name(engine), "prompt": TARGET, "max_tokens": 10,
                                                           "temperature": 0, "stop": [stop, "w254 w254"]}, timeout=60).json()
    assert answer["object"] == "text_completion" and answer["model"] == model_name(engine)
    assert answer["choices"][0]["text"] == text and answer["choices"][0]["finish_reason"] == "length"
    prompt_tokens = engine.encode(TARGET).numel()
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 10, "total_tokens": prompt_tokens + 10}
    # A stop string ends the text before it (the API's rule), with finish_reason stop.
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]
    assert stopped["usage"]["completion_tokens"] < 10


def test_streaming_sends_chunks_then_usage_then_done(engine):
    tokens = alone(engine, TARGET, max_tokens=12)
    with running(engine) as (url, _):
        body = {"model": model_name(engine), "prompt": TARGET, "max_tokens": 12, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    usage, final, chunks = payloads[-2], payloads[-3], payloads[:-3]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    assert final["choices"][0]["finish_reason"] == "length"
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks) and len(chunks) > 1
    text = "".join(chunk["choices"][0]["text"] for chunk in payloads[:-2])
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_streams_the_role_first_and_equals_generate_chat(engine):
    tokens = alone(engine, "w5 w9 w31", max_tokens=10, chat=True)
    with running(engine) as (url, _):
        body = {"model": model_name(engine), "messages": [{"role": "user", "content": "w5 w9 w31"}], "max_tokens": 10,
                "temperature": 0}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
            payloads = sse_payloads(response)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert payloads[0]["object"] == "chat.completion.chunk" and payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads[:-1])
    assert streamed == text and payloads[-1] == "[DONE]"


def test_the_openai_client_streams_and_not(engine):
    openai = pytest.importorskip("openai")
    tokens = alone(engine, TARGET, max_tokens=8)
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    chat_text = engine.tokenizer.decode(alone(engine, "w5 w9", max_tokens=8, chat=True), skip_special_tokens=True)
    with running(engine, api_key="sesame") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sesame")
        assert [m.id for m in client.models.list()] == [model_name(engine)]
        done = client.completions.create(model=model_name(engine), prompt=TARGET, max_tokens=8, temperature=0)
        assert done.choices[0].text == text and done.usage.completion_tokens == 8
        streamed = client.completions.create(model=model_name(engine), prompt=TARGET, max_tokens=8, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == text
        chat = client.chat.completions.create(model=model_name(engine), messages=[{"role": "user", "content": "w5 w9"}],
                                              max_completion_tokens=8, temperature=0)
        assert chat.choices[0].message.content == chat_text
        stream = client.chat.completions.create(model=model_name(engine), messages=[{"role": "user", "content": "w5 w9"}],
                                                max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong").models.list()


def test_a_client_that_leaves_mid_stream_frees_its_slot(engine):
    with running(engine) as (url, scheduler):
        body = {"model": model_name(engine), "prompt": TARGET, "max_tokens": 1500, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert scheduler.active == 1
        wait_until(lambda: scheduler.active == 0, timeout=5)  # closed: cancelled at the next step
        assert scheduler.metrics.completion_tokens < 1500
        assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_metrics_count_requests_tokens_and_batch(engine):
    with running(engine) as (url, _):
        httpx.post(url + "/v1/completions", json={"model": model_name(engine), "prompt": TARGET, "max_tokens": 5,
                                                 "temperature": 0}, timeout=60)
        httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": TARGET}, timeout=60)
        text = httpx.get(url + "/metrics").text
    assert 'specvocab_requests_total{code="200"} 1' in text and 'specvocab_requests_total{code="404"} 1' in text
    assert "specvocab_generation_tokens_total 5" in text and "specvocab_batch_size_peak 1" in text
    assert "# TYPE specvocab_queue_length gauge" in text and "specvocab_acceptance_rate" in text
