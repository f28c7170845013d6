"""LowRankOptions: every option validated once, with one clear error each."""

import dataclasses

import pytest

from lowrank_laplace.fitting.config import FitConfig, SolverKind
from lowrank_laplace.laplace_torch.options import OPTION_NAMES, LowRankOptions
from lowrank_laplace.posterior import probe
from lowrank_laplace.posterior.residual import DiagonalResidual, SpectralResidual


def test_defaults_and_normalisation():
    opts = LowRankOptions(rank=50)
    assert opts.mc_samples == 0 and opts.residual == "spectral"
    assert opts.residual_model is SpectralResidual
    assert opts.solver is SolverKind.AUTO and str(opts.solver) == "auto"
    assert opts.track_diagonal and LowRankOptions(residual="diagonal").track_diagonal
    assert LowRankOptions(residual="diagonal").residual_model is DiagonalResidual
    assert not LowRankOptions(residual="isotropic").track_diagonal
    assert opts.probe_inputs == probe.PROBE_SIZE
    assert LowRankOptions(residual="none").probe_inputs == 0
    assert LowRankOptions(solver="sketch").solver is SolverKind.SKETCH
    assert LowRankOptions(solver="streaming").solver is SolverKind.STREAMING
    assert isinstance(opts, FitConfig)  # the same object goes down the fit


def test_about_ten_options_a_user_decides():
    """Tuning constants are module constants, not options; what the fit derives from
    the residual model (diagonal, probe inputs) is not an option either."""
    assert OPTION_NAMES == ("rank", "mc_samples", "subsample_fraction", "memory_budget",
                            "micro_batch_size", "seed", "low_memory", "factor_backend",
                            "solver", "residual", "warm_start")
    with pytest.raises(TypeError):
        LowRankOptions(track_diagonal=True)


def test_memory_budget_forms_accepted():
    for budget in (2**20, 2e9, 0.5, "512MB", None):
        assert LowRankOptions(memory_budget=budget).memory_budget == budget
    assert LowRankOptions(seed=2**40).seed == 2**40
    assert LowRankOptions(seed=2**63 - 1, rank=4.0).seed == 2**63 - 1


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        LowRankOptions().rank = 3


@pytest.mark.parametrize("kwargs, msg", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(rank=2.5), "rank must be a positive integer"),
    (dict(rank=True), "rank must be a positive integer"),
    (dict(mc_samples=1.5), "mc_samples must be 0"),
    (dict(subsample_fraction=0.0), "subsample_fraction must lie in"),
    (dict(micro_batch_size=0), "micro_batch_size must be a positive integer"),
    (dict(residual="bogus"), "residual must be one of 'spectral', 'isotropic'"),
    (dict(solver="lanczos"), "solver must be one of 'auto', 'streaming', 'sketch'"),
    (dict(factor_backend="jax"), "backend must be one of"),
    (dict(seed="a"), "seed must be an integer"),
    (dict(seed=1.0), "seed must be an integer"),
    (dict(seed=2**64 - 1), r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"),
    (dict(seed=-2**63 - 1), "seed must be an integer in"),
    (dict(rank=float("inf")), "rank must be a positive integer, got inf"),
    (dict(rank=float("nan")), "rank must be a positive integer, got nan"),
    (dict(micro_batch_size=float("inf")), "micro_batch_size must be a positive integer"),
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

    la = LowRankGGNLaplace(*mlp_laplace_args, rank=7, solver="sketch", residual="none")
    assert (la.rank, la.solver, la.residual, la.warm_start) == (7, "sketch", "none", True)
    assert la.options == LowRankOptions(rank=7, solver="sketch", residual="none")
    with pytest.raises(AttributeError):
        la.rank = 8  # read-only: the options are validated once
    with pytest.raises(TypeError):
        LowRankGGNLaplace(*mlp_laplace_args, not_an_option=1)
    with pytest.raises(TypeError):
        LowRankGGNLaplace(*mlp_laplace_args, dense_max_dim=0)  # a module constant now


@pytest.fixture
def mlp_laplace_args():
    from torch import nn

    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "classification"
