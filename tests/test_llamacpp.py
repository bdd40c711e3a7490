"""The llama.cpp reference method: refused cleanly without the extra or a GGUF, and on a real model a bench row.

llama-cpp-python is an optional extra built from source; the real-model test runs only where it is
installed (it is skipped, with the reason, elsewhere).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from runtime.llamacpp.bindings import LlamaCppUnavailable, load_llama
from runtime.methods import canonical, parse_method

HAVE_LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


def test_llamacpp_parses_and_makes_no_identity_claim() -> None:
    spec = parse_method("llamacpp")
    assert str(spec) == "llamacpp" and not spec.distribution_preserving
    assert canonical(parse_method("llamacpp:lookup")) == "llamacpp:lookup:10"  # llama-cpp-python's default
    assert canonical(parse_method("llamacpp:lookup:4")) == "llamacpp:lookup:4"
    assert not parse_method("llamacpp:lookup:4").distribution_preserving
    for bad in ("llamacpp:fast", "llamacpp:lookup:0", "llamacpp:lookup:4:2"):
        with pytest.raises(ValueError, match="takes nothing, lookup"):
            parse_method(bad)
    with pytest.raises(ValueError, match=r"\+csv applies"):
        parse_method("llamacpp+csv")


def test_without_the_extra_the_method_is_refused_naming_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(LlamaCppUnavailable, match=r"\.\[llamacpp\]"):
        load_llama(tmp_path / "m.gguf", 512, 1)


@pytest.mark.skipif(not HAVE_LLAMACPP, reason="llama-cpp-python (the optional llamacpp extra) is not installed")
def test_a_file_llama_cpp_cannot_load_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(LlamaCppUnavailable, match="cannot load"):
        load_llama(bad, 512, 1)


@pytest.mark.real_model
@pytest.mark.skipif(not HAVE_LLAMACPP, reason="llama-cpp-python (the optional llamacpp extra) is not installed")
def test_llamacpp_bench_row_on_real_smollm2(tmp_path) -> None:
    """smollm2-135m: llama.cpp decodes the same prompt ids greedily; the bench reports its identity to ar."""
    from artifacts import Artifact
    from prep import stages
    from runtime import api
    from runtime.models import load_model

    loaded = load_model("smollm2-135m-instruct", progress=False, weights=True)
    path = tmp_path / "art"
    stages.write_screen(stages.HeadSource(loaded, Artifact.create(path, loaded.info, stages.created_by())), group_size=None, force=False)
    engine = api.load(path, progress=False)
    record = engine.bench(["ar", "llamacpp", "llamacpp:lookup:4"], ["def add(a, b):\n", "The capital of France is"],
                          max_new_tokens=16)
    for name in ("llamacpp", "llamacpp:lookup:4"):
        row = next(r for r in record["methods"] if r["method"] == name)
        assert row["new_tokens"] == 32 and row["tokens_per_s"] > 0
        assert row["identical_to_greedy"] is None  # no identity claim for a method that is not exact
        assert row["identical_to_ar"] in (0.0, 0.5, 1.0)
    import llama_cpp

    build = record["setup"]["llamacpp_build"]  # which llama.cpp build the tok/s came from
    assert build.startswith(f"{llama_cpp.__version__}: ") and " = 1" in build  # e.g. "AVX2 = 1"
    assert torch.get_num_threads() >= 1
