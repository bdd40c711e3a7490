"""DynaSpec on a tiny random Llama: traces, router training (Lightning) and export, ONNX/torch
parity, and exactness of shortlisted drafters (greedy identity, sampling)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from prep import recipes
from prep.traces import INDEX_FILE
from runtime.text.data import split_of_text
from runtime.cli import main as runtime_main
from runtime.loops.decode import generate_ar
from runtime.methods import build_method
from runtime.drafters.dynaspec import RouterStage
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams
from runtime.drafters.router import RouterRunner
from runtime.session import open_session
from factories import prep_ok
from sampling_checks import assert_second_token_follows_the_target

TEXTS = 80


@pytest.fixture(scope="module")
def built(tiny_model_dir: Path, tmp_path_factory):
    """prep cluster + prep traces + prep train-router on the tiny model, once for the module."""
    root = tmp_path_factory.mktemp("dynaspec")
    rng = random.Random(0)
    corpus = root / "corpus.json"
    corpus.write_text(json.dumps([{"text": " ".join(f"w{rng.randrange(4, 256)}" for _ in range(rng.randrange(8, 40)))}
                                  for _ in range(TEXTS)]))
    art, traces = root / "art", root / "traces"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(root / "cache"))
        prep_ok(["cluster", tiny_model_dir, "-o", art, "--clusters", 8])
        prep_ok(["traces", tiny_model_dir, "--corpus", corpus, "-o", traces, "--shard-tokens", 400, "--drafter-layers", 1])
        out = prep_ok(["train-router", art, "--traces", traces, "--clusters", 16, "--max-steps", 6, "--width", 32,
                      "--batch-size", 64, "--devices", 1, "--accelerator", "cpu"])
        session = open_session(art, progress=False)
    assert "recall" in out
    assert (traces / "router-train" / "checkpoints" / "last.ckpt").is_file()
    assert list((traces / "router-train" / "logs").rglob("metrics.csv"))
    return session, traces, corpus


@pytest.fixture(scope="module")
def built_final(built, tmp_path_factory):
    """A copy of the artifact whose router reads the final hidden state (the int8 drafter's)."""
    session, traces, _ = built
    root = tmp_path_factory.mktemp("dynaspec-final")
    art = root / "art"
    shutil.copytree(session.artifact.path, art)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(root / "cache"))
        prep_ok(["train-router", art, "--traces", traces, "--hidden", "final", "--clusters", 16, "--max-steps", 6,
                "--width", 32, "--batch-size", 64, "--devices", 1, "--accelerator", "cpu", "--work-dir", root / "work",
                "--force"])
        return open_session(art, progress=False)


def test_traces_index_splits_and_drafter_hidden(built, tiny_model_dir):
    session, traces, corpus = built
    index = json.loads((traces / INDEX_FILE).read_text())
    assert index["drafter_layers"] == [1] and all(e["complete"] for e in index["shards"])
    assert len(index["shards"]) > 1
    docs = [d for e in index["shards"] for d in e["docs"]]
    assert docs == list(range(TEXTS))
    splits = [s for e in index["shards"] for s in e["splits"]]
    # A file's texts are split by content, so the split does not depend on where pytest put the file.
    texts = [item["text"] for item in json.loads(corpus.read_text())]
    assert splits == [split_of_text(texts[d]) for d in docs] and {"train", "validation"} <= set(splits)
    shard = safetensors.torch.load_file(str(traces / index["shards"][0]["file"]))
    first = shard["doc"] == shard["doc"][0]
    ids = shard["input_ids"][first].long()
    # The stored layers:1 hidden state is what the layer-truncated drafter computes.
    drafter = session.target.truncated(1)
    expected = drafter.forward(ids, drafter.new_cache())
    full = session.target.forward(ids, session.target.new_cache())
    assert torch.allclose(shard["hidden_layers_1"][first].float(), expected, atol=1e-2, rtol=1e-2)
    assert torch.equal(shard["top1"][first].long(), torch.nn.functional.linear(full, session.target.head_weight).argmax(1))
    assert torch.equal(shard["next_token"][first][:-1], shard["input_ids"][first][1:])


def test_traces_resume_skips_finished_shards(built, tiny_model_dir, monkeypatch, tmp_path):
    session, traces, corpus = built
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    index = json.loads((traces / INDEX_FILE).read_text())
    kept, removed = traces / index["shards"][0]["file"], traces / index["shards"][1]["file"]
    before = kept.stat().st_mtime_ns
    content = removed.read_bytes()
    removed.unlink()
    prep_ok(["traces", tiny_model_dir, "--corpus", corpus, "-o", traces, "--shard-tokens", 400, "--drafter-layers", 1])
    assert kept.stat().st_mtime_ns == before
    assert removed.read_bytes() == content  # recomputed, bit for bit


def test_router_stage_and_onnx_torch_parity(built):
    session, _, _ = built
    stage = RouterStage.load(session.artifact)
    assert stage.params["hidden"] == "layers:1" and stage.params["steps"] == 6
    assert "val/recall@1" in stage.params["validation"]
    onnx, torch_runner = stage.runner("onnx"), stage.runner("torch")
    gen = torch.Generator().manual_seed(0)
    emb, hid = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen) * 150
    assert (onnx.scores(emb, hid) - torch_runner.scores(emb, hid)).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="engine"):
        RouterRunner(stage.tensors, stage.onnx_path, "tensorrt")


@pytest.mark.parametrize("method", ["dynaspec:layers:1:k=1", "dynaspec:layers:1:k=4:schedule=position:router=torch",
                                    "dynaspec:layers:1:k=2:overlap=1", "dynaspec:layers:1:k=1:context=0",
                                    "frspec:layers:1:20:gamma=3", "frspec:layers:1:20:context=0", "screenspec:layers:1"])
def test_cheap_drafter_heads_keep_greedy_output(built, method):
    assert_greedy_identity(built[0], method, shortlisted=not method.startswith("screenspec"))


def assert_greedy_identity(session, method: str, shortlisted: bool = True) -> None:
    """`method` decodes plain greedy decoding's tokens; a shortlisted drafter reports a shortlist fraction in (0, 1)."""
    run = build_method(session, method).decode
    head = session.full_head()
    for prompt in [torch.tensor([5, 9, 200, 31, 77]), torch.tensor([100, 4, 4, 18])]:
        expected, _ = generate_ar(session.target, head, prompt, 24, SamplingParams())
        tokens, stats = run(prompt, 24, SamplingParams(), torch.Generator().manual_seed(0))
        assert tokens == expected
        if shortlisted:
            assert 0 < stats.shortlist_fraction < 1 and stats.to_json()["shortlist_fraction"] == stats.shortlist_fraction


@pytest.mark.parametrize("method", ["dynaspec:int8:k=2", "dynaspec:int8:k=1:context=0:gamma=3+csv", "frspec:int8:20"])
def test_int8_drafter_with_shortlist_heads_keeps_greedy_output(built_final, method):
    assert_greedy_identity(built_final, method)


def test_generate_decodes_with_dynaspec_drafters(built, built_final, monkeypatch, tmp_path):
    """`runtime generate --method spec --drafter dynaspec:...` prints plain decoding's text."""
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    for session, drafter in ((built[0], "dynaspec:layers:1:k=2"), (built_final, "dynaspec:int8:k=2"),
                             (built[0], "frspec:layers:1:20")):
        args = ["generate", str(session.artifact.path), "--prompt", "w5 w9 w31", "--max-new-tokens", "12"]
        reference = CliRunner().invoke(runtime_main, [*args, "--method", "ar"])
        result = CliRunner().invoke(runtime_main, [*args, "--method", "spec", "--drafter", drafter])
        assert reference.exit_code == 0 and result.exit_code == 0, result.output
        assert reference.stdout.strip() and result.stdout == reference.stdout


def test_router_refuses_a_drafter_it_was_not_trained_for(built, built_final):
    with pytest.raises(ValueError, match="--hidden final"):
        build_method(built[0], "dynaspec:int8")
    with pytest.raises(ValueError, match="--hidden layers:1"):
        build_method(built_final, "dynaspec:layers:1")


def test_routed_drafter_samples_exactly_in_the_loop(built):
    """Sampled speculative output follows the target although the drafter's q lives on a shortlist: the
    token a verify round decides over the routed drafter's draft, by a chi-square test."""
    assert_second_token_follows_the_target(built[0], "dynaspec:layers:1:k=3:gamma=2", [5, 9, 200])


def test_router_overlap_routes_like_the_sequential_drafter(built):
    """The router in a second thread sees the same inputs: the same shortlists, step for step."""
    session, _, _ = built
    prompt = torch.tensor([5, 9, 200, 31, 77])
    stats = [build_method(session, f"dynaspec:layers:1:k=3:overlap={o}").decode(
        prompt, 20, SamplingParams(), torch.Generator().manual_seed(0))[1] for o in (0, 1)]
    assert stats[0].shortlist == stats[1].shortlist


def test_screen_draft_head_drafts_from_the_int8_logits(built):
    session, _, _ = built
    from artifacts.format import Stage
    from runtime.heads import ScreenBound
    from runtime.heads.screen_draft import ScreenDraftHead

    target = session.target
    head = ScreenDraftHead(ScreenBound.from_stage(target.head_weight, target.head_bias, session.artifact.read_stage(Stage.SCREEN)))
    hidden = torch.randn(4, target.hidden_size, generator=torch.Generator().manual_seed(0)) * 10
    approx, exact = head.logits(hidden), FullHead(target.head_weight, target.head_bias).logits(hidden)
    assert approx.shape == exact.shape and (approx - exact).abs().max() < 0.05 * exact.abs().max()
    assert torch.equal(head.select(hidden, SamplingParams()), approx.argmax(1))


def test_prep_all_with_router_runs_the_recipe(built, tiny_model_dir, tmp_path, monkeypatch, recwarn):
    """prep all --with-router: traces + a multi-label router from the recipe's [router] section, without
    Lightning's internal deprecation warning (prep.router_trainer.quiet_lightning)."""
    _, _, corpus = built
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(recipes, "DEFAULTS", recipes.Recipe(
        cluster=recipes.ClusterRecipe(clusters=8, iterations=2, top_m_bias=3),
        router=recipes.RouterRecipe(corpus=str(corpus), max_tokens=1500, max_tokens_per_text=64, drafter_layers=1,
                                    hidden="final", clusters=16, width=16, max_steps=3, batch_size=64, loss="multilabel")))
    art, traces = tmp_path / "art", tmp_path / "traces"
    prep_ok(["all", tiny_model_dir, "-o", art, "--with-router", "--traces", traces])
    session = open_session(art, progress=False)
    assert {"clusters", "screen", "screen4", "router"} <= set(session.artifact.stages)  # the recipe's head stages too
    params = RouterStage.load(session.artifact).params
    assert params["loss"] == "multilabel" and params["hidden"] == "final" and params["steps"] == 3
    assert 1400 <= sum(e["tokens"] for e in json.loads((traces / INDEX_FILE).read_text())["shards"]) <= 1500
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]
