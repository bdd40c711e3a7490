"""`runtime bench-serve`: concurrent streaming clients against our server and llama.cpp's llama-server."""

from __future__ import annotations

import json
import sys
import urllib.request
from contextlib import contextmanager, nullcontext

import click

from runtime.cli import values
from runtime.cli.group import clean_errors, main
from runtime.cli.bench import NOTHING_WRITTEN
from runtime.common.checks import comma_items

SERVERS = ("ours", "llama-server")
MAX_CONCURRENCY = 64
COLUMNS = [("server", "server", "{}"), ("concurrency", "clients", "{}"), ("requests", "requests", "{}"),
           ("errors", "errors", "{}"), ("aggregate_tokens_per_s", "aggregate tok/s", "{:.2f}"),
           ("per_request_tokens_per_s", "per-request tok/s (median)", "{:.2f}"), ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
           ("ttft_p99_s", "TTFT p99 s", "{:.3f}"), ("probe_same_as_alone", "probe text as alone", "{}")]


def concurrency_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: client counts from 1 to MAX_CONCURRENCY, each once (else a ValueError)."""
    items = comma_items(text, "--concurrency", "1,2,4,8")
    if not all(item.isdigit() and 1 <= int(item) <= MAX_CONCURRENCY for item in items):
        raise ValueError(f"--concurrency {text}: give client counts from 1 to {MAX_CONCURRENCY}, e.g. 1,2,4,8")
    return [int(item) for item in items]


def server_names(text: str) -> list[str]:
    """'ours,llama-server' -> the names, each one of SERVERS (else a ValueError)."""
    items = comma_items(text, "--servers", "ours,llama-server")
    if not set(items) <= set(SERVERS):
        raise ValueError(f"--servers {text}: name {' and/or '.join(SERVERS)}, e.g. ours,llama-server")
    return items


def model_id(url: str) -> str:
    """The first model a server lists at /v1/models (what requests name)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as reply:
        return json.load(reply)["data"][0]["id"]


def load_server(name: str, url: str, prompts: list[str], levels: list[int], max_tokens: int, max_requests: int,
                duration: float, extra: dict | None = None, restart=None) -> list[dict]:
    """Every concurrency level against one server: the probe alone first (warm-up and reference text), then
    each level with the probe among its requests. restart(level): a context manager giving the URL of a
    server started for that level (llama-server's slots), else `url` serves every level."""
    from runtime.bench.load import run_level, summarize

    rows, reference = [], None
    for level in levels:
        with restart(level) if restart else nullcontext(url) as level_url:
            model = model_id(level_url)
            if reference is None:
                alone, _ = run_level(level_url, model, prompts, 1, max_tokens, 0, 1e9, prompts[0], extra)
                reference = alone[0].text if alone[0].error is None else None
            outcomes, wall = run_level(level_url, model, prompts, level, max_tokens, max_requests, duration, prompts[0], extra)
        probe = [o for o in outcomes if o.prompt == -1][0]
        row = {"server": name, "concurrency": level, **summarize(outcomes, wall),
               "probe_same_as_alone": None if probe.error or reference is None else probe.text == reference}
        click.echo(f"{name} x{level}: {row['aggregate_tokens_per_s']:.2f} tok/s aggregate, {row['errors']} errors", err=True)
        rows.append(row)
    return rows


@main.command("bench-serve")
@click.argument("artifact", type=click.Path())
@click.option("--servers", default="ours,llama-server", show_default=True,
              help="Servers to load, each started here on 127.0.0.1: ours (runtime serve), llama-server (llama.cpp's, "
                   "-np clients; SPECVOCAB_LLAMACPP_BIN).")
@click.option("--url", default=None, help="Load the server already running at this URL as 'ours' instead of starting one.")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Concurrent streaming clients, per level.")
@click.option("--requests", "max_requests", type=values.COUNT, default=16, show_default=True,
              help="Requests per level at most (besides the probe).")
@click.option("--duration", type=values.Number(0, low_open=True), default=120.0, show_default=True,
              help="Seconds per level at most: no request starts after it (those in flight finish).")
@click.option("--prompts", "prompt_source", type=values.PromptSource(), default="humaneval", show_default=True,
              help="humaneval, sharegpt, or a JSON file of [{\"text\": ...}]; the first is the probe.")
@click.option("-n", "num_prompts", type=values.COUNT, default=8, show_default=True, help="Prompts to cycle through.")
@click.option("--max-tokens", type=values.COUNT, default=64, show_default=True, help="max_tokens of every request.")
@click.option("--method", type=values.METHOD, default=None, help="Our server's --method (default: its default).")
@click.option("--threads", type=values.THREADS, default=1, show_default=True, help="Threads of each server.")
@click.option("--json", "json_path", type=values.OutputFile((".md",)), default="bench-out/serve.json", show_default=True,
              help="JSON output; the .md table goes beside it.")
@click.option("--force", is_flag=True, help=values.FORCE_HELP)
@clean_errors(interrupted=NOTHING_WRITTEN)
def bench_serve(artifact, servers, url, concurrency, max_requests, duration, prompt_source, num_prompts, max_tokens,
                method, threads, json_path, force) -> None:
    """Load servers with 1, 2, 4, 8 concurrent streaming greedy clients; report aggregate and per-request tok/s,
    time to first token p50/p99, errors, and whether a probe prompt's text moved under load.

    \b
    runtime bench-serve art/g270
    runtime bench-serve art/qwen --concurrency 1,8 --requests 32 --max-tokens 128 --threads 2
    runtime bench-serve art/g270 --servers ours --url http://127.0.0.1:8000
    """
    from artifacts import Artifact
    from runtime.bench.provenance import provenance
    from runtime.bench.report import markdown_rows, write_json
    from runtime.bench.servers import LLAMA_EXTRA, our_server
    from runtime.text.data import load_prompts
    from runtime.models.resolve import resolve_model
    from runtime.session import model_spec_of

    levels, names = concurrency_levels(concurrency), server_names(servers)
    markdown_path = json_path.with_suffix(".md")
    values.refuse_replacing([json_path, markdown_path], force)
    texts = load_prompts(prompt_source, num_prompts)
    spec = model_spec_of(Artifact.open(artifact))
    limits = (max_tokens, max_requests, duration)
    rows, builds = [], {}
    if "ours" in names:
        if url is not None:
            rows += load_server("ours", url.rstrip("/"), texts, levels, *limits)
        else:
            with our_server(artifact, threads, str(method) if method else None, max(levels)) as ours:
                rows += load_server("ours", ours, texts, levels, *limits)
    if "llama-server" in names:
        gguf = resolve_model(spec, progress=False).gguf_path
        if gguf is None:
            raise click.ClickException(f"llama-server decodes a .gguf file and {spec} has none; run --servers ours")

        rows += load_server("llama-server", "", texts, levels, *limits, LLAMA_EXTRA,
                            lambda level: _llama_level(gguf, threads, level, builds))
    record = {"command": "runtime bench-serve " + " ".join(sys.argv[2:]),
              "setup": {"model": spec, "method": str(method) if method else "the server's default", "threads": threads,
                        "prompts": str(prompt_source), "num_prompts": len(texts), "max_tokens": max_tokens,
                        "max_requests": max_requests, "duration_s": duration, **provenance(),
                        "llama_server": next(iter(builds.values()), None)},
              "levels": rows}
    table = markdown_rows(rows, COLUMNS)

    def write():
        from artifacts.atomic import atomic_write_bytes

        write_json(record, json_path)
        header = ", ".join(f"{k}={v}" for k, v in record["setup"].items())
        atomic_write_bytes(markdown_path, f"`{record['command']}`\n\n{header}\n\n{table}\n".encode())
        return json_path, markdown_path

    paths = values.print_and_write(table, write, "--json")
    click.echo("wrote " + ", ".join(str(p) for p in paths), err=True)


@contextmanager
def _llama_level(gguf, threads: int, level: int, builds: dict):
    """llama-server with `level` slots; yields its URL, its build line kept in `builds`."""
    from runtime.bench.servers import llama_server

    with llama_server(gguf, threads, level) as (url, build):
        builds[url] = build
        yield url
