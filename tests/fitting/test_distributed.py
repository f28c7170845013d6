"""Data-parallel fit: 2 CPU processes with gloo equal a single-process fit."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lowrank_laplace import LowRankGGNLaplace
from tests.conftest import set_tuning


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 3)).double()
    X = torch.randn(30, 1, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (30,))
    return model, X, y


def _worker(rank, world, port, out, configs):
    """Every configuration's fit on this process's shard, under one process group."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for name, (rank_kw, tuning, online) in configs.items():
            with pytest.MonkeyPatch.context() as patch:  # a spawned process's own constants
                set_tuning(patch, **tuning)
                _fit_shard(rank, world, rank_kw, online, f"{out}.{name}.{rank}")
    finally:
        dist.destroy_process_group()


def _fit_shard(rank, world, rank_kw, online, path):
    model, X, y = _problem()
    Xs, ys = X[rank::world], y[rank::world]
    la = LowRankGGNLaplace(model, "classification", **rank_kw)
    if online:  # two updates: fit(first 6 of the shard), fit(the rest, override=False)
        la.fit(DataLoader(TensorDataset(Xs[:6], ys[:6]), batch_size=4))
        la.fit(DataLoader(TensorDataset(Xs[6:], ys[6:]), batch_size=4), override=False)
    else:
        la.fit(DataLoader(TensorDataset(Xs, ys), batch_size=4))
    U, lam = la.H
    torch.save({"H": U @ torch.diag(lam) @ U.T, "lam": lam, "n_data": la.n_data,
                "marglik": la.log_marginal_likelihood().detach(), "trace": la.trace,
                "residual": la.residual_diagonal, "fit_path": la.fit_path}, path)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``(dense_max_dim, online, solver)`` of each configuration, by test id.
CONFIGS = {
    "streaming": (0, False, None), "dense": (2048, False, None),
    "streaming-online": (0, True, None), "sketch-truncated": (0, False, "sketch"),
    "sketch-online": (0, True, "sketch"), "sketch-one-merge": (0, False, "sketch-one-merge"),
}


def _options(dense_max_dim, online, solver):
    """``(Laplace keyword arguments, tuning constants)`` of a configuration."""
    kw = dict(rank=1000, residual="diagonal")
    tuning = dict(dense_max_dim=dense_max_dim)
    if solver == "sketch":
        # passes of 2 samples: one streaming merge must not cover a process's data
        kw = dict(rank=1000 if online else 5, residual="diagonal", solver="sketch",
                  micro_batch_size=2)
        tuning["oversampling"] = 3 / kw["rank"]
    if solver == "sketch-one-merge":  # every process streams its one exact merge
        kw = dict(rank=1000, residual="diagonal", solver="sketch")
    return kw, tuning


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The results of every configuration's data-parallel fit (two processes spawned once)."""
    out = str(tmp_path_factory.mktemp("distributed") / "result")
    configs = {name: (*_options(*c), c[1]) for name, c in CONFIGS.items()}
    mp.spawn(_worker, args=(2, _free_port(), out, configs), nprocs=2, join=True)
    return out


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.slow
def test_two_processes_equal_single_process(two_processes, monkeypatch, name):
    """Exact fits; and truncated sketches, which add up to the single-process sketch."""
    dense_max_dim, online, solver = CONFIGS[name]
    kw, tuning = _options(dense_max_dim, online, solver)
    set_tuning(monkeypatch, **tuning)
    model, X, y = _problem()
    single = LowRankGGNLaplace(model, "classification", **kw)
    single.fit(DataLoader(TensorDataset(X, y), batch_size=4), process_group=None)
    U, lam = single.H
    H = U @ torch.diag(lam) @ U.T
    results = [torch.load(f"{two_processes}.{name}.{r}") for r in range(2)]
    for res in results:  # every rank ends with the same posterior
        assert res["n_data"] == 30
        assert res["fit_path"] == single.fit_path == \
            {None: "dense" if dense_max_dim else "streaming", "sketch": "sketch",
             "sketch-one-merge": "streaming"}[solver]
        torch.testing.assert_close(res["H"], H, rtol=1e-6, atol=1e-10 * H.abs().max())
        torch.testing.assert_close(res["marglik"], single.log_marginal_likelihood().detach())
        torch.testing.assert_close(res["trace"], single.trace)
        torch.testing.assert_close(res["residual"], single.residual_diagonal, rtol=0,
                                   atol=1e-9 * H.abs().max())
    torch.testing.assert_close(results[0]["lam"], results[1]["lam"], rtol=0, atol=0)


def _refine_worker(rank, world, port, path):
    """Fit and refine on this process's shard (ten Lanczos steps), save what was found."""
    from lowrank_laplace.posterior import quadrature

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        quadrature.MIN_STEPS = quadrature.MAX_STEPS = 10
        model, X, y = _problem()
        la = LowRankGGNLaplace(model, "classification", rank=5)
        loader = DataLoader(TensorDataset(X[rank::world], y[rank::world]), batch_size=4)
        la.fit(loader)
        own = _refined(la)
        la.refine_complement(loader)
        torch.save({**_refined(la), "own": own}, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def _refined(la):
    found, one = la._quadrature, torch.tensor(1.0, dtype=torch.float64)
    return {"nodes": found.nodes, "counts": found.counts, "steps": found.steps,
            "samples": found.samples, "v": found.variance(one, one, 1e300)}


@pytest.mark.slow
def test_refine_complement_sums_the_products_over_processes(tmp_path, monkeypatch):
    """The Gaussian runs see the whole data's GGN: the single process's nodes and counts,
    on the fit's kept factors as on passes over the loader."""
    from lowrank_laplace.posterior import quadrature

    path = str(tmp_path / "refined")
    mp.spawn(_refine_worker, args=(2, _free_port(), path), nprocs=2, join=True)
    monkeypatch.setattr(quadrature, "MIN_STEPS", 10)
    monkeypatch.setattr(quadrature, "MAX_STEPS", 10)
    model, X, y = _problem()
    single = LowRankGGNLaplace(model, "classification", rank=5)
    loader = DataLoader(TensorDataset(X, y), batch_size=4)
    single.fit(loader, process_group=None)
    own = _refined(single)
    single.refine_complement(loader)  # one process: torch.distributed is not initialised here
    expected = _refined(single)
    results = [torch.load(f"{path}.{r}") for r in range(2)]
    for res in results:
        assert res["steps"] == expected["steps"] == 10
        torch.testing.assert_close(res["nodes"], expected["nodes"], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(res["counts"], expected["counts"], rtol=1e-6, atol=1e-8)
        # the Jacobian starts are other random combinations of the same 30 inputs
        assert float(res["v"]) == pytest.approx(float(expected["v"]), rel=0.3)
        # the fit's own measurement: the kept factors of both shards, summed; each process
        # holds out a quarter of its own first inputs
        assert res["own"]["samples"] == (6, 30, 30) and own["samples"] == (7, 30, 30)
        torch.testing.assert_close(res["own"]["nodes"], own["nodes"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(results[0]["v"], results[1]["v"], rtol=0, atol=0)
