"""The 4-bit screen: its stage (codes, float16 scales and minimums, low-rank correction, rounded-up
norms), its kernel against a float64 reference of the same integer split, and the soundness of its
radius on tiny heads, with hidden states that stress the split and the correction.
"""

from __future__ import annotations

import pytest
import torch

from factories import make_tiny_head
from head_factories import screen_bound
from prep.screen4 import build_screen4, check_screen4_shape, hidden_basis, quantize_int4
from runtime.heads.screen4_bound import MAX_ROWS, Screen4Bound
from runtime.kernels import _screen4_torch, build, pack_screen4, unpack_int4
from runtime.kernels.screen4_panels import PANEL_ROWS
from test_screen_int16 import adversarial_hidden, reference_split

VOCAB, DIM = 1031, 128  # 1031 rows: not a multiple of the kernel's row blocks


def calibration(dim: int, seed: int = 0) -> torch.Tensor:
    """Hidden-like rows [400, dim] (seed: the sample): a shared direction and a few strong ones, the same
    for every seed, on top of noise."""
    strong = torch.randn(4, dim, generator=torch.Generator().manual_seed(100)) * torch.tensor([40.0, 20.0, 10.0, 5.0])[:, None]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(400, dim, generator=gen) + torch.randn(400, 4, generator=gen) @ strong / 4 + strong[0]


def stage(group: int, rank: int = 16, seed: int = 1) -> tuple[torch.Tensor, dict]:
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=seed)
    return head.weight, quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), rank), group)


def dequantize4(t: dict) -> torch.Tensor:
    """Q [V, d] float64: d_g q + m_g, the values the screen stands for (exact in float64)."""
    V, G = t["scales"].shape
    group = t["codes"].shape[1] * 2 // G
    q = unpack_int4(t["codes"], group).double().view(V, G, group)
    return (q * t["scales"].double()[..., None] + t["mins"].double()[..., None]).view(V, -1)


@pytest.mark.parametrize("group", [32, 64])
def test_stage_codes_and_norms_are_what_the_bound_needs(group: int):
    weight, t = stage(group)
    q = unpack_int4(t["codes"], group)
    assert q.shape == (VOCAB, DIM) and int(q.max()) <= 15
    assert t["scales"].dtype == t["mins"].dtype == torch.float16 and t["scales"].shape == (VOCAB, DIM // group)
    quantized = dequantize4(t)
    error = weight.double() - quantized
    basis = t["basis"].double()
    projected = error @ basis  # P_i = U^T E_i
    stored = t["corr"].double() * t["corr_scale"].double()[:, None]
    expected = {"error_norms": error.norm(dim=1), "qrow_norms": quantized.norm(dim=1), "row_norms": weight.double().norm(dim=1),
                "corr_norms": stored.norm(dim=1), "corr_error_norms": (projected - stored).norm(dim=1)}
    for name, value in expected.items():
        assert bool((t[name].double() >= value).all()), f"{name} is not rounded up"
        assert torch.allclose(t[name].double(), value, rtol=1e-6), name
    # 4 bits with a minimum per group: each weight within half a step of its group's grid
    steps = t["scales"].double().repeat_interleave(group, dim=1)
    assert bool((error.abs() <= steps / 2 + 1e-3 * steps + 1e-12).all())


def test_shapes_the_kernel_cannot_take_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="divisible by 64.*int8 screen"):
        check_screen4_shape(96, 16, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        check_screen4_shape(128, 20, 64)
    with pytest.raises(ValueError, match="--group must be one of 32, 64"):
        check_screen4_shape(128, 16, 48)
    with pytest.raises(ValueError, match="float16 range"):
        quantize_int4(torch.full((4, 64), 1e5), torch.eye(64)[:, :16], 64)


def screen4_module(path: str):
    """The compiled module of `path` (avx512 or avx2: the paths with a 4-bit screen), skipping where this CPU cannot run it."""
    missing = build.missing_cpu_flags(path)
    if missing:
        pytest.skip(f"this CPU cannot run the {path} kernels (lacks {', '.join(missing)})")
    return build.module(path)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("path, vnni", [("avx512", False), ("avx512", True), ("avx2", False)],
                         ids=["avx512-vpmaddubsw", "avx512-vpdpbusd", "avx2"])
def test_kernel_is_the_integer_split_screen(group: int, path: str, vnni: bool):
    module = screen4_module(path)
    if vnni and "avx512_vnni" not in build.cpu_flags():
        pytest.skip("this CPU does not report avx512_vnni")
    weight, t = stage(group)
    hidden = torch.cat([calibration(DIM, seed=7)[:5], adversarial_hidden(DIM)[[0, 1, 2, 3]]])  # [9, d]
    coords = hidden @ t["basis"]
    panels = pack_screen4(t["codes"], t["scales"], t["mins"], t["corr"], t["corr_scale"])
    center, remainder, used = module.screen4_gemv(panels.packed, VOCAB, group, hidden, coords, vnni)
    assert torch.equal(used, coords)  # 2^-e c never underflows here
    quantized = dequantize4(t)
    correction = t["corr"].double() * t["corr_scale"].double()[:, None]  # [V, k]
    for row in range(hidden.shape[0]):
        a, e = reference_split(hidden[row], limit=32639)  # the byte split a = 256 hi + lo needs |a| <= 32639
        assert float(remainder[row]) >= float((hidden[row].double() - a.double() * 2.0**e).norm())
        expected = quantized @ a.double() * 2.0**e + correction @ coords[row].double()  # [V] float64
        scale = (quantized.abs() @ a.double().abs() * 2.0**e + correction.abs() @ coords[row].double().abs())  # sum of |terms|
        assert bool(((center[row].double() - expected).abs() <= 1e-5 * scale + 1e-30).all()), row


@pytest.mark.parametrize("group", [32, 64])
def test_avx2_kernel_gives_the_avx512_bits(group: int):
    """The same integers and float32 operations per row: equal outputs for 1..7 hidden rows (passes of
    three and their remainders), on a ragged last panel."""
    avx2, avx512 = screen4_module("avx2"), screen4_module("avx512")
    weight, t = stage(group)
    hidden = torch.cat([calibration(DIM, seed=5)[:4], adversarial_hidden(DIM)[[0, 1, 2]]])  # [7, d]
    coords = hidden @ t["basis"]
    panels = pack_screen4(t["codes"], t["scales"], t["mins"], t["corr"], t["corr_scale"])
    for rows in range(1, hidden.shape[0] + 1):
        got = avx2.screen4_gemv(panels.packed, VOCAB, group, hidden[:rows], coords[:rows], False)
        expected = avx512.screen4_gemv(panels.packed, VOCAB, group, hidden[:rows], coords[:rows], False)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), rows
    with pytest.raises(RuntimeError, match="no VNNI path"):
        avx2.screen4_gemv(panels.packed, VOCAB, group, hidden[:1], coords[:1], True)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("vocab", [VOCAB, 48], ids=["ragged", "whole-panels"])
def test_panels_hold_the_stage_and_give_back_any_row_range(group: int, vocab: int):
    t = {name: value[:vocab] if value.shape[0] == VOCAB else value for name, value in stage(group)[1].items()}
    panels = pack_screen4(t["codes"], t["scales"], t["mins"], t["corr"], t["corr_scale"])
    assert panels.packed.shape[0] == -(-vocab // PANEL_ROWS) and panels.packed.data_ptr() % 64 == 0
    q = unpack_int4(t["codes"], group)
    for start, stop in [(0, vocab), (17, 35), (vocab - 3, vocab)]:
        rows = panels.rows(start, stop)
        expected = (q, t["scales"], t["mins"], t["corr"], t["corr_scale"])
        assert all(torch.equal(got, want[start:stop]) for got, want in zip(rows, expected)), (start, stop)
    # the kernel's view: byte 4L + m of a group's vector v holds columns 8v + m (low nibble) and 8v + 4 + m (high) of row L
    row, g, v, m = PANEL_ROWS + 3, panels.groups - 1, 2, 1
    byte = int(panels.packed[1, g * (8 * group + 64) + 64 * v + 4 * 3 + m])
    assert byte == int(q[row, g * group + 8 * v + m]) | int(q[row, g * group + 8 * v + 4 + m]) << 4


def test_torch_reference_matches_the_float64_definition():
    weight, t = stage(32)
    hidden = calibration(DIM, seed=3)[:3]
    coords = hidden @ t["basis"]
    got = _screen4_torch(pack_screen4(t["codes"], t["scales"], t["mins"], t["corr"], t["corr_scale"]), hidden, coords)
    expected = hidden.double() @ dequantize4(t).T + coords.double() @ (t["corr"].double() * t["corr_scale"].double()[:, None]).T
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-6)


def hidden_rows() -> torch.Tensor:
    """Calibration-like rows, rows off the calibration subspace, and the int16 split's hard cases."""
    gen = torch.Generator().manual_seed(11)
    off = torch.randn(3, DIM, generator=gen) * 30  # no shared direction: the correction helps little
    extreme = torch.randn(1, DIM, generator=gen) * 2.0**61  # beyond the split's range: the float64 fallback
    return torch.cat([calibration(DIM, seed=9)[:6], off, adversarial_hidden(DIM)[:5], extreme])


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_exact_logit_lies_within_the_radius(group: int, bias: bool):
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=2, bias=bias)
    tensors = quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), 16), group)
    bound = Screen4Bound(head.weight, head.bias, tensors)
    hidden = hidden_rows()
    for start in range(0, hidden.shape[0], 2):  # batches of up to two rows, the ones this screen takes
        batch = hidden[start : start + 2]
        state = bound.prepare(batch)
        exact = batch.double() @ head.weight.double().T + (head.bias.double() if bias else 0.0)  # [B, V]
        computed = torch.nn.functional.linear(batch, head.weight, head.bias).double()  # float32, as the full head
        for row in range(batch.shape[0]):
            radius = bound.radius(state, row).double()
            for logits in (exact, computed):
                assert bool(((logits[row] - state.center[row].double()).abs() <= radius).all()), (start + row)


def test_the_correction_tightens_the_radius_on_calibration_like_rows():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=4)
    calib = calibration(DIM).double()
    with_basis = Screen4Bound(head.weight, None, quantize_int4(head.weight, hidden_basis(calib, 16), 64))
    random_basis = torch.linalg.qr(torch.randn(DIM, 16, generator=torch.Generator().manual_seed(0)))[0].float()
    without = Screen4Bound(head.weight, None, quantize_int4(head.weight, random_basis, 64))
    hidden = calibration(DIM, seed=5)[:2]
    tight, loose = with_basis.prepare(hidden), without.prepare(hidden)
    assert float(with_basis.radius(tight, 0).mean()) < 0.5 * float(without.radius(loose, 0).mean())


def test_wide_batches_go_to_the_int8_screen_and_stay_sound():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=6)
    wide = screen_bound(head, 0)
    bound = Screen4Bound(head.weight, None, quantize_int4(head.weight, hidden_basis(calibration(DIM).double(), 16), 64), wide)
    hidden = calibration(DIM, seed=8)[: MAX_ROWS + 2]
    narrow_state, wide_state = bound.prepare(hidden[:MAX_ROWS]), bound.prepare(hidden)
    assert wide_state.coefficients is wide.coefficients and narrow_state.coefficients is bound.coefficients
    exact = hidden.double() @ head.weight.double().T
    for row in range(hidden.shape[0]):
        assert bool(((exact[row] - wide_state.center[row].double()).abs() <= bound.radius(wide_state, row).double()).all())
        picked = bound.open_topk(wide_state, row, 1, 0.0, None)
        assert int(picked.ids[picked.logits.argmax()]) == int(exact[row].argmax())


def test_build_screen4_params():
    head = make_tiny_head(vocab=VOCAB, dim=DIM, seed=1)
    tensors, params = build_screen4(head.weight, calibration(DIM).double(), rank=32, group=64)
    assert params["bits"] == 4 and params["rank"] == 32 and params["group_size"] == 64
    assert params["calibration_positions"] == 400 and tensors["basis"].shape == (DIM, 32)
    assert 0 < params["mean_relative_error"] < 0.2
