"""LowRankOptions: every option validated once, with one clear error each."""

import dataclasses

import pytest

from lowrank_laplace.laplace_torch.options import LowRankOptions, SketchTestMatrix, SolverKind
from lowrank_laplace.posterior import ResidualKind


def test_defaults_and_normalisation():
    opts = LowRankOptions(rank=50)
    assert opts.oversampling == 10 and opts.mc_samples == 0 and opts.dense_max_dim == 2048
    assert opts.residual is ResidualKind.SPECTRAL and opts.residual == "spectral"
    assert opts.solver is SolverKind.AUTO
    assert opts.sketch_test_matrix is SketchTestMatrix.KRONECKER
    assert repr(opts.residual) == "'spectral'" and str(opts.solver) == "auto"
    assert opts.track_diagonal and LowRankOptions(residual="diagonal").track_diagonal
    assert not LowRankOptions(residual="isotropic").track_diagonal
    assert LowRankOptions(oversampling=0, solver="sketch").solver is SolverKind.SKETCH
    assert LowRankOptions(solver="streaming").solver is SolverKind.STREAMING


def test_memory_budget_forms_accepted():
    for budget in (2**20, 2e9, 0.5, "512MB", None):
        assert LowRankOptions(memory_budget=budget).memory_budget == budget
    assert LowRankOptions(seed=2**40).seed == 2**40


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LowRankOptions().rank = 3


@pytest.mark.parametrize("kwargs, msg", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(rank=2.5), "rank must be a positive integer"),
    (dict(rank=True), "rank must be a positive integer"),
    (dict(oversampling=-1), "oversampling must be a non-negative integer"),
    (dict(mc_samples=1.5), "mc_samples must be 0"),
    (dict(subsample_fraction=0.0), "subsample_fraction must lie in"),
    (dict(micro_batch_size=0), "micro_batch_size must be a positive integer"),
    (dict(residual="bogus"), "residual must be one of 'spectral', 'isotropic'"),
    (dict(solver="lanczos"), "solver must be one of 'auto', 'streaming', 'sketch'"),
    (dict(sketch_test_matrix="rademacher"), "sketch_test_matrix must be one of"),
    (dict(factor_backend="jax"), "backend must be one of"),
    (dict(dense_max_dim=-1), "dense_max_dim must be a non-negative integer"),
    (dict(probe_size=-1), "probe_size must be a non-negative integer"),
    (dict(probe_columns=0), "probe_columns must be a positive integer"),
    (dict(seed="a"), "seed must be an integer"),
    (dict(seed=1.0), "seed must be an integer"),
    (dict(memory_budget=float("nan")), "memory_budget=nan is not a size"),
    (dict(memory_budget=float("inf")), "memory_budget=inf is not a size"),
    (dict(memory_budget=1.5), "memory_budget=1.5 is not a size"),
    (dict(memory_budget=0), "memory_budget must be positive"),
    (dict(memory_budget="lots"), "is not a size"),
])
def test_each_bad_option_has_its_error(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        LowRankOptions(**kwargs)


def test_laplace_reads_its_options(mlp_laplace_args):
    from lowrank_laplace import LowRankGGNLaplace

    la = LowRankGGNLaplace(*mlp_laplace_args, rank=7, solver="sketch", probe_columns=None)
    assert (la.rank, la.oversampling, la.solver, la.probe_columns) == (7, 1, "sketch", None)
    assert la.options == LowRankOptions(rank=7, solver="sketch", probe_columns=None)
    with pytest.raises(TypeError):
        LowRankGGNLaplace(*mlp_laplace_args, not_an_option=1)


@pytest.fixture
def mlp_laplace_args():
    from torch import nn

    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "classification"
