"""runtime serve's bad inputs over plain HTTP: each gets its status and the API's JSON error object, and
the server keeps answering."""

from __future__ import annotations

import httpx
import pytest

from factories import tiny_engine
from serve_factories import model_name, running, wait_until


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("serve-errors"))


@pytest.fixture(scope="module")
def server(engine):
    with running(engine, max_body=64 << 10, api_key="sesame") as (url, scheduler):
        yield url, scheduler


KEY = {"Authorization": "Bearer sesame"}


def _body(engine, **fields) -> dict:
    return {"model": model_name(engine), "prompt": "w5 w9 w31", "max_tokens": 4, "temperature": 0, **fields}


# (name, path, body or raw bytes, status, words the message holds, param)
CASES = [
    ("negative temperature", {"temperature": -1}, 400, "temperature", None),
    ("temperature as text", {"temperature": "hot"}, 400, "temperature", "temperature"),
    ("top_p above 1", {"temperature": 1, "top_p": 1.5}, 400, "top_p", None),
    ("top_k with greedy", {"top_k": 5}, 400, "top_k", None),
    ("negative top_k", {"temperature": 1, "top_k": -2}, 400, "top_k", None),
    ("zero max_tokens", {"max_tokens": 0}, 400, "max_new_tokens", None),
    ("fractional max_tokens", {"max_tokens": 2.5}, 400, "max_tokens", "max_tokens"),
    ("negative seed", {"seed": -1}, 400, "seed", None),
    ("huge seed", {"seed": 2**64}, 400, "seed", None),
    ("n of 2", {"n": 2}, 400, "n must be 1", "n"),
    ("unknown field", {"temprature": 0.5}, 400, "unknown field", "temprature"),
    ("unknown method", {"method": "warp-drive"}, 400, "unknown method", None),
    ("reference method", {"method": "llamacpp"}, 400, "not served", None),
    ("bad gamma", {"method": "spec:ngram:gamma=99"}, 400, "gamma", None),
    ("empty prompt", {"prompt": ""}, 400, "empty", None),
    ("several prompts", {"prompt": ["w5", "w6"]}, 400, "one per request", "prompt"),
    ("id outside the vocabulary", {"prompt": [5, 9, 100000]}, 400, "outside the model's vocabulary", None),
    ("prompt beyond the context", {"prompt": [5] * 3000}, 400, "context", None),
    ("empty stop", {"stop": ""}, 400, "stop", None),
    ("five stops", {"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4", "stop"),
    ("stop as a number", {"stop": 7}, 400, "stop", "stop"),
    ("penalty", {"presence_penalty": 0.5}, 400, "not supported", "presence_penalty"),
    ("logprobs", {"logprobs": 3}, 400, "not supported", "logprobs"),
    ("stream options without stream", {"stream_options": {"include_usage": True}}, 400, "stream", "stream_options"),
    ("stream as text", {"stream": "yes"}, 400, "stream", "stream"),
    ("unknown model", {"model": "gpt-7"}, 404, "not served", "model"),
    ("lone surrogate in the prompt", {"prompt": "w5 \ud800"}, 400, "surrogate", None),
]


@pytest.mark.parametrize("fields, status, says, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_completion_field_is_an_api_error(engine, server, fields, status, says, param):
    url, _ = server
    body = _body(engine, **fields)
    if fields.get("prompt") == "w5 \ud800":  # not encodable by json=: send the escape itself
        response = httpx.post(url + "/v1/completions", content=httpx.Request("POST", url, json=_body(engine)).content
                              .replace(b'"w5 w9 w31"', b'"w5 \\ud800"'), headers={**KEY, "Content-Type": "application/json"})
    else:
        response = httpx.post(url + "/v1/completions", json=body, headers=KEY, timeout=30)
    _assert_error(response, status, says, param)


def _assert_error(response: httpx.Response, status: int, says: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says.lower() in error["message"].lower(), error["message"]
    assert "Traceback" not in error["message"] and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("raw, says", [(b"{not json", "not valid JSON"), (b"[1, 2]", "request body"),
                                       (b"", "not valid JSON"), (b'{"model": "x"}', "prompt")],
                         ids=["malformed", "array", "empty", "missing prompt"])
def test_a_malformed_body_is_400(server, raw, says):
    url, _ = server
    response = httpx.post(url + "/v1/completions", content=raw, headers={**KEY, "Content-Type": "application/json"})
    _assert_error(response, 400, says)


def test_chat_errors(engine, server):
    url, _ = server
    base = {"model": model_name(engine), "max_tokens": 4}
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
             ({"messages": [{"role": "user", "content": "hi"}]}, "chat template"),
             ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "max_completion_tokens": 5}, "differ")]
    for fields, says in cases:
        _assert_error(httpx.post(url + "/v1/chat/completions", json={**base, **fields}, headers=KEY), 400, says)


def test_auth_routes_and_sizes(engine, server):
    url, _ = server
    _assert_error(httpx.post(url + "/v1/completions", json=_body(engine)), 401, "api key")
    _assert_error(httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "api key")
    _assert_error(httpx.get(url + "/metrics"), 401, "api key")
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # no key needed
    _assert_error(httpx.get(url + "/v1/nothing", headers=KEY), 404, "no route")
    _assert_error(httpx.get(url + "/v1/models/gpt-7", headers=KEY), 404, "not served")
    _assert_error(httpx.get(url + "/v1/completions", headers=KEY), 405, "not allowed")
    big = {**_body(engine), "prompt": "w5 " * 40_000}  # 120 kB against the test server's 64 kB
    _assert_error(httpx.post(url + "/v1/completions", json=big, headers=KEY), 413, "body")

    def chunked():  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"w5 " * 300
        yield b'"}'

    _assert_error(httpx.post(url + "/v1/completions", content=chunked(), headers=KEY), 413, "body")
    answer = httpx.post(url + "/v1/completions", json=_body(engine), headers=KEY, timeout=30)  # nothing else disturbed
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_a_full_queue_is_503_and_a_timeout_504(engine):
    with running(engine, start=False, max_queue=1, timeout_s=0.0) as (url, scheduler):
        import threading

        first: list = []
        waiting = threading.Thread(target=lambda: first.append(httpx.post(url + "/v1/completions", json=_body(engine),
                                                                          timeout=30)))
        waiting.start()
        wait_until(lambda: scheduler.pending == 1)
        _assert_error(httpx.post(url + "/v1/completions", json=_body(engine)), 503, "queue is full")
        scheduler.start()
        waiting.join()
    _assert_error(first[0], 504, "timeout")
