"""The `runtime` command group and what its commands share: one-line errors, interrupts, the model and sampling options."""

from __future__ import annotations

import errno
import functools
import signal
import threading
import traceback
from contextlib import contextmanager
from typing import Callable

import click

from artifacts import ArtifactError
from runtime.cli import values
from runtime.common.sampling import MIN_RESPONSE_TOKENS
from runtime.models import ModelError


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is, as Ctrl-C's KeyboardInterrupt is: the same cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextmanager
def signals_as_interrupts():
    """Within: SIGTERM and SIGHUP (a `kill`, a closed terminal) raise Interrupted; outside, the old handlers."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def os_error_line(error: OSError) -> str:
    """runtime's line for an OS error no option check foresaw: a full disk under an output or standard output."""
    where = f" ({error.filename})" if error.filename else " (writing the output)"
    return f"{error.strerror or error}{where}; free space or choose another place for the output, then rerun the command"


def clean_errors(command=None, *, interrupted: str | None = None, os_error: Callable[[OSError], str] = os_error_line):
    """Turn expected failures into one-line click errors (exit 1, no traceback), and interrupts into one line.

    Ctrl-C (exit 130), SIGTERM and SIGHUP (128 + the signal) add `interrupted` to their line where there
    is more to say: what the command keeps, and how to go on. `os_error` words an OS error's line; a
    broken pipe (`| head`) is left to click, which exits quietly as pipes expect.
    """
    if command is None:
        return functools.partial(clean_errors, interrupted=interrupted, os_error=os_error)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (ArtifactError, ModelError, ValueError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from exc
        except KeyboardInterrupt as exc:
            traceback.clear_frames(exc.__traceback__)  # progress bars close now, so this line is the last one
            signum = getattr(exc, "signum", signal.SIGINT)
            how = "" if signum == signal.SIGINT else f" ({signal.Signals(signum).name})"
            click.echo(f"Error: interrupted{how}" + (f"; {interrupted}" if interrupted else ""), err=True)
            raise click.exceptions.Exit(128 + signum) from None
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                raise
            raise click.ClickException(os_error(exc)) from None

    return wrapper


class UsageLine(click.ClickException):
    """A usage error as one line (exit 2, click's code for usage errors)."""

    exit_code = 2


@contextmanager
def one_line_usage():
    """Turn click's usage errors (a usage block, a hint and the error: four lines) into one line naming --help."""
    try:
        yield
    except click.exceptions.NoArgsIsHelpError:
        raise  # a bare `runtime` or `prep` shows its help, as usual
    except click.UsageError as e:
        message = e.format_message()
        if e.ctx is not None:
            message += f" See {e.ctx.command_path} --help." if message.endswith((".", "?")) else f"; see {e.ctx.command_path} --help"
        raise UsageLine(message) from None


class OneLineGroup(click.Group):
    """A command group whose every error, usage errors included, is one line."""

    def make_context(self, info_name, args, parent=None, **extra):
        with one_line_usage():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx):
        with one_line_usage(), signals_as_interrupts():
            return super().invoke(ctx)


def model_options(command):
    """--backend and --threads, shared by the commands that run a model; --threads is applied at once.

    It sets the process default (runtime.api.set_threads), which the command's one session decodes with.
    """
    from runtime.backends import BACKENDS

    @functools.wraps(command)
    def with_threads(*args, threads, **kwargs):
        from runtime.api import set_threads

        set_threads(threads)
        return command(*args, **kwargs)

    options = [
        click.option("--backend", type=click.Choice(list(BACKENDS)), default="auto", show_default=True,
                     help="Backend (the TargetModel implementation): lean (hand-written forward, gemma3/qwen2/llama), "
                          "transformers, native where available, or auto (the fastest exact one supported)."),
        click.option("--threads", type=values.THREADS, default=None, help="Decoding threads (default: every core this process may use, stood down while one is taken)."),
    ]
    for option in reversed(options):
        with_threads = option(with_threads)
    return with_threads


def sampling_options(command):
    """--temperature/--top-k/--top-p/--epsilon/--seed, shared by generate and bench."""
    options = [
        click.option("--temperature", type=values.TEMPERATURE, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-k", type=values.TOP_K, default=0, show_default=True, help="0 = off."),
        click.option("--top-p", type=values.TOP_P, default=1.0, show_default=True, help="1 = off."),
        click.option("--epsilon", type=values.EPSILON, default=None, help="csv only: allow total variation <= epsilon."),
        click.option("--seed", type=values.SEED, default=0, show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def sampling_params(temperature, top_k, top_p, epsilon):
    """SamplingParams from the sampling options (a bad value is a one-line error)."""
    from runtime.common.sampling import SamplingParams

    return SamplingParams(temperature, top_k, top_p, epsilon)


min_response_option = click.option(
    "--min-response-tokens", type=values.NON_NEGATIVE, default=MIN_RESPONSE_TOKENS, show_default=True,
    help="With --chat: no EOS among the first N response tokens, in drafts or the target's choice (0 = off).")


def check_min_response(chat: bool) -> None:
    """Refuse --min-response-tokens given without --chat, which would ignore it."""
    source = click.get_current_context().get_parameter_source("min_response_tokens")
    if not chat and source is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--min-response-tokens applies with --chat (the response's first tokens); add --chat or drop it")


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Decode with specvocab artifacts, benchmark methods, inspect artifacts.

    \b
    runtime generate art/g270 --method csv --prompt "Write a haiku about rain."
    runtime generate art/g270 --method spec:int8:gamma=6+csv --prompt "def fib(n):"
    runtime bench art/g270 --prompts humaneval --methods ar,csv:screen,csv:cluster
    runtime bench-verify art/g270 --head csv
    runtime inspect art/g270
    runtime serve art/g270 --port 8000
    """
