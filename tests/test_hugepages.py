"""runtime.kernels.hugepages: weights copied into huge-page memory keep their values, and the copy is skipped where huge pages are off."""

from __future__ import annotations

import pytest
import torch

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
