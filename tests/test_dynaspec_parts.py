"""DynaSpec's parts on their own, without a trained artifact: the router module, the position budget,
shortlist heads, the multi-label loss, rejection sampling over a shortlisted q, held-out bench prompts and
a corpus file's splits."""

from __future__ import annotations

import pytest
import torch

from prep.router_loss import positive_clusters, router_loss
from prep.traces import split_of
from runtime.heads import FullHead
from runtime.common.sampling import SamplingParams, warp
from runtime.heads.shortlist import ShortlistHead
from runtime.drafters.router import Router, position_budget
from runtime.loops.verify import verify_exact


def test_router_forward_shapes_and_state_roundtrip():
    router = Router(embed_dim=12, hidden_dim=10, clusters=7, width=16).eval()
    emb, hid = torch.randn(5, 12), torch.randn(5, 10) * 150
    assert router(emb, hid).shape == (5, 7)
    again = Router.from_state(router.stage_tensors())
    assert torch.equal(again(emb, hid), router(emb, hid))


def test_position_budget_follows_dynaspec():
    assert [position_budget(16, t) for t in range(6)] == [16, 16, 2, 2, 1, 1]
    assert [position_budget(40, t) for t in range(5)] == [40, 40, 6, 5, 4]


def test_shortlist_head_scores_only_its_clusters(tiny_head):
    labels = torch.arange(tiny_head.weight.shape[0]) % 10
    always = torch.tensor([0, 7])
    head = ShortlistHead(tiny_head.weight, tiny_head.bias, labels, always)
    head.choose([3, 4])
    full = FullHead(tiny_head.weight, tiny_head.bias).logits(tiny_head.hidden)
    logits = head.logits(tiny_head.hidden)
    inside = torch.isin(labels, torch.tensor([3, 4])) | torch.isin(torch.arange(len(labels)), always)
    assert head.size == int(inside.sum())
    assert torch.allclose(logits[:, inside], full[:, inside], atol=1e-4)
    assert torch.isinf(logits[:, ~inside]).all()
    best = head.select(tiny_head.hidden, SamplingParams())
    assert torch.equal(best, torch.where(inside, full, float("-inf")).argmax(1))
    assert head.stats.recomputed_fraction == pytest.approx(head.size / len(labels))


def test_shortlist_head_context_adds_the_sequence_tokens(tiny_head):
    V = tiny_head.weight.shape[0]
    labels = torch.arange(V) % 10
    head = ShortlistHead(tiny_head.weight, tiny_head.bias, labels, torch.tensor([0]), context=True)
    head.choose([3])
    in_cluster = int(torch.nonzero(labels == 3)[0])
    others = [int(t) for t in torch.nonzero(labels != 3).squeeze(1) if t != 0][:40]  # past the first buffer size
    head.add_context([others[0], in_cluster, others[0]])
    head.add_context(others)
    inside = (labels == 3) | (torch.arange(V) == 0) | torch.isin(torch.arange(V), torch.tensor(others))
    assert head.size == int(inside.sum())  # the in-cluster and repeated tokens count once
    full = FullHead(tiny_head.weight, tiny_head.bias).logits(tiny_head.hidden)
    logits = head.logits(tiny_head.hidden)
    assert torch.allclose(logits[:, inside], full[:, inside], atol=1e-4)
    assert torch.isinf(logits[:, ~inside]).all()
    assert torch.equal(head.select(tiny_head.hidden, SamplingParams()), torch.where(inside, full, float("-inf")).argmax(1))
    head.choose([4])  # the context stays across steps, the token of cluster 3 included
    context = torch.isin(torch.arange(V), torch.tensor(others + [in_cluster]))
    assert head.size == int(((labels == 4) | (torch.arange(V) == 0) | context).sum())
    head.clear_context()
    assert head.size == int(((labels == 4) | (torch.arange(V) == 0)).sum())
    static = ShortlistHead.static(tiny_head.weight, tiny_head.bias, torch.tensor([1, 2]))
    static.add_context(others)  # context=False: ignored
    assert static.size == 2


def test_verification_repairs_a_shortlisted_q():
    """Whatever shortlist q is confined to, modified rejection sampling returns tokens distributed as p."""
    gen = torch.Generator().manual_seed(0)
    V, k, n = 12, 2, 20_000
    p = warp(torch.randn(k + 1, V, generator=gen) * 2, SamplingParams(temperature=1.0))  # [k + 1, V]
    logits = torch.randn(k, V, generator=gen) * 2
    logits[:, 6:] = float("-inf")  # q is zero outside a shortlist of 6 tokens, p is not
    q = warp(logits, SamplingParams(temperature=1.0))  # [k, V]
    counts = torch.zeros(V)
    for _ in range(n):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(k)])
        counts[verify_exact(p, q, draft, gen).tokens[0]] += 1
    tv = 0.5 * (counts / n - p[0]).abs().sum()
    # The sampling error of an empirical distribution on 12 outcomes at n = 20k is ~0.01 in TV.
    assert tv < 0.03
    assert 0.5 * (q[0] - p[0]).abs().sum() > 0.1  # q itself is far from p


def test_multilabel_positives_and_loss():
    labels = torch.tensor([0, 0, 1, 2, 3])  # cluster per token
    top_ids = torch.tensor([[2, 0, 4], [4, 3, 1]])
    top_probs = torch.tensor([[0.5, 0.3, 0.01], [0.02, 0.9, 0.08]])
    positives = positive_clusters(labels, top_ids, top_probs)
    assert positives.tolist() == [[1, 0, -1], [3, 2, 0]]  # the top-1's cluster is kept at any probability
    scores = torch.full((2, 4), -20.0)
    scores[0, [0, 1]] = scores[1, [0, 2, 3]] = 20.0
    assert router_loss("multilabel", scores, positives) < 1e-6
    assert router_loss("ce", scores, positives) > router_loss("ce", scores.index_fill(1, torch.tensor([1, 3]), 40.0), positives)
    with pytest.raises(ValueError, match="ce or multilabel"):
        router_loss("focal", scores, positives)


def test_sharegpt_bench_prompts_are_held_out_of_router_training():
    """Bench prompts come from held-out conversations; prep traces trains only on the other splits."""
    from itertools import islice

    from runtime.text.data import sharegpt_conversations, sharegpt_prompts

    prompts = sharegpt_prompts(4)
    firsts = {}
    for index, conversation in enumerate(islice(sharegpt_conversations(), 400)):
        turn = next((t for t in conversation["conversations"] if t.get("from") == "human"), None)
        if turn and isinstance(turn.get("value"), str):
            firsts.setdefault(turn["value"].strip(), index)
    assert all(split_of("sharegpt", firsts[p]) == "heldout" for p in prompts)


def test_a_corpus_files_splits_follow_its_texts_not_its_path(tmp_path):
    """The same texts, in another file and another order, land in the same splits (a path-keyed hash
    moved them, so a copied corpus trained on other texts)."""
    import json

    from prep.traces import corpus_texts, plan_shards

    class WordTokenizer:  # one id per word; plan_shards needs only this much
        bos_token = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [len(word) for word in text.split()]}

    texts = [f"text number {i} with a few words" for i in range(200)]
    splits = {}
    for name, order in (("a.json", texts), ("elsewhere/b.json", texts[::-1])):
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps([{"text": t} for t in order]))
        plans = plan_shards(corpus_texts(str(path), WordTokenizer()), WordTokenizer(), str(path), max_tokens=10**6,
                            shard_tokens=10**6, max_tokens_per_text=512)
        splits[name] = {order[d]: s for plan in plans for d, s in zip(plan.docs, plan.splits)}
    assert splits["a.json"] == splits["elsewhere/b.json"]
    assert {"train", "validation", "heldout"} == set(splits["a.json"].values())
