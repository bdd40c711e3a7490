"""`prep train-drafter`: train the EAGLE-3 draft head (runtime.drafters.eagle_head) with Lightning on the target's features.

Data: traces folders written with `prep traces --features` (one or more corpora), one text per
batch. Labels: at each draft step, the target's own next-token distribution (its top TOP_TOKENS
tokens and probabilities) restricted to the draft vocabulary and renormalized: the head learns to
predict what the target would say, not what the corpus says. The draft vocabulary is the Vd tokens
the target most often chooses (its top-1) over the training rows, FR-Spec style.

Training-time test: every text is unrolled `steps` draft steps (EagleHead.unrolled); step j's loss
weighs 0.8^j, as EAGLE-3 does. Validation reports, per step, the share of rows whose draft top-1
is the target's top-1 (`top1@j`, on the corpus's own tokens), and `chain@j`: over the rows where
the text follows the target's top-1 (so the step's input token is what a drafted chain would feed),
the share whose drafts 1..j+1 are all the target's top-1, which is the acceptance by position a greedy
chain would see on such text (`runtime bench`'s figure). Also the draft vocabulary's coverage of the
target's top-1.

The head starts from the target: lm_head from the target head's rows of the draft vocabulary, the
final norm from the target's, and fc passing the highest feature layer through, so that before any
step the head reads off the target's late residual stream with the target's own head.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from artifacts import StageExists
from artifacts.format import Stage
from prep.recipes import DEFAULTS, DrafterRecipe
from prep.router_trainer import fit_and_validate, lightning_flags, training_run
from prep.trace_files import load_traces, read_index, traces_of
from prep.traces import SPLITS
from runtime.backends.layers import RMSNorm
from runtime.drafters.eagle import stage_tensors
from runtime.drafters.eagle_head import NOT_DRAFTED, EagleConfig, EagleHead

STEP_DECAY = 0.8  # weight of draft step j's loss: STEP_DECAY ** j
KEYS = ["input_ids", "features", "top_ids", "top_probs", "doc", "split"]


@dataclass(frozen=True)
class DrafterConfig:
    """How `train_drafter` shapes and trains the head, and Lightning's trainer flags."""

    draft_vocab: int = DEFAULTS.drafter.draft_vocab
    intermediate_size: int | None = None  # None: mlp_width of the target's
    mlp_width: float = DEFAULTS.drafter.mlp_width
    steps: int = DEFAULTS.drafter.steps  # training-time test depth
    epochs: int = DEFAULTS.drafter.epochs
    lr: float = DEFAULTS.drafter.lr
    seed: int = 0
    trainer_flags: dict = field(default_factory=lightning_flags)
    progress: bool = True

    @classmethod
    def from_recipe(cls, recipe: DrafterRecipe, **options) -> DrafterConfig:
        """The fields of a recipe's [drafter] section (flags already applied), plus `options`."""
        return cls(draft_vocab=recipe.draft_vocab, steps=recipe.steps, epochs=recipe.epochs, lr=recipe.lr,
                   mlp_width=recipe.mlp_width, **options)


class TextData(Dataset):
    """One text per item: features [T, 3d], the token ids [T] and the target's top tokens [T, K] and probabilities."""

    def __init__(self, tensors: dict[str, torch.Tensor], split: str, min_tokens: int) -> None:
        self.tensors = tensors
        _, lengths = torch.unique_consecutive(tensors["doc"], return_counts=True)  # a text's rows are consecutive
        starts = (lengths.cumsum(0) - lengths).tolist()
        wanted = SPLITS.index(split)
        self.spans = [(start, start + n) for start, n in zip(starts, lengths.tolist())
                      if n >= min_tokens and int(tensors["split"][start]) == wanted]

    def __len__(self) -> int:
        return len(self.spans)

    def __getitem__(self, i: int):
        start, end = self.spans[i]
        t = self.tensors
        return t["features"][start:end], t["input_ids"][start:end], t["top_ids"][start:end], t["top_probs"][start:end]


class TextsData(L.LightningDataModule):
    """The train and validation texts of one or more features folders."""

    def __init__(self, folders: list[str], model_name: str, vocab_size: int, steps: int) -> None:
        super().__init__()
        self.folders, self.model_name, self.vocab_size, self.steps = folders, model_name, vocab_size, steps
        self.splits: dict[str, TextData] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        parts = [load_traces(folder, KEYS)[1] for folder in self.folders]
        offset, docs = 0, []
        for part in parts:  # one doc numbering across folders
            docs.append(part["doc"].long() + offset)
            offset = int(docs[-1].max()) + 1
        tensors = {k: torch.cat([p[k] for p in parts]) for k in KEYS if k != "doc"}
        tensors["doc"] = torch.cat(docs)
        self.tensors = tensors
        for name in ("train", "validation"):
            self.splits[name] = TextData(tensors, name, self.steps + 2)
            if not len(self.splits[name]):
                raise ValueError(f"the features at {', '.join(self.folders)} have no {name} texts of "
                                 f"{self.steps + 2} tokens or more; trace more text with a larger --max-tokens")

    def top1_counts(self) -> torch.Tensor:
        """How often the target chose each token [V] over the training rows."""
        rows = self.tensors["split"] == SPLITS.index("train")
        return torch.bincount(self.tensors["top_ids"][rows, 0].long(), minlength=self.vocab_size)

    def train_dataloader(self):
        return DataLoader(self.splits["train"], batch_size=None, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.splits["validation"], batch_size=None)


class DrafterModule(L.LightningModule):
    """The training-time-test loss of an EagleHead against the target's distributions."""

    def __init__(self, head: EagleHead, embedding: torch.Tensor, steps: int, lr: float, total_steps: int) -> None:
        super().__init__()
        self.head = head
        self.embedding = embedding  # [V, d], the target's table as stored, frozen (not a buffer: never checkpointed)
        self.steps, self.lr, self.total_steps = steps, lr, total_steps
        self.register_buffer("t2d_index", head.t2d_index(), persistent=False)  # [V]
        self.register_buffer("steps_taken", torch.zeros((), dtype=torch.long))

    def unrolled_losses(self, batch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per draft step: the loss, the rows whose draft top-1 is the target's top-1, and the rows whose
        text followed the target's top-1 into that step (its input token is what a chain would feed) (bool [T'])."""
        features, ids, top_ids, top_probs = batch
        rows = ids.shape[0] - self.steps  # row t, step j reads token t + 1 + j and the target's distribution there
        embeds = self.embedding[ids[1:].long()].float()  # [T - 1, d]
        outs = self.head.unrolled(features[:rows].float(), embeds, self.steps)
        losses, hits, follows = [], [], []
        for j, out in enumerate(outs):
            logq = torch.log_softmax(self.head.logits(out).float(), dim=-1)  # [T', Vd]
            drafted = self.t2d_index[top_ids[1 + j : 1 + j + rows].long()]  # [T', K]
            p = top_probs[1 + j : 1 + j + rows].float() * (drafted != NOT_DRAFTED)
            mass = p.sum(1, keepdim=True)
            kept = mass[:, 0] > 0
            p = p / mass.clamp_min(1e-9)
            loss = -(p * logq.gather(1, drafted.clamp_min(0))).sum(1)[kept].mean()
            losses.append(loss)
            hits.append(logq.argmax(1) == drafted[:, 0])
            follows.append(ids[1 + j : 1 + j + rows] == top_ids[j : j + rows, 0])  # step j's token is the target's top-1
        return losses, hits, follows

    def training_step(self, batch, batch_idx):
        losses, _, _ = self.unrolled_losses(batch)
        weights = [STEP_DECAY ** j for j in range(len(losses))]
        loss = sum(w * l for w, l in zip(weights, losses)) / sum(weights)
        self.log("train/loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps_taken += 1

    def validation_step(self, batch, batch_idx):
        losses, hits, follows = self.unrolled_losses(batch)
        rows = hits[0].numel()
        for j, (loss, hit) in enumerate(zip(losses, hits)):
            self.log(f"val/loss@{j}", loss, batch_size=rows, reduce_fx="mean")
            self.log(f"val/top1@{j}", hit.float().mean(), batch_size=rows, reduce_fx="mean")
        for j, (rate, counted) in enumerate(chain_acceptance(hits, follows)):
            if counted:
                self.log(f"val/chain@{j}", rate, batch_size=counted, reduce_fx="mean")

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, self.total_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def chain_acceptance(hits: list[torch.Tensor], follows: list[torch.Tensor]) -> list[tuple[float, int]]:
    """A greedy chain's acceptance at each draft position, and the rows it counts.

    hits[j], follows[j]: bool [T'] per row, as DrafterModule.unrolled_losses gives them. Position
    j + 1 counts the rows whose text followed the target's top-1 through step j's input (steps 1..j),
    so that the teacher-forced steps saw what a drafted chain would have fed; of those, the share
    whose drafts 1..j + 1 were all the target's top-1.
    """
    chained = torch.ones_like(hits[0])  # drafts 1..j + 1 all the target's top-1
    fed = torch.ones_like(hits[0])  # the text followed the target through step j's input
    rates = []
    for j, hit in enumerate(hits):
        chained = chained & hit
        fed = fed & follows[j] if j else fed
        counted = int(fed.sum())
        rates.append((float((chained & fed).sum()) / counted if counted else 0.0, counted))
    return rates


def initial_head(head_weight: torch.Tensor, config: EagleConfig, draft_ids: torch.Tensor,
                 final_norm: torch.Tensor) -> EagleHead:
    """An EagleHead reading off the target: its head rows [V, d] and final norm [d], fc passing the last feature layer through."""
    head = EagleHead(config)
    head.set_vocabulary(draft_ids)
    d = config.hidden_size
    with torch.no_grad():
        head.lm_head.weight.copy_(head_weight[head.draft_ids()].float())
        head.norm.copy_(final_norm)
        head.fc.weight.zero_()
        head.fc.weight[:, -d:] = torch.eye(d)
    return head


def mlp_width(target_width: int, fraction: float) -> int:
    """The head's MLP width: `fraction` (in (0, 1]: DrafterRecipe) of the target's, in whole blocks of 32, at least one.

    down_proj's rows are that wide, and the runtime requantizes them to Q8_0, whose blocks hold 32 values.
    """
    return max(32, round(fraction * target_width / 32) * 32)


def draft_vocabulary(counts: torch.Tensor, size: int, always: list[int]) -> torch.Tensor:
    """The `size` most chosen target ids, with the `always` ids (EOS) among them: ascending ids [size]."""
    if not 1 <= size <= counts.numel():
        raise ValueError(f"--draft-vocab must be between 1 and the vocabulary size {counts.numel()}, got {size}")
    ranked = counts.clone().float()
    ranked[torch.tensor(always, dtype=torch.long)] = float("inf")
    return ranked.topk(size).indices.sort().values


def train_drafter(session, folders: list[str], work_dir: str | Path, config: DrafterConfig | None = None,
                  force: bool = False) -> dict:
    """Train, validate and write stage `drafter` into the session's artifact; returns its params."""
    if session.artifact.has_stage(Stage.DRAFTER) and not force:
        raise StageExists(session.artifact.path, Stage.DRAFTER)
    started = time.perf_counter()
    c = config or DrafterConfig()
    L.seed_everything(c.seed, workers=True, verbose=False)
    target = session.target
    layers = None
    for folder in folders:
        index = traces_of(folder, session.model.info.name, target.vocab_size)
        if not index.get("feature_layers"):
            raise ValueError(f"{folder} holds no features; write them with prep traces MODEL --features -o {folder}")
        if layers not in (None, index["feature_layers"]):
            raise ValueError(f"{folder} holds features of layers {index['feature_layers']}, the others {layers}; "
                             "give folders traced by one model")
        layers = index["feature_layers"]
    data = TextsData(folders, session.model.info.name, target.vocab_size, c.steps)
    data.setup()
    counts = data.top1_counts()
    draft_ids = draft_vocabulary(counts, c.draft_vocab, sorted(i for i in target.eos_token_ids if i < target.vocab_size))
    body = target.config
    eagle = EagleConfig(
        hidden_size=target.hidden_size, num_heads=body.num_attention_heads, kv_heads=body.num_key_value_heads,
        head_dim=getattr(body, "head_dim", None) or target.hidden_size // body.num_attention_heads,
        intermediate_size=c.intermediate_size or mlp_width(body.intermediate_size, c.mlp_width), draft_vocab=len(draft_ids),
        vocab_size=target.vocab_size, feature_layers=tuple(layers),
    )
    gemma = body.model_type.startswith("gemma")
    head = initial_head(target.head_weight, eagle, draft_ids, RMSNorm.of_module(target.body.norm, gemma).factor)
    total = c.epochs * len(data.splits["train"])
    embedding = target.model.get_input_embeddings().weight.detach()  # as stored: gemma3's scale is its module's
    module = DrafterModule(head, embedding, c.steps, c.lr, total)
    run = training_run(Stage.DRAFTER, session.model.info.name, c, {folder: read_index(folder) for folder in folders})
    metrics = fit_and_validate(module, data, c.trainer_flags, total, Path(work_dir), c.progress, run, "drafter")
    coverage = float(counts[draft_ids].sum() / counts.sum())
    params = {
        **eagle.params(),
        "steps": c.steps,
        "max_positions": int(getattr(body, "max_position_embeddings", 0) or 0),  # the target's, for exports
        "features": [str(f) for f in folders],
        "train_texts": len(data.splits["train"]),
        "validation_texts": len(data.splits["validation"]),
        "epochs": c.epochs,
        "optimizer_steps": int(module.steps_taken),
        "lr": c.lr,
        "precision": c.trainer_flags["precision"],
        "seed": c.seed,
        "draft_vocab_coverage": round(coverage, 4),
        "validation": metrics,
        "seconds": round(time.perf_counter() - started, 1),
    }
    order = counts[draft_ids].argsort(descending=True, stable=True)  # draft rows, the most chosen first
    tensors = {**stage_tensors(module.head.cpu().eval()), "draft_order": order}
    session.artifact.write_stage(Stage.DRAFTER, tensors, params, force=force)
    return params
