"""`runtime generate`: decode one prompt with any method of the grammar, streaming the text."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from runtime.cli import values
from runtime.cli.group import check_min_response, clean_errors, main, min_response_option, model_options, sampling_options, sampling_params
from runtime.kernels import decode_threads
from runtime.methods import DEFAULT_METHOD_HELP, MethodSpec, canonical, methods_help, parse_method
from runtime.loops.speculative import MAX_GAMMA
from runtime.heads import BOUNDS
from runtime.methods import (METHODS, NOT_PRESERVING, preserves_distribution)

# The old flags: thin aliases that write the method name (--method spec --drafter X --gamma G ...),
# deprecated: each use prints the --method spelling of what it ran, and the next release removes them.
ALIASES = ("--drafter", "--gamma", "--adaptive", "--no-verifier", "--target-head")
DEPRECATED = ("--bound", *ALIASES)
BUDGET_OPTIONS = ("--cluster-budget and --adaptive-budget go with the cluster bound: --method csv:cluster or a method "
                  "ending in +csv:cluster")


def method_from_flags(method: str | None, bound, drafter, gamma, adaptive, no_verifier, target_head,
                      cluster_budget: float | None, adaptive_budget: bool) -> MethodSpec | None:
    """The MethodSpec that --method and the alias flags name together (parsed once, by the grammar);
    None when they name none (the engine's default method then runs)."""
    aliased = drafter is not None or gamma is not None or adaptive or no_verifier or target_head is not None
    budgeted = cluster_budget is not None or adaptive_budget
    if method is None and not aliased:
        if bound is None and not budgeted:
            return None
        if bound is None:
            raise click.UsageError(BUDGET_OPTIONS)
        method = "csv"  # --bound alone: the certified head with that bound
    text = (method or "").strip()
    if bound is not None and text != "csv" and target_head != "csv":
        example = f"csv:{bound}" if text.startswith("csv") else f"{text.partition('+')[0] or 'spec:lookup'}+csv:{bound}"
        raise click.UsageError(f"--bound goes with --method csv or --target-head csv; write the bound in the method "
                               f"name instead, e.g. {example}")
    if text == "spec":
        options = [f"gamma={gamma}"] * (gamma is not None) + ["adaptive"] * adaptive + ["no-verifier"] * no_verifier
        text = ":".join(["spec", drafter or "ngram", *options])
        if target_head == "csv":
            text += f"+csv:{bound or 'screen'}"
    elif aliased:
        raise click.UsageError(f"{', '.join(ALIASES)} go with --method spec; or write them in the method name, "
                               "e.g. --method spec:ngram:gamma=6:adaptive+csv")
    elif text == "csv" and bound is not None:
        text = f"csv:{bound}"
    try:
        spec = parse_method(text)
    except ValueError as e:  # --method named, as bench's --methods names its own; the alias flags wrote the name together
        if aliased:
            raise click.UsageError(f"{e} (the method the alias flags made: {text})") from None
        raise click.BadParameter(str(e), param_hint="'--method'") from None
    if not budgeted:
        return spec
    if spec.head != "csv:cluster":  # the options would be dropped without a word
        raise click.UsageError(BUDGET_OPTIONS)
    return replace(spec, adaptive_budget=adaptive_budget,
                   **({} if cluster_budget is None else {"cluster_budget": cluster_budget}))


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--method", default=None,
              help=f"Method name (default: {DEFAULT_METHOD_HELP}). {methods_help()}")
@click.option("--bound", type=click.Choice(BOUNDS), default=None,
              help="Alias: --bound cluster = csv:cluster; with --target-head csv, its bound (default screen).")
@click.option("--cluster-budget", type=values.Number(0, 1, low_open=True), default=None,
              help="csv:cluster: largest fraction of the vocabulary to open before falling back (default 0.25).")
@click.option("--adaptive-budget", is_flag=True, help="csv:cluster: adapt the budget as CSV-Decode does.")
@click.option("--drafter", default=None, help="Alias, with --method spec: spec:DRAFTER (default ngram).")
@click.option("--gamma", type=values.Integer(1, MAX_GAMMA), default=None, help="Alias, with --method spec: :gamma=G (tokens drafted per target forward).")
@click.option("--adaptive", is_flag=True, help="Alias, with --method spec: :adaptive (gamma +1 after a full accept, -1 after a rejection).")
@click.option("--no-verifier", is_flag=True,
              help="Alias, with --method spec: :no-verifier, the drafter's compressed model alone (gp, int8; the GP "
                   "paper's ablation: not the target's text).")
@click.option("--target-head", type=click.Choice(["full", "csv"]), default=None,
              help="Alias, with --method spec: csv = +csv (the certified head verifies; bound from --bound).")
@min_response_option
@click.option("--prompt", type=values.Text(), default=None, help="Prompt text.")
@click.option("--prompt-file", type=values.TextFile(), default=None, help="A UTF-8 file holding the prompt text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--max-new-tokens", type=values.COUNT, default=128, show_default=True,
              help="At most this many new tokens (fewer if the prompt leaves less room in the model's context: a note says so).")
@click.option("--stop", "stops", type=values.StopText(), multiple=True,
              help=f"End once the response contains this text (repeatable; escapes: {values.STOP_ESCAPES}); the stop text is kept.")
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@sampling_options
@model_options
@clean_errors
def generate(artifact, method, bound, cluster_budget, adaptive_budget, drafter, gamma, adaptive, no_verifier, target_head,
             min_response_tokens, prompt, prompt_file, chat, max_new_tokens, stops, model,
             temperature, top_k, top_p, epsilon, seed, backend) -> None:
    """Generate text, streaming it, then print speed and certification (and drafting) stats.

    \b
    runtime generate art/g270 --prompt "def fib(n):"          (the default: the fastest exact method)
    runtime generate art/qwen --method csv --chat --temperature 0.7 --prompt "Tell me a joke."
    runtime generate art/g270 --method csv --stop "\\n\\n" --prompt "def fib(n):"
    runtime generate art/g270 --method spec:int8:gamma=6+csv --prompt "def fib(n):"
    runtime generate art/smol --method spec:layers:6:adaptive+csv --chat --prompt "Hi!"
    runtime generate art/g270 --method spec:gp:256:act:no-verifier --prompt "def fib(n):"
    runtime generate art/g270 --method dynaspec:layers:16 --prompt "def fib(n):"
    runtime generate art/g270 --method spec --drafter ngram --gamma 6 --prompt "def fib(n):"   (deprecated flags)
    """
    from runtime import api
    from runtime.text.prompting import TextStream

    # Every cheap check before the model loads.
    text = _prompt_text(prompt, prompt_file)
    check_min_response(chat)
    params = sampling_params(temperature, top_k, top_p, epsilon)
    spec = method_from_flags(method, bound, drafter, gamma, adaptive, no_verifier, target_head, cluster_budget,
                             adaptive_budget)
    used = [flag for flag, value in zip(DEPRECATED, (bound, drafter, gamma, adaptive, no_verifier, target_head))
            if value not in (None, False)]
    if used:
        click.echo(f"note: {', '.join(used)} {'is' if len(used) == 1 else 'are'} deprecated and removed in the next "
                   f"release; the same method: --method {canonical(spec)}", err=True)
    if spec is not None and METHODS[spec.name].bench_only:
        raise click.UsageError(f"{spec} is a bench-only reference; use it in runtime bench --methods")
    api.check_sampling(params, [spec] if spec is not None else [])
    engine = api.load(artifact, model, backend=backend, chat=chat)
    spec = spec or engine.default_method()
    run = engine.generate(text, spec, params, max_new_tokens, chat, min_response_tokens if chat else None, stops, seed)
    if run.note:
        click.echo(run.note, err=True)
    stream = TextStream(engine.tokenizer, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    for token in run:
        stream(token)
    click.echo("")
    stats = run.stats
    summary = stats.head.summary()
    label = canonical(spec) if spec.verifier else f"{spec.drafter} alone, no verifier"
    if not preserves_distribution(spec, params):
        label += f", {NOT_PRESERVING}" + (f" (epsilon {params.epsilon:g})" if spec.distribution_preserving else "")
    backend = f"{spec.backend or engine.session.target.name} backend"
    if not spec.verifier:  # the drafter decoded alone, on its own (int8, low-rank) copy of the target's backend
        backend = f"the {spec.drafter.name} drafter's copy of the {backend}"
    ran_on = "llama.cpp" if spec.name == "llamacpp" else backend
    # Only a certified head certifies or recomputes; the full head (and llama.cpp's own) has nothing to say.
    head = (f"; certified {summary['certification_rate']:.1%}, fallback {summary['fallback_rate']:.1%}, "
            f"recomputed {summary['recomputed_fraction']:.4%} of the vocabulary") if spec.certified else ""
    count = f"{stats.new_tokens} token{'s' * (stats.new_tokens != 1)}"
    speed = f"{stats.tokens_per_s:.2f} tok/s decode" if stats.decode_tokens else "no decode step: the prefill gave it"
    click.echo(
        f"[{label}] {count}, {speed} ({ran_on}, "
        f"{decode_threads()} thread(s)), prefill {stats.seconds_prefill:.2f} s{head}",
        err=True,
    )
    if stats.spec is not None and stats.decode_tokens:  # a one-token run verified no draft
        click.echo(_spec_line(stats.spec), err=True)


def _spec_line(spec) -> str:
    """One line of drafting stats: acceptance, and the closed-form throughput beside the measured one."""
    per_position = ", ".join(f"{a:.0%}" for a in spec.acceptance_per_position)
    return (
        f"[spec] {spec.drafts} drafts, {spec.drafted} drafted, {spec.accepted} accepted; "
        f"mean accepted length {spec.mean_accepted_length:.2f}, acceptance {spec.acceptance_rate:.1%} "
        f"(per position: {per_position or '-'}); predicted {spec.predicted_tokens_per_s:.2f} tok/s by the GP paper's "
        f"closed form (gamma {spec.gamma_mean:.2f}, T_D {1e3 * spec.seconds_draft_per_token:.2f} ms/token, "
        f"T_V {1e3 * spec.seconds_verify_per_round:.2f} ms/round)"
    )


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt: --prompt's text or --prompt-file's (already read and checked by their types)."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else prompt_file
    if not text:
        raise click.UsageError(f"{'--prompt' if prompt is not None else '--prompt-file'} is empty; give some text")
    return text
