"""Lightning's Trainer for prep train-router and train-drafter: its flags checked before any work, its chatter off, Ctrl-C kept.

Only strategies that start their processes from this run work: `auto` (one device, or ddp_spawn
when the devices are several) and `ddp_spawn`. Lightning's `ddp` (like fsdp and deepspeed)
re-runs the command line in every new process, and a second prep train-router would meet the
first one's writer lock on the artifact. The final validation runs on one device, so its recall
covers every validation row once (several processes would each see a share).
"""

from __future__ import annotations

import logging
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tqdm import tqdm

from runtime.common.checks import is_digits

STRATEGIES = ("auto", "ddp_spawn")
ACCELERATORS = ("auto", "cpu", "gpu")
# Lightning's info lines (the device summary, a promotional tip, "`Trainer.fit` stopped"); warnings still show.
INFO_LOGGER = "lightning.pytorch.utilities.rank_zero"
# But one: Lightning's own use of a torch API that torch 2.13 deprecates, which no prep flag can change.
LIGHTNING_INTERNAL_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


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


class StepBar(L.Callback):
    """One progress bar over the optimizer steps, with the loss (Lightning's own restarts at every epoch)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.bar: tqdm | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.bar = tqdm(total=trainer.max_steps, desc=self.name, unit="step", file=sys.stderr,
                        disable=not trainer.is_global_zero)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.bar.update(trainer.global_step - self.bar.n)
        self.bar.set_postfix(loss=f"{float(outputs['loss']):.3f}", refresh=False)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.bar.close()

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        if self.bar is not None:
            self.bar.close()  # before the error line


def fit_and_validate(module: L.LightningModule, data: L.LightningDataModule, flags: dict, max_steps: int,
                     work_dir: Path, progress: bool, name: str = "router") -> dict[str, float]:
    """Train for max_steps with `flags`, then validate on one device; returns the validation metrics.

    name: what the progress bar says it trains.
    CSV logs and checkpoints go under work_dir; the metrics go into the stage's params, not the logs.
    """
    checkpoints = ModelCheckpoint(dirpath=str(work_dir / "checkpoints"), save_last=True)
    with quiet_lightning():
        trainer = L.Trainer(max_steps=max_steps, logger=CSVLogger(str(work_dir), name="logs"),
                            callbacks=[checkpoints, *([StepBar(name)] if progress else [])], enable_progress_bar=False,
                            enable_model_summary=False, log_every_n_steps=min(10, max_steps), num_sanity_val_steps=0,
                            **flags)
        with ctrl_c_kept(trainer):
            trainer.fit(module, datamodule=data)
        one_device = {k: flags[k] for k in ("accelerator", "precision") if k in flags}
        validator = L.Trainer(devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, **one_device)
        with ctrl_c_kept(validator):
            return {k: float(v) for k, v in validator.validate(module, datamodule=data, verbose=False)[0].items()}
