"""C-level output redirected for a block: what C and C++ libraries (faiss, llama.cpp) write straight
to file descriptors 1 and 2, which Python's sys.stdout / sys.stderr never see."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def fd_redirected(fd: int, to: int) -> Iterator[None]:
    """Point file descriptor `fd` at what `to` refers to for the block, then restore it."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        os.dup2(to, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
