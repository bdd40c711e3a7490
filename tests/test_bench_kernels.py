"""`runtime bench-kernels`' comparison on the real gemma3-270m, whose native head is the GGUF's Q8_0 blocks."""

from __future__ import annotations

import pytest

from artifacts import Stage
from runtime.bench.kernels import compare_kernels
from runtime.kernels import QuantMatrix, has_screen4_kernel, screen_gemv_int16

pytestmark = pytest.mark.real_model


def test_kernels_are_timed_against_the_native_exact_head(gemma_session, gemma_hidden):
    weight, artifact = gemma_session.target.head_weight, gemma_session.artifact
    assert isinstance(weight, QuantMatrix)  # the case that used to end in a TypeError from F.linear
    screen = artifact.read_stage(Stage.SCREEN)
    hidden = gemma_hidden[:1]  # [1, 640]
    rows = compare_kernels(weight, screen, hidden, repeats=1, screen4=artifact.read_stage(Stage.SCREEN4))
    by_name = {row["kernel"].split(" (")[0].split(",")[0]: row for row in rows}

    exact = rows[0]
    assert exact["kernel"].startswith("exact head") and "GGUF blocks" in exact["kernel"]
    assert exact["max_error"] == 0.0 and exact["vs_full_head"] == 1.0
    assert exact["gb_per_s"] == pytest.approx(weight.nbytes / exact["ms"] / 1e6)
    screens = [row for row in rows if "screen" in row["kernel"]]
    expected = 1 + (screen_gemv_int16(screen["qweight"], screen["scales"], hidden) is not None) + has_screen4_kernel()
    assert len(screens) == expected
    for row in screens:  # approximate, but close: a screen's centre is within a logit or two of the exact value
        assert 0.0 < row["max_error"] < 5.0 and row["gb_per_s"] > 0 and row["ms"] > 0
    assert "torch dynamic int8 linear" in by_name and by_name["torch dynamic int8 linear"]["gb_per_s"] is None
