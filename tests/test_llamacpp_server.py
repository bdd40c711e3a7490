"""Method llamacpp:bin: llama.cpp's own llama-server as the bench reference, on a fake server (no llama.cpp needed).

tests/fake_llama_server.py answers as llama-server does; the real binary is used only where
SPECVOCAB_LLAMACPP_BIN names one (the real-model test, skipped elsewhere).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from runtime.common.sampling import SamplingParams
from runtime.llamacpp.bindings import LlamaCppUnavailable, features_line
from runtime.llamacpp.server import BIN_ENV, Eagle3Draft, LlamaServerDecoder, find_server
from runtime.methods import canonical, parse_method

FAKE = Path(__file__).with_name("fake_llama_server.py")
EOS = frozenset({1})


@pytest.fixture
def fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable llama-server (the fake) in its own folder, named by SPECVOCAB_LLAMACPP_BIN."""
    folder = tmp_path / "bin"
    folder.mkdir()
    binary = folder / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(0o755)
    monkeypatch.setenv(BIN_ENV, str(folder))
    monkeypatch.setenv("FAKE_LLAMA_REQUESTS", str(tmp_path / "requests.jsonl"))
    return binary


def requests(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


def test_llamacpp_bin_parses_and_makes_no_identity_claim():
    spec = parse_method("llamacpp:bin")
    assert canonical(spec) == "llamacpp:bin" and spec.options.binary and not spec.distribution_preserving
    with pytest.raises(ValueError, match="takes nothing, lookup.* or bin"):
        parse_method("llamacpp:binary")


def test_llamacpp_bin_eagle3_names_the_head_and_llama_cpps_own_draft_options():
    spec = parse_method("llamacpp:bin:eagle3=heads/q.gguf:pmin=0.5:n=4")
    assert canonical(spec) == "llamacpp:bin:eagle3=heads/q.gguf:n=4:pmin=0.5" and not spec.distribution_preserving
    assert spec.options.eagle3 == Eagle3Draft(Path("heads/q.gguf"), max_drafts=4, min_probability=0.5)
    assert canonical(parse_method("llamacpp:bin:eagle3=h.gguf")) == "llamacpp:bin:eagle3=h.gguf"  # llama.cpp's defaults
    for bad, message in (("llamacpp:bin:2", "takes eagle3=HEAD.gguf, n=N and pmin=P, each at most once, not '2'"),
                         ("llamacpp:bin:draft=h.gguf", "takes eagle3=HEAD.gguf, n=N and pmin=P"),
                         ("llamacpp:bin:eagle3=a.gguf:eagle3=b.gguf", "eagle3 is given twice; give each option once"),
                         ("llamacpp:bin:n=4", "name its head with eagle3=HEAD.gguf"),
                         ("llamacpp:bin:eagle3=", "eagle3 takes a path to the head's GGUF, not ''"),
                         ("llamacpp:bin:eagle3=h.gguf:n=0", "n takes an integer in 1..32, not '0'"),
                         ("llamacpp:bin:eagle3=h.gguf:pmin=2", r"pmin takes a number in \[0, 1\], not '2'")):
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


def test_a_missing_binary_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(BIN_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on it
    with pytest.raises(LlamaCppUnavailable, match=f"set {BIN_ENV}=/path/to/llama-server or put it on PATH"):
        find_server()
    monkeypatch.setenv(BIN_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(LlamaCppUnavailable, match=f"{BIN_ENV}=.*nowhere is not an executable llama-server"):
        find_server()


def test_greedy_decoding_sends_the_prompt_ids_and_reports_the_servers_timing(fake_server: Path, tmp_path: Path):
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    assert decoder.build == "llama-server b4242-fake123: instruction sets not known (no libllama.so beside it)"
    tokens, stats = _drive(decoder(torch.tensor([5, 6, 7]), 6, SamplingParams(), torch.Generator().manual_seed(3)))
    assert tokens == [8, 9, 10, 11, 12, 13]
    assert stats.new_tokens == 6 and stats.seconds_prefill == pytest.approx(0.010)
    assert stats.tokens_per_s == pytest.approx(500.0)  # 5 tokens after the first in 10 ms: the server's own rate
    (body,) = requests(tmp_path)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 6 and body["seed"] == 3
    assert body["top_k"] == 1 and body["temperature"] == 0.0 and body["cache_prompt"] is False and body["return_tokens"]


def test_a_libllama_that_does_not_load_leaves_the_instruction_sets_unknown(fake_server: Path, tmp_path: Path):
    (fake_server.parent / "libllama.so").write_bytes(b"not a library")
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    assert decoder.build.startswith("llama-server b4242-fake123: instruction sets not known (") and "did not load" in decoder.build


def test_the_features_line_drops_the_empty_last_part():
    assert features_line("CPU : SSE3 = 1 | AVX2 = 1 | \n") == "CPU : SSE3 = 1 | AVX2 = 1"


def test_the_eos_guard_redoes_only_a_run_that_put_eos_early(fake_server: Path, tmp_path: Path):
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    tokens, _ = _drive(decoder(torch.tensor([5, 6]), 6, SamplingParams(), None, min_new_tokens=2))
    assert tokens == [7, 8, 9, 10, 11, 12] and len(requests(tmp_path)) == 1  # no EOS in the first two: as it was
    # the fake counts on from the last prompt id: 0, then EOS (1) second, inside the guard
    tokens, stats = _drive(decoder(torch.tensor([5, 99]), 6, SamplingParams(), None, min_new_tokens=2))
    plain, first, second = requests(tmp_path)[1:]
    assert "logit_bias" not in plain and first["n_predict"] == 2 and first["logit_bias"] == [[1, False]]
    assert second["prompt"] == [5, 99, 0, 1] and second["n_predict"] == 4 and second["cache_prompt"] is True
    assert "logit_bias" not in second
    assert tokens == [0, 1, 2, 3, 4, 5] and stats.new_tokens == 6
    # first token from the first prefill; then 1 + 3 steps of the two requests and the second's prompt
    assert stats.seconds_prefill == pytest.approx(0.010) and stats.seconds_decode == pytest.approx(0.002 + 0.010 + 0.006)


def test_eagle3_runs_llamacpps_speculation_with_the_head_and_counts_what_it_kept(fake_server: Path, tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch):
    head = tmp_path / "head.gguf"
    head.write_bytes(b"GGUF")
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv.json"))
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=2, eagle3=Eagle3Draft(head, max_drafts=4))
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[argv.index("-md"):] == ["-md", str(head), "--spec-type", "draft-eagle3", "-td", "2", "-tbd", "2",
                                        "--spec-draft-n-max", "4"]
    tokens, stats = _drive(decoder(torch.tensor([5, 6, 7]), 9, SamplingParams(), None))
    assert tokens == list(range(8, 17))
    # the fake: of the 8 tokens after the first, 4 were accepted drafts, so 4 target forwards, each drafting 4
    spec = stats.spec
    assert (spec.rounds, spec.drafts, spec.drafted, spec.accepted) == (4, 4, 16, 4) and stats.forwards == 5
    assert spec.mean_accepted_length == 2.0 and spec.acceptance_rate == 0.25
    assert spec.seconds_verify == 0 and spec.predicted_tokens_per_s == 0.0  # llama.cpp reports no phase times


def test_plain_decoding_by_the_binary_reports_no_speculation(fake_server: Path, tmp_path: Path):
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    _, stats = _drive(decoder(torch.tensor([5]), 4, SamplingParams(), None))
    assert stats.spec is None and stats.forwards == 4


def test_a_missing_head_is_one_line_naming_the_converter(fake_server: Path, tmp_path: Path):
    with pytest.raises(LlamaCppUnavailable, match=r"eagle3=.*none\.gguf: no such file; convert the head with llama.cpp's "
                                                  "convert_hf_to_gguf.py"):
        LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1, eagle3=Eagle3Draft(tmp_path / "none.gguf"))


def test_a_server_that_cannot_load_the_model_is_refused_with_its_reason(fake_server: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "error: failed to load model")
    with pytest.raises(LlamaCppUnavailable, match=r"cannot serve .*m\.gguf \(main: error: failed to load model\)"):
        LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)


def test_a_refused_request_is_one_line_with_the_servers_message(fake_server: Path, tmp_path: Path):
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    with pytest.raises(LlamaCppUnavailable, match=r"refused a prompt of 65 tokens \(the request exceeds the available context"):
        _drive(decoder(torch.arange(65), 4, SamplingParams(), None))


def test_the_server_ends_with_its_decoder(fake_server: Path, tmp_path: Path):
    decoder = LlamaServerDecoder(tmp_path / "m.gguf", EOS, threads=1)
    process = decoder.process
    del decoder
    assert process.wait(timeout=10) is not None


def test_bench_runs_the_binary_beside_ar_and_records_its_build(fake_server: Path, tmp_path: Path, tiny_model_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    from click.testing import CliRunner

    from prep.cli import main as prep_main
    from runtime import api

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    art = tmp_path / "art"
    assert CliRunner().invoke(prep_main, ["cluster", str(tiny_model_dir), "-o", str(art), "--clusters", "8"]).exit_code == 0
    engine = api.load(art, progress=False)
    engine.session.model.gguf_path = tmp_path / "m.gguf"  # the fake serves any path
    head = tmp_path / "head.gguf"
    head.write_bytes(b"GGUF")
    eagle3 = f"llamacpp:bin:eagle3={head}:n=2"
    record = engine.bench(["ar", "llamacpp:bin", eagle3], ["w5 w6", "w7"], max_new_tokens=4)
    row = next(r for r in record["methods"] if r["method"] == "llamacpp:bin")
    assert row["tokens_per_s"] == pytest.approx(500.0) and row["new_tokens"] == 8
    assert row["identical_to_greedy"] is None and row["identical_to_ar"] in (0.0, 0.5, 1.0)
    assert "mean_accepted_length" not in row
    # llama.cpp's speculation: per prompt 3 tokens after the first, 1 an accepted draft, 2 forwards drafting 2 each
    row = next(r for r in record["methods"] if r["method"] == eagle3)
    assert row["mean_accepted_length"] == 1.5 and row["acceptance_rate"] == 0.25 and row["identical_to_greedy"] is None
    assert row["draft_ms_per_token"] is None and row["verify_ms_per_round"] is None and row["predicted_tokens_per_s"] is None
    assert record["setup"]["llamacpp_bin_build"].startswith("llama-server b4242-fake123: ")
    assert "llamacpp_build" not in record["setup"]  # llama-cpp-python was not run


def _drive(stream):
    from runtime.loops.decode import drive

    return drive(stream)


@pytest.mark.real_model
@pytest.mark.skipif(not os.environ.get(BIN_ENV), reason=f"no llama.cpp build named by {BIN_ENV} (docs/llamacpp-reference.md)")
def test_real_llama_server_bench_row_on_smollm2(tmp_path: Path):
    """smollm2-135m: the real llama-server decodes the same prompt ids greedily; the bench reports its identity to ar."""
    from artifacts import Artifact
    from prep import stages
    from runtime import api
    from runtime.models import load_model

    loaded = load_model("smollm2-135m-instruct", progress=False, weights=True)
    path = tmp_path / "art"
    stages.write_screen(stages.HeadSource(loaded, Artifact.create(path, loaded.info, stages.created_by())), group_size=None, force=False)
    record = api.load(path, progress=False).bench(["ar", "llamacpp:bin"], ["def add(a, b):\n", "The capital of France is"],
                                                  max_new_tokens=16)
    row = next(r for r in record["methods"] if r["method"] == "llamacpp:bin")
    assert row["new_tokens"] == 32 and row["tokens_per_s"] > 0 and row["identical_to_ar"] in (0.0, 0.5, 1.0)
    assert " = 1" in record["setup"]["llamacpp_bin_build"]  # e.g. "AVX2 = 1": the instruction sets it ran with
