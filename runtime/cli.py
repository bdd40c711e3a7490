"""`runtime`: decode with a model and its artifact, benchmark methods side by side, inspect artifacts."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click
import torch

from artifacts import ArtifactError
from runtime.drafters import DRAFTERS_HELP
from runtime.heads.sampling import SamplingParams
from runtime.models import ModelError


def clean_errors(command):
    """Turn expected failures into one-line click errors (exit 1, no traceback)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ArtifactError, ModelError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from exc

    return wrapper


def backend_option(command):
    """The --backend option shared by the commands that run the model."""
    return click.option(
        "--backend", type=click.Choice(["auto", "lean", "transformers"]), default="auto", show_default=True,
        help="Forward implementation: lean (hand-written, gemma3/qwen2/llama), transformers, or auto (lean where supported).",
    )(command)


def sampling_options(command):
    """--temperature/--top-k/--top-p/--epsilon/--seed, shared by generate and bench."""
    options = [
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=int, default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off."),
        click.option("--epsilon", type=float, default=None, help="csv only: allow total variation <= epsilon."),
        click.option("--seed", type=int, default=0, show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


min_response_option = click.option(
    "--min-response-tokens", type=int, default=4, show_default=True,
    help="With --chat: no EOS among the first N response tokens, in drafts or the target's choice (0 = off).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Decode with specvocab artifacts, benchmark methods, inspect artifacts.

    \b
    runtime generate art/g270 --method csv --prompt "Write a haiku about rain."
    runtime generate art/g270 --method spec --drafter ngram --prompt "def fib(n):"
    runtime bench art/g270 --prompts humaneval --methods ar,csv:screen,csv:cluster
    runtime bench-verify art/g270 --head csv
    runtime inspect art/g270
    """


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--method", type=click.Choice(["ar", "csv", "spec"]), default="csv", show_default=True,
              help="ar: full head; csv: certified head; spec: speculative decoding with --drafter.")
@click.option("--bound", type=click.Choice(["screen", "cluster"]), default="screen", show_default=True,
              help="csv, or spec --target-head csv: which certified bound.")
@click.option("--cluster-budget", type=float, default=0.25, show_default=True,
              help="csv --bound cluster: largest fraction of the vocabulary to open before falling back.")
@click.option("--adaptive-budget", is_flag=True, help="csv --bound cluster: adapt the budget as in seed 000.")
@click.option("--drafter", default="ngram", show_default=True,
              help=f"spec: {DRAFTERS_HELP}.")
@click.option("--gamma", type=int, default=4, show_default=True,
              help="spec: tokens drafted per target forward (the starting value with --adaptive).")
@click.option("--adaptive", is_flag=True, help="spec: gamma +1 after a fully accepted draft, -1 after a rejection.")
@click.option("--no-verifier", is_flag=True,
              help="spec with a gp drafter: decode with the compressed model alone and print its own text "
                   "(seed 002's ablation; not the target's text).")
@click.option("--target-head", type=click.Choice(["full", "csv"]), default="full", show_default=True,
              help="spec: the head that verifies (csv: certified, bound from --bound; the drafter gets one too).")
@min_response_option
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--stop", "stops", multiple=True,
              help="End once the response contains this text (repeatable; \\n, \\t escapes work); the stop text is kept.")
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@sampling_options
@backend_option
@clean_errors
def generate(artifact, method, bound, cluster_budget, adaptive_budget, drafter, gamma, adaptive, no_verifier, target_head,
             min_response_tokens, prompt, prompt_file, chat, max_new_tokens, stops, model,
             temperature, top_k, top_p, epsilon, seed, backend) -> None:
    """Generate text, streaming it, then print speed and certification (and drafting) stats.

    \b
    runtime generate art/g270 --method csv --prompt "def fib(n):"
    runtime generate art/g270 --method csv --chat --temperature 0.7 --prompt "Tell me a joke."
    runtime generate art/g270 --method csv --stop "\\n\\n" --prompt "def fib(n):"
    runtime generate art/g270 --method spec --drafter ngram --gamma 6 --prompt "def fib(n):"
    runtime generate art/g270 --method spec --drafter layers:6 --adaptive --target-head csv --chat --prompt "Hi!"
    runtime generate art/g270 --method spec --drafter gp:256:act --no-verifier --prompt "def fib(n):"
    runtime generate art/g270 --method spec --drafter dynaspec:layers:16 --prompt "def fib(n):"
    """
    from runtime.decode import generate_ar
    from runtime.prompting import TextStream, encode_prompt
    from runtime.session import open_session
    from runtime.stopping import StopStrings

    text = _prompt_text(prompt, prompt_file)
    params = SamplingParams(temperature, top_k, top_p, epsilon)
    certified = method == "csv" or (method == "spec" and target_head == "csv")
    if epsilon is not None and method != "csv":
        raise click.UsageError("--epsilon applies to --method csv only")
    if no_verifier and not (method == "spec" and drafter.startswith("gp:")):
        raise click.UsageError("--no-verifier decodes with the GP drafter's compressed model alone: use it with "
                               "--method spec --drafter gp:RANK[:act]")
    if min_response_tokens < 0:
        raise click.UsageError("--min-response-tokens must be >= 0")
    session = open_session(artifact, model, backend=backend)
    if certified:
        head = session.certified_head(bound, max_open_fraction=cluster_budget, adaptive_budget=adaptive_budget)
    else:
        head = session.full_head()
    ids = encode_prompt(session.tokenizer, text, chat)
    stream = TextStream(session.tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    generator = torch.Generator().manual_seed(seed)
    guard = min_response_tokens if chat else 0
    stop = StopStrings(session.tokenizer, [_unescape(s) for s in stops]) if stops else None
    if method == "spec":
        from runtime.drafters import build_drafter
        from runtime.heads import CertifiedHead
        from runtime.speculative import generate_speculative

        # The drafter's own head instance (sharing the certified bound): its rows are not the target's.
        own = CertifiedHead(head.weight, head.bias, head.bound) if certified else session.full_head()
        if drafter.strip() == "int8":  # the int8 drafter drafts with the int8 screening head
            from runtime.heads.screen_draft import ScreenDraftHead

            own = ScreenDraftHead(session.screen_bound())
        draft = build_drafter(drafter, session.target, own, artifact=session.artifact,
                              target_info=session.model.info)
        if no_verifier:
            # The GP copy decodes alone with the drafter's head: its own text, unverified.
            _, stats = generate_ar(draft.backend, own, ids, max_new_tokens, params,
                                   generator, on_token=stream, min_new_tokens=guard, stop=stop)
            label = f"{drafter} alone, no verifier"
        else:
            _, stats = generate_speculative(session.target, head, draft, ids, max_new_tokens, params, generator,
                                            gamma=gamma, adaptive=adaptive, on_token=stream, min_new_tokens=guard,
                                            stop=stop)
            label = f"spec:{drafter}" + (f"+csv:{bound}" if certified else "")
    else:
        _, stats = generate_ar(session.target, head, ids, max_new_tokens, params, generator, on_token=stream,
                               min_new_tokens=guard, stop=stop)
        label = f"csv:{bound}" if method == "csv" else "ar"
    click.echo("")
    summary = stats.head.summary()
    click.echo(
        f"[{label}] {stats.new_tokens} tokens, {stats.tokens_per_s:.2f} tok/s decode, prefill {stats.seconds_prefill:.2f} s; "
        f"certified {summary['certification_rate']:.1%}, fallback {summary['fallback_rate']:.1%}, "
        f"recomputed {summary['recomputed_fraction']:.4%} of the vocabulary",
        err=True,
    )
    if method == "spec" and not no_verifier:
        click.echo(_spec_line(stats.spec), err=True)


def _spec_line(spec) -> str:
    """One line of drafting stats: acceptance, and the closed-form throughput beside the measured one."""
    per_position = ", ".join(f"{a:.0%}" for a in spec.acceptance_per_position)
    return (
        f"[spec] {spec.drafts} drafts, {spec.drafted} drafted, {spec.accepted} accepted; "
        f"mean accepted length {spec.mean_accepted_length:.2f}, acceptance {spec.acceptance_rate:.1%} "
        f"(per position: {per_position or '-'}); predicted {spec.predicted_tokens_per_s:.2f} tok/s by seed 002's "
        f"closed form (gamma {spec.gamma_mean:.2f}, T_D {1e3 * spec.seconds_draft_per_token:.2f} ms/token, "
        f"T_V {1e3 * spec.seconds_verify_per_round:.2f} ms/round)"
    )


def _unescape(text: str) -> str:
    """--stop '\\n\\n' as typed in a shell means two newlines: backslash escapes are decoded."""
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-file")
    return prompt if prompt is not None else Path(prompt_file).read_text()


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompts", "prompt_source", default="humaneval", show_default=True,
              help="humaneval, sharegpt, or a JSON file of [{\"text\": ...}].")
@click.option("--methods", default="ar,csv:screen", show_default=True, help="Comma-separated methods.")
@click.option("-n", "num_prompts", type=int, default=12, show_default=True)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap prompts in the chat template.")
@min_response_option
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default="bench-out/bench.json", show_default=True,
              help="JSON output; the .md table and .png plot go beside it.")
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@sampling_options
@backend_option
@clean_errors
def bench(artifact, prompt_source, methods, num_prompts, max_new_tokens, chat, min_response_tokens, json_path, model,
          temperature, top_k, top_p, epsilon, seed, backend) -> None:
    """Run methods interleaved on the same prompts; report tok/s and speedup over ar in one run.

    \b
    runtime bench art/g270 --prompts humaneval --methods ar,csv:screen,csv:cluster -n 12
    runtime bench art/g270 --prompts prompts.json --methods ar,csv --temperature 0.7
    runtime bench art/qwen --prompts sharegpt --chat --methods ar,spec:layers:20 --min-response-tokens 4
    """
    from runtime.backend import backend_name
    from runtime.bench.methods import build_method
    from runtime.bench.report import markdown_table, write_reports
    from runtime.bench.runner import run_bench, summarize
    from runtime.data import load_prompts
    from runtime.kernels import kernel_name
    from runtime.prompting import encode_prompt
    from runtime.session import open_session

    names = [m for m in methods.split(",") if m.strip()]
    if "ar" not in names:
        names.insert(0, "ar")  # speedups are always against ar measured in the same run
    params = SamplingParams(temperature, top_k, top_p, epsilon)
    if min_response_tokens < 0:
        raise click.UsageError("--min-response-tokens must be >= 0")
    guard = min_response_tokens if chat else 0
    session = open_session(artifact, model, backend=backend)
    built = [build_method(session, name) for name in names]
    texts = load_prompts(prompt_source, num_prompts)
    prompts = [encode_prompt(session.tokenizer, text, chat) for text in texts]
    results = run_bench(built, prompts, max_new_tokens, params, seed, min_new_tokens=guard)
    rows = summarize(results, params)
    record = {
        "command": "runtime bench " + " ".join(sys.argv[2:]),
        "setup": {
            "model": session.model.info.name, "prompts": prompt_source, "n": len(prompts),
            "max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "epsilon": epsilon, "seed": seed, "chat": chat, "min_response_tokens": guard, "threads": torch.get_num_threads(),
            "screen_kernel": kernel_name(), "backend": backend_name(session.target),
        },
        "methods": rows,
    }
    paths = write_reports(record, Path(json_path))
    click.echo(markdown_table(rows))
    click.echo("wrote " + ", ".join(str(p) for p in paths), err=True)


@main.command("bench-kernels")
@click.argument("artifact", type=click.Path())
@click.option("--prompt", default="def fibonacci(n):", show_default=True, help="Text whose last hidden state is screened.")
@click.option("--repeats", type=int, default=20, show_default=True)
@backend_option
@clean_errors
def bench_kernels(artifact, prompt, repeats, backend) -> None:
    """Time the screening-kernel candidates against the full head, in one run, on a real hidden state.

    \b
    runtime bench-kernels art/g270
    """
    from artifacts.format import Stage
    from runtime.bench.kernels import compare_kernels
    from runtime.bench.report import markdown_rows
    from runtime.prompting import encode_prompt
    from runtime.session import open_session

    session = open_session(artifact, backend=backend)
    ids = encode_prompt(session.tokenizer, prompt)
    hidden = session.target.forward(ids, session.target.new_cache())[-1:].float()  # [1, d]
    rows = compare_kernels(session.target.head_weight, session.artifact.read_stage(Stage.SCREEN), hidden, repeats)
    columns = [("kernel", "kernel", "{}"), ("activations", "activations", "{}"), ("ms", "ms", "{:.2f}"),
               ("vs_full_head", "time vs full head", "{:.2f}x"), ("max_error", "max abs error", "{:.2e}")]
    click.echo(markdown_rows(rows, columns))


@main.command("bench-verify")
@click.argument("artifact", type=click.Path())
@click.option("--head", "head_kind", type=click.Choice(["full", "csv"]), default="full", show_default=True,
              help="Head the greedy verifier selects with on the n rows (csv: certified, bound from --bound).")
@click.option("--bound", type=click.Choice(["screen", "cluster"]), default="screen", show_default=True)
@click.option("--prompts", "prompt_source", default="humaneval", show_default=True,
              help="Text the tokens come from: humaneval, sharegpt, or a JSON file of [{\"text\": ...}].")
@click.option("--context", type=int, default=180, show_default=True, help="Tokens in the cache before the verify forward.")
@click.option("--max-n", type=int, default=8, show_default=True, help="Largest number of tokens per verify forward.")
@click.option("--repeats", type=int, default=10, show_default=True, help="Timings per n (the median is reported).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the table as JSON.")
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@backend_option
@clean_errors
def bench_verify(artifact, head_kind, bound, prompt_source, context, max_n, repeats, json_path, model, backend) -> None:
    """Time one target forward over n = 1..8 new tokens plus the greedy head work: T_V(n) / T_V(1).

    \b
    runtime bench-verify art/g270
    runtime bench-verify art/g270 --head csv --repeats 20 --json bench-out/verify.json
    """
    from runtime.backend import backend_name
    from runtime.bench.report import markdown_rows
    from runtime.bench.verify_cost import best_gamma, verify_cost, write_json
    from runtime.data import load_prompts
    from runtime.session import open_session

    session = open_session(artifact, model, backend=backend)
    head = session.certified_head(bound) if head_kind == "csv" else session.full_head()
    tokens = _token_run(session.tokenizer, load_prompts(prompt_source, 64), context + max_n)
    rows = verify_cost(session.target, head, tokens, context, max_n, repeats)
    columns = [("n", "n", "{}"), ("forward_ms", "forward ms", "{:.2f}"), ("head_ms", "head ms", "{:.2f}"),
               ("total_ms", "T_V(n) ms", "{:.2f}"), ("ratio", "T_V(n) / T_V(1)", "{:.2f}x")]
    label = f"csv:{bound}" if head_kind == "csv" else "full"
    click.echo(f"{session.model.info.name}, {backend_name(session.target)} backend, head {label}, cache {context} tokens, "
               f"{torch.get_num_threads()} threads, median of {repeats}")
    click.echo(markdown_rows(rows, columns))
    choices = {alpha: best_gamma(rows, alpha) for alpha in (0.3, 0.5, 0.7, 0.9)}
    click.echo("best gamma with a free drafter (n-gram): " + ", ".join(
        f"acceptance {alpha:.0%} -> gamma {g} ({speedup:.2f}x)" for alpha, (g, speedup) in choices.items()))
    if json_path:
        record = {"command": "runtime bench-verify " + " ".join(sys.argv[2:]),
                  "setup": {"model": session.model.info.name, "backend": backend_name(session.target), "head": label, "context": context, "repeats": repeats,
                            "threads": torch.get_num_threads(), "prompts": prompt_source},
                  "rows": rows,
                  "best_gamma_free_drafter": {str(a): {"gamma": g, "speedup": s} for a, (g, s) in choices.items()}}
        write_json(record, Path(json_path))
        click.echo(f"wrote {json_path}", err=True)


def _token_run(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """The first `length` token ids of the texts joined by blank lines [length]."""
    ids: list[int] = []
    for count in range(1, len(texts) + 1):
        ids = tokenizer("\n\n".join(texts[:count]))["input_ids"]
        if len(ids) >= length:
            return torch.tensor(ids[:length], dtype=torch.long)
    raise ValueError(f"the prompts give {len(ids)} tokens, {length} are needed: use a longer --prompts source "
                     "or a smaller --context")


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--check-model", is_flag=True, help="Also load the model and compare fingerprints.")
@clean_errors
def inspect(artifact, check_model) -> None:
    """Show an artifact's stages, parameters and sizes, and whether it is valid.

    \b
    runtime inspect art/g270
    runtime inspect art/g270 --check-model
    """
    from runtime.inspect import describe_artifact

    model_info = None
    if check_model:
        from artifacts import Artifact
        from runtime.models import load_model
        from runtime.session import model_spec_of

        model_info = load_model(model_spec_of(Artifact.open(artifact)), progress=False).info
    report, valid = describe_artifact(artifact, model_info)
    click.echo(report)
    if not valid:
        sys.exit(1)


if __name__ == "__main__":
    main()
