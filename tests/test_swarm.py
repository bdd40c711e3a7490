"""SWARM token-tree speculative decoding (runtime.loops.tree_speculative): greedy outputs identical to
generate_ar for trees from a backend drafter's top-K per slot (layers:1, int8) and from a OneDecode
table, K = 2, 4, 8 and 7..32 nodes; EOS, token limits and the EOS guard at any position; an end-to-end
sampling check against the exact law of the first tokens; the method names in generate and bench; and
on real gemma3-270m, greedy identity with ar for swarm:int8 and swarm:layers.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from factories import tiny_artifact
from runtime.backends.lean import lean_target
from runtime.loops.decode import generate_ar
from runtime.drafters import Int8Drafter, LayerDrafter, LookupDrafter
from runtime.drafters.layers import SlotTrees
from runtime.drafters.lookup import LookupTrees
from runtime.drafters.onedecode import OneDecodeDrafter, OneDecodeTable, TableTrees
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams, TokenBan, warp
from runtime.loops.tree_speculative import drop_banned_nodes, generate_tree
from runtime.drafters.trees import TokenTree

NEW_TOKENS = 24
PROMPTS = [[5, 6, 7, 8] * 5, list(range(10, 30)), [3], [201, 17, 88, 4, 150, 9, 63, 240, 31, 77, 120, 5]]
SHAPES = [(2, 4, 7), (4, 4, 16), (8, 3, 32), (4, 8, 32)]  # (K, depth, nodes)


@pytest.fixture(scope="module")
def target(tiny_llama):
    return lean_target(tiny_llama, set())  # no EOS: every run produces its full token budget


def full_head(target) -> FullHead:
    return FullHead(target.head_weight, target.head_bias)


def ar(target, prompt, n=NEW_TOKENS, **kwargs) -> list[int]:
    return generate_ar(target, full_head(target), torch.tensor(prompt), n, **kwargs)[0]


def slot_trees(target, source: str, k: int) -> SlotTrees:
    drafter = LayerDrafter(target, 1, full_head(target)) if source == "layers:1" else Int8Drafter(target, full_head(target))
    return SlotTrees(drafter, k)


def own_table(target, k: int) -> OneDecodeTable:
    """A table keyed by the last token: the target's own greedy successors first, random fill after."""
    successors: dict[int, list[int]] = {}
    for prompt in PROMPTS:
        out = prompt[-1:] + ar(target, prompt)
        for a, b in zip(out, out[1:]):
            successors.setdefault(a, [])
            if b not in successors[a]:
                successors[a].append(b)
    rng = random.Random(0)
    single = {}
    for key, first in successors.items():
        tokens = (first + [t for t in rng.sample(range(256), 2 * k) if t not in first])[:k]
        single[key] = (tokens, [0.9 / (i + 1) for i in range(k)])
    return OneDecodeTable(single, {}, k)


@pytest.mark.parametrize("source", ["layers:1", "int8"])
@pytest.mark.parametrize("k, depth, nodes", SHAPES)
def test_greedy_swarm_equals_ar(target, source, k, depth, nodes) -> None:
    accepted = 0
    for prompt in PROMPTS:
        tokens, stats = generate_tree(target, full_head(target), slot_trees(target, source, k), torch.tensor(prompt),
                                      NEW_TOKENS, depth=depth, budget=nodes)
        assert tokens == ar(target, prompt), prompt
        assert stats.spec.drafted <= stats.spec.rounds * nodes
        accepted += stats.spec.accepted
    assert accepted > 0  # the trees were used, not only the target's own token


@pytest.mark.parametrize("k", [2, 4, 8])
def test_greedy_table_swarm_equals_ar_and_beats_the_chain(target, k) -> None:
    """OTT-SWARM: the table's top-K per node; more tokens per round than the table's single chain."""
    table = own_table(target, k)
    trees, chain = [], []
    for prompt in PROMPTS:
        tokens, stats = generate_tree(target, full_head(target), TableTrees(OneDecodeDrafter(table), k),
                                      torch.tensor(prompt), NEW_TOKENS, depth=4, budget=16)
        assert tokens == ar(target, prompt)
        single, chain_stats = generate_tree(target, full_head(target), TableTrees(OneDecodeDrafter(table), 1),
                                            torch.tensor(prompt), NEW_TOKENS, depth=4, budget=4)
        assert single == tokens
        trees.append(stats.spec.accepted / max(stats.spec.drafts, 1))
        chain.append(chain_stats.spec.accepted / max(chain_stats.spec.drafts, 1))
    assert sum(trees) > 0 and sum(trees) >= sum(chain)
    with pytest.raises(ValueError, match=f"holds {k} per key .* use swarm:onedecode:{k}"):
        TableTrees(OneDecodeDrafter(table), k + 1)  # more candidates than the table holds: refused, not cut silently


@pytest.mark.parametrize("k, depth, nodes", [(1, 4, 4), (4, 4, 12), (8, 6, 32)])
def test_greedy_lookup_swarm_equals_ar(target, k, depth, nodes) -> None:
    """The lookup drafter's K continuations as a tree; its session spans the prompts, as in bench."""
    trees = LookupTrees(LookupDrafter(), k)
    accepted = 0
    for prompt in PROMPTS + PROMPTS:  # the second pass also finds the first pass's outputs
        tokens, stats = generate_tree(target, full_head(target), trees, torch.tensor(prompt), NEW_TOKENS, depth=depth,
                                      budget=nodes)
        assert tokens == ar(target, prompt), prompt
        assert stats.spec.drafted <= stats.spec.rounds * nodes
        accepted += stats.spec.accepted
    assert accepted > 0 and len(trees.drafter.history) == 2 * len(PROMPTS) - 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_token_limit_at_any_position(target, n) -> None:
    prompt = PROMPTS[0]
    tokens, stats = generate_tree(target, full_head(target), slot_trees(target, "layers:1", 4), torch.tensor(prompt), n)
    assert tokens == ar(target, prompt, n) and len(tokens) == n and stats.new_tokens == n


def test_eos_at_any_position(tiny_llama) -> None:
    """EOS ends the output wherever it falls inside an accepted path (tokens up to and including it)."""
    plain = lean_target(tiny_llama, set())
    reference = ar(plain, PROMPTS[1])
    for index in range(0, NEW_TOKENS, 3):
        eos = reference[index]
        with_eos = lean_target(tiny_llama, {eos})
        tokens, _ = generate_tree(with_eos, full_head(with_eos), slot_trees(with_eos, "layers:1", 4),
                                  torch.tensor(PROMPTS[1]), NEW_TOKENS)
        assert tokens == reference[: reference.index(eos) + 1]


def test_min_response_guard_matches_ar(tiny_llama) -> None:
    """With EOS banned from the first tokens, trees lose banned nodes and rows are guarded by position."""
    plain = lean_target(tiny_llama, set())
    eos = ar(plain, PROMPTS[3])[1]
    target = lean_target(tiny_llama, {eos})
    for guard in (2, 5, 12):
        tokens, _ = generate_tree(target, full_head(target), slot_trees(target, "layers:1", 4), torch.tensor(PROMPTS[3]),
                                  NEW_TOKENS, min_new_tokens=guard)
        assert tokens == ar(target, PROMPTS[3], min_new_tokens=guard)
        assert eos not in tokens[:guard]


def test_drop_banned_nodes_removes_subtrees_at_guarded_positions() -> None:
    tree = TokenTree(torch.tensor([1, 9, 9, 4, 9, 7, 3]), torch.tensor([-1, -1, 0, 0, 3, 4, 1]))
    kept = drop_banned_nodes(tree, TokenBan(frozenset({9}), until=12), start=10)  # depths 1 and 2 guarded
    # Node 1 (9 at depth 1) goes with its child 6, node 2 (9 at depth 2) too; node 4 (9 at depth 3) stays.
    assert kept.tokens.tolist() == [1, 4, 9, 7] and kept.parents.tolist() == [-1, 0, 1, 2]
    assert drop_banned_nodes(tree, TokenBan(frozenset({9}), until=10), start=10) is tree


def test_sampling_end_to_end_follows_the_target(target) -> None:
    """The law of the first three tokens (the prefill's, then a depth-2 tree round) against the exact
    law from the target's own warped rows, temperature 1 restricted to the top 3 (27 outcomes): total
    variation within sampling error (expected under 0.04 at 3000 runs)."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt, head = PROMPTS[3], full_head(target)

    def law(context: list[int]) -> dict[int, float]:
        row = warp(head.logits(target.forward(torch.tensor(context), target.new_cache())[-1:]), params)[0]  # [V]
        return {x: float(row[x]) for x in row.nonzero().flatten().tolist()}

    exact: dict[tuple[int, ...], float] = {}
    for x1, p1 in law(prompt).items():
        for x2, p2 in law(prompt + [x1]).items():
            for x3, p3 in law(prompt + [x1, x2]).items():
                exact[(x1, x2, x3)] = p1 * p2 * p3
    runs, counts = 3000, {}
    drafter = slot_trees(target, "layers:1", 2)
    for seed in range(runs):
        tokens, _ = generate_tree(target, head, drafter, torch.tensor(prompt), 3, params,
                                  torch.Generator().manual_seed(seed), depth=2, budget=6)
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(key, 0) / runs - p) for key, p in exact.items())
    assert tv < 0.07, (tv, counts, exact)


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    return tiny_artifact(tiny_model_dir, tmp_path_factory.mktemp("swarm"))


def test_generate_and_bench_accept_the_tree_methods(artifact, tmp_path, monkeypatch) -> None:
    """Every swarm / mjsd name runs in both commands; bench counts swarm as identical to greedy and
    never mjsd (not distribution-preserving: no identity claim)."""
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(artifact.parent / "cache"))
    names = ["swarm:layers:1:4", "swarm:int8:2:gamma=3:nodes=8+csv", "swarm:lookup:4:nodes=12+csv", "swarm:layers:1:8:nodes=32",
             "mjsd:layers:1", "mjsd:int8:beam=2:tau=0.5:gamma=3"]
    prompt = "w5 w9 w31 w5 w9"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": prompt}]))
    out = tmp_path / "bench.json"
    bench = CliRunner().invoke(runtime_main, ["bench", str(artifact), "--prompts", str(prompts), "--methods",
                                              ",".join(["ar"] + names), "-n", "1", "--max-new-tokens", "12",
                                              "--json", str(out)])
    assert bench.exit_code == 0, bench.output
    rows = {row["method"]: row for row in json.loads(out.read_text())["methods"]}
    assert all(rows[name]["identical_to_greedy"] == 1.0 for name in names if name.startswith("swarm"))
    assert all(rows[name]["identical_to_greedy"] is None and not rows[name]["distribution_preserving"]
               for name in names if name.startswith("mjsd"))
    table = out.with_suffix(".md").read_text()  # the terminal's table too: MJSD says what it is wherever it appears
    assert all((f"| {name} [not distribution-preserving] |" in table) == name.startswith("mjsd") for name in names)
    texts = {}
    for name in ["ar"] + names:
        result = CliRunner().invoke(runtime_main, ["generate", str(artifact), "--method", name, "--prompt", prompt,
                                                   "--max-new-tokens", "12", "--threads", "1"])
        assert result.exit_code == 0, result.output
        assert (", not distribution-preserving]" in result.stderr) == name.startswith("mjsd"), result.stderr
        texts[name] = result.stdout
    assert all(texts[name] == texts["ar"] for name in names if name.startswith("swarm")) and texts["ar"].strip()


def test_transformers_backend_refuses_tree_methods(artifact, monkeypatch) -> None:
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(artifact.parent / "cache"))
    result = CliRunner().invoke(runtime_main, ["generate", str(artifact), "--method", "swarm:layers:1:4", "--prompt",
                                               "w5 w9", "--backend", "transformers"])
    assert result.exit_code != 0 and "--backend lean|native" in result.output and "Traceback" not in result.output


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["swarm:int8:4", "swarm:layers:12:2:gamma=5:nodes=32", "swarm:lookup:4:nodes=12",
                                  "swarm:lookup:4:nodes=12+csv:screen4"])
def test_real_gemma_greedy_swarm_equals_ar(gemma_session, name) -> None:
    from runtime.methods import build_method

    from factories import real_texts

    method, reference = build_method(gemma_session, name), build_method(gemma_session, "ar")
    accepted = 0
    for text in real_texts()[:2]:
        prompt = torch.tensor(gemma_session.tokenizer(text)["input_ids"])
        tokens, stats = method.decode(prompt, 48, SamplingParams(), None)
        assert tokens == reference.decode(prompt, 48, SamplingParams(), None)[0]
        accepted += stats.spec.accepted
    assert accepted > 0


def test_bench_verify_times_trees_next_to_chains(artifact, tmp_path, monkeypatch) -> None:
    from runtime.cli import main as runtime_main

    monkeypatch.setenv("SPECVOCAB_CACHE", str(artifact.parent / "cache"))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"text": " ".join(f"w{4 + (i * 7) % 250}" for i in range(80))}]))
    out = tmp_path / "verify.json"
    result = CliRunner().invoke(runtime_main, ["bench-verify", str(artifact), "--prompts", str(prompts), "--context", "20",
                                               "--max-n", "4", "--repeats", "1", "--trees", "4,8,32", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["tree_rows"]
    assert [row["nodes"] for row in rows] == [4, 8, 32] and all(row["total_ms"] > 0 and row["depth"] >= 1 for row in rows)
    bad = CliRunner().invoke(runtime_main, ["bench-verify", str(artifact), "--trees", "4,x"])
    assert bad.exit_code != 0 and "--trees" in bad.output and "Traceback" not in bad.output
