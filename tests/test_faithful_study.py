"""The faithfulness study: its exact reference against laplace-torch's ``FullLaplace``,
its command line, and its tiny end-to-end run."""

import json
import os

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import _exact, bench_faithful


def _problem(seed=0, n=30):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    X = torch.randn(n, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (n,))
    return model, X, y


def _full_laplace(model, X, y):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="full")
        la.fit(DataLoader(TensorDataset(X, y), batch_size=8))
    finally:
        torch.set_default_dtype(old)
    return la


@pytest.mark.parametrize("space", ["parameters", "gram"])
def test_exact_ggn_is_laplace_torch_full_ggn(space):
    """Eigenvalues, top eigenpairs, functional variance and probit predictive of the
    dense reference equal ``FullLaplace``'s (exact GGN) in float64, in either space."""
    model, X, y = _problem(n=30 if space == "parameters" else 8)
    la = _full_laplace(model, X, y)
    ggn = _exact.build_ggn(model, X, "classification", space=space, chunk=7)
    assert ggn.space == space
    H = la.H.double()
    dense = torch.linalg.eigvalsh(H).flip(0)
    k = min(len(dense), len(ggn.eigenvalues))
    torch.testing.assert_close(ggn.eigenvalues[:k], dense[:k].clamp(min=0), atol=1e-10,
                               rtol=1e-9)
    assert ggn.trace == pytest.approx(float(H.trace()), rel=1e-12)
    lam, U = ggn.top_pairs(5)
    torch.testing.assert_close(H @ U, U * lam, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(U.T @ U, torch.eye(5, dtype=U.dtype), atol=1e-10, rtol=0)
    delta = 0.7
    la.prior_precision = delta
    J, f = _exact.jacobians(model, _exact.trainable_names(model), X[:5])
    torch.testing.assert_close(ggn.variance(J, delta), la.functional_variance(J),
                               atol=1e-10, rtol=1e-9)
    probs = la(X[:5], pred_type="glm", link_approx="probit")
    torch.testing.assert_close(_exact.probit(f, ggn.variance(J, delta)), probs)


def test_marglik_prior_is_laplace_torch_stationary_point():
    """At the closed-form prior the gradient of laplace-torch's log marginal
    likelihood in ``log delta`` vanishes; at twice and half of it, it does not."""
    model, X, y = _problem()
    la = _full_laplace(model, X, y)
    ggn = _exact.build_ggn(model, X, "classification")
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    delta = _exact.marglik_prior(ggn.eigenvalues, float((theta**2).sum()))

    def slope(value):
        log_delta = torch.tensor(float(value), dtype=torch.float64).log().requires_grad_()
        la.log_marginal_likelihood(prior_precision=log_delta.exp()).backward()
        return float(log_delta.grad)

    assert abs(slope(delta)) < 1e-8
    assert slope(delta / 2) > 1e-3 and slope(2 * delta) < -1e-3


def test_exact_predictive_splits_at_the_exact_top_pairs():
    """Kept plus complement variance is the exact variance; without a complement
    (full rank) the complement holds only the prior's share of the null space."""
    model, X, y = _problem()
    ggn = _exact.build_ggn(model, X, "classification")
    out = _exact.exact_predictive(ggn, model, X[:6], 1.3, [2, 5], chunk=4)
    assert out["f_var"].shape == (6, 3, 3) and out["f_mu"].shape == (6, 3)
    for r in (2, 5):
        split = out["split"][r]
        total = out["f_var"].diagonal(dim1=1, dim2=2).sum(-1)
        assert (split["trace"] > 0).all() and (split["trace"] < total).all()
        assert (split["energy"] > 0).all()
    assert (out["split"][5]["trace"] < out["split"][2]["trace"]).all()


def test_build_ggn_refuses_an_unknown_space():
    model, X, _ = _problem()
    with pytest.raises(ValueError, match="space must be one of"):
        _exact.build_ggn(model, X, "classification", space="dense")


@pytest.mark.parametrize("argv, message", [
    (["--problems", "imagenet"], "--problems: unknown or empty"),
    (["--methods", "full"], "--methods: unknown or empty"),
    (["--ranks", "ten"], "--ranks must be comma-separated integers"),
    (["--ranks", "0"], "--ranks must be positive integers"),
])
def test_command_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_faithful.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LOWRANK_LAPLACE_HEAVY"),
                    reason="the study's end-to-end run: set LOWRANK_LAPLACE_HEAVY=1")
def test_tiny_run_writes_json_png_and_tables(tmp_path, capsys):
    """``--tiny`` runs the whole study on a shrunken problem in seconds: reference,
    every default method, the JSON (with machine and commit), the PNG and the table;
    a second run loads the stored reference, gives the same exact posterior and, with
    ``--update``, keeps the first run's other problems in the JSON."""
    threads = torch.get_num_threads()
    argv = ["--tiny", "--problems", "mnist_mlp", "--ranks", "100,30", "--out",
            str(tmp_path), "--references", str(tmp_path / "refs"), "--marglik-steps", "50"]
    first = bench_faithful.main(argv)
    saved = json.loads((tmp_path / "faithful.json").read_text())
    assert (tmp_path / "faithful.png").stat().st_size > 0
    assert saved["machine"]["date"] and saved["commit"]
    rec = saved["problems"]["mnist_mlp"]
    assert set(rec["methods"]) == {"default r=8", "streaming r=8", "kron", "diag",
                                   "last_layer"}
    assert all("sets" in row for row in rec["methods"].values())
    default = rec["methods"]["default r=8"]
    assert 0 < default["kept_vs_exact_top"] <= 1 + 1e-9
    assert set(default["sets"]) == {"test", "rot45"}
    assert default["sets"]["test"]["probit_check"] < 1e-6
    assert "| exact full GGN |" in capsys.readouterr().out
    saved["problems"]["other"] = rec
    (tmp_path / "faithful.json").write_text(json.dumps(saved))
    assert (tmp_path / "refs" / "mnist_mlp.pt").exists()
    second = bench_faithful.main([*argv, "--update", "--threads", "1"])  # loads it
    assert (second["problems"]["mnist_mlp"]["exact_prior"]
            == first["problems"]["mnist_mlp"]["exact_prior"])
    kept = json.loads((tmp_path / "faithful.json").read_text())["problems"]
    assert set(kept) == {"mnist_mlp", "other"}
    assert kept["mnist_mlp"]["run"]["commit"] == saved["commit"]
    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == threads
    refs = tmp_path / "only"
    bench_faithful.main([*argv[:-4], "--references", str(refs), "--references-only",
                         "--out", str(tmp_path / "none")])
    assert (refs / "mnist_mlp.pt").exists() and not (tmp_path / "none" / "faithful.json").exists()


def test_augmented_training_set_keeps_the_images_first_and_repeats_the_labels():
    """An augmented problem's training set: the images themselves, then warped copies
    (reproducible, none equal to its image), labels repeated; the test sets unchanged."""
    from dataclasses import replace

    from benchmarks._faithful_problems import Problem, make_data

    plain = Problem("digits", "mlp", {"hidden": [4]}, n_train=20, n_test=10, rotations=(30,))
    augmented = replace(plain, augment=3)
    base, data = make_data(plain), make_data(augmented)
    X, y = data.train
    assert X.shape == (60, 64) and torch.equal(y, base.train[1].repeat(3))
    torch.testing.assert_close(X[:20], base.train[0])
    assert all((X[20 * k:20 * (k + 1)] - X[:20]).abs().amax(1).min() > 0 for k in (1, 2))
    torch.testing.assert_close(make_data(augmented).train[0], X)
    for name, (Xt, yt) in base.tests.items():
        torch.testing.assert_close(data.tests[name][0], Xt)
        assert torch.equal(data.tests[name][1], yt)
