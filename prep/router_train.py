"""`prep train-router`: train the DynaSpec router (runtime.drafters.router.Router) with Lightning on traces.

Target per position t: the cluster of the target's top-1 next token (loss "ce"), or the clusters
of its top tokens (loss "multilabel", see prep.router_loss), from E(x_t) and h_{t-1} (zeros at a
text's first position). Validation reports recall@k (the fraction of positions whose
target top-1 lies in the shortlist of the top-k clusters plus the always-kept ids) beside the
mean shortlist size over V. The result is stage `router`: the weights, the cluster labels, the
always-kept ids and the next-token counts as safetensors, and the router as an ONNX graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from artifacts import StageExists
from artifacts.format import Stage
from prep.cluster import _compact, spherical_kmeans
from prep.recipes import RouterRecipe
from prep.router_loss import positive_clusters, router_loss
from prep.router_trainer import fit_and_validate, lightning_flags, training_run
from prep.trace_files import load_traces, require_split, traces_of
from prep.traces import SPLITS, build_traces, parse_layers, teacher_target
from runtime.common.checks import is_digits
from runtime.drafters.router import ONNX_FILE, Router, onnx_bytes

RECALL_KS = (1, 2, 4, 8, 16, 32, 64)


def hidden_key(hidden: str) -> str:
    """Trace tensor holding the router's hidden input: 'final' or 'layers:N'."""
    if hidden == "final":
        return "hidden"
    kind, _, n = hidden.partition(":")
    if kind != "layers" or not is_digits(n) or int(n) < 1:
        raise ValueError(f"--hidden must be 'final' or 'layers:N' with N >= 1, got {hidden!r}")
    return f"hidden_layers_{int(n)}"


def default_hidden(index: dict) -> str:
    """layers:N when the traces hold exactly one drafter depth N, else the final hidden state."""
    layers = index.get("drafter_layers") or []
    return f"layers:{layers[0]}" if len(layers) == 1 else "final"


class RouterModule(L.LightningModule):
    """The router loss (prep.router_loss) on the target's top clusters; recall@k of the top-1's cluster
    against the shortlist size."""

    def __init__(self, router: Router, embedding: torch.Tensor, cluster_sizes: torch.Tensor, always: int,
                 lr: float = 1e-3, loss: str = "ce", vocab_size: int | None = None):
        super().__init__()
        self.router = router
        self.lr, self.loss = lr, loss
        self.register_buffer("embedding", embedding, persistent=False)  # [V, d_e], frozen
        self.register_buffer("cluster_sizes", cluster_sizes.float(), persistent=False)  # [M]
        self.always = always
        self.vocab_size = vocab_size or embedding.shape[0]  # what the shortlist share is of: V, or a head's Vd
        # Counted in the module's state, which Lightning carries back from spawned processes (ddp_spawn).
        self.register_buffer("steps_taken", torch.zeros((), dtype=torch.long))

    def scores(self, ids: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return self.router(self.embedding[ids.long()].float(), previous.float())  # [B, M]

    def training_step(self, batch, batch_idx):
        ids, previous, positives = batch
        loss = router_loss(self.loss, self.scores(ids, previous), positives)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps_taken += 1

    def validation_step(self, batch, batch_idx):
        ids, previous, positives = batch
        scores = self.scores(ids, previous)
        label, n = positives[:, 0], len(positives)
        self.log("val/loss", router_loss(self.loss, scores, positives), batch_size=n, prog_bar=True, sync_dist=True)
        ranked = scores.topk(min(max(RECALL_KS), scores.shape[1]), dim=1).indices  # [B, K]
        for k in RECALL_KS:
            if k > scores.shape[1]:
                break
            top = ranked[:, :k]
            hit = (top == label[:, None]).any(dim=1).float().mean()
            size = (self.cluster_sizes[top].sum(dim=1) + self.always).mean() / self.vocab_size
            self.log(f"val/recall@{k}", hit, batch_size=n, sync_dist=True)
            self.log(f"val/shortlist@{k}", size, batch_size=n, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.router.parameters(), lr=self.lr, weight_decay=0.01)


class TraceDataModule(L.LightningDataModule):
    """(input id, previous hidden state, positive clusters [K]) rows of the train / validation splits;
    column 0 of the positives is the cluster of the target's top-1 (the only one for loss "ce")."""

    def __init__(self, traces: str | Path, key: str, labels: torch.Tensor, batch_size: int = 256, workers: int = 0,
                 loss: str = "ce"):
        super().__init__()
        self.traces, self.key, self.labels, self.loss = traces, key, labels, loss
        self.batch_size, self.workers = batch_size, workers
        self.splits: dict[str, TensorDataset] = {}
        self.token_counts: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        tops = ["top_ids", "top_probs"] if self.loss == "multilabel" else ["top1"]
        _, t = load_traces(self.traces, ["input_ids", "position", "next_token", "split", self.key, *tops])
        hidden = t[self.key]
        previous = torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]])
        previous[t["position"] == 0] = 0  # a text's first position has no previous state
        if self.loss == "multilabel":
            label = positive_clusters(self.labels, t["top_ids"], t["top_probs"])  # [N, K]
        else:
            label = self.labels[t["top1"].long()][:, None]  # [N, 1]
        for name in ("train", "validation"):
            rows = require_split(self.traces, t["split"], name)
            self.splits[name] = TensorDataset(t["input_ids"][rows], previous[rows], label[rows])
        train_next = t["next_token"][(t["split"] == SPLITS.index("train")) & (t["next_token"] >= 0)].long()
        self.token_counts = torch.bincount(train_next, minlength=len(self.labels))

    def train_dataloader(self):
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self):
        return DataLoader(self.splits["validation"], batch_size=4096, num_workers=self.workers)


def router_clusters(weight: torch.Tensor, clusters: int, iterations: int, seed: int, progress: bool) -> torch.Tensor:
    """Cluster label [V] per token: faiss spherical k-means of the LM-head rows (compacted to 0..M-1)."""
    if not 1 <= clusters <= weight.shape[0]:
        raise ValueError(f"--clusters must be between 1 and the vocabulary size {weight.shape[0]}")
    return _compact(spherical_kmeans(weight, clusters, iterations, seed, progress))


@dataclass(frozen=True)
class RouterConfig:
    """How `train_router` trains: the router's shape, the optimisation, and Lightning's trainer flags."""

    clusters: int = 256  # token clusters M (spherical k-means of the head rows)
    hidden: str | None = None  # final or layers:N; None: the traces' only drafter depth, else final
    width: int = 512  # router MLP width
    max_steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    kmeans_iterations: int = 10
    loss: str = "ce"  # ce or multilabel (prep.router_loss)
    trainer_flags: dict = field(default_factory=lightning_flags)  # Lightning Trainer flags, checked (prep.router_trainer)
    progress: bool = True

    @classmethod
    def from_recipe(cls, recipe: RouterRecipe, **options) -> "RouterConfig":
        """The training fields of a recipe's [router] section (flags already applied), plus `options`."""
        return cls(clusters=recipe.clusters, hidden=recipe.router_hidden, width=recipe.width, max_steps=recipe.max_steps,
                   batch_size=recipe.batch_size, loss=recipe.loss, **options)


def train_router(session, traces: str | Path, work_dir: str | Path, config: RouterConfig | None = None,
                 force: bool = False) -> dict:
    """Train, validate and export stage `router` into the session's artifact; returns its params."""
    if session.artifact.has_stage(Stage.ROUTER) and not force:
        raise StageExists(session.artifact.path, Stage.ROUTER)
    started = time.perf_counter()
    c = config or RouterConfig()
    L.seed_everything(c.seed, workers=True, verbose=False)
    index = traces_of(traces, session.model.info.name, session.target.vocab_size)
    hidden = c.hidden or default_hidden(index)
    key = hidden_key(hidden)
    target = session.target
    labels = router_clusters(target.head_weight.float(), c.clusters, c.kmeans_iterations, c.seed, c.progress)
    always = torch.tensor(sorted(set(target.eos_token_ids) | set(session.tokenizer.all_special_ids)), dtype=torch.long)
    always = always[always < target.vocab_size]
    sizes = torch.bincount(labels, minlength=int(labels.max()) + 1)
    in_clusters = sizes.clone()
    in_clusters.index_add_(0, labels[always], -torch.ones_like(always))  # always-kept ids are scored anyway
    embedding = target.model.get_input_embeddings().weight.detach()
    data = TraceDataModule(traces, key, labels, c.batch_size, loss=c.loss)
    data.setup()
    d_h = data.splits["train"].tensors[1].shape[1]
    module = RouterModule(Router(embedding.shape[1], d_h, len(sizes), c.width), embedding, in_clusters, len(always), c.lr,
                          c.loss)
    run = training_run(Stage.ROUTER, session.model.info.name, c, {"traces": index, "hidden": hidden})
    metrics = fit_and_validate(module, data, c.trainer_flags, c.max_steps, Path(work_dir), c.progress, run)
    router = module.router.cpu().eval()
    graph = onnx_bytes(router)
    tensors = {
        **router.stage_tensors(),
        "cluster_labels": labels,
        "always_ids": always,
        "token_counts": data.token_counts,
    }
    params = {
        "clusters": int(len(sizes)),
        "kmeans_iterations": c.kmeans_iterations,
        "hidden": hidden,
        "loss": c.loss,
        "width": c.width,
        "traces": str(traces),
        "train_positions": len(data.splits["train"]),
        "validation_positions": len(data.splits["validation"]),
        "max_steps": c.max_steps,
        "steps": int(module.steps_taken),
        "batch_size": c.batch_size,
        "lr": c.lr,
        "seed": c.seed,
        "validation": metrics,
        "seconds": round(time.perf_counter() - started, 1),
    }
    session.artifact.write_stage(Stage.ROUTER, tensors, params, extra_files={ONNX_FILE: graph}, force=force)
    return params


def router_from_recipe(loaded, artifact, cfg: RouterRecipe, traces: str | Path, force: bool = False,
                       progress: bool = True) -> dict:
    """Run the recipe's `[router]` section end to end: prep traces, then prep train-router.

    The traces are resumed if begun (rebuilt where `force` allows); `prep all --traces` names their folder.
    """
    from runtime.backends import reload_target
    from runtime.session import Session, model_spec_of

    teacher = teacher_target(loaded)
    build_traces(teacher, loaded.tokenizer, loaded.info.name, cfg.corpus, traces, cfg.max_tokens,
                 max_tokens_per_text=cfg.max_tokens_per_text, drafter_layers=parse_layers(cfg.drafter_layers),
                 force=force, option="--traces", progress=progress, workers=None, model=model_spec_of(artifact))
    session = Session(artifact, loaded, reload_target(loaded, "transformers", teacher.eos_token_ids))  # training reads the fp32 weights
    return train_router(session, traces, Path(traces) / "router-train", RouterConfig.from_recipe(cfg, progress=progress),
                        force=force)
