"""The library on a CUDA device against the same computation on the CPU.

Every test builds its case on the CPU in float64, runs it there, moves a copy to the
device and compares: engine results of both factor backends (the BackPACK converter,
torch.func), the low-memory modes' replay of Monte-Carlo draws with the device's
generator, both fit paths of ``Laplace`` (dense and streaming), its marginal
likelihood, Jacobian weighting and GLM predictive, dict batches, float32 on the
device, and the command line. Skipped on machines without CUDA.
"""

import copy

import pytest
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace as ll
from tests.conftest import one_pass_and_low_memory, set_tuning
from tests.engine.test_models import DictModel, zoo_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
TOL = dict(rtol=1e-6, atol=1e-9)
KW = dict(subset_of_weights="all", hessian_structure="lowrank_ggn")


def on_device(model, *tensors):
    """A copy of the model and the tensors on the device."""
    return (copy.deepcopy(model).to(DEVICE), *(t.to(DEVICE) for t in tensors))


def low_rank_matrix(res):
    """``U diag(lam) U^T`` of a result (unique where eigenvectors are not)."""
    U = res.eigenvectors.cpu().double()
    return U @ torch.diag(res.eigenvalues.cpu().double()) @ U.T


def snapshot(model):
    """Parameters, buffers, mode and ``requires_grad`` of a model, on the CPU."""
    return ({k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            [m.training for m in model.modules()],
            [p.requires_grad for p in model.parameters()])


def assert_unchanged(model, before):
    state, modes, grads = snapshot(model)
    assert modes == before[1] and grads == before[2]
    for key, value in before[0].items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    assert not any(m._forward_hooks or m._backward_hooks or m._forward_pre_hooks
                   for m in model.modules())


ENGINE_CASES = ["class_cnn", "resnet_block", "transformer", "lstm", "tied_params",
                "layernorm_gelu", "frozen"]


@pytest.mark.parametrize("name", ENGINE_CASES)
def test_cuda_engine_equals_cpu(name):
    model, loss_func, X, y = zoo_case(name, n=6)
    cpu = ll.ggn_eigh(model, loss_func, X, y, top_k=None)
    dd_cpu = ll.directional_derivatives(model, loss_func, X, y, top_k=3)
    step_cpu = ll.damped_newton_step(model, loss_func, X, y, damping=0.5)

    gm, Xg, yg = on_device(model, X, y)
    before = snapshot(gm)
    res = ll.ggn_eigh(gm, loss_func, Xg, yg, top_k=None)
    assert res.backend == cpu.backend
    assert res.eigenvalues.device.type == res.eigenvectors.device.type == DEVICE
    torch.testing.assert_close(res.eigenvalues.cpu(), cpu.eigenvalues, **TOL)
    torch.testing.assert_close(res.trace.cpu(), cpu.trace, **TOL)
    G_cpu = low_rank_matrix(cpu)
    torch.testing.assert_close(low_rank_matrix(res), G_cpu, rtol=1e-6,
                               atol=1e-9 * G_cpu.abs().max())
    low = ll.ggn_eigh(gm, loss_func, Xg, yg, top_k=3, low_memory=True)
    torch.testing.assert_close(low.eigenvalues.cpu(), cpu.eigenvalues[:3], **TOL)

    dd = ll.directional_derivatives(gm, loss_func, Xg, yg, top_k=3)
    torch.testing.assert_close(dd.lambdas.cpu(), dd_cpu.lambdas, **TOL)
    torch.testing.assert_close(dd.gammas.abs().cpu(), dd_cpu.gammas.abs(), **TOL)
    step = ll.damped_newton_step(gm, loss_func, Xg, yg, damping=0.5)
    assert step.device.type == DEVICE
    torch.testing.assert_close(step.cpu(), step_cpu, rtol=1e-6, atol=1e-9)
    x = torch.randn(step.numel(), dtype=torch.float64)
    inv_cpu = ll.ggn_inverse_matvec(model, loss_func, X, y, x, 0.5)
    inv = ll.ggn_inverse_matvec(gm, loss_func, Xg, yg, x.to(DEVICE), 0.5)
    torch.testing.assert_close(inv.cpu(), inv_cpu, rtol=1e-6, atol=1e-9)
    assert_unchanged(gm, before)


@pytest.mark.parametrize("name, backend", [("class_cnn", "backpack"),
                                           ("layernorm_gelu", "hooks"),
                                           ("layernorm_gelu", "functorch")])
def test_cuda_low_memory_replays_monte_carlo_draws(name, backend):
    """The second pass replays the device generator's draws (every backend)."""
    model, loss_func, X, y = zoo_case(name, n=6)
    gm, Xg, yg = on_device(model, X, y)
    (one, one_step), (two, two_step) = one_pass_and_low_memory(gm, loss_func, Xg, yg, 2,
                                                               backend=backend)
    torch.testing.assert_close(two.eigenvalues, one.eigenvalues, **TOL)
    torch.testing.assert_close(two_step, one_step, rtol=1e-6, atol=1e-9)
    assert one.backend == two.backend == backend


@pytest.mark.parametrize("name", ["class_cnn", "transformer"])
def test_cuda_float32_close_to_float64(name):
    """float32 on the device (convolutions may run in TF32) near the float64 result."""
    model, loss_func, X, y = zoo_case(name, n=6)
    ref = ll.ggn_eigh(model, loss_func, X, y, top_k=3)
    Xf = X.float() if X.is_floating_point() else X
    gm, Xg, yg = on_device(model.float(), Xf, y)
    res = ll.ggn_eigh(gm, loss_func, Xg, yg, top_k=3)
    assert res.eigenvalues.dtype == torch.float32
    torch.testing.assert_close(res.eigenvalues.cpu().double(), ref.eigenvalues,
                               rtol=5e-3, atol=1e-6 * ref.eigenvalues[0])


def fit_pair(model, X, y, path, monkeypatch, **kwargs):
    """The same ``Laplace`` fit on the CPU and on the device, on the given path."""
    fits = []
    for device in ("cpu", DEVICE):
        m, Xd, yd = on_device(model, X, y) if device == DEVICE else (model, X, y)
        set_tuning(monkeypatch, dense_max_dim=2048 if path == "dense" else 0)
        la = Laplace(m, "classification", **KW, **kwargs)
        la.fit(DataLoader(TensorDataset(Xd, yd), batch_size=8))
        assert la.fit_path == path
        fits.append(la)
    return fits


@pytest.mark.parametrize("path", ["dense", "streaming"])
@pytest.mark.parametrize("name", ["class_cnn", "transformer"])
def test_cuda_laplace_equals_cpu(name, path, monkeypatch):
    model, _, X, y = zoo_case(name, n=24)
    cpu, gpu = fit_pair(model, X, y, path, monkeypatch, rank=20)
    assert gpu.factor_backend_used == cpu.factor_backend_used
    assert gpu.H[0].device.type == DEVICE
    torch.testing.assert_close(gpu.H[1].cpu(), cpu.H[1], **TOL)
    assert gpu.fit_report.quadrature_steps == cpu.fit_report.quadrature_steps
    torch.testing.assert_close(gpu.dropped_quadrature.q.cpu(), cpu.dropped_quadrature.q,
                               rtol=1e-5, atol=1e-9 * float(cpu.dropped_quadrature.q.max()))
    for la in (cpu, gpu):
        la.prior_precision = 0.7
    torch.testing.assert_close(gpu.log_det_posterior_precision.cpu(),
                               cpu.log_det_posterior_precision, **TOL)
    torch.testing.assert_close(gpu.log_marginal_likelihood().cpu(),
                               cpu.log_marginal_likelihood(), **TOL)
    probs = gpu(X[:5].to(DEVICE), pred_type="glm", link_approx="probit")
    assert probs.device.type == DEVICE
    torch.testing.assert_close(probs.cpu(), cpu(X[:5], pred_type="glm", link_approx="probit"),
                               **TOL)
    samples = gpu(X[:5].to(DEVICE), pred_type="nn", link_approx="mc", n_samples=7)
    assert samples.device.type == DEVICE and torch.isfinite(samples).all()
    for la in (cpu, gpu):
        la.optimize_prior_precision(method="marglik", n_steps=30)
    torch.testing.assert_close(gpu.prior_precision.cpu(), cpu.prior_precision, rtol=1e-5,
                               atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_sketch_equals_cpu_with_the_same_test_matrix(dtype):
    """The truncated Nyström sketch on the device (Cholesky, triangular solve and
    eigendecomposition there) against the CPU's with the CPU's test matrix."""
    from lowrank_laplace.engine import FactorEngine
    from lowrank_laplace.fitting.sketch import SketchMerge

    model, loss_func, X, y = zoo_case("class_cnn", n=24)
    model, X = model.to(dtype), X.to(dtype)
    results, omega = [], None
    for device in ("cpu", DEVICE):
        m, Xd, yd = on_device(model, X, y) if device == DEVICE else (model, X, y)
        merge = SketchMerge(5, 4, track_diagonal=True, seed=0)
        with FactorEngine(m, loss_func) as engine:
            for Xb, yb in zip(Xd.split(8), yd.split(8)):
                factor = engine.compute(Xb, yb)
                if merge._omega is None:
                    if omega is None:  # the CPU's draw, used on both devices
                        omega = merge._test_matrix(factor.group_dim(),
                                                   torch.zeros(1, dtype=dtype),
                                                   factor.shapes)
                    merge._omega = omega.to(device=device)
                merge.add_factor(factor)
        results.append([t.cpu().double() for t in merge.result()])
    (U1, l1, t1, r1), (U2, l2, t2, r2) = results
    tol = dict(rtol=1e-6, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-3, atol=0)
    torch.testing.assert_close(l2, l1, **tol)
    torch.testing.assert_close(t2, t1, **tol)
    torch.testing.assert_close(U2 @ torch.diag(l2) @ U2.T, U1 @ torch.diag(l1) @ U1.T,
                               rtol=0, atol=tol["rtol"] * l1[0])
    torch.testing.assert_close(r2, r1, rtol=0, atol=tol["rtol"] * l1[0])


def test_cuda_sketch_laplace_at_full_rank_equals_cpu_streaming(monkeypatch):
    model, _, X, y = zoo_case("class_cnn", n=12)
    set_tuning(monkeypatch, dense_max_dim=0)
    cpu = Laplace(model, "classification", **KW, rank=1000)
    cpu.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    m, Xd, yd = on_device(model, X, y)
    # passes of 4: one streaming merge must not cover the data, or the sketch streams
    gpu = Laplace(m, "classification", **KW, rank=1000, solver="sketch", micro_batch_size=4)
    gpu.fit(DataLoader(TensorDataset(Xd, yd), batch_size=8))
    assert gpu.fit_path == "sketch" and gpu.H[0].device.type == DEVICE
    U, lam = gpu.H
    H = (U @ torch.diag(lam) @ U.T).cpu()
    Uc, lc = cpu.H
    ref = Uc @ torch.diag(lc) @ Uc.T
    torch.testing.assert_close(H, ref, rtol=0, atol=1e-8 * ref.abs().max())
    torch.testing.assert_close(gpu.log_marginal_likelihood().cpu(),
                               cpu.log_marginal_likelihood(), **TOL)


def test_cuda_dict_batches_equal_cpu(monkeypatch):
    torch.manual_seed(0)
    model = DictModel().double()
    _, _, X, y = zoo_case("transformer", n=12)
    fits = []
    for device in ("cpu", DEVICE):
        m = copy.deepcopy(model).to(device)
        records = [{"input_ids": x, "labels": t} for x, t in zip(X.to(device), y.to(device))]
        la = Laplace(m, "classification", dict_key_x="input_ids", dict_key_y="labels",
                     rank=1000, **KW)
        la.fit(DataLoader(records, batch_size=4))
        la.prior_precision = 0.7
        fits.append(la)
    cpu, gpu = fits
    torch.testing.assert_close(gpu.log_marginal_likelihood().cpu(),
                               cpu.log_marginal_likelihood(), **TOL)
    batch = {"input_ids": X.to(DEVICE), "labels": y.to(DEVICE)}
    torch.testing.assert_close(gpu(batch, pred_type="glm", link_approx="probit").cpu(),
                               cpu({"input_ids": X, "labels": y}, pred_type="glm",
                                   link_approx="probit"), **TOL)


def test_cuda_command_line(tmp_path, capsys):
    from lowrank_laplace.toolkit.cli import main

    spectrum = ["spectrum", "--epochs", "0", "--batch-size", "24", "--top-k", "3",
                "--model", "mlp", "--device", "cuda", "--out", str(tmp_path / "spectrum")]
    assert main(spectrum) == 0
    calibrate = ["calibrate", "--dataset", "digits", "--epochs", "1", "--n-train", "300",
                 "--n-test", "80", "--rank", "20", "--angles", "0,45", "--device", "cuda",
                 "--out", str(tmp_path / "calibrate")]
    assert main(calibrate) == 0
    assert "lowrank" in capsys.readouterr().out


def test_cuda_default_budget_is_a_quarter_of_free_memory():
    from lowrank_laplace.fitting.budget import DEFAULT_MEMORY_BUDGET, resolve_memory_budget

    device = torch.device(DEVICE)
    free = torch.cuda.mem_get_info(device)[0]
    budget = resolve_memory_budget(None, device)
    assert budget >= DEFAULT_MEMORY_BUDGET
    assert abs(budget - max(DEFAULT_MEMORY_BUDGET, free // 4)) <= 2**26
    assert resolve_memory_budget(None, torch.device("cpu")) == DEFAULT_MEMORY_BUDGET


def test_auto_sketches_on_the_device_where_the_cpu_cost_model_streams():
    """``solver="auto"`` on a CUDA device takes the sketch wherever its float64 matrix
    fits the budget's share: the CPU's cost model streams this conv net (D = 82,826,
    512 samples, rank 100), whose sketch products are cheap on a GPU."""
    from torch import nn

    from lowrank_laplace.engine import FactorEngine
    from lowrank_laplace.fitting.config import FitConfig
    from lowrank_laplace.fitting.plan import choose_plan, measure_sizes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32 * 16 * 16, 10))
    X = torch.randn(512, 3, 16, 16)
    paths = {}
    for device in ("cpu", DEVICE):
        engine = FactorEngine(copy.deepcopy(model).to(device),
                              nn.CrossEntropyLoss(reduction="sum"), eval_mode=True)
        Xd = X.to(device)
        with engine:
            engine.compute(Xd[:1], torch.zeros(1, dtype=torch.long, device=device))
            config = FitConfig(rank=100)
            plan = choose_plan(measure_sizes(engine, Xd, 64, 512, config), config)
        paths[device] = (plan.path, plan.keep)
    assert paths == {"cpu": ("streaming", 120), DEVICE: ("sketch", 400)}
