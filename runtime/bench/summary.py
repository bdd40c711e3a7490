"""The headline table from `runtime bench` records: per record, native `ar` and the best exact method
against llama.cpp's plain decoding, whether every exact method matched `ar`, and llama.cpp's own
identity to `ar` (the figures the results pages in docs/results/ report, read back from the JSONs).
A page holds the table between bench-summary markers, so it is regenerated, never edited.

llama.cpp's plain decoding is the faster of the rows that ran it: through llama-cpp-python (`llamacpp`)
and by its own llama-server binary (`llamacpp:bin`); the table names which, with the other's rate."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from runtime.bench.report import markdown_rows

PROMPT_NAMES = {"humaneval": "HumanEval", "sharegpt": "ShareGPT held-out"}
COLUMNS = [
    ("cell", "model, prompts (n × tokens)", "{}"),
    ("threads", "threads", "{}"),
    ("ar", "`ar` tok/s", "{:.1f}"),
    ("llamacpp", "llama.cpp tok/s", "{:.1f}"),
    ("llamacpp_as", "llama.cpp run as", "{}"),
    ("ar_vs_llamacpp", "native `ar` / llama.cpp", "{:.2f}x"),
    ("best", "best exact method, tok/s", "{}"),
    ("best_vs_llamacpp", "best exact / llama.cpp", "{:.2f}x"),
    ("exact_identical", "exact methods = `ar`", "{}"),
    ("llamacpp_identical", "llama.cpp = `ar`", "{:.0%}"),
    ("rss", "peak RSS", "{:.1f} GiB"),
]
# Shown only when a record also ran a llama.cpp variant (llamacpp:lookup): llama.cpp's fastest row.
VARIANT_COLUMNS = [
    ("llamacpp_fastest", "llama.cpp's fastest, tok/s (= `ar`)", "{}"),
    ("best_vs_llamacpp_fastest", "best exact / llama.cpp's fastest", "{:.2f}x"),
]
_NUMBER = (int, float)  # a JSON number
PLAIN_LLAMACPP = ("llamacpp", "llamacpp:bin")  # llama.cpp's plain decoding: the Python wrapper's loop, its own binary


def _finite_non_negative(value: float) -> bool:
    """Whether a number is finite and at least 0 (a rate, a size)."""
    return math.isfinite(value) and value >= 0


class Field(NamedTuple):
    """A record field the summary reads: its JSON types, and where it has a range, a test and its words."""

    kinds: type | tuple[type, ...]
    in_range: Callable[[float], bool] | None = None
    words: str = ""


# The fields the summary reads (each may be absent or null).
SETUP_FIELDS = {"model": Field(str), "prompts": Field(str), "n": Field(int), "max_new_tokens": Field(int), "threads": Field(int),
                "temperature": Field(_NUMBER), "peak_rss_mib": Field(_NUMBER, _finite_non_negative, "a finite number >= 0"),
                "code": Field(str), "cpu": Field(str), "screen_kernel": Field(str), "backend": Field(str),
                "llamacpp_build": Field(str), "llamacpp_bin_build": Field(str)}
ROW_FIELDS = {"tokens_per_s": Field(_NUMBER, _finite_non_negative, "a finite rate >= 0 (0: no decode step)"),
              "identical_to_ar": Field(_NUMBER, lambda v: 0 <= v <= 1, "a share in [0, 1]"),
              "distribution_preserving": Field(bool)}
_KIND_WORDS = {str: "text", int: "an integer", bool: "true or false"}


class SummaryError(ValueError):
    """A file that is not a greedy `runtime bench` record."""


def _wrong_field(values: dict, fields: dict[str, Field], where: str) -> str | None:
    """'<where>.<field> is <value>, not <what>' for the first field of the wrong JSON type or range, else None."""
    for name, field in fields.items():
        value = values.get(name)
        if value is None:
            continue
        wanted = field.kinds if isinstance(field.kinds, tuple) else (field.kinds,)
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            return f"{where}.{name} is {json.dumps(value)}, not {'a number' if wanted == _NUMBER else _KIND_WORDS[wanted[0]]}"
        if field.in_range is not None and not field.in_range(value):
            return f"{where}.{name} is {json.dumps(value)}, not {field.words}"
    return None


def read_record(path: Path) -> dict:
    """A `runtime bench --json` record; SummaryError (one line naming the fix) for anything else."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not JSON"
        raise SummaryError(f"{path} cannot be read ({reason}); give the --json output of runtime bench") from None
    rows_ok = isinstance(record, dict) and isinstance(record.get("methods"), list) and all(
        isinstance(row, dict) and isinstance(row.get("method"), str) and isinstance(row.get("tokens_per_s"), _NUMBER)
        for row in record["methods"])  # a rate's JSON type and range: ROW_FIELDS
    if not (rows_ok and isinstance(record.get("setup"), dict)):
        raise SummaryError(f"{path} is not a runtime bench record (no setup, or methods without method and tokens_per_s); give the --json output of runtime bench")
    problem = _wrong_field(record["setup"], SETUP_FIELDS, "setup") or next(
        (p for row in record["methods"] if (p := _wrong_field(row, ROW_FIELDS, row["method"])) is not None), None)
    if problem is not None:
        raise SummaryError(f"{path}: {problem}; give the unedited --json output of runtime bench")
    if record["setup"].get("temperature", 0.0) != 0.0:
        raise SummaryError(f"{path} was sampled (temperature {record['setup']['temperature']}); the summary compares "
                           "greedy runs, whose tokens can be checked against ar: give runtime bench records without --temperature")
    return record


def headline_row(record: dict) -> dict:
    """One table row: the record's cell, `ar`, llama.cpp and the fastest distribution-preserving method."""
    setup, methods = record["setup"], record["methods"]
    by_name = {row["method"]: row for row in methods}
    exact = [row for row in methods if row.get("distribution_preserving")]
    best = max(exact, key=lambda row: row["tokens_per_s"]) if exact else None
    ar = by_name.get("ar")
    plain = [by_name[name] for name in PLAIN_LLAMACPP if name in by_name]
    llama = max(plain, key=lambda row: row["tokens_per_s"]) if plain else None
    prompts = PROMPT_NAMES.get(setup.get("prompts"), setup.get("prompts", "?"))

    def ratio(row: dict | None, to: dict | None = llama) -> float | None:
        return row["tokens_per_s"] / to["tokens_per_s"] if row and to and to["tokens_per_s"] > 0 else None

    matched = sum(row.get("identical_to_ar") == 1.0 for row in exact)
    variants = [row for row in methods if row["method"].startswith("llamacpp")]
    others = len(variants) > len(plain)  # a variant beyond plain decoding ran (llamacpp:lookup)
    fastest = max(variants, key=lambda row: row["tokens_per_s"]) if others else None
    return {
        "cell": f"{setup.get('model', '?')}, {prompts} ({setup.get('n', '?')} × {setup.get('max_new_tokens', '?')})",
        "threads": setup.get("threads"),
        "ar": ar["tokens_per_s"] if ar else None,
        "llamacpp": llama["tokens_per_s"] if llama else None,
        "llamacpp_as": _plain_cell(llama, plain) if llama else None,
        "ar_vs_llamacpp": ratio(ar),
        "best": f"`{best['method']}` {best['tokens_per_s']:.1f}" if best else None,
        "best_vs_llamacpp": ratio(best),
        "exact_identical": f"{matched} of {len(exact)}",
        "llamacpp_identical": llama.get("identical_to_ar") if llama else None,
        "rss": setup["peak_rss_mib"] / 1024 if setup.get("peak_rss_mib") else None,
        "llamacpp_fastest": _fastest_cell(fastest) if fastest else None,
        "best_vs_llamacpp_fastest": ratio(best, fastest),
    }


def reference_line(record: dict) -> str | None:
    """The headline in one line, for `runtime bench`'s output: llama.cpp's faster plain row and the ratios
    against it; None when no plain llama.cpp row ran."""
    cells = headline_row(record)
    if cells["llamacpp"] is None:
        return None

    def times(ratio: float | None) -> str:
        return "n/a (no decode step)" if ratio is None else f"{ratio:.2f}x"

    return (f"against llama.cpp, {cells['llamacpp_as']} {cells['llamacpp']:.1f} tok/s: native `ar` {times(cells['ar_vs_llamacpp'])}"
            + (f", best exact {cells['best']} {times(cells['best_vs_llamacpp'])}" if cells["best"] else ""))


def _plain_cell(faster: dict, plain: list[dict]) -> str:
    """'`llamacpp:bin` (`llamacpp` 55.1)': the row the ratios are against, and the other plain row's rate."""
    other = [f"`{row['method']}` {row['tokens_per_s']:.1f}" for row in plain if row is not faster]
    return f"`{faster['method']}`" + (f" ({other[0]})" if other else "")


def _fastest_cell(row: dict) -> str:
    """'`llamacpp:lookup` 41.2 (58%)': llama.cpp's fastest row, and its identity to `ar` where recorded."""
    identity = row.get("identical_to_ar")
    return f"`{row['method']}` {row['tokens_per_s']:.1f}" + (f" ({identity:.0%})" if identity is not None else "")


def summary_markdown(paths: list[Path]) -> str:
    """The headline table of the records at `paths` (sorted by model, prompts, threads; with llama.cpp's
    fastest row where a record ran a variant such as llamacpp:lookup), then each record's provenance:
    code version, CPU, kernel path and llama.cpp build."""
    records = [(Path(p), read_record(Path(p))) for p in paths]
    records.sort(key=lambda item: (str(item[1]["setup"].get("model")), str(item[1]["setup"].get("prompts")),
                                   item[1]["setup"].get("threads") or 0))
    rows = [headline_row(record) for _, record in records]
    variants = VARIANT_COLUMNS if any(row["llamacpp_fastest"] for row in rows) else []
    table = markdown_rows(rows, COLUMNS + variants)
    notes = []
    for path, record in records:
        setup = record["setup"]
        parts = [f"code {setup.get('code') or 'not recorded'}", f"CPU {setup.get('cpu') or 'not recorded'}",
                 f"kernels {setup.get('screen_kernel', '?')}", f"backend {setup.get('backend', '?')}"]
        if setup.get("llamacpp_build"):
            parts.append(f"llama.cpp {_enabled_features(setup['llamacpp_build'])}")
        if setup.get("llamacpp_bin_build"):
            parts.append(_enabled_features(setup["llamacpp_bin_build"]))
        notes.append(f"- {path}: " + "; ".join(parts))
    return table + "\n\n" + "\n".join(notes)


def _enabled_features(build: str) -> str:
    """'0.3.36: CPU : SSE3 = 1 | AVX512 = 0 | ...' -> '0.3.36 (SSE3 ...)': the version and the sets it uses."""
    version, _, features = build.partition(":")
    enabled = [part.split("=")[0].split(":")[-1].strip() for part in features.split("|") if part.strip().endswith("= 1")]
    return f"{version.strip()} ({' '.join(enabled)})" if enabled else build


# A page's generated block: the opening marker names the command that wrote it.
PAGE_BLOCK = re.compile(r"<!-- bench-summary\b[^\n]*-->\n.*?<!-- /bench-summary -->", re.S)


def page_with_summary(page: str, table: str, paths: list) -> str:
    """`page` (Markdown) with its one bench-summary block replaced by `table`, the summary of `paths`;
    SummaryError unless the page holds exactly one block between its two markers."""
    found = len(PAGE_BLOCK.findall(page))
    if found != 1:
        raise SummaryError(f"the page holds {found} blocks between <!-- bench-summary --> and <!-- /bench-summary -->, "
                           "not 1; put the two marker lines, once, where the table goes")
    opening = "<!-- bench-summary: runtime bench-summary " + " ".join(str(p) for p in paths) + " -->"
    return PAGE_BLOCK.sub(lambda _: f"{opening}\n\n{table}\n\n<!-- /bench-summary -->", page)  # blank lines: Markdown
