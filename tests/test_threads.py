"""The kernels' thread pool (runtime/kernels/csrc/pool.h): no result depends on which thread runs which chunk.

Each kernel runs at 1 thread, then repeatedly at 2 and 3 threads with the workers in every region
(the fallback off): a chunk whose bits depended on the thread that ran it, or a split that moved
with the thread count, would give different bits on some repeat.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from gguf import GGMLQuantizationType as T

from runtime import api
from runtime.bench.contention import busy_loops
from runtime.kernels.build import usable_cores
from runtime.kernels import (attend, decode_threads, dequantize, has_screen_gemv_kernel, kernel_name, linear, quant_linear_parts,
                             rms_norm, screen_gemv, screen_gemv_int16, set_kernel_threads, take_rows, thread_stats, threads_restored,
                             torch_threads)

from factories import random_matrix, tall_rows

THREAD_COUNTS = (2, 3)  # 3 on a 2-core machine too: more threads than cores is where a thread is descheduled
REPEATS = 6

pytestmark = pytest.mark.skipif(kernel_name() == "torch", reason="SPECVOCAB_KERNELS=torch: no compiled kernels, no pool")


@contextmanager
def workers_in_every_region(threads: int):
    """The pool at `threads` threads, its fallback off; restored afterwards."""
    with threads_restored():
        set_kernel_threads(threads, adaptive=False)
        yield


def assert_thread_independent(compute) -> None:
    """compute() gives the 1-thread bits on every repeat at every count of THREAD_COUNTS, on the workers."""
    with workers_in_every_region(1):
        expected = compute()
    for threads in THREAD_COUNTS:
        with workers_in_every_region(threads):
            ran_before = thread_stats()["regions_parallel"]
            for repeat in range(REPEATS):
                got = compute()
                for a, b in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
                    assert torch.equal(a, b), (threads, repeat)
            assert thread_stats()["regions_parallel"] > ran_before  # the workers were asked to take part


@pytest.mark.parametrize("n", [1, 5, tall_rows()], ids=["decode", "verify", "tall"])
def test_quant_linear_parts(n: int) -> None:
    """Several formats in one region (chunks of every part), skinny and tall."""
    parts = [random_matrix(T.Q4_K, 700, 512, seed=1), random_matrix(T.Q8_0, 300, 512, seed=2), random_matrix(T.F32, 90, 512, seed=3)]
    x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n))
    assert_thread_independent(lambda: quant_linear_parts(x, parts))


def test_fp32_linear_and_take_rows() -> None:
    weight = torch.randn(3000, 640, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 640, generator=torch.Generator().manual_seed(5))
    w = random_matrix(T.Q6_K, 900, 512, seed=6)
    ids = torch.randint(0, 900, (400,), generator=torch.Generator().manual_seed(7))
    assert_thread_independent(lambda: (linear(x, weight), take_rows(w, ids)))


def test_a_region_of_more_chunks_than_a_run_word_holds() -> None:
    """take_rows over 64 x 65,537 ids: more chunks than pool.h's kMaxChunks, run in groups, each row once."""
    w = random_matrix(T.F32, 50, 1, seed=10)
    ids = torch.randint(0, 50, (64 * 65_537,), generator=torch.Generator().manual_seed(11))
    assert torch.equal(take_rows(w, ids), dequantize(w)[ids])
    assert_thread_independent(lambda: take_rows(w, ids))


def test_rms_norm_and_attention() -> None:
    g = torch.Generator().manual_seed(8)
    x, factor = torch.randn(300, 640, generator=g), torch.randn(640, generator=g)
    count, heads, kv, hd, capacity = 12, 8, 2, 64, 200
    qkv = torch.randn(count, heads + 2 * kv, hd, generator=g)
    keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
    first, end = torch.zeros(count, dtype=torch.long), torch.arange(150, 150 + count)
    no_path = torch.empty(count, 0, dtype=torch.long)
    assert_thread_independent(lambda: (rms_norm(x, factor, 1e-6), attend(qkv, heads, keys, values, first, end, no_path, 0.125)))


@pytest.mark.parametrize("groups", [1, 10])
def test_int8_screens(groups: int) -> None:
    """The certified head's compiled screens over a vocabulary-sized matrix (1000 chunks of rows): the
    float one on the AVX-512 paths, the int16 one (per-row scales) on AVX-512 and AVX2."""
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (5003, 640), generator=g, dtype=torch.int8)  # odd row count: a tail chunk
    scales = torch.rand(5003, groups, generator=g) / 64
    hidden = torch.randn(3, 640, generator=g) * 40
    screens = [screen for screen, compiled in [(screen_gemv, has_screen_gemv_kernel()),
                                               (screen_gemv_int16, screen_gemv_int16(q, scales, hidden) is not None)] if compiled]
    if not screens:
        pytest.skip(f"the {kernel_name()} path screens {groups} groups a row with torch's ops, not the pool")
    for screen in screens:
        assert_thread_independent(lambda: screen(q, scales, hidden))


def test_the_default_thread_count_stands_down_and_a_chosen_one_does_not() -> None:
    with threads_restored():
        api.set_threads()
        assert thread_stats()["adaptive"] == 1
        api.set_threads(1)
        assert thread_stats()["adaptive"] == 0


def test_torch_ops_run_on_one_thread_beside_the_pool() -> None:
    """The kernels' pool gets the count; torch's ops between kernels one thread (its OpenMP workers
    spin after each op on the core the pool's worker needs: docs/contention.md)."""
    with threads_restored():
        assert api.set_threads(1) == 1 == decode_threads() == thread_stats()["threads"]
        assert torch.get_num_threads() == 1
        assert api.set_threads() == usable_cores() == decode_threads() == thread_stats()["threads"]
        assert torch.get_num_threads() == 1
        with torch_threads(usable_cores()):  # a forward of torch's own ops (prefill attention, the transformers backend)
            assert torch.get_num_threads() == usable_cores()
        assert torch.get_num_threads() == 1


def test_busy_loops_run_beside_the_block_and_always_stop() -> None:
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    with pytest.raises(KeyboardInterrupt):
        with busy_loops(2) as pids:
            assert len(pids) == 2 and all(alive(p) for p in pids)
            raise KeyboardInterrupt
    assert not any(alive(p) for p in pids)
