"""Preparation jobs on one single-threaded process per core (prep.core_pool): the same output as one process."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
import random

import pytest
import torch
from click.testing import CliRunner
from multiprocessing.reduction import ForkingPickler

from prep import core_pool
from prep.cli import main as prep_main
from prep.trace_files import load_traces
from factories import prep_ok, save_tiny_model_dir

FIELDS = ["input_ids", "top_ids", "top_probs", "hidden", "features", "doc", "split"]


def test_worker_count_takes_a_request_else_the_cores_memory_allows_for_a_job_worth_it(monkeypatch):
    monkeypatch.setattr(core_pool, "usable_cores", lambda: 4)
    monkeypatch.setattr(core_pool, "available_memory", lambda: 10 * 2**30)
    monkeypatch.setattr(core_pool, "resident_memory", lambda: 2**30)
    assert core_pool.worker_count(3, 10, 100) == 3  # asked for: even a small job
    assert core_pool.worker_count(None, 99, 100) == 1  # too small to repay the workers' start
    assert core_pool.worker_count(None, 100, 100) == 4
    monkeypatch.setattr(core_pool, "resident_memory", lambda: 4 * 2**30)
    assert core_pool.worker_count(None, 100, 100) == 2
    monkeypatch.setattr(core_pool, "resident_memory", lambda: 64 * 2**30)
    assert core_pool.worker_count(None, 100, 100) == 1  # one always runs


def test_traces_on_two_processes_are_the_ones_one_process_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model_dir(tmp_path / "model", layers=6)
    rng = random.Random(1)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"text": " ".join(f"w{rng.randrange(2, 40)}" for _ in range(rng.randrange(12, 40)))}
                                  for _ in range(30)]))
    folders = {}
    for workers in (1, 2):
        folders[workers] = tmp_path / f"traces-{workers}"
        prep_ok(["traces", model, "--corpus", corpus, "-o", folders[workers], "--shard-tokens", 300,
                 "--drafter-layers", 0, "--features", "--workers", workers])
    (index1, alone), (index2, shared) = (load_traces(folders[w], FIELDS) for w in (1, 2))
    assert len(index1["shards"]) == len(index2["shards"]) > 1
    for key in ("input_ids", "top_ids", "doc", "split"):
        assert torch.equal(alone[key], shared[key]), key
    for key in ("top_probs", "hidden", "features"):  # one thread against torch's own count: equal to rounding
        torch.testing.assert_close(alone[key].float(), shared[key].float(), atol=1e-2, rtol=1e-2)


def test_an_interrupted_pooled_trace_stops_its_workers_and_resumes_to_the_same_shards(tmp_path, monkeypatch):
    from prep import traces

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model_dir(tmp_path / "model")
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"text": " ".join(f"w{(i * 7 + j) % 40}" for j in range(30))} for i in range(20)]))
    args = ["traces", model, "--corpus", corpus, "--shard-tokens", 150, "--drafter-layers", 0, "--workers", 2]
    whole = tmp_path / "whole"
    prep_ok([*args, "-o", whole])
    real, calls = traces.run_shard, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(traces, "run_shard", interrupted)
    resumed = tmp_path / "resumed"
    result = CliRunner().invoke(prep_main, [str(a) for a in [*args, "-o", resumed]])
    assert result.exit_code == 130 and "complete shards are kept" in result.output, result.output
    assert not multiprocessing.active_children()  # the workers stopped with the run
    monkeypatch.setattr(traces, "run_shard", real)
    prep_ok([*args, "-o", resumed])
    shards = sorted(p.name for p in whole.glob("shard-*"))
    assert len(shards) > 2 and shards == sorted(p.name for p in resumed.glob("shard-*"))
    assert all((whole / n).read_bytes() == (resumed / n).read_bytes() for n in shards)


@pytest.mark.parametrize("workers", [1, 2])
def test_map_on_cores_returns_results_in_order_from_single_threaded_workers(workers):
    results = list(core_pool.map_on_cores(workers, _work, range(9), "state", _setup, ("state",)))
    assert [(state, item) for state, item, _, _ in results] == [("state", i) for i in range(9)]
    if workers > 1:
        assert all(pid != os.getpid() and threads == 1 for _, _, pid, threads in results)


def _setup(value):
    return value


def _work(state, item):
    return state, item, os.getpid(), torch.get_num_threads()


def test_the_workers_end_on_their_own_so_their_exit_handlers_run(tmp_path):
    """The pool lets its workers exit rather than killing them: a worker's exit handlers run (among them
    the one that unregisters a lock tqdm made, which otherwise reads as a leaked semaphore, a warning
    at the parent's exit)."""
    served = set(core_pool.map_on_cores(2, _pid, range(6), None, _exit_marker, (str(tmp_path),)))
    marked = {int(p.name) for p in tmp_path.iterdir()}
    assert len(marked) == 2 and served <= marked


def test_a_trace_runs_its_pool_past_the_last_text_so_the_workers_exit_on_their_own(tmp_path, monkeypatch):
    """build_traces reads its texts' results one at a time; after the last it runs the pool to its end
    (pool.close and join) rather than closing it there, which kills the workers (a traced text over a
    prefill chunk makes a tqdm lock: a leaked-semaphore warning as `prep traces` exits)."""
    from prep import traces

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model_dir(tmp_path / "model", layers=2)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"text": f"w{i} " * 30} for i in range(4)]))
    ended = []

    def recorded(*args):
        yield from core_pool.map_on_cores(*args)
        ended.append(True)

    monkeypatch.setattr(traces, "map_on_cores", recorded)
    prep_ok(["traces", model, "--corpus", corpus, "-o", tmp_path / "traces", "--drafter-layers", 0, "--workers", 1])
    assert ended == [True]


def _exit_marker(folder: str):
    """Setup: write FOLDER/PID as this worker exits (multiprocessing's exit handlers, which a kill skips)."""
    pid = os.getpid()
    multiprocessing.util.Finalize(None, lambda: open(os.path.join(folder, str(pid)), "w").close(), exitpriority=10)


def _pid(state, item):
    return os.getpid()


def test_a_tensor_from_a_worker_is_sent_by_value_so_it_outlives_the_worker():
    """torch sends a tensor between processes as a handle its sender serves; a pool worker exits once
    its tasks are done, maybe before the parent has read its last result (the pool's result reader
    then dies, and terminating the pool raises). Ours send the bytes."""
    sent = list(core_pool.map_on_cores(2, _pickled_tensors, range(2), None, _setup, (None,)))
    assert not multiprocessing.active_children()  # every sender has exited
    for item, message in enumerate(sent):
        received = ForkingPickler.loads(message)
        assert received.keys() == _tensors(item).keys()
        for key, tensor in _tensors(item).items():
            assert received[key].dtype == tensor.dtype and torch.equal(received[key], tensor), key


def _tensors(item):
    return {"float": torch.arange(6.0).reshape(2, 3) + item, "bf16": torch.linspace(-1, 1, 5, dtype=torch.bfloat16),
            "scalar": torch.tensor(item), "empty": torch.zeros(0, 4, dtype=torch.int16),
            "strided": torch.arange(12).reshape(3, 4).t(), "bool": torch.tensor([True, False])}


def _pickled_tensors(state, item):
    return bytes(ForkingPickler.dumps(_tensors(item)))
