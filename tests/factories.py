"""Factories the tests share: tiny random heads, tiny causal LMs per architecture (and one saved with a
tokenizer), random block weights.

A plain module (not conftest.py) so that test files import it by one unambiguous name; the
fixtures built on it live in conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from runtime.kernels import QuantMatrix, build, kernel_name

# Captured at import, before any test's monkeypatch: the real model lives in the user's cache
# (converting it afresh takes minutes), even while a test points SPECVOCAB_CACHE elsewhere.
USER_CACHE = os.environ.get("SPECVOCAB_CACHE")


@contextlib.contextmanager
def in_user_cache():
    """Within: SPECVOCAB_CACHE as the user had it, so a packaged model resolves to (or is imported into) their cache."""
    with pytest.MonkeyPatch.context() as mp:
        if USER_CACHE is None:
            mp.delenv("SPECVOCAB_CACHE", raising=False)
        else:
            mp.setenv("SPECVOCAB_CACHE", USER_CACHE)
        yield


TINY_VOCAB, TINY_DIM = 4096, 64
HIDDEN_NORM = 100.0  # real models' final-normed hidden states have norms ~130-180


@dataclass
class TinyHead:
    """A random LM head and hidden states to feed it."""

    weight: torch.Tensor  # [V, d] float32
    bias: torch.Tensor | None  # [V] or None
    hidden: torch.Tensor  # [B, d] float32


def random_hidden(rows: int, dim: int, generator: torch.Generator, norm: float = HIDDEN_NORM) -> torch.Tensor:
    """Hidden states [rows, d] of the given norm; every third row has a few massive coordinates.

    Real models' hidden states have outlier dimensions ("massive activations"); they stress the
    bounds differently from isotropic vectors of the same norm.
    """
    h = torch.randn(rows, dim, generator=generator)
    h[::3, :3] *= 30.0
    return h / h.norm(dim=1, keepdim=True) * norm


def make_tiny_head(
    bias: bool = False, seed: int = 0, vocab: int = TINY_VOCAB, dim: int = TINY_DIM, rows: int = 16
) -> TinyHead:
    """Random head with rows of norm ~1, a few rows 10-50x larger, and optionally a spread-out bias."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5  # [V, d]
    big = torch.randperm(vocab, generator=gen)[:8]
    weight[big] *= torch.linspace(10.0, 50.0, len(big))[:, None]
    b = torch.randn(vocab, generator=gen) * 3.0 if bias else None  # [V]
    return TinyHead(weight, b, random_hidden(rows, dim, gen))


TINY_ARCHS = ("gemma3", "llama", "qwen2")
# The tiny Llama most runtime tests share: 2 layers, vocab 256, hidden 64, EOS id 1.
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, tie_word_embeddings=False, bos_token_id=2, eos_token_id=1)


def tiny_causal_lm(arch: str) -> torch.nn.Module:
    """A fresh random tiny causal LM (vocab 128, hidden 64) of one architecture, same weights on every call.

    gemma3 has 3 layers with a 6-token sliding window on the first two; qwen2 has grouped KV heads
    and q/k/v biases; llama is the plain case.
    """
    from transformers import (
        Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    )

    if arch == "gemma3":
        torch.manual_seed(1)
        return Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=32,
        )).eval()
    if arch == "qwen2":
        torch.manual_seed(2)
        return Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).eval()
    if arch == "llama":
        torch.manual_seed(3)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=4)).eval()
    raise ValueError(f"no tiny {arch!r} model; use one of {', '.join(TINY_ARCHS)}")


def save_tiny_model_dir(path: Path, *, tied: bool = False, layers: int = 2) -> Path:
    """Save a random Llama (vocab 128, hidden 32, 2 layers unless told) and a word-level tokenizer into path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(path)
    return path


def tiny_artifact(model_dir: Path, root: Path) -> Path:
    """`prep cluster` (8 clusters) of a tiny model into root/art, with the model cache in root/cache."""
    from click.testing import CliRunner

    from prep.cli import main as prep_main

    out = root / "art"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(root / "cache"))
        result = CliRunner().invoke(prep_main, ["cluster", str(model_dir), "-o", str(out), "--clusters", "8"])
    assert result.exit_code == 0, result.output
    return out


def tiny_engine(model_dir: Path, root: Path):
    """tiny_artifact opened with runtime.api.load (the model cache in root/cache)."""
    from runtime import api

    out = tiny_artifact(model_dir, root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(root / "cache"))
        return api.load(out, progress=False)


def real_texts() -> list[str]:
    """Code and chat texts, interleaved, to run the real model over."""
    from runtime.text.data import humaneval_prompts, sharegpt_prompts

    code, chat = humaneval_prompts(20), sharegpt_prompts(20)
    return [text for pair in zip(code, chat) for text in pair]


# Bit-level claims (batch invariance, tree = chain, path identity) are the compiled kernels'; the
# pure-torch fallback (SPECVOCAB_KERNELS=torch) computes the same values through torch's GEMM.
needs_compiled_kernels = pytest.mark.skipif(
    kernel_name() == "torch", reason="SPECVOCAB_KERNELS=torch: the pure-torch fallback makes no bit-level claims"
)

_HAS_MIN = (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K)  # a second fp16 (min / dmin) at byte 2


def random_matrix(t: T, rows: int, cols: int, seed: int = 0) -> QuantMatrix:
    """Random bytes in type t with finite fp16 scales (elementwise types: random finite values)."""
    rng = np.random.default_rng(seed)
    if t == T.F32:
        raw = rng.standard_normal((rows, cols), dtype=np.float32).view(np.uint8)
    elif t == T.F16:
        raw = (rng.standard_normal((rows, cols)) * 4).astype(np.float16).view(np.uint8)
    elif t == T.BF16:
        raw = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        block, size = GGML_QUANT_SIZES[t]
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for at in [208] if t == T.Q6_K else [0, 2] if t in _HAS_MIN else [0]:
            scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block)).astype(np.float16)
            scales[0, 0] = np.float16(6e-8)  # a subnormal fp16 scale
            raw[..., at : at + 2] = scales.view(np.uint8).reshape(rows, -1, 2)
        raw = raw.reshape(rows, -1)
    return QuantMatrix.from_numpy(np.ascontiguousarray(raw), t, rows, cols)


def compiled_module(path: str):
    """The extension of `path`, skipping (with the reason) when this CPU cannot run it."""
    missing = build.missing_cpu_flags(path)
    if missing:
        pytest.skip(f"this CPU cannot run the {path} kernels (lacks {', '.join(missing)})")
    module = build.module(path)
    if module is None:
        pytest.fail(f"the {path} kernels did not build (see the warning)")
    return module


def tall_rows() -> int:
    """Rows of x past every compiled path's kTallMinRows (read from simd_*.h, runnable here or not), so a
    forward of them takes run_tall's decoded tiles on whichever path runs it."""
    headers = sorted((Path(build.__file__).parent / "csrc").glob("simd_*.h"))
    thresholds = [int(re.search(r"kTallMinRows = (\d+);", h.read_text()).group(1)) for h in headers]
    assert len(thresholds) == 3, headers  # avx512, avx2, portable
    return max(thresholds) + 7


def prep_ok(args) -> str:
    """Run `prep ARGS` in-process (CliRunner); assert it succeeded and return its output."""
    from click.testing import CliRunner

    from prep.cli import main as prep_main

    result = CliRunner().invoke(prep_main, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


# A small corpus for a briefly trained head: code and prose, repeated so that a few steps see each.
HEAD_TEXTS = ["def add(a, b):\n    return a + b\n", "The capital of France is Paris, and the capital of Italy is Rome.",
              "import os\n\nfor name in os.listdir('.'):\n    print(name)\n", "Water boils at one hundred degrees Celsius."] * 4


def exported_head(root: Path, model: str, draft_vocab: int):
    """A head for the packaged `model` trained for one epoch by prep on HEAD_TEXTS' features and exported by
    `prep export-drafter`: (artifact dir, the resolved model, the EAGLE-3 checkpoint dir)."""
    from runtime.models.resolve import resolve_model

    corpus = root / "corpus.json"
    corpus.write_text(json.dumps([{"text": text} for text in HEAD_TEXTS]))
    art, features, head = root / "art", root / "features", root / "head"
    with in_user_cache():
        target = resolve_model(model, progress=False)
        prep_ok(["cluster", model, "-o", art, "--clusters", 8])
        prep_ok(["traces", model, "--corpus", corpus, "-o", features, "--drafter-layers", 0, "--features"])
        prep_ok(["train-drafter", art, "--features", features, "--draft-vocab", draft_vocab, "--epochs", 1,
                 "--devices", 1, "--accelerator", "cpu"])
        prep_ok(["export-drafter", art, "-o", head])
    return art, target, head
