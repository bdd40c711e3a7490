"""`prep traces`, `train-router`, `gp-basis` and `bake-onedecode`: teacher-forced traces and the drafters' stages."""

from __future__ import annotations

from pathlib import Path

import click

from artifacts.format import Stage
from prep import stages
from prep.cli import SEED, clean_errors, main, model_argument
from prep.recipes import load_recipe, overridden
from prep.responses import BATCH as RESPONSE_BATCH, NEW_TOKENS, SOURCES as RESPONSE_SOURCES
from prep.router_loss import LOSSES
from prep.traces import TOP_TOKENS
from runtime.cli.values import COUNT, Integer, Number


PRECISION_HELP = "Lightning precision (32-true, bf16-mixed, ...)"
RECIPE_PRECISION_HELP = (f"{PRECISION_HELP}, or auto: bf16-mixed on a CUDA GPU or a CPU with AVX512-BF16 but no AMX, "
                         "else 32-true (default: the recipe's)")


def lightning_options(command=None, *, precision_from_recipe: bool = False):
    """The Lightning flags the training commands pass through (checked by prep.router_trainer.lightning_flags), and --seed.

    precision_from_recipe: --precision defaults to the recipe's and takes auto (train-drafter);
    otherwise it defaults to 32-true.
    """
    if command is None:
        return lambda c: lightning_options(c, precision_from_recipe=precision_from_recipe)
    precision = (click.option("--precision", default=None, help=RECIPE_PRECISION_HELP + ".") if precision_from_recipe
                 else click.option("--precision", default="32-true", show_default=True, help=PRECISION_HELP + "."))
    for option in reversed([
        click.option("--devices", default="auto", show_default=True, help="Lightning devices: a number (1, 2) or auto."),
        click.option("--accelerator", default="auto", show_default=True, help="Lightning accelerator: cpu, gpu or auto."),
        precision,
        click.option("--strategy", default="auto", show_default=True,
                     help="Lightning strategy: auto (ddp_spawn for several devices) or ddp_spawn; ddp re-runs the "
                          "command, refused."),
        click.option("--seed", type=SEED, default=0, show_default=True),
    ]):
        command = option(command)
    return command


@main.command("traces")
@model_argument
@click.option("--corpus", default=None,
              help="sharegpt, humaneval, pystdlib (the standard library's source), or a JSON file of {\"text\": ...} objects (default: the recipe's).")
@click.option("-o", "--out", required=True, help="Traces folder to create or complete (its own folder, not an artifact).")
@click.option("--max-tokens", type=COUNT, default=None,
              help="Total token budget (default: the recipe's; with --features, a file's texts whole and a packaged "
                   "corpus at the recipe's [drafter] budget, as prep all --with-drafter traces them).")
@click.option("--shard-tokens", type=COUNT, default=16_384, show_default=True, help="Tokens per shard (the resume unit).")
@click.option("--max-tokens-per-text", type=Integer(2), default=None, help="Default: the recipe's.")
@click.option("--drafter-layers", default=None,
              help="Also store the hidden state after the first N layers (layers:N drafters), e.g. 16 or 15,16; 0 = none "
                   "(default: the recipe's; none with --features).")
@click.option("--features", is_flag=True,
              help="Also store the target's features an EAGLE-3 draft head reads (prep train-drafter): 3 layers, bfloat16.")
@click.option("--feature-layers", "feature_layers_text", default=None,
              help="With --features: the three layers whose inputs the head reads, lowest first, e.g. 2,12,23 "
                   "(default: EAGLE-3's 2, N/2, N-3 of N layers).")
@click.option("--workers", type=COUNT, default=None,
              help="Tracing processes, one thread and one core each (default: one per core, as memory allows).")
@click.option("--force", is_flag=True, help="Rebuild the folder's traces: needed to change their settings, or to remove or shorten them.")
@clean_errors(interrupted="complete shards are kept: rerun the same command to resume")
def traces(model: str, corpus, out: str, max_tokens, shard_tokens: int, max_tokens_per_text, drafter_layers,
           features: bool, feature_layers_text: str | None, workers: int | None, force: bool) -> None:
    """Run the target teacher-forced over a corpus and write trace shards (resumable).

    \b
    prep traces gemma3-270m -o traces/g270
    prep traces gemma3-270m --corpus humaneval -o traces/g270-code --max-tokens 50000 --drafter-layers 16
    prep traces gemma3-270m --corpus pystdlib --features -o features/g270-code --max-tokens 40000
    prep traces qwen2.5-coder-0.5b-instruct --features --feature-layers 2,12,23 -o features/qwen-top
    """
    from prep.drafter_recipe import features_budget
    from prep.trace_files import check_traces_folder
    from prep.traces import TEACHER_BACKEND, build_traces, check_corpus, parse_feature_layers, parse_layers
    from runtime.backends import load_target

    if feature_layers_text is not None and not features:
        raise click.UsageError("--feature-layers chooses the layers of --features; add --features")
    recipe = load_recipe(model)
    cfg = overridden(recipe.router, corpus=corpus, max_tokens_per_text=max_tokens_per_text)
    if features:  # a draft head's data: by default what prep all --with-drafter's features folders hold
        cfg = overridden(cfg, max_tokens=features_budget(recipe.drafter, recipe.router, cfg.corpus), drafter_layers=0)
    cfg = overridden(cfg, max_tokens=max_tokens, drafter_layers=drafter_layers)
    layers = parse_layers(cfg.drafter_layers)
    check_corpus(cfg.corpus)
    check_traces_folder(out, "-o")
    loaded, target = load_target(model, TEACHER_BACKEND)
    taps = parse_feature_layers(feature_layers_text, loaded.config.num_hidden_layers) if features else ()
    index = build_traces(target, loaded.tokenizer, loaded.info.name, cfg.corpus, out, cfg.max_tokens, shard_tokens,
                         cfg.max_tokens_per_text, tuple(layers), force, feature_layers=taps,
                         workers=workers, model=model)
    tokens = sum(e["tokens"] for e in index["shards"])
    click.echo(f"{out}: {len(index['shards'])} shards, {tokens} tokens")


@main.command("train-router")
@click.argument("artifact")
@click.option("--traces", "traces_dir", required=True, help="Traces directory written by prep traces.")
@click.option("--clusters", type=COUNT, default=None, help="Token clusters M, spherical k-means of the head rows (default: the recipe's).")
@click.option("--hidden", default=None, help="Router hidden input: final (dynaspec:int8) or layers:N (dynaspec:layers:N) (default: the recipe's; auto: the traces' only drafter depth, else final).")
@click.option("--loss", type=click.Choice(LOSSES), default=None,
              help="ce: the cluster of the target's top-1; multilabel: the clusters of its top tokens (default: the recipe's).")
@click.option("--width", type=COUNT, default=None, help="Router MLP width (default: the recipe's).")
@click.option("--max-steps", type=COUNT, default=None, help="Default: the recipe's.")
@click.option("--batch-size", type=COUNT, default=None, help="Default: the recipe's.")
@click.option("--lr", type=Number(0, low_open=True), default=1e-3, show_default=True)
@lightning_options
@click.option("--work-dir", default=None, help="Logs (CSV) and checkpoints (default: TRACES/router-train).")
@click.option("--force", is_flag=True, help="Overwrite an existing router stage.")
@clean_errors
def train_router_command(artifact: str, traces_dir: str, clusters, hidden, loss, width, max_steps, batch_size,
                         lr: float, devices: str, accelerator: str, precision: str, strategy: str, seed: int, work_dir,
                         force: bool) -> None:
    """Train the DynaSpec router on traces (Lightning) and export stage `router` (safetensors + ONNX).

    \b
    prep train-router art/g270 --traces traces/g270
    prep train-router art/g270 --traces traces/g270 --loss multilabel --work-dir runs/ml --force
    prep train-router art/g270 --traces traces/g270 --devices 2 --precision bf16-mixed
    """
    from prep.router_train import RouterConfig, hidden_key, train_router
    from prep.router_trainer import lightning_flags
    from prep.trace_files import traces_of
    from runtime.session import open_session

    flags = lightning_flags(devices, accelerator, precision, strategy)
    if hidden is not None:
        hidden_key(hidden)  # its form, before the model loads (whether the traces hold it: after)
    with stages.adding_stage(artifact, Stage.ROUTER, force) as art:
        traces_of(traces_dir, art.model.name, art.model.vocab_size)
        session = open_session(artifact, backend="transformers")  # training reads the fp32 weights
        cfg = overridden(load_recipe(session.model.info.name).router, clusters=clusters, hidden=hidden, loss=loss,
                         width=width, max_steps=max_steps, batch_size=batch_size)
        config = RouterConfig.from_recipe(cfg, lr=lr, seed=seed, trainer_flags=flags)
        params = train_router(session, traces_dir, work_dir or Path(traces_dir) / "router-train", config, force=force)
    recall = {k.split("@")[1]: v for k, v in params["validation"].items() if k.startswith("val/recall@")}
    sizes = {k.split("@")[1]: v for k, v in params["validation"].items() if k.startswith("val/shortlist@")}
    for k in recall:
        click.echo(f"k={k}: recall {recall[k]:.3f} at shortlist {sizes[k]:.2%} of the vocabulary")
    click.echo(f"wrote stage router to {artifact} ({params['steps']} steps, {params['seconds']} s)")


@main.command("gp-basis")
@click.argument("artifact")
@click.option("--rank", type=COUNT, default=None, help="Largest rank stored (default: the hidden size); the runtime's gp:K takes any K up to it.")
@click.option("--traces", "traces_dir", default=None, help="Traces directory (prep traces): also build activation-aware bases (gp:K:act).")
@click.option("--max-tokens", type=COUNT, default=65_536, show_default=True, help="--traces: layer inputs from at most this many tokens.")
@click.option("--mlp", is_flag=True, help="Also compress the MLP (gate/up, down); default: attention only (q/k/v, o).")
@click.option("--force", is_flag=True, help="Overwrite an existing gp stage.")
@clean_errors
def gp_basis(artifact: str, rank, traces_dir, max_tokens: int, mlp: bool, force: bool) -> None:
    """Compute per-layer low-rank input bases of the target's linears (stage `gp`, the GP drafter's).

    \b
    prep gp-basis art/g270
    prep gp-basis art/g270 --rank 320 --traces traces/g270 --force
    runtime generate art/g270 --method spec --drafter gp:128:act --prompt "def fib(n):"
    """
    from prep.gp_basis import build_gp_basis, check_rank, trace_texts
    from prep.trace_files import traces_of
    from runtime.session import open_session

    with stages.adding_stage(artifact, Stage.GP, force) as art:
        rank = art.model.hidden_size if rank is None else check_rank(rank, art.model.hidden_size)
        if traces_dir:
            traces_of(traces_dir, art.model.name, art.model.vocab_size)
        session = open_session(artifact, backend="transformers")  # bases come from the fp32 weights
        body = session.target.body
        texts = trace_texts(traces_dir, session.model.info.name, session.target.vocab_size, max_tokens) if traces_dir else None
        tensors, params = build_gp_basis(body, rank, mlp, texts)
        params["traces"] = traces_dir
        session.artifact.write_stage(Stage.GP, tensors, params, force=force)
    energy = ", ".join(f"{kind} {group} k={k}: {v:.1%}" for kind, table in params["retained_energy"].items()
                       for group, row in table.items() for k, v in row.items())
    click.echo(f"wrote stage gp to {artifact} (rank <= {params['max_rank']}, {' + '.join(params['kinds'])}); "
               f"mean retained energy: {energy}")


@main.command("bake-onedecode")
@click.argument("artifact")
@click.option("--traces", "traces_dir", required=True, help="Traces directory written by prep traces (the target's own top-8).")
@click.option("--v-bake", type=COUNT, default=2048, show_default=True, help="Most frequent single-token keys baked.")
@click.option("--top-k", type=Integer(1, TOP_TOKENS), default=TOP_TOKENS, show_default=True, help="Candidates kept per key.")
@click.option("--min-pair-count", type=COUNT, default=8, show_default=True, help="Two-token keys need this many occurrences.")
@click.option("--force", is_flag=True, help="Overwrite an existing onedecode stage.")
@clean_errors
def bake_onedecode(artifact: str, traces_dir: str, v_bake: int, top_k: int, min_pair_count: int, force: bool) -> None:
    """Bake the OneDecode table (stage `onedecode`: next-token candidates by the last one or two tokens).

    \b
    prep bake-onedecode art/g270 --traces traces/g270
    prep bake-onedecode art/g270 --traces traces/g270 --v-bake 4096 --top-k 4 --force
    """
    from prep.onedecode import bake

    with stages.adding_stage(artifact, Stage.ONEDECODE, force) as art:
        tensors, params = bake(traces_dir, art.model.name, art.model.vocab_size, v_bake, top_k, min_pair_count)
        art.write_stage(Stage.ONEDECODE, tensors, params, force=force)
    held = params["heldout"]
    click.echo(f"wrote stage onedecode to {artifact}: {params['single_keys']} single + {params['pair_keys']} pair keys; "
               f"held-out hit rate {held['hit_rate']:.1%}, top-1 agreement {held['top1_agreement']:.1%}, "
               f"top-{top_k} recall {held['topk_recall']:.1%} ({held['positions']} positions)")


@main.command("train-drafter")
@click.argument("artifact")
@click.option("--features", "folders", multiple=True, required=True,
              help="Features folder written by prep traces --features (repeat for several corpora).")
@click.option("--draft-vocab", type=COUNT, default=None,
              help="Draft vocabulary: the target's most chosen tokens, FR-Spec style (default: the recipe's).")
@click.option("--intermediate", type=COUNT, default=None, help="The head's MLP width (default: the recipe's mlp_width, a fraction of the target's: a quarter).")
@click.option("--steps", type=Integer(1, 8), default=None,
              help="Training-time-test depth, draft steps unrolled (default: the recipe's).")
@click.option("--epochs", type=COUNT, default=None, help="Default: the recipe's.")
@click.option("--lr", type=Number(0, low_open=True), default=None, help="Default: the recipe's.")
@lightning_options(precision_from_recipe=True)
@click.option("--work-dir", default=None, help="Logs (CSV) and checkpoints (default: FEATURES/drafter-train).")
@click.option("--force", is_flag=True, help="Overwrite an existing drafter stage.")
@clean_errors
def train_drafter_command(artifact: str, folders: tuple[str, ...], draft_vocab, intermediate, steps, epochs, lr,
                          devices: str, accelerator: str, precision, strategy: str,
                          seed: int, work_dir, force: bool) -> None:
    """Train the EAGLE-3 draft head on the target's features (Lightning) and write stage `drafter`.

    \b
    prep traces gemma3-270m --features -o features/g270
    prep train-drafter art/g270 --features features/g270 --features features/g270-code
    runtime generate art/g270 --method spec:eagle+csv:screen4 --prompt "def fib(n):"
    """
    from prep.drafter_recipe import training_precision
    from prep.drafter_train import DrafterConfig, train_drafter
    from prep.router_trainer import lightning_flags
    from prep.trace_files import traces_of
    from runtime.kernels import cpu_flags
    from runtime.session import open_session

    with stages.adding_stage(artifact, Stage.DRAFTER, force) as art:
        for folder in folders:
            traces_of(folder, art.model.name, art.model.vocab_size)
        cfg = overridden(load_recipe(art.model.name).drafter, draft_vocab=draft_vocab, steps=steps, epochs=epochs,
                         lr=lr, precision=precision)
        flags = lightning_flags(devices, accelerator, training_precision(cfg.precision, accelerator, cpu_flags()), strategy)
        session = open_session(artifact, backend="transformers")  # training reads the fp32 weights
        config = DrafterConfig.from_recipe(cfg, intermediate_size=intermediate, seed=seed, trainer_flags=flags)
        params = train_drafter(session, list(folders), work_dir or Path(folders[0]) / "drafter-train", config, force)
    validation = params["validation"]
    top1 = ", ".join(f"{validation[f'val/top1@{j}']:.1%}" for j in range(cfg.steps))
    chain = ", ".join(f"{validation[f'val/chain@{j}']:.1%}" if f"val/chain@{j}" in validation else "–"
                      for j in range(cfg.steps))
    click.echo(f"wrote stage drafter to {artifact}: draft vocabulary {params['draft_vocab']} "
               f"(covers {params['draft_vocab_coverage']:.1%} of the target's choices), validation top-1 by step "
               f"{top1}, a greedy chain's acceptance by position {chain} ({params['optimizer_steps']} steps, {params['seconds']} s)")


@main.command("train-drafter-router")
@click.argument("artifact")
@click.option("--features", "folders", multiple=True,
              help="Features folder (prep traces --features; repeat for several; default: the ones the head was trained on).")
@click.option("--clusters", type=COUNT, default=64, show_default=True,
              help="Clusters M of the head's draft-vocabulary rows (spherical k-means).")
@click.option("--width", type=COUNT, default=256, show_default=True, help="Router MLP width.")
@click.option("--max-steps", type=COUNT, default=2000, show_default=True)
@click.option("--batch-size", type=COUNT, default=256, show_default=True)
@click.option("--max-tokens", type=COUNT, default=60_000, show_default=True,
              help="Text rows of the features to read (each gives one router row per draft step).")
@click.option("--lr", type=Number(0, low_open=True), default=1e-3, show_default=True)
@lightning_options
@click.option("--work-dir", default=None, help="Logs (CSV) and checkpoints (default: FEATURES/drafter-router-train).")
@click.option("--force", is_flag=True, help="Overwrite an existing drafter_router stage.")
@clean_errors
def train_drafter_router_command(artifact: str, folders: tuple[str, ...], clusters: int, width: int, max_steps: int,
                                 batch_size: int, max_tokens: int, lr: float, devices: str, accelerator: str,
                                 precision: str, strategy: str, seed: int, work_dir, force: bool) -> None:
    """Train DynaSpec's router over the draft head's vocabulary (Lightning) and write stage `drafter_router`.

    \b
    prep train-drafter-router art/g270
    runtime generate art/g270 --method spec:eagle:dynaspec=8:conf=0.4+csv:screen4 --prompt "def fib(n):"
    """
    from prep.drafter_router import DrafterRouterConfig, train_drafter_router
    from prep.router_trainer import lightning_flags
    from prep.trace_files import traces_of
    from runtime.session import open_session

    flags = lightning_flags(devices, accelerator, precision, strategy)
    with stages.adding_stage(artifact, Stage.DRAFTER_ROUTER, force) as art:
        if not art.has_stage(Stage.DRAFTER):
            raise click.ClickException(f"{artifact} has no draft head to route; run: prep train-drafter {artifact} "
                                       "--features FEATURES")
        folders = list(folders) or art.stage_params(Stage.DRAFTER)["features"]
        for folder in folders:
            traces_of(folder, art.model.name, art.model.vocab_size)
        session = open_session(artifact, backend="transformers")  # the embedding table as stored
        config = DrafterRouterConfig(clusters=clusters, width=width, max_steps=max_steps, batch_size=batch_size, lr=lr,
                                     max_tokens=max_tokens, seed=seed, trainer_flags=flags)
        params = train_drafter_router(session, work_dir or Path(folders[0]) / "drafter-router-train", config, folders,
                                      force)
    validation = params["validation"]
    recall = ", ".join(f"k={k}: {validation[f'val/recall@{k}']:.1%} at {validation[f'val/shortlist@{k}']:.1%}"
                       for k in (1, 4, 8, 16) if f"val/recall@{k}" in validation)
    click.echo(f"wrote stage drafter_router to {artifact}: {params['clusters']} clusters; validation recall of the "
               f"target's top-1 by clusters kept (share of the draft vocabulary) {recall} ({params['steps']} steps, "
               f"{params['seconds']} s)")


@main.command("export-drafter")
@click.argument("artifact")
@click.option("-o", "--out", required=True, help="Checkpoint folder to write (config.json + model.safetensors).")
@click.option("--force", is_flag=True, help="Replace an existing folder at -o.")
@clean_errors
def export_drafter_command(artifact: str, out: str, force: bool) -> None:
    """Export stage `drafter` as an EAGLE-3 checkpoint folder (vLLM, SGLang, llama.cpp's convert_hf_to_gguf.py).

    \b
    prep export-drafter art/g270 -o heads/g270-eagle3
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "heads/g270-eagle3", "num_speculative_tokens": 4}'
    python convert_hf_to_gguf.py heads/g270-eagle3 --target-model-dir ~/.cache/specvocab/models/gemma3-270m --outfile g270-eagle3.gguf
    llama-server -m ~/.cache/specvocab/models/gemma3-270m/*.gguf -md g270-eagle3.gguf --spec-type draft-eagle3

    Keep the converter's default type (bf16): an f16 head overflows on gemma3's features and drafts nothing.
    llama.cpp runs heads on gemma3 and qwen2 targets only with one line added to its graphs
    (docs/llamacpp-reference.md); llama targets (smollm2) run as they are.
    """
    from artifacts import Artifact
    from prep.drafter_export import export_drafter

    art = Artifact.open(artifact)
    if not art.has_stage(Stage.DRAFTER):
        raise click.ClickException(f"{artifact} has no stage drafter; run: prep train-drafter {artifact} --features FEATURES")
    written = export_drafter(art, out, force)
    click.echo(f"wrote {written}: an EAGLE-3 head for {art.model.name}")


@main.command("responses")
@click.argument("artifact")
@click.option("--source", type=click.Choice(RESPONSE_SOURCES), default="sharegpt", show_default=True,
              help="ShareGPT train-split first turns (chat template), openings of the standard library's source, or its "
                   "functions cut after their docstrings (HumanEval's shape, not HumanEval).")
@click.option("-n", "--prompts", "count", type=COUNT, default=100, show_default=True, help="How many prompts.")
@click.option("--max-new-tokens", type=COUNT, default=NEW_TOKENS, show_default=True)
@click.option("-o", "--out", required=True, help="JSON corpus file to write ([{\"text\": ...}]), for prep traces --corpus.")
@click.option("--workers", type=COUNT, default=None,
              help="Decoding processes, one thread and one core each (default: one per core, as memory allows).")
@click.option("--batch", type=COUNT, default=RESPONSE_BATCH, show_default=True,
              help="Prompts each process decodes at once, sharing the target's forwards (the same tokens at any batch).")
@click.option("--force", is_flag=True, help="Replace an existing file at -o.")
@clean_errors(interrupted="the finished responses are kept in OUT.partial: rerun the same command to resume")
def responses_command(artifact: str, source: str, count: int, max_new_tokens: int, out: str, workers: int | None,
                      batch: int, force: bool) -> None:
    """Write the target's own greedy responses to training prompts: self-distillation text for the draft head.

    \b
    prep responses art/g270 --source sharegpt -n 200 -o features/g270-responses.json
    prep traces gemma3-270m --corpus features/g270-responses.json --features -o features/g270-self
    """
    from prep.responses import write_responses
    from runtime import api

    if Path(out).exists() and not force:
        raise click.ClickException(f"{out} exists; choose another -o, or pass --force to replace it")
    engine = api.load(artifact)
    tokens = write_responses(engine, source, count, max_new_tokens, out, workers, batch)
    click.echo(f"wrote {out}: {count} texts, {tokens} tokens of {engine.session.model.info.name}'s own text")
