"""OneDecode: the baked table against a brute-force reference on synthetic traces, its held-out
figures, the `prep bake-onedecode` command, and the OTT-OD drafter's lookups and fallbacks."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from artifact_factories import VERSION, make_model
from artifacts import Artifact
from artifacts.format import Stage
from prep.onedecode import build_table, evaluate
from prep.traces import INDEX_FILE, TRACES_FORMAT
from runtime.text.data import SPLITS
from runtime.drafters.base import Proposal
from runtime.drafters.ngram import NgramDrafter
from runtime.drafters.onedecode import FirstProposal, OneDecodeDrafter, OneDecodeTable, tensor_name
from runtime.common.sampling import SamplingParams
from runtime.drafters.base import Verdict

V = 32  # make_model's vocabulary
TOP = 8


def synthetic_traces(n_texts: int = 60, length: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    """Traces of texts drawn from a second-order Markov chain; the 'target' top-8 is its true
    next-token law after the last two tokens (so pair keys are sharper than single ones)."""
    gen = torch.Generator().manual_seed(seed)
    law = torch.softmax(torch.randn(V, V, V, generator=gen) * 3, dim=-1)  # [prev, last, next]
    cols = {k: [] for k in ("input_ids", "position", "top_ids", "top_probs", "split")}
    for text in range(n_texts):
        ids = [int(torch.randint(V, (1,), generator=gen)), int(torch.randint(V, (1,), generator=gen))]
        while len(ids) < length:
            ids.append(int(torch.multinomial(law[ids[-2], ids[-1]], 1, generator=gen)))
        for pos, token in enumerate(ids):
            row = law[ids[pos - 1], token] if pos > 0 else law[token, token]
            top = row.topk(TOP)
            cols["top_ids"].append(top.indices.to(torch.int32))
            cols["top_probs"].append(top.values.to(torch.float16))
        cols["input_ids"].append(torch.tensor(ids, dtype=torch.int32))
        cols["position"].append(torch.arange(length, dtype=torch.int32))
        cols["split"].append(torch.full((length,), 2 if text % 5 == 0 else 0, dtype=torch.int8))
    return {k: torch.stack(v) if k.startswith("top") else torch.cat(v) for k, v in cols.items()}


def reference_table(traces, level: str, keys: list, top_k: int) -> dict:
    """Brute force: per key, every candidate's summed probability / the key's occurrences."""
    train = (traces["split"] == SPLITS.index("train")).tolist()
    ids, pos = traces["input_ids"].tolist(), traces["position"].tolist()
    mass, count = defaultdict(lambda: defaultdict(float)), defaultdict(int)
    for i in range(len(ids)):
        if not train[i] or (level == "pair" and pos[i] == 0):
            continue
        key = ids[i] if level == "single" else (ids[i - 1], ids[i])
        count[key] += 1
        for t, p in zip(traces["top_ids"][i].tolist(), traces["top_probs"][i].float().tolist()):
            mass[key][t] += p
    out = {}
    for key in keys:
        ranked = sorted(mass[key].items(), key=lambda tp: (-tp[1], tp[0]))[:top_k]
        out[key] = ([t for t, _ in ranked], [m / count[key] for _, m in ranked], count[key])
    return out, count


def test_table_matches_brute_force():
    traces = synthetic_traces()
    tensors, params = build_table(traces, V, v_bake=20, top_k=4, min_pair_count=3, max_pairs=50)
    table = OneDecodeTable.from_tensors(tensors)
    for level, keys in (("single", list(table.single)), ("pair", list(table.pair))):
        expected, counts = reference_table(traces, level, keys, 4)
        assert tensors[tensor_name(level, "count")].tolist() == [expected[k][2] for k in keys]
        for key in keys:
            tokens, conf = (table.single if level == "single" else table.pair)[key]
            assert tokens == expected[key][0], (level, key)
            assert conf == pytest.approx(expected[key][1], abs=1e-6)
        # The baked keys are the most frequent ones (ties may go either way at the boundary only).
        baked = [counts[k] for k in keys]
        others = [c for k, c in counts.items() if k not in set(keys)]
        if others:
            assert min(baked) >= max(others) or (level == "pair" and len(keys) < 50)
    assert len(table.single) == 20 and params["single_keys"] == 20
    assert 0 < len(table.pair) <= 50 and all(c >= 3 for c in tensors["pair.count"].tolist())
    # hits: how often each candidate was the target's top-1 there; never more than the key's count.
    assert (tensors["single.hits"].sum(dim=1) <= tensors["single.count"]).all()


def test_heldout_figures_match_brute_force():
    traces = synthetic_traces(seed=1)
    tensors, _ = build_table(traces, V, v_bake=10, top_k=3, min_pair_count=2)
    table = OneDecodeTable.from_tensors(tensors)
    stats = evaluate(tensors, traces, V)
    held = (traces["split"] == SPLITS.index("heldout")).tolist()
    ids, pos = traces["input_ids"].tolist(), traces["position"].tolist()
    n = hits = agree = recall = 0
    for i in range(len(ids)):
        if not held[i]:
            continue
        n += 1
        found = table.lookup(ids[i - 1 : i + 1] if pos[i] > 0 else ids[i : i + 1])
        if found:
            hits += 1
            top1 = int(traces["top_ids"][i, 0])
            agree += found[0][0] == top1
            recall += top1 in found[0]
    assert stats["positions"] == n and n > 0
    assert stats["hit_rate"] == round(hits / n, 4)
    assert stats["top1_agreement"] == round(agree / hits, 4)
    assert stats["topk_recall"] == round(recall / hits, 4)
    # The chain's law is second order: pair keys agree with the target more often than single ones.
    singles_only, _ = build_table(traces, V, v_bake=10, top_k=3, min_pair_count=10**6)
    without = evaluate(singles_only, traces, V)
    assert without["pair_share"] == 0 < stats["pair_share"]
    assert stats["top1_agreement"] > without["top1_agreement"]


def crafted_table() -> OneDecodeTable:
    return OneDecodeTable(
        single={1: ([2, 3], [0.9, 0.05]), 2: ([3], [0.6]), 3: ([4], [0.1]), 5: ([6, 7, 8], [0.5, 0.3, 0.1])},
        pair={(1, 2): ([5], [0.8])},
        top_k=3,
    )


def test_drafter_chains_pair_keys_first_and_stops_on_low_confidence():
    drafter = OneDecodeDrafter(crafted_table(), threshold=0.4)
    drafter.reset([1], SamplingParams(), None)
    # 1 -> 2 (single), then (1, 2) -> 5 (pair beats single 2 -> 3), then 5 -> 6, then 6 misses.
    assert drafter.propose([0, 1], 8).tokens.tolist() == [2, 5, 6]
    assert drafter.propose([0, 1], 2).tokens.tolist() == [2, 5]
    # 2 -> 3 at 0.6, then 3 -> 4 at 0.1 < 0.4 stops.
    proposal = drafter.propose([9, 2], 8)
    assert proposal.tokens.tolist() == [3] and proposal.probs is None
    assert OneDecodeDrafter(crafted_table(), threshold=0.0).propose([9, 2], 8).tokens.tolist() == [3, 4]
    assert drafter.propose([9], 8).tokens.numel() == 0 and drafter.propose([], 8).tokens.numel() == 0
    assert drafter.top_k([4, 5], 2) == ([6, 7], [0.5, 0.3])
    assert drafter.top_k([1, 2], 4) == ([5], [0.8]) and drafter.top_k([9], 4) == ([], [])
    with pytest.raises(ValueError, match="threshold"):
        OneDecodeDrafter(crafted_table(), threshold=1.5)


def test_swarm_tree_from_the_table():
    drafter = OneDecodeDrafter(crafted_table())
    tree = drafter.tree([0, 1], k=2, depth=3, budget=16)
    paths = sorted(tuple(tree.tokens[p].tolist()) for p in tree.paths())
    # 1 -> {2 (0.9), 3 (0.05)}; (1, 2) -> 5; 5 -> {6, 7}; 3 -> 4 (the pair (1, 3) is not baked).
    assert paths == [(2, 5, 6), (2, 5, 7), (3, 4)]
    assert tree.scores[0] == pytest.approx(math.log(0.9))
    small = drafter.tree([0, 1], k=2, depth=3, budget=3)  # the 3 most confident nodes: 2, 2-5, 2-5-6
    assert sorted(tuple(small.tokens[p].tolist()) for p in small.paths()) == [(2, 5, 6)]
    assert drafter.tree([9], k=4, depth=3, budget=8).size == 0


class Recorder:
    """A drafter that proposes fixed tokens and records what it observed."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.seen, self.resets = tokens, [], 0

    def reset(self, prompt, params, generator, ban=None) -> None:
        self.resets += 1

    def propose(self, context, k) -> Proposal:
        return Proposal(torch.tensor(self.tokens[:k], dtype=torch.long))

    def observe(self, verdict) -> None:
        self.seen.append(verdict)


def test_first_proposal_falls_back_and_routes_verdicts():
    fallback = Recorder([7, 7])
    drafter = FirstProposal([OneDecodeDrafter(crafted_table(), threshold=0.4), fallback])
    drafter.reset([1], SamplingParams(), None)
    assert fallback.resets == 1
    assert drafter.propose([0, 1], 4).tokens.tolist() == [2, 5, 6]  # table hit: its proposal
    drafter.observe(Verdict(3, 1, [2, 4]))
    assert fallback.seen == []
    assert drafter.propose([9], 4).tokens.tolist() == [7, 7]  # table miss: the fallback's
    drafter.observe(Verdict(2, 0, [3]))
    assert fallback.seen == [Verdict(2, 0, [3])] and drafter.sources == [1, 1]
    # Context n-gram first (llama.cpp's lookup order): a repeated suffix wins over the table.
    ordered = FirstProposal([NgramDrafter(), OneDecodeDrafter(crafted_table(), threshold=0.4)])
    assert ordered.propose([1, 9, 9, 1], 2).tokens.tolist() == [9, 9]
    assert ordered.propose([0, 1], 2).tokens.tolist() == [2, 5]  # no earlier match: the table


def write_traces(path, traces: dict[str, torch.Tensor], model: str) -> None:
    """A one-shard traces directory in prep traces' format."""
    path.mkdir()
    safetensors.torch.save_file(traces, str(path / "shard-00000.safetensors"))
    index = {"format": TRACES_FORMAT, "model": model, "vocab_size": V,
             "shards": [{"file": "shard-00000.safetensors", "complete": True}]}
    (path / INDEX_FILE).write_text(json.dumps(index))


def test_prep_bake_onedecode(tmp_path):
    from prep.cli import main as prep_main

    art = Artifact.create(tmp_path / "art", make_model(), VERSION)
    write_traces(tmp_path / "tr", synthetic_traces(), "tiny")
    runner = CliRunner()
    args = ["bake-onedecode", str(art.path), "--traces", str(tmp_path / "tr"), "--v-bake", "16", "--top-k", "4"]
    result = runner.invoke(prep_main, args)
    assert result.exit_code == 0, result.output
    assert "held-out hit rate" in result.output and "top-1 agreement" in result.output
    art = Artifact.open(art.path)
    params = art.stage_params(Stage.ONEDECODE)
    assert params["v_bake"] == 16 and params["top_k"] == 4 and 0 < params["heldout"]["hit_rate"] <= 1
    table = OneDecodeTable.load(art)
    assert len(table.single) == 16 and table.top_k == 4
    again = runner.invoke(prep_main, args)
    assert again.exit_code == 1 and "--force" in again.output and "Traceback" not in again.output
    assert runner.invoke(prep_main, args + ["--force"]).exit_code == 0
    # Traces of another model are refused with the command that makes the right ones.
    write_traces(tmp_path / "other", synthetic_traces(), "other-model")
    wrong = runner.invoke(prep_main, ["bake-onedecode", str(art.path), "--traces", str(tmp_path / "other"), "--force"])
    assert wrong.exit_code == 1 and "prep traces tiny" in wrong.output
    bad = runner.invoke(prep_main, args[:4] + ["--top-k", "9", "--force"])
    assert bad.exit_code == 2 and "--top-k" in bad.output


def test_parse_and_build_by_name(tmp_path):
    from types import SimpleNamespace

    from runtime.drafters.onedecode import OnedecodeOptions

    parse = OnedecodeOptions.parse
    assert parse([]).format() == ("threshold=0.25", "fallback=none")
    assert parse(["fallback=ngram", "threshold=0.5"]) == OnedecodeOptions(0.5, "ngram")
    assert parse(["fallback=ngram", "threshold=0.5"]).format() == ("threshold=0.5", "fallback=ngram")
    assert parse(["context=first"]).format()[-1] == "context=first"
    for bad, says in ((["threshold=2"], "threshold"), (["fallback=gp"], "fallback"), (["k=3"], "unknown"),
                      (["context=first", "fallback=ngram"], "drop fallback=ngram"), (["context=last"], "context")):
        with pytest.raises(ValueError, match=says):
            parse(bad)
    art = Artifact.create(tmp_path / "art", make_model(), VERSION)
    tensors, params = build_table(synthetic_traces(), V, v_bake=8, top_k=4)
    art.write_stage(Stage.ONEDECODE, tensors, params)
    context = SimpleNamespace(target=None, head=None, artifact=art, target_info=None)
    alone = parse(["threshold=0.1"]).build(context)
    assert isinstance(alone, OneDecodeDrafter) and alone.threshold == 0.1 and len(alone.table.single) == 8
    both = parse(["context=first", "fallback=none"]).build(context)
    assert isinstance(both, FirstProposal) and isinstance(both.drafters[0], NgramDrafter)
    with pytest.raises(ValueError, match="bake-onedecode"):
        parse([]).build(SimpleNamespace(target=None, head=None, artifact=None, target_info=None))


def test_spec_onedecode_in_generate_and_bench(tiny_model_dir, tmp_path, monkeypatch):
    """prep traces -> bake-onedecode -> `runtime generate` / `runtime bench` with spec:onedecode on the
    tiny random Llama: the text equals plain decoding's, with and without fallbacks."""
    from prep.cli import main as prep_main
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(tmp_path / "cache"))
    gen = torch.Generator().manual_seed(0)
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([{"text": " ".join(f"w{int(t)}" for t in torch.randint(4, 256, (64,), generator=gen))}
                                  for _ in range(60)]))
    art, tr = tmp_path / "art", tmp_path / "tr"
    run = lambda cli, args: CliRunner().invoke(cli, [str(a) for a in args])  # noqa: E731
    for args in (["cluster", tiny_model_dir, "-o", art, "--clusters", 8],
                 ["traces", tiny_model_dir, "--corpus", corpus, "-o", tr, "--max-tokens", 4000,
                  "--max-tokens-per-text", 64, "--drafter-layers", 0],
                 ["bake-onedecode", art, "--traces", tr, "--v-bake", 256]):
        result = run(prep_main, args)
        assert result.exit_code == 0, result.output
    prompt = ["--prompt", "w5 w9 w5 w9 w5 w12 w7", "--max-new-tokens", 16]
    reference = run(runtime_main, ["generate", art, "--method", "ar", *prompt])
    assert reference.exit_code == 0 and reference.stdout.strip(), reference.output
    for method in ("spec:onedecode:threshold=0", "spec:onedecode:fallback=ngram:gamma=3", "spec:onedecode:context=first"):
        result = run(runtime_main, ["generate", art, "--method", method, *prompt])
        assert result.exit_code == 0, result.output
        assert result.stdout == reference.stdout, method
    prompts = tmp_path / "prompts.json"
    # Six prompts x 16 tokens: this random model accepts 23 of the table's 201 drafts, so a run
    # without one acceptance would be a broken table, not bad luck.
    prompts.write_text(json.dumps([{"text": text} for text in ("w5 w9 w5 w9 w5", "w7 w8 w7 w8 w30", "w12 w40 w12",
                                                               "w100 w101 w102", "w7 w7 w7 w7", "w200 w9 w31 w5")]))
    out = tmp_path / "b.json"
    result = run(runtime_main, ["bench", art, "--prompts", prompts, "--methods", "ar,spec:onedecode:threshold=0",
                                "-n", 6, "--max-new-tokens", 16, "--json", out])
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row for row in json.loads(out.read_text())["methods"]}
    row = rows["spec:onedecode:threshold=0"]
    assert row["identical_to_greedy"] == 1.0
    assert row["acceptance_rate"] > 0  # the table's drafts were accepted: the identity tested something
    bad = run(runtime_main, ["generate", art, "--method", "spec:onedecode:fallback=gp", *prompt])
    assert bad.exit_code != 0 and "fallback" in bad.output and "Traceback" not in bad.output
