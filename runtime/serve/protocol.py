"""The OpenAI API's bodies as the server reads and writes them: requests, responses, chunks, errors.

Values are checked once, by the runtime (Engine.prepare, SamplingParams: the checks the CLI's
options use too); the models here check only the JSON shapes, and refuse unknown fields as the
API does, so a misspelt field is an error instead of a silently ignored one.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat  # JSON numbers; "0.5" or true are not numbers
DEFAULT_COMPLETION_TOKENS = 16  # the API's default max_tokens for /v1/completions
DEFAULT_CHAT_TOKENS = 256  # chat has no default in the API (the context's room); a bounded one here
MAX_STOPS = 4  # the API takes at most four stop sequences


class APIError(Exception):
    """An error the API reports as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class Sampled(_Body):
    """The fields completions and chat share."""

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None  # the API's default is 1
    top_p: Number | None = None
    top_k: StrictInt | None = None  # an extra field (0 = off)
    seed: StrictInt | None = None  # none: a fresh random seed, as the API samples differently each call
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    method: StrictStr | None = None  # an extra field: a name in runtime.methods' grammar (default: the server's)
    return_token_ids: StrictBool = False  # an extra field, as vLLM's: the choice carries its token ids
    user: StrictStr | None = None  # accepted and not used
    presence_penalty: Number = 0
    frequency_penalty: Number = 0
    logprobs: StrictBool | StrictInt | None = None

    def check(self) -> None:
        """Refuse what the server does not do (several choices, penalties, log-probabilities): 400."""
        if self.n != 1:
            raise APIError(400, f"n must be 1 (one choice per request), got {self.n}; send n requests instead", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (it would change what the model says); drop it or "
                                    "send 0", param=name)
        if self.logprobs:
            raise APIError(400, "logprobs is not supported; drop it", param="logprobs")
        stops = self.stops()
        if len(stops) > MAX_STOPS:
            raise APIError(400, f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options goes with stream: true", param="stream_options")

    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampled):
    """POST /v1/completions."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def check(self) -> None:
        super().check()
        if self.echo or self.suffix:
            raise APIError(400, "echo and suffix are not supported; drop them", param="echo" if self.echo else "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise APIError(400, f"prompt holds {len(self.prompt)} prompts; send one per request", param="prompt")

    def prompt_value(self) -> str | list[int]:
        """The prompt as Engine.prepare takes it: text, or token ids."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt

    def token_limit(self) -> int:
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampled):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    def check(self) -> None:
        super().check()
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens")

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def token_limit(self) -> int:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return DEFAULT_CHAT_TOKENS if limit is None else limit


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shape:
    """The response and chunk bodies of one endpoint (text completion or chat), for one request."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def response(self, text: str, reason: str, prompt_tokens: int, completion_tokens: int,
                 tokens: list[int] | None = None) -> dict:
        """The whole response (stream: false); `tokens`: the choice's token ids, where asked for."""
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if tokens is not None:
            choice["token_ids"] = tokens
        return self._envelope(self.object, [choice], usage=usage(prompt_tokens, completion_tokens))

    def chunk(self, text: str | None, reason: str | None = None, tokens: list[int] | None = None,
              role: bool = False) -> dict:
        """One streamed chunk: new text, or the finish reason (chat: the first chunk carries the role)."""
        choice: dict = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if tokens is not None:
            choice["token_ids"] = tokens
        return self._envelope(f"{self.object}.chunk" if self.chat else self.object, [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return self._envelope(f"{self.object}.chunk" if self.chat else self.object, [],
                              usage=usage(prompt_tokens, completion_tokens))
