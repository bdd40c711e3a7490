"""Lightning's Trainer for prep train-router and train-drafter: its flags checked before any work, its chatter off, Ctrl-C kept.

Only strategies that start their processes from this run work: `auto` (one device, or ddp_spawn
when the devices are several) and `ddp_spawn`. Lightning's `ddp` (like fsdp and deepspeed)
re-runs the command line in every new process, and a second prep train-router would meet the
first one's writer lock on the artifact. The final validation runs on one device, so its recall
covers every validation row once (several processes would each see a share).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tqdm import tqdm

from artifacts.atomic import atomic_write_bytes
from runtime.common.checks import is_digits

RUN_FILE = "run.json"  # beside the checkpoints folder: which run wrote them (a hash of its settings and data)
STRATEGIES = ("auto", "ddp_spawn")
ACCELERATORS = ("auto", "cpu", "gpu")
# Lightning's info lines (the device summary, a promotional tip, "`Trainer.fit` stopped"); warnings still show.
INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"
# But one: Lightning's own use of a torch API that torch 2.13 deprecates, which no prep flag can change.
LIGHTNING_INTERNAL_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
# And its note on a checkpoint folder that holds files: fit_and_validate resumes from them or clears them itself.
CHECKPOINT_FOLDER_WARNING = r"Checkpoint directory .* exists and is not empty"


def lightning_flags(devices: str = "auto", accelerator: str = "auto", precision: str = "32-true",
                    strategy: str = "auto") -> dict:
    """Lightning Trainer flags from train-router's options, checked now; ValueError naming the option and what works."""
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy {strategy} is not supported: use auto or ddp_spawn (ddp and its like re-run the "
                         "command in each process, which the artifact's writer lock refuses)")
    if not (devices == "auto" or is_digits(devices) and int(devices) >= 1):
        raise ValueError(f"--devices takes a number of devices such as 1 or 2, or auto; got {devices!r}")
    if accelerator not in ACCELERATORS:
        raise ValueError(f"--accelerator takes {', '.join(ACCELERATORS)}; got {accelerator!r}")
    if accelerator == "gpu" and not (CUDAAccelerator.is_available() or MPSAccelerator.is_available()):
        raise ValueError("--accelerator gpu: no GPU is visible here; use --accelerator cpu, or auto (a GPU when there is one)")
    flags = {"devices": int(devices) if is_digits(devices) else devices, "accelerator": accelerator,
             "precision": precision, "strategy": strategy}
    try:
        with quiet_lightning():
            probe = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, **flags)
    except (MisconfigurationException, ValueError, TypeError) as e:
        raise ValueError(f"Lightning refuses --precision {precision} with --accelerator {accelerator} --devices {devices}: "
                         f"{' '.join(str(e).split())}") from None
    if strategy == "auto" and probe.world_size > 1:
        flags["strategy"] = "ddp_spawn"  # Lightning's own choice for several devices, ddp, re-runs the command
    return flags


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Lightning's info lines and its internal deprecation warning off for the block (this process
    only; spawned ones still print theirs)."""
    logger = logging.getLogger(INFO_LOGGER)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=LIGHTNING_INTERNAL_WARNING)
            warnings.filterwarnings("ignore", message=CHECKPOINT_FOLDER_WARNING)
            yield
    finally:
        logger.setLevel(level)


@contextmanager
def ctrl_c_kept(trainer: L.Trainer) -> Iterator[None]:
    """Raise Ctrl-C during a Trainer call as KeyboardInterrupt, as everywhere else in prep.

    Lightning turns it into exit status 1 and leaves SIGINT ignored.
    """
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    except SystemExit:
        if trainer.interrupted:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, handler)


def training_run(stage: str, model: str, config, data: dict) -> dict:
    """What identifies a training for resuming: the stage, the model, the config's fields but `progress`, and its data."""
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k != "progress"}
    return {"stage": stage, "model": model, "config": settings, "data": data}


def resumable_checkpoint(folder: Path, run: dict) -> Path | None:
    """folder's last checkpoint if the same run (settings and data) wrote it, else None, with folder
    emptied of another run's checkpoints and this run recorded."""
    key = hashlib.sha256(json.dumps(run, sort_keys=True, default=str).encode()).hexdigest()
    last, recorded = folder / "last.ckpt", folder.parent / RUN_FILE
    try:
        same = json.loads(recorded.read_text(encoding="utf-8")).get("key") == key
    except (OSError, ValueError, AttributeError):
        same = False
    if same and last.is_symlink() and last.exists():
        return last
    stale = sorted(folder.glob("*.ckpt"))
    if stale:
        print(f"{folder}: checkpoints of other settings or data, replaced", file=sys.stderr)
        for path in stale:
            path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(recorded, (json.dumps({"key": key}) + "\n").encode())
    return None


class StepBar(L.Callback):
    """One progress bar over the optimizer steps, with the loss (Lightning's own restarts at every epoch)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bar: tqdm | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc=self.name, unit="step", file=sys.stderr,
                        disable=not trainer.is_global_zero)  # a resumed run starts at its checkpoint's step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.bar.update(trainer.global_step - self.bar.n)
        self.bar.set_postfix(loss=f"{float(outputs['loss']):.3f}", refresh=False)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.bar.close()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        if self.bar is not None:
            self.bar.close()  # before the error line


class ProcessGroupClosed(L.Callback):
    """Close the distributed process group at the end of fit, on every rank together.

    Lightning closes it at exit for NCCL only. A gloo group left open is torn down during each spawned
    process's interpreter shutdown, with its threads still running, and a rank can abort there
    ("terminate called without an active exception") after the training succeeded.
    """

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank closes its end while another still uses it
            torch.distributed.destroy_process_group()


def fit_and_validate(module: L.LightningModule, data: L.LightningDataModule, flags: dict, max_steps: int,
                     work_dir: Path, progress: bool, run: dict, name: str = "router") -> dict[str, float]:
    """Train for max_steps with `flags`, then validate on one device; returns the validation metrics.

    run: what identifies this training (its settings and data, JSON-able): a checkpoint left under
    work_dir by the same run (interrupted) is resumed from its last epoch; another run's are replaced.
    name: what the progress bar says it trains.
    CSV logs and checkpoints go under work_dir; the metrics go into the stage's params, not the logs.
    """
    folder = work_dir / "checkpoints"
    resume = resumable_checkpoint(folder, run)
    if resume is not None:
        print(f"{name}: resuming from {folder / os.readlink(resume)} (an earlier run of these settings)", file=sys.stderr)
    checkpoints = ModelCheckpoint(dirpath=str(folder), save_last="link")  # last.ckpt links the newest epoch's file
    with quiet_lightning():
        trainer = L.Trainer(max_steps=max_steps, logger=CSVLogger(str(work_dir), name="logs"),
                            callbacks=[checkpoints, ProcessGroupClosed(), *([StepBar(name)] if progress else [])],
                            enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=min(10, max_steps), num_sanity_val_steps=0,
                            **flags)
        with ctrl_c_kept(trainer):
            trainer.fit(module, datamodule=data, ckpt_path=None if resume is None else str(resume))
        one_device = {k: flags[k] for k in ("accelerator", "precision") if k in flags}
        validator = L.Trainer(devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, **one_device)
        with ctrl_c_kept(validator):
            return {k: float(v) for k, v in validator.validate(module, datamodule=data, verbose=False)[0].items()}
