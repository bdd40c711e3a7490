"""GGML block kernels: exact dequantization (bit for bit gguf-py's), and the skinny GEMM over blocks.

Every claim is checked with torch.equal: `dequantize` / `take_rows` against `gguf.quants.dequantize`
on random blocks and on the packaged GGUF files' own tensors; `linear(x, QuantMatrix)` against the
fp32 kernel on the dequantized weight; every compiled path (avx512, avx2, portable) against the others.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from runtime.kernels import SKINNY_MAX_ROWS, QuantMatrix, dequantize, kernel_name, linear, take_rows
from runtime.kernels import build, lanes, quant
from runtime.kernels.lanes import LANES_TYPES
from runtime.kernels.quant import SUPPORTED_GGML_TYPES, _dequantize_torch, from_lanes, kernel_layout, row_bytes, to_lanes
from runtime.models import resolve_model

from factories import compiled_module, in_user_cache, random_matrix, tall_rows

TYPES = [pytest.param(t, id=t.name) for t in SUPPORTED_GGML_TYPES]


def reference(w: QuantMatrix, ids: torch.Tensor | None = None) -> torch.Tensor:
    """gguf-py's dequantize of (rows `ids` of) w: [k, cols] float32."""
    raw = w.data.numpy() if ids is None else w.data.numpy()[ids.numpy()]
    return torch.from_numpy(gguf.quants.dequantize(raw, T(w.ggml_type)).reshape(raw.shape[0], w.cols).copy())


def columns(t: T) -> int:
    """A row length for t: not a multiple of 32 where the type allows it."""
    return {32: 96, 256: 512}.get(GGML_QUANT_SIZES[t][0], 77)


@pytest.mark.parametrize("t", TYPES)
def test_dequantize_random_blocks_bit_identical_to_gguf(t: T) -> None:
    w = random_matrix(t, 13, columns(t))
    expected = reference(w)
    ids = torch.tensor([12, 0, 5, 5])
    assert torch.equal(dequantize(w), expected)
    assert torch.equal(take_rows(w, ids), expected[ids])
    assert torch.equal(_dequantize_torch(w.data, t, w.cols), expected)


@pytest.mark.parametrize("t", [pytest.param(T.Q4_1, id="Q4_1"), pytest.param(T.Q5_1, id="Q5_1")])
def test_scale_and_min_of_every_magnitude_decode_exactly(t: T) -> None:
    """The _1 formats' d * q + m, which the AVX2 and portable paths take as one FMA (d * q is exact),
    at scales and mins from fp16's subnormals to its largest values, both signs: gguf-py's bits on
    every compiled path and as a matrix's rows in the skinny GEMM."""
    block_bytes = GGML_QUANT_SIZES[t][1]
    rng = np.random.default_rng(5)
    magnitudes = np.float16(2.0) ** np.arange(-24, 15, dtype=np.float16)  # 2^-24 (subnormal) .. 2^15
    d = (magnitudes * rng.uniform(1, 2, magnitudes.size).astype(np.float16)).astype(np.float16)
    pairs = [(s * a, b) for a in d for b in (d[::3] * -1).tolist() + d[::5].tolist() + [0.0] for s in (1, -1)]
    raw = rng.integers(0, 256, size=(len(pairs), block_bytes), dtype=np.uint8)
    raw[:, 0:2] = np.array([p[0] for p in pairs], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    raw[:, 2:4] = np.array([p[1] for p in pairs], dtype=np.float16).view(np.uint8).reshape(-1, 2)
    w = QuantMatrix.from_numpy(raw, t, len(pairs), 32)
    expected = reference(w)
    assert torch.isfinite(expected).all()
    for path in build.runnable_paths():
        module = compiled_module(path)
        assert torch.equal(module.take_rows(w.data, int(t), 32, torch.arange(w.rows)), expected), path
        x = torch.eye(32)[:3]  # rows of x that pick single weights: the outputs are the values themselves
        assert torch.equal(module.quant_linear(x, w.data, int(t), 32), expected[:, :3].T.contiguous()), path


@pytest.mark.parametrize("t", [pytest.param(T.F16, id="F16"), pytest.param(T.BF16, id="BF16")])
def test_every_half_value_converts_exactly(t: T) -> None:
    """All 65536 bit patterns but NaNs (subnormals, infinities, -0) on every compiled path and torch."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    values = bits.view(np.float16).astype(np.float32) if t == T.F16 else (bits.astype(np.uint32) << 16).view(np.float32)
    raw = bits[~np.isnan(values)][: 2048 * 31].reshape(2048, 31)  # odd row length: tails too
    w = QuantMatrix.from_numpy(np.ascontiguousarray(raw), t, *raw.shape)
    expected = reference(w)
    assert torch.equal(_dequantize_torch(w.data, t, w.cols), expected)
    for path in build.runnable_paths():
        assert torch.equal(compiled_module(path).take_rows(w.data, int(t), w.cols, torch.arange(w.rows)), expected), path


@pytest.mark.parametrize("t", TYPES)
def test_quant_linear_equals_fp32_kernel_on_dequantized(t: T) -> None:
    """n = 1..16 rows, 41 weight rows (4 * 10 + 1, 3 * 13 + 2, 2 * 20 + 1: every pass width leaves rows for the
    closing passes): the same bits as linear(x, dequantize(w))."""
    if kernel_name() == "torch":
        pytest.skip("SPECVOCAB_KERNELS=torch: the fallback is documented as not bit-identical")
    for cols in [columns(t)] + ([20, 45] if GGML_QUANT_SIZES[t][0] == 1 else []):
        w = random_matrix(t, 41, cols, seed=cols)
        dense = dequantize(w)  # [41, cols]
        x = torch.randn(SKINNY_MAX_ROWS + 4, cols, generator=torch.Generator().manual_seed(cols))
        for n in range(1, SKINNY_MAX_ROWS + 1):
            assert torch.equal(linear(x[:n], w), linear(x[:n], dense)), (cols, n)
        chunked = torch.cat([linear(x[:SKINNY_MAX_ROWS], dense), linear(x[SKINNY_MAX_ROWS:], dense)])
        assert torch.equal(linear(x, w), chunked)  # n > 16: the 16-row chunks' values
        bias = torch.randn(41)
        assert torch.equal(linear(x[:3], w, bias), linear(x[:3], dense, bias))


@pytest.mark.parametrize("t", TYPES)
def test_prefill_rows_get_their_one_row_bits(t: T) -> None:
    """A prefill chunk past every path's kTallMinRows (run_tall's decoded tiles): each row's output is
    torch.equal to that row alone, for block and fp32 weights, at 1 and 2 threads; the columns cover
    one tile segment and several (> 1024, with a tail where the type allows), the rows a partial tile."""
    if kernel_name() == "torch":
        pytest.skip("SPECVOCAB_KERNELS=torch: the fallback is documented as not bit-identical")
    qk = GGML_QUANT_SIZES[t][0]
    before = torch.get_num_threads()
    try:
        for cols in (columns(t), {1: 2085, 32: 2080, 256: 2304}[qk]):
            w = random_matrix(t, 83, cols, seed=cols)
            dense = dequantize(w)  # [83, cols]
            x = torch.randn(tall_rows(), cols, generator=torch.Generator().manual_seed(cols))  # past every kTallMinRows
            alone = torch.cat([linear(x[i : i + 1], w) for i in range(x.shape[0])])  # [tall_rows(), 83]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(linear(x, w), alone), (cols, threads)
                assert torch.equal(linear(x, dense), alone), (cols, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("path", build.PATHS)
def test_compiled_paths_bit_identical(path: str) -> None:
    """Every path gives the active path's bits: fp32 skinny GEMM, block GEMM and take_rows, every type."""
    if kernel_name() == "torch":
        pytest.skip("SPECVOCAB_KERNELS=torch: no compiled path to compare against")
    other, active = compiled_module(path), build.active()[1]
    g = torch.Generator().manual_seed(1)
    for d in (640, 77, 20):
        x, w = torch.randn(11, d, generator=g), torch.randn(29, d, generator=g)
        for n in (1, 2, 3, 5, 11):
            assert torch.equal(other.skinny_linear(x[:n], w), active.skinny_linear(x[:n], w)), (d, n)
    for t in SUPPORTED_GGML_TYPES:
        w = random_matrix(t, 23, columns(t), seed=7)  # 23 = 4 * 5 + 3 = 3 * 7 + 2: the closing passes run
        x = torch.randn(20, w.cols, generator=g)
        for n in (1, 2, 3, 4, 9, 20):
            assert torch.equal(other.quant_linear(x[:n], w.data, int(t), w.cols), active.quant_linear(x[:n], w.data, int(t), w.cols)), (t.name, n)
        ids = torch.arange(w.rows)
        assert torch.equal(other.take_rows(w.data, int(t), w.cols, ids), active.take_rows(w.data, int(t), w.cols, ids)), t.name


LANES_CASES = [pytest.param(t, cols, id=f"{t.name}-{cols}") for t, cols in
               [(T.Q5_0, 96), (T.Q5_0, 896), (T.Q5_0, 160), (T.Q5_0, 64), (T.Q5_0, 2080), (T.Q4_K, 512), (T.Q4_K, 2304), (T.Q6_K, 512), (T.Q6_K, 2304)]]


@pytest.mark.parametrize("t, cols", LANES_CASES)
def test_lanes_layouts_keep_the_values_and_bits(t: T, cols: int) -> None:
    """Q5_0, Q4_K and Q6_K repacked into lanes (Q5_0: whole 96-element groups plus a tail of 0, 1 or 2
    Q5_0 blocks; 2080 and 2304 columns: several prefill tile segments). The bytes unpack to the
    file's; values, kernel outputs at n = 1..16 and a prefill's rows are the source type's bits on
    the active path; every compiled path gives the same bits."""
    w = random_matrix(t, 37, cols, seed=cols)
    packed = to_lanes(w)
    assert packed.ggml_type == LANES_TYPES[t] and packed.data.shape[1] == row_bytes(LANES_TYPES[t], cols)
    assert torch.equal(from_lanes(packed).data, w.data)
    assert torch.equal(lanes.pack(w.data, int(t), cols), packed.data)  # the torch reference pack, byte for byte
    expected = reference(w)
    assert torch.equal(_dequantize_torch(packed.data, packed.ggml_type, cols), expected)
    assert torch.equal(dequantize(packed), expected)
    assert torch.equal(take_rows(packed, torch.tensor([36, 0, 3])), expected[[36, 0, 3]])
    if kernel_name() == "torch":
        return
    x = torch.randn(tall_rows(), cols, generator=torch.Generator().manual_seed(cols))  # a prefill past every kTallMinRows
    for n in [*range(1, SKINNY_MAX_ROWS + 1), x.shape[0]]:
        assert torch.equal(linear(x[:n], packed), linear(x[:n], w)), n
    active = build.active()[1]
    for path in build.runnable_paths():
        other = compiled_module(path)
        for n in (1, 3, 9):
            assert torch.equal(other.quant_linear(x[:n], packed.data, packed.ggml_type, cols), active.quant_linear(x[:n], w.data, int(t), cols)), (path, n)
        assert torch.equal(other.take_rows(packed.data, packed.ggml_type, cols, torch.arange(37)), expected), path
        assert torch.equal(other.pack_lanes(w.data, int(t), cols, torch.empty_like(packed.data)), packed.data), path


def test_kernel_layout_repacks_on_the_simd_paths_only(monkeypatch) -> None:
    q5, q8 = random_matrix(T.Q5_0, 4, 896), random_matrix(T.Q8_0, 4, 896)
    assert kernel_layout(q8) is q8
    expected = LANES_TYPES[T.Q5_0] if kernel_name() in ("avx512vbmi", "avx512", "avx2") else int(T.Q5_0)
    assert kernel_layout(q5).ggml_type == expected
    with pytest.raises(ValueError, match="repacks Q5_0, Q4_K, Q6_K matrices, not Q8_0"):
        to_lanes(q8)
    ext = build.active()[1]
    if ext is not None:  # any compiled module packs; the path name decides
        monkeypatch.setattr(quant, "active", lambda: ("avx2", ext))
        assert kernel_layout(q5).ggml_type == LANES_TYPES[T.Q5_0]
    for unpacked in (("portable", object()), ("torch", None)):
        monkeypatch.setattr(quant, "active", lambda: unpacked)
        assert kernel_layout(q5) is q5


def test_thread_count_does_not_change_the_bits() -> None:
    """Rows split across threads (at::parallel_for) sum exactly as one thread does."""
    if kernel_name() == "torch":
        pytest.skip("SPECVOCAB_KERNELS=torch: no compiled path")
    w = random_matrix(T.Q8_0, 1031, 96, seed=3)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [linear(x[:n], w) for n in (1, 5)]
        torch.set_num_threads(2)
        two = [linear(x[:n], w) for n in (1, 5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_unsupported_type_and_bad_override_say_what_to_do(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"Q2_K .*--backend lean"):
        QuantMatrix(torch.zeros(2, 84, dtype=torch.uint8), int(T.Q2_K), 2, 256)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantMatrix(torch.zeros(2, 34, dtype=torch.uint8), int(T.Q8_0), 2, 33)
    monkeypatch.setenv(build.ENV, "sse9")
    with pytest.raises(ValueError, match="avx512, avx2, portable, torch"):
        build.requested()


def test_torch_override_falls_back_to_dequantize_and_matmul(monkeypatch) -> None:
    monkeypatch.setenv(build.ENV, "torch")
    build.active.cache_clear()
    try:
        assert kernel_name() == "torch"
        w = random_matrix(T.Q4_K, 5, 256)
        x = torch.randn(2, 256)
        assert torch.equal(take_rows(w, torch.tensor([4, 1])), reference(w)[[4, 1]])
        torch.testing.assert_close(linear(x, w), x @ reference(w).T)
    finally:
        monkeypatch.delenv(build.ENV)
        build.active.cache_clear()


def packaged_gguf(name: str) -> Path:
    """The packaged model's assembled .gguf, from the user's model cache (imported there on first use)."""
    with in_user_cache():
        return resolve_model(name, progress=False).gguf_path


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"])
def test_real_tensors_bit_identical_to_gguf(name: str) -> None:
    """Every tensor of the file: a slice of rows exact; per type, the block GEMM equals the fp32 one."""
    from runtime.backends.gguf_file import GGUFFile  # the native backend's reader: what its kernels get

    file = GGUFFile(packaged_gguf(name))
    seen: set[int] = set()
    g = torch.Generator().manual_seed(0)
    for info in file.tensors.values():
        cols, rows = (*info.dims, 1)[:2]  # 1-D tensors (norms): one row
        w = QuantMatrix.from_numpy(file.array(info.name), info.ggml_type, rows, cols)
        ids = torch.cat([torch.arange(min(rows, 24)), torch.randint(rows, (8,), generator=g)])
        assert torch.equal(take_rows(w, ids), reference(w, ids)), info.name
        if w.ggml_type not in seen and kernel_name() != "torch":
            seen.add(w.ggml_type)
            part = QuantMatrix(w.data[:300], w.ggml_type, min(rows, 300), cols)
            x = torch.randn(SKINNY_MAX_ROWS, cols, generator=g)
            for n in (1, 4, SKINNY_MAX_ROWS):
                assert torch.equal(linear(x[:n], part), linear(x[:n], reference(part))), (info.name, n)
    assert seen or kernel_name() == "torch"


def test_compiled_pack_refuses_other_types_and_wrong_sizes() -> None:
    if kernel_name() == "torch":
        pytest.skip("SPECVOCAB_KERNELS=torch: no compiled path")
    ext = build.active()[1]
    q8, q5 = random_matrix(T.Q8_0, 2, 64), random_matrix(T.Q5_0, 2, 96)
    out = torch.empty(2, row_bytes(LANES_TYPES[T.Q5_0], 96), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="repacks Q5_0, Q4_K and Q6_K, not ggml type 8"):
        ext.pack_lanes(q8.data, int(T.Q8_0), 64, out)
    with pytest.raises(RuntimeError, match="row_bytes 44 does not match 96 columns of ggml type 6"):
        ext.pack_lanes(q5.data[:, :44].contiguous(), int(T.Q5_0), 96, out)
    with pytest.raises(RuntimeError, match="cols must be a multiple of 32 for ggml type 6"):
        ext.pack_lanes(q5.data, int(T.Q5_0), 95, out)
    for wrong in (out[:1], out[:, :-1], out.view(torch.int8), out.t()):
        with pytest.raises(RuntimeError, match=r"pack_lanes writes a contiguous uint8 \[2, "):
            ext.pack_lanes(q5.data, int(T.Q5_0), 96, wrong)
    assert ext.pack_lanes(q5.data, int(T.Q5_0), 96, out) is not None and torch.equal(out, to_lanes(q5).data)
