"""`runtime bench`, `bench-kernels`, `bench-screen` and `bench-verify`: methods side by side, screening kernels,
lower-bit screens' candidate fractions, verify cost."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import torch

from runtime.bench.report import REPORT_SUFFIXES, report_paths
from runtime.bench.screen_bits import FORMATS as SCREEN_FORMATS
from runtime.common.checks import comma_items, is_digits
from runtime.cli import values
from runtime.cli.group import check_min_response, clean_errors, main, min_response_option, model_options, sampling_options, sampling_params
from runtime.kernels import SKINNY_MAX_ROWS, decode_threads, kernel_name
from runtime.heads import BOUNDS
from runtime.methods import methods_help

# bench-screen's hidden states: the first SCREEN_TEXT_TOKENS tokens of each of up to SCREEN_TEXTS texts.
SCREEN_TEXTS, SCREEN_TEXT_TOKENS = 256, 256


# What Ctrl-C leaves of a measuring command: a record holds whole runs, never a part of one.
NOTHING_WRITTEN = "nothing is written (a record holds whole runs only): rerun the command"

@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--prompts", "prompt_source", type=values.PromptSource(), default="humaneval", show_default=True,
              help="humaneval, sharegpt, or a JSON file of [{\"text\": ...}].")
@click.option("--methods", "specs", type=values.MethodList(), default="ar,csv:screen", show_default=True,
              help=f"Comma-separated method names. {methods_help()}")
@click.option("-n", "num_prompts", type=values.COUNT, default=12, show_default=True,
              help="Prompts to run (a prompts file may hold fewer).")
@click.option("--max-new-tokens", type=values.COUNT, default=128, show_default=True)
@click.option("--chat", is_flag=True, help="Wrap prompts in the chat template.")
@min_response_option
@click.option("--json", "json_path", type=values.OutputFile(REPORT_SUFFIXES), default="bench-out/bench.json",
              show_default=True, help="JSON output; the .md table and .png plot go beside it (checked writable first).")
@click.option("--force", is_flag=True, help=values.FORCE_HELP)
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@click.option("--background-load", type=values.BACKGROUND_LOAD, default=0, show_default=True,
              help="Busy-loop processes beside the bench, started and stopped by it: a machine whose cores are taken.")
@click.option("--keep-session", is_flag=True,
              help="Keep each method's drafter session across the prompts (lookup also drafts from the earlier "
                   "prompts' outputs, as over one Python Engine); by default each prompt starts fresh, as "
                   "`runtime generate` and every served request do.")
@sampling_options
@model_options
@clean_errors(interrupted=NOTHING_WRITTEN)
def bench(artifact, prompt_source, specs, num_prompts, max_new_tokens, chat, min_response_tokens, json_path, force, model,
          background_load, keep_session, temperature, top_k, top_p, epsilon, seed, backend) -> None:
    """Run methods interleaved on the same prompts; report tok/s, speedup over ar in one run, peak RSS.

    \b
    runtime bench art/g270 --prompts humaneval --methods ar,csv:screen,csv:cluster -n 12
    runtime bench art/g270 --prompts prompts.json --methods ar,csv --temperature 0.7
    runtime bench art/g270 --methods ar,spec:int8:gamma=6+csv,dynaspec:int8:k=8
    runtime bench art/qwen --prompts sharegpt --chat --methods ar,spec:layers:20 --min-response-tokens 4
    runtime bench art/g270 --methods ar,spec:lookup+csv:screen4 --background-load 1
    """
    from runtime import api
    from runtime.bench.contention import busy_loops
    from runtime.bench.report import markdown_table, write_reports
    from runtime.bench.summary import reference_line
    from runtime.text.data import load_prompts

    # Every cheap check before the model loads (the options' types did the rest).
    check_min_response(chat)
    values.refuse_replacing(report_paths(json_path), force)
    params = sampling_params(temperature, top_k, top_p, epsilon)
    api.check_sampling(params, specs)
    texts = load_prompts(prompt_source, num_prompts)
    if len(texts) < num_prompts:
        click.echo(f"note: {prompt_source} holds {len(texts)} prompts, fewer than -n {num_prompts}; running those",
                   err=True)
    engine = api.load(artifact, model, backend=backend, chat=chat)
    with busy_loops(background_load):
        record = engine.bench(specs, texts, max_new_tokens, params, seed, chat, min_response_tokens if chat else None,
                              keep_session)
    record = {"command": "runtime bench " + " ".join(sys.argv[2:]),
              "setup": {"prompts": prompt_source, **record["setup"], "background_load": background_load},
              "methods": record["methods"]}
    click.echo(f"peak RSS {record['setup']['peak_rss_mib']:.0f} MiB (the process, all methods)", err=True)
    headline = reference_line(record)
    table = markdown_table(record["methods"]) + (f"\n\n{headline}" if headline else "")
    paths = values.print_and_write(table, lambda: write_reports(record, json_path), "--json")
    click.echo("wrote " + ", ".join(str(p) for p in paths), err=True)


@main.command("bench-summary")
@click.argument("records", nargs=-1, required=True, type=click.Path())
@click.option("--page", type=click.Path(dir_okay=False), default=None,
              help="Also write the table into this Markdown page, between its <!-- bench-summary --> and "
                   "<!-- /bench-summary --> lines (docs/results/*.md).")
@clean_errors
def bench_summary(records, page) -> None:
    """The headline table of greedy bench records: native ar and the best exact method against llama.cpp.

    \b
    runtime bench-summary bench-out/*.json
    runtime bench-summary bench-out/zen4/*.json --page docs/results/epyc-zen4.md
    """
    from artifacts.atomic import atomic_write_bytes
    from runtime.bench.summary import page_with_summary, summary_markdown

    table = summary_markdown(list(records))
    click.echo(table)
    if page is not None:
        text = page_with_summary(values.read_utf8(page), table, list(records))
        with values.writing("--page"):
            atomic_write_bytes(Path(page), text.encode())
        click.echo(f"wrote the table into {page}", err=True)


@main.command("bench-kernels")
@click.argument("artifact", type=click.Path())
@click.option("--prompt", type=values.Text(nonempty=True), default="def fibonacci(n):", show_default=True,
              help="Text whose last hidden state is screened.")
@click.option("--repeats", type=values.COUNT, default=20, show_default=True)
@model_options
@clean_errors
def bench_kernels(artifact, prompt, repeats, backend) -> None:
    """Time the screening kernels against the exact head, in one run, on a real hidden state.

    \b
    runtime bench-kernels art/g270
    """
    from artifacts.format import Stage
    from runtime import api
    from runtime.bench.kernels import compare_kernels
    from runtime.bench.report import markdown_rows

    engine = api.load(artifact, backend=backend)
    session, ids = engine.session, engine.encode(prompt)  # a prompt beyond the context is refused here
    hidden = session.target.forward(ids, session.target.new_cache())[-1:].float()  # [1, d]
    screen4 = session.artifact.read_stage(Stage.SCREEN4) if session.artifact.has_stage(Stage.SCREEN4) else None
    rows = compare_kernels(session.target.head_weight, session.artifact.read_stage(Stage.SCREEN), hidden, repeats, screen4)
    columns = [("kernel", "kernel", "{}"), ("activations", "activations", "{}"), ("ms", "ms", "{:.2f}"),
               ("gb_per_s", "GB/s", "{:.1f}"), ("vs_full_head", "time vs exact head", "{:.2f}x"),
               ("max_error", "max abs error", "{:.2e}")]
    click.echo(markdown_rows(rows, columns))


def _items(text: str, option: str, example: str) -> list[str]:
    """comma_items, its refusal a usage error (exit 2) naming the option."""
    try:
        return comma_items(text, option, example)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _screen_formats(text: str) -> list[str]:
    """--formats: screen formats of runtime.bench.screen_bits, each once."""
    chosen = _items(text, "--formats", "q4_0,q8_row")
    unknown = next((f for f in chosen if f not in SCREEN_FORMATS), None)
    if unknown is not None:
        raise click.BadParameter(f"unknown format {unknown!r}; choose from {', '.join(SCREEN_FORMATS)}", param_hint="--formats")
    return chosen


@main.command("bench-screen")
@click.argument("artifact", type=click.Path())
@click.option("--prompts", "prompt_source", type=values.PromptSource(), default="sharegpt", show_default=True,
              help="Texts whose hidden states are screened (sharegpt: held-out conversations).")
@click.option("--positions", type=values.COUNT, default=512, show_default=True, help="Hidden states to screen.")
@click.option("--formats", default=",".join(SCREEN_FORMATS), show_default=True, help="Screen formats to measure.")
@click.option("--json", "json_path", type=values.OutputFile(), default=None,
              help="Also write the table as JSON (checked writable first).")
@click.option("--force", is_flag=True, help=values.FORCE_HELP)
@model_options
@clean_errors(interrupted=NOTHING_WRITTEN)
def bench_screen(artifact, prompt_source, positions, formats, json_path, force, backend) -> None:
    """Measure how much of the vocabulary a lower-bit screen of the head leaves to recompute (greedy, sound bound).

    \b
    runtime bench-screen art/g270 --json bench-out/screen.json
    """
    from runtime import api
    from runtime.bench.report import markdown_rows
    from runtime.bench.screen_bits import candidate_fractions
    from runtime.text.data import load_prompts
    from runtime.kernels import QuantMatrix, dequantize

    chosen = _screen_formats(formats)
    values.refuse_replacing([json_path], force)
    engine = api.load(artifact, backend=backend)
    target = engine.session.target
    hidden = []
    for text in load_prompts(prompt_source, SCREEN_TEXTS):
        ids = engine.encode(text)[:SCREEN_TEXT_TOKENS]
        hidden.append(target.forward(ids, target.new_cache()))  # [T, d]
        if sum(h.shape[0] for h in hidden) >= positions:
            break
    hidden = torch.cat(hidden)[:positions].float()  # [B, d]
    if hidden.shape[0] < positions:
        click.echo(f"note: {prompt_source} holds {hidden.shape[0]} positions (the first {SCREEN_TEXT_TOKENS} tokens of each "
                   f"of up to {SCREEN_TEXTS} texts), fewer than --positions {positions}; screening those", err=True)
    head = target.head_weight  # [V, d]
    rows = candidate_fractions(dequantize(head), hidden, chosen)
    exact_bytes = head.data.shape[1] / head.cols if isinstance(head, QuantMatrix) else head.element_size()
    report = "\n".join([
        f"{engine.session.model.info.name}: {hidden.shape[0]} hidden states of {prompt_source}; the exact head "
        f"streams {exact_bytes:.3f} bytes per weight",
        markdown_rows(rows, [("format", "screen", "{}"), ("bytes_per_weight", "bytes / weight", "{:.3f}"),
                             ("relative_error", "mean |W - Q(W)| / |W|", "{:.4f}"),
                             ("candidates_mean", "recomputed (mean)", "{:.3%}"),
                             ("candidates_p90", "p90", "{:.3%}"), ("candidates_max", "max", "{:.3%}")])])
    record = None
    if json_path:
        from runtime.bench.provenance import provenance

        record = {"command": "runtime bench-screen " + " ".join(sys.argv[2:]),
                  "setup": {"model": engine.session.model.info.name, "prompts": prompt_source, "positions": hidden.shape[0],
                            **provenance()},
                  "rows": rows}
    print_report(report, record, json_path)


def print_report(report: str, record: dict | None, json_path) -> None:
    """Print a measuring command's report and write its record (if --json asked for one), each whatever the other meets."""
    from runtime.bench.report import write_json

    def write() -> None:
        if record is not None:
            write_json(record, json_path)

    values.print_and_write(report, write, "--json")
    if record is not None:
        click.echo(f"wrote {json_path}", err=True)


def _tree_sizes(text: str) -> tuple[int, ...]:
    """--trees: node counts in 1..64, each listed once, or none."""
    if text == "none":
        return ()
    counts = _items(text, "--trees", "4,8,16")
    bad = next((n for n in counts if not (is_digits(n) and 1 <= int(n) <= 64)), None)
    if bad is not None:
        raise click.BadParameter(f"{bad!r} is not a node count in 1..64; e.g. --trees 4,8,16, or --trees none",
                                 param_hint="--trees")
    return tuple(int(n) for n in counts)


@main.command("bench-verify")
@click.argument("artifact", type=click.Path())
@click.option("--head", "head_kind", type=click.Choice(["full", "csv"]), default="full", show_default=True,
              help="Head the greedy verifier selects with on the n rows (csv: certified, bound from --bound).")
@click.option("--bound", type=click.Choice(BOUNDS), default=None, help="With --head csv: its bound (default screen).")
@click.option("--prompts", "prompt_source", type=values.PromptSource(), default="humaneval", show_default=True,
              help="Text the tokens come from: humaneval, sharegpt, or a JSON file of [{\"text\": ...}].")
@click.option("--context", type=values.COUNT, default=180, show_default=True,
              help="Tokens in the cache before the verify forward.")
@click.option("--max-n", type=values.Integer(1, SKINNY_MAX_ROWS), default=8, show_default=True,
              help=f"Largest number of tokens per verify forward (at most {SKINNY_MAX_ROWS}, the rows a forward keeps "
                   "batch-invariant).")
@click.option("--repeats", type=values.COUNT, default=10, show_default=True,
              help="Timings per n (the median is reported).")
@click.option("--trees", default="4,8,16,32", show_default=True,
              help="Also time SWARM token trees of these node counts (4 candidates per node; lean/native), or none.")
@click.option("--json", "json_path", type=values.OutputFile(), default=None,
              help="Also write the table as JSON (checked writable first).")
@click.option("--force", is_flag=True, help=values.FORCE_HELP)
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@model_options
@clean_errors(interrupted=NOTHING_WRITTEN)
def bench_verify(artifact, head_kind, bound, prompt_source, context, max_n, repeats, trees, json_path, force, model,
                 backend) -> None:
    """Time one target forward over n = 1..8 new tokens plus the greedy head work: T_V(n) / T_V(1).

    \b
    runtime bench-verify art/g270
    runtime bench-verify art/g270 --head csv --repeats 20 --json bench-out/verify.json
    """
    from runtime import api
    from runtime.bench.report import markdown_rows
    from runtime.bench.verify_cost import best_gamma, tree_verify_cost, verify_cost
    from runtime.text.data import load_prompts

    if bound is not None and head_kind != "csv":  # the full head has no bound: it would be ignored
        raise click.UsageError(f"--bound goes with --head csv (the certified head's bound); add --head csv or drop --bound {bound}")
    bound = bound or "screen"
    sizes = _tree_sizes(trees)
    values.refuse_replacing([json_path], force)
    texts = load_prompts(prompt_source, 64)
    engine = api.load(artifact, model, backend=backend)
    session = engine.session
    if engine.context_length and context + max_n > engine.context_length:
        raise click.UsageError(f"--context {context} plus --max-n {max_n} tokens pass the model's context of "
                               f"{engine.context_length}; lower them")
    head = session.certified_head(bound) if head_kind == "csv" else session.full_head()
    tokens = _token_run(session.tokenizer, texts, context + max(max_n, 9))  # trees: the root + up to 8 levels
    rows = verify_cost(session.target, head, tokens, context, max_n, repeats)
    if sizes and session.target.name == "transformers":
        click.echo("token trees skipped: the transformers backend has no tree forward (--backend lean|native)", err=True)
        sizes = ()
    tree_rows = tree_verify_cost(session.target, head, tokens, context, sizes, repeats=repeats) if sizes else []
    columns = [("n", "n", "{}"), ("forward_ms", "forward ms", "{:.2f}"), ("head_ms", "head ms", "{:.2f}"),
               ("total_ms", "T_V(n) ms", "{:.2f}"), ("ratio", "T_V(n) / T_V(1)", "{:.2f}x")]
    near_ties = any(row["head_fallbacks"] for row in rows)  # a near-tie position: its full-head pass is in every timing
    if near_ties:
        columns.insert(3, ("head_fallbacks", "full-head rows", "{:.1f}"))
    label = f"csv:{bound}" if head_kind == "csv" else "full"
    choices = {alpha: best_gamma(rows, alpha) for alpha in (0.3, 0.5, 0.7, 0.9)}
    report = [f"{session.model.info.name}, {session.target.name} backend ({kernel_name()} kernels), head {label}, "
              f"cache {context} tokens, {decode_threads()} threads, median of {repeats}",
              markdown_rows(rows, columns),
              *(["full-head rows: rows per forward the certified head sent to the full head (a near-tie in this "
                 "text, met in every repeat; a decoding loop meets few: `runtime bench`'s fallback column), so "
                 "their T_V(n) holds a full-head pass; another --context moves the text"] if near_ties else []),
              "best gamma with a free drafter (n-gram): " + ", ".join(
                  f"acceptance {alpha:.0%} -> gamma {g} ({speedup:.2f}x)" for alpha, (g, speedup) in choices.items())]
    if tree_rows:
        report += ["token trees: one tree forward over the last token + N nodes, greedy tree verifier; T_V(1) here is a "
                   "one-token step timed between the trees (interleaved with them, not the table above)",
                   markdown_rows(tree_rows, [("nodes", "nodes N", "{}"), ("depth", "depth", "{}"),
                                             ("forward_ms", "forward ms", "{:.2f}"), ("total_ms", "T_V ms", "{:.2f}"),
                                             ("ratio", "T_V / T_V(1)", "{:.2f}x")])]
    record = None
    if json_path:
        from runtime.bench.provenance import provenance

        record = {"command": "runtime bench-verify " + " ".join(sys.argv[2:]),
                  "setup": {"model": session.model.info.name, "backend": session.target.name, "head": label,
                            "context": context, "repeats": repeats, "threads": decode_threads(),
                            "prompts": prompt_source, **provenance()},
                  "rows": rows,
                  "tree_rows": tree_rows,
                  "best_gamma_free_drafter": {str(a): {"gamma": g, "speedup": s} for a, (g, s) in choices.items()}}
    print_report("\n".join(report), record, json_path)


def _token_run(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """The first `length` token ids of the texts joined by blank lines [length]."""
    ids: list[int] = []
    for count in range(1, len(texts) + 1):
        ids = tokenizer("\n\n".join(texts[:count]))["input_ids"]
        if len(ids) >= length:
            return torch.tensor(ids[:length], dtype=torch.long)
    raise ValueError(f"the prompts give {len(ids)} tokens, {length} are needed: use a longer --prompts source "
                     "or a smaller --context")
