"""One single-threaded worker process per core, for preparation jobs made of independent items.

A response to a training prompt or a text's features needs nothing from its neighbours, and on the
2-core machines we measure one process per core outruns one process on two threads (docs/draft-head.md,
"The recipe's data on both cores"). Each worker runs torch and the kernels on one thread (the
scheduler gives each its own core), loads its state once (`setup(*args)`, e.g. a model) and then maps
items with `work(state, item)`; results come back in the items' order, so a caller that writes them in
order (and resumes from what it wrote) works as it does on one process. Workers start with `spawn`:
nothing of the parent's threads or loaded models is copied into them. A worker sends its tensors'
bytes, not torch's shared-memory handles: a handle is served by its sender, and a worker exits once
its tasks are done, maybe before the parent has read its last result.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.reduction import ForkingPickler

from runtime.kernels.build import usable_cores

_state = None  # a worker's own, from setup


def worker_count(requested: int | None, work: int, minimum: int) -> int:
    """How many workers a job of `work` units (tokens) runs on: `requested`; else 1 where work < minimum
    (too little to repay the workers' start: torch's import and a model load each), else one per core
    this process may use, no more than the available memory holds at what this process holds (a
    worker loads the same model)."""
    if requested is not None:
        return requested
    if work < minimum:
        return 1
    return max(1, min(usable_cores(), available_memory() // max(1, resident_memory())))


def resident_memory() -> int:
    """This process's resident memory in bytes: what a worker loading the same model will hold, about."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _start(setup: Callable, args: tuple) -> None:
    """Keep this worker's torch on one thread and build its state.

    Ctrl-C reaches the whole process group: the parent stops the workers, which ignore it themselves
    (no traceback from each of them)."""
    global _state
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    torch.set_num_threads(1)
    ForkingPickler.register(torch.Tensor, _tensor_by_value)  # in place of torch's own, in this worker
    _state = setup(*args)


def _tensor_by_value(tensor) -> tuple[Callable, tuple]:
    """A reduction of `tensor` that carries its bytes (its dtype, shape and values; not its strides)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)  # [numel]
    data = flat.view(torch.uint8).numpy().tobytes()  # [numel * element size]
    return _tensor_from_bytes, (str(flat.dtype).removeprefix("torch."), tuple(tensor.shape), data)


def _tensor_from_bytes(dtype: str, shape: tuple[int, ...], data: bytes):
    """The tensor _tensor_by_value reduced."""
    import torch

    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def _run(work_and_item: tuple[Callable, object]):
    """One item's work, on this worker's state."""
    work, item = work_and_item
    return work(_state, item)


def map_on_cores(workers: int, work: Callable, items: Iterable, state, setup: Callable, args: tuple) -> Iterator:
    """work(state, item) for each item, in order: in this process on `state` for 1 worker, else on
    `workers` single-threaded processes, each on its own setup(*args) (what `state` is, loaded again).

    setup and work must be module-level functions (they are sent to spawned processes by name).
    Breaking off the iteration, or an interrupt, stops the workers.
    """
    if workers == 1:
        for item in items:
            yield work(state, item)
        return
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_start, initargs=(setup, args))
    try:
        yield from pool.imap(_run, ((work, item) for item in items))
        pool.close()
        pool.join()  # the workers exit on their own, so their exit handlers run (terminate kills them before:
        # a semaphore one made, tqdm's lock, then reads as leaked at the parent's exit)
    finally:
        pool.terminate()
        pool.join()
