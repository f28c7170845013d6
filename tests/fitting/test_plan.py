"""The fit's plan: decided once, frozen, and the solver it names."""

import dataclasses

import pytest
import torch
from torch import nn

from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.fitting.config import FitConfig
from lowrank_laplace.fitting.dense import DenseSum
from lowrank_laplace.fitting.plan import FitSizes, choose_plan, make_solver, measure_sizes
from lowrank_laplace.fitting.sketch import SketchMerge
from lowrank_laplace.fitting.streaming import StreamingMerge

TOL = dict(rtol=1e-10, atol=1e-12)


def _engine_and_batch(n=32, width=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 4)).double()
    X = torch.randn(n, 5, dtype=torch.float64)
    return FactorEngine(model, nn.CrossEntropyLoss(reduction="sum"), eval_mode=True), X


def _plan(engine, X, num_data=None, wide_sketch=False, **options):
    """The plan of a fit of ``num_data`` samples in batches like ``X`` (default: four)."""
    options = {"rank": 10, "solver": "streaming", **options}
    config = FitConfig(**options)
    engine.compute(X[:1], torch.zeros(1, dtype=torch.long))  # outputs known, as at a fit
    sizes = measure_sizes(engine, X, len(X), num_data or 4 * len(X), config)
    plan = choose_plan(sizes, config)
    return plan.widened() if wide_sketch and plan.widen else plan


def _solver(plan, rank=10):
    return make_solver(plan, FitConfig(rank=rank), [torch.zeros(3)])


@pytest.fixture(autouse=True)
def streaming(tune):
    """Below ``DENSE_MAX_DIM`` parameters the plan sums densely: tests set it."""
    tune(dense_max_dim=0)


def test_the_plan_is_a_pure_function_of_sizes_and_options(tune):
    """No engine, no machine: the same sizes and options give the same plan."""
    sizes = FitSizes(dim=64, gram_dim=10, columns=3, vector_bytes=8 * 70, block_bytes=8 * 40,
                     itemsize=8, batch_size=32, num_data=1000, budget=2**20)
    config = FitConfig(rank=10, solver="streaming")
    first = choose_plan(sizes, config)
    assert first == choose_plan(sizes, config) and first.path == "streaming"
    assert first.threads == 1 and first.keep == 12  # small merges run on one thread
    auto = choose_plan(sizes, FitConfig(rank=10))
    assert (auto.path, auto.keep) == ("sketch", 40)
    tune(dense_max_dim=2048)
    assert choose_plan(sizes, config).path == "dense"
    low = choose_plan(sizes, FitConfig(rank=10, solver="streaming", low_memory=True))
    assert low.path == "dense" and not low.low_memory  # the dense sum drops low_memory
    with pytest.raises(ValueError, match="too small for one sample"):
        choose_plan(dataclasses.replace(sizes, budget=100), config)


def test_the_plan_is_frozen_and_names_its_solver(tune):
    engine, X = _engine_and_batch()
    with engine:
        plan = _plan(engine, X)
        sketch = _plan(engine, X, solver="sketch", micro_batch_size=2)
        tune(dense_max_dim=2048)
        dense = _plan(engine, X)
    assert plan.path == "streaming" and dense.path == "dense" and sketch.path == "sketch"
    assert plan.dim == 5 * 6 + 6 + 6 * 4 + 4 and plan.micro >= 1 and plan.chunk >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.path = "dense"
    assert isinstance(_solver(plan), StreamingMerge)
    assert isinstance(_solver(dense), DenseSum)
    assert isinstance(_solver(sketch), SketchMerge)
    # few parameters per kept eigenpair: explicit rotations, not lazy updates
    assert not plan.lazy and _solver(plan).lazy is False


def test_a_sketch_that_one_streaming_merge_covers_streams():
    engine, X = _engine_and_batch()
    with engine:
        plan = _plan(engine, X, solver="sketch", num_data=len(X))
    assert plan.path == "streaming"


def test_dense_plans_drop_low_memory(tune):
    tune(dense_max_dim=2048)
    engine, X = _engine_and_batch()
    with engine:
        plan = _plan(engine, X, low_memory=True)
    assert plan.path == "dense" and not plan.low_memory


def test_dense_sum_adds_lowrank_curvature_exactly():
    torch.manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(9, 4, dtype=torch.float64))
    lam = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    V = torch.randn(9, 3, dtype=torch.float64)
    solver = DenseSum(rank=9, track_diagonal=True)
    solver.add_lowrank(Q, lam, lam.sum())
    solver.add_lowrank(V, torch.ones(3, dtype=torch.float64), (V**2).sum())
    U, evals, trace, residual = solver.result()
    H = Q @ torch.diag(lam) @ Q.T + V @ V.T
    torch.testing.assert_close(U @ torch.diag(evals) @ U.T, H, **TOL)
    torch.testing.assert_close(trace, H.trace(), **TOL)
    torch.testing.assert_close(residual, torch.zeros(9, dtype=torch.float64), rtol=0,
                               atol=1e-12)
    with pytest.raises(RuntimeError, match="already eigendecomposed"):
        solver.add_lowrank(Q, lam, lam.sum())



def test_auto_sketches_with_four_times_the_rank_where_its_float64_matrix_fits():
    """``solver="auto"``: a sketch of ``4 * rank`` columns where it is cheaper than
    streaming and its float64 ``D x l`` matrix fits a quarter of the budget; streaming
    merges of ``rank + oversampling`` where it does not, and for low-memory fits."""
    from lowrank_laplace.fitting import plan as plan_module

    engine, X = _engine_and_batch()
    dim = 5 * 6 + 6 + 6 * 4 + 4
    with engine:
        auto = _plan(engine, X, solver="auto", rank=10)
        tight = _plan(engine, X, solver="auto", rank=10,
                      memory_budget=int(dim * 40 * 8 / plan_module.WIDE_SKETCH_SHARE) - 1)
        low = _plan(engine, X, solver="auto", rank=10, low_memory=True)
    assert (auto.path, auto.keep, auto.sketch_dtype) == ("sketch", 40, None)  # float64 model
    assert (tight.path, tight.keep) == ("streaming", 12)
    assert (low.path, low.keep) == ("streaming", 12)
    merge = _solver(auto)
    assert isinstance(merge, SketchMerge) and (merge.rank, merge.keep) == (10, 40)


def test_auto_sums_densely_exactly_where_streaming_would(tune):
    """Under ``solver="auto"`` the dense sum competes with streaming at streaming's own
    merge size, not at the sketch's (whose single large merge made every streaming
    fit look dearer than a dense ``D x D`` eigendecomposition)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).double()
    engine = FactorEngine(model, nn.CrossEntropyLoss(reduction="sum"), eval_mode=True)
    X = torch.randn(128, 64, dtype=torch.float64)
    tune(dense_max_dim=None)
    with engine:
        for n in (128, 1400):
            kw = dict(num_data=n, rank=100)
            streaming = _plan(engine, X, **kw)
            auto = _plan(engine, X, solver="auto", **kw)
            assert (auto.path == "dense") == (streaming.path == "dense")
        assert auto.path == "sketch"  # D = 3,760, 1,400 samples: dense is the dearest


def test_a_float32_sketch_is_widened_to_float64_on_its_second_pass_where_it_fits():
    from lowrank_laplace.fitting import plan as plan_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4))  # float32
    engine = FactorEngine(model, nn.CrossEntropyLoss(reduction="sum"), eval_mode=True)
    X = torch.randn(32, 5)
    dim = 5 * 6 + 6 + 6 * 4 + 4
    share = plan_module.WIDE_SKETCH_SHARE
    with engine:
        first = _plan(engine, X, solver="sketch", micro_batch_size=2)
        wide = _plan(engine, X, solver="sketch", micro_batch_size=2, wide_sketch=True)
        narrow = _plan(engine, X, solver="sketch", micro_batch_size=2, wide_sketch=True,
                       memory_budget=int(dim * 12 * 8 / share) - 1)
        low = _plan(engine, X, solver="sketch", micro_batch_size=2, low_memory=True)
    assert first.path == wide.path == narrow.path == low.path == "sketch"
    # float32 first, float64 on the second pass where it fits
    assert first.sketch_dtype is None and first.widen
    assert wide.sketch_dtype == torch.float64 and not wide.widen
    assert narrow.sketch_dtype is None and not narrow.widen
    assert low.sketch_dtype is None and not low.widen  # recomputed passes: factors' dtype
    assert _solver(wide).accumulate == torch.float64
    assert _solver(first).accumulate is None


def test_small_streaming_fits_run_on_one_thread_and_sketches_on_the_idle_cores():
    """Small streaming merges run on one CPU thread; a sketch, whose products are few and
    wide, leaves the threads to the fit (the cores idle at its start). Nothing reads the
    load while planning."""
    engine, X = _engine_and_batch()
    with engine:
        sketch = _plan(engine, X, solver="sketch", micro_batch_size=2)
        streaming = _plan(engine, X)
    assert sketch.path == "sketch" and sketch.threads is None
    assert streaming.path == "streaming" and streaming.threads == 1


@pytest.mark.parametrize("chunk", [None, 40], ids=["whole", "sliced"])
def test_dense_sum_of_a_factor_is_v_v_transposed(monkeypatch, chunk):
    """The dense sum expands ``V`` from its blocks (factored and explicit), in slices of
    samples where it is large, and adds exactly ``scale V V^T`` and its trace."""
    from lowrank_laplace.factor import weights

    if chunk is not None:
        monkeypatch.setattr(weights, "WIDE_ENTRIES", chunk)
    engine, X = _engine_and_batch(n=7)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    with engine:
        factor = engine.compute(X, y, gradient=False)
    eye = torch.eye(factor.num_columns, dtype=torch.float64)
    V = factor.matmul(eye)  # (D, M), the explicit factor
    solver = DenseSum(rank=10)
    solver.add_factor(factor, scale=0.5)
    torch.testing.assert_close(solver._dense, 0.5 * V @ V.T, **TOL)
    torch.testing.assert_close(solver.trace, 0.5 * (V**2).sum(), **TOL)
