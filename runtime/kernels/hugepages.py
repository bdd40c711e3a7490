"""Weights in memory backed by 2 MiB pages: the kernels stream every matrix once per step, and on 4 KiB
pages each step walks ~100k page-table entries (qwen2.5-coder: ~500 MB of weights).

`empty(shape, dtype)` gives a tensor in anonymous memory advised for transparent huge pages
(MADV_HUGEPAGE), packed into 2 MiB-aligned chunks so that small matrices share pages, for a layout
written straight into it; `resident(t)` copies a tensor there. The native backend's matrices go there,
and so do the certified head's screens: the int8 screen's copy replaces the stage's tensor, which is
then freed, and the 4-bit screen's panels are packed straight into it. Where the kernel gives no huge
pages (`/sys/kernel/mm/transparent_hugepage/enabled` says never, no MADV_HUGEPAGE, or
SPECVOCAB_HUGEPAGES=0), `empty` is torch.empty and `resident(t)` is `t` itself. The bytes are the same
either way, so no result changes (docs/backends-and-kernels.md has the timing).
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from functools import lru_cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
CHUNK = 64 << 20  # bytes an arena maps at a time (more for a larger tensor)
ALIGN = 64  # each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@lru_cache(maxsize=1)
def enabled() -> bool:
    """Whether an advised anonymous mapping gets huge pages here (THP 'always' or 'madvise'), unless
    SPECVOCAB_HUGEPAGES=0 turns the copies off."""
    if os.environ.get("SPECVOCAB_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in huge-page memory (the process's arena), or torch.empty's
    where there is none (enabled): for a layout written straight into it (quant.to_lanes)."""
    if not enabled():
        return torch.empty(shape, dtype=dtype)
    with _ARENA_LOCK:
        return _ARENA.empty(shape, dtype)


def resident(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into huge-page memory (the process's arena), or `t` itself where there is none (enabled)."""
    if not enabled():
        return t
    return empty(tuple(t.shape), t.dtype).copy_(t)


class HugePageArena:
    """Anonymous memory in 2 MiB-aligned chunks advised for huge pages; the tensors placed in it share them.

    A chunk's memory is returned when the last tensor in it is freed (each view holds its mapping).
    """

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None  # [bytes] uint8 view of the current chunk, 2 MiB-aligned
        self._used = 0  # bytes of the current chunk handed out

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` in the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = _advised_chunk(max(CHUNK, nbytes)), 0
        out = self._chunk[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += -(-nbytes // ALIGN) * ALIGN
        return out


def _advised_chunk(nbytes: int) -> torch.Tensor:
    """A fresh anonymous mapping of at least `nbytes`, 2 MiB-aligned and advised for huge pages: [size] uint8."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` for as long as a view lives
    start = -whole.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    return whole[start:start + size]


_ARENA = HugePageArena()
_ARENA_LOCK = threading.Lock()  # a server may load a model beside a decoding thread
