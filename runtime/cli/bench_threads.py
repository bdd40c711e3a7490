"""`runtime bench-threads`: decoding speed per thread setting, quiet and beside busy-loop processes."""

from __future__ import annotations

import json
import os
import sys

import click

from runtime.cli import values
from runtime.cli.group import clean_errors, main
from runtime.cli.bench import NOTHING_WRITTEN
from runtime.common.checks import comma_items

MAX_LOAD = 64  # busy-loop processes: more is a typo, not a machine


def thread_settings(text: str) -> list[str]:
    """'default,1,2' -> ['default', '1', '2']: 'default' or a count of usable cores, each once (else a ValueError)."""
    from runtime.bench.contention import DEFAULT
    from runtime.kernels.build import usable_cores

    items = comma_items(text, "--thread-settings", "default,1")
    for item in items:
        if item != DEFAULT and not (item.isdigit() and 1 <= int(item) <= usable_cores()):
            raise ValueError(f"--thread-settings: {item!r} is neither '{DEFAULT}' nor a thread count from 1 to "
                             f"{usable_cores()} (the cores this process may use)")
    return items


def loads(text: str) -> list[int]:
    """'0,1' -> [0, 1]: numbers of busy-loop processes, each from 0 to MAX_LOAD (else a ValueError)."""
    items = comma_items(text, "--background-load", "0,1")
    if not all(item.isdigit() and int(item) <= MAX_LOAD for item in items):
        raise ValueError(f"--background-load {text}: give numbers of busy-loop processes from 0 to {MAX_LOAD}, e.g. 0,1")
    return [int(item) for item in items]


@main.command("bench-threads")
@click.argument("artifact", type=click.Path())
@click.option("--methods", default="ar,default", show_default=True,
              help="Comma-separated methods; 'default' is the method generate runs when none is named.")
@click.option("--thread-settings", "settings", default="default,1,2", show_default=True,
              help="'default' (every core, the extra ones stood down while they do not pay) and fixed counts.")
@click.option("--background-load", "load_text", default="0,1", show_default=True,
              help="Busy-loop processes beside the bench, one run per number (started and stopped by the bench).")
@click.option("--prompts", "prompt_source", type=values.PromptSource(), default="humaneval", show_default=True)
@click.option("-n", "num_prompts", type=values.COUNT, default=4, show_default=True)
@click.option("--max-new-tokens", type=values.COUNT, default=64, show_default=True)
@click.option("--json", "json_path", type=values.OutputFile(), default="bench-out/threads.json", show_default=True)
@click.option("--force", is_flag=True, help=values.FORCE_HELP)
@clean_errors(interrupted=NOTHING_WRITTEN)
def bench_threads(artifact, methods, settings, load_text, prompt_source, num_prompts, max_new_tokens, json_path, force) -> None:
    """Greedy decoding speed per thread setting, interleaved, quiet and with busy-loop processes beside it.

    \b
    runtime bench-threads art/g270                          # ar and the default method; default, 1, 2 threads; 0 and 1 busy loops
    runtime bench-threads art/qwen --methods ar --background-load 1 -n 8
    """
    from artifacts.atomic import atomic_write_bytes
    from runtime import api
    from runtime.bench.contention import markdown, rows, run_contention
    from runtime.bench.provenance import provenance
    from runtime.text.data import load_prompts
    from runtime.methods import build_method

    # Every check before the model loads.
    setting_list, load_list = thread_settings(settings), loads(load_text)
    values.refuse_replacing([json_path], force)
    parsed = {name: None if name == "default" else api.as_method_spec(name)
              for name in comma_items(methods, "--methods", "ar,default")}
    texts = load_prompts(prompt_source, num_prompts)
    engine = api.load(artifact)
    specs = [spec or engine.default_method() for spec in parsed.values()]
    ids = [engine.encode(text) for text in texts]
    started_load = os.getloadavg()
    cells = run_contention(specs, lambda spec: build_method(engine.session, spec), ids, max_new_tokens, setting_list,
                           load_list, api.set_threads)
    table = rows(cells)
    record = {"command": "runtime bench-threads " + " ".join(sys.argv[2:]),
              "setup": {"model": engine.session.model.info.name, "n": len(ids), "max_new_tokens": max_new_tokens,
                        "prompts": prompt_source, "thread_settings": setting_list, "background_load": load_list,
                        "loadavg_before": started_load, "loadavg_after": os.getloadavg(),
                        "backend": engine.session.target.name, **provenance()},
              "rows": table}
    def write() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(json_path, json.dumps(record, indent=1).encode())

    values.print_and_write(markdown(table), write, "--json")
    click.echo(f"wrote {json_path}", err=True)
