"""The headline table from `runtime bench` records: per record, native `ar` and the best exact method
against llama.cpp's plain decoding, whether every exact method matched `ar`, and llama.cpp's own
identity to `ar` (the figures the README's Results tables report, read back from the JSONs)."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.bench.report import markdown_rows

PROMPT_NAMES = {"humaneval": "HumanEval", "sharegpt": "ShareGPT held-out"}
COLUMNS = [
    ("cell", "model, prompts (n × tokens)", "{}"),
    ("threads", "threads", "{}"),
    ("ar", "`ar` tok/s", "{:.1f}"),
    ("llamacpp", "llama.cpp tok/s", "{:.1f}"),
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


# The record fields the summary reads, and their JSON types (each may be absent or null).
_NUMBER = (int, float)
SETUP_FIELDS = {"model": str, "prompts": str, "n": int, "max_new_tokens": int, "threads": int, "temperature": _NUMBER,
                "peak_rss_mib": _NUMBER, "code": str, "cpu": str, "screen_kernel": str, "backend": str, "llamacpp_build": str}
ROW_FIELDS = {"identical_to_ar": _NUMBER, "distribution_preserving": bool}


class SummaryError(ValueError):
    """A file that is not a greedy `runtime bench` record."""


def _wrong_field(values: dict, fields: dict, where: str) -> str | None:
    """'<where>.<field> is <value>, not <type>' for the first field of the wrong JSON type, else None."""
    for name, kinds in fields.items():
        value = values.get(name)
        wanted = kinds if isinstance(kinds, tuple) else (kinds,)
        is_bool = isinstance(value, bool)
        if value is not None and (not isinstance(value, wanted) or (is_bool and bool not in wanted)):
            kind = "a number" if wanted == _NUMBER else {str: "text", int: "an integer", bool: "true or false"}[wanted[0]]
            return f"{where}.{name} is {json.dumps(value)}, not {kind}"
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
        and not isinstance(row["tokens_per_s"], bool) for row in record["methods"])
    if not (rows_ok and isinstance(record.get("setup"), dict)):
        raise SummaryError(f"{path} is not a runtime bench record (no setup, or methods without method and tokens_per_s); give the --json output of runtime bench")
    problem = _wrong_field(record["setup"], SETUP_FIELDS, "setup") or next(
        (p for row in record["methods"] if (p := _wrong_field(row, ROW_FIELDS, row["method"])) is not None), None)
    slow = next((row for row in record["methods"] if not row["tokens_per_s"] > 0 or row["tokens_per_s"] == float("inf")), None)
    if problem is None and slow is not None:
        problem = f"{slow['method']}.tokens_per_s is {slow['tokens_per_s']}, not a positive rate"
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
    ar, llama = by_name.get("ar"), by_name.get("llamacpp")
    prompts = PROMPT_NAMES.get(setup.get("prompts"), setup.get("prompts", "?"))

    def ratio(row: dict | None) -> float | None:
        return row["tokens_per_s"] / llama["tokens_per_s"] if row and llama else None

    matched = sum(row.get("identical_to_ar") == 1.0 for row in exact)
    variants = [row for row in methods if row["method"].startswith("llamacpp")]
    fastest = max(variants, key=lambda row: row["tokens_per_s"]) if len(variants) > 1 else None
    return {
        "cell": f"{setup.get('model', '?')}, {prompts} ({setup.get('n', '?')} × {setup.get('max_new_tokens', '?')})",
        "threads": setup.get("threads"),
        "ar": ar["tokens_per_s"] if ar else None,
        "llamacpp": llama["tokens_per_s"] if llama else None,
        "ar_vs_llamacpp": ratio(ar),
        "best": f"`{best['method']}` {best['tokens_per_s']:.1f}" if best else None,
        "best_vs_llamacpp": ratio(best),
        "exact_identical": f"{matched} of {len(exact)}",
        "llamacpp_identical": llama.get("identical_to_ar") if llama else None,
        "rss": setup["peak_rss_mib"] / 1024 if setup.get("peak_rss_mib") else None,
        "llamacpp_fastest": _fastest_cell(fastest) if fastest else None,
        "best_vs_llamacpp_fastest": best["tokens_per_s"] / fastest["tokens_per_s"] if fastest and best else None,
    }


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
        notes.append(f"- {path}: " + "; ".join(parts))
    return table + "\n\n" + "\n".join(notes)


def _enabled_features(build: str) -> str:
    """'0.3.36: CPU : SSE3 = 1 | AVX512 = 0 | ...' -> '0.3.36 (SSE3 ...)': the version and the sets it uses."""
    version, _, features = build.partition(":")
    enabled = [part.split("=")[0].split(":")[-1].strip() for part in features.split("|") if part.strip().endswith("= 1")]
    return f"{version.strip()} ({' '.join(enabled)})" if enabled else build
