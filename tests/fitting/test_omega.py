"""The sketch's test matrix kept per slice, against its formed ``D x l`` matrix."""

import pytest
import torch

from lowrank_laplace.factor import dense_block
from lowrank_laplace.factor.blocks import DenseBlock, KronBlock
from lowrank_laplace.fitting.omega import BasisOmega, Omega

TOL = dict(rtol=1e-10, atol=1e-12)
# a wide and a tall weight (both contraction orders), a vector, a convolution, a bias
SHAPES = [torch.Size(s) for s in [(3, 7), (6, 2), (5,), (2, 3, 2, 2), (4,)]]
DIM = sum(s.numel() for s in SHAPES)


def _omega_and_dense(cols=5, seed=0):
    omega = Omega(cols, DIM, torch.zeros(1, dtype=torch.float64), seed, SHAPES)
    return omega, omega.dense()


def test_slices_are_khatri_rao_where_matrix_shaped():
    omega, dense = _omega_and_dense()
    assert dense.shape == (DIM, 5) and dense.T.is_contiguous()
    assert [omega.factors(i) is not None for i in range(len(SHAPES))] == [
        True, True, False, False, False]
    p, q = omega.factors(0)
    torch.testing.assert_close(dense[:21].T.reshape(5, 3, 7), p[:, :, None] * q[:, None, :],
                               rtol=0, atol=0)
    # kept as factors: 5 * (3 + 7) + 5 * (6 + 2) numbers for the two weights
    assert omega.nbytes() == 8 * 5 * (10 + 8 + 5 + 24 + 4)
    gaussian = Omega(5, DIM, torch.zeros(1, dtype=torch.float64), 0, SHAPES, kronecker=False)
    assert all(gaussian.factors(i) is None for i in range(len(SHAPES)))
    assert gaussian.nbytes() == 8 * 5 * DIM


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("chunk", [2**24, 7])
def test_products_equal_the_formed_matrix(monkeypatch, layout, chunk):
    monkeypatch.setattr(dense_block, "_KHATRI_RAO_CHUNK", chunk)  # 7: one column per chunk
    omega, dense = _omega_and_dense()
    torch.manual_seed(1)
    x = torch.randn(DIM, 4, dtype=torch.float64)
    if layout == "transposed":
        x = x.T.contiguous().T
    torch.testing.assert_close(omega.t_matmul(x), dense.T @ x, **TOL)
    torch.testing.assert_close(omega.gram(), dense.T @ dense, **TOL)
    y = torch.randn(5, DIM, dtype=torch.float64).T  # the sketch's layout
    expected = y + 0.3 * dense
    torch.testing.assert_close(omega.add_to_(y, 0.3), expected, **TOL)


def test_block_products_equal_the_formed_matrix():
    """``V^T Omega`` from factored and explicit blocks, against every slice kind."""
    omega, dense = _omega_and_dense()
    torch.manual_seed(2)
    n, v = 4, 3
    blocks = []
    for shape in SHAPES:
        if len(shape) == 2:
            blocks.append(KronBlock(torch.randn(v, n, shape[0], dtype=torch.float64),
                                    torch.randn(n, shape[1], dtype=torch.float64)))
        else:
            blocks.append(DenseBlock(torch.randn(v * n, shape.numel(), dtype=torch.float64)))
    rows = torch.cat([b.to_dense() for b in blocks], dim=1)
    torch.testing.assert_close(omega.block_products(blocks), rows @ dense, **TOL)
    # an explicit block over a Khatri-Rao slice takes the formed slice
    blocks[0] = DenseBlock(blocks[0].to_dense())
    torch.testing.assert_close(omega.block_products(blocks), rows @ dense, **TOL)


def test_moves_and_casts_without_a_new_draw():
    omega, dense = _omega_and_dense()
    single = omega.to(torch.float32)
    assert single.dtype == torch.float32 and single.factors(0)[0].dtype == torch.float32
    torch.testing.assert_close(single.dense().double(), dense, rtol=1e-6, atol=0)
    assert omega.dense().dtype == torch.float64  # the original is unchanged
    with pytest.raises(ValueError, match="do not hold"):
        Omega(5, DIM + 1, torch.zeros(1), 0, SHAPES)


def _basis_omega(cols=5, basis_cols=3, seed=0):
    torch.manual_seed(seed + 7)
    basis = torch.linalg.qr(torch.randn(DIM, basis_cols, dtype=torch.float64))[0]
    omega, dense = _omega_and_dense(cols, seed)
    return BasisOmega(basis, omega), torch.cat([basis, dense], dim=1)


def test_basis_columns_come_first_in_every_product():
    warm, dense = _basis_omega()
    assert warm.cols == 8 and warm.dense().T.is_contiguous()
    torch.testing.assert_close(warm.dense(), dense, rtol=0, atol=0)
    torch.manual_seed(1)
    x = torch.randn(DIM, 4, dtype=torch.float64)
    torch.testing.assert_close(warm.t_matmul(x), dense.T @ x, **TOL)
    torch.testing.assert_close(warm.gram(), dense.T @ dense, **TOL)
    y = torch.randn(8, DIM, dtype=torch.float64).T  # the sketch's layout
    expected = y + 0.3 * dense
    torch.testing.assert_close(warm.add_to_(y, 0.3), expected, **TOL)
    n, v = 4, 3
    blocks = [KronBlock(torch.randn(v, n, s[0], dtype=torch.float64),
                        torch.randn(n, s[1], dtype=torch.float64)) if len(s) == 2
              else DenseBlock(torch.randn(v * n, s.numel(), dtype=torch.float64))
              for s in SHAPES]
    rows = torch.cat([b.to_dense() for b in blocks], dim=1)
    torch.testing.assert_close(warm.block_products(blocks), rows @ dense, **TOL)
    assert warm.nbytes() == 8 * 3 * DIM + warm.omega.nbytes()
    with pytest.raises(ValueError, match="rows"):
        BasisOmega(torch.zeros(DIM + 1, 2, dtype=torch.float64), warm.omega)
