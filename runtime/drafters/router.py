"""DynaSpec router: a small MLP that scores M token clusters from the current input
token's embedding E(x_t) and the previous position's hidden state h_{t-1}.

It needs nothing the drafter computes at step t, so it can run beside the drafter's forward; the
union of its top-k clusters (plus the always-kept ids: EOS and special tokens) is the drafter
head's shortlist for the token after x_t. The module lives here so prep's LightningModule can
wrap it and the runtime can run it without Lightning; the runtime runs the exported ONNX graph
through ONNX Runtime by default, or this module on request.

Stage `router` tensors: `router.*` (this module's state dict), `cluster_labels` [V],
`always_ids` [n], `token_counts` [V] (next-token frequencies in the training traces: the FR-Spec
baseline's static list).
"""

from __future__ import annotations

import io
import warnings

import torch
from torch import nn

ONNX_FILE = "router.onnx"
HEAD_ROUTER_ONNX_FILE = "drafter_router.onnx"  # stage drafter_router's: DynaSpec's router on the draft head
PREFIX = "router."
ENGINES = ("onnx", "torch")  # what runs the router (not a model backend)


class Router(nn.Module):
    """[E(x_t); h_{t-1}] -> M cluster scores; each input is layer-normed first (h has norm ~150)."""

    def __init__(self, embed_dim: int, hidden_dim: int, clusters: int, width: int = 512) -> None:
        super().__init__()
        self.embed_norm = nn.LayerNorm(embed_dim, elementwise_affine=False)
        self.hidden_norm = nn.LayerNorm(hidden_dim, elementwise_affine=False)
        self.net = nn.Sequential(nn.Linear(embed_dim + hidden_dim, width), nn.SiLU(), nn.Linear(width, clusters))

    def forward(self, embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [B, M] for embeddings [B, d_e] and previous hidden states [B, d_h]."""
        return self.net(torch.cat([self.embed_norm(embedding), self.hidden_norm(hidden)], dim=-1))

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor]) -> "Router":
        """Rebuild from stage tensors (the `router.` keys); shapes give the sizes."""
        state = {k.removeprefix(PREFIX): v for k, v in tensors.items() if k.startswith(PREFIX)}
        first, last = state["net.0.weight"], state["net.2.weight"]  # [width, d_e + d_h], [M, width]
        embed_dim = int(tensors["embed_dim"])
        router = cls(embed_dim, first.shape[1] - embed_dim, last.shape[0], first.shape[0])
        router.load_state_dict(state)
        return router.eval()

    def stage_tensors(self) -> dict[str, torch.Tensor]:
        """This module's weights as stage tensors."""
        tensors = {PREFIX + k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        tensors["embed_dim"] = torch.tensor([self.embed_norm.normalized_shape[0]])
        return tensors


def onnx_bytes(router: Router) -> bytes:
    """The router as an ONNX graph with a dynamic batch axis (inputs `embedding`, `hidden`)."""
    embed_dim = router.embed_norm.normalized_shape[0]
    hidden_dim = router.hidden_norm.normalized_shape[0]
    example = (torch.zeros(1, embed_dim), torch.zeros(1, hidden_dim))
    # The TorchScript exporter: the torch.export one needs onnxscript, which is not a dependency,
    # and a two-layer MLP needs nothing it adds. It warns that it is deprecated; that is known.
    graph = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            router.eval(), example, graph, input_names=["embedding", "hidden"], output_names=["scores"],
            dynamic_axes={"embedding": {0: "batch"}, "hidden": {0: "batch"}, "scores": {0: "batch"}},
            opset_version=17, dynamo=False,
        )
    return graph.getvalue()


class RouterRunner:
    """Cluster scores from the `router` stage, through ONNX Runtime ("onnx") or torch ("torch")."""

    def __init__(self, tensors: dict[str, torch.Tensor], onnx_path: str | None, engine: str = "onnx", threads: int = 1):
        if engine not in ENGINES:
            raise ValueError(f"unknown router engine {engine!r}; use router={' or router='.join(ENGINES)}")
        self.engine = engine
        self.module = Router.from_state(tensors)
        self.session = None
        if engine == "onnx":
            if onnx_path is None:
                raise ValueError("the onnx router engine needs router.onnx; rerun prep train-router")
            import onnxruntime

            options = onnxruntime.SessionOptions()
            # A 2-layer MLP: one thread, so it does not compete with the drafter's forward.
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            self.session = onnxruntime.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])

    @torch.inference_mode()
    def scores(self, embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [B, M] for embeddings [B, d_e] and previous hidden states [B, d_h] (float32)."""
        embedding, hidden = embedding.float(), hidden.float()
        if self.session is None:
            return self.module(embedding, hidden)
        feeds = {"embedding": embedding.numpy(), "hidden": hidden.numpy()}
        return torch.from_numpy(self.session.run(["scores"], feeds)[0])


def position_budget(k_max: int, t: int) -> int:
    """DynaSpec's position-aware cluster budget: k_max at draft positions 0 and 1, then
    floor(k_max / (2 (t + 1))), at least one cluster."""
    return k_max if t <= 1 else max(1, k_max // (2 * (t + 1)))


def fixed_budget(k_max: int, t: int) -> int:
    """The same k_max clusters at every draft position."""
    return k_max


SCHEDULES = {"fixed": fixed_budget, "position": position_budget}
