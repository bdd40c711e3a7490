"""The scheduler: one worker thread decodes every admitted request, interleaved at round boundaries.

Requests join and leave the running batch between steps. A step feeds one prefill chunk to each
request still prefilling (runtime.serve.prefill) and advances every other one by one token of its own
decoding loop, which runs one draft-and-verify round (or one plain step) when it needs a new token.
Each request runs its method freshly built (a new drafter session and draft budget, as a new
`runtime generate` process starts with), on its own KV cache and its own seeded generator, so its
tokens are exactly the ones it gets alone: nothing it computes reads another request's state.

This is the first version: sequences are interleaved, each forward serves one request. Fusing the
rows of several requests into one target forward needs a decoder call over several caches and loops
that hand their forwards to the scheduler instead of making them (docs/serving.md, "Batching").

Threads: `run` belongs on the thread that loaded the model (runtime.decode says why); the HTTP side
calls `submit` and `cancel` from its event loop and gets each request's events through `emit`.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from runtime.api import Engine, Plan
from runtime.backends.target import DecoderTarget
from runtime.decode import TokenStream
from runtime.method_builders import build_method
from runtime.methods import METHODS, MethodSpec
from runtime.serve.metrics import Metrics
from runtime.serve.prefill import ChunkedPrefill, PrefilledTarget
from runtime.serve.text import TextDeltas

IDLE_WAIT_S = 0.05  # with nothing to decode, the worker waits this long for a new request


def check_servable(spec: MethodSpec) -> None:
    """Refuse a method the server does not run: another program's decoder (llamacpp, a bench reference,
    loaded anew per request and not this project's exact output) or a bench-only one."""
    if spec.name == "llamacpp" or METHODS[spec.name].bench_only:
        raise ValueError(f"{spec} is a reference decoder for runtime bench, not served; name one of this project's "
                         "methods (e.g. spec:lookup+csv)")


@dataclass(frozen=True)
class Started:
    """The request was checked and encoded; it waits for, or has, a slot."""

    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    """New response text and the tokens that made it (the text may be '' while it could be a stop)."""

    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """The response is over: why (stop or length), and the token counts the API's usage reports."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str  # the whole response text
    rest: str  # the text not sent in a Delta yet (held back while it could have begun a stop string)


@dataclass(frozen=True)
class Failed:
    """The request ended with an error: an HTTP status and a one-line message."""

    status: int
    message: str
    kind: str = "invalid_request_error"


Event = Started | Delta | Finished | Failed


@dataclass(eq=False)
class Job:
    """One request as the HTTP side hands it over: how to plan it, where its events go, when it expires."""

    prepare: Callable[[Engine], Plan]  # runs on the worker thread (it tokenizes)
    emit: Callable[[Event], None]  # thread-safe
    timeout_s: float
    id: int = 0
    submitted: float = 0.0


class Sequence:
    """An admitted request: its chunked prefill, then its token stream, and the text sent so far."""

    def __init__(self, engine: Engine, job: Job, plan: Plan) -> None:
        self.job, self.plan = job, plan
        target = engine.session.target
        # Without a verifier the drafter decodes alone on its own copy: nothing to prefill on the target.
        chunked = isinstance(target, DecoderTarget) and plan.spec.verifier
        self.prefill = ChunkedPrefill(target, plan.ids) if chunked else None
        engine.method(plan.spec)  # built once on the session too: bounds and stages it reads stay cached there
        self._engine = engine
        self.stream: TokenStream | None = None
        self.text = TextDeltas(engine.tokenizer, plan.stops.stops if plan.stops else ())
        self.stats = None

    def advance(self) -> Event | None:
        """One step: a prefill chunk, or the next token; an event for the client, or None (a chunk fed)."""
        if self.prefill is not None and not self.prefill.done:
            self.prefill.step()
            return None
        if self.stream is None:
            session = self._engine.session
            if self.prefill is not None:  # the loop resumes after the chunks already in the cache
                session = replace(session, target=PrefilledTarget(session.target, self.prefill.cache))
            self.stream = self.plan.stream(build_method(session, self.plan.spec))
        try:
            token = next(self.stream)
        except StopIteration as done:
            tokens, self.stats = done.value
            return self._finished(tokens)
        return Delta(self.text.add(token), (token,))

    def _finished(self, tokens: list[int]) -> Finished:
        plan = self.plan
        eos = bool(tokens) and tokens[-1] in self._engine.session.target.eos_token_ids
        stopped = eos or (plan.stops is not None and plan.stops.hit(tokens))
        rest = self.text.finish()
        return Finished("stop" if stopped else "length", plan.ids.numel(), len(tokens), self.text.text, rest)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class Scheduler:
    """Admits up to `max_batch` requests at once, queues up to `max_queue` more, and decodes them."""

    def __init__(self, engine: Engine, max_batch: int = 8, max_queue: int = 64, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.max_batch, self.max_queue = max_batch, max_queue
        self.metrics = metrics or Metrics()
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[tuple[Job, Plan]] = deque()
        self._active: list[Sequence] = []
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet admitted (inbox + waiting)
        self._cancelled: set[int] = set()
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the HTTP side (any thread) -------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue a job (it gets an id); False when the queue is full or the server is stopping."""
        with self._lock:
            if self._stopping.is_set() or self._pending >= self.max_queue:
                return False
            self._pending += 1
            job.id, job.submitted = next(self._ids), time.monotonic()
        self._inbox.put(job)
        return True

    def cancel(self, job_id: int) -> None:
        """Drop a job (its client went away): its slot is free after the current step."""
        with self._lock:
            self._cancelled.add(job_id)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def pending(self) -> int:
        """Requests submitted and not admitted yet (planned or not)."""
        with self._lock:
            return self._pending

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return len(self._active)

    # --- the worker -----------------------------------------------------------------------------

    def run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Decode until stop() (or until keep_going() is false); then fail whatever is left, as stopping."""
        try:
            while not self._stopping.is_set() and keep_going():
                self.step()
        finally:
            self._stopping.set()
            self._fail_all(Failed(503, "the server is shutting down; retry on another server", "server_error"))

    def start(self) -> threading.Thread:
        """run() on a daemon thread (tests, and servers whose model thread is busy elsewhere)."""
        self._thread = threading.Thread(target=self.run, name="specvocab-scheduler", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Refuse new jobs and end run() after the current step; waits for a thread start() began."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def step(self) -> None:
        """Take new jobs, drop cancelled and expired ones, admit waiting ones, and advance every active one."""
        self._take_new(block=not self._active and not self._waiting)
        self._drop_cancelled()
        while self._waiting and len(self._active) < self.max_batch:
            job, plan = self._waiting.popleft()
            with self._lock:
                self._pending -= 1
            try:
                self._active.append(Sequence(self.engine, job, plan))
            except ValueError as e:  # a method the session cannot build (a missing stage, ...)
                job.emit(Failed(400, str(e)))
        produced = 0
        for sequence in list(self._active):
            event = self._advance(sequence)
            if isinstance(event, Delta):
                produced += 1
            if event is not None:
                sequence.job.emit(event)
            if isinstance(event, (Finished, Failed)):
                self._active.remove(sequence)
                sequence.close()
        self.metrics.step(produced, self._pending, len(self._active))

    def _advance(self, sequence: Sequence) -> Event | None:
        """sequence.advance(), with an unexpected error turned into a 500 for its client (logged here)."""
        try:
            event = sequence.advance()
        except ValueError as e:
            return Failed(400, str(e))
        except Exception:  # noqa: BLE001 - one request's bug must not stop the others
            traceback.print_exc(file=sys.stderr)
            return Failed(500, "internal error while decoding this request (the server log has the traceback)",
                          "server_error")
        if isinstance(event, Finished) and sequence.stats is not None:
            spec = sequence.stats.spec
            self.metrics.finished(event.prompt_tokens, spec.drafted if spec else 0, spec.accepted if spec else 0)
        return event

    def _take_new(self, block: bool) -> None:
        """Plan every job in the inbox (a bad request fails here, before it waits for a slot)."""
        try:
            job = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                plan = job.prepare(self.engine)
            except (ValueError, TypeError) as e:
                with self._lock:
                    self._pending -= 1
                job.emit(Failed(400, str(e)))
            else:
                job.emit(Started(plan.ids.numel()))
                self._waiting.append((job, plan))
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drop_cancelled(self) -> None:
        """Remove cancelled jobs and fail expired ones, waiting or active."""
        now = time.monotonic()
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()

        def expired(job: Job) -> bool:
            return now - job.submitted > job.timeout_s

        for job, plan in list(self._waiting):
            if job.id in cancelled or expired(job):
                self._waiting.remove((job, plan))
                with self._lock:
                    self._pending -= 1
                if job.id not in cancelled:
                    job.emit(_timed_out(job))
        for sequence in list(self._active):
            job = sequence.job
            if job.id in cancelled or expired(job):
                self._active.remove(sequence)
                sequence.close()
                if job.id not in cancelled:
                    job.emit(_timed_out(job))

    def _fail_all(self, failure: Failed) -> None:
        """Fail every job not finished yet: in the inbox, waiting, or active."""
        while True:
            try:
                self._waiting.append((self._inbox.get_nowait(), None))
            except queue.Empty:
                break
        for job, _ in self._waiting:
            job.emit(failure)
        for sequence in self._active:
            sequence.close()
            sequence.job.emit(failure)
        self._waiting.clear()
        self._active.clear()
        with self._lock:
            self._pending = 0


def _timed_out(job: Job) -> Failed:
    return Failed(504, f"the request took longer than the server's timeout of {job.timeout_s:g} s; ask for fewer "
                       "tokens (max_tokens) or retry when the server is less busy", "timeout")
