"""Stage `gp`: per-layer orthonormal bases of the inputs of the target's linears (the GP paper).

For every group of linears that reads one input (runtime.drafters.gp.GROUPS), an ordered basis
B [in, r]: its first k columns are the best rank-k choice by the basis' own criterion, so one
stage serves every rank up to r.

- `weights` (calibration-free, the GP paper): the top right singular vectors of the group's weights
  stacked row-wise, i.e. the input directions the weights amplify most.
- `activations` (activation-aware): the top eigenvectors of E[x xᵀ] over real inputs of the group,
  collected with forward pre-hooks while the target runs over trace texts; the uncentred second
  moment because the drafter projects x itself, not x minus its mean.

Each basis is stored with its spectrum (`<key>.energy`: squared singular values or eigenvalues,
all of them, in order) so that the retained energy at any rank can be reported.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from prep.trace_files import complete_shards, shard_tensors, traces_of
from runtime.drafters.gp import ATTENTION_GROUPS, GROUPS, MLP_GROUPS, basis_key, group_linears

REPORT_RANKS = (64, 128, 256)  # plus d/2 and the stage's rank: the ranks whose retained energy the params record


def top_eigenvectors(gram: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `rank` leading eigenvectors [in, r] (float32) of a symmetric float64 matrix, and all its eigenvalues, descending."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram)  # ascending
    order = torch.argsort(eigenvalues, descending=True)
    return eigenvectors[:, order[:rank]].float().contiguous(), eigenvalues[order].clamp(min=0).float()


def weight_bases(body: torch.nn.Module, groups: tuple[str, ...], rank: int, progress: bool = True) -> dict[str, torch.Tensor]:
    """Calibration-free bases: B = top right singular vectors of [W_1; W_2; ...] for each group."""
    tensors = {}
    for index, layer in enumerate(tqdm(body.layers, desc="gp bases (weights)", unit="layer", disable=not progress)):
        for group in groups:
            stacked = torch.cat([linear.weight.detach().double() for linear in group_linears(layer, group)])  # [out, in]
            # Right singular vectors = eigenvectors of WᵀW [in, in]: one small eigh instead of an SVD.
            # Directions beyond the weights' row space (out < in) are their null space: W B is 0
            # there, so fewer than `rank` columns are already exact and nothing more is stored.
            kept = min(rank, *stacked.shape)
            basis, energy = top_eigenvectors(stacked.T @ stacked, kept)
            tensors[basis_key("weights", index, group)] = basis  # [in, r]
            tensors[basis_key("weights", index, group) + ".energy"] = energy[: min(stacked.shape)]
    return tensors


def check_rank(rank: int, hidden_size: int) -> int:
    """`rank` if a basis can have it (1 to the hidden size); ValueError naming the limit otherwise."""
    if not 1 <= rank <= hidden_size:
        raise ValueError(f"--rank must be between 1 and the hidden size {hidden_size}, got {rank}")
    return rank


def trace_texts(traces_dir: str | Path, model_name: str, vocab_size: int, max_tokens: int) -> list[torch.Tensor]:
    """The token ids of the traces' texts [T_i], in order, until `max_tokens` tokens."""
    texts, total = [], 0
    for entry in complete_shards(traces_of(traces_dir, model_name, vocab_size)):
        if total >= max_tokens:
            break
        shard = shard_tensors(traces_dir, entry, ["input_ids", "doc"])
        ids, doc = shard["input_ids"].long(), shard["doc"]
        starts = torch.cat([torch.tensor([0]), torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1, torch.tensor([len(doc)])])
        for start, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
            if total >= max_tokens:
                break
            texts.append(ids[start : min(end, start + max_tokens - total)])
            total += len(texts[-1])
    if not texts:
        raise ValueError(f"{traces_dir} has no complete shard; rerun prep traces to finish it")
    return texts


@torch.inference_mode()
def input_moments(body: torch.nn.Module, groups: tuple[str, ...], texts: list[torch.Tensor], progress: bool = True) -> dict[tuple[int, str], torch.Tensor]:
    """Sum of x xᵀ (float64 [in, in]) over every real input x of each (layer, group)."""
    moments: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []

    def accumulate(key):
        def hook(_module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # [T, in]
            moments[key] = moments.get(key, 0) + x.T @ x
        return hook

    for index, layer in enumerate(body.layers):
        for group in groups:
            # Every linear of a group reads the same x: hook the first one only.
            hooks.append(group_linears(layer, group)[0].register_forward_pre_hook(accumulate((index, group))))
    try:
        with tqdm(total=sum(len(t) for t in texts), desc="gp bases (layer inputs)", unit="tok", disable=not progress) as bar:
            for ids in texts:
                body(input_ids=ids.view(1, -1), use_cache=False)
                bar.update(len(ids))
    finally:
        for hook in hooks:
            hook.remove()
    return moments


def activation_bases(body: torch.nn.Module, groups: tuple[str, ...], rank: int, texts: list[torch.Tensor],
                     progress: bool = True) -> dict[str, torch.Tensor]:
    """Activation-aware bases: B = top eigenvectors of the inputs' second moment, per (layer, group)."""
    tensors = {}
    tokens = sum(len(t) for t in texts)
    for (index, group), moment in input_moments(body, groups, texts, progress).items():
        basis, energy = top_eigenvectors(moment / tokens, rank)
        tensors[basis_key("activations", index, group)] = basis  # [in, r]
        tensors[basis_key("activations", index, group) + ".energy"] = energy
    return tensors


def retained_energy(tensors: dict[str, torch.Tensor], kind: str, groups: tuple[str, ...], layers: int,
                    ranks: list[int]) -> dict[str, dict[str, float]]:
    """Mean over layers of the spectrum's fraction kept by the first k directions, per group and rank."""
    table = {}
    for group in groups:
        spectra = [tensors[basis_key(kind, i, group) + ".energy"].double() for i in range(layers)]
        table[group] = {str(k): round(float(sum(s[:k].sum() / s.sum() for s in spectra) / layers), 4) for k in ranks}
    return table


def build_gp_basis(body: torch.nn.Module, rank: int, mlp: bool = False, texts: list[torch.Tensor] | None = None,
                   progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and params of stage `gp`: weights bases always, activation bases when `texts` are given."""
    check_rank(rank, body.config.hidden_size)
    started = time.perf_counter()
    groups = ATTENTION_GROUPS + (MLP_GROUPS if mlp else ())
    tensors = weight_bases(body, groups, rank, progress)
    kinds = ["weights"]
    if texts is not None:
        tensors.update(activation_bases(body, groups, rank, texts, progress))
        kinds.append("activations")
    layers = len(body.layers)
    hidden = body.config.hidden_size
    ranks = sorted({k for k in (*REPORT_RANKS, hidden // 2) if k <= rank} | {rank})
    params = {
        "max_rank": rank,
        "kinds": kinds,
        "groups": list(groups),
        "linears": {group: list(GROUPS[group]) for group in groups},
        "layers": layers,
        "trace_tokens": sum(len(t) for t in texts) if texts is not None else 0,
        "retained_energy": {kind: retained_energy(tensors, kind, groups, layers, ranks) for kind in kinds},
        "seconds": round(time.perf_counter() - started, 1),
    }
    return tensors, params
