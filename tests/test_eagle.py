"""The EAGLE-3 draft head on a tiny random 6-layer Llama: features, Lightning training, the stage, and
the `eagle` drafter's exactness (greedy identity with plain decoding, exact sampling)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil

import pytest
import torch
from click.testing import CliRunner

from artifacts import ArtifactError
from artifacts.format import Stage
from prep.cli import main as prep_main
from prep.drafter_train import chain_acceptance, mlp_width
from prep.recipes import DEFAULTS
from prep.traces import parse_feature_layers
from runtime import api
from runtime.backends.rows import Rows
from runtime.common.sampling import SamplingParams
from runtime.drafters.eagle import EagleDrafter, KernelHead, KernelWeights, head_from_stage, q8_0
from runtime.drafters.eagle_head import EagleConfig, EagleHead, feature_layers
from runtime.drafters.lookup import LookupDrafter
from runtime.heads import FullHead
from runtime.kernels import dequantize
from runtime.loops.decode import generate_ar
from runtime.methods import build_method
from runtime.session import open_session
from factories import prep_ok, save_tiny_model_dir
from sampling_checks import assert_second_token_follows_the_target
from serve_factories import alone, model_name, posted_in_one_batch, running

TEXTS = 60


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prep cluster + prep traces --features + prep train-drafter on a tiny 6-layer Llama, once for the module."""
    root = tmp_path_factory.mktemp("eagle")
    model = save_tiny_model_dir(root / "model", layers=6)
    rng = random.Random(0)
    corpus = root / "corpus.json"
    corpus.write_text(json.dumps([{"text": " ".join(f"w{rng.randrange(2, 40)}" for _ in range(rng.randrange(12, 40)))}
                                  for _ in range(TEXTS)]))
    art, features = root / "art", root / "features"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(root / "cache"))
        prep_ok(["cluster", model, "-o", art, "--clusters", 8])
        prep_ok(["traces", model, "--corpus", corpus, "-o", features, "--shard-tokens", 400, "--features"])
        out = prep_ok(["train-drafter", art, "--features", features, "--draft-vocab", 48, "--epochs", 1,
                      "--devices", 1, "--accelerator", "cpu"])
        session = open_session(art, backend="lean", progress=False)
    return session, features, out


def test_train_drafter_trains_at_the_recipe_precision(trained):
    session, _, _ = trained
    from prep.drafter_recipe import training_precision
    from runtime.kernels import cpu_flags

    expected = training_precision(DEFAULTS.drafter.precision, "cpu", cpu_flags())  # the tiny model has no recipe; trained on the cpu
    assert session.artifact.stage_params(Stage.DRAFTER)["precision"] == expected


def test_features_by_hand_default_to_the_recipes_data_settings(trained):
    """prep traces --features without --max-tokens or --drafter-layers traces a responses file whole and stores
    no layers:N states, as prep all --with-drafter's folders (not the router's 40,000-token budget and depth)."""
    from prep.drafter_recipe import RESPONSES_MAX_TOKENS
    from prep.trace_files import INDEX_FILE

    index = json.loads((trained[1] / INDEX_FILE).read_text())
    assert index["max_tokens"] == RESPONSES_MAX_TOKENS and index["drafter_layers"] == []


def assert_features_are_the_taps(session, features, layers: list[int]) -> None:
    """The features folder holds `layers`' inputs: its first text's features equal a decoding cache's taps."""
    from prep.trace_files import load_traces

    index, t = load_traces(features, ["features", "input_ids", "doc"])
    assert index["feature_layers"] == layers
    first = t["doc"] == t["doc"][0]
    ids = t["input_ids"][first].long()
    cache = session.target.new_cache()
    cache.tap(tuple(layers))
    session.target.forward(ids, cache)
    # Traces come from transformers' fp32 forward, the tap from the native ladder: the same model, to rounding.
    torch.testing.assert_close(cache.features[: ids.numel()], t["features"][first].float(), atol=2e-2, rtol=2e-2)


def test_features_are_the_residual_stream_entering_the_tapped_layers(trained):
    session, features, _ = trained
    assert list(feature_layers(6)) == [2, 3, 3]
    assert_features_are_the_taps(session, features, [2, 3, 3])


def test_feature_layers_choose_the_taps_the_head_is_trained_and_exported_with(trained, tmp_path):
    """prep traces --features --feature-layers L,M,H stores those layers' inputs; train-drafter takes its taps
    from the features, and export-drafter names them for vLLM and llama.cpp."""
    session, _, _ = trained
    model, corpus = session.artifact.path.parent / "model", session.artifact.path.parent / "corpus.json"
    features, art, out = tmp_path / "features", tmp_path / "art", tmp_path / "head"
    shutil.copytree(session.artifact.path, art)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
        prep_ok(["traces", model, "--corpus", corpus, "-o", features, "--features", "--feature-layers", "1,3,5"])
        prep_ok(["train-drafter", art, "--features", features, "--draft-vocab", 48, "--epochs", 1, "--force",
                 "--devices", 1, "--accelerator", "cpu"])
        prep_ok(["export-drafter", art, "-o", out])
    assert_features_are_the_taps(session, features, [1, 3, 5])
    assert open_session(art, backend="lean", progress=False).artifact.stage_params(Stage.DRAFTER)["feature_layers"] == [1, 3, 5]
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]


@pytest.mark.parametrize("num_layers", [6, 7, 8, 24, 30])
def test_the_default_feature_layers_are_a_value_the_option_takes(num_layers):
    """EAGLE-3's default, written out, parses to itself, also where it names a layer twice (6 layers: 2,3,3)."""
    default = feature_layers(num_layers)
    assert parse_feature_layers(",".join(map(str, default)), num_layers) == default
    assert parse_feature_layers(None, num_layers) == default


@pytest.mark.parametrize("args, fragment", [
    (["--feature-layers", "1,3,5"], "add --features"),
    (["--features", "--feature-layers", "3,1,5"], "three layers in 0..5, lowest first"),
    (["--features", "--feature-layers", "1,3,6"], "three layers in 0..5, lowest first"),
    (["--features", "--feature-layers", "1,3"], "e.g. 2,3,3"),
    (["--features", "--feature-layers", "1,x,5"], "three layers in 0..5"),
    (["--features", "--feature-layers", "1,,5"], "three layers in 0..5"),
])
def test_bad_feature_layers_are_refused_in_one_line_before_any_write(trained, tmp_path, args, fragment):
    session, _, _ = trained
    model, corpus = session.artifact.path.parent / "model", session.artifact.path.parent / "corpus.json"
    result = CliRunner().invoke(prep_main, ["traces", str(model), "--corpus", str(corpus), "-o", str(tmp_path / "f"), *args])
    assert result.exit_code != 0 and fragment in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "f").exists()


def test_training_writes_a_drafter_stage_that_reports_its_validation(trained):
    session, _, out = trained
    params = session.artifact.stage_params("drafter")
    assert params["draft_vocab"] == 48 and params["steps"] == 3
    width = session.target.config.intermediate_size  # 128: a quarter, the recipe's default, is one block of 32
    assert params["intermediate_size"] == mlp_width(width, DEFAULTS.drafter.mlp_width) == 32
    assert 0 < params["draft_vocab_coverage"] <= 1
    assert {f"val/top1@{j}" for j in range(3)} <= set(params["validation"])
    validation = params["validation"]
    assert validation["val/chain@0"] == pytest.approx(validation["val/top1@0"])  # the first draft: every row counts
    assert "validation top-1 by step" in out and "a greedy chain's acceptance by position" in out


def test_chain_acceptance_counts_only_rows_a_chain_would_have_fed():
    """Position j + 1: of the rows whose text followed the target through steps 1..j, those whose drafts 1..j + 1 all hit."""
    hits = [torch.tensor(h, dtype=torch.bool) for h in ([1, 1, 1, 0, 1], [1, 0, 1, 1, 1], [1, 1, 0, 1, 0])]
    follows = [torch.tensor(f, dtype=torch.bool) for f in ([0, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1])]
    (first, n1), (second, n2), (third, n3) = chain_acceptance(hits, follows)
    assert (first, n1) == (4 / 5, 5)  # step 0's input is the known next token: every row counts
    assert (second, n2) == (2 / 4, 4)  # rows 0-3 followed; rows 0 and 2 hit twice
    assert (third, n3) == (1 / 3, 3)  # rows 0-2 followed twice; row 0 hit three times


def test_kernel_head_matches_the_training_module(trained):
    """The runtime's Q8_0 head computes what the nn.Module computes with those Q8_0 weights, over a catch-up and a draft step."""
    session, _, _ = trained
    art = session.artifact
    head = q8_module(art)  # the module on the values the kernels read, so only summation order differs
    gen = torch.Generator().manual_seed(0)
    d = head.config.hidden_size
    features, embeds = torch.randn(5, 3 * d, generator=gen) * 3, torch.randn(6, d, generator=gen)
    with torch.no_grad():
        reference = head.unrolled(features, embeds, 2)  # step 0 rows 0..4; step 1 row t reads row t's step-0 output
    runner = KernelHead(KernelWeights.of(head))
    out = runner.step(embeds[:5], runner.fuse(features))
    torch.testing.assert_close(out, reference[0], atol=1e-4, rtol=1e-4)
    second = runner.step(embeds[5:6], out[-1:])  # row 4's second step, after all of step 0's rows
    torch.testing.assert_close(second, reference[1][-1:], atol=1e-4, rtol=1e-4)


def test_the_compiled_layer_gives_the_bits_of_its_ops_one_at_a_time(trained):
    """KernelHead's layer as one compiled call (layer_plan.h's forward_input) equals the same kernels called one
    at a time from Python, bit for bit, over a catch-up, a chain step and a token tree's level."""
    weights = KernelWeights.of(q8_module(trained[0].artifact))
    if weights.plan is None:
        pytest.skip("no compiled kernels on this machine")
    d = weights.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    features, embeds = torch.randn(5, 3 * d, generator=gen) * 3, torch.randn(8, d, generator=gen)
    outs = []
    for w in (weights, dataclasses.replace(weights, plan=None)):
        runner = KernelHead(w)
        caught_up = runner.step(embeds[:5], runner.fuse(features))  # rows 0..4
        chained = runner.step(embeds[5:6], caught_up[-1:])  # row 5: node 0 of a tree over the prefix of 5
        level = runner.step(embeds[6:8], torch.cat([chained, chained]), Rows(6, 2, 5, [[0, 1], [0, 2]]))  # node 0's children
        outs.append(torch.cat([caught_up, chained, level]))
    assert torch.equal(outs[0], outs[1])


# The tiny head is near uniform over its 48 rows (top-1 ~0.029): conf=0.025 drafts one token a round.
@pytest.mark.parametrize("method", ["spec:eagle", "spec:eagle:gamma=3", "spec:eagle:frspec=16+csv", "spec:eagle:adaptive",
                                    "spec:eagle:lookup:gamma=4", "spec:eagle:frspec=24:lookup+csv", "spec:eagle:conf=0.025",
                                    "spec:eagle:conf=0.025:lookup", "spec:eagle:head=1:lookup+csv"])
def test_eagle_greedy_equals_plain_decoding(trained, method):
    assert_greedy_identity(trained[0], method, random.Random(1), prompts=4, tokens=40)


def assert_greedy_identity(session, method: str, rng: random.Random, prompts: int, tokens: int) -> None:
    """`method` decodes plain decoding's tokens on random prompts, and drafts some."""
    target, head = session.target, FullHead(session.target.head_weight, session.target.head_bias)
    built, drafted = build_method(session, method), 0
    for _ in range(prompts):
        prompt = torch.tensor([2] + [rng.randrange(2, 40) for _ in range(rng.randrange(3, 30))])
        reference, _ = generate_ar(target, head, prompt, tokens)
        decoded, stats = built.decode(prompt, tokens, SamplingParams(), None)
        assert decoded == reference
        drafted += stats.spec.drafted
    assert drafted > 0


def test_the_default_method_drafts_with_the_head_where_the_artifact_has_one(trained, tmp_path):
    """generate without --method: the head beside lookup on an artifact with a head, lookup without one;
    serve without --method: lookup either way."""
    session = trained[0]
    engine = api.Engine(session)
    assert str(engine.default_method()) == "spec:eagle:conf=0.3:head=1:lookup+csv:screen"  # prep cluster writes the int8 screen
    assert str(engine.default_method(serving=True)) == "spec:lookup+csv:screen"
    # The tiny head is near uniform, so conf=0.3 leaves the drafting to lookup; a confident head drafts itself.
    assert_greedy_identity(session, str(engine.default_method()), random.Random(2), prompts=3, tokens=40)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
        prep_ok(["cluster", session.artifact.path.parent / "model", "-o", tmp_path / "bare", "--clusters", 8])
        bare = open_session(tmp_path / "bare", backend="lean", progress=False)
    assert str(api.Engine(bare).default_method()) == "spec:lookup+csv:screen"


def test_the_server_decodes_with_the_head_under_load_as_alone(trained):
    """runtime serve over an artifact with a head: generate's default there (the head beside lookup) and a
    chain the head drafts give every request the tokens it gets alone, with the others in the same forwards."""
    engine = api.Engine(trained[0])
    prompts = [("w5 w9 w31 w5 w9 w17", 24), ("w40 w41 w42", 30), ("w7 w7 w8 w9 w10 w7 w7", 17)]
    for method in ("spec:eagle:conf=0.3:head=1:lookup+csv", "spec:eagle:conf=0.025"):
        expected = [alone(engine, prompt, method, max_tokens=n) for prompt, n in prompts]
        bodies = [{"model": model_name(engine), "prompt": prompt, "max_tokens": n, "temperature": 0,
                   "return_token_ids": True, "method": method} for prompt, n in prompts]
        with running(engine, start=False) as (url, scheduler):
            answers = posted_in_one_batch(url, scheduler, bodies)
            assert scheduler.metrics.peak_fused == len(prompts)  # they ran in one forward
        assert [answer["choices"][0]["token_ids"] for answer in answers] == expected, method


def test_a_session_requantizes_the_head_once_per_shortlist(trained, monkeypatch):
    """Methods built over one session (a server's requests) share the head's Q8_0 weights: one
    requantization per FR-Spec shortlist, none for a method built again."""
    session = open_session(trained[0].artifact.path, backend="lean", progress=False)
    made = []
    original = KernelWeights.of
    monkeypatch.setattr(KernelWeights, "of", lambda head, shortlist=None: made.append(shortlist) or original(head, shortlist))
    for method in ["spec:eagle", "spec:eagle", "spec:eagle:lookup", "spec:eagle:frspec=16", "spec:eagle:frspec=16+csv"]:
        build_method(session, method)
    assert [None if rows is None else rows.numel() for rows in made] == [None, 16]


def q8_module(art) -> EagleHead:
    """The stage's head with every Linear weight replaced by its Q8_0 values (what KernelHead reads)."""
    head = head_from_stage(art.read_stage("drafter"), EagleConfig.from_params(art.stage_params("drafter")))
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(q8_0(module.weight)))
    return head


def test_drafts_are_the_training_modules_chain_on_the_targets_features(trained):
    """Decode-time alignment: the drafter's chain is the module's greedy chain over the same features and tokens
    (row t reads the features at t and the token t + 1; each draft feeds the next step)."""
    session, _, _ = trained
    head = q8_module(session.artifact)
    drafter = EagleDrafter(session.target, KernelWeights.of(head))
    context = [2] + [random.Random(5).randrange(2, 40) for _ in range(14)]
    cache = session.target.new_cache()
    drafter.follow(cache)
    drafter.reset(context, SamplingParams(), None)
    session.target.forward(torch.tensor(context[:-1]), cache)
    drafts = drafter.propose(context, 3).tokens.tolist()
    features = cache.features[: len(context) - 1]
    embeds = session.target.embedding_rows(torch.tensor(context[1:] + drafts[:2]))
    with torch.no_grad():
        outs = head.unrolled(features, embeds, 3)
    chain = [int(head.draft_ids()[head.logits(out[-1:]).argmax()]) for out in outs]
    assert drafts == chain


def test_a_confident_chain_stops_where_its_path_score_falls_below_conf(trained):
    """eagle:conf=P drafts the unconditioned chain's longest prefix whose running product of the head's
    top-1 probabilities stays >= P (conf=1 drafts nothing: no probability over many rows reaches 1)."""
    session, _, _ = trained
    weights = KernelWeights.of(q8_module(session.artifact))
    context = [2] + [random.Random(7).randrange(2, 40) for _ in range(14)]

    def chain(confidence: float) -> tuple[list[int], list[float]]:
        drafter = EagleDrafter(session.target, weights, min_confidence=confidence)
        cache = session.target.new_cache()
        drafter.follow(cache)
        drafter.reset(context, SamplingParams(), None)
        session.target.forward(torch.tensor(context[:-1]), cache)
        drafts = drafter.propose(context, 6).tokens.tolist()
        head, probs, out, embed = drafter.head, [], drafter.out, drafter.embed
        for token in drafts:  # replay the chain for its probabilities
            probs.append(head.top1(out, embed)[1])
            embed = session.target.embedding_rows(torch.tensor([token]))
            out = head.step(embed, out)
        return drafts, probs

    full, probs = chain(0.0)
    scores = torch.tensor(probs, dtype=torch.float64).cumprod(0).tolist()
    assert len(full) == 6 and scores[0] > scores[1] > scores[3] > 0
    for kept, confidence in [(1, (scores[0] + scores[1]) / 2), (3, (scores[2] + scores[3]) / 2), (0, 1.0)]:
        assert chain(confidence)[0] == full[:kept]


def test_head_h_cuts_the_heads_chain_but_not_lookups_match(trained):
    """eagle:head=H: where lookup finds no match the head drafts at most H tokens (the first H of its
    uncut chain); where it finds one, the match keeps the round's full length."""
    session, _, _ = trained
    weights = KernelWeights.of(q8_module(session.artifact))

    def propose(context: list[int], head_drafts: int | None, lookup: bool) -> list[int]:
        drafter = EagleDrafter(session.target, weights, LookupDrafter() if lookup else None, head_drafts=head_drafts)
        cache = session.target.new_cache()
        drafter.follow(cache)
        drafter.reset(context, SamplingParams(), None)
        session.target.forward(torch.tensor(context[:-1]), cache)
        return drafter.propose(context, 5).tokens.tolist()

    fresh = [2] + [random.Random(9).randrange(2, 40) for _ in range(14)]
    full = propose(fresh, None, lookup=False)
    assert len(full) == 5 and propose(fresh, 2, lookup=False) == full[:2]
    repeating = [2] + [5, 6, 7, 8, 9, 10, 11] * 3 + [5, 6]  # lookup continues 7, 8, 9, ...
    matched = propose(repeating, None, lookup=True)
    assert matched[:3] == [7, 8, 9] and propose(repeating, 1, lookup=True) == matched


def test_a_head_from_another_artifact_of_the_model_drafts_exactly(trained, tmp_path):
    """eagle:from=ART: a session over an artifact without a head drafts with another artifact's, which
    is how two heads are compared over one loaded target; the methods share nothing but the target."""
    model = trained[0].artifact.path.parent / "model"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
        prep_ok(["cluster", model, "-o", tmp_path / "bare", "--clusters", 8])
        session = open_session(tmp_path / "bare", backend="lean", progress=False)
    source = trained[0].artifact.path
    assert_greedy_identity(session, f"spec:eagle:from={source}:conf=0.025", random.Random(1), prompts=3, tokens=30)
    with pytest.raises(ValueError, match="prep train-drafter"):
        build_method(session, "spec:eagle")  # its own artifact still has no head


def test_a_head_from_another_models_artifact_is_refused_in_one_line(trained, tmp_path):
    model = save_tiny_model_dir(tmp_path / "tied", tied=True, layers=6)  # another head's weights: another fingerprint
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
        prep_ok(["cluster", model, "-o", tmp_path / "art", "--clusters", 8])
        session = open_session(tmp_path / "art", backend="lean", progress=False)
    with pytest.raises(ValueError, match=f"eagle:from={trained[0].artifact.path} was built for .*; name an artifact of"):
        build_method(session, f"spec:eagle:from={trained[0].artifact.path}")
    with pytest.raises(ArtifactError, match="is not a specvocab artifact"):
        build_method(session, f"spec:eagle:from={tmp_path / 'nowhere'}")


def test_eagle_refuses_an_artifact_without_the_stage(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model", layers=6)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
        prep_ok(["cluster", model, "-o", tmp_path / "art", "--clusters", 8])
        session = open_session(tmp_path / "art", backend="lean", progress=False)
    with pytest.raises(ValueError, match="prep train-drafter"):
        build_method(session, "spec:eagle")
    refused = CliRunner().invoke(prep_main, ["train-drafter-router", str(tmp_path / "art")])
    assert refused.exit_code != 0 and "has no draft head to route; run: prep train-drafter" in refused.output
    assert "Traceback" not in refused.output and not (tmp_path / "art" / "drafter_router.safetensors").exists()


def test_export_is_an_eagle3_checkpoint_folder(trained, tmp_path):
    """config.json names LlamaForCausalLMEagle3 with the head's shape; the weights carry the checkpoint names and d2t."""
    import safetensors.torch

    session, _, _ = trained
    out = tmp_path / "head"
    prep_ok(["export-drafter", session.artifact.path, "-o", out])
    config = json.loads((out / "config.json").read_text())
    params = session.artifact.stage_params("drafter")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == params["draft_vocab"] == 48
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == params["feature_layers"]  # vLLM, SGLang
    assert config["eagle_aux_hidden_state_layer_ids"] == params["feature_layers"]  # llama.cpp's converter
    weights = safetensors.torch.load_file(out / "model.safetensors")
    stage = session.artifact.read_stage("drafter")
    assert "draft_order" not in weights and "midlayer.self_attn.q_proj.weight" in weights
    assert weights["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["d2t"], stage["d2t"]) and torch.equal(weights["t2d"], stage["t2d"])
    assert torch.equal(weights["d2t"] + torch.arange(48), torch.nonzero(stage["t2d"]).view(-1))
    mask = os.umask(0o022)
    os.umask(mask)
    assert {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()} == {
        "config.json": 0o666 & ~mask, "model.safetensors": 0o666 & ~mask}  # shared like any output, not 0600
    result = CliRunner().invoke(prep_main, ["export-drafter", str(session.artifact.path), "-o", str(out)])
    assert result.exit_code != 0 and "--force" in result.output


def test_export_loads_in_readers_written_from_vllm_and_sglang(trained, tmp_path):
    """Every exported tensor lands on a parameter of the shape vLLM's and SGLang's one-layer head allocate from
    config.json, every parameter is filled, and both map the draft rows to the stage's target ids."""
    import safetensors.torch

    from eagle3_loaders import sglang_read, vllm_read

    session, _, _ = trained
    out = tmp_path / "head"
    prep_ok(["export-drafter", session.artifact.path, "-o", out])
    config = json.loads((out / "config.json").read_text())
    weights = safetensors.torch.load_file(out / "model.safetensors")
    draft_ids = torch.nonzero(session.artifact.read_stage("drafter")["t2d"]).view(-1)  # [Vd], ascending
    assert torch.equal(vllm_read(config, weights) + torch.arange(draft_ids.numel()), draft_ids)
    assert torch.equal(sglang_read(config, weights), draft_ids)
    renamed = {("midlayer.self_attn.q_proj.weight" if k == "midlayer.self_attn.k_proj.weight" else k): v
               for k, v in weights.items() if k != "midlayer.self_attn.q_proj.weight"}  # k's tensor where q's goes
    with pytest.raises(AssertionError, match="qkv_proj.weight shard q"):
        vllm_read(config, renamed)


@pytest.mark.parametrize("method", ["spec:eagle:gamma=2", "spec:eagle:dynaspec=2:gamma=2", "swarm:eagle:3:gamma=2:nodes=5",
                                    "spec:eagle:head=1:lookup:gamma=2"])  # the last: the default's drafter, uncut
def test_sampled_eagle_follows_the_target_distribution(request, method):
    """At temperature 0.7 the token a verify round decides over eagle's draft follows the target's exact
    marginal (tests/sampling_checks.py)."""
    session = request.getfixturevalue("routed")[0] if "dynaspec" in method else request.getfixturevalue("trained")[0]
    assert_second_token_follows_the_target(session, method, [2, 11, 7, 30, 5, 19])


@pytest.fixture(scope="module")
def routed(trained):
    """prep train-drafter-router on the trained head (6 clusters of its 48 rows), once for the module."""
    session, _, _ = trained
    out = prep_ok(["train-drafter-router", session.artifact.path, "--clusters", 6, "--max-steps", 40, "--devices", 1,
                   "--accelerator", "cpu"])
    return open_session(session.artifact.path, backend="lean", progress=False), out


def test_the_drafter_router_stage_groups_the_heads_rows_and_reports_recall(routed):
    session, out = routed
    art = session.artifact
    params, tensors = art.stage_params("drafter_router"), art.read_stage("drafter_router")
    assert params["clusters"] == 6 and tensors["cluster_labels"].shape == (48,)
    assert sorted(tensors["cluster_labels"].unique().tolist()) == list(range(6))
    recall = [params["validation"][f"val/recall@{k}"] for k in (1, 2, 4)]
    assert 0 < recall[0] <= recall[1] <= recall[2] <= 1 and params["train_rows"] > params["validation_rows"] > 0
    assert torch.isfinite(torch.tensor(params["validation"]["val/loss"]))
    assert params["drafter_sha256"] == art.manifest.stages["drafter"].files["drafter.safetensors"].sha256
    assert "k=1: " in out and "wrote stage drafter_router" in out


@pytest.mark.parametrize("method", ["spec:eagle:dynaspec=2", "spec:eagle:dynaspec=1:gamma=3+csv",
                                    "spec:eagle:dynaspec=3:conf=0.025:lookup"])
def test_routed_eagle_greedy_equals_plain_decoding(routed, method):
    assert_greedy_identity(routed[0], method, random.Random(3), prompts=3, tokens=30)


@pytest.mark.parametrize("method", ["swarm:eagle:2", "swarm:eagle:3:gamma=3:nodes=8+csv", "swarm:eagle:frspec=24:4:nodes=12",
                                    "swarm:eagle:dynaspec=2:2:nodes=6"])
def test_eagle_trees_greedy_equal_plain_decoding(routed, method):
    assert_greedy_identity(routed[0], method, random.Random(4), prompts=3, tokens=30)


def following(session, drafter, seed: int) -> list[int]:
    """A random context whose prefix (all but its last token) the target has run with `drafter` following its cache."""
    context = [2] + [random.Random(seed).randrange(2, 40) for _ in range(14)]
    cache = session.target.new_cache()
    drafter.follow(cache)
    drafter.reset(context, SamplingParams(), None)
    session.target.forward(torch.tensor(context[:-1]), cache)
    return context


def test_an_eagle_tree_is_eagle2s_best_scored_nodes_and_k1_is_the_chain(trained):
    """Level 1 is the head's top-K at the root; every node's score is its path's product of head probabilities,
    the kept nodes are the best `budget`, parents first; with K = 1 the tree is the drafter's chain."""
    from runtime.drafters.eagle_trees import EagleTrees

    session, _, _ = trained
    weights = KernelWeights.of(q8_module(session.artifact))
    chain_drafter = EagleDrafter(session.target, weights)
    context = following(session, chain_drafter, 13)
    chain = chain_drafter.propose(context, 4).tokens.tolist()
    one = EagleTrees(EagleDrafter(session.target, weights), 1)
    tree = one.tree(following(session, one, 13), 4, 8)
    assert tree.tokens.tolist() == chain and tree.parents.tolist() == [-1, 0, 1, 2]

    trees = EagleTrees(EagleDrafter(session.target, weights), 3)
    context = following(session, trees, 13)
    tree = trees.tree(context, 3, 7)
    head = trees.drafter.head
    ids, probs = head.top_k(trees.drafter.out, trees.drafter.embed, 3)
    level1 = [i for i, p in enumerate(tree.parents.tolist()) if p == -1]
    assert tree.size == 7 and tree.tokens[level1].tolist() == ids[0][: len(level1)] and tree.tokens[0] == chain[0]
    assert torch.allclose(tree.scores[level1].exp(), torch.tensor(probs[0][: len(level1)], dtype=torch.float64))
    for node, parent in enumerate(tree.parents.tolist()):
        assert parent < node and (parent == -1 or tree.scores[node] <= tree.scores[parent])
    assert head.length == trees.drafter.fed  # the round's nodes are cropped from the head's cache


def test_swarm_eagle_refuses_lookup_and_conf_in_one_line(trained):
    for method, word in [("swarm:eagle:lookup:2", "drop lookup"), ("swarm:eagle:conf=0.4:2", "drop conf=P"),
                         ("swarm:eagle:head=1:2", "drop head=H"),
                         ("swarm:eagle:conf=0.4:head=1:lookup:2", "drop lookup, conf=P, head=H")]:
        with pytest.raises(ValueError, match=word):
            build_method(trained[0], method)


def routed_chain(session, k: int, seen: list | None = None) -> list[int]:
    """The eagle:dynaspec=k drafter's chain of 4 over a fixed context (seen: each draft's scored token ids)."""
    from runtime.drafters.eagle import ClusterRouter, HeadRouterStage

    stage = HeadRouterStage.load(session.artifact)
    weights = KernelWeights.of(q8_module(session.artifact), stage.order)
    router = ClusterRouter(stage.runner, stage.starts, k)
    if seen is not None:
        rows = router.rows
        router.rows = lambda embed, out: seen.append(weights.token_ids[r := rows(embed, out)].tolist()) or r
    drafter = EagleDrafter(session.target, weights, router=router)
    context = [2] + [random.Random(11).randrange(2, 40) for _ in range(14)]
    cache = session.target.new_cache()
    drafter.follow(cache)
    drafter.reset(context, SamplingParams(), None)
    session.target.forward(torch.tensor(context[:-1]), cache)
    return drafter.propose(context, 4).tokens.tolist()


def test_a_routed_head_drafts_from_its_routers_clusters_and_all_clusters_draft_the_full_chain(routed):
    session, _ = routed
    seen = []
    for token, scored in zip(routed_chain(session, 2, seen), seen):
        assert token in scored and len(scored) < 48
    full = EagleDrafter(session.target, KernelWeights.of(q8_module(session.artifact)))
    context = [2] + [random.Random(11).randrange(2, 40) for _ in range(14)]
    cache = session.target.new_cache()
    full.follow(cache)
    full.reset(context, SamplingParams(), None)
    session.target.forward(torch.tensor(context[:-1]), cache)
    assert routed_chain(session, 6) == full.propose(context, 4).tokens.tolist()


def test_routed_eagle_refuses_a_missing_stale_or_too_small_router_in_one_line(routed, trained, tmp_path):
    session, _ = routed
    with pytest.raises(ValueError, match="exceeds the router's 6 clusters"):
        build_method(session, "spec:eagle:dynaspec=7")
    stale = tmp_path / "stale"
    shutil.copytree(session.artifact.path, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    manifest["stages"]["drafter_router"]["params"]["drafter_sha256"] = "0" * 64
    (stale / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="another draft head; run: prep train-drafter-router .* --force"):
        build_method(open_session(stale, backend="lean", progress=False), "spec:eagle:dynaspec=2")
    del manifest["stages"]["drafter_router"]
    (stale / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="needs stage drafter_router; run: prep train-drafter-router"):
        build_method(open_session(stale, backend="lean", progress=False), "spec:eagle:dynaspec=2")


@pytest.mark.parametrize("text, fix", [("eagle:frspec=0", "frspec=N"), ("eagle:lookup:lookup", "at most once"),
                                       ("eagle:dynaspec=0", "dynaspec=K"), ("eagle:frspec=8:dynaspec=2", "frspec=N or"),
                                       ("eagle:tree", "frspec=N"), ("eagle:frspec=4:frspec=8", "at most once"),
                                       ("eagle:conf=-0.1", "0 <= P <= 1"), ("eagle:conf=1.5", "conf=P"),
                                       ("eagle:conf=high", "conf=P"), ("eagle:conf=0.2:conf=0.3", "at most once"),
                                       ("eagle:from=", "from=ART"), ("eagle:from=a:from=b", "at most once"),
                                       ("eagle:head=0", "head=H"), ("eagle:head=1:head=2", "at most once")])
def test_eagle_arguments_are_refused_in_one_line(text, fix):
    from runtime.drafters import parse_drafter

    with pytest.raises(ValueError, match=fix):
        parse_drafter(text)


def test_eagle_arguments_have_one_spelling():
    from runtime.drafters import DrafterSpec, EagleOptions, parse_drafter

    assert parse_drafter("eagle:lookup:frspec=0016") == DrafterSpec("eagle", EagleOptions(frspec=16, lookup=True))
    assert str(parse_drafter("eagle:lookup:frspec=0016")) == "eagle:frspec=16:lookup"
    assert str(parse_drafter("eagle:lookup:conf=0.250:frspec=16")) == "eagle:frspec=16:conf=0.25:lookup"
    assert parse_drafter("eagle:conf=.3").options == EagleOptions(confidence=0.3)
    assert str(parse_drafter("eagle:lookup:conf=0.4:dynaspec=08")) == "eagle:dynaspec=8:conf=0.4:lookup"
    assert parse_drafter("eagle:conf=0") == parse_drafter("eagle") and str(parse_drafter("eagle:conf=0.0")) == "eagle"
    assert str(parse_drafter("eagle:lookup:conf=0.40:from=art/q3")) == "eagle:from=art/q3:conf=0.4:lookup"
    assert parse_drafter("eagle:from=art/q3").options == EagleOptions(source="art/q3")
    assert str(parse_drafter("eagle:lookup:head=01:conf=0.4")) == "eagle:conf=0.4:head=1:lookup"
    assert parse_drafter("eagle:head=2").options == EagleOptions(head_drafts=2)
