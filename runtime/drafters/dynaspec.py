"""DynaSpec and FR-Spec drafters: the layer-truncated self-drafter with a shortlist head.

DynaSpec: before each draft token, the router scores clusters from the embedding of
the token just fed, E(x_t), and the drafter's hidden state one position earlier, h_{t-1}; the
head then scores only the union of the top-k(t) clusters. Neither input waits for the drafter's
forward at step t, so with `overlap` the router runs in a second thread beside that forward. FR-Spec: the same drafter with a
static list of the tokens most frequent in the traces. Both heads can also keep the sequence's own
tokens in the shortlist (`context`, on by default: see runtime.heads.shortlist). Verification
stays full-vocabulary.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from artifacts import Artifact
from artifacts.format import Stage
from runtime.drafters.int8 import Int8Drafter
from runtime.drafters.layers import LayerDrafter
from runtime.heads.shortlist import ShortlistHead
from runtime.drafters.router import ONNX_FILE, SCHEDULES, RouterRunner
from runtime.backends.base import TargetModel


@dataclass
class RouterStage:
    """The `router` stage of an artifact: the router, its clusters and the trace token counts."""

    tensors: dict[str, torch.Tensor]
    params: dict
    onnx_path: str

    @classmethod
    def load(cls, artifact: Artifact) -> "RouterStage":
        tensors = artifact.read_stage(Stage.ROUTER)
        return cls(tensors, artifact.stage_params(Stage.ROUTER), str(artifact.stage_file(Stage.ROUTER, ONNX_FILE)))

    def runner(self, engine: str = "onnx") -> RouterRunner:
        """The router run by ONNX Runtime ("onnx") or torch ("torch")."""
        return RouterRunner(self.tensors, self.onnx_path, engine)

    def cluster_head(self, target: TargetModel, context: bool = True) -> ShortlistHead:
        """A shortlist head over the router's clusters (the always-kept ids, and with `context` the
        sequence's tokens, included at every step)."""
        labels, always = self.tensors["cluster_labels"], self.tensors["always_ids"]
        return ShortlistHead(target.head_weight, target.head_bias, labels, always, context)

    def frequent_head(self, target: TargetModel, tokens: int, context: bool = True) -> ShortlistHead:
        """FR-Spec: the `tokens` most frequent next tokens of the training traces, plus the always-kept
        ids (and with `context` the sequence's tokens)."""
        if not 1 <= tokens <= target.vocab_size:
            raise ValueError(f"the FR-Spec shortlist size must be in 1..{target.vocab_size}, got {tokens}")
        counts = self.tensors["token_counts"]
        top = torch.argsort(counts, descending=True, stable=True)[:tokens]
        ids = torch.unique(torch.cat([top, self.tensors["always_ids"]]))
        return ShortlistHead.static(target.head_weight, target.head_bias, ids, context)

    def check_hidden(self, drafter: str) -> None:
        """The router must have been trained on the hidden state the drafter ("layers:N" or "int8")
        gives it: layers:N, or final for the int8 copy of the whole target."""
        hidden = "final" if drafter == "int8" else drafter
        if self.params.get("hidden") != hidden:
            raise ValueError(
                f"the router was trained on the {self.params.get('hidden')!r} hidden state, but a {drafter} "
                f"drafter gives it {hidden!r}; rerun: prep train-router ART --traces TR --hidden {hidden} --force"
            )


class ShortlistDrafting:
    """Mixin for a DecoderDrafter over a ShortlistHead: the head is told every token fed (its context)."""

    head: ShortlistHead

    def reset(self, prompt, params, generator, *args, **kwargs) -> None:
        super().reset(prompt, params, generator, *args, **kwargs)
        self.head.clear_context()

    def feed(self, tokens: list[int]) -> torch.Tensor:
        self.head.add_context(tokens)
        return super().feed(tokens)


class ShortlistLayerDrafter(ShortlistDrafting, LayerDrafter):
    """LayerDrafter over a ShortlistHead (FR-Spec)."""


class ShortlistInt8Drafter(ShortlistDrafting, Int8Drafter):
    """Int8Drafter over a ShortlistHead (FR-Spec)."""


class RoutedDrafting(ShortlistDrafting):
    """Mixin for a DecoderDrafter whose ShortlistHead is re-chosen by the router before every draft token.

    Call `route_with` after the drafter's own __init__.
    """

    def route_with(
        self, target: TargetModel, router: RouterRunner, k_max: int, schedule: str = "fixed", overlap: bool = False
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown cluster schedule {schedule!r}; use {' or '.join(SCHEDULES)}")
        if k_max < 1:
            raise ValueError("the cluster budget k must be >= 1")
        self.router, self.k_max, self.budget = router, k_max, SCHEDULES[schedule]
        self.embedding_rows = target.embedding_rows  # ids [k] -> input-embedding rows [k, d]
        self.hiddens: list[torch.Tensor] = []  # [d] per cached position, aligned with self.cached
        self.step = 0  # draft position of the next token the head picks
        # One worker: the router of step t beside the drafter forward of step t (ONNX Runtime and
        # torch both release the GIL while they compute).
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router") if overlap else None

    def reset(self, prompt, params, generator, *args, **kwargs) -> None:
        super().reset(prompt, params, generator, *args, **kwargs)
        self.hiddens = []

    def propose(self, context: list[int], k: int):
        self.step = 0
        return super().propose(context, k)

    def _route(self, token: int, previous: torch.Tensor) -> torch.Tensor:
        """Cluster scores [M] for the position of `token`, whose previous hidden state is `previous` [d]."""
        with torch.inference_mode():
            return self.router.scores(self.embedding_rows(torch.tensor([token])), previous[None])[0]

    @torch.inference_mode()
    def feed(self, tokens: list[int]) -> torch.Tensor:
        """Append tokens to the cache, route on the last one, and return its hidden state [1, d]."""
        self.head.add_context(tokens)
        # h_{t-1} is known before this forward only when a single token follows a cached position.
        routed = None
        if self.pool is not None and len(tokens) == 1 and self.hiddens:
            routed = self.pool.submit(self._route, tokens[0], self.hiddens[-1])
        hidden = self.forward(tokens)  # [T, d]
        self.hiddens.extend(hidden)
        if routed is not None:
            scores = routed.result()  # [M]
        else:
            previous = self.hiddens[-2] if len(self.hiddens) >= 2 else torch.zeros_like(self.hiddens[-1])
            scores = self._route(tokens[-1], previous)  # [M]
        self.head.choose(torch.topk(scores, min(self.budget(self.k_max, self.step), scores.numel())).indices)
        self.step += 1
        return hidden[-1:]

    def _crop(self, length: int) -> None:
        super()._crop(length)
        del self.hiddens[length:]


class RoutedLayerDrafter(RoutedDrafting, LayerDrafter):
    """The layers:N drafter with a router-chosen shortlist head (DynaSpec)."""

    def __init__(
        self, target: TargetModel, layers: int, head: ShortlistHead, router: RouterRunner, k_max: int,
        schedule: str = "fixed", overlap: bool = False,
    ) -> None:
        LayerDrafter.__init__(self, target, layers, head)
        self.route_with(target, router, k_max, schedule, overlap)


class RoutedInt8Drafter(RoutedDrafting, Int8Drafter):
    """The int8 self-drafter with a router-chosen shortlist head (DynaSpec on a router trained on the
    final hidden state, which the int8 copy approximates)."""

    def __init__(
        self, target: TargetModel, head: ShortlistHead, router: RouterRunner, k_max: int,
        schedule: str = "fixed", overlap: bool = False,
    ) -> None:
        Int8Drafter.__init__(self, target, head)
        self.route_with(target, router, k_max, schedule, overlap)
