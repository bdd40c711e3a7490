"""runtime.kernels.hugepages: what huge-page memory holds, and when it is used.

Weights copied there keep their values, the certified head's screens are placed there too, and the copy
is skipped where huge pages are off.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_tiny_head
from prep.screen import quantize_int8
from prep.screen4 import hidden_basis, quantize_int4
from runtime.heads import ScreenBound
from runtime.heads.screen4_bound import Screen4Bound
from runtime.kernels import hugepages


@pytest.fixture
def huge_pages_setting(monkeypatch):
    """Set SPECVOCAB_HUGEPAGES for one test, re-reading the setting before and after."""

    def set_to(value: str) -> None:
        monkeypatch.setenv("SPECVOCAB_HUGEPAGES", value)
        hugepages.enabled.cache_clear()

    yield set_to
    monkeypatch.undo()
    hugepages.enabled.cache_clear()


def test_off_gives_the_tensor_itself(huge_pages_setting) -> None:
    huge_pages_setting("0")
    t = torch.arange(10, dtype=torch.int8)
    assert hugepages.resident(t) is t


def test_an_arena_packs_copies_on_cache_lines_in_aligned_chunks() -> None:
    arena = hugepages.HugePageArena()
    a = torch.randint(-128, 128, (3, 100), dtype=torch.int8)  # 300 bytes: the next copy starts at 320
    b = torch.randn(5, 7)
    big = torch.randint(0, 256, (hugepages.CHUNK + 1,), dtype=torch.uint8)  # more than a chunk: a chunk of its own
    copies = [arena.empty(tuple(t.shape), t.dtype).copy_(t) for t in (a, b, big)]
    for t, c in zip((a, b, big), copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t) and c.data_ptr() != t.data_ptr()
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # a chunk starts on a huge page
    assert copies[1].data_ptr() - copies[0].data_ptr() == 320
    assert copies[2].data_ptr() % hugepages.HUGE_PAGE == 0


@pytest.mark.skipif(not hugepages.enabled(), reason="this kernel gives no transparent huge pages")
def test_resident_copies_where_huge_pages_are_on() -> None:
    t = torch.randn(1000, 64)
    copy = hugepages.resident(t)
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr() and copy.data_ptr() % hugepages.ALIGN == 0


@pytest.mark.skipif(not hugepages.enabled(), reason="this kernel gives no transparent huge pages")
def test_the_screens_bytes_are_placed_in_huge_pages(arena_placements) -> None:
    """What a certified head streams every step, the int8 screen and the 4-bit screen's panels, lies in
    the arena, as the native backend's matrices do, holding the stage's values."""
    head = make_tiny_head(vocab=200, dim=64, seed=3)
    screen = quantize_int8(head.weight, 0)
    bound = ScreenBound.from_stage(head.weight, head.bias, screen)
    basis = hidden_basis(torch.randn(300, 64, generator=torch.Generator().manual_seed(4)).double(), 16)
    panels = Screen4Bound(head.weight, head.bias, quantize_int4(head.weight, basis, 32)).panels.packed
    assert sorted(t.data_ptr() for t in arena_placements) == sorted([bound.qweight.data_ptr(), panels.data_ptr()])
    assert torch.equal(bound.qweight, screen["qweight"])
