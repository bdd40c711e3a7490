"""The scheduler: one worker thread decodes every admitted request, one fused target forward per step.

Requests join and leave the running batch between steps. Each request's decoding loop runs in a
Fiber (runtime.serve.fiber) on a ScheduledTarget (runtime.serve.batch): it runs until it needs a
target forward or LM-head call (runtime.heads.rowwise), hands it over and waits. A step resumes every
request whose last forward is done, runs the head calls they hand over (each head's calls as one call
over all their rows), resumes those, and finally runs the next piece of every waiting forward in ONE
forward over all their rows, each request on its own KV cache: one row for a plain decoding step, the
last token and the drafts for a verify round, a token tree's nodes, a chunk of a new request's prompt
(chunked prefill). Drafters run their own forwards in their request's turn.

Each request runs its method freshly built (a new drafter session and draft budget, as a new
`runtime generate` process starts with), on its own KV cache and its own seeded generator, and the
fused forward gives each row the bits its forward alone gives it (Decoder.forward_feeds), and a fused
head call its logits bit for bit or a sound bound (runtime.heads.rowwise), so its tokens are exactly the ones
it gets alone.

Threads: `run` belongs on the thread that loaded the model (runtime.loops.decode says why); it runs every
target forward. The fibers take turns with it, never beside it. The HTTP side calls `submit` and
`cancel` from its event loop and gets each request's events through `emit`.
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
from runtime.methods import METHODS, MethodSpec, build_method
from runtime.serve.metrics import Metrics
from runtime.heads.rowwise import RowCall, posting, run_calls
from runtime.serve.batch import Forward, ScheduledTarget, fusable, run_step
from runtime.serve.fiber import Fiber
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
    """An admitted request: its decoding loop in a fiber, the forward it waits for, and the text sent so far."""

    def __init__(self, engine: Engine, job: Job, plan: Plan) -> None:
        self.job, self.plan = job, plan
        engine.method(plan.spec)  # built once on the session too: bounds and stages it reads stay cached there
        self._engine = engine
        # Without a verifier the drafter decodes alone on its own copy: no target forward to schedule.
        self.scheduled = isinstance(engine.session.target, DecoderTarget) and plan.spec.verifier
        self.fiber = Fiber(self._decode, f"specvocab-request-{job.id}")
        self.waiting: Forward | RowCall | None = None  # the target forward or head call the loop handed over
        self.text = TextDeltas(engine.tokenizer, plan.stops.stops if plan.stops else ())
        self.stats = None
        self._new: list[int] = []  # tokens appended since the last advance

    @property
    def ready(self) -> bool:
        """Whether the loop can go on: nothing handed over, or it is done."""
        return self.waiting is None or self.waiting.done

    @property
    def calling(self) -> bool:
        """Whether the loop waits for a head call (runtime.heads.rowwise) not run yet."""
        return isinstance(self.waiting, RowCall) and not self.waiting.done

    def _decode(self, suspend) -> tuple[list[int], object]:
        """The fiber's body: the request's token stream to its end, its target forwards and head calls
        (runtime.heads.rowwise) handed to the scheduler."""
        session = self._engine.session
        if self.scheduled:
            session = replace(session, target=ScheduledTarget(session.target, suspend))
        stream = self.plan.stream(build_method(session, self.plan.spec))
        with posting(suspend):
            try:
                while True:
                    try:
                        token = next(stream)  # may suspend: the scheduler swaps _new meanwhile
                    except StopIteration as done:
                        return done.value
                    self._new.append(token)
                    if not self.scheduled:  # a loop the scheduler does not step: one token per turn
                        suspend(None)
            finally:
                stream.close()

    def advance(self) -> list[Event]:
        """Resume the loop (with its forward's hidden states) until it hands over the next forward or ends:
        a Delta per new token, then Finished when it ended."""
        self.waiting = self.fiber.resume()
        if self.fiber.error is not None:
            raise self.fiber.error
        new, self._new = self._new, []
        events: list[Event] = [Delta(self.text.add(token), (token,)) for token in new]
        if self.fiber.done:
            tokens, self.stats = self.fiber.result
            events.append(self._finished(tokens))
        return events

    def _finished(self, tokens: list[int]) -> Finished:
        plan = self.plan
        eos = bool(tokens) and tokens[-1] in self._engine.session.target.eos_token_ids
        stopped = eos or (plan.stops is not None and plan.stops.hit(tokens))
        rest = self.text.finish()
        return Finished("stop" if stopped else "length", plan.ids.numel(), len(tokens), self.text.text, rest)

    def close(self) -> None:
        self.fiber.close()


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
        """Decode (on the session's threads) until stop() (or until keep_going() is false); then fail
        whatever is left, as stopping."""
        try:
            with self.engine.session.decoding():
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
        """Take new jobs, drop cancelled and expired ones, admit waiting ones, resume every one whose
        forward is done, then run one fused forward over the pieces of every forward handed over."""
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
        ready = [s for s in self._active if s.ready]
        while ready:  # resume; run the head calls they hand over (fused), resume those; until all wait for forwards
            for sequence in ready:
                for event in self._advance(sequence):
                    produced += isinstance(event, Delta)
                    sequence.job.emit(event)
                    if isinstance(event, (Finished, Failed)):
                        self._active.remove(sequence)
                        sequence.close()
            calling = [s for s in self._active if s.calling]
            self.metrics.head_calls(run_calls([s.waiting for s in calling], fusable()))
            ready = calling
        waiting = [s.waiting for s in self._active if isinstance(s.waiting, Forward) and not s.waiting.done]
        started = time.perf_counter()
        rows, fused = run_step(waiting) if waiting else (0, 0)
        self.metrics.step(produced, self._pending, len(self._active), rows, fused, time.perf_counter() - started)

    def _advance(self, sequence: Sequence) -> list[Event]:
        """sequence.advance(), with an error turned into a Failed for its client (an unexpected one logged here)."""
        try:
            events = sequence.advance()
        except ValueError as e:
            return [Failed(400, str(e))]
        except Exception:  # noqa: BLE001 - one request's bug must not stop the others
            traceback.print_exc(file=sys.stderr)
            return [Failed(500, "internal error while decoding this request (the server log has the traceback)",
                           "server_error")]
        if events and isinstance(events[-1], Finished) and sequence.stats is not None:
            spec = sequence.stats.spec
            self.metrics.finished(events[-1].prompt_tokens, spec.drafted if spec else 0, spec.accepted if spec else 0)
        return events

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
