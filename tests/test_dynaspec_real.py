"""DynaSpec, FR-Spec and the screening draft head on gemma3-270m: greedy output identical to plain
decoding. The router is trained for a few steps on a tiny trace: identity does not depend on its
quality, only on verification keeping the full vocabulary."""

from __future__ import annotations

import pytest
import torch

from artifacts import Artifact
from prep.router_train import RouterConfig, train_router
from prep.stages import created_by
from prep.traces import build_traces
from runtime.backends.hf import TransformersTarget
from runtime.loops.decode import generate_ar
from runtime.common.sampling import SamplingParams
from runtime.methods import build_method
from runtime.session import Session

pytestmark = pytest.mark.real_model

DEPTH = 16  # of 18: shallower gemma3-270m drafters accept almost nothing, so few drafts would be checked
NEW_TOKENS = 24
PROMPTS = ["def is_prime(n):\n    \"\"\"Return True if n is prime.\"\"\"\n", "The three largest cities in France are"]


@pytest.fixture(scope="module")
def gemma_traces(real_gemma, gemma_session, tmp_path_factory):
    """300 traced tokens (the final and the layers:16 hidden states)."""
    traces = tmp_path_factory.mktemp("gemma-traces") / "traces"
    # The first 25 HumanEval prompts, 12 tokens each: text 24 is the first in the validation split.
    target = TransformersTarget(real_gemma.model, gemma_session.target.eos_token_ids)  # as `prep traces` runs
    build_traces(target, real_gemma.tokenizer, real_gemma.info.name, "humaneval", traces, max_tokens=300,
                 max_tokens_per_text=12, drafter_layers=(DEPTH,), progress=False)
    return traces


def routed_session(real_gemma, gemma_session, traces, root, hidden: str) -> Session:
    """A gemma3-270m artifact with a router trained 5 steps on the traces' `hidden` state."""
    artifact = Artifact.create(root / "art", real_gemma.info, created_by())
    # Training reads the fp32 weights (as `prep train-router` does); decoding runs on the default backend.
    trainer = Session(artifact, real_gemma, TransformersTarget(real_gemma.model, gemma_session.target.eos_token_ids))
    config = RouterConfig(clusters=32, hidden=hidden, width=32, max_steps=5, batch_size=32, kmeans_iterations=2,
                          trainer_flags={"accelerator": "cpu", "devices": 1}, progress=False)
    params = train_router(trainer, traces, root / "work", config)
    assert params["hidden"] == hidden
    return Session(Artifact.open(artifact.path), real_gemma, gemma_session.target)


@pytest.fixture(scope="module")
def router_session(real_gemma, gemma_session, gemma_traces, tmp_path_factory):
    return routed_session(real_gemma, gemma_session, gemma_traces, tmp_path_factory.mktemp("router"), f"layers:{DEPTH}")


@pytest.fixture(scope="module")
def final_router_session(real_gemma, gemma_session, gemma_traces, tmp_path_factory):
    return routed_session(real_gemma, gemma_session, gemma_traces, tmp_path_factory.mktemp("router-final"), "final")


@pytest.fixture(scope="module")
def expected(gemma_session):
    """Plain greedy decoding of each prompt (prompt ids, tokens)."""
    head, tokenizer = gemma_session.full_head(), gemma_session.tokenizer
    runs = []
    for text in PROMPTS:
        prompt = torch.tensor(tokenizer(text)["input_ids"])
        runs.append((prompt, generate_ar(gemma_session.target, head, prompt, NEW_TOKENS, SamplingParams())[0]))
    return runs


@pytest.mark.parametrize("method", [f"dynaspec:layers:{DEPTH}:k=4:schedule=position",
                                    f"dynaspec:layers:{DEPTH}:k=4:context=0", f"frspec:layers:{DEPTH}:4096",
                                    "dynaspec:int8:k=4", f"screenspec:layers:{DEPTH}"])
def test_cheap_drafter_heads_keep_gemma_greedy_output(router_session, final_router_session, gemma_session, expected,
                                                      method):
    if method.startswith("screenspec"):
        session = gemma_session
    else:
        session = final_router_session if method.startswith("dynaspec:int8") else router_session
    run = build_method(session, method).decode
    accepted = 0
    for prompt, tokens in expected:
        got, stats = run(prompt, NEW_TOKENS, SamplingParams(), torch.Generator().manual_seed(0))
        assert got == tokens
        accepted += stats.spec.accepted
        if not method.startswith("screenspec"):
            assert 0 < stats.shortlist_fraction < 0.5
    assert accepted > 0  # drafts were taken, so the identity covers accepted shortlisted drafts too
