"""Randomized SVD against full SVD, and principal angles on constructed subspaces."""

import math

import pytest
import torch

from megatron_sdpo.diagnostics.spectral import principal_angles, top_singular, truncated_svd


def _matrix(m, n, spectrum, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, m, generator=g)).Q[:, : len(spectrum)]
    v = torch.linalg.qr(torch.randn(n, n, generator=g)).Q[:, : len(spectrum)]
    return (u * spectrum) @ v.T, u, v


@pytest.mark.parametrize("shape", [(301, 173), (97, 260)])
def test_randomized_matches_full_svd_on_decaying_spectrum(shape):
    m, n = shape
    r = min(m, n)
    s = torch.exp(-torch.arange(r, dtype=torch.float32) / 12.0) * 5.0
    a, _, _ = _matrix(m, n, s)
    k = 10
    u, sv, v = truncated_svd(a, k, seed=3)
    uf, sf, vhf = torch.linalg.svd(a, full_matrices=False)
    torch.testing.assert_close(sv, sf[:k], rtol=1e-4, atol=1e-5)
    assert principal_angles(u, uf[:, :k]).max() < 0.05  # degrees
    assert principal_angles(v, vhf[:k].T).max() < 0.05
    # Orthonormal factors: U^T U = I
    torch.testing.assert_close(u.T @ u, torch.eye(k), atol=1e-5, rtol=0)


def test_randomized_top_values_on_flat_gaussian_spectrum():
    # Worst case for sketching: no spectral gap. Top values still within 2%.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(400, 300, generator=g)
    _, sv, _ = truncated_svd(a, 16, seed=0)
    sf = torch.linalg.svdvals(a)[:16]
    assert ((sv - sf).abs() / sf).max() < 0.02


def test_top_singular_dispatch_and_determinism():
    a = torch.randn(64, 40)
    *_, method = top_singular(a, 8, exact_max_dim=64)
    assert method == "exact"
    u1, s1, v1, method = top_singular(a, 8, exact_max_dim=16, seed=5)
    u2, s2, v2, _ = top_singular(a.clone(), 8, exact_max_dim=16, seed=5)
    assert method == "randomized"
    assert torch.equal(u1, u2) and torch.equal(s1, s2) and torch.equal(v1, v2)
    _, s_all, _, _ = top_singular(a, None, exact_max_dim=0)
    assert s_all.numel() == 40


@pytest.mark.parametrize("theta_deg", [0.5, 17.0, 63.0, 90.0])
def test_principal_angles_of_constructed_rotation(theta_deg):
    m, r = 50, 4
    q = torch.linalg.qr(torch.randn(m, r + 1, dtype=torch.float64)).Q
    qa = q[:, :r]
    t = math.radians(theta_deg)
    qb = qa.clone()
    # rotate the 2nd basis vector towards a direction outside span(qa) by theta
    qb[:, 1] = math.cos(t) * q[:, 1] + math.sin(t) * q[:, r]
    # an arbitrary orthogonal mix of the basis must not change the angles
    mix = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64)).Q
    ang = principal_angles(qa.float(), (qb @ mix).float())
    expected = torch.tensor([0.0, 0.0, 0.0, theta_deg], dtype=torch.float64)
    torch.testing.assert_close(ang, expected, atol=2e-3, rtol=0)


def test_principal_angles_identical_subspace_is_exactly_zero():
    # fp32 singular vectors are orthonormal to ~1e-7 only, which read as ~3e-5 degrees before
    # the float64 re-orthonormalization; now a subspace and itself are at exactly 0.
    q = torch.linalg.qr(torch.randn(200, 8)).Q
    assert principal_angles(q, q).tolist() == [0.0] * 8
    q64 = torch.linalg.qr(torch.randn(300, 5, dtype=torch.float64)).Q
    assert principal_angles(q64, q64.clone()).tolist() == [0.0] * 5


def test_identical_checkpoint_matrices_drift_exactly_zero():
    from megatron_sdpo.diagnostics.param_drift import matrix_drift

    for shape, exact_max_dim in (((60, 70), 512), ((600, 700), 512)):  # exact and randomized SVD
        a = torch.randn(*shape)
        d = matrix_drift(a, a.clone(), rank=8, exact_max_dim=exact_max_dim)
        assert d["angle_max_deg"] == 0.0 and d["angle_mean_deg"] == 0.0 and d["rel_frob"] == 0.0


def test_principal_angles_known_rotation_in_float64():
    # a 2-D plane rotated by 1e-4 degrees about one axis: angles (0, 1e-4), the small one exact
    t = math.radians(1e-4)
    qa = torch.zeros(4, 2, dtype=torch.float64)
    qa[0, 0] = qa[1, 1] = 1.0
    qb = qa.clone()
    qb[1, 1], qb[2, 1] = math.cos(t), math.sin(t)
    ang = principal_angles(qa, qb)
    assert ang[0].item() == 0.0
    assert ang[1].item() == pytest.approx(1e-4, rel=1e-9)
