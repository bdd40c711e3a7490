"""Time the candidate screening kernels on this machine, in one run, against the full float32 head.

Each candidate computes approximate logits [1, V] from an int8 copy of the head. Only kernels
that keep activations in float32 need no activation-quantization term in the bound; the others
are timed for comparison and their extra error is measured on the same hidden state.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import numpy as np
import torch

from runtime.kernels import kernel_name, screen_gemv


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
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda h: torch.from_numpy(session.run(None, {"A": h.numpy()})[0])


def compare_kernels(weight: torch.Tensor, screen: dict, hidden: torch.Tensor, repeats: int = 20) -> list[dict]:
    """Rows of {kernel, activations, ms, vs_full_head, max_error}: max |approx - exact| on `hidden` [1, d]."""
    exact = torch.nn.functional.linear(hidden, weight)
    candidates = [
        ("full float32 head (F.linear)", "fp32", lambda h: torch.nn.functional.linear(h, weight)),
        (f"specvocab screen_gemv ({kernel_name()}, stage layout)", "fp32",
         lambda h: screen_gemv(screen["qweight"], screen["scales"], h)),
        ("torch._weight_int8pack_mm", "bf16", _torch_int8pack(weight)),
        ("torch dynamic int8 linear", "int8 per tensor", _torch_dynamic_int8(weight)),
        ("onnxruntime MatMulNBits 8-bit, accuracy 0", "fp32", _ort_matmul_nbits(weight, 0)),
        ("onnxruntime MatMulNBits 8-bit, accuracy 4", "int8 per block", _ort_matmul_nbits(weight, 4)),
    ]
    rows = []
    for name, activations, fn in candidates:
        ms = _time_ms(lambda: fn(hidden), repeats if "accuracy 0" not in name else 3)
        error = float((fn(hidden).float() - exact).abs().max())
        rows.append({"kernel": name, "activations": activations, "ms": ms, "max_error": error})
    for row in rows:
        row["vs_full_head"] = row["ms"] / rows[0]["ms"]
    return rows
