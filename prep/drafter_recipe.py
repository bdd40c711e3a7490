"""The draft head's recipe end to end (`prep all --with-drafter`): the target's own responses, their features, training.

A recipe's [drafter] section names the data: `responses` ("SOURCE:PROMPTS", the target's own greedy
responses to that many training prompts of prep responses' sources) and `corpora` ("CORPUS:TOKENS",
raw text of ShareGPT or the standard library's source, never HumanEval). Each becomes a features
folder under one data folder (FEATURES/responses-SOURCE-N.json, FEATURES/self-SOURCE, FEATURES/CORPUS),
the same files the separate commands write (docs/draft-head.md, "Making one"). A rerun reuses what is
there: a responses file of the same name, the responses an interrupted run finished, every intact
trace shard; then the head trains on all the folders with the recipe's epochs and draft vocabulary
and stage `drafter` is written.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from prep.recipes import DrafterRecipe, RouterRecipe
from prep.responses import NEW_TOKENS, SOURCES as RESPONSE_SOURCES
from prep.traces import CODE_CORPUS, named_corpus
from runtime.common.checks import is_digits

RAW_CORPORA = ("sharegpt", CODE_CORPUS)  # HumanEval stays held out of every training set
RESPONSES_MAX_TOKENS = 1_000_000  # a responses file is traced whole (its texts are cut per text only)


@dataclass(frozen=True)
class FeatureSet:
    """One features folder of the recipe: raw text (`corpus`) or the target's responses to `prompts` prompts of `source`."""

    folder: Path
    corpus: str  # a packaged corpus, or the responses file traced
    max_tokens: int
    source: str | None = None  # responses only: the prompts' source
    prompts: int = 0


def recipe_entries(entries: list[str], key: str, allowed: tuple[str, ...], what: str) -> list[tuple[str, int]]:
    """("name", count) pairs of "NAME:COUNT" entries; ValueError naming the recipe key and the valid names."""
    pairs = []
    for entry in entries:
        name, _, count = entry.partition(":")
        if name not in allowed or not is_digits(count) or int(count) < 1:
            raise ValueError(f"[drafter] {key}: {entry!r} should be NAME:{what} with NAME one of {', '.join(allowed)} "
                             f"and {what} >= 1, e.g. {allowed[0]}:100")
        pairs.append((name, int(count)))
    if len({name for name, _ in pairs}) < len(pairs):
        raise ValueError(f"[drafter] {key}: each name at most once, not {entries}")
    return pairs


def feature_sets(recipe: DrafterRecipe, features_dir: str | Path) -> list[FeatureSet]:
    """The features folders the recipe trains on, responses first; ValueError for a bad or empty recipe."""
    root = Path(features_dir)
    sets = [FeatureSet(root / f"self-{source}", str(root / f"responses-{source}-{n}.json"), RESPONSES_MAX_TOKENS, source, n)
            for source, n in recipe_entries(recipe.responses, "responses", RESPONSE_SOURCES, "PROMPTS")]
    sets += [FeatureSet(root / corpus, corpus, tokens)
             for corpus, tokens in recipe_entries(recipe.corpora, "corpora", RAW_CORPORA, "TOKENS")]
    if not sets:
        raise ValueError("[drafter] names no training data; give responses = [\"pyfunctions:100\"] or corpora = [\"sharegpt:40000\"]")
    return sets


def features_budget(recipe: DrafterRecipe, router: RouterRecipe, corpus: str) -> int:
    """Tokens of `corpus` whose features `prep traces --features` stores by default, as the recipe's data
    folders hold them: a responses file (any file) whole, a raw corpus at its [drafter] `corpora` budget,
    else at the router's."""
    if not named_corpus(corpus):
        return RESPONSES_MAX_TOKENS
    return dict(recipe_entries(recipe.corpora, "corpora", RAW_CORPORA, "TOKENS")).get(corpus, router.max_tokens)


def training_precision(precision: str, accelerator: str, cpu_flags: frozenset[str]) -> str:
    """A Lightning precision, "auto" resolved: bf16-mixed on a CUDA GPU, and on a CPU with AVX512-BF16 but
    no AMX; 32-true elsewhere.

    With AMX the recipes' heads trained as fast in 32-true as in bf16-mixed, at 2.7x less memory; on
    the AMD EPYC Zen 4 (AVX512-BF16, no AMX) the first head had trained ~7x faster in bf16-mixed
    (docs/draft-head.md, "Training precision on the CPU").
    """
    if precision != "auto":
        return precision
    from lightning.pytorch.accelerators import CUDAAccelerator

    on_cuda = accelerator in ("gpu", "auto") and CUDAAccelerator.is_available()  # (Apple's MPS: as before, 32-true)
    return "bf16-mixed" if on_cuda or "avx512_bf16" in cpu_flags and "amx_bf16" not in cpu_flags else "32-true"


def build_drafter(artifact, loaded, recipe: DrafterRecipe, router: RouterRecipe, features_dir: str | Path,
                  force: bool) -> dict:
    """Write the recipe's responses and features under features_dir (reusing what is there), train, write stage `drafter`.

    artifact: the open Artifact (its writer lock held by the caller); loaded: the target, loaded for
    teacher forcing. Returns the stage's params, with each part's wall seconds under "recipe_seconds".
    """
    from prep.drafter_train import DrafterConfig, train_drafter
    from prep.router_trainer import lightning_flags
    from prep.traces import build_traces, teacher_target
    from runtime.drafters.eagle_head import feature_layers
    from runtime.kernels import cpu_flags
    from runtime.session import model_spec_of, open_session

    sets = feature_sets(recipe, features_dir)
    flags = lightning_flags(precision=training_precision(recipe.precision, "auto", cpu_flags()))  # refused now, not after the data
    Path(features_dir).mkdir(parents=True, exist_ok=True)
    seconds = {"responses": 0.0, "features": 0.0}
    started = time.perf_counter()
    missing = [s for s in sets if s.source is not None and not Path(s.corpus).is_file()]
    if missing:
        from prep.responses import write_responses
        from runtime import api

        engine = api.load(artifact.path)
        for s in missing:
            print(f"drafter data: {s.prompts} responses to {s.source} prompts -> {s.corpus}", file=sys.stderr)
            write_responses(engine, s.source, s.prompts, NEW_TOKENS, s.corpus, workers=None)
        del engine
    seconds["responses"] = round(time.perf_counter() - started, 1)
    started = time.perf_counter()
    target = teacher_target(loaded)
    taps = feature_layers(loaded.model.config.num_hidden_layers)
    for s in sets:
        print(f"drafter data: features of {s.corpus} -> {s.folder}", file=sys.stderr)
        build_traces(target, loaded.tokenizer, loaded.info.name, s.corpus, s.folder, s.max_tokens,
                     max_tokens_per_text=router.max_tokens_per_text, force=force, option="--features",
                     feature_layers=taps, workers=None, model=model_spec_of(artifact))
    del target  # the teacher's weights (the native backend's own copies) are not held through the training
    seconds["features"] = round(time.perf_counter() - started, 1)
    session = open_session(artifact.path, backend="transformers")  # training reads the fp32 weights
    config = DrafterConfig.from_recipe(recipe, trainer_flags=flags)
    params = train_drafter(session, [str(s.folder) for s in sets], Path(features_dir) / "drafter-train", config, force)
    return {**params, "recipe_seconds": {**seconds, "training": params["seconds"]}}
