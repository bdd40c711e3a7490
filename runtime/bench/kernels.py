"""Time the screening kernels on this machine, in one run, against the backend's exact head.

The reference row is the exact head the target decodes with (the GGUF's own blocks on the native
backend, float32 on lean). Then the screens the certified head runs: the int8 screen (its int16-split
integer path and its float32-activation path) and, where the artifact has the stage and the CPU the
kernel, the 4-bit screen. Last, other libraries' int8 kernels on the same (dequantized) weights, timed for
comparison: those that quantize activations would need an activation term in the bound. Each row's
error is measured on the same hidden state; "GB/s" is the weight bytes a kernel streams per second
(near the machine's bandwidth: memory-bound; far below it: compute-bound).
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import numpy as np
import torch

from runtime.kernels import (QuantMatrix, decode_threads, has_screen4_kernel, kernel_name, linear, pack_screen4, screen4_gemv, screen_gemv,
                             screen_gemv_int16)
from runtime.kernels.quant import dequantize


def _time_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1000


def _torch_int8pack(weight: torch.Tensor):
    """torch._weight_int8pack_mm: per-row int8 weights, bf16 activations (fp32 is far slower)."""
    scale = (weight.abs().amax(1) / 127).clamp(min=1e-30)
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale_bf16 = scale.bfloat16()
    return lambda h: torch._weight_int8pack_mm(h.bfloat16(), q, scale_bf16).float()


def _torch_dynamic_int8(weight: torch.Tensor):
    """torch dynamic quantized linear (fbgemm): int8 weights and per-tensor int8 activations."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)
    return lambda h: quantized(h)


def _ort_matmul_nbits(weight: torch.Tensor, accuracy_level: int, block: int = 32):
    """ONNX Runtime MatMulNBits, 8-bit weights in blocks; level 0 = fp32 compute, 4 = int8 activations."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    V, d = weight.shape
    blocks = weight.view(V, d // block, block)
    scale = (blocks.abs().amax(2, keepdim=True) / 127).clamp(min=1e-30)
    q = (torch.round(blocks / scale).clamp(-127, 127) + 128).to(torch.uint8).numpy()
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=d, N=V, bits=8,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "screen", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, d])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, V])],
        initializer=[onnx.numpy_helper.from_array(q, "B"),
                     onnx.numpy_helper.from_array(scale.reshape(-1).numpy().astype(np.float32), "S")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # onnxruntime reads IR <= 10..13 depending on version; 10 is safe
    options = ort.SessionOptions()
    options.intra_op_num_threads = decode_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda h: torch.from_numpy(session.run(None, {"A": h.numpy()})[0])


def _screen4(tensors: dict):
    """The 4-bit screen as one call and the bytes that call streams.

    The call maps h [1, d] to the centre [1, V] as Screen4Bound.prepare computes it (basis coordinates included).
    """
    basis = tensors["basis"].float()  # [d, k]
    panels = pack_screen4(*(tensors[name] for name in ("codes", "scales", "mins", "corr", "corr_scale")))
    return (lambda h: screen4_gemv(panels, h, h @ basis)[0]), panels.nbytes


def compare_kernels(weight: torch.Tensor | QuantMatrix, screen: dict, hidden: torch.Tensor, repeats: int = 20,
                    screen4: dict | None = None) -> list[dict]:
    """Rows of {kernel, activations, ms, gb_per_s, vs_full_head, max_error} on `hidden` [1, d]: max |approx - exact|."""
    exact_name = f"exact head ({kernel_name()}, {'GGUF blocks' if isinstance(weight, QuantMatrix) else 'float32'})"
    qweight, scales = screen["qweight"], screen["scales"]
    screen_bytes = qweight.nbytes + scales.nbytes
    candidates = [(exact_name, "fp32", weight.nbytes, lambda h: linear(h, weight))]
    if screen_gemv_int16(qweight, scales, hidden) is not None:  # None: no integer path on this CPU or shape
        candidates.append(("int8 screen, int16-split activations (the bound's path)", "int16 + remainder", screen_bytes,
                           lambda h: screen_gemv_int16(qweight, scales, h)[0]))
    candidates.append(("int8 screen, float32 activations", "fp32", screen_bytes, lambda h: screen_gemv(qweight, scales, h)))
    if screen4 is not None and has_screen4_kernel():
        screen4_fn, screen4_bytes = _screen4(screen4)
        candidates.append(("4-bit screen with its low-rank correction", "int16 + remainder", screen4_bytes, screen4_fn))
    dense = dequantize(weight)  # [V, d] float32: the values every other library gets
    candidates += [
        ("torch._weight_int8pack_mm", "bf16", None, _torch_int8pack(dense)),
        ("torch dynamic int8 linear", "int8 per tensor", None, _torch_dynamic_int8(dense)),
        ("onnxruntime MatMulNBits 8-bit, accuracy 0", "fp32", None, _ort_matmul_nbits(dense, 0)),
        ("onnxruntime MatMulNBits 8-bit, accuracy 4", "int8 per block", None, _ort_matmul_nbits(dense, 4)),
    ]
    exact = linear(hidden, weight)  # [1, V]
    rows = []
    for name, activations, stream, fn in candidates:
        ms = _time_ms(lambda: fn(hidden), repeats if "accuracy 0" not in name else 3)
        error = float((fn(hidden).float() - exact).abs().max())
        gb_per_s = stream / ms / 1e6 if stream is not None else None
        rows.append({"kernel": name, "activations": activations, "ms": ms, "gb_per_s": gb_per_s, "max_error": error})
    for row in rows:
        row["vs_full_head"] = row["ms"] / rows[0]["ms"]
    return rows
