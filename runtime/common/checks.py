"""Checks of the values a Python caller passes (SamplingParams, runtime.api): one-line ValueErrors.

The CLI parses text with its click types (runtime.cli.values); these check Python objects, where a
bool passes isinstance(x, int) and nan slips past a range check written as `if x < 0: raise` (every
comparison with it is false), so both are refused explicitly. is_digits is the one check of number
text outside click: the method grammar's and prep's options; comma_items the one split of a
comma-separated option value (--methods, --formats, --trees, --drafter-layers).
"""

from __future__ import annotations

import math
import numbers


def is_number(value) -> bool:
    """Whether `value` is a finite real number (a bool is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_integer(value) -> bool:
    """Whether `value` is an integer (a bool is not; 2.0 is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_digits(text: str) -> bool:
    """Whether `text` spells a non-negative integer in ASCII digits (str.isdigit alone also passes
    '٣', which int() reads as 3, and '²', which int() refuses)."""
    return text.isascii() and text.isdigit()


def require(ok: bool, name: str, what: str, value) -> None:
    """A ValueError "NAME must be WHAT, got VALUE" unless `ok`."""
    if not ok:
        raise ValueError(f"{name} must be {what}, got {value!r}")


def require_count(name: str, value, low: int, high: int | None = None, why: str = "") -> int:
    """`value` as an int, or a ValueError unless it is an integer in [low, high] (high None: no limit)."""
    inside = is_integer(value) and value >= low and (high is None or value <= high)
    require(inside, name, f"an integer {f'in {low}..{high}' if high is not None else f'>= {low}'}{why}", value)
    return int(value)


def comma_items(text: str, option: str, example: str) -> list[str]:
    """`option`'s comma-separated value as stripped items, each named once, or a one-line ValueError naming the fix.

    An empty item (ar,,csv or ar,) is refused, not dropped: a stray comma may stand where an item was meant.
    `example` is a good value, shown when the text names nothing."""
    items = [item.strip() for item in text.split(",")]
    kept = list(dict.fromkeys(item for item in items if item))  # each item once, in order
    if not kept:
        raise ValueError(f"{text!r} names nothing; e.g. {option} {example}")
    if "" in items:
        raise ValueError(f"{text!r} has an empty item (a stray comma?); write {option} {','.join(kept)}")
    if len(kept) < len(items):
        twice = next(item for i, item in enumerate(items) if item in items[:i])
        raise ValueError(f"{text!r} lists {twice!r} twice; list each once: {option} {','.join(kept)}")
    return items


def first_surrogate(text: str) -> int | None:
    """The index of text's first lone surrogate, or None: the mark of a byte that was not UTF-8 (Python
    decodes one with errors='surrogateescape', as it does argv), which no tokenizer encodes."""
    return next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
