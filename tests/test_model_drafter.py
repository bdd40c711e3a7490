"""The model:NAME|PATH drafter on a tiny random pair that shares a tokenizer (the 2-layer tiny Llama and
a 1-layer model made from it): greedy identity with generate_ar, rollback of its own cache, sampled
proposals carrying q with the EOS guard inside q, heads of another size, refusal of another
tokenizer, and the CLI / bench registrations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from factories import tiny_artifact
from runtime.loops.decode import generate_ar
from runtime.drafters import ModelDrafter, build_drafter
from runtime.drafters.model import head_in_target_space
from runtime.heads import FullHead
from runtime.models import load_model
from runtime.loops.speculative import generate_speculative
from runtime.backends.hf import TransformersTarget
from runtime.common.sampling import SamplingParams, TokenBan
from runtime.drafters.base import Verdict

NEW_TOKENS = 24
PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 30)), [3], [201, 17, 88, 4, 150, 9, 63, 240, 31, 77, 120, 5]]


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tiny_draft_model_dir):
    """(target, target's ModelInfo, drafter directory) with no EOS: every run uses its whole budget."""
    loaded = load_model(str(tiny_model_dir), progress=False)
    return TransformersTarget(loaded.model, set()), loaded.info, tiny_draft_model_dir


def model_drafter(pair) -> ModelDrafter:
    target, info, path = pair
    return build_drafter(f"model:{path}", target, None, target_info=info)


def full_head(target) -> FullHead:
    return FullHead(target.head_weight, target.head_bias)


@pytest.mark.parametrize("gamma, adaptive", [(4, False), (2, True)])
def test_greedy_equals_generate_ar(pair, gamma, adaptive):
    target = pair[0]
    accepted = 0
    for prompt in PROMPTS:
        expected = generate_ar(target, full_head(target), torch.tensor(prompt), NEW_TOKENS)[0]
        tokens, stats = generate_speculative(target, full_head(target), model_drafter(pair), torch.tensor(prompt),
                                             NEW_TOKENS, gamma=gamma, adaptive=adaptive)
        assert tokens == expected, prompt
        accepted += stats.spec.accepted
    assert accepted > 0, "no draft was accepted: multi-token appends were never exercised"


def test_rollback_keeps_the_drafter_cache_consistent(pair):
    """After partial acceptances the drafter's cache holds a prefix of the context, and its next hidden
    state equals a fresh forward of its model over everything."""
    target = pair[0]
    drafter, prompt = model_drafter(pair), PROMPTS[3]
    params = SamplingParams(temperature=0.05, top_k=20)
    tokens, stats = generate_speculative(target, full_head(target), drafter, torch.tensor(prompt), 40, params,
                                         torch.Generator().manual_seed(0))
    assert 0 < stats.spec.accepted < stats.spec.drafted, "the run must include partial acceptances"
    context = prompt + tokens
    assert drafter.cached == context[: len(drafter.cached)]
    assert len(drafter.cache) == len(drafter.cached)
    drafter.propose(context, 1)  # brings its cache to exactly the context
    incremental = drafter.feed([7])[-1]
    fresh = drafter.backend.forward(torch.tensor(context + [7]), drafter.backend.new_cache())[-1]
    assert torch.allclose(incremental, fresh, atol=1e-4)


def test_sampled_proposals_carry_q_and_respect_the_guard(pair):
    target = pair[0]
    drafter = model_drafter(pair)
    banned = frozenset({19, 158})
    context = PROMPTS[0]
    drafter.reset(context, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0),
                  TokenBan(banned, until=len(context) + 2))
    proposal = drafter.propose(context, 4)
    assert proposal.tokens.shape == (4,) and proposal.probs.shape == (4, target.vocab_size)
    assert torch.allclose(proposal.probs.sum(dim=1), torch.ones(4))
    assert float(proposal.probs[:2, sorted(banned)].sum()) == 0.0  # guarded positions
    assert float(proposal.probs[2:, sorted(banned)].sum()) > 0.0
    drafter.observe(Verdict(4, 1, proposal.tokens[:1].tolist() + [9]))
    assert drafter.cached == (context + proposal.tokens.tolist())[: len(drafter.cached)]
    assert len(drafter.cached) <= len(context) + 1


def test_heads_of_another_size_are_cut_or_padded():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    hidden = torch.randn(3, 32)
    weight = model.lm_head.weight.detach()
    cut = head_in_target_space(weight, None, 256)
    assert cut.vocab_size == 256 and torch.allclose(cut.logits(hidden), hidden @ weight[:256].T, atol=1e-6)
    padded = head_in_target_space(weight, None, 320)
    logits = padded.logits(hidden)  # [3, 320]
    assert torch.allclose(logits[:, :300], hidden @ weight.T, atol=1e-6)
    assert bool((logits[:, 300:] == float("-inf")).all())


def with_another_tokenizer(path: Path, out: Path) -> Path:
    """A copy of the model directory whose tokenizer maps two words to each other's ids."""
    shutil.copytree(path, out)
    tokenizer_file = out / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    vocab["w4"], vocab["w5"] = vocab["w5"], vocab["w4"]
    tokenizer_file.write_text(json.dumps(data))
    return out


def test_another_tokenizer_is_refused(pair, tmp_path):
    target, info, path = pair
    other = with_another_tokenizer(path, tmp_path / "other")
    with pytest.raises(ValueError, match="another tokenizer.*no two packaged models share a tokenizer"):
        build_drafter(f"model:{other}", target, None, target_info=info)
    with pytest.raises(ValueError, match="model:"):
        build_drafter("model:", target, None, target_info=info)


def test_cli_generate_and_bench_with_a_model_drafter(tiny_model_dir, tiny_draft_model_dir, tmp_path, monkeypatch):
    """`runtime generate --drafter model:PATH` prints plain decoding's text, and refuses another tokenizer
    with one error line; bench spec:model:PATH is identical to greedy ar."""
    from click.testing import CliRunner

    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tiny_artifact(tiny_model_dir, tmp_path)

    def invoke(*args) -> str:
        result = CliRunner().invoke(runtime_main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.stdout

    generate = ["generate", art, "--prompt", "w5 w6 w7 w8 w5 w6", "--max-new-tokens", 12]
    reference = invoke(*generate, "--method", "ar")
    assert invoke(*generate, "--method", "spec", "--drafter", f"model:{tiny_draft_model_dir}") == reference
    other = with_another_tokenizer(tiny_draft_model_dir, tmp_path / "other")
    refused = CliRunner().invoke(runtime_main, [str(a) for a in generate] + ["--method", "spec", "--drafter", f"model:{other}"])
    assert refused.exit_code != 0 and "Traceback" not in refused.output
    assert "Error: drafter other has another tokenizer" in refused.output
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": "w5 w6 w7 w8 w5 w6"}, {"text": "w9 hi w9 hi"}]))
    out = tmp_path / "bench.json"
    invoke("bench", art, "--prompts", prompts, "--methods", f"ar,spec:model:{tiny_draft_model_dir}", "-n", 2,
           "--max-new-tokens", 12, "--json", out)
    rows = {row["method"]: row for row in json.loads(out.read_text())["methods"]}
    assert rows[f"spec:model:{tiny_draft_model_dir}"]["identical_to_greedy"] == 1.0
