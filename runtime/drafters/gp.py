"""GP self-drafter (the GP paper's geodesic projection): a copy of the target whose linears are low rank.

Per decoder layer, every group of linears that reads the same input x (q/k/v; o; gate/up; down)
shares an orthonormal basis B [in, r] stored in stage `gp`, ordered so that its first k columns
are the rank-k basis. The drafter's copy computes W x ~ (W B_k)(B_kᵀ x) + b with W B_k
precomputed and B_kᵀ x computed once per group; every other weight (embeddings, norms, head) is
the target's own. Bases come from the weights alone (kind `weights`: right singular vectors of
the stacked weights) or from real layer inputs (kind `activations`: principal directions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from artifacts import Artifact
from artifacts.format import Stage
from runtime.backends.layers import Projection
from runtime.backends.target import DecoderTarget
from runtime.common.checks import is_digits
from runtime.drafters.layers import BackendDrafter
from runtime.drafters.arguments import need_artifact
from runtime.drafters.registry import DraftContext

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


class LowRankProjection:
    """A projection y = x Wᵀ + b restricted to a basis B [in, k] of its inputs: (x B)(W B)ᵀ + b."""

    def __init__(self, original, basis: torch.Tensor) -> None:
        weight = original.dense()  # [out, in]
        basis = basis.to(weight)
        self.project = Projection(basis.T.contiguous())  # [k, in]
        self.expand = Projection((weight @ basis).contiguous(), original.bias)  # [out, k]
        self.bias = original.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.expand(self.project(x))  # [T, out]

    def dense(self) -> torch.Tensor:
        return self.expand.weight @ self.project.weight


def low_rank_copy(target: DecoderTarget, bases: dict[tuple[int, str], torch.Tensor]) -> DecoderTarget:
    """The target over a decoder whose grouped projections are low rank (embeddings, norms, rotary shared).

    The ladder fuses q/k/v and gate/up into one projection each, so one basis per group is one
    LowRankProjection (the groups' names are the ladder's projection names).
    """
    def transform(name: str, index: int, projection):
        basis = bases.get((index, name))
        return projection if basis is None else LowRankProjection(projection, basis)

    return target.with_decoder(target.decoder.map_projections(transform))


class GPDrafter(BackendDrafter):
    """Drafts with the GP-compressed copy of the target + final norm + its own head, with its own KV cache."""

    def __init__(self, target, stage: GPStage, rank: int, kind: str, head) -> None:
        if not isinstance(target, DecoderTarget):
            raise ValueError("the GP drafter runs on the lean or native backend; use --backend auto, lean or native")
        super().__init__(low_rank_copy(target, stage.bases(rank, kind)), head)


@dataclass(frozen=True)
class GPOptions:
    """gp:RANK[:act]: the rank of every basis, and which bases (KINDS: weights, or act for the activation-aware ones)."""

    rank: int
    basis: str = "weights"

    @classmethod
    def parse(cls, args: list[str]) -> GPOptions:
        if not args or not is_digits(args[0]) or int(args[0]) < 1 or len(args) > 2 or (len(args) == 2 and args[1] not in KINDS):
            raise ValueError(f"bad GP drafter 'gp:{':'.join(args)}'; use {GP_HELP}, e.g. gp:256 or gp:256:act")
        return cls(int(args[0]), *args[1:])

    def format(self) -> tuple[str, ...]:
        return (str(self.rank),) + ((self.basis,) if self.basis != "weights" else ())

    def build(self, context: DraftContext) -> GPDrafter:
        stage = GPStage.load(need_artifact(context, "gp"))
        return GPDrafter(context.target, stage, self.rank, KINDS[self.basis], context.head)
