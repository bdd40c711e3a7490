"""`prep train-drafter-router`: DynaSpec's router over the draft head's own vocabulary (stage `drafter_router`).

This is the DynaSpec paper's setting: an EAGLE-class head whose O(Vd·d) LM head a router shortlists.
The head's draft-vocabulary rows are grouped by faiss spherical k-means of their directions; the
router (runtime.drafters.router.Router, the same MLP as stage `router`'s) scores the clusters from
the embedding of the token the head step fed and the head's output at that step, and the head
then scores only the rows of the top-k clusters (`eagle:dynaspec=K`). Reading the head's output
rather than the step before it (DynaSpec's h_{t-1}) gives up running the router beside the head's
forward, which one thread cannot do anyway, for the state the LM head itself reads.

Data: the head unrolled over the features it was trained on (EagleHead.unrolled, teacher-forced,
`steps` draft steps), so the router sees the outputs of first and later draft steps. Label: the
cluster of the target's top-1 at that row (rows whose top-1 lies outside the draft vocabulary are
left out: no shortlist can draft them). Validation reports recall@k, the share of rows whose label
is among the top-k clusters, beside the mean shortlist's share of the draft vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

from artifacts import StageExists
from artifacts.format import Stage
from prep.drafter_train import TextsData
from prep.router_train import RouterModule, router_clusters
from prep.router_trainer import fit_and_validate, lightning_flags, training_run
from prep.trace_files import read_index
from runtime.drafters.eagle import head_from_stage
from runtime.drafters.eagle_head import NOT_DRAFTED, EagleConfig
from runtime.drafters.router import HEAD_ROUTER_ONNX_FILE as ONNX_FILE, Router, onnx_bytes


@dataclass(frozen=True)
class DrafterRouterConfig:
    """How `train_drafter_router` clusters the head's rows and trains the router."""

    clusters: int = 64  # M: ~Vd / 64 rows a cluster (128 for a draft vocabulary of 8192)
    width: int = 256  # router MLP width
    max_steps: int = 2000
    batch_size: int = 256
    lr: float = 1e-3
    max_tokens: int = 60_000  # text rows read from the features (each gives `steps` router rows)
    kmeans_iterations: int = 20
    seed: int = 0
    trainer_flags: dict = field(default_factory=lightning_flags)
    progress: bool = True


class RouterRows(L.LightningDataModule):
    """(fed token id, head output, cluster label [1]) rows of the train and validation splits."""

    def __init__(self, splits: dict[str, TensorDataset], batch_size: int) -> None:
        super().__init__()
        self.splits, self.batch_size = splits, batch_size

    def train_dataloader(self):
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.splits["validation"], batch_size=4096)


@torch.no_grad()
def head_rows(head, steps: int, embedding: torch.Tensor, texts, labels: torch.Tensor, max_tokens: int,
              progress: bool, split: str) -> TensorDataset:
    """The router's rows of one split: the head unrolled over each text, every draft step's rows.

    embedding [V, d] as stored (what the head was trained with); labels [Vd] the cluster of each draft row.
    """
    t2d_index = head.t2d_index()
    ids_out, hidden_out, label_out, taken = [], [], [], 0
    for features, ids, top_ids, _ in tqdm(texts, desc=f"head outputs ({split})", unit="text", disable=not progress,
                                          leave=False):
        if taken >= max_tokens:
            break
        rows = ids.shape[0] - steps
        outs = head.unrolled(features[:rows].float(), embedding[ids[1:].long()].float(), steps)
        for j, out in enumerate(outs):  # step j, row t: fed token t + 1 + j, the target's top-1 at t + 1 + j
            drafted = t2d_index[top_ids[1 + j : 1 + j + rows, 0].long()]  # [T']
            kept = drafted != NOT_DRAFTED
            ids_out.append(ids[1 + j : 1 + j + rows][kept].long())
            hidden_out.append(out[kept].to(torch.bfloat16))  # [n, d]: half the memory, float32's range (gemma3's residual leaves float16's)
            label_out.append(labels[drafted[kept]])
        taken += rows
    return TensorDataset(torch.cat(ids_out), torch.cat(hidden_out), torch.cat(label_out)[:, None])


def train_drafter_router(session, work_dir: str | Path, config: DrafterRouterConfig | None = None,
                         folders: list[str] | None = None, force: bool = False) -> dict:
    """Cluster the head's rows, train the router on the head's outputs, and write stage `drafter_router`; its params.

    folders: features folders (prep traces --features); None: the ones stage drafter was trained on.
    """
    artifact = session.artifact
    if artifact.has_stage(Stage.DRAFTER_ROUTER) and not force:
        raise StageExists(artifact.path, Stage.DRAFTER_ROUTER)
    if not artifact.has_stage(Stage.DRAFTER):
        raise ValueError(f"{artifact.path} has no draft head to route; run: prep train-drafter {artifact.path} "
                         "--features FEATURES")
    started = time.perf_counter()
    c = config or DrafterRouterConfig()
    L.seed_everything(c.seed, workers=True, verbose=False)
    params = artifact.stage_params(Stage.DRAFTER)
    head = head_from_stage(artifact.read_stage(Stage.DRAFTER), EagleConfig.from_params(params))
    folders = folders or params["features"]
    if not 1 <= c.clusters <= head.config.draft_vocab:
        raise ValueError(f"--clusters must be between 1 and the head's draft vocabulary of {head.config.draft_vocab}, "
                         f"got {c.clusters}")
    labels = router_clusters(head.lm_head.weight.detach(), c.clusters, c.kmeans_iterations, c.seed, c.progress)  # [Vd]
    texts = TextsData(folders, session.model.info.name, session.target.vocab_size, params["steps"])
    texts.setup()
    embedding = session.target.model.get_input_embeddings().weight.detach()  # [V, d] as stored, as the head reads it
    splits = {name: head_rows(head, params["steps"], embedding, texts.splits[name], labels,
                              c.max_tokens if name == "train" else max(c.max_tokens // 10, 1), c.progress, name)
              for name in ("train", "validation")}
    sizes = torch.bincount(labels, minlength=int(labels.max()) + 1)
    router = Router(embedding.shape[1], head.config.hidden_size, len(sizes), c.width)
    module = RouterModule(router, embedding, sizes, 0, c.lr, "ce", vocab_size=head.config.draft_vocab)
    run = training_run(Stage.DRAFTER_ROUTER, session.model.info.name, c,
                       {"drafter": artifact.tensors_sha256(Stage.DRAFTER), **{folder: read_index(folder) for folder in folders}})
    metrics = fit_and_validate(module, RouterRows(splits, c.batch_size), c.trainer_flags, c.max_steps, Path(work_dir),
                               c.progress, run)
    router = module.router.cpu().eval()
    graph = onnx_bytes(router)
    out = {
        "clusters": int(len(sizes)),
        "width": c.width,
        "drafter_sha256": artifact.tensors_sha256(Stage.DRAFTER),
        "features": [str(f) for f in folders],
        "train_rows": len(splits["train"]),
        "validation_rows": len(splits["validation"]),
        "max_steps": c.max_steps,
        "steps": int(module.steps_taken),
        "batch_size": c.batch_size,
        "lr": c.lr,
        "seed": c.seed,
        "kmeans_iterations": c.kmeans_iterations,
        "validation": metrics,
        "seconds": round(time.perf_counter() - started, 1),
    }
    tensors = {**router.stage_tensors(), "cluster_labels": labels}
    artifact.write_stage(Stage.DRAFTER_ROUTER, tensors, out, extra_files={ONNX_FILE: graph}, force=force)
    return out
