"""llama.cpp's plain decoding of the same GGUF, as a same-run reference for the bench (method `llamacpp`).

Users who want fast CPU decoding of a GGUF run llama.cpp on it, so the bench runs it beside our
methods: same prompt token ids, same thread count, interleaved like every other method. It is not
exact with respect to the fp32 model (it quantizes activations), so the bench reports whether its
tokens equal `ar`'s and never counts it in "identical to greedy" claims.

llama-cpp-python is an optional extra (`pip install '.[llamacpp]'`, built from source; see the
README for the build flags that run on both of this project's CPUs). Without it, or when llama.cpp
cannot load the file, the method is refused with a one-line error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import torch

from runtime.common.fds import fd_redirected
from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats
from runtime.kernels import decode_threads
from runtime.loops.decode import TokenStream

INSTALL_HINT = ("install the optional extra built for this CPU: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON "
                "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" "
                "pip install --force-reinstall --no-deps '.[llamacpp]' (see the README)")


class LlamaCppUnavailable(ValueError):
    """llama-cpp-python is not installed, or llama.cpp cannot load the model."""


@contextlib.contextmanager
def _quiet_stderr():
    """Silence llama.cpp's C-level log lines while it loads (it writes straight to fd 2)."""
    with open(os.devnull, "w") as null, fd_redirected(2, null.fileno()):
        yield


_PROBE = """
import sys, llama_cpp
llama = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
for i, _ in zip(range(2), llama.generate([1, 2, 3], temp=0.0, top_k=1)):
    pass
"""


def probe(gguf_path) -> None:
    """Decode two tokens with llama.cpp in a child process: a build that dies on this CPU (an AMX or
    AVX-VNNI kernel it cannot run) is refused here instead of killing the bench."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf_path)], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppUnavailable(f"llama.cpp did not decode two tokens of {gguf_path} in 300 s; leave llamacpp out of --methods") from exc
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        raise LlamaCppUnavailable(f"llama.cpp died with {name} on this CPU; rebuild llama-cpp-python: {INSTALL_HINT}")
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["no message"])[-1]
        raise LlamaCppUnavailable(f"llama.cpp cannot load {gguf_path} ({last}); check the llama-cpp-python build (README) "
                                  "or leave llamacpp out of --methods")


def load_llama(gguf_path, context: int, threads: int, lookup_tokens: int | None = None):
    """A llama_cpp.Llama over `gguf_path` (lookup_tokens: with llama-cpp-python's prompt lookup drafting
    that many tokens per round); LlamaCppUnavailable (one line, naming the fix) when it cannot be had."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise LlamaCppUnavailable(f"method llamacpp needs llama-cpp-python: {INSTALL_HINT}") from exc
    if gguf_path is None:
        raise LlamaCppUnavailable("method llamacpp decodes a .gguf file and this model has none (an HF directory)")
    probe(gguf_path)
    draft = None
    if lookup_tokens is not None:  # its documented default n-gram size; it keeps every position's logits
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
    try:
        with _quiet_stderr():
            return llama_cpp.Llama(str(gguf_path), n_ctx=context, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False, draft_model=draft)
    except Exception as exc:  # llama.cpp reports load failures as ValueError / RuntimeError with C context
        raise LlamaCppUnavailable(f"llama.cpp cannot load {gguf_path} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                                  "check the llama-cpp-python build (README) or leave llamacpp out of --methods") from exc


def build_info() -> str:
    """llama-cpp-python's version and the instruction sets its llama.cpp was built for, e.g.
    '0.3.36: CPU : SSE3 = 1 | ... | AVX2 = 1 | ...' (the bench records it beside llama.cpp's tok/s)."""
    import llama_cpp

    return f"{llama_cpp.__version__}: {features_line(llama_cpp.llama_print_system_info().decode(errors='replace'))}"


def features_line(system_info: str) -> str:
    """llama_print_system_info()'s 'CPU : SSE3 = 1 | ... | REPACK = 1 |' without its empty last part."""
    return " | ".join(part.strip() for part in system_info.split("|") if part.strip())


class LlamaCppDecoder:
    """Decoding by llama.cpp: greedy (top-1) or its own sampler at the same temperature / top-k / top-p;
    plain, or with llama-cpp-python's prompt lookup drafting `lookup_tokens` per round (its verify
    forwards batch the drafts, so its text may differ from its own plain decoding's)."""

    def __init__(self, gguf_path, eos_token_ids: frozenset[int], context: int = 4096, threads: int | None = None,
                 lookup_tokens: int | None = None) -> None:
        self.threads = threads or decode_threads()
        self.llama = load_llama(gguf_path, context, self.threads, lookup_tokens)
        self.eos_token_ids = eos_token_ids

    def __call__(self, prompt: torch.Tensor, max_new_tokens: int, params: SamplingParams, generator=None,
                 min_new_tokens: int = 0, stop=None) -> TokenStream:
        """Decode up to max_new_tokens after prompt [P]: a token stream (runtime.loops.decode) with the timing our loops report."""
        import numpy as np

        eos = sorted(self.eos_token_ids)

        def guard(input_ids, scores):  # the EOS min-response guard, as our loops apply it
            if len(tokens) < min_new_tokens:
                scores[eos] = -np.inf
            return scores

        greedy = params.greedy
        tokens: list[int] = []
        stats = DecodeStats(prompt_tokens=prompt.numel())
        self.llama.reset()
        start = time.perf_counter()
        stream = self.llama.generate(
            prompt.tolist(), top_k=1 if greedy else params.top_k, top_p=1.0 if greedy else params.top_p, min_p=0.0,
            temp=0.0 if greedy else params.temperature, repeat_penalty=1.0, reset=True,
            logits_processor=[guard] if min_new_tokens else None)
        with contextlib.closing(stream):  # also when our stream is closed early
            for token in stream:
                if not tokens:
                    stats.seconds_prefill = time.perf_counter() - start
                tokens.append(int(token))
                stats.forwards += 1
                yield int(token)
                if token in self.eos_token_ids or len(tokens) >= max_new_tokens or (stop is not None and stop.hit(tokens)):
                    break
        stats.seconds_total = time.perf_counter() - start
        stats.new_tokens = len(tokens)
        return tokens, stats
