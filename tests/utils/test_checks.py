"""Every validation error has its own test."""

import pytest
import torch
from torch import nn

import lowrank_laplace as ll
from tests import reference as ref
from tests.conftest import make_case


@pytest.fixture
def mlp():
    return make_case("mlp", "ce-mean")


def test_unsupported_loss(mlp):
    model, _, X, y = mlp
    with pytest.raises(TypeError, match="Unsupported loss NLLLoss"):
        ll.ggn_eigh(model, nn.NLLLoss(), X, y)


@pytest.mark.parametrize("reduction", ["none", "batchmean"])
def test_bad_reduction(mlp, reduction):
    model, _, X, y = mlp
    loss = nn.CrossEntropyLoss()
    loss.reduction = reduction
    with pytest.raises(ValueError, match="reduction='mean' or reduction='sum'"):
        ll.ggn_eigh(model, loss, X, y)


def test_weighted_cross_entropy(mlp):
    model, _, X, y = mlp
    with pytest.raises(ValueError, match="class weights or label smoothing"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(label_smoothing=0.1), X, y)


def test_unsupported_layer_named():
    model = nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    with pytest.raises(NotImplementedError, match=r"Layer '1' \(GELU\).*functorch"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, backend="backpack")
    auto = ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, top_k=None)
    assert auto.backend == "hooks"  # all trainable weights in linear layers
    with ll.FactorEngine(model, nn.CrossEntropyLoss()) as engine:
        assert engine.backend == "hooks" and "GELU" in engine.backpack_problem


def test_unknown_backend(mlp):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match="backend must be one of"):
        ll.ggn_eigh(model, loss, X, y, backend="jax")


def test_functorch_failure_names_module():
    class ViaNumpy(nn.Module):
        def forward(self, x):
            return torch.from_numpy(x.detach().numpy() * 2) + x  # leaves torch

    model = nn.Sequential(nn.Linear(3, 2), ViaNumpy())
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(NotImplementedError, match=r"module '1'.*last_layer"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, backend="functorch")


def test_data_dependent_control_flow_runs_sample_by_sample():
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x  # vmap cannot batch this branch

    model = nn.Sequential(nn.Linear(3, 2), Branchy()).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    res = ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, top_k=None)
    G = ref.ggn(model, nn.CrossEntropyLoss(), X, y)
    torch.testing.assert_close(res.trace, torch.trace(G), rtol=1e-5, atol=1e-8)


def test_functional_operation_detected():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.exp(self.a(x)))  # no BackPACK module computes exp

    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(NotImplementedError,
                       match="input of 'b'.*functional operation.*converter could not"):
        ll.ggn_eigh(Net(), nn.CrossEntropyLoss(), X, y, backend="backpack")
    assert ll.ggn_eigh(Net(), nn.CrossEntropyLoss(), X, y).backend == "hooks"
    assert ll.ggn_eigh(Net(), nn.CrossEntropyLoss(), X, y, backend="functorch").backend \
        == "functorch"


def test_batchnorm_in_train_mode():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="training mode.*model.eval"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y)


def test_target_dtype_for_cross_entropy(mlp):
    model, loss, X, _ = mlp
    with pytest.raises(ValueError, match="class-index targets of dtype torch.long"):
        ll.ggn_eigh(model, loss, X, torch.zeros(X.shape[0]))


def test_target_out_of_range(mlp):
    model, loss, X, _ = mlp
    with pytest.raises(ValueError, match=r"Class indices must lie in \[0, 3\)"):
        ll.ggn_eigh(model, loss, X, torch.full((X.shape[0],), 7))


def test_target_shape_for_mse(mlp):
    model, _, X, _ = mlp
    with pytest.raises(ValueError, match="MSELoss needs floating-point targets"):
        ll.ggn_eigh(model, nn.MSELoss(), X, torch.zeros(X.shape[0], 2, dtype=X.dtype))


def test_batch_size_mismatch(mlp):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match="first dimensions must match"):
        ll.ggn_eigh(model, loss, X, y[:2])


def test_empty_batch(mlp):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match="Empty batch"):
        ll.ggn_eigh(model, loss, X[:0], y[:0])


def test_non_tensor_inputs(mlp):
    model, loss, X, y = mlp
    with pytest.raises(TypeError, match="must be a torch.Tensor or a dict batch"):
        ll.ggn_eigh(model, loss, X.tolist(), y)


def test_output_must_be_2d():
    model = nn.Sequential(nn.Conv1d(1, 2, 2))
    X, y = torch.randn(3, 1, 4), torch.randn(3, 2, 3)
    with pytest.raises(ValueError, match=r"output must have shape \(N, C\)"):
        ll.ggn_eigh(model, nn.MSELoss(), X, y)


@pytest.mark.parametrize("sub, msg", [
    ([0, 9], r"must lie in \[0, 5\)"),
    ([-1], r"must lie in \[0, 5\)"),
    ([1, 1], "duplicate"),
    ([], "subsampling is empty"),
])
def test_bad_subsampling(mlp, sub, msg):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match=msg):
        ll.ggn_eigh(model, loss, X, y, subsampling=sub)


@pytest.mark.parametrize("mc", [-1, 1.5, True])
def test_bad_mc_samples(mlp, mc):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match="mc_samples must be 0"):
        ll.ggn_eigh(model, loss, X, y, mc_samples=mc)


def test_non_finite_loss(mlp):
    model, loss, X, y = mlp
    X = X.clone()
    X[0, 0] = float("nan")
    with pytest.raises(ValueError, match="loss is not finite"):
        ll.ggn_eigh(model, loss, X, y)


def test_param_group_errors(mlp):
    model, loss, X, y = mlp
    p = list(model.parameters())
    with pytest.raises(ValueError, match="dict with key 'params'"):
        ll.ggn_eigh(model, loss, X, y, param_groups=[p])
    with pytest.raises(ValueError, match="has no parameters"):
        ll.ggn_eigh(model, loss, X, y, param_groups=[{"params": []}])
    with pytest.raises(ValueError, match="not in the model"):
        ll.ggn_eigh(model, loss, X, y, param_groups=[{"params": [nn.Parameter(torch.ones(2))]}])
    with pytest.raises(ValueError, match="more than one group"):
        ll.ggn_eigh(model, loss, X, y, param_groups=[{"params": p}, {"params": p[:1]}])


def test_no_trainable_parameters(mlp):
    model, loss, X, y = mlp
    for q in model.parameters():
        q.requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        ll.ggn_eigh(model, loss, X, y)


def test_module_called_twice():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.Tanh(), lin)
    X, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    with pytest.raises(NotImplementedError, match="tied parameter.*functorch"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y, backend="backpack")

    class Twice(nn.Module):  # one module, registered once, called twice
        def __init__(self):
            super().__init__()
            self.lin, self.act = nn.Linear(3, 3), nn.Tanh()

        def forward(self, x):
            return self.lin(self.act(self.lin(x)))

    with pytest.raises(NotImplementedError, match="owns parameters|called more than once"):
        ll.ggn_eigh(Twice(), nn.CrossEntropyLoss(), X, y, backend="backpack")


def test_closed_engine(mlp):
    model, loss, X, y = mlp
    with ll.FactorEngine(model, loss) as engine:
        engine.compute(X, y)
    with pytest.raises(RuntimeError, match="engine is closed"):
        engine.compute(X, y)
    with pytest.raises(ValueError, match="keep_blocks, compute_grams and/or project"):
        ll.FactorEngine(model, loss).compute(X, y, keep_blocks=False)


def test_ignore_index_refused(mlp):
    model, _, X, y = mlp
    y = y.clone()
    y[0] = 1
    with pytest.raises(ValueError, match="ignore_index=1"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(ignore_index=1), X, y)
    y[0] = -100  # the default ignore_index
    with pytest.raises(ValueError, match="ignore_index=-100"):
        ll.ggn_eigh(model, nn.CrossEntropyLoss(), X, y)


@pytest.mark.parametrize("backend", ["backpack", "functorch"])
def test_zero_ggn_gives_an_empty_spectrum(backend):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    X, y = torch.randn(5, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    loss = nn.CrossEntropyLoss()  # one output: the loss is constant, the GGN zero
    for low_memory in (False, True):
        res = ll.ggn_eigh(model, loss, X, y, top_k=3, low_memory=low_memory, backend=backend)
        assert res.eigenvalues.numel() == 0 and res.eigenvectors.shape == (21, 0)
        assert float(res.kept_fraction) == 1.0
        dd = ll.directional_derivatives(model, loss, X, y, low_memory=low_memory,
                                        backend=backend)
        assert dd.gammas.shape == (5, 0) and dd.lambdas.shape == (5, 0)
        step = ll.damped_newton_step(model, loss, X, y, low_memory=low_memory,
                                     backend=backend)
        assert torch.equal(step, torch.zeros_like(step))
    assert ll.ggn_eigvals(model, loss, X, y, backend=backend).numel() == 0


@pytest.mark.parametrize("vec, msg", [
    (lambda d: torch.randn(d, 2, 2, dtype=torch.float64), r"shape \(D,\) or \(D, K\)"),
    (lambda d: [0.0] * d, r"shape \(D,\) or \(D, K\), got list"),
    (lambda d: torch.randn(d), "dtype torch.float32"),
])
def test_inverse_matvec_vector_checks(mlp, vec, msg):
    model, loss, X, y = mlp
    dim = sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=msg):
        ll.ggn_inverse_matvec(model, loss, X, y, vec(dim), damping=1.0)


def test_empty_param_groups_fractional_subsampling_duplicate_indices(mlp):
    model, loss, X, y = mlp
    with pytest.raises(ValueError, match="param_groups is empty"):
        ll.ggn_eigh(model, loss, X, y, param_groups=[])
    with pytest.raises(ValueError, match="integer sample indices"):
        ll.ggn_eigh(model, loss, X, y, subsampling=[0.5])
    with pytest.raises(ValueError, match="indices contains duplicates"):
        ll.ggn_eigh(model, loss, X, y, top_k=None, indices=[1, 1])


def test_memory_budget_units():
    from lowrank_laplace.fitting.budget import resolve_memory_budget

    cpu = torch.device("cpu")
    assert resolve_memory_budget("1GB", cpu) == 10**9
    assert resolve_memory_budget("512 MiB", cpu) == 2**29
    with pytest.raises(ValueError, match="not a size"):
        resolve_memory_budget("lots", cpu)
    with pytest.raises(ValueError, match="must be bytes"):
        resolve_memory_budget([1], cpu)


def test_adaptive_pooling_with_unequal_windows():
    model = nn.Sequential(nn.Conv2d(1, 2, 2), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                          nn.Linear(8, 3)).double()
    X, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    loss = nn.CrossEntropyLoss()
    with pytest.raises(NotImplementedError, match=r"does not divide.*functorch"):
        ll.ggn_eigh(model, loss, X, y, backend="backpack")
    res = ll.ggn_eigh(model, loss, X, y, top_k=None)  # auto: 5 x 5 -> 2 x 2 via functorch
    assert res.backend == "functorch"
    torch.testing.assert_close(res.trace, torch.trace(ref.ggn(model, loss, X, y)))


def test_predict_on_an_empty_batch():
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(3, 2)).double()
    X, y = torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 2, (6,))
    la = ll.LowRankGGNLaplace(model, "classification")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=3))
    with pytest.raises(ValueError, match="Empty batch"):
        la(X[:0], pred_type="glm")


def test_user_backward_hooks_do_not_fire_in_internal_passes(mlp):
    """Forward hooks are part of the function (these only look, so BackPACK keeps them);
    backward hooks are not, and none of the user's hooks is removed or added."""
    from torch.utils.data import DataLoader, TensorDataset

    model, loss, X, y = mlp
    calls, seen = [], []
    handles = [model.register_forward_hook(lambda *a: seen.append("model")),
               model[0].register_forward_pre_hook(lambda *a: seen.append("layer")),
               model[0].register_full_backward_hook(lambda *a: calls.append("backward"))]
    for backend in ("backpack", "functorch"):
        ll.ggn_eigh(model, loss, X, y, low_memory=True, backend=backend)
        la = ll.LowRankGGNLaplace(model, "classification", factor_backend=backend)
        la.fit(DataLoader(TensorDataset(X, y), batch_size=3))
        la(X, pred_type="glm")
    assert calls == []
    assert all(len(h.hooks_dict_ref()) == 1 for h in handles)


@pytest.mark.parametrize("size, text", [(512, "512 bytes"), (1536, "1.5 KiB"),
                                        (3 * 2**20 + 2**19, "3.5 MiB"),
                                        (1.04 * 2**30, "1.04 GiB")])
def test_sizes_in_messages_are_in_the_unit_they_fill(size, text):
    from lowrank_laplace.utils.batches import format_bytes

    assert format_bytes(size) == text
