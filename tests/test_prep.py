"""Prep builders on tiny heads: int8 screening copy and its error norms, group-size choice,
and the cluster stage (permutation, offsets, sound radii, bias tables).
"""

from __future__ import annotations

import pytest
import torch

from factories import make_tiny_head
from prep.cluster import build_clusters, spherical_kmeans
from prep.screen import CANDIDATE_GROUPS, build_screen, choose_group_size, quantize_int8

VOCAB, DIM = 4096, 64


def dequantize(q: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float64 head [V, d] that the int8 copy stands for."""
    V, d = q["qweight"].shape
    G = q["scales"].shape[1]
    return (q["qweight"].double().view(V, G, d // G) * q["scales"].double()[..., None]).view(V, d)


@pytest.mark.parametrize("group_size", [0, 16, 32, 64])
def test_quantize_int8_shapes_dtypes_and_sound_error_norms(group_size: int):
    weight = make_tiny_head(seed=1).weight
    q = quantize_int8(weight, group_size)
    groups = DIM // (group_size or DIM)
    assert q["qweight"].shape == (VOCAB, DIM) and q["qweight"].dtype == torch.int8
    assert q["scales"].shape == (VOCAB, groups) and q["scales"].dtype == torch.float32
    assert int(q["qweight"].abs().max()) <= 127 and bool((q["scales"] > 0).all())
    for name in ("error_norms", "qrow_norms", "row_norms"):
        assert q[name].shape == (VOCAB,) and q[name].dtype == torch.float32

    exact, dequant = weight.double(), dequantize(q)
    true = {
        "error_norms": (exact - dequant).norm(dim=1),
        "qrow_norms": dequant.norm(dim=1),
        "row_norms": exact.norm(dim=1),
    }
    for name, value in true.items():
        stored = q[name].double()
        # Rounded up: never below the float64 truth, and no looser than one float32 step.
        assert bool((stored >= value).all()), name
        assert bool((stored <= value * (1 + 2**-22)).all()), name
    # The error is what int8 rounding allows: at most half a step per coordinate.
    half_step = q["scales"].double().repeat_interleave(DIM // groups, dim=1) / 2
    assert bool(((exact - dequant).abs() <= half_step * (1 + 1e-6)).all())


def test_quantize_int8_rejects_a_group_size_that_does_not_fit():
    weight = make_tiny_head(seed=1).weight
    for bad in (24, 48, 8):  # does not divide 64, or not a multiple of 16
        with pytest.raises(ValueError, match="group size"):
            quantize_int8(weight, bad)


def test_quantize_int8_keeps_a_zero_row_exact():
    weight = make_tiny_head(seed=1).weight.clone()
    weight[5] = 0.0
    q = quantize_int8(weight, 0)
    assert int(q["qweight"][5].abs().max()) == 0 and float(q["error_norms"][5]) == 0.0


def test_choose_group_size_keeps_per_row_scales_for_gaussian_rows():
    weight = make_tiny_head(seed=1, dim=256, vocab=2048).weight
    chosen, measured = choose_group_size(weight)
    assert chosen == 0
    assert {"mean_error_norm_group_row", "mean_error_norm_group_64", "mean_error_norm_group_32"} <= set(measured)
    assert all(value > 0 for value in measured.values())
    # Smaller groups never quantize worse on average, but here not by the required factor 2.
    assert measured["mean_error_norm_group_32"] <= measured["mean_error_norm_group_row"]


def test_choose_group_size_picks_groups_when_outliers_dominate():
    # One outlier per row at ~100 sigma: a per-row scale spends the int8 range on it (error ~7 % of
    # the row norm with d=1024), groups of 32 confine the damage to one group (error ~5x smaller).
    gen = torch.Generator().manual_seed(2)
    rows, dim = 1024, 1024
    weight = torch.randn(rows, dim, generator=gen)
    weight[torch.arange(rows), torch.randint(0, dim, (rows,), generator=gen)] = 100.0
    chosen, measured = choose_group_size(weight)
    assert chosen in CANDIDATE_GROUPS and chosen != 0 and dim % chosen == 0
    assert measured["mean_error_norm_group_row"] > 2 * measured[f"mean_error_norm_group_{chosen}"]
    tensors, params = build_screen(weight, None, progress=False)
    assert params["group_size"] == chosen and not params["per_row"]
    assert tensors["scales"].shape == (rows, dim // chosen)


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def clusters(request):
    """Stage `clusters` of a tiny head whose rows have very different norms."""
    head = make_tiny_head(bias=request.param, seed=3)
    norms = torch.exp(torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)))
    weight = head.weight * norms[:, None]
    tensors, params = build_clusters(weight, head.bias, 32, iterations=8, top_m=3, seed=0, progress=False)
    return weight, head.bias, tensors, params


def test_cluster_permutation_offsets_and_sizes_are_consistent(clusters):
    weight, _, t, params = clusters
    C = params["clusters"]
    assert 1 <= C <= 32 and params["clusters_requested"] == 32
    assert torch.equal(torch.sort(t["permutation"]).values, torch.arange(VOCAB))
    assert t["offsets"].shape == (C + 1,) and int(t["offsets"][0]) == 0 and int(t["offsets"][-1]) == VOCAB
    assert torch.equal(t["offsets"][1:] - t["offsets"][:-1], t["sizes"]) and bool((t["sizes"] > 0).all())
    assert torch.equal(torch.bincount(t["labels"], minlength=C), t["sizes"])
    for c in range(C):
        members = t["permutation"][t["offsets"][c] : t["offsets"][c + 1]]
        assert bool((t["labels"][members] == c).all())
    for name, shape in [("centroids", (C, weight.shape[1])), ("directions", (C, weight.shape[1])),
                        ("radii", (C,)), ("angular_radii", (C,)), ("max_norms", (C,))]:
        assert t[name].shape == shape, name


def test_cluster_radii_cover_every_row(clusters):
    weight, _, t, _ = clusters
    rows, labels = weight.double(), t["labels"]
    centroids, directions = t["centroids"].double(), t["directions"].double()
    # Centroids are the float64 means of the raw rows; directions are unit vectors.
    sums = torch.zeros_like(centroids).index_add_(0, labels, rows)
    assert torch.allclose(centroids, sums / t["sizes"].double()[:, None], rtol=1e-12, atol=1e-12)
    assert torch.allclose(directions.norm(dim=1), torch.ones(len(directions), dtype=torch.float64))

    distance = (rows - centroids[labels]).norm(dim=1)
    assert bool((distance <= t["radii"].double()[labels]).all())
    assert bool((rows.norm(dim=1) <= t["max_norms"].double()[labels]).all())
    # Angle between each row and its cluster's direction, computed stably (atan2, not arccos).
    u = directions[labels]
    along = (rows * u).sum(1)
    across = (rows - along[:, None] * u).norm(dim=1)
    angle = torch.atan2(across, along)
    assert bool((angle <= t["angular_radii"].double()[labels]).all())
    # Not vacuous: the radii are attained (to rounding) by some row of each cluster.
    widest = torch.zeros(len(t["sizes"]), dtype=torch.float64).scatter_reduce_(0, labels, distance, reduce="amax")
    assert torch.allclose(widest, t["radii"].double(), rtol=1e-6)


def test_cluster_bias_tables(clusters):
    weight, bias, t, params = clusters
    if bias is None:
        assert "bias_top_ids" not in t and "bias_rest_max" not in t and not params["has_bias"]
        return
    assert params["has_bias"] and params["top_m_bias"] == 3
    C = len(t["sizes"])
    assert t["bias_top_ids"].shape == (C, 3) and t["bias_rest_max"].shape == (C,)
    for c in range(C):
        members = t["permutation"][t["offsets"][c] : t["offsets"][c + 1]]
        ranked = members[torch.argsort(bias[members], descending=True, stable=True)]
        m = min(3, len(members))
        top = t["bias_top_ids"][c]
        assert torch.equal(bias[top[:m]], bias[ranked[:m]])  # the m largest biases, in order
        assert set(top[:m].tolist()) <= set(members.tolist())
        assert bool((top[m:] == -1).all())
        rest = float(t["bias_rest_max"][c])
        if len(members) > 3:
            assert rest == float(bias[ranked[3]])  # the next one
            assert rest <= float(bias[top[:m]].min())
        else:
            assert rest == float("-inf")


def test_kmeans_progress_goes_to_stderr_not_stdout(capfd):
    """faiss's C++ iteration lines are progress: stdout stays the command's own output."""
    labels = spherical_kmeans(torch.randn(256, 16), 8, 5, 0, progress=True)
    out, err = capfd.readouterr()
    assert labels.shape == (256,) and int(labels.max()) < 8
    assert out == ""
    assert "Iteration" in err and "k-means: 8 clusters" in err


def test_build_clusters_rejects_an_impossible_cluster_count():
    weight = make_tiny_head(seed=1, vocab=64).weight
    for bad in (0, 65):
        with pytest.raises(ValueError, match="--clusters"):
            build_clusters(weight, None, bad, progress=False)
