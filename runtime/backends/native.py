"""The native backend: the decoder ladder over the GGUF file's own quantized blocks.

The fp32 weights the lean backend runs are gguf-py's `dequantize` of the file's blocks
(transformers' GGUF loader). The native backend memory-maps the same file and its kernels
(runtime.kernels) dequantize each block in registers to exactly those fp32 values and sum every
output in the lean kernel's order, so hidden states are bit-identical to the lean backend's while
a decode step reads the file's ~0.6-1.1 bytes per weight instead of 4. No fp32 copy of the
weights is held: only norms and biases (F32 tensors, a few KB per layer) are materialized.

What transformers does to GGUF tensors is repeated here: gemma's norm weights are stored as
w + 1 (subtracted back), llama's q/k rows are stored permuted for llama.cpp's rotary layout (their
block rows are copied once into transformers' order: the same bytes, ~5 % of a llama file), and
q/k/v and gate/up stay separate matrices whose outputs one kernel call writes side by side (the
lean backend fuses them; each output is the same dot product either way).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from runtime.backends.decoder import Decoder
from runtime.backends.layers import DecoderLayer, KernelProjection, RMSNorm, UnsupportedModel, check_supported, layer_type
from runtime.backends.gguf_file import GGUFError, GGUFFile
from runtime.backends.target import DecoderTarget
from runtime.kernels import QuantMatrix, dequantize, quant_linear_parts, take_rows
from runtime.kernels import hugepages
from runtime.kernels.quant import SUPPORTED_GGML_TYPES, kernel_layout, type_name


class NativeProjection(KernelProjection):
    """y = x Wᵀ + b over one or more GGUF matrices whose outputs sit side by side (q/k/v, gate/up).

    One kernel call fills the output from every part's blocks, bit-identical to the lean kernel on
    the dequantized, concatenated rows, for any number of rows (prefill chunks included).
    """

    def __init__(self, parts: list[QuantMatrix], bias: torch.Tensor | None = None) -> None:
        self.parts = parts
        self.bias = bias  # [out]

    def dense(self) -> torch.Tensor:
        """The fp32 weight [out, in] the lean backend holds for this projection."""
        rows = [dequantize(w) for w in self.parts]
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def kernel_parts(self) -> tuple[list[QuantMatrix], torch.Tensor | None]:
        """The GGUF matrices and the bias: what one kernel call takes."""
        return self.parts, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = quant_linear_parts(x, self.parts)  # [T, out]
        return out.add_(self.bias) if self.bias is not None else out


class GGUFTensors:
    """The tensors of a memory-mapped GGUF file by name (zero-copy torch views)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = GGUFFile(path)
        except GGUFError as exc:
            raise UnsupportedModel(str(exc)) from exc
        self.types = {name: info.ggml_type for name, info in self.file.tensors.items()}
        unsupported = sorted({t for t in self.types.values() if t not in SUPPORTED_GGML_TYPES})
        if unsupported:
            names = ", ".join(type_name(t) for t in unsupported)
            raise UnsupportedModel(f"{path.name} holds tensor type(s) {names}, which the native backend does not read; use --backend lean")

    def __contains__(self, name: str) -> bool:
        return name in self.types

    def matrix(self, name: str) -> QuantMatrix:
        """A 2-D tensor as a QuantMatrix over the mapped bytes [rows, row_bytes]."""
        cols, rows = self.file.tensors[name].dims
        return QuantMatrix.from_numpy(self.file.array(name), self.types[name], int(rows), int(cols))

    def vector(self, name: str) -> torch.Tensor | None:
        """A 1-D F32 tensor (norm weight, bias) copied into memory, or None when the file lacks it."""
        if name not in self.types:
            return None
        if self.types[name] != 0:  # GGML F32
            raise UnsupportedModel(f"{self.path.name}: {name} is not stored as F32; use --backend lean")
        return torch.from_numpy(self.file.array(name).copy().view(np.float32).reshape(-1))


@lru_cache(maxsize=4)
def _open_gguf(path: Path, mtime_ns: int, size: int) -> GGUFTensors:
    return GGUFTensors(path)


def open_gguf(path: str | Path) -> GGUFTensors:
    """The tensor directory of a GGUF file, parsed once per file version (choosing the backend and
    building it both read it)."""
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise UnsupportedModel(f"{path} cannot be read ({exc.strerror}); check the path, or use --backend lean") from exc
    return _open_gguf(path, stat.st_mtime_ns, stat.st_size)


_PLACE_SLICE_BYTES = 8 << 20  # bytes of a mapped tensor copied into huge pages before its pages are released


def _rope_order(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation (transformers' _reverse_permute_weights)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


class _Builder:
    """Builds the ladder of one GGUF file against a meta-device skeleton of the transformers model."""

    def __init__(self, tensors: GGUFTensors, config) -> None:
        from transformers import AutoModelForCausalLM

        self.tensors, self.config = tensors, config
        self.gemma = config.model_type.startswith("gemma")
        self.permuted = config.model_type == "llama"
        with torch.device("meta"):
            self.skeleton = AutoModelForCausalLM.from_config(config)
        self.body = self.skeleton.get_decoder()

    def norm(self, template: torch.nn.Module, name: str) -> RMSNorm:
        """The norm `template` (a meta-device module: its eps) with the file's weight `name` (gemma's stored as 1 + w)."""
        weight = self.tensors.vector(name)
        if weight is None:
            raise UnsupportedModel(f"{self.tensors.path.name} has no tensor {name}; use --backend lean")
        return RMSNorm.of_module(template, self.gemma, weight - 1 if self.gemma else weight)  # transformers' Gemma2TensorProcessor

    def projection(self, names: list[str], heads: list[int | None], bias: bool = False) -> NativeProjection:
        """The projection over tensors `names` (outputs concatenated); heads: the rotary head count of a
        llama q/k tensor whose rows llama.cpp permuted, else None."""
        parts = [self.weight(f"{name}.weight", count) for name, count in zip(names, heads)]
        biases = [self.tensors.vector(f"{name}.bias") for name in names] if bias else []
        if biases and any(b is None for b in biases):
            raise UnsupportedModel("q/k/v projections with partial biases are not supported; use --backend transformers")
        return NativeProjection(parts, torch.cat(biases) if biases else None)

    def weight(self, name: str, rope_heads: int | None = None, repack: bool = True) -> QuantMatrix:
        """The file's matrix `name` as the kernels read it, in huge-page memory where there is some (else
        the mapped bytes, unless a copy was needed); the file's mapped pages of it released once copied.

        rope_heads: the rotary head count of a llama q/k tensor whose rows llama.cpp permuted (the rows
        are put back in transformers' order); repack: the layer matrices' kernel_layout, packed straight
        into huge-page memory (the table and head keep the file's format).
        """
        mapped = self.tensors.matrix(name)
        matrix = mapped
        if self.permuted and rope_heads:  # a copy of the rows in transformers' order (q and k: small)
            matrix = replace(mapped, data=mapped.data[_rope_order(mapped.rows, rope_heads)])
        laid_out = kernel_layout(matrix, hugepages.empty) if repack else matrix
        if laid_out is mapped:  # the file's bytes as they are: placed a slice at a time, each released as it goes
            return replace(mapped, data=self.placed(name, mapped.data))
        if laid_out is matrix:  # a reordered copy, as it is
            laid_out = replace(matrix, data=hugepages.resident(matrix.data))
        self.tensors.file.release(name)  # laid_out is a copy (a reorder or a repack): the mapped pages are not needed
        return laid_out

    def placed(self, name: str, data: torch.Tensor) -> torch.Tensor:
        """The file's tensor `name` (data: its mapped bytes [rows, row_bytes]) copied into huge-page
        memory a slice at a time, each slice's mapped pages released once copied, so that a large
        table (gemma3-270m's: 180 MB) is never resident twice; `data` itself where there are no huge pages."""
        if not hugepages.enabled():
            return data
        out = hugepages.empty(tuple(data.shape), data.dtype)  # [rows, row_bytes]
        row_bytes = data.shape[1]
        step = max(1, _PLACE_SLICE_BYTES // row_bytes)  # rows per slice
        for start in range(0, data.shape[0], step):
            out[start:start + step] = data[start:start + step]
            self.tensors.file.release(name, start * row_bytes, (start + step) * row_bytes)
        return out

    def layer(self, index: int) -> DecoderLayer:
        hf, blk, config = self.body.layers[index], f"blk.{index}", self.config
        attn = hf.self_attn
        kind = layer_type(config, index)
        window = getattr(attn, "sliding_window", None) if kind == "sliding_attention" else None
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        has_bias = f"{blk}.attn_q.bias" in self.tensors
        return DecoderLayer(
            input_norm=self.norm(hf.input_layernorm, f"{blk}.attn_norm.weight"),
            qkv=self.projection([f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"], [heads, kv, None], bias=has_bias),
            q_norm=self.norm(attn.q_norm, f"{blk}.attn_q_norm.weight") if self.gemma else None,
            k_norm=self.norm(attn.k_norm, f"{blk}.attn_k_norm.weight") if self.gemma else None,
            o=self.projection([f"{blk}.attn_output"], [None], bias=f"{blk}.attn_output.bias" in self.tensors),
            post_attention_norm=self.norm(hf.post_attention_layernorm, f"{blk}.post_attention_norm.weight") if self.gemma else None,
            pre_mlp_norm=self.norm(hf.pre_feedforward_layernorm if self.gemma else hf.post_attention_layernorm, f"{blk}.ffn_norm.weight"),
            post_mlp_norm=self.norm(hf.post_feedforward_layernorm, f"{blk}.post_ffw_norm.weight") if self.gemma else None,
            gate_up=self.projection([f"{blk}.ffn_gate", f"{blk}.ffn_up"], [None, None]),
            down=self.projection([f"{blk}.ffn_down"], [None]),
            activation=copy.deepcopy(hf.mlp.act_fn),
            scaling=float(attn.scaling),
            window=int(window) if window else None,
            rope=kind,
        )

    def embed(self, table: QuantMatrix):
        """ids [T] -> rows [T, d], scaled as transformers' embedding module scales them (gemma: sqrt(d))."""
        scalar = getattr(self.body.embed_tokens, "scalar_embed_scale", None)
        scale = torch.tensor(scalar) if scalar is not None else None  # a float32 0-d tensor, as transformers builds it

        def embed(ids: torch.Tensor) -> torch.Tensor:
            rows = take_rows(table, ids)  # [T, d]
            return rows * scale if scale is not None else rows

        return embed

    def decoder(self, table: QuantMatrix) -> Decoder:
        rotary = type(self.body.rotary_emb)(config=self.config)  # real tables on the CPU, not meta
        layers = [self.layer(i) for i in range(self.config.num_hidden_layers)]
        norm = self.norm(self.body.norm, "output_norm.weight")
        return Decoder(self.config, self.embed(table), layers, norm, rotary, self.body.layers[0].self_attn.head_dim)


def native_target(gguf_path: str | Path, config, eos_token_ids: set[int] | frozenset[int]) -> DecoderTarget:
    """TargetModel over a GGUF file's blocks, bit-identical to the lean backend: the matrices copied into
    huge-page memory where the kernel gives it (runtime.kernels.hugepages), else read from the mapped file.

    UnsupportedModel (one line, naming `--backend lean`) for an architecture the ladder lacks or a
    tensor type the kernels do not read.
    """
    check_supported(config)
    tensors = open_gguf(gguf_path)
    torch.set_flush_denormal(True)  # as the lean backend, so both treat subnormal weights alike
    builder = _Builder(tensors, config)
    table = builder.weight("token_embd.weight", repack=False)
    head = builder.weight("output.weight", repack=False) if "output.weight" in tensors else table
    return DecoderTarget("native", builder.decoder(table), table, head, tensors.vector("output.bias"), eos_token_ids)
