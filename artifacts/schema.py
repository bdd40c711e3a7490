"""Typed stage schemas: per stage, its tensor names, dtypes and symbolic shapes, its parameters and extra files.

Prep writes through a schema and the runtime reads through it (Artifact.write_stage / read_stage
check every stage against its schema), so a file that holds the wrong tensors, another stage's
tensors or tensors of another model's shape is a one-line error, not a KeyError deep in a head.
Shapes are symbolic: `V` (vocabulary) and `d` (hidden size) come from the manifest's model; any
other symbol must take one value across the stage's tensors; `C+1` is one more than `C`; `*` is any.
Adding a stage is one `declare(StageSchema(...))` below.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from artifacts.format import Stage


@dataclass(frozen=True)
class T:
    """One tensor of a stage: dtype and symbolic shape, e.g. T("int8", "V", "d")."""

    dtype: str
    shape: tuple[str, ...]
    optional: bool = False

    def __init__(self, dtype: str, *shape: str, optional: bool = False) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "optional", optional)


@dataclass(frozen=True)
class StageSchema:
    """What one stage holds. `patterns` maps a regex over tensor names to the spec of every match."""

    name: str
    tensors: dict[str, T]
    params: tuple[str, ...] = ()  # required parameter keys
    files: tuple[str, ...] = ()  # extra files besides <name>.safetensors
    patterns: dict[str, T] = field(default_factory=dict)

    def problem(self, tensors: dict[str, torch.Tensor], params: dict, vocab_size: int, hidden_size: int) -> str | None:
        """Return what does not fit this schema (one phrase), or None."""
        missing = [n for n, spec in self.tensors.items() if n not in tensors and not spec.optional]
        if missing:
            owner = _owner(tensors)
            held = f" (it holds stage {owner!r}'s tensors)" if owner and owner != self.name else ""
            return f"lacks tensor(s) {', '.join(missing)}{held}"
        bound = {"V": vocab_size, "d": hidden_size}
        for name, tensor in tensors.items():
            spec = self.tensors.get(name) or next((s for p, s in self.patterns.items() if re.fullmatch(p, name)), None)
            if spec is None:
                return f"holds an unexpected tensor {name!r}"
            if str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                return f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, expected {spec.dtype}"
            if (bad := _shape_problem(tensor.shape, spec.shape, bound)) is not None:
                return f"tensor {name!r} {bad}"
        absent = [k for k in self.params if k not in params]
        if absent:
            return f"has no parameter(s) {', '.join(absent)}"
        return None


def _shape_problem(shape: torch.Size, dims: tuple[str, ...], bound: dict[str, int]) -> str | None:
    """Bind the symbols of `dims` to `shape` (consistently with `bound`); say what does not fit."""
    want = "[" + ", ".join(dims) + "]"
    if len(shape) != len(dims):
        return f"has shape {list(shape)}, expected {want}"
    for size, dim in zip(shape, dims):
        if dim == "*":
            continue
        symbol, _, plus = dim.partition("+")
        value = int(size) - (int(plus) if plus else 0)
        if symbol.isdigit():
            ok = value == int(symbol)
        else:
            ok = bound.setdefault(symbol, value) == value
        if not ok:
            return f"has shape {list(shape)}, expected {want} with {', '.join(f'{k}={v}' for k, v in bound.items())}"
    return None


SCHEMAS: dict[str, StageSchema] = {}


def declare(schema: StageSchema) -> StageSchema:
    """Register a stage's schema (once per stage name)."""
    if schema.name in SCHEMAS:
        raise ValueError(f"stage {schema.name!r} is declared twice")
    SCHEMAS[schema.name] = schema
    return schema


def schema_of(stage: str) -> StageSchema:
    """The schema of `stage`; ValueError for a stage nobody declared."""
    try:
        return SCHEMAS[stage]
    except KeyError:
        raise ValueError(f"no schema is declared for stage {stage!r} (stages: {', '.join(sorted(SCHEMAS))}); "
                         "declare it in artifacts/schema.py") from None


def _owner(tensors: dict[str, torch.Tensor]) -> str | None:
    """The declared stage whose required tensors these are, if any (a file copied from another stage)."""
    for schema in SCHEMAS.values():
        required = {n for n, s in schema.tensors.items() if not s.optional}
        if required and required <= set(tensors):
            return schema.name
    return None


CLUSTERS = declare(StageSchema(
    Stage.CLUSTERS,
    tensors={
        "labels": T("int64", "V"),  # cluster of each token
        "permutation": T("int64", "V"),  # token ids grouped by cluster
        "offsets": T("int64", "C+1"),
        "sizes": T("int64", "C"),
        "centroids": T("float64", "C", "d"),
        "radii": T("float32", "C"),
        "directions": T("float64", "C", "d"),
        "angular_radii": T("float32", "C"),
        "max_norms": T("float32", "C"),
        "bias_top_ids": T("int64", "C", "m", optional=True),  # only for heads with a bias
        "bias_rest_max": T("float32", "C", optional=True),
    },
    params=("clusters", "iterations", "seed", "top_m_bias", "has_bias"),
))

SCREEN = declare(StageSchema(
    Stage.SCREEN,
    tensors={
        "qweight": T("int8", "V", "d"),
        "scales": T("float32", "V", "G"),  # G groups per row (1: per-row scales)
        "error_norms": T("float32", "V"),
        "qrow_norms": T("float32", "V"),
        "row_norms": T("float32", "V"),
    },
    params=("scheme", "group_size", "per_row"),
))

# Per-row norms of the `screen4` stage (prep.screen4 writes them, runtime.heads.screen4_bound reads them).
SCREEN4_ROW_NORMS = ("error_norms", "qrow_norms", "row_norms", "code_norms", "min_norms", "corr_norms", "corr_error_norms")

SCREEN4 = declare(StageSchema(
    Stage.SCREEN4,
    tensors={
        "codes": T("uint8", "V", "H"),  # H = d / 2: two 4-bit codes per byte
        "scales": T("float16", "V", "G"),  # G = d / 32 or d / 64 (the group size)
        "mins": T("float16", "V", "G"),
        "corr": T("int8", "V", "k"),
        "corr_scale": T("float32", "V"),
        "basis": T("float32", "d", "k"),
        **{name: T("float32", "V") for name in SCREEN4_ROW_NORMS},
    },
    params=("bits", "group_size", "rank", "calibration_positions"),
))

ROUTER = declare(StageSchema(
    Stage.ROUTER,
    tensors={
        "embed_dim": T("int64", "1"),
        "cluster_labels": T("int64", "V"),
        "always_ids": T("int64", "A"),
        "token_counts": T("int64", "V"),
    },
    patterns={r"router\..+\.bias": T("float32", "*"), r"router\..+": T("float32", "*", "*")},
    params=("clusters", "hidden", "loss", "width"),
    files=("router.onnx",),
))

GP = declare(StageSchema(
    Stage.GP,
    tensors={},
    # <kind>.<layer>.<group> [in, r] bases and their spectra <key>.energy [r'] (runtime.drafters.gp.basis_key)
    patterns={r"(weights|activations)\.\d+\.\w+": T("float32", "*", "*"),
              r"(weights|activations)\.\d+\.\w+\.energy": T("float32", "*")},
    params=("max_rank", "kinds", "groups", "layers"),
))

ONEDECODE = declare(StageSchema(
    Stage.ONEDECODE,
    tensors={
        "single.keys": T("int64", "S"), "single.tokens": T("int64", "S", "K"),
        "single.confidence": T("float32", "S", "K"), "single.hits": T("int32", "S", "K"),
        "single.count": T("int32", "S"),
        "pair.keys": T("int64", "P", "2"), "pair.tokens": T("int64", "P", "K"),
        "pair.confidence": T("float32", "P", "K"), "pair.hits": T("int32", "P", "K"),
        "pair.count": T("int32", "P"),
    },
    params=("v_bake", "top_k"),
))

# The EAGLE-3 draft head (prep train-drafter), under the checkpoint names of runtime.drafters.eagle.
# Q = heads x head_dim, K = kv heads x head_dim, F = the MLP width, Vd = the draft vocabulary.
DRAFTER = declare(StageSchema(
    Stage.DRAFTER,
    tensors={
        "fc.weight": T("float32", "d", "*"),
        "midlayer.input_layernorm.weight": T("float32", "d"),
        "midlayer.hidden_norm.weight": T("float32", "d"),
        "midlayer.self_attn.q_proj.weight": T("float32", "Q", "*"),
        "midlayer.self_attn.k_proj.weight": T("float32", "K", "*"),
        "midlayer.self_attn.v_proj.weight": T("float32", "K", "*"),
        "midlayer.self_attn.o_proj.weight": T("float32", "d", "Q"),
        "midlayer.post_attention_layernorm.weight": T("float32", "d"),
        "midlayer.mlp.gate_proj.weight": T("float32", "F", "d"),
        "midlayer.mlp.up_proj.weight": T("float32", "F", "d"),
        "midlayer.mlp.down_proj.weight": T("float32", "d", "F"),
        "norm.weight": T("float32", "d"),
        "lm_head.weight": T("float32", "Vd", "d"),
        "d2t": T("int64", "Vd"),
        "t2d": T("bool", "V"),
        "draft_order": T("int64", "Vd"),  # draft-vocabulary rows, the target's most chosen first (FR-Spec lists)
    },
    params=("hidden_size", "num_heads", "kv_heads", "head_dim", "intermediate_size", "draft_vocab", "vocab_size",
            "feature_layers", "rope_theta", "steps", "max_positions"),
))

# DynaSpec's router over the draft head's vocabulary (prep train-drafter-router): cluster_labels [Vd]
# groups the head's rows; the router scores the clusters from the fed token's embedding and the
# head's output. params drafter_sha256: the stage drafter it was trained on.
DRAFTER_ROUTER = declare(StageSchema(
    Stage.DRAFTER_ROUTER,
    tensors={
        "embed_dim": T("int64", "1"),
        "cluster_labels": T("int64", "Vd"),
    },
    patterns={r"router\..+\.bias": T("float32", "*"), r"router\..+": T("float32", "*", "*")},
    params=("clusters", "width", "drafter_sha256"),
    files=("drafter_router.onnx",),
))
