"""The `eagle` drafter: a trained EAGLE-3 head (stage `drafter`) drafting from the target's own features.

The target's decoder writes the residual stream entering the head's feature layers into its KV
cache (KVCache.tap), so the verify forward the loop runs anyway computes the head's input: no
extra target work. Per round the head first catches up on the positions the target verified since
the last round (one forward over their features), then drafts one token per step from its own
output, with its own one-layer KV cache (cropped back to the verified positions after the round).

The head runs on the native kernels: every matrix is requantized to Q8_0 once at load (a quarter of
fp32's bytes; a drafted token's cost is what matters, and drafts never change the output: the
verifier is exact), and its decoder layer is one compiled call, the target decoder's own
(layer_plan.h), where the kernels are compiled. Drafts are the head's top-1 mapped to target ids
(point masses, so exact sampling verifies them as Chen et al.'s q = delta). `frspec=N` keeps only
the N draft-vocabulary rows the target chose most often in training (FR-Spec's shortlist on the
head); `dynaspec=K` scores, per draft, the rows of the K clusters DynaSpec's router ranks highest
(stage drafter_router, the DynaSpec paper's setting: a router shortlisting an EAGLE head's LM head). `conf=P` stops a
chain where the head's confidence in it, the product of its top-1 probabilities so far (EAGLE-2's
path score), falls below P: a draft the head doubts costs a verify row and a head step, and usually
buys nothing. The cut reads only the head's own state, so exact sampling stays exact. Without it
every position is drafted (conf=0), the meaning `spec:eagle` has in the bench records. conf=0.4 is
the value for the head alone: on gemma3-270m's head it turned 0.95x / 0.92x `ar` (HumanEval / ShareGPT)
into 1.15x / 1.15x, with 0.2-0.6 within 6 % of it (docs/draft-head.md). `head=H` caps the head's own
chain at H tokens a round while lookup's matches keep the round's length. Beside lookup one head draft
a round pays best: a later one adds a verify row (exact fp32 work; with `+csv:screen4` past two rows the
int8 screen's pass instead of the 4-bit one's) that costs more than the tokens it brings, so `conf=0.3:head=1:lookup` (the
default method's drafter with a head) ran 1.1-7.7 % faster than `conf=0.4:lookup` in 10 of the AMD
EPYC Zen 5's 12 cells and at most 1.6 % slower in the other 2 (docs/draft-head.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from runtime.backends.rows import Rows
from runtime.common.checks import is_digits
from runtime.common.sampling import NO_BAN, SamplingParams, TokenBan
from runtime.drafters.arguments import number_text, unit_number
from runtime.drafters.base import Proposal, Verdict, empty_proposal
from runtime.drafters.eagle_head import NORM_EPS, EagleConfig, EagleHead, rotary
from runtime.drafters.lookup import LookupDrafter
from runtime.drafters.registry import DraftContext
from runtime.drafters.router import HEAD_ROUTER_ONNX_FILE, RouterRunner
from runtime.kernels import QuantMatrix, attend, layer_plan, linear, prepare_qkv, quant_linear_parts, rms_norm

# EagleHead's parameter names -> the EAGLE-3 checkpoint's (what vLLM, SGLang and llama.cpp's converter read).
CHECKPOINT_NAMES = {
    "fc.weight": "fc.weight",
    "input_layernorm": "midlayer.input_layernorm.weight",
    "hidden_norm": "midlayer.hidden_norm.weight",
    "q_proj.weight": "midlayer.self_attn.q_proj.weight",
    "k_proj.weight": "midlayer.self_attn.k_proj.weight",
    "v_proj.weight": "midlayer.self_attn.v_proj.weight",
    "o_proj.weight": "midlayer.self_attn.o_proj.weight",
    "post_attention_layernorm": "midlayer.post_attention_layernorm.weight",
    "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
    "up_proj.weight": "midlayer.mlp.up_proj.weight",
    "down_proj.weight": "midlayer.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}
CACHE_CAPACITY = 512  # the head's K/V rows at first; doubled as a sequence grows


def stage_tensors(head: EagleHead) -> dict[str, torch.Tensor]:
    """The head's weights under their checkpoint names (stage `drafter`), float32, contiguous."""
    state = head.state_dict()
    return {CHECKPOINT_NAMES[k]: (v.float() if v.is_floating_point() else v).contiguous() for k, v in state.items()}


def head_from_stage(tensors: dict[str, torch.Tensor], config: EagleConfig) -> EagleHead:
    """An EagleHead holding a stage's tensors."""
    head = EagleHead(config)
    head.load_state_dict({name: tensors[checkpoint] for name, checkpoint in CHECKPOINT_NAMES.items()})
    return head.eval()


def q8_0(weight: torch.Tensor) -> QuantMatrix:
    """A float weight [out, in] requantized to Q8_0 (gguf-py's quantizer): what the kernels stream for it."""
    rows, cols = weight.shape
    blocks = quantize(weight.detach().float().contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return QuantMatrix.from_numpy(np.ascontiguousarray(blocks), GGMLQuantizationType.Q8_0, rows, cols)


@dataclass(frozen=True)
class KernelWeights:
    """An EagleHead's weights as the native kernels read them: every matrix requantized to Q8_0 once.

    Built once per session (DraftContext.once) and shared by every drafter over it: requantizing
    takes ~0.4 s, which a server would otherwise pay on each request.
    """

    config: EagleConfig
    fc: QuantMatrix
    qkv: list[QuantMatrix]
    o: QuantMatrix
    gate_up: list[QuantMatrix]
    down: QuantMatrix
    lm_head: QuantMatrix  # the kept draft-vocabulary rows
    token_ids: torch.Tensor  # [rows]: the target id of each kept row
    norms: dict[str, torch.Tensor]
    plan: object | None  # the layer as one compiled call (layer_plan.h's forward_input), None without compiled kernels

    @classmethod
    def of(cls, head: EagleHead, shortlist: torch.Tensor | None = None) -> KernelWeights:
        """head's weights, its LM head cut to the draft-vocabulary rows `shortlist` (None: all)."""
        rows = torch.arange(head.config.draft_vocab) if shortlist is None else shortlist
        qkv = [q8_0(head.q_proj.weight), q8_0(head.k_proj.weight), q8_0(head.v_proj.weight)]
        o, gate_up, down = q8_0(head.o_proj.weight), [q8_0(head.gate_proj.weight), q8_0(head.up_proj.weight)], q8_0(head.down_proj.weight)
        norms = {name: getattr(head, name).detach().float().clone()
                 for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm")}
        return cls(head.config, q8_0(head.fc.weight), qkv, o, gate_up, down, q8_0(head.lm_head.weight[rows]),
                   head.draft_ids()[rows], norms, _layer_plan(head.config, qkv, o, gate_up, down, norms["post_attention_layernorm"]))


def _layer_plan(c: EagleConfig, qkv: list[QuantMatrix], o: QuantMatrix, gate_up: list[QuantMatrix], down: QuantMatrix,
                pre_mlp: torch.Tensor):
    """The head's decoder layer as a compiled LayerPlan (Llama's: its only norm inside is the pre-MLP one,
    post_attention_layernorm), or None without compiled kernels."""
    norms = [None, None, None, None, (pre_mlp, NORM_EPS), None]
    projections = [(qkv, None), ([o], None), (gate_up, None), ([down], None)]
    return layer_plan(norms, projections, c.num_heads, c.kv_heads, c.head_dim, c.head_dim ** -0.5, "silu")


class ClusterRouter:
    """DynaSpec's router on the head (stage drafter_router): the rows of the top-k clusters for a head step.

    The head's LM-head rows are stored grouped by cluster (KernelWeights built with HeadRouterStage.order),
    so cluster c is rows starts[c]..starts[c + 1] - 1.
    """

    def __init__(self, runner: RouterRunner, starts: torch.Tensor, k: int) -> None:
        self.runner, self.k = runner, k
        self.starts = starts.tolist()  # [M + 1]

    def rows(self, embed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The LM-head rows [n] of the k clusters the router ranks highest for the fed token's embedding
        and the head's output (both [1, d]), ascending."""
        clusters = self.runner.scores(embed, out)[0].topk(self.k).indices.sort().values.tolist()
        return torch.cat([torch.arange(self.starts[c], self.starts[c + 1]) for c in clusters])


class KernelHead:
    """An EagleHead's forward on the native kernels (its KernelWeights), over a one-layer KV cache of its own."""

    def __init__(self, weights: KernelWeights, router: ClusterRouter | None = None) -> None:
        self.weights = weights  # shared with every KernelHead over the session: never written
        self.router = router  # None: score every kept row
        c = self.config = weights.config
        self.keys = torch.zeros(c.kv_heads, CACHE_CAPACITY, c.head_dim)
        self.values = torch.zeros_like(self.keys)
        self.cos, self.sin = rotary(torch.arange(CACHE_CAPACITY), c.head_dim, c.rope_theta)  # [capacity, hd] each
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Fused features [T, d] of the target's tapped layers [T, 3d]."""
        return linear(features, self.weights.fc)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
        """Append rows (token embeddings, hidden inputs [T, d]) to the cache; their layer outputs [T, d].

        By default the rows are a chain at the next positions, each seeing every cached row before it.
        A token tree's level gives its Rows (runtime.backends.rows): its nodes' positions, and the keys each
        sees (the verified prefix, its ancestors' rows and its own). The layer is the target decoder's own
        compiled call (layer_plan.h) where the kernels are compiled, else the same ops one at a time.
        """
        c, w, count, start = self.config, self.weights, embeds.shape[0], self.length
        n = w.norms
        rows = rows or Rows(start, count)
        if rows.start != start or rows.count != count:
            raise ValueError(f"a head step appends {count} rows at {start}, not {rows.count} at {rows.start}")
        x = torch.cat([rms_norm(embeds, n["input_layernorm"], NORM_EPS), rms_norm(hidden, n["hidden_norm"], NORM_EPS)], dim=1)  # [T, 2d]
        self._reserve(start + count)
        self.length = start + count
        first, end, extra = rows.keys(None)
        if w.plan is not None:
            return w.plan.forward_input(x, hidden, self.keys, self.values, rows.positions, first, end, extra, start, self.cos, self.sin)
        qkv = quant_linear_parts(x, w.qkv).view(count, c.num_heads + 2 * c.kv_heads, c.head_dim)  # [T, H + 2 KV, hd]
        prepare_qkv(qkv, c.num_heads, None, 0.0, (self.cos, self.sin), rows.positions, self.keys, self.values, start)
        x = hidden + linear(attend(qkv, c.num_heads, self.keys, self.values, first, end, extra, c.head_dim ** -0.5), w.o)
        gate_up = quant_linear_parts(rms_norm(x, n["post_attention_layernorm"], NORM_EPS), w.gate_up)  # [T, 2 F]
        half = gate_up.shape[1] // 2
        return x + linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], w.down)

    def top1(self, out: torch.Tensor, embed: torch.Tensor) -> tuple[int, float]:
        """(target id, probability over the scored rows) of the best draft-vocabulary token for the last
        layer output of out [T, d]; embed [1, d]: the embedding of the token that step fed (the router's input).
        The scored rows are the kept ones, or with a router those of its top-k clusters."""
        ids, probs = self.top_k(out[-1:], embed, 1)
        return ids[0][0], probs[0][0]

    def top_k(self, out: torch.Tensor, embed: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """The k best draft-vocabulary tokens (target ids) and their probabilities over the scored rows,
        per row of layer outputs out [n, d] (embed [n, d]: the embeddings those rows fed), best first."""
        w = self.weights
        if self.router is None:
            return self._top(linear(rms_norm(out, w.norms["norm"], NORM_EPS), w.lm_head), w.token_ids, k)
        picks = []
        for i in range(out.shape[0]):  # each row scores its own clusters
            rows = self.router.rows(embed[i : i + 1], out[i : i + 1])  # [n]
            lm_head = QuantMatrix(w.lm_head.data.index_select(0, rows), w.lm_head.ggml_type, rows.numel(), w.lm_head.cols)
            picks.append(self._top(linear(rms_norm(out[i : i + 1], w.norms["norm"], NORM_EPS), lm_head), w.token_ids[rows], k))
        return [ids[0] for ids, _ in picks], [probs[0] for _, probs in picks]

    @staticmethod
    def _top(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Per row of logits [n, rows] over rows holding target ids token_ids [rows]: the k best ids and their softmax."""
        top = logits.topk(min(k, logits.shape[1]), dim=1)  # ranked by logit, as the module's argmax
        probs = torch.softmax(logits, dim=1).gather(1, top.indices)
        return token_ids[top.indices].tolist(), probs.tolist()

    def _reserve(self, length: int) -> None:
        """Room for `length` rows in the cache and the rotary tables (doubling)."""
        if length > self.keys.shape[1]:
            capacity = max(length, 2 * self.keys.shape[1])
            self.cos, self.sin = rotary(torch.arange(capacity), self.config.head_dim, self.config.rope_theta)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)


class EagleDrafter:
    """Drafts a chain per round from the target's tapped features (runtime.backends.base.KVCache.tap)."""

    def __init__(self, target, weights: KernelWeights, lookup: LookupDrafter | None = None,
                 min_confidence: float = 0.0, router: ClusterRouter | None = None, head_drafts: int | None = None) -> None:
        self.target = target
        self.head = KernelHead(weights, router)
        self.lookup = lookup  # drafts first where it finds a match
        self.min_confidence = min_confidence  # a chain ends before the draft that takes its path score below this
        self.head_drafts = head_drafts  # the most tokens the head drafts a round (None: the round's k); lookup's are not cut
        self.layers = weights.config.feature_layers
        self.cache = None  # the target's KV cache, whose taps hold the features
        self.fed = 0  # verified positions the head's cache holds (its rows 0..fed-1)
        self.out: torch.Tensor | None = None  # the head's output at row fed - 1 [1, d]
        self.embed: torch.Tensor | None = None  # the embedding of the token row fed - 1 read [1, d]

    def follow(self, cache) -> None:
        """Read the features of the target cache `cache` (the loop calls this before its prefill)."""
        cache.tap(self.layers)
        self.cache = cache

    def reset(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None,
              ban: TokenBan = NO_BAN) -> None:
        self.head.crop(0)
        self.fed, self.out, self.embed = 0, None, None
        if self.lookup is not None:
            self.lookup.reset(prompt, params, generator, ban)

    def propose(self, context: list[int], k: int) -> Proposal:
        verified = len(context) - 1  # the target cache holds features of context[:-1]
        if k <= 0 or self.cache is None or verified < 1:
            return empty_proposal()
        if self.lookup is not None:
            found = self.lookup.propose(context, k)
            if found.tokens.numel():
                return found  # the head catches up on these positions next time it drafts
        self.catch_up(context)
        if self.head_drafts is not None:
            k = min(k, self.head_drafts)
        drafts, out, embed, confidence = [], self.out, self.embed, 1.0
        for _ in range(k):
            token, prob = self.head.top1(out, embed)
            confidence *= prob
            if confidence < self.min_confidence:
                break
            drafts.append(token)
            if len(drafts) < k:
                embed = self.target.embedding_rows(torch.tensor([token]))  # [1, d]
                out = self.head.step(embed, out)
        self.head.crop(self.fed)
        return Proposal(torch.tensor(drafts, dtype=torch.long))

    def catch_up(self, context: list[int]) -> None:
        """Feed the head the positions the target verified since its last draft (row t reads the features
        at t and the token t + 1), so that self.out is its output at the context's last verified row."""
        verified = len(context) - 1  # the target cache holds features of context[:-1]
        if self.fed < verified:
            features = self.cache.features[self.fed : verified]  # [n, 3d]
            embeds = self.target.embedding_rows(torch.tensor(context[self.fed + 1 : verified + 1]))  # [n, d]
            self.out = self.head.step(embeds, self.head.fuse(features))[-1:]
            self.embed = embeds[-1:]
            self.fed = verified

    def observe(self, verdict: Verdict) -> None:
        """The head learns nothing (the next propose catches up on the verified positions); lookup follows the text."""
        if self.lookup is not None:
            self.lookup.observe(verdict)


EAGLE_EXAMPLE = ("e.g. eagle, eagle:frspec=4096, eagle:dynaspec=8, eagle:conf=0.4, eagle:lookup, eagle:head=1:lookup or "
                 "eagle:from=art/other")


@dataclass(frozen=True)
class EagleOptions:
    """eagle[:from=ART][:frspec=N|dynaspec=K][:conf=P][:head=H][:lookup]: from=ART reads the head (stages drafter,
    drafter_router) from another artifact built for the same model, a path without ':' (two heads
    compared over one loaded target, in one bench run); frspec=N (N >= 1) keeps the head's N most chosen
    draft-vocabulary rows; dynaspec=K (K >= 1) scores, per draft, the rows of the K clusters DynaSpec's
    router ranks highest (stage drafter_router); conf=P (0 <= P <= 1; 0, the default, drafts every
    position) ends a chain where the product of the head's top-1 probabilities falls below P; head=H
    (H >= 1) lets the head draft at most H tokens a round; lookup drafts by prompt lookup first, its
    matches up to the round's full length whatever H is. Canonical order: from, frspec or dynaspec,
    conf (unless 0), head, then lookup."""

    frspec: int | None = None
    lookup: bool = False
    confidence: float = 0.0
    dynaspec: int | None = None
    source: str | None = None  # from=ART; None: the session's artifact
    head_drafts: int | None = None  # head=H: the most tokens the head drafts a round; None: the round's length

    @classmethod
    def parse(cls, args: list[str]) -> EagleOptions:
        frspec, dynaspec, lookup, confidence, source, head_drafts = None, None, False, None, None, None
        for arg in args:
            option, _, value = arg.partition("=")
            positive = is_digits(value) and int(value) >= 1
            if option == "from" and source is None and value:
                source = value
            elif option == "frspec" and frspec is None and dynaspec is None and positive:
                frspec = int(value)
            elif option == "dynaspec" and dynaspec is None and frspec is None and positive:
                dynaspec = int(value)
            elif option == "conf" and confidence is None and unit_number(value) is not None:
                confidence = unit_number(value)
            elif option == "head" and head_drafts is None and positive:
                head_drafts = int(value)
            elif arg == "lookup" and not lookup:
                lookup = True
            else:
                raise ValueError(f"eagle takes from=ART, frspec=N or dynaspec=K (N, K >= 1), conf=P (0 <= P <= 1), "
                                 f"head=H (H >= 1) and lookup, each at most once, not {arg!r}; {EAGLE_EXAMPLE}")
        return cls(frspec, lookup, confidence or 0.0, dynaspec, source, head_drafts)

    def format(self) -> tuple[str, ...]:
        words = [] if self.source is None else [f"from={self.source}"]
        words += [] if self.frspec is None else [f"frspec={self.frspec}"]
        words += [] if self.dynaspec is None else [f"dynaspec={self.dynaspec}"]
        words += [f"conf={number_text(self.confidence)}"] if self.confidence else []
        words += [] if self.head_drafts is None else [f"head={self.head_drafts}"]
        return (*words, *["lookup"] * self.lookup)

    def build(self, context: DraftContext) -> EagleDrafter:
        """The eagle drafter over the artifact's stage `drafter` (trained by prep train-drafter)."""
        from artifacts.format import Stage

        target = context.target
        artifact = context.artifact if self.source is None else self.other_artifact(context)
        if artifact is None or not artifact.has_stage(Stage.DRAFTER):
            where = artifact.path if artifact is not None else "ART"
            raise ValueError(f"the eagle drafter needs stage drafter; run: prep train-drafter {where} --features FEATURES")
        if not hasattr(target, "decoder"):
            raise ValueError("the eagle drafter reads the target's layers on the native or lean backend; use --backend native")
        config = EagleConfig.from_params(artifact.stage_params(Stage.DRAFTER))
        if self.frspec is not None and self.frspec > config.draft_vocab:
            raise ValueError(f"eagle:frspec={self.frspec} exceeds the head's draft vocabulary of {config.draft_vocab}; "
                             f"give N <= {config.draft_vocab}")
        stage = None
        if self.dynaspec is not None:
            stage = context.once(("eagle", self.source, "router"), lambda: HeadRouterStage.load(artifact))
            stage.check_k(self.dynaspec)
            weights = context.once(("eagle", self.source, "dynaspec"), lambda: KernelWeights.of(
                head_from_stage(artifact.read_stage(Stage.DRAFTER), config), stage.order))
        else:
            weights = context.once(("eagle", self.source, self.frspec),
                                   lambda: self.weights(artifact.read_stage(Stage.DRAFTER), config))
        router = None if stage is None else ClusterRouter(stage.runner, stage.starts, self.dynaspec)
        return EagleDrafter(target, weights, LookupDrafter() if self.lookup else None, self.confidence, router,
                            self.head_drafts)

    def other_artifact(self, context: DraftContext):
        """The artifact from=ART names, checked to be built for the session's model (a one-line error if not)."""
        from artifacts import Artifact, same_model

        other = Artifact.open(self.source)
        model = context.target_info if context.target_info is not None else getattr(context.artifact, "model", None)
        if model is not None and not same_model(other.model, model):
            raise ValueError(f"eagle:from={self.source} was built for {other.model.name}, not this session's "
                             f"{model.name}; name an artifact of {model.name}")
        return other

    def weights(self, tensors: dict[str, torch.Tensor], config: EagleConfig) -> KernelWeights:
        """Stage drafter's tensors on the kernels, cut to FR-Spec's shortlist (the draft rows chosen most in training) if asked."""
        shortlist = None if self.frspec is None else tensors["draft_order"][: self.frspec].sort().values
        return KernelWeights.of(head_from_stage(tensors, config), shortlist)


@dataclass(frozen=True)
class HeadRouterStage:
    """Stage drafter_router, loaded once a session: the router on ONNX Runtime and the head's rows grouped by cluster."""

    runner: RouterRunner
    order: torch.Tensor  # [Vd]: the head's rows, cluster 0's first (stable within a cluster)
    starts: torch.Tensor  # [M + 1]: cluster c is order[starts[c] : starts[c + 1]]

    @classmethod
    def load(cls, artifact) -> HeadRouterStage:
        from artifacts.format import Stage

        if not artifact.has_stage(Stage.DRAFTER_ROUTER):
            raise ValueError(f"eagle:dynaspec needs stage drafter_router; run: prep train-drafter-router {artifact.path}")
        params = artifact.stage_params(Stage.DRAFTER_ROUTER)
        if params["drafter_sha256"] != artifact.tensors_sha256(Stage.DRAFTER):
            raise ValueError(f"{artifact.path}'s stage drafter_router was trained for another draft head; "
                             f"run: prep train-drafter-router {artifact.path} --force")
        tensors = artifact.read_stage(Stage.DRAFTER_ROUTER)
        labels = tensors["cluster_labels"]  # [Vd]
        counts = torch.bincount(labels, minlength=params["clusters"])
        starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        runner = RouterRunner(tensors, str(artifact.stage_file(Stage.DRAFTER_ROUTER, HEAD_ROUTER_ONNX_FILE)))
        return cls(runner, torch.argsort(labels, stable=True), starts)

    def check_k(self, k: int) -> int:
        clusters = self.starts.numel() - 1
        if k > clusters:
            raise ValueError(f"eagle:dynaspec={k} exceeds the router's {clusters} clusters; give K <= {clusters}")
        return k
