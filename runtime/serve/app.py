"""The HTTP side: FastAPI routes for the OpenAI endpoints, over a Scheduler that runs elsewhere.

Every error is the API's {"error": {...}} object with its status (400 bad values, 401 bad key, 404
unknown route or model, 413 oversized body, 503 full queue or stopping, 504 timeout); an unexpected
exception is a 500 with a one-line message, its traceback in the server's log only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import sys
import traceback
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from runtime.api import Engine, Plan
from runtime.common.sampling import MAX_SEED, SamplingParams
from runtime.serve.protocol import APIError, ChatRequest, CompletionRequest, Sampled, Shape
from runtime.serve.scheduler import Delta, Failed, Finished, Job, Scheduler, check_servable

MAX_BODY_BYTES = 4 << 20  # a larger request body is refused (413) before it is parsed
TYPE_TAGS = {"int", "float", "str", "bool"}  # pydantic's names of a union's members in an error's location
DISCONNECT_POLL_S = 0.5  # a non-streaming request checks this often whether its client is still there


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class Guard:
    """ASGI middleware: the body-size limit, the API key, and the response count by status."""

    def __init__(self, app, scheduler: Scheduler, api_key: str | None, max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.scheduler, self.api_key, self.max_body = app, scheduler, api_key, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = self.scheduler.metrics

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                metrics.responded(message["status"])
            await send(message)

        refusal = self._refusal(scope)
        body, refusal = (b"", refusal) if refusal else await self._read(scope, receive)
        if refusal is not None:
            return await error_response(refusal)(scope, receive, counted)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, counted)

    def _refusal(self, scope) -> APIError | None:
        """401 without the key (/health needs none); 413 for a declared length over the limit."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' with "
                                     "the server's --api-key", code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body:
            return _too_large(self.max_body)
        return None

    async def _read(self, scope, receive) -> tuple[bytes, APIError | None]:
        """The whole body (chunked ones included), or 413 once it passes the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", None  # the client left: the app sees an empty body and a disconnect
            size += len(message.get("body", b""))
            if size > self.max_body:
                return b"", _too_large(self.max_body)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit >> 20} MiB; send a shorter prompt", code="body_too_large")


def create_app(scheduler: Scheduler, model_id: str, default_method: str, api_key: str | None = None,
               timeout_s: float = 600.0, max_body: int = MAX_BODY_BYTES, aliases: tuple[str, ...] = ()) -> Guard:
    """The ASGI app: the OpenAI routes on `scheduler`, serving `model_id` (or one of `aliases`) with
    `default_method` unless a request names its own."""
    app = FastAPI(title="specvocab", docs_url=None, redoc_url=None, openapi_url=None)
    served = {model_id, *aliases}

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        return error_response(_validation_error(error))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = {404: f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, "
                        "/v1/chat/completions, /health, /metrics",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, str(error.detail))
        return error_response(APIError(error.status_code, message, code="not_found" if error.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        traceback.print_exception(error, file=sys.stderr)
        return error_response(APIError(500, "internal server error (the server log has the traceback)", "server_error"))

    @app.get("/health")
    async def health():
        if scheduler.stopping:
            raise APIError(503, "the server is shutting down", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(scheduler.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "specvocab"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_id)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in served:
            raise _unknown_model(name, model_id)
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(body, body.prompt_value(), False, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await respond(body, body.conversation(), True, request)

    async def respond(body: Sampled, prompt, chat: bool, request: Request):
        body.check()
        if body.model not in served:
            raise _unknown_model(body.model, model_id)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the server's loop is closed: nobody is listening any more
                pass

        job = Job(_planner(body, prompt, chat, default_method), emit, timeout_s)
        if not scheduler.submit(job):
            if scheduler.stopping:
                raise APIError(503, "the server is shutting down", "server_error")
            raise APIError(503, f"the server's queue is full ({scheduler.max_queue} requests); retry later",
                           "server_error", code="queue_full")
        try:
            first = await events.get()  # planning takes one step: Started, or why the request is refused
        except asyncio.CancelledError:
            scheduler.cancel(job.id)
            raise
        if isinstance(first, Failed):
            raise _failure(first)
        shape = Shape(chat, body.model)
        if body.stream:
            return StreamingResponse(_stream(scheduler, job, events, shape, body), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(scheduler, job, events, shape, body, request)

    return Guard(app, scheduler, api_key, max_body)


def _planner(body: Sampled, prompt, chat: bool, default_method: str):
    """The Job's prepare: the request's values through Engine.prepare (run on the worker thread)."""
    temperature = 1.0 if body.temperature is None else body.temperature  # the API's default
    seed = secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed

    def prepare(engine: Engine) -> Plan:
        sampling = SamplingParams(temperature, 0 if body.top_k is None else body.top_k,
                                  1.0 if body.top_p is None else body.top_p)
        plan = engine.prepare(prompt, body.method or default_method, sampling, body.token_limit(), chat, None,
                              body.stops(), seed)
        check_servable(plan.spec)
        return plan

    return prepare


def _unknown_model(name: str, model_id: str) -> APIError:
    return APIError(404, f"model {name!r} is not served here; this server serves {model_id!r} (GET /v1/models)",
                    param="model", code="model_not_found")


def _failure(failed: Failed) -> APIError:
    return APIError(failed.status, failed.message, failed.kind)


def _validation_error(error: RequestValidationError) -> APIError:
    """The first schema error as one line naming the field (param: the top-level field)."""
    problems = error.errors()
    first = problems[0] if problems else {}
    # The field's path, without pydantic's union-member tags ('int', 'list[str]', 'function-after[...]').
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and str(part) not in TYPE_TAGS and "[" not in str(part)]
    param = loc[0] if loc else None
    kind = first.get("type")
    if kind == "json_invalid" or (kind == "missing" and param is None):
        return APIError(400, "the request body is not valid JSON; send a JSON object")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}; see the API's fields (docs/serving.md)", param=param)
    where = f"{'.'.join(loc)}: " if loc else "the request body: "
    return APIError(400, f"{where}{first.get('msg', 'invalid value')}", param=param)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(scheduler: Scheduler, job: Job, events: asyncio.Queue, shape: Shape, body: Sampled) -> AsyncIterator[str]:
    """SSE chunks until the finish chunk (then usage, if asked) and [DONE]; a client that leaves
    cancels this generator, and the job with it."""
    done = False
    try:
        if shape.chat:
            yield _sse(shape.chunk("", role=True))
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                if event.text or body.return_token_ids:
                    yield _sse(shape.chunk(event.text, tokens=list(event.tokens) if body.return_token_ids else None))
            elif isinstance(event, Finished):
                done = True
                yield _sse(shape.chunk(event.rest or None, event.reason, [] if body.return_token_ids else None))
                if body.include_usage:
                    yield _sse(shape.usage_chunk(event.prompt_tokens, event.completion_tokens))
                yield _sse("[DONE]")
                return
            elif isinstance(event, Failed):
                done = True
                yield _sse(_failure(event).body())
                yield _sse("[DONE]")
                return
    finally:
        if not done:
            scheduler.cancel(job.id)


async def _collect(scheduler: Scheduler, job: Job, events: asyncio.Queue, shape: Shape, body: Sampled,
                   request: Request) -> dict:
    """The whole response once it is over; a client that leaves meanwhile cancels the job."""
    tokens: list[int] = []
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job.id)
                    raise APIError(499, "the client closed the request") from None
                continue
            if isinstance(event, Delta):
                tokens.extend(event.tokens)
            elif isinstance(event, Finished):
                return shape.response(event.text, event.reason, event.prompt_tokens, event.completion_tokens,
                                      tokens if body.return_token_ids else None)
            elif isinstance(event, Failed):
                raise _failure(event)
    except asyncio.CancelledError:
        scheduler.cancel(job.id)
        raise
