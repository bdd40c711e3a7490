"""One validation layer for `runtime` command-line values: click types that refuse a bad value with one
line naming the option and the fix, before any model loads.

Every numeric option, text option, input file and output path of the runtime commands goes through
one of these types; a command body receives values that are already valid (finite numbers in range,
UTF-8 text, readable prompt files, writable output paths, parsed method names).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import click

from artifacts.format import MANIFEST_FILE
from runtime.common.checks import first_surrogate
from runtime.common.sampling import MAX_SEED, SamplingParams
from runtime.kernels.build import usable_cores
from runtime.text.data import PACKAGED_SOURCES, PromptFile, prompts_from_json

STOP_ESCAPES = r"\n \t \r \\ \" \' \0 \xHH \uHHHH \UHHHHHHHH"
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[ntr0\\\"']|.?)", re.DOTALL)
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'"}

T = TypeVar("T")


def _range_text(low, high, low_open: bool) -> str:
    """'>= 1', 'in (0, 1]', ... for messages."""
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


class Number(click.ParamType):
    """A finite float in a range (nan and inf are refused: they pass every comparison click makes)."""

    name = "number"

    def __init__(self, low: float, high: float | None = None, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):
            self.fail(f"give a finite number {self._range()}, not {value!r}", param, ctx)
        below = number <= self.low if self.low_open else number < self.low
        if below or (self.high is not None and number > self.high):
            self.fail(f"give a number {self._range()}, not {value}", param, ctx)
        return number

    def _range(self) -> str:
        return _range_text(self.low, self.high, self.low_open)


class Integer(click.ParamType):
    """An integer in [low, high] (high optional)."""

    name = "integer"

    def __init__(self, low: int, high: int | None = None, hint: str = "") -> None:
        self.low, self.high, self.hint = low, high, hint

    def convert(self, value, param, ctx):
        text = str(value).strip()
        number = int(text) if re.fullmatch(r"[+-]?\d+", text, re.ASCII) else None  # \d alone takes '٣' too
        if number is None or number < self.low or (self.high is not None and number > self.high):
            self.fail(f"give an integer {_range_text(self.low, self.high, False)}{self.hint}, not {value!r}",
                      param, ctx)
        return number


class SamplingValue(click.ParamType):
    """One field of runtime.common.sampling.SamplingParams (a number, or an integer), checked by SamplingParams.

    The sampling ranges and their messages are stated there once, for the CLI and the API.
    """

    def __init__(self, field: str, integer: bool = False) -> None:
        self.field, self.integer = field, integer
        self.name = "integer" if integer else "number"

    def convert(self, value, param, ctx):
        text = str(value).strip()
        # Not a number (nor digits such as '٣', which int() and float() also read): SamplingParams refuses
        # the text with the message it gives every bad value.
        number = text
        if text.isascii():
            try:
                number = int(text) if self.integer else float(text)
            except ValueError:
                pass
        try:  # this field alone, sampling: how the options combine is checked once all are known (sampling_params)
            SamplingParams(**{"temperature": 1.0, self.field: number})
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return number


class Text(click.ParamType):
    """Text typed on the command line: UTF-8 (a stray byte arrives as a lone surrogate); not empty where `nonempty`."""

    name = "text"

    def __init__(self, nonempty: bool = False) -> None:
        self.nonempty = nonempty

    def convert(self, value, param, ctx):
        bad = first_surrogate(value)
        if bad is not None:
            self.fail(f"holds a byte that is not UTF-8 (character {bad}); pass UTF-8 text, or put the text in a "
                      "UTF-8 file and use --prompt-file", param, ctx)
        if self.nonempty and not value:
            self.fail("is empty; give some text", param, ctx)
        return value


class StopText(Text):
    """A stop string: UTF-8, non-empty, with backslash escapes decoded (only the ones in STOP_ESCAPES)."""

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)

        def decode(match: re.Match) -> str:
            code = match.group(1)
            if code in _SIMPLE:
                return _SIMPLE[code]
            point = int(code[1:], 16) if code[:1] in ("x", "u", "U") and len(code) > 1 else -1
            if 0 <= point <= 0x10FFFF and not 0xD800 <= point <= 0xDFFF:
                return chr(point)
            self.fail(f"'{value}': bad escape '{match.group(0)}' at character {match.start()}; allowed escapes: "
                      f"{STOP_ESCAPES} (write \\\\ for a backslash)", param, ctx)

        text = _ESCAPE.sub(decode, value)
        if not text:
            self.fail("is empty; give the text that ends generation, e.g. --stop '\\n\\n'", param, ctx)
        return text


def read_utf8(path: str | Path) -> str:
    """The text of a UTF-8 file; a missing, unreadable, binary or non-UTF-8 file is a ValueError naming it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ValueError(f"{path} is a directory; give a text file") from None
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}; check the path") from None
    if b"\0" in data:
        raise ValueError(f"{path} is a binary file (a NUL byte at offset {data.index(0)}); give a UTF-8 text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None


class TextFile(click.ParamType):
    """A UTF-8 text file, read at once: the value is its text."""

    name = "file"

    def convert(self, value, param, ctx):
        try:
            return read_utf8(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class PromptSource(click.ParamType):
    """humaneval, sharegpt, or a JSON file of [{"text": ...}] objects holding at least one prompt."""

    name = "source"
    NAMED = PACKAGED_SOURCES

    def convert(self, value, param, ctx):
        if isinstance(value, PromptFile) or value in self.NAMED:
            return value
        if not Path(value).exists():
            self.fail(f"{value!r} is neither {' nor '.join(self.NAMED)} nor an existing file; check the path", param, ctx)
        try:
            data = json.loads(read_utf8(value))  # read once: the file may be a pipe, `<(...)`
        except json.JSONDecodeError as e:
            self.fail(f"cannot read prompts from {value}: not JSON ({e}); it should hold a JSON list of "
                      '{"text": ...} objects', param, ctx)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        try:
            prompts = prompts_from_json(data, value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        if not prompts:
            self.fail(f"{value} holds no prompts ([]); add at least one {{\"text\": ...}} object", param, ctx)
        return PromptFile(value, prompts)


class MethodList(click.ParamType):
    """Comma-separated method names of runtime.methods' grammar, parsed: the value is a list of MethodSpec."""

    name = "methods"

    def convert(self, value, param, ctx):
        from runtime.methods import parse_methods

        if isinstance(value, list):
            return value
        try:
            return parse_methods(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class MethodName(click.ParamType):
    """One method name of runtime.methods' grammar, parsed: the value is a MethodSpec."""

    name = "method"

    def convert(self, value, param, ctx):
        from runtime.methods import MethodSpec, parse_method

        if isinstance(value, MethodSpec):
            return value
        try:
            return parse_method(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class OutputFile(click.ParamType):
    """A file path the command will write (with `siblings`: the same stem with those suffixes too),
    checked writable now, before any work: nothing is created or changed by the check."""

    name = "path"

    def __init__(self, siblings: tuple[str, ...] = ()) -> None:
        self.siblings = siblings

    def convert(self, value, param, ctx):
        path = Path(value)
        if not path.name or str(value).endswith(os.sep):  # "", ".", "out/": a folder, with no stem to put the outputs
            # beside ("..": unwritable below)
            self.fail(f"cannot write {value!r}: it names a directory; give a file path, e.g. bench-out/run.json", param, ctx)
        if path.suffix in self.siblings:
            self.fail(f"{path}: the {path.suffix} output goes beside the JSON and would replace it; give a path "
                      f"ending in .json", param, ctx)
        for target in (path, *(path.with_suffix(s) for s in self.siblings)):
            if artifact_file(target):
                self.fail(f"cannot write {target}: it is a file of the artifact in {target.parent}; choose another path",
                          param, ctx)
            problem = unwritable(target)
            if problem:
                self.fail(f"cannot write {target}: {problem}; choose a writable path", param, ctx)
        return path


FORCE_HELP = "Replace output files an earlier run left at the --json path (refused otherwise)."


def refuse_replacing(paths: Sequence[Path | None], force: bool) -> None:
    """Refuse, before any work, an output file that exists when --force was not given (one usage-error line).

    An earlier run's results are never replaced silently; None stands for an output not asked for.
    """
    existing = [p for p in paths if p is not None and p.exists()]
    if existing and not force:
        raise click.UsageError(f"{existing[0]} exists (an earlier run's output); pass another --json path, or "
                               f"--force to replace it")


def artifact_file(path: Path) -> bool:
    """Whether `path` is an artifact's manifest or a file its manifest lists: never an output to write, even with --force."""
    manifest = path.parent / MANIFEST_FILE
    if not manifest.is_file():
        return False
    if path.name == MANIFEST_FILE:
        return True
    try:
        stages = json.loads(manifest.read_text()).get("stages") or {}
        return any(path.name in (stage.get("files") or {}) for stage in stages.values())
    except (OSError, ValueError, AttributeError):  # a damaged manifest: its own commands say so
        return False


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be written (None if it can): probed with a temporary file that is removed again."""
    if path.is_dir():
        return "it is a directory"
    if path.exists() and not os.access(path, os.W_OK):
        return "the file is read-only"
    folder = path.parent
    while not folder.exists():  # the command creates the missing folders under the nearest existing one
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as e:
        return f"no file can be created in {folder} ({e.strerror or e})"
    return None


def print_and_write(table: str, write: Callable[[], T], option: str) -> T:
    """Print a run's results, then write its files: each happens whatever the other meets.

    A full disk loses no printed table, and a closed or full standard output (`| true`, `> /dev/full`)
    no written record: the files are written before the printing error is raised.
    """
    try:
        click.echo(table)
    except OSError:
        with writing(option):
            write()
        raise
    with writing(option):
        return write()


@contextlib.contextmanager
def writing(option: str):
    """Writing a command's output files: an OSError is one line naming the file and the option."""
    try:
        yield
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the output'}: {e.strerror or e}; the results are "
                                   f"printed above; rerun with a writable {option}") from None


TEMPERATURE = SamplingValue("temperature")
TOP_K = SamplingValue("top_k", integer=True)
TOP_P = SamplingValue("top_p")
EPSILON = SamplingValue("epsilon")
SEED = Integer(0, MAX_SEED)
COUNT = Integer(1)  # a number of things (tokens, prompts, repeats): at least 1
THREADS = Integer(1, usable_cores(), hint=" (the cores this process may use)")
NON_NEGATIVE = Integer(0)
METHOD = MethodName()
BACKGROUND_LOAD = Integer(0, 64, hint=" (busy-loop processes; more is a typo, not a machine)")
