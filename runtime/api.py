"""The Python API (the one `runtime generate` and `runtime bench` call): a model plus its artifact, then
generate with any method of the grammar in runtime.methods, streaming tokens, or bench methods side by side.

    from runtime import api
    from runtime.common.sampling import SamplingParams

    engine = api.load("art/g270")                   # the artifact and the model it was built for
    engine.generate("def fib(n):").text             # the fastest exact method (Engine.default_method)
    run = engine.generate("def fib(n):", method="spec:int8+csv", max_new_tokens=64)
    for token in run:                               # token ids, as the loop appends them
        ...
    print(run.text, run.stats.tokens_per_s)         # after the last token
    print(run.note)                                 # set when max_new_tokens was lowered to fit the context
    chat = api.load("art/qwen")                     # an instruct model with a chat template (gemma3-270m has none)
    chat.generate("Tell me a joke.", chat=True, sampling=SamplingParams(temperature=0.7)).text
    record = engine.bench(["ar", "csv", "spec:int8"], ["def fib(n):", "class Stack:"], max_new_tokens=32)
    two = api.load("art/g270", threads=2)           # this session decodes on 2 threads (None: set_threads' default)
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from runtime.common.checks import first_surrogate, require, require_count
from runtime.common.sampling import MAX_SEED, MIN_RESPONSE_TOKENS, SamplingParams
from runtime.common.stats import DecodeStats
from runtime.kernels import set_decoding_threads
from runtime.kernels.build import usable_cores
from runtime.loops.decode import TokenStream
from runtime.methods import METHODS, Method, MethodSpec, build_method, check_distinct, default_method, parse_method
from runtime.text.prompting import encode_prompt
from runtime.session import Session, open_session
from runtime.text.stopping import StopStrings

# A prompt longer than this many characters per token of the model's context is refused before it is
# tokenized (tokenizing 10 MB of text takes ~8 s and ~1.5 GB); real text averages 3-5 characters per token.
MAX_CHARS_PER_TOKEN = 64


def set_threads(threads: int | None = None) -> int:
    """Set the process default of decoding threads and return their count: what sessions loaded without
    `threads` (load) and everything outside a session decode with; `runtime --threads` sets it.

    `threads`: 1 up to the cores this process may run on, used in every parallel region; None: every
    one of those cores, the kernels leaving the extra ones alone while their workers wait for a core
    (another process holds one: docs/contention.md). Outputs are the same bits either way. torch's ops
    between the kernels run on one thread (runtime.kernels.set_decoding_threads says why).
    """
    count = usable_cores() if threads is None else _thread_count(threads)
    set_decoding_threads(count, threads is None)
    return count


def _thread_count(threads) -> int:
    """`threads` as a count of the cores this process may use, or a one-line ValueError."""
    return require_count("threads", threads, 1, usable_cores(), " (the cores this process may use)")


def as_method_spec(method: str | MethodSpec) -> MethodSpec:
    """A method name in the grammar of runtime.methods, parsed (a MethodSpec is returned as it is)."""
    if isinstance(method, MethodSpec):
        return method
    if not isinstance(method, str):
        raise TypeError(f"a method is a name in the grammar of runtime.methods (e.g. 'csv', 'spec:int8+csv') or a "
                        f"MethodSpec, got {method!r}")
    return parse_method(method)


def check_sampling(sampling: SamplingParams, specs: Sequence[MethodSpec]) -> None:
    """Refuse `sampling` unless it is a SamplingParams whose epsilon, if set, one of `specs` uses.

    Only csv's certified head samples within total variation epsilon; every other method would ignore it.
    No specs: the default method, which is not csv.
    """
    if not isinstance(sampling, SamplingParams):
        raise TypeError("sampling must be a runtime.common.sampling.SamplingParams, e.g. SamplingParams(temperature=0.7), "
                        f"got {sampling!r}")
    if sampling.epsilon is not None and not any(spec.name == "csv" for spec in specs):
        names = ", ".join(spec.text or str(spec) for spec in specs) or "the default method"
        raise ValueError(f"epsilon (--epsilon) applies to method csv only (its certified head), not {names}; "
                         "drop epsilon or run csv")


def _listed(value, name: str) -> list:
    """`value` as a list; a bare string is one item, never a sequence of characters."""
    if isinstance(value, str):
        return [value]
    require(isinstance(value, Iterable), name, "a string or a list", value)
    return list(value)


def _check_counts(max_new_tokens, seed) -> tuple[int, int]:
    """The integer arguments generate and bench share, as Python ints (a numpy integer reaches neither
    torch's manual_seed nor the bench's JSON record); a one-line ValueError when one is not in range."""
    return require_count("max_new_tokens", max_new_tokens, 1), require_count("seed", seed, 0, MAX_SEED)


def _response_guard(min_response_tokens, chat: bool) -> int:
    """How many response tokens may not be EOS: min_response_tokens (None: MIN_RESPONSE_TOKENS) with chat,
    0 without, where a number given would be ignored and is refused."""
    if min_response_tokens is None:
        return MIN_RESPONSE_TOKENS if chat else 0
    count = require_count("min_response_tokens", min_response_tokens, 0, why=" (0 = off)")
    require(chat, "min_response_tokens", "left at None without chat=True (it guards a chat response's first "
            "tokens); set chat=True or drop it", min_response_tokens)
    return count


def _check_unicode(name: str, text: str) -> None:
    """A one-line ValueError when `text` holds a lone surrogate (first_surrogate)."""
    bad = first_surrogate(text)
    if bad is not None:
        raise ValueError(f"{name} holds a lone surrogate {text[bad]!r} at character {bad}, not text a "
                         "tokenizer encodes; decode its bytes as UTF-8 (errors='replace' keeps the rest)")


def _check_path(name: str, value, what: str) -> None:
    """A TypeError unless `value` is a non-empty str or path (an empty one would read as the current folder,
    or as no model at all)."""
    if not (isinstance(value, (str, os.PathLike)) and os.fspath(value)):
        raise TypeError(f"{name} is {what}, a non-empty str or Path; got {value!r:.80}")


def load(artifact: str | Path, model: str | None = None, backend: str = "auto", threads: int | None = None,
         progress: bool = True, chat: bool = False) -> "Engine":
    """Open ART and load its model (or `model`, whose fingerprint must match) on `backend`.

    threads: the session decodes on that many threads (1 up to the cores this process may use), set
    around each of its calls and put back after; None: the process default (set_threads).
    chat: prompts will be wrapped in the chat template, so a model without one is refused before it loads.
    """
    _check_path("artifact", artifact, "the path of an artifact directory")
    if model is not None:
        _check_path("model", model, "a packaged name, a model directory or a .gguf path (None: the artifact's own)")
    if threads is not None:
        threads = _thread_count(threads)
    require(isinstance(progress, bool), "progress", "True or False", progress)
    require(isinstance(chat, bool), "chat", "True or False", chat)
    return Engine(open_session(artifact, model, progress=progress, backend=backend, chat=chat, threads=threads))


class Engine:
    """A session plus the methods built on it (once per method, whatever its spelling; reused across calls)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._methods: dict[MethodSpec, Method] = {}  # as spelled; two spellings of a method share its stream

    @property
    def tokenizer(self):
        return self.session.tokenizer

    def method(self, method: str | MethodSpec) -> Method:
        """The built Method for a name in the grammar of runtime.methods (or a parsed MethodSpec).

        Built once per method: two spellings of one (spec:lookup+csv, spec:lookup+csv:screen) share
        its stream, and so its drafter's session and draft budget; each keeps its own name."""
        spec = as_method_spec(method)
        if spec not in self._methods:
            same = replace(spec, text="")
            built = next((m for m in self._methods.values() if replace(m.spec, text="") == same), None)
            if built is None:
                with self.session.decoding():
                    self._methods[spec] = build_method(self.session, spec)
            else:
                self._methods[spec] = replace(built, name=str(spec), spec=spec)
        return self._methods[spec]

    def _fresh(self, method: Method) -> Method:
        """A new build of `method` (a new drafter session and draft budget); a reference run by another
        program (llama.cpp) as it is, since it keeps no session of ours."""
        if METHODS[method.spec.name].bench_only:
            return method
        return build_method(self.session, method.spec)  # named str(spec), as Engine.method names it

    def default_method(self, serving: bool = False) -> MethodSpec:
        """The method generate runs when none is named: the fastest exact one this artifact (its
        screening stages, its draft head) and CPU allow (runtime.methods.default_method).

        serving: the server's default instead, which drafts by lookup with a head too: the head drafts
        for each request apart, outside the fused forward, and under load that cost more than it gained
        (docs/serving.md#the-default-method-under-load)."""
        return default_method(self.session.best_bound(), self.session.has_draft_head() and not serving)

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (its config's max_position_embeddings; None if it has none)."""
        return getattr(self.session.model.config, "max_position_embeddings", None)

    def encode(self, prompt: str | Sequence[int] | torch.Tensor | list[dict], chat: bool = False) -> torch.Tensor:
        """Token ids [P] of a prompt given as text (with chat=True through the chat template, which also
        takes a list of {"role", "content"} messages) or as ids.

        A prompt that leaves no room in the model's context for one new token is a ValueError giving its
        token count and the limit (a very long text is refused before it is tokenized); so is an id
        outside the model's vocabulary, empty text, text that holds a lone surrogate, and a batch of several prompts."""
        require(isinstance(chat, bool), "chat", "True or False", chat)
        limit = self.context_length
        if chat and _is_messages(prompt):
            _check_length(sum(len(message["content"]) for message in prompt), limit)
            for message in prompt:
                _check_unicode(f"a {message['role']} message", message["content"])
            ids = encode_prompt(self.tokenizer, [dict(message) for message in prompt], chat)
        elif isinstance(prompt, str):
            _check_length(len(prompt), limit)
            if not prompt:  # a tokenizer that adds BOS would otherwise decode from BOS alone
                raise ValueError("the prompt is empty text; give some text (or token ids: [BOS] alone starts from "
                                 "nothing)")
            _check_unicode("the prompt", prompt)
            ids = encode_prompt(self.tokenizer, prompt, chat)
        elif chat:
            raise ValueError("chat=True wraps prompt text (one user turn) or a list of {'role': str, 'content': str} "
                             f"messages in the chat template; got {prompt!r:.80}")
        else:
            ids = _token_ids(prompt)
        if ids.numel() == 0:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.session.target.vocab_size
        outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
        if outside.numel():
            raise ValueError(f"token id {int(ids[outside[0]])} (position {int(outside[0])}) is outside the model's "
                             f"vocabulary of {vocab} tokens; give ids in 0..{vocab - 1}")
        self.room(ids.numel())
        return ids

    def room(self, prompt_tokens: int) -> int:
        """How many new tokens fit in the model's context after `prompt_tokens` (no limit: a large number);
        a prompt that leaves no room for one is a ValueError with its token count and the limit."""
        limit = self.context_length
        if limit is None:
            return 1 << 62
        if prompt_tokens >= limit:
            raise ValueError(f"the prompt is {prompt_tokens} tokens; the model's context is {limit} tokens "
                             "(max_position_embeddings) and must also hold the new ones: shorten the prompt")
        return limit - prompt_tokens

    def generate(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        method: str | MethodSpec | None = None,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        chat: bool = False,
        min_response_tokens: int | None = None,
        stop: str | Sequence[str] = (),
        seed: int = 0,
    ) -> "Generation":
        """Start decoding `prompt` with `method` (None: default_method()); iterate the result for token ids
        as they are appended.

        min_response_tokens: with chat, no EOS among the first that many response tokens (None: 4; 0 = off).
        stop: end once the response contains one of these strings (kept in the output); a bare string is one.
        Every argument is checked before the method is built (which can take seconds: an int8 copy, a drafter model).
        """
        plan = self.prepare(prompt, method, sampling, max_new_tokens, chat, min_response_tokens, stop, seed)
        return Generation(self.tokenizer, plan.stream(self.method(plan.spec)), plan.note, self.session.decoding)

    def prepare(
        self,
        prompt: str | Sequence[int] | torch.Tensor | list[dict],
        method: str | MethodSpec | None = None,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        chat: bool = False,
        min_response_tokens: int | None = None,
        stop: str | Sequence[str] = (),
        seed: int = 0,
    ) -> "Plan":
        """generate's arguments checked and the prompt encoded, nothing built or run: a Plan (generate's
        arguments; with chat, the prompt may also be a list of {"role", "content"} messages)."""
        max_new_tokens, seed = _check_counts(max_new_tokens, seed)
        require(isinstance(chat, bool), "chat", "True or False", chat)
        guard = _response_guard(min_response_tokens, chat)
        stops = [] if stop is None else _listed(stop, "stop")
        require(all(isinstance(text, str) for text in stops), "stop", "a string or a list of strings", stop)
        for text in stops:
            _check_unicode("a stop string", text)
        spec = self.default_method() if method is None else as_method_spec(method)
        check_sampling(sampling, [spec])
        ids = self.encode(prompt, chat)
        stops = StopStrings(self.tokenizer, stops) if stops else None
        room, note = self.room(ids.numel()), None
        if max_new_tokens > room:  # the prompt plus the new tokens stay within the context
            note = (f"note: the prompt ({ids.numel()} tokens) leaves room for {room} new token{'s' * (room != 1)} "
                    f"in the model's context of {self.context_length}; generating at most {room}, not {max_new_tokens}")
            max_new_tokens = room
        return Plan(ids, spec, sampling, max_new_tokens, guard, stops, seed, note)

    def bench(
        self,
        methods: str | Sequence[str | MethodSpec],
        prompts: str | Sequence[str],
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        chat: bool = False,
        min_response_tokens: int | None = None,
        keep_session: bool = False,
    ) -> dict:
        """Run methods interleaved on the same prompts (ar always among them, first); the JSON record
        `runtime bench` writes: setup, and one row per method (tok/s, speedup over ar in this run, the
        target's perplexity of its output, joules per token or null with the reason, ...). A bare string
        is one method, or one prompt. Every argument and prompt is checked before any method is built.

        Each prompt runs on a freshly built method, as `runtime generate` and every served request do;
        keep_session: each method keeps its drafter's session across the prompts instead (lookup then also
        drafts from the earlier prompts' outputs, as it does over one Engine's generate calls)."""
        from runtime.bench.energy import EnergyMeter
        from runtime.bench.perplexity import perplexities
        from runtime.bench.provenance import provenance
        from runtime.bench.runner import run_bench, summarize
        from runtime.kernels import decode_threads, thread_stats

        max_new_tokens, seed = _check_counts(max_new_tokens, seed)
        require(isinstance(chat, bool), "chat", "True or False", chat)
        guard = _response_guard(min_response_tokens, chat)
        specs = check_distinct([as_method_spec(m) for m in _listed(methods, "methods")])
        if not any(spec.name == "ar" and spec.backend is None for spec in specs):
            specs.insert(0, parse_method("ar"))  # speedups are always against ar measured in the same run
        check_sampling(sampling, specs)
        prompts = _listed(prompts, "prompts")
        if not prompts:
            raise ValueError("bench needs at least one prompt")
        ids = [self.encode(text, chat) for text in prompts]
        for i, prompt in enumerate(ids):  # every method runs every prompt to the same length: refuse, not clamp
            if self.room(prompt.numel()) < max_new_tokens:
                raise ValueError(f"prompt {i} ({prompt.numel()} tokens) leaves room for {self.room(prompt.numel())} "
                                 f"new tokens in the model's context of {self.context_length}, not {max_new_tokens}: "
                                 "lower max_new_tokens (--max-new-tokens) or drop that prompt")
        built = [self.method(spec) for spec in specs]
        meter = EnergyMeter()
        with self.session.decoding():
            threads = {"threads": decode_threads(), "adaptive_threads": bool(thread_stats().get("adaptive"))}
            results = run_bench(built, ids, max_new_tokens, sampling, seed, min_new_tokens=guard, meter=meter,
                                fresh=None if keep_session else self._fresh)
            rss = peak_rss_mib()  # the methods' runs, not the perplexity forwards below
            # after every timed run: one teacher-forced target forward per prompt and distinct output
            scores = perplexities(self.session.target, self.session.full_head(), ids, [r.outputs for r in results])
            for result, score in zip(results, scores):
                result.perplexity = score
        return {
            "setup": {
                "model": self.session.model.info.name, "n": len(ids), "max_new_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                "epsilon": sampling.epsilon, "seed": seed, "chat": chat, "min_response_tokens": guard,
                "drafter_session": "kept across prompts" if keep_session else "new per prompt",
                **threads,
                "backend": self.session.target.name, "peak_rss_mib": rss,
                "energy_counters": meter.description, **_llamacpp_builds(built), **provenance(),
            },
            "methods": summarize(results, sampling),
        }


def _is_messages(prompt) -> bool:
    """Whether `prompt` is a non-empty list of chat messages: dicts with a str role and str content."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def _check_length(characters: int, limit: int | None) -> None:
    """Refuse a prompt of more characters than the model's context can hold, before it is tokenized."""
    if limit and characters > MAX_CHARS_PER_TOKEN * limit:
        raise ValueError(f"the prompt is {characters} characters, more than the model's context of {limit} "
                         f"tokens can hold ({MAX_CHARS_PER_TOKEN} characters per token at most are allowed); "
                         "shorten the prompt")


def _token_ids(prompt) -> torch.Tensor:
    """Token ids [P] of a prompt given as ids (a sequence or tensor of integers, [P] or [1, P]); a TypeError
    for anything else (a bare integer included), a ValueError for a batch of several prompts."""
    try:
        ids = torch.as_tensor(prompt)
    except (RuntimeError, TypeError, ValueError):
        ids = None
    integers = ids is not None and ids.dim() > 0 and (
        ids.numel() == 0 or not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool))
    if not integers:
        raise TypeError(f"a prompt is text or a sequence of token ids (integers), got {prompt!r:.80}")
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise ValueError(f"a prompt is one sequence of token ids, [P] or [1, P], got shape {list(ids.shape)}: "
                         "generate one prompt at a time, or give bench a list of prompts")
    return ids.long().flatten()


def _llamacpp_builds(built: Sequence[Method]) -> dict:
    """The llama.cpp builds among the methods, each as version and instruction sets: "llamacpp_build"
    (llama-cpp-python's, for llamacpp and llamacpp:lookup) and "llamacpp_bin_build" (llama-server's)."""
    from runtime.llamacpp.bindings import LlamaCppDecoder, build_info
    from runtime.llamacpp.server import LlamaServerDecoder

    builds = {}
    for method in built:
        if isinstance(method.stream, LlamaCppDecoder):
            builds["llamacpp_build"] = build_info()
        elif isinstance(method.stream, LlamaServerDecoder):
            builds["llamacpp_bin_build"] = method.stream.build
    return builds


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB (getrusage: every method of a run included)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@dataclass(frozen=True, eq=False)
class Plan:
    """One generation, checked and encoded (Engine.prepare): what generate runs and the server schedules."""

    ids: torch.Tensor  # [P] prompt token ids
    spec: MethodSpec
    sampling: SamplingParams
    max_new_tokens: int  # already lowered to fit the model's context (then `note` says so)
    min_new_tokens: int  # the EOS min-response guard
    stops: StopStrings | None
    seed: int
    note: str | None = None

    def stream(self, method: Method) -> TokenStream:
        """`method`'s token stream for this plan, sampling from a generator seeded with `seed`."""
        generator = torch.Generator().manual_seed(self.seed)
        return method.stream(self.ids, self.max_new_tokens, self.sampling, generator, self.min_new_tokens, self.stops)


class Generation:
    """Token ids of one generation as they are appended; `text` and `stats` once it is over; `note`
    when max_new_tokens was lowered to fit the model's context.

    Iterating runs the decoding loop in the caller's thread, one token per step (runtime.loops.decode says
    why not in another thread); closing the iterator early (or leaving a `for` loop) ends the loop there.
    """

    def __init__(self, tokenizer, stream: TokenStream, note: str | None = None,
                 decoding: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.tokenizer = tokenizer
        self.note = note  # set when max_new_tokens was lowered to fit the model's context
        self._decoding = decoding  # the session's threads, around each step (Session.decoding)
        self.tokens: list[int] = []
        self.stats: DecodeStats | None = None
        self._stream = stream
        self._started = False

    def __iter__(self) -> Iterator[int]:
        """The tokens as they are appended; once the generation is over, nothing more (`tokens` holds them all)."""
        self._started = True
        try:
            while self.stats is None:  # another iterator over this generation (wait()) may end it first
                if self._stream.gi_frame is None:  # closed before its end (by any iterator): it cannot resume
                    raise RuntimeError("this generation was stopped before its end (its iteration was closed); "
                                       "its tokens so far are in .tokens: call engine.generate again for a new one")
                try:
                    with self._decoding():
                        token = next(self._stream)
                except StopIteration as done:
                    _, self.stats = done.value
                    return
                self.tokens.append(token)
                yield token
        finally:
            self._stream.close()

    def wait(self) -> "Generation":
        """Run to the end (consuming the stream); returns self."""
        for _ in self:
            pass
        return self

    @property
    def text(self) -> str:
        """The decoded response (the stream is consumed first if it has not been)."""
        if not self._started:
            self.wait()
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)
