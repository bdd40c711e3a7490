"""`runtime bench --chat` applies the EOS min-response guard to every method, as `runtime generate --chat` does."""

from __future__ import annotations

import torch

from runtime.methods import Method
from runtime.bench.runner import run_bench
from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats


def test_run_bench_passes_the_guard_to_every_decode():
    calls = []

    def stream(prompt, n, params, generator, guard=0, stop=None):
        calls.append(guard)
        yield from [1] * n
        return [1] * n, DecodeStats(prompt_tokens=prompt.numel(), new_tokens=n)

    methods = [Method("ar", stream), Method("spec:ngram", stream)]
    run_bench(methods, [torch.tensor([3, 4]), torch.tensor([5])], 4, SamplingParams(), seed=0, min_new_tokens=4)
    assert calls == [4] * 6  # two warm-ups, then two methods on two prompts


def test_bench_chat_records_the_guard_and_stays_identical(tiny_model_dir, tmp_path, monkeypatch):
    import json
    import shutil

    from click.testing import CliRunner

    from prep.cli import main as prep_main
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}hi"
    config_path.write_text(json.dumps(config))
    art = tmp_path / "art"
    assert CliRunner().invoke(prep_main, ["cluster", str(model), "-o", str(art), "--clusters", "8"]).exit_code == 0
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": "w5 w6 w7 w5 w6"}]))
    for extra, guard in (([], 0), (["--chat"], 4), (["--chat", "--min-response-tokens", "2"], 2)):
        out = tmp_path / f"bench-{guard}.json"  # a run never replaces an earlier one's record
        result = CliRunner().invoke(runtime_main, ["bench", str(art), "--prompts", str(prompts), "--methods",
                                                   "ar,spec:ngram,spec:layers:1", "-n", "1", "--max-new-tokens", "8",
                                                   "--json", str(out), *extra])
        assert result.exit_code == 0, result.output
        record = json.loads(out.read_text())
        assert record["setup"]["min_response_tokens"] == guard
        assert all(row["identical_to_greedy"] == 1.0 for row in record["methods"])
    from runtime import api

    engine = api.load(art, progress=False)  # the API's default guard is the CLI's: 4 with chat, none without
    assert engine.bench("ar", "w5 w6 w7", max_new_tokens=2, chat=True)["setup"]["min_response_tokens"] == 4
    assert engine.bench("ar", "w5 w6 w7", max_new_tokens=2)["setup"]["min_response_tokens"] == 0
