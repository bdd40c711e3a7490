"""`prep bake-onedecode`: the OneDecode table (the GP paper's section 8) from the target's own predictions.

Built from traces (prep/traces.py), not from corpus text: at every training position the key is the
input token (level `single`) or the input token and the one before it in the same text (level
`pair`), and the value is what the target itself predicted there, its top TOP_TOKENS tokens with
their probabilities. A candidate's confidence is its mean target probability over the key's
occurrences, counting 0 where it was outside the stored top tokens (so a slight underestimate).
Keys: the `v_bake` most frequent single tokens, and the most frequent token pairs seen at least
`min_pair_count` times (at most `max_pairs`). The held-out split measures the table: hit rate
(a key is found) and top-1 agreement (its best candidate is the target's greedy token).
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from runtime.drafters.onedecode import FIELDS, LEVELS, PAIR, SINGLE, tensor_name
from runtime.text.data import SPLITS

TRACE_KEYS = ["input_ids", "position", "top_ids", "top_probs", "split"]


def previous_tokens(input_ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The token before each position in the same text, -1 at a text's first position: [N]."""
    prev = torch.cat([torch.tensor([-1]), input_ids[:-1]])  # [N]
    return torch.where(position > 0, prev, torch.full_like(prev, -1))


def pair_codes(prev: torch.Tensor, last: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One int64 per two-token key (prev * V + last), -1 where there is no previous token: [N]."""
    return torch.where(prev >= 0, prev * vocab_size + last, torch.full_like(last, -1))


def frequent_keys(codes: torch.Tensor, limit: int, min_count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The `limit` most frequent codes >= 0 seen at least min_count times (ties: smaller code first),
    sorted ascending, and their counts: ([n], [n])."""
    uniq, counts = torch.unique(codes[codes >= 0], return_counts=True)  # ascending
    order = torch.argsort(-counts, stable=True)[:limit]
    order = order[counts[order] >= min_count]
    keep = order.sort().values
    return uniq[keep], counts[keep]


def key_index(codes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Row of each code in the sorted `keys`, -1 where it is not baked: [N]."""
    if keys.numel() == 0:
        return torch.full_like(codes, -1)
    at = torch.searchsorted(keys, codes).clamp_(max=keys.numel() - 1)
    return torch.where((keys[at] == codes) & (codes >= 0), at, torch.full_like(at, -1))


def candidates(rows: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor, n_keys: int, top_k: int,
               vocab_size: int) -> dict[str, torch.Tensor]:
    """Per key, the top_k next tokens by mean target probability over the key's occurrences.

    rows: [N] key row per position (-1: not a key); top_ids, top_probs: [N, T] the target's top T.
    Returns tokens [n_keys, top_k] (-1 padding), confidence, hits and count (see runtime's FIELDS).
    """
    sel = rows >= 0
    rows, ids, probs = rows[sel], top_ids[sel].long(), top_probs[sel].float()  # [n], [n, T], [n, T]
    count = torch.bincount(rows, minlength=n_keys)  # [n_keys]
    width = ids.shape[1]
    pairs = rows.repeat_interleave(width) * vocab_size + ids.flatten()  # [n * T] (key row, token)
    uniq, inverse = torch.unique(pairs, return_inverse=True)  # ascending: by key, then token
    mass = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, probs.flatten().double())
    first = (torch.arange(pairs.numel()) % width == 0).double()  # the target's top-1 column
    hits = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, first)
    key, token = uniq // vocab_size, uniq % vocab_size
    conf = mass / count[key].double()
    # Best first within a key: sort by confidence (stable: ties keep the smaller token), then by key.
    order = torch.sort(conf, descending=True, stable=True).indices
    order = order[torch.sort(key[order], stable=True).indices]
    key_sorted = key[order]
    rank = torch.arange(order.numel()) - torch.searchsorted(key_sorted, key_sorted)
    keep = rank < top_k
    slot = (key_sorted[keep], rank[keep])
    out = {
        "tokens": torch.full((n_keys, top_k), -1, dtype=torch.long),
        "confidence": torch.zeros(n_keys, top_k, dtype=torch.float32),
        "hits": torch.zeros(n_keys, top_k, dtype=torch.int32),
        "count": count.to(torch.int32),
    }
    out["tokens"][slot] = token[order][keep]
    out["confidence"][slot] = conf[order][keep].float()
    out["hits"][slot] = hits[order][keep].round().to(torch.int32)
    return out


def build_table(traces: dict[str, torch.Tensor], vocab_size: int, v_bake: int = 2048, top_k: int = 8,
                min_pair_count: int = 8, max_pairs: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Stage `onedecode`'s tensors from the training split of traces (TRACE_KEYS), and its params."""
    if v_bake < 1 or not 1 <= top_k <= traces["top_ids"].shape[1] or min_pair_count < 1:
        raise ValueError(f"need --v-bake >= 1, 1 <= --top-k <= {traces['top_ids'].shape[1]} (the traces' top tokens) "
                         "and a min pair count >= 1")
    max_pairs = 4 * v_bake if max_pairs is None else max_pairs
    train = traces["split"] == SPLITS.index("train")
    last = traces["input_ids"].long()
    codes = {SINGLE: last, PAIR: pair_codes(previous_tokens(last, traces["position"].long()), last, vocab_size)}
    limits = {SINGLE: (v_bake, 1), PAIR: (max_pairs, min_pair_count)}
    tensors: dict[str, torch.Tensor] = {}
    for level in LEVELS:
        keys, _ = frequent_keys(codes[level][train], *limits[level])
        rows = key_index(codes[level][train], keys)
        values = candidates(rows, traces["top_ids"][train], traces["top_probs"][train], keys.numel(), top_k, vocab_size)
        values["keys"] = torch.stack([keys // vocab_size, keys % vocab_size], dim=1) if level == PAIR else keys
        tensors.update({tensor_name(level, f): values[f] for f in FIELDS})
    params = {"v_bake": v_bake, "top_k": top_k, "min_pair_count": min_pair_count, "max_pairs": max_pairs,
              "single_keys": int(tensors[tensor_name(SINGLE, "keys")].shape[0]),
              "pair_keys": int(tensors[tensor_name(PAIR, "keys")].shape[0]),
              "train_positions": int(train.sum())}
    return tensors, params


def evaluate(tensors: dict[str, torch.Tensor], traces: dict[str, torch.Tensor], vocab_size: int,
             split: str = "heldout") -> dict:
    """Hit rate and top-1 agreement of the table on one split of the traces.

    hit_rate: share of positions whose key (pair first, then single) is baked; top1_agreement: share
    of hits whose best candidate is the target's top-1; topk_recall: share of hits whose candidates
    hold it; pair_share: share of hits found by the two-token key.
    """
    sel = traces["split"] == SPLITS.index(split)
    last = traces["input_ids"].long()[sel]
    prev = previous_tokens(traces["input_ids"].long(), traces["position"].long())[sel]
    top1 = traces["top_ids"][sel][:, 0].long()  # [n]
    pair_keys = tensors[tensor_name(PAIR, "keys")]
    pair_row = key_index(pair_codes(prev, last, vocab_size), pair_keys[:, 0] * vocab_size + pair_keys[:, 1])
    single_row = key_index(last, tensors[tensor_name(SINGLE, "keys")])
    found_pair, found = pair_row >= 0, (pair_row >= 0) | (single_row >= 0)
    cands = torch.where(found_pair[:, None], padded(tensors[tensor_name(PAIR, "tokens")])[pair_row],
                        padded(tensors[tensor_name(SINGLE, "tokens")])[single_row])[found]  # [hits, K]
    hits = int(found.sum())
    agree = int((cands[:, 0] == top1[found]).sum())
    recall = int((cands == top1[found][:, None]).any(dim=1).sum())
    ratio = lambda a, b: round(a / b, 4) if b else 0.0  # noqa: E731
    return {"split": split, "positions": int(sel.sum()), "hit_rate": ratio(hits, int(sel.sum())),
            "top1_agreement": ratio(agree, hits), "topk_recall": ratio(recall, hits),
            "pair_share": ratio(int(found_pair.sum()), hits)}


def padded(tokens: torch.Tensor) -> torch.Tensor:
    """tokens [n, K] plus a last row of -1, which row index -1 (not baked) then selects: [n + 1, K]."""
    return torch.cat([tokens, torch.full((1, tokens.shape[1]), -1, dtype=tokens.dtype)])


def bake(traces_dir: str, model_name: str, vocab_size: int, v_bake: int, top_k: int, min_pair_count: int,
         progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Load traces, build the table, measure it on the held-out split: (tensors, params)."""
    from prep.trace_files import load_traces, require_split, traces_of

    traces_of(traces_dir, model_name, vocab_size)
    with tqdm(total=3, desc="onedecode", unit="step", disable=not progress, file=sys.stderr) as bar:
        bar.set_postfix_str("loading traces")
        index, traces = load_traces(traces_dir, TRACE_KEYS)
        require_split(traces_dir, traces["split"], "train")  # else a table of no keys
        bar.update()
        bar.set_postfix_str("building")
        tensors, params = build_table(traces, vocab_size, v_bake, top_k, min_pair_count)
        bar.update()
        bar.set_postfix_str("held-out check")
        params["heldout"] = evaluate(tensors, traces, vocab_size)
        params.update(traces=str(traces_dir), traces_model=index.get("model"), traces_corpus=index.get("corpus"))
        bar.update()
    return tensors, params
