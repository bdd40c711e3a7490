"""Bench quality columns: the target's perplexity of each method's output, and joules per token from
RAPL / NVML counters or "not available" (runtime.bench.perplexity, runtime.bench.energy)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from factories import tiny_engine
from runtime import api
from runtime.bench import energy
from runtime.bench.energy import EnergyMeter
from runtime.bench.perplexity import output_nll, perplexities
from runtime.bench.report import markdown_table
from runtime.bench.runner import run_bench, summarize
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams
from runtime.common.stats import DecodeStats
from runtime.methods import Method

PROMPTS = ["w5 w9 w31 w5 w9", "hi w7 w8 w7 w8"]


@pytest.fixture
def no_counters(tmp_path, monkeypatch):
    """A machine without energy counters: an empty powercap root and no pynvml."""
    monkeypatch.setattr(energy, "POWERCAP_ROOT", tmp_path / "no-powercap")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    return tiny_engine(tiny_model_dir, tmp_path_factory.mktemp("quality"))


# --- perplexity -------------------------------------------------------------------------------------

class OneHotTarget:
    """A fake backend whose hidden state at a position is the one-hot vector of that position's token."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.calls = vocab, []

    def new_cache(self) -> list:
        return []

    def forward(self, tokens: torch.Tensor, cache: list) -> torch.Tensor:
        self.calls.append((tokens.tolist(), len(cache)))
        return torch.nn.functional.one_hot(tokens, self.vocab).float()  # [T, V]


def test_perplexity_by_hand_on_a_crafted_two_token_model():
    # logits after token t are column t of W: after 0, p = (1/4, 3/4); after 1, p = (1/2, 1/2).
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]])  # [V, d]
    target = OneHotTarget(2)
    prompts, outputs = [torch.tensor([0]), torch.tensor([1])], [[1, 0], [1]]
    # prompt [0] -> 1 (3/4) -> 0 (1/2); prompt [1] -> 1 (1/2): three tokens, token-weighted mean.
    expected = math.exp(-(math.log(3 / 4) + math.log(1 / 2) + math.log(1 / 2)) / 3)
    (score,) = perplexities(target, FullHead(weight), prompts, [outputs])
    assert score == pytest.approx(expected, rel=1e-6)  # fp32 logits
    assert expected == pytest.approx((3 / 16) ** (-1 / 3))
    # One forward per prompt over prompt + output, each on a fresh cache.
    assert target.calls == [([0, 1, 0], 0), ([1, 1], 0)]
    assert output_nll(target, FullHead(weight), torch.tensor([0]), [1]) == pytest.approx(-math.log(3 / 4), rel=1e-6)


def test_perplexity_of_no_tokens_is_none_and_costs_no_forward():
    target = OneHotTarget(2)
    assert perplexities(target, FullHead(torch.zeros(2, 2)), [torch.tensor([0])], [[]]) == [None]
    assert target.calls == []


def test_an_output_several_methods_gave_is_scored_once():
    weight = torch.tensor([[0.0, 0.0], [math.log(3), 0.0]])  # [V, d]
    target = OneHotTarget(2)
    prompts = [torch.tensor([0]), torch.tensor([1])]
    same, other = [[1, 0], [1]], [[0, 1], [1]]  # the second method differs on the first prompt only
    first, second, third = perplexities(target, FullHead(weight), prompts, [same, other, same])
    assert first == third and first != second
    assert target.calls == [([0, 1, 0], 0), ([1, 1], 0), ([0, 0, 1], 0)]  # three distinct (prompt, output) pairs


def test_perplexity_scores_rows_in_chunks_the_same_as_one_by_one(engine):
    """Outputs longer than one head chunk (16 rows): the sum equals scoring each token after its own prefix."""
    session = engine.session
    prompt = engine.encode(PROMPTS[0])
    output = [int(t) for t in torch.randint(4, 256, (37,), generator=torch.Generator().manual_seed(0))]
    whole = output_nll(session.target, session.full_head(), prompt, output)
    prefixes = [torch.cat([prompt, torch.tensor(output[:i], dtype=torch.long)]) for i in range(len(output))]
    stepwise = sum(output_nll(session.target, session.full_head(), prefix, [token])
                   for prefix, token in zip(prefixes, output))
    assert whole == pytest.approx(stepwise, rel=1e-5)


def test_exact_greedy_methods_have_ar_perplexity_exactly(engine, no_counters):
    record = engine.bench(["csv", "spec:ngram", "spec:layers:1", "mjsd:layers:1:tau=0.5"], PROMPTS, max_new_tokens=12)
    rows = {row["method"]: row for row in record["methods"]}
    reference = rows["ar"]["perplexity"]
    assert reference is not None and math.isfinite(reference) and reference > 1
    for name in ("csv", "spec:ngram", "spec:layers:1"):
        assert rows[name]["identical_to_greedy"] == 1.0
        assert rows[name]["perplexity"] == reference  # same tokens, same forward: the same bits
    # MJSD's output differs from greedy on these prompts, and so does its perplexity.
    assert rows["mjsd:layers:1:tau=0.5"]["identical_to_ar"] == 0.0
    assert rows["mjsd:layers:1:tau=0.5"]["perplexity"] != reference


def test_sampled_outputs_that_differ_get_a_different_perplexity(engine, no_counters):
    record = engine.bench(["spec:ngram"], PROMPTS, max_new_tokens=12, sampling=SamplingParams(temperature=1.0))
    ar, spec = record["methods"]
    assert spec["identical_to_ar"] == 0.0  # exact in distribution, not token for token
    assert spec["perplexity"] != ar["perplexity"]


# --- energy -----------------------------------------------------------------------------------------

def _domain(root, name: str, label: str, energy_uj: int, max_uj: int = 1_000_000_000):
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return path


def test_rapl_sums_package_domains_and_unwraps_a_counter(tmp_path, monkeypatch):
    root = tmp_path / "powercap"
    package0 = _domain(root, "intel-rapl:0", "package-0", 999_000_000)
    package1 = _domain(root, "intel-rapl:1", "package-1", 5_000_000)
    core = _domain(root, "intel-rapl:0:0", "core", 7)  # inside package-0: never added to it
    psys = _domain(root, "intel-rapl:2", "psys", 7)  # the whole platform: would count the packages twice
    _domain(root, "intel-rapl-mmio:0", "package-0", 7)  # the same package through MMIO
    monkeypatch.setattr(energy, "POWERCAP_ROOT", root)
    meter = EnergyMeter(nvml=False)
    assert meter.available and meter.reason is None
    assert meter.description == "RAPL package-0, RAPL package-1"
    before = meter.read()
    (package0 / "energy_uj").write_text("2500000\n")  # wrapped: 999 J -> 1000 J (range) -> 0 -> 2.5 J
    (package1 / "energy_uj").write_text("6250000\n")  # +1.25 J
    for other in (core, psys):
        (other / "energy_uj").write_text("900000000\n")
    assert meter.joules_since(before) == pytest.approx(3.5 + 1.25, abs=1e-9)


def test_root_only_rapl_counters_are_not_available_with_the_reason(tmp_path, monkeypatch):
    root = tmp_path / "powercap"
    _domain(root, "intel-rapl:0", "package-0", 10)

    def refuse(path):
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return int(path.read_text())

    monkeypatch.setattr(energy, "_read_int", refuse)
    meter = EnergyMeter(root, nvml=False)
    assert not meter.available and meter.joules_since(meter.read()) is None
    assert meter.reason.startswith("not available: ")
    assert "only by root" in meter.reason and "intel-rapl:0" in meter.reason


def test_nvml_counters_in_millijoules(monkeypatch, tmp_path):
    state = {"mj": [1000, 50]}

    class NVMLError(Exception):
        pass

    def total(handle):
        if handle == 2:
            raise NVMLError("not supported")  # a GPU without an energy counter is skipped
        return state["mj"][handle]

    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 3,
                                 nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetTotalEnergyConsumption=total)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter = EnergyMeter(tmp_path / "no-powercap")
    assert meter.description == "NVML GPU 0, NVML GPU 1"
    before = meter.read()
    state["mj"] = [4000, 550]
    assert meter.joules_since(before) == pytest.approx(3.5)


def test_no_counters_is_not_available(no_counters):
    meter = EnergyMeter()
    assert not meter.available and meter.read() == [] and meter.joules_since([]) is None
    assert meter.reason.startswith("not available: ") and "pynvml is not installed" in meter.reason
    assert meter.description == meter.reason


def test_bench_rows_report_joules_per_token_or_not_available(tmp_path, monkeypatch):
    """Counters read around each decode call, summed per method, over its new tokens; n/a in the table without."""
    root = tmp_path / "powercap"
    package = _domain(root, "intel-rapl:0", "package-0", 0)
    monkeypatch.setattr(energy, "POWERCAP_ROOT", root)

    def decoder(microjoules: int):
        def stream(prompt, n, params, generator, guard=0, stop=None):
            spent = int((package / "energy_uj").read_text()) + microjoules
            (package / "energy_uj").write_text(f"{spent}\n")
            yield from [1] * n
            return [1] * n, DecodeStats(prompt_tokens=prompt.numel(), new_tokens=n)
        return stream

    methods = [Method("ar", decoder(400_000)), Method("csv", decoder(100_000))]
    prompts = [torch.tensor([3, 4]), torch.tensor([5])]
    results = run_bench(methods, prompts, 4, SamplingParams(), seed=0, meter=EnergyMeter(nvml=False))
    rows = summarize(results, SamplingParams())
    assert [row["joules_per_token"] for row in rows] == pytest.approx([0.1, 0.025])  # 0.4 J / 4 tokens, 0.1 J / 4
    assert all(row["energy_unavailable"] is None for row in rows)
    assert markdown_table(rows).splitlines()[2].endswith("| 0.1000 |")  # the ar row's last column, J/token

    monkeypatch.setitem(sys.modules, "pynvml", None)
    results = run_bench(methods, prompts, 4, SamplingParams(), seed=0, meter=EnergyMeter(tmp_path / "none"))
    rows = summarize(results, SamplingParams())
    assert all(row["joules_per_token"] is None for row in rows)
    assert all(row["energy_unavailable"].startswith("not available") for row in rows)
    table = markdown_table(rows).splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    column = header.index("J/token")
    assert "perplexity" in header
    assert all(line.strip("|").split("|")[column].strip() == "n/a" for line in table[2:])


def test_cli_bench_json_and_table_carry_both_columns(engine, no_counters, tmp_path, monkeypatch):
    import json

    from runtime.cli import main as runtime_main

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": text} for text in PROMPTS]))
    out = tmp_path / "bench.json"
    art = engine.session.artifact.path
    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(runtime_main, ["bench", str(art), "--prompts", str(prompts), "--methods",
                                               "ar,spec:ngram", "-n", "2", "--max-new-tokens", "6", "--json", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["setup"]["energy_counters"].startswith("not available")
    for row in record["methods"]:
        assert row["perplexity"] > 1 and row["joules_per_token"] is None
        assert row["energy_unavailable"].startswith("not available")
    assert record["methods"][0]["perplexity"] == record["methods"][1]["perplexity"]
    table = out.with_suffix(".md").read_text()
    assert "| perplexity | J/token |" in table and "| n/a |" in table


@pytest.mark.real_model
def test_real_qwen_exact_greedy_methods_share_ar_perplexity(qwen_session, no_counters):
    """qwen2.5-coder on its default backend (native): the equality holds on a real model and real prompts."""
    from runtime.text.data import humaneval_prompts

    engine = api.Engine(qwen_session)
    record = engine.bench(["csv:screen", "spec:ngram", "spec:int8"], humaneval_prompts(2), max_new_tokens=16)
    rows = {row["method"]: row for row in record["methods"]}
    assert record["setup"]["backend"] == "native"
    reference = rows["ar"]["perplexity"]
    assert 1 < reference < 50  # greedy code continuations are likely under their own model
    for name in ("csv:screen", "spec:ngram", "spec:int8"):
        assert rows[name]["identical_to_greedy"] == 1.0 and rows[name]["perplexity"] == reference


def test_table_shows_identity_without_a_claim_apart() -> None:
    """A method with no identity claim shows how often its tokens equalled `ar`'s in a column of its own.

    Never as "identical to greedy" (llama.cpp, MJSD); a table of exact methods only has no such column."""
    ar = {"method": "ar", "tokens_per_s": 10.0, "distribution_preserving": True, "identical_to_greedy": 1.0, "identical_to_ar": 1.0}
    llama = {"method": "llamacpp", "tokens_per_s": 12.0, "distribution_preserving": False, "identical_to_greedy": None,
             "identical_to_ar": 0.25}
    lines = markdown_table([ar, llama]).splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    cells = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")] for line in lines[2:]}
    claimed, unclaimed = header.index("identical to greedy"), header.index("same tokens as ar (no claim)")
    assert cells["ar"][claimed] == "100%" and cells["ar"][unclaimed] == "–"
    assert cells["llamacpp [not distribution-preserving]"][claimed] == "–"
    assert cells["llamacpp [not distribution-preserving]"][unclaimed] == "25%"
    assert "same tokens as ar (no claim)" not in markdown_table([ar])
