"""Long prompts: refused at once beyond the model's context, --max-new-tokens fitted to the room left,
and the memory of a prefill at the context limit bounded (lean backend: prefill in PREFILL_CHUNK chunks).

The tiny Llama's context is transformers' default max_position_embeddings, 2048 tokens; its word-level
tokenizer gives one token per word and adds none.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from bad_helpers import REPO, TINY_CLUSTERS, runtime_fails
from bad_helpers import save_tiny_model
from prep.cli import main as prep_main
from runtime.backends.decoder import PREFILL_CHUNK
from runtime.cli import main as runtime_main

CONTEXT = 2048


def words(n: int) -> str:
    return " ".join(f"w{3 + i % 250}" for i in range(n))


def prompt_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"prompt-{n}.txt"
    path.write_text(words(n))
    return path


@pytest.mark.parametrize("tokens", [CONTEXT, CONTEXT + 52], ids=["at-context", "beyond"])
def test_a_prompt_beyond_the_context_is_refused(art: Path, tmp_path: Path, tokens: int):
    path = prompt_file(tmp_path, tokens)
    runtime_fails(["generate", art, "--prompt-file", path], f"the prompt is {tokens} tokens",
                  f"the model's context is {CONTEXT} tokens", "shorten the prompt", unchanged=(art, tmp_path))


def test_a_text_too_long_to_tokenize_is_refused_untokenized(art: Path, tmp_path: Path):
    from runtime.api import MAX_CHARS_PER_TOKEN

    path = tmp_path / "huge.txt"
    path.write_text("w3" * (MAX_CHARS_PER_TOKEN * CONTEXT // 2 + 1))  # one "word": a single token if tokenized
    runtime_fails(["generate", art, "--prompt-file", path], "characters, more than the model's context of 2048",
                  "shorten the prompt", unchanged=(art, tmp_path))


def test_max_new_tokens_is_fitted_to_the_room_left(art: Path, tmp_path: Path):
    result = CliRunner().invoke(runtime_main, ["generate", str(art), "--method", "ar", "--prompt-file",
                                               str(prompt_file(tmp_path, CONTEXT - 8)), "--max-new-tokens", "100"])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert f"note: the prompt ({CONTEXT - 8} tokens) leaves room for 8 new tokens" in result.output
    assert "generating at most 8, not 100" in result.output
    assert 1 <= int(re.search(r"\[ar\] (\d+) tokens", result.output).group(1)) <= 8  # fewer if EOS came first


def test_bench_refuses_a_prompt_its_max_new_tokens_would_overflow(art: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": "w3 w4"}, {"text": words(CONTEXT - 8)}]))
    runtime_fails(["bench", art, "--prompts", prompts, "--methods", "ar", "--max-new-tokens", 100, "--json",
                   tmp_path / "out" / "b.json"], f"prompt 1 ({CONTEXT - 8} tokens) leaves room for 8",
                  "lower max_new_tokens (--max-new-tokens)", unchanged=(art, tmp_path))
    assert not (tmp_path / "out").exists()


def test_bench_verify_context_beyond_the_model(art: Path):
    runtime_fails(["bench-verify", art, "--context", CONTEXT - 4, "--max-n", 8], "--context 2044 plus --max-n 8",
                  f"pass the model's context of {CONTEXT}; lower them", code=2, unchanged=(art,))


def test_the_api_refuses_a_40k_token_prompt_within_a_second(art: Path):
    from runtime import api

    engine = api.load(art, progress=False)
    started = time.perf_counter()
    with pytest.raises(ValueError, match=f"the prompt is 40960 tokens; the model's context is {CONTEXT}"):
        engine.generate((list(range(3, 253)) * 164)[:40960], method="ar")
    assert time.perf_counter() - started < 1.0


CHILD = """
import json, resource, sys, time
import torch
from runtime import api

engine = api.load(sys.argv[1], backend="lean", progress=False)
limit = engine.context_length
engine.generate([5, 6, 7], method="ar", max_new_tokens=2).wait()  # everything but the long prefill allocated
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
run = engine.generate(torch.arange(limit - 1) % 250 + 3, method="ar", max_new_tokens=5).wait()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
try:
    engine.generate(torch.arange(limit + 1) % 250 + 3, method="ar")
    refused = None
except ValueError as e:
    refused = str(e)
print(json.dumps({"limit": limit, "tokens": len(run.tokens), "note": run.note, "before_kib": before, "after_kib": after,
                  "refused": refused, "refused_s": time.perf_counter() - started}))
"""


def test_a_prompt_at_the_context_limit_runs_within_the_memory_bound(tmp_path: Path, private_cache: Path):
    """Peak RSS of a prefill at the context limit stays within the KV cache plus one chunk's attention scores.

    Model: 2 layers, 16 heads of dim 4, context L = 8192. Bound on the growth of peak RSS over a short
    run: the KV cache at twice L (its doubling growth) held twice while it grows, plus two copies of one
    chunk's fp32 attention scores [H, C, L] (C = PREFILL_CHUNK), plus 64 MiB of allocator slack. A
    prefill in one piece would need the [H, L, L] scores, 4 GiB, far above it.
    """
    layers, heads, head_dim, limit = 2, 16, 4, 8192
    model = save_tiny_model(tmp_path / "long", seed=0, num_attention_heads=heads, num_key_value_heads=heads,
                            max_position_embeddings=limit)
    art = tmp_path / "art"
    result = CliRunner().invoke(prep_main, ["cluster", str(model), "-o", str(art), *TINY_CLUSTERS])
    assert result.exit_code == 0, result.output
    child = subprocess.run([sys.executable, "-c", CHILD, str(art)], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.strip().splitlines()[-1])
    kv_cache = 2 * layers * heads * (2 * limit) * head_dim * 4  # K and V, fp32
    chunk_scores = heads * PREFILL_CHUNK * limit * 4
    bound = 2 * kv_cache + 2 * chunk_scores + (64 << 20)
    assert heads * limit * limit * 4 > 8 * bound  # the bound means something: one-piece scores are far above it
    grown = (out["after_kib"] - out["before_kib"]) * 1024
    assert out["limit"] == limit and out["tokens"] == 1 and "leaves room for 1 new token in" in out["note"]
    assert grown <= bound, f"peak RSS grew {grown / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
    assert f"the prompt is {limit + 1} tokens" in out["refused"] and out["refused_s"] < 1.0
