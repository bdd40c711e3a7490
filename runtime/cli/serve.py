"""`runtime serve`: an OpenAI-compatible server over an artifact's model (runtime.serve)."""

from __future__ import annotations

from pathlib import Path

import click

from runtime.cli import values
from runtime.cli.group import clean_errors, main, model_options
from runtime.methods import SERVING_DEFAULT_METHOD_HELP


@main.command()
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=values.Integer(0, 65535), default=8000, show_default=True, help="Port (0: any free one).")
@click.option("--method", type=values.METHOD, default=None,
              help=f"Method for requests that name none (default: {SERVING_DEFAULT_METHOD_HELP}); a request may name its own "
                   "in the extra field \"method\".")
@click.option("--max-batch", type=values.Integer(1, 64), default=8, show_default=True,
              help="Requests decoded at once; the rest wait in the queue.")
@click.option("--max-queue", type=values.COUNT, default=64, show_default=True,
              help="Requests that may wait for a slot; one more gets 503.")
@click.option("--timeout", type=values.Number(0, low_open=True), default=600.0, show_default=True,
              help="Seconds a request may take, queued and decoding; then it ends with 504.")
@click.option("--api-key", type=values.Text(nonempty=True), default=None, envvar="SPECVOCAB_API_KEY",
              help="Require 'Authorization: Bearer KEY' (or set SPECVOCAB_API_KEY); /health stays open.")
@click.option("--model", default=None, help="Model to run (default: the one the artifact was built for).")
@model_options
@clean_errors(interrupted="the server stopped; requests still open got a 503 error")
def serve(artifact, host, port, method, max_batch, max_queue, timeout, api_key, model, backend) -> None:
    """Serve the OpenAI API (completions, chat, streaming) with continuous batching; every response's
    tokens are the ones `runtime generate` gives with the same method, seed and values, whatever the load.

    \b
    runtime serve art/g270
    runtime serve art/qwen --method spec:lookup+csv --max-batch 4 --port 8080 --api-key secret
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "gemma3-270m", "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'
    """
    from runtime import api
    from runtime.serve.app import create_app
    from runtime.serve.scheduler import Scheduler, check_servable
    from runtime.serve.server import listen, serve as run_server

    if method is not None:
        try:
            check_servable(method)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--method'") from None
    sock = listen(host, port)  # a port in use fails before the model loads
    engine = api.load(artifact, model, backend=backend)
    spec = method or engine.default_method(serving=True)
    engine.method(spec)  # built now: the first request does not wait for it
    scheduler = Scheduler(engine, max_batch, max_queue)
    name = engine.session.model.info.name
    app = create_app(scheduler, name, str(spec), api_key, timeout, aliases=(Path(artifact).name,))
    bound_host, bound_port = sock.getsockname()[:2]
    run_server(scheduler, app, sock, f"[specvocab] serving {name} at http://{bound_host}:{bound_port}/v1 "
                                     f"(method {spec}, up to {max_batch} at once); Ctrl-C stops")
