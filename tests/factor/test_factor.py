"""The GGN factor V against dense torch.func references."""

import pytest
import torch
from torch import nn

from lowrank_laplace import FactorEngine
from lowrank_laplace.factor.blocks import DenseBlock, KronBlock
from lowrank_laplace.factor.conv_block import ConvBlock, factored_gram_pays
from tests import reference as ref
from tests.conftest import make_case

TOL = dict(rtol=1e-5, atol=1e-8)


def dense_V(factor, group=0):
    eye = torch.eye(factor.num_columns, dtype=torch.float64)
    return factor.matmul(eye, group)


def test_factor_equals_dense_ggn(case):
    model, loss_func, X, y = case
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, compute_grams=True)
    V = dense_V(factor)
    G = ref.ggn(model, loss_func, X, y)
    torch.testing.assert_close(V @ V.T, G, **TOL)
    torch.testing.assert_close(factor.gram(), V.T @ V, **TOL)
    torch.testing.assert_close(factor.trace(), torch.trace(G), **TOL)
    torch.testing.assert_close(factor.diag(), G.diagonal(), **TOL)
    x = torch.randn(G.shape[0], 2, dtype=G.dtype)
    torch.testing.assert_close(factor.matvec(x), G @ x, **TOL)


def test_gram_computed_once_and_trace_from_it(case):
    model, loss_func, X, y = case
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
    G = ref.ggn(model, loss_func, X, y)
    before = factor.trace()  # from the blocks' row norms
    gram = factor.gram()
    assert factor.gram() is gram  # kept: a second call costs nothing
    torch.testing.assert_close(factor.trace(), before, **TOL)  # now its diagonal
    torch.testing.assert_close(factor.trace(), torch.trace(G), **TOL)


def test_stagewise_gram_equals_kept(case):
    model, loss_func, X, y = case
    with FactorEngine(model, loss_func) as engine:
        lean = engine.compute(X, y, keep_blocks=False, compute_grams=True)
        full = engine.compute(X, y)
    assert lean.blocks == {}
    torch.testing.assert_close(lean.gram(), full.gram(), **TOL)
    with pytest.raises(RuntimeError, match="not kept"):
        lean.matmul(torch.eye(lean.num_columns, dtype=torch.float64))


def test_projection_pass_equals_products_with_kept_blocks(case):
    model, loss_func, X, y = case
    params = list(model.parameters())
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    with FactorEngine(model, loss_func) as engine:
        full = engine.compute(X, y, param_groups=groups)
        Y = torch.randn(full.num_columns, 3, dtype=torch.float64)
        lean = engine.compute(X, y, param_groups=groups, keep_blocks=False, project=[Y, None])
        with pytest.raises(ValueError, match="one entry per group"):
            engine.compute(X, y, param_groups=groups, project=[Y])
        with pytest.raises(ValueError, match="cross_batch_grads needs batch_grad=True"):
            engine.compute(X, y, cross_batch_grads=True)
        grads = engine.gradient(X, y, param_groups=groups)
        x = torch.randn(full.group_dim(1), 2, dtype=torch.float64)
        transposed = engine.compute(X, y, param_groups=groups, keep_blocks=False,
                                    t_project=[None, x])
    assert lean.blocks == {}
    torch.testing.assert_close(lean.projected_flat(0), full.matmul(Y, 0), **TOL)
    for g in range(2):
        torch.testing.assert_close(grads[g], full.grad_flat(g), **TOL)
    torch.testing.assert_close(transposed.t_projected[1], full.t_matmul(x, 1), **TOL)
    assert 0 not in transposed.t_projected
    with pytest.raises(RuntimeError, match="not projected"):
        lean.projected_flat(1)


@pytest.mark.parametrize("loss", ["ce-mean", "ce-sum", "mse-mean", "mse-sum"])
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_subsampling_equals_dense_ggn_of_subset(arch, loss):
    model, loss_func, X, y = make_case(arch, loss, n=6)
    sub = [4, 0, 2]
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, subsampling=sub)
    V = dense_V(factor)
    assert factor.num_curv_samples == 3
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y, subsampling=sub), **TOL)
    # the gradient still uses the whole batch
    torch.testing.assert_close(factor.grad_flat(), ref.gradient(model, loss_func, X, y), **TOL)


@pytest.mark.parametrize("loss", ["ce-mean", "mse-sum"])
def test_mc_ggn_is_unbiased(loss):
    model, loss_func, X, y = make_case("mlp", loss, n=3)
    torch.manual_seed(1)
    mc = 40_000
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, mc_samples=mc)
    assert factor.num_columns == mc * 3
    Vt = torch.cat([factor.blocks[i].to_dense() for i in factor.groups[0]], dim=1)
    G = ref.ggn(model, loss_func, X, y)
    V = Vt.T
    # Monte-Carlo error ~ 1/sqrt(mc) relative to the largest entry
    err = (V @ V.T - G).abs().max() / G.abs().max()
    assert err < 3e-2


@pytest.mark.parametrize("arch", ["mlp", "cnn", "residual"])
def test_param_groups_give_diagonal_blocks(arch):
    model, loss_func, X, y = make_case(arch, "ce-mean")
    params = list(model.parameters())
    groups = [{"params": params[i : i + 2]} for i in range(0, len(params), 2)]
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, param_groups=groups)
    G = ref.ggn(model, loss_func, X, y)
    start = 0
    for g in range(len(groups)):
        V = dense_V(factor, g)
        d = V.shape[0]
        torch.testing.assert_close(V @ V.T, G[start : start + d, start : start + d], **TOL)
        start += d


def test_per_sample_gradients(case):
    model, loss_func, X, y = case
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, batch_grad=True)
    N = X.shape[0]
    scale = N if loss_func.reduction == "mean" else 1
    V = dense_V(factor)
    g_n = ref.per_sample_grads(model, loss_func, X, y)
    torch.testing.assert_close(scale * factor.t_matmul_batch_grads(), V.T @ g_n.T, **TOL)


def test_linear_gram_without_expansion():
    torch.manual_seed(0)
    s, z = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    kron = KronBlock(s, z)
    dense = DenseBlock(kron.to_dense())
    # row m = v N + n is vec(s_vn z_n^T), row-major like a (5, 3) weight
    torch.testing.assert_close(dense.rows[7], torch.outer(s[1, 3], z[3]).flatten())
    torch.testing.assert_close(kron.gram(), dense.gram(), **TOL)
    torch.testing.assert_close(kron.row_sq_norms(), dense.row_sq_norms(), **TOL)
    torch.testing.assert_close(kron.diag_outer(), dense.diag_outer(), **TOL)
    torch.testing.assert_close(dense.diag_outer(), (dense.rows.T @ dense.rows).diagonal(), **TOL)
    x, y = torch.randn(15, 2, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    torch.testing.assert_close(kron.t_matmul(x), dense.t_matmul(x), **TOL)
    torch.testing.assert_close(kron.matmul(y), dense.matmul(y), **TOL)
    start = torch.randn(15, 2, dtype=torch.float64)
    for block in (kron, dense):
        torch.testing.assert_close(block.matmul_add_(start.clone(), y), start + dense.matmul(y),
                                   **TOL)
    other = KronBlock(torch.randn(1, 4, 5, dtype=torch.float64), z)
    torch.testing.assert_close(kron.cross(other), dense.cross(other), **TOL)
    torch.testing.assert_close(kron.cross(DenseBlock(other.to_dense())), dense.cross(other), **TOL)
    torch.testing.assert_close(dense.cross(other), dense.rows @ other.to_dense().T, **TOL)
    w = torch.rand(15, dtype=torch.float64)
    for weight in (0.7, torch.tensor([0.7], dtype=torch.float64), w):
        torch.testing.assert_close(kron.weighted_gram(weight), dense.weighted_gram(weight), **TOL)
        torch.testing.assert_close(kron.sample_gram(3, weight), dense.sample_gram(3, weight), **TOL)
    expected = (dense.rows * w) @ dense.rows.T
    torch.testing.assert_close(dense.weighted_gram(w), expected, **TOL)
    torch.testing.assert_close(dense.weighted_gram(0.7), 0.7 * dense.rows @ dense.rows.T, **TOL)
    scalar_blocks = (0.7 * dense.rows @ dense.rows.T).reshape(3, 4, 3, 4)
    torch.testing.assert_close(dense.sample_gram(3, 0.7),
                               scalar_blocks.diagonal(dim1=1, dim2=3).permute(2, 0, 1), **TOL)
    blocks = expected.reshape(3, 4, 3, 4).diagonal(dim1=1, dim2=3).permute(2, 0, 1)
    torch.testing.assert_close(dense.sample_gram(3, w), blocks, **TOL)



@pytest.mark.parametrize("row_wise", [1, 2**30])
def test_explicit_block_diagonal_row_by_row_or_in_chunks(monkeypatch, row_wise):
    """The GGN diagonal of an explicit block, slabs of squared rows added into 16
    accumulators (wide blocks on the CPU; 150 rows: a short last slab, 5 rows: one) or
    over chunks of rows."""
    from lowrank_laplace.factor import dense_block

    monkeypatch.setattr(dense_block, "_ROW_WISE_DIAG_COLUMNS", row_wise)
    torch.manual_seed(0)
    for num_rows in (150, 5, 0):
        block = DenseBlock(torch.randn(num_rows, 7, dtype=torch.float64))
        torch.testing.assert_close(block.diag_outer(),
                                   (block.rows.T @ block.rows).diagonal(), **TOL)


@pytest.mark.parametrize("n, k", [(5, 3), (5, 40), (520, 3)])
def test_factored_products_into_contiguous_outputs_take_every_order(n, k):
    """``out += B^T y`` of a factored weight into a ``(D, K)`` output: per output unit
    in place (few samples, at least 32 columns) or over slabs of 16 output units (few
    columns, such as top-k eigenvectors, or many samples)."""
    torch.manual_seed(0)
    kron = KronBlock(torch.randn(2, n, 35, dtype=torch.float64),
                     torch.randn(n, 4, dtype=torch.float64))
    dense = DenseBlock(kron.to_dense())
    y = torch.randn(2 * n, k, dtype=torch.float64)
    start = torch.randn(35 * 4, k, dtype=torch.float64)
    torch.testing.assert_close(kron.matmul_add_(start.clone(), y),
                               start + dense.rows.T @ y, **TOL)


@pytest.mark.parametrize("k", [3, 16, 17, 40])
@pytest.mark.parametrize("out_dim, in_dim", [(7, 4), (4, 7)])
def test_factored_products_with_vectors_take_either_contraction(k, out_dim, in_dim):
    """``B x`` of a factored weight: one wide product ``z X`` for up to 16 columns, one
    product per output unit above."""
    torch.manual_seed(0)
    kron = KronBlock(torch.randn(3, 11, out_dim, dtype=torch.float64),
                     torch.randn(11, in_dim, dtype=torch.float64))
    x = torch.randn(out_dim * in_dim, k, dtype=torch.float64)
    torch.testing.assert_close(kron.t_matmul(x), kron.to_dense() @ x, **TOL)


@pytest.mark.parametrize("entries", [1, 2**30])
def test_small_factored_products_into_transposed_outputs_in_chunks(monkeypatch, entries):
    """A small weight's per-sample products into a transposed output are formed in
    chunks of samples (here 16, 16 and 8, or all 40 at once, as on a GPU) and reuse one
    buffer."""
    from lowrank_laplace.factor import kron_block

    monkeypatch.setattr(kron_block, "_ACC_ENTRIES", entries)
    torch.manual_seed(0)
    kron = KronBlock(torch.randn(3, 40, 5, dtype=torch.float64),
                     torch.randn(40, 6, dtype=torch.float64))
    dense = DenseBlock(kron.to_dense())
    y = torch.randn(120, 4, dtype=torch.float64)
    out_wide = torch.randn(4, 30, dtype=torch.float64)
    expected = out_wide.T + dense.rows.T @ y
    kron.matmul_add_(out_wide.T, y)
    torch.testing.assert_close(out_wide.T, expected, **TOL)


@pytest.mark.parametrize("one_product", [True, False])
@pytest.mark.parametrize("wide", [False, True])
def test_products_with_operands_stored_transposed(wide, one_product, monkeypatch):
    """``x`` and ``out`` as row slices of ``(K, D)`` tensors (the sketch's layout) give
    the products of contiguous operands, for factored and explicit blocks (wide
    blocks with many rows take the dense block's other product order; small factored
    weights take one wide product each way, large ones one product per column)."""
    from lowrank_laplace.factor import kron_block

    for name in ("_ONE_PRODUCT_MAX", "_ONE_PRODUCT_MAX_TRANSPOSED"):
        monkeypatch.setattr(kron_block, name, 2**30 if one_product else 0)
    torch.manual_seed(0)
    num_vecs, n, out_dim, in_dim, k = (9, 4, 6, 800, 3) if wide else (3, 4, 5, 3, 2)
    s = torch.randn(num_vecs, n, out_dim, dtype=torch.float64)
    kron = KronBlock(s, torch.randn(n, in_dim, dtype=torch.float64))
    dense = DenseBlock(kron.to_dense())
    d, offset = out_dim * in_dim, 7
    x_wide = torch.randn(k, d + 2 * offset, dtype=torch.float64)
    x = x_wide.T[offset:offset + d]  # (d, K), unit stride down the columns
    assert not x.is_contiguous() and x.stride(0) == 1
    y = torch.randn(num_vecs * n, k, dtype=torch.float64)
    expected_t = dense.rows @ x.contiguous()
    for block in (kron, dense):
        torch.testing.assert_close(block.t_matmul(x), expected_t, **TOL)
        out_wide = torch.randn(k, d + 2 * offset, dtype=torch.float64)
        before = out_wide.clone()
        block.matmul_add_(out_wide.T[offset:offset + d], y)
        torch.testing.assert_close(out_wide.T[offset:offset + d],
                                   before.T[offset:offset + d] + dense.rows.T @ y, **TOL)
        # nothing outside the slice is touched
        assert torch.equal(out_wide[:, :offset], before[:, :offset])
        assert torch.equal(out_wide[:, offset + d:], before[:, offset + d:])


@pytest.mark.parametrize("out_dim, in_dim", [(5, 6), (6, 5)])  # both contraction orders
@pytest.mark.parametrize("chunk", [2**24, 13])  # 13: a few rows per chunk
def test_product_with_khatri_rao_columns_equals_the_explicit_one(monkeypatch, out_dim,
                                                                  in_dim, chunk):
    """``B (p_k (x) q_k)`` of factored blocks and of explicit ones (with fewer rows than
    ``max(out, in)`` without forming the columns, with more by forming them) equals the
    explicit product; factors of the wrong sizes are refused."""
    from lowrank_laplace.factor import dense_block

    monkeypatch.setattr(dense_block, "_KHATRI_RAO_CHUNK", chunk)
    torch.manual_seed(0)
    kron = KronBlock(torch.randn(3, 4, out_dim, dtype=torch.float64),
                     torch.randn(4, in_dim, dtype=torch.float64))
    dense = DenseBlock(kron.to_dense())
    p = torch.randn(7, out_dim, dtype=torch.float64)
    q = torch.randn(7, in_dim, dtype=torch.float64)
    x = (p[:, :, None] * q[:, None, :]).reshape(7, -1).T  # (out * in, K), out-major
    few = DenseBlock(dense.rows[:3])  # 3 rows < max(out, in)
    for block in (kron, dense, few, kron.to(torch.float32), dense.to(torch.float32)):
        expected = block.to_dense().double() @ x
        tol = TOL if block.dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
        own = block.t_matmul_khatri_rao(p.to(block.dtype), q.to(block.dtype))
        torch.testing.assert_close(own.double(), expected, **tol)
        # into an existing sum in place (a float64 one beside a float32 block): one more term
        out = torch.ones_like(expected)
        assert block.t_matmul_khatri_rao(p, q, out) is out
        torch.testing.assert_close(out, 1 + expected, **tol)
        out = torch.ones_like(expected)
        assert block.t_matmul(x, out) is out
        torch.testing.assert_close(out, 1 + expected, **tol)
        with pytest.raises(ValueError, match="do not match"):
            block.t_matmul_khatri_rao(p[:, :-1], q)


def test_blocks_of_passes_concatenated_only_when_read_whole():
    """Explicit blocks of several passes (one scaled, one factored) give the products of
    their explicit concatenation, rows ``(v, n)``, part by part; ``rows`` forms it."""
    from lowrank_laplace.factor import cat_blocks

    torch.manual_seed(0)
    V, out_dim, in_dim = 3, 4, 5
    kron = KronBlock(torch.randn(V, 2, out_dim, dtype=torch.float64),
                     torch.randn(2, in_dim, dtype=torch.float64))
    parts = [DenseBlock(torch.randn(V * n, out_dim * in_dim, dtype=torch.float64))
             for n in (4, 3)] + [kron]
    alphas = [1.0, 0.5, 1.0]
    explicit = torch.cat([(b.to_dense() * a).reshape(V, -1, out_dim * in_dim)
                          for b, a in zip(parts, alphas)], dim=1).reshape(-1, out_dim * in_dim)
    block = cat_blocks(parts, alphas, V)
    x = torch.randn(out_dim * in_dim, 6, dtype=torch.float64)
    y = torch.randn(explicit.shape[0], 6, dtype=torch.float64)
    p, q = torch.randn(6, out_dim, dtype=torch.float64), torch.randn(6, in_dim, dtype=torch.float64)
    torch.testing.assert_close(block.t_matmul(x), explicit @ x, **TOL)
    torch.testing.assert_close(block.t_matmul_khatri_rao(p, q),
                               explicit @ (p[:, :, None] * q[:, None, :]).reshape(6, -1).T, **TOL)
    for product in (lambda out: block.t_matmul(x, out),  # added part by part, in place
                    lambda out: block.t_matmul_khatri_rao(p, q, out)):
        out = torch.ones(explicit.shape[0], 6, dtype=torch.float64)
        assert product(out) is out
        torch.testing.assert_close(out, 1 + product(None), **TOL)
    torch.testing.assert_close(block.row_sq_norms(), (explicit**2).sum(1), **TOL)
    torch.testing.assert_close(block.diag_outer(), (explicit**2).sum(0), **TOL)
    out = torch.ones(out_dim * in_dim, 6, dtype=torch.float64)
    torch.testing.assert_close(block.matmul_add_(out, y), 1 + explicit.T @ y, **TOL)
    assert block.to(torch.float64) is block and "rows" not in vars(block)  # nothing formed
    torch.testing.assert_close(block.rows, explicit, rtol=0, atol=0)
    assert block.to(torch.float32).dtype == torch.float32


@pytest.mark.parametrize("num_rows", [5, 191, 192, 250])
def test_dense_gram_blocked_symmetric(num_rows):
    """The blocked Gram (upper block triangle mirrored) equals the plain product.

    The code guarantees exact symmetry (averaging, mirroring); the reference product
    itself is compared with tolerances only, since a BLAS ``A A^T`` need not be
    bitwise symmetric (e.g. MKL's AVX512 kernels).
    """
    torch.manual_seed(0)
    rows = torch.randn(num_rows, 37, dtype=torch.float64)
    gram = DenseBlock(rows).gram()
    torch.testing.assert_close(gram, rows @ rows.T, **TOL)
    assert torch.equal(gram, gram.T)  # enforced by the code, not by the kernel

def _hook_count(model):
    return sum(
        len(m._forward_hooks) + len(m._backward_hooks) + len(m._forward_pre_hooks)
        for m in model.modules()
    )


@pytest.mark.parametrize("train", [False, True])
def test_model_left_as_it_was(train):
    model, loss_func, X, y = make_case("mlp", "ce-mean")
    model.train(train)
    model[2].weight.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    flags = [p.requires_grad for p in model.parameters()]
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
    assert factor.group_dim() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert _hook_count(model) == 0
    assert model.training == train
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p)
    assert not any(hasattr(m, "input0") or hasattr(m, "_backpack_extend") for m in model.modules())
    # torch.func still works on the same model
    params = {n: p.detach() for n, p in model.named_parameters()}
    torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (X,)))(params)
    from backpack.context import CTX

    assert engine.backend == "backpack"
    assert all(h not in CTX.hook_handles for h in engine._impl._handles)


def test_engine_follows_parameter_updates():
    model, loss_func, X, y = make_case("mlp", "mse-mean")
    with FactorEngine(model, loss_func) as engine:
        engine.compute(X, y)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        factor = engine.compute(X, y)
    V = dense_V(factor)
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_and_dtype_follow_model(device, dtype):
    model, loss_func, X, y = make_case("cnn", "ce-mean", device=device, dtype=dtype)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
    gram = factor.gram()
    assert gram.dtype == dtype and gram.device.type == device
    G = ref.ggn(model.double(), loss_func, X.double(), y)
    V = factor.matmul(torch.eye(factor.num_columns, dtype=dtype, device=device)).double()
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else TOL  # float32 rounding
    torch.testing.assert_close(V @ V.T, G, **tol)


def test_unsupported_module_with_children_and_params():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.extra = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return self.inner(x) * self.extra

    with pytest.raises(NotImplementedError, match="owns parameters"):
        FactorEngine(nn.Sequential(Odd(), nn.Linear(2, 2)), nn.MSELoss(), backend="backpack")


@pytest.mark.parametrize("kernel, dilation, padding, stride", [
    ((3, 3), (1, 1), (0, 0), (1, 1)),
    ((3, 2), (2, 1), (2, 1), (2, 3)),
    ((1, 4), (1, 2), (0, 3), (1, 1)),
])
def test_unfold_input_matches_torch(kernel, dilation, padding, stride):
    from lowrank_laplace.engine.backpack.extensions import unfold_input

    x = torch.randn(3, 2, 9, 10, dtype=torch.float64)
    expected = torch.nn.functional.unfold(x, kernel, dilation, padding, stride)
    torch.testing.assert_close(unfold_input(x, kernel, dilation, padding, stride), expected)


def test_blocks_change_dtype_and_stay_factored():
    torch.manual_seed(0)
    dense = DenseBlock(torch.randn(6, 5, dtype=torch.float32))
    kron = KronBlock(torch.randn(2, 3, 4, dtype=torch.float32), torch.randn(3, 5))
    for block in (dense, kron):
        wide = block.to(torch.float64)
        assert type(wide) is type(block) and block.to(torch.float32) is block
        assert wide.to_dense().dtype == torch.float64
        torch.testing.assert_close(wide.to_dense(), block.to_dense().double())


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
@pytest.mark.parametrize("mc_samples", [0, 1])
def test_take_samples_is_the_factor_of_those_samples(arch, mc_samples):
    """Dense (conv) and factored (linear) blocks, several vectors per sample or one."""
    model, loss_func, X, y = make_case(arch, "ce-sum", n=5)
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, mc_samples=mc_samples)
    V = dense_V(factor).reshape(-1, factor.num_vectors, 5)  # columns ordered (v, n)
    for start, stop in [(0, 2), (2, 5), (4, 5)]:
        piece = factor.take_samples(start, stop)
        assert piece.num_curv_samples == stop - start and piece.grams == []
        expected = V[:, :, start:stop].reshape(V.shape[0], -1)
        torch.testing.assert_close(dense_V(piece), expected, **TOL)
        torch.testing.assert_close(piece.gram(), expected.T @ expected, **TOL)


@pytest.mark.parametrize("arch, in_place, shared", [("cnn", True, False),
                                                    ("residual", None, True)])
def test_activations_multiply_in_place_only_what_nothing_else_reads(monkeypatch, arch,
                                                                    in_place, shared):
    """A branch point saves one matrix for both inputs: that one is multiplied apart."""
    import lowrank_laplace.engine.backpack.extensions as extensions

    calls = []
    exclusive = extensions._exclusive
    monkeypatch.setattr(extensions, "_exclusive",
                        lambda ext, mat: calls.append(exclusive(ext, mat)) or calls[-1])
    model, loss_func, X, y = make_case(arch, "ce-sum", n=5)
    with FactorEngine(model, loss_func, backend="backpack") as engine:
        factor = engine.compute(X, y)
    V = dense_V(factor)
    torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)
    assert calls  # every activation asked
    if in_place is not None:
        assert in_place in calls
    assert (False in calls) == shared


def _late_conv_case(dtype=torch.float64):
    """A convolution with few output positions and wide patches: its Gram pays from factors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 4))
    X, y = torch.randn(5, 8, 4, 4), torch.randint(0, 4, (5,))
    return model.to(dtype), nn.CrossEntropyLoss(reduction="sum"), X.to(dtype), y


@pytest.mark.parametrize("mc_samples", [0, 3])
def test_conv_gram_from_factors_equals_the_dense_ggn(mc_samples):
    """The conv block keeps its factors (2x2 positions, 72-entry patches) and its Gram,
    that of a piece of its samples, scaled and in float32 all equal the rows' products."""
    model, loss_func, X, y = _late_conv_case()
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y, mc_samples=mc_samples)
    assert isinstance(factor.blocks[0], ConvBlock)
    V = dense_V(factor)
    if not mc_samples:
        torch.testing.assert_close(V @ V.T, ref.ggn(model, loss_func, X, y), **TOL)
    torch.testing.assert_close(factor.gram(), V.T @ V, **TOL)
    block = factor.blocks[0]
    rows = block.rows.clone()
    piece = block.take_samples(1, 4, factor.num_vectors)
    expected = rows.reshape(factor.num_vectors, 5, -1)[:, 1:4].reshape(-1, rows.shape[1])
    assert isinstance(piece, ConvBlock)
    torch.testing.assert_close(piece.gram(), expected @ expected.T, **TOL)
    single = block.to(torch.float32)
    torch.testing.assert_close(single.gram().double(), rows @ rows.T, rtol=1e-5, atol=1e-5)
    gram = block.scale_(0.5).gram()
    torch.testing.assert_close(gram, rows @ rows.T / 4, **TOL)
    assert torch.equal(gram, gram.T) and block.nbytes > rows.numel() * 8


@pytest.mark.parametrize("layer, pays", [
    ((9, 64, 28 * 28, 3 * 25), False),  # DeepOBS 3c3d's convolutions, exact GGN of 10 classes
    ((9, 96, 12 * 12, 64 * 9), False),
    ((9, 128, 6 * 6, 96 * 9), True),
    ((1, 128, 6 * 6, 96 * 9), False),  # one MC vector
    ((9, 512, 7 * 7, 512 * 9), True),  # a ResNet's last stage
])
def test_conv_gram_from_factors_where_it_multiplies_less(layer, pays):
    assert factored_gram_pays(*layer) is pays


def test_conv_block_only_where_its_gram_pays(monkeypatch):
    import lowrank_laplace.factor.conv_block as conv_block

    monkeypatch.setattr(conv_block, "FACTORED_GRAM_ADVANTAGE", 1e9)
    model, loss_func, X, y = _late_conv_case()
    with FactorEngine(model, loss_func) as engine:
        factor = engine.compute(X, y)
    assert type(factor.blocks[0]) is DenseBlock


def test_conv_block_factors_outlive_the_engine_buffers():
    """A conv block behind a max-pool keeps its own factors: the next pass, which writes
    into the pool's reused buffer, leaves the first factor's Gram as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 6, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(6, 4)).double()
    loss_func = nn.CrossEntropyLoss(reduction="sum")
    X, y = torch.randn(10, 16, 4, 4, dtype=torch.float64), torch.randint(0, 4, (10,))
    with FactorEngine(model, loss_func) as engine:
        first = engine.compute(X[:5], y[:5])
        block = first.blocks[0]
        assert isinstance(block, ConvBlock)
        expected = block.rows @ block.rows.T
        engine.compute(X[5:], y[5:])
    torch.testing.assert_close(block.gram(), expected, **TOL)
