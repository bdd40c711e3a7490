"""GP self-drafter (seed 002's geodesic projection): a copy of the target whose linears are low rank.

Per decoder layer, every group of linears that reads the same input x (q/k/v; o; gate/up; down)
shares an orthonormal basis B [in, r] stored in stage `gp`, ordered so that its first k columns
are the rank-k basis. The drafter's copy computes W x ~ (W B_k)(B_kᵀ x) + b with W B_k
precomputed and B_kᵀ x computed once per group; every other weight (embeddings, norms, head) is
the target's own. Bases come from the weights alone (kind `weights`: right singular vectors of
the stacked weights) or from real layer inputs (kind `activations`: principal directions).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from artifacts import Artifact
from artifacts.format import Stage
from runtime.drafters.layers import BackendDrafter, shallow_copy
from runtime.lean import LeanTarget, Projection
from runtime.target import TorchTarget

# Linears that read the same input, by their path inside a decoder layer (llama, qwen2, gemma3).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
ATTENTION_GROUPS, MLP_GROUPS = ("qkv", "o"), ("gate_up", "down")
KINDS = {"weights": "weights", "act": "activations"}  # spec suffix -> stage kind
GP_HELP = "gp:RANK[:act] (the GP low-rank copy; :act for the activation-aware basis)"


def basis_key(kind: str, layer: int, group: str) -> str:
    """Name of a basis tensor [in, r] in stage `gp`; `<key>.energy` holds its spectrum [r']."""
    return f"{kind}.{layer}.{group}"


def group_linears(layer: torch.nn.Module, group: str) -> list[torch.nn.Linear]:
    """The nn.Linear modules of one group in a decoder layer."""
    return [layer.get_submodule(path) for path in GROUPS[group]]


class SharedProjection(torch.nn.Module):
    """Bᵀ x [.., k], computed once per input tensor for all the linears of a group.

    q, k and v (and gate, up) are called one after the other on the same tensor object, so the
    last input and its projection are kept and reused when the same object comes again; holding
    the reference also keeps its id from being reused by another tensor.
    """

    def __init__(self, basis: torch.Tensor) -> None:
        super().__init__()
        self.basis_t = basis.T.contiguous()  # [k, in]
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.last is None or self.last[0] is not x:
            self.last = (x, torch.nn.functional.linear(x, self.basis_t))
        return self.last[1]


class LowRankLinear(torch.nn.Module):
    """y = (W B)(Bᵀ x) + b: an nn.Linear restricted to the span of a basis B of its inputs."""

    def __init__(self, linear: torch.nn.Linear, projection: SharedProjection) -> None:
        super().__init__()
        self.projection = projection
        basis_t = projection.basis_t  # [k, in]
        self.weight = torch.nn.Parameter(linear.weight.detach() @ basis_t.T, requires_grad=False)  # [out, k]
        self.bias = linear.bias  # the target's own, shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.projection(x), self.weight, self.bias)


def compressed_decoder(body: torch.nn.Module, bases: dict[tuple[int, str], torch.Tensor]) -> torch.nn.Module:
    """A copy of a transformers decoder whose grouped linears are low rank; bases[(layer, group)]: B [in, k].

    The copy shares every weight it does not compress with `body`, and `body` is left unchanged.
    """
    clone = shallow_copy(body)
    layers = []
    for index, layer in enumerate(body.layers):
        layer = shallow_copy(layer)
        parents: dict[str, torch.nn.Module] = {}  # copied submodules (self_attn, mlp) of this layer
        for group in GROUPS:
            basis = bases.get((index, group))
            if basis is None:
                continue
            linears = group_linears(layer, group)
            projection = SharedProjection(basis.to(linears[0].weight))
            for path, linear in zip(GROUPS[group], linears):
                parent_name, name = path.split(".")
                if parent_name not in parents:
                    parents[parent_name] = shallow_copy(getattr(layer, parent_name))
                    setattr(layer, parent_name, parents[parent_name])
                setattr(parents[parent_name], name, LowRankLinear(linear, projection))
        layers.append(layer)
    clone.layers = torch.nn.ModuleList(layers)
    return clone


def parse_gp(args: list[str]) -> tuple[int, str]:
    """['RANK'] or ['RANK', 'act'|'weights'] (a spec after 'gp:') -> (rank, stage kind)."""
    if not args or not args[0].isdigit() or int(args[0]) < 1 or len(args) > 2 or (len(args) == 2 and args[1] not in KINDS):
        raise ValueError(f"bad GP drafter 'gp:{':'.join(args)}'; use {GP_HELP}, e.g. gp:256 or gp:256:act")
    return int(args[0]), KINDS[args[1] if len(args) == 2 else "weights"]


@dataclass
class GPStage:
    """The `gp` stage of an artifact: ordered bases per (kind, layer, group), up to params['max_rank'] columns."""

    tensors: dict[str, torch.Tensor]
    params: dict

    @classmethod
    def load(cls, artifact: Artifact) -> "GPStage":
        return cls(artifact.read_stage(Stage.GP), artifact.stage_params(Stage.GP))

    def bases(self, rank: int, kind: str = "weights") -> dict[tuple[int, str], torch.Tensor]:
        """The first `rank` columns of every stored basis of `kind` (all of them where fewer are stored)."""
        if kind not in self.params["kinds"]:
            raise ValueError(f"stage gp holds no {kind} bases (it has {', '.join(self.params['kinds'])}); rerun: "
                             "prep gp-basis ART --traces TR --force  (TR from: prep traces MODEL -o TR)")
        if rank > self.params["max_rank"]:
            raise ValueError(f"stage gp stores bases up to rank {self.params['max_rank']}, not {rank}; use a smaller "
                             f"rank or rerun: prep gp-basis ART --rank {rank} --force")
        # A stored basis narrower than max_rank spans every direction its linears can see (the
        # weights' row space, or all inputs): its first `rank` columns are then exact for them.
        return {
            (layer, group): self.tensors[basis_key(kind, layer, group)][:, :rank]
            for layer in range(self.params["layers"])
            for group in self.params["groups"]
        }

    def decoder(self, target: TorchTarget, rank: int, kind: str = "weights") -> torch.nn.Module:
        return compressed_decoder(target.body, self.bases(rank, kind))


class LowRankProjection:
    """The lean backend's y = x Wᵀ + b restricted to a basis B [in, k] of its inputs: (x B)(W B)ᵀ + b."""

    def __init__(self, dense: Projection, basis: torch.Tensor) -> None:
        basis = basis.to(dense.weight)
        self.project = Projection(basis.T.contiguous())  # [k, in]
        self.expand = Projection((dense.weight @ basis).contiguous(), dense.bias)  # [out, k]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(self.project(x))  # [T, out]


def lean_compressed(target: LeanTarget, bases: dict[tuple[int, str], torch.Tensor]) -> LeanTarget:
    """A LeanTarget sharing the target's embeddings, norms and rotary tables, with low-rank projections.

    The lean layers fuse q/k/v and gate/up into one projection each, so one basis per group is one
    LowRankProjection (the groups' names are the lean layers' field names).
    """
    clone = copy.copy(target)
    clone.layers = [
        dataclasses.replace(layer, **{group: LowRankProjection(getattr(layer, group), bases[(index, group)])
                                      for group in GROUPS if (index, group) in bases})
        for index, layer in enumerate(target.layers)
    ]
    return clone


def compressed_backend(target: TorchTarget, bases: dict[tuple[int, str], torch.Tensor]) -> TorchTarget:
    """The GP copy of the target as a backend of the same kind: lean for a lean target, else transformers."""
    if isinstance(target, LeanTarget):
        return lean_compressed(target, bases)
    return compressed_target(target, compressed_decoder(target.body, bases))


class GPDrafter(BackendDrafter):
    """Drafts with the GP-compressed copy of the target + final norm + its own head, with its own KV cache."""

    def __init__(self, target: TorchTarget, stage: GPStage, rank: int, kind: str, head) -> None:
        self.backend = compressed_backend(target, stage.bases(rank, kind))
        super().__init__(target.body, head)


def compressed_target(target: TorchTarget, body: torch.nn.Module) -> TorchTarget:
    """A transformers backend over the target's model running `body` (the GP copy of its decoder).

    Always the transformers backend: a lean target runs its own fused copies of the weights, not `body`.
    """
    alone = TorchTarget(target.model, target.eos_token_ids)  # same head, EOS ids and cache layout
    alone.body = body
    return alone
