"""runtime.common.checks.comma_items: the one split of a comma-separated option value, and its one-line refusals."""

from __future__ import annotations

import pytest

from runtime.common.checks import comma_items


@pytest.mark.parametrize("text, items", [
    ("ar", ["ar"]),
    ("ar,csv:screen", ["ar", "csv:screen"]),
    (" ar , csv:screen ", ["ar", "csv:screen"]),
    ("csv,ar", ["csv", "ar"]),
], ids=["one", "two", "spaces", "order-kept"])
def test_items_are_stripped_in_order(text: str, items: list[str]):
    assert comma_items(text, "--methods", "ar,csv") == items


@pytest.mark.parametrize("text, message", [
    ("", "'' names nothing; e.g. --methods ar,csv"),
    ("  ", "'  ' names nothing; e.g. --methods ar,csv"),
    (",", "',' names nothing; e.g. --methods ar,csv"),
    ("ar,,csv", "'ar,,csv' has an empty item (a stray comma?); write --methods ar,csv"),
    ("ar,", "'ar,' has an empty item (a stray comma?); write --methods ar"),
    (",ar", "',ar' has an empty item (a stray comma?); write --methods ar"),
    ("ar, ,csv", "'ar, ,csv' has an empty item (a stray comma?); write --methods ar,csv"),
    ("ar,ar,", "'ar,ar,' has an empty item (a stray comma?); write --methods ar"),
    ("ar,csv,ar", "'ar,csv,ar' lists 'ar' twice; list each once: --methods ar,csv"),
    ("ar, ar ", "'ar, ar ' lists 'ar' twice; list each once: --methods ar"),
], ids=["empty", "blank", "comma-alone", "empty-item", "trailing-comma", "leading-comma", "blank-item",
        "repeat-and-trailing-comma", "repeat", "repeat-with-spaces"])
def test_refusals_are_one_line_naming_the_option_and_the_fix(text: str, message: str):
    with pytest.raises(ValueError) as error:
        comma_items(text, "--methods", "ar,csv")
    assert str(error.value) == message
