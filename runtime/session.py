"""Open an artifact together with the model it was built for, and build heads from its stages."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable

from artifacts import Artifact
from artifacts.format import Stage
from runtime.heads import BOUNDS, CertifiedHead, ClusterBound, FullHead, ScreenBound
from runtime.heads.screen4_bound import Screen4Bound
from runtime.kernels import decoding_threads, has_screen4_kernel, kernel_name, screen4_pays
from runtime.backends import TargetModel, load_target, reload_target
from runtime.models import LoadedModel, ModelError, ModelLog



@dataclass
class Session:
    """A model, its decoding backend, the artifact prepared for it, and the threads it decodes on."""

    artifact: Artifact
    model: LoadedModel
    target: TargetModel
    threads: int | None = None  # None: the process's setting (runtime.api.set_threads)
    _screen_bound: ScreenBound | None = field(default=None, repr=False)
    _screen4_bound: Screen4Bound | None = field(default=None, repr=False)
    _other_targets: dict = field(default_factory=dict, repr=False)  # backend name -> TargetModel
    _built: dict = field(default_factory=dict, repr=False)  # Session.once's objects, by key

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def decoding(self) -> AbstractContextManager:
        """Where this session's work runs: on its own thread count, put back after (none: the process's)."""
        return nullcontext() if self.threads is None else decoding_threads(self.threads)

    def target_on(self, backend: str) -> TargetModel:
        """The session's model on another backend (ar:BACKEND, a same-run reference), loaded once."""
        if backend == self.target.name:
            return self.target
        if backend not in self._other_targets:
            self._other_targets[backend] = reload_target(self.model, backend, self.target.eos_token_ids)
        return self._other_targets[backend]

    def once(self, key: Hashable, make: Callable[[], object]) -> object:
        """make(), called once per session under `key`: what drafters build at load and never change
        (the eagle head's requantized weights), shared by every method built over the session."""
        if key not in self._built:
            self._built[key] = make()
        return self._built[key]

    def full_head(self) -> FullHead:
        return FullHead(self.target.head_weight, self.target.head_bias)

    def screen_bound(self) -> ScreenBound:
        """The screening bound of the artifact's `screen` stage (one int8 head copy per session)."""
        if self._screen_bound is None:
            tensors = self.artifact.read_stage(Stage.SCREEN)
            self._screen_bound = ScreenBound.from_stage(self.target.head_weight, self.target.head_bias, tensors)
        return self._screen_bound

    def best_bound(self) -> str | None:
        """The certified head's fastest bound this artifact and CPU allow: screen4 (its stage, and kernels
        where it beats the int8 screen: runtime.kernels.screen4_pays), else screen (its stage), else None."""
        if self.artifact.has_stage(Stage.SCREEN4) and screen4_pays():
            return "screen4"
        return "screen" if self.artifact.has_stage(Stage.SCREEN) else None

    def has_draft_head(self) -> bool:
        """Whether the artifact has a trained draft head (stage drafter), which the eagle drafter reads."""
        return self.artifact.has_stage(Stage.DRAFTER)

    def certified_head(
        self, bound: str = "screen", max_open_fraction: float = 0.25, adaptive_budget: bool = False
    ) -> CertifiedHead:
        """CertifiedHead over the artifact's `screen`, `screen4` or `clusters` stage."""
        weight, bias = self.target.head_weight, self.target.head_bias
        if bound == "screen":
            family = self.screen_bound()
        elif bound == "screen4":
            if self._screen4_bound is None:
                tensors = self.artifact.read_stage(Stage.SCREEN4)  # a missing stage is the first thing to fix
                if not has_screen4_kernel():
                    raise ValueError(f"csv:screen4 needs the AVX-512 or AVX2 kernels and this CPU runs {kernel_name()}: without them "
                                     "the 4-bit screen takes ~1.6 s per step; use +csv (the int8 screen)")
                wide = self.screen_bound() if self.artifact.has_stage(Stage.SCREEN) else None
                self._screen4_bound = Screen4Bound.from_stage(weight, bias, tensors, wide)
            family = self._screen4_bound
        elif bound == "cluster":
            tensors = self.artifact.read_stage(Stage.CLUSTERS)
            family = ClusterBound(weight, bias, tensors, max_open_fraction=max_open_fraction, adaptive_budget=adaptive_budget)
        else:
            raise ValueError(f"unknown bound {bound!r}; choose one of {', '.join(BOUNDS)}")
        return CertifiedHead(weight, bias, family)


def model_spec_of(artifact: Artifact) -> str:
    """The model argument an artifact was built from: its packaged name, .gguf path or model directory."""
    return artifact.model.source.model_argument


def open_session(
    artifact_path: str | Path, model: str | None = None, progress: bool = True, backend: str = "auto", chat: bool = False,
    threads: int | None = None,
) -> Session:
    """Open ART, load its model (or `model`), and refuse a model whose fingerprint differs.

    backend: auto (native for a GGUF the native backend reads, else lean where supported, else
    transformers), native, lean or transformers (runtime.backends).
    chat: refuse a model without a chat template before it loads (prompts will be wrapped in one).
    threads: the session's thread count (Session.decoding), None for the process's.
    """
    artifact = Artifact.open(artifact_path)
    spec = model or model_spec_of(artifact)
    ModelLog.of(spec, progress)(f"loading for {artifact_path} ...")  # a few seconds with nothing else on the screen
    try:
        loaded, target = load_target(spec, backend, progress=progress, chat=chat)
    except ModelError as e:
        if model is not None:
            raise
        raise ModelError(f"{e} (the artifact was built for {artifact.model.name}, from {artifact.model.source}); "
                         "pass --model with a local copy of that model") from None
    artifact.check_model(loaded.info)
    return Session(artifact, loaded, target, threads)
