"""Bench output: a JSON record, a Markdown table and a PNG plot, all from the same rows."""

from __future__ import annotations

import io
import json
from pathlib import Path

from artifacts.atomic import atomic_write_bytes
from runtime.methods import marked

COLUMNS = [
    ("method", "method", "{}"),
    ("tokens_per_s", "tok/s", "{:.2f}"),
    ("speedup_vs_ar", "speedup vs ar", "{:.2f}x"),
    ("identical_to_greedy", "identical to greedy", "{:.0%}"),
    ("unclaimed_identity", "same tokens as ar (no claim)", "{:.0%}"),
    ("certification_rate", "certified", "{:.1%}"),
    ("fallback_rate", "fallback", "{:.1%}"),
    ("near_tie_rate", "of which near-ties", "{:.1%}"),
    ("recomputed_fraction", "recomputed", "{:.4%}"),
    ("required_open_fraction", "needed to certify", "{:.1%}"),
    ("mean_accepted_length", "mean accepted length", "{:.2f}"),
    ("acceptance_rate", "acceptance", "{:.1%}"),
    ("acceptance_by_position", "acceptance by position", "{}"),
    ("draft_ms_per_token", "T_D ms", "{:.2f}"),
    ("draft_share_of_ar_step", "T_D / ar step", "{:.1%}"),
    ("verify_ms_per_round", "T_V ms", "{:.2f}"),
    ("predicted_tokens_per_s", "predicted tok/s", "{:.2f}"),
    ("shortlist_fraction", "shortlist", "{:.1%}"),
    ("perplexity", "perplexity", "{:.3f}"),
    ("joules_per_token", "J/token", "{:.4f}"),
]
ALWAYS_SHOWN = {"perplexity", "joules_per_token"}  # every bench table has them, measured or not
# A null value whose row carries this reason field prints as n/a (not measurable here), not as a dash.
REASONS = {"joules_per_token": "energy_unavailable"}


def markdown_table(rows: list[dict]) -> str:
    """Markdown table of the bench rows; columns empty for every method are left out (but ALWAYS_SHOWN).

    A method that makes no identity claim (llama.cpp, MJSD) shows how often its tokens equalled `ar`'s
    in a column of its own, never as "identical to greedy"."""
    rows = [{**row, "method": method_label(row), "unclaimed_identity": _unclaimed_identity(row),
             "acceptance_by_position": _by_position(row.get("acceptance_by_position"))} for row in rows]
    shown = [c for c in COLUMNS if c[0] in ALWAYS_SHOWN or any(row.get(c[0]) is not None for row in rows)]
    return markdown_rows(rows, shown)


def _by_position(shares: list[float] | None) -> str | None:
    """Acceptance at draft positions 1, 2, .. as '62/41/30 %' (None for methods that do not draft)."""
    return "/".join(f"{100 * share:.0f}" for share in shares) + " %" if shares else None


def _unclaimed_identity(row: dict) -> float | None:
    """The share of prompts on which a method without an identity claim gave `ar`'s tokens, else None."""
    return None if row.get("distribution_preserving", True) else row.get("identical_to_ar")


def method_label(row: dict) -> str:
    """A bench row's method name, marked when the method does not preserve the target's distribution."""
    return marked(row["method"], row.get("distribution_preserving", True))


def markdown_rows(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table with (key, title, format) columns; missing values print as a dash (n/a: see REASONS)."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "n/a" if row.get(REASONS.get(key, "")) else "–"
                 for key, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(record: dict, path: Path) -> None:
    """Write a JSON record atomically (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json_bytes(record))


def json_bytes(record: dict) -> bytes:
    """A record as the indented JSON text the bench writes."""
    return (json.dumps(record, indent=2) + "\n").encode()


REPORT_SUFFIXES = (".md", ".png")  # the table and the plot beside a bench record


def report_paths(json_path: Path) -> tuple[Path, Path, Path]:
    """The files write_reports writes for json_path: it, and the .md table and .png plot beside it."""
    return json_path, *(json_path.with_suffix(suffix) for suffix in REPORT_SUFFIXES)


def write_reports(record: dict, json_path: Path) -> tuple[Path, Path, Path]:
    """Write JSON at json_path, and .md / .png beside it (same stem).

    All three are rendered before the first is written, so a Ctrl-C while matplotlib draws (about a
    second) writes none of them.
    """
    paths = report_paths(json_path)
    contents = [json_bytes(record), (_markdown_document(record) + "\n").encode(), plot_png(record)]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for path, data in zip(paths, contents):
        atomic_write_bytes(path, data)
    return paths


def _markdown_document(record: dict) -> str:
    setup = record["setup"]
    header = ", ".join(f"{k}={v}" for k, v in setup.items())
    return f"`{record['command']}`\n\n{header}\n\n{markdown_table(record['methods'])}"


def plot_png(record: dict) -> bytes:
    """Bar chart of tokens/s per method, annotated with the speedup over ar, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["methods"]
    fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(rows)), 3.6))
    labels = [method_label(r).replace(" [", "\n[") for r in rows]  # the mark on a line of its own
    bars = ax.bar(labels, [r["tokens_per_s"] for r in rows], color="#4a7ebb")
    for bar, row in zip(bars, rows):
        if row.get("speedup_vs_ar") is not None:
            ax.annotate(f"{row['speedup_vs_ar']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom")
    ax.margins(y=0.15)  # room for the speedup labels under the title
    ax.set_ylabel("tokens / s (decode)")
    ax.set_title(f"{record['setup'].get('model', '')}: {record['setup'].get('prompts', '')}", fontsize=10)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()
