"""Reused convolution rows: a pass writes into the last one's buffer only once it is dropped."""

import torch
from torch import nn

import lowrank_laplace as ll
from lowrank_laplace.engine.backpack.buffers import RowBuffers, held_elsewhere


def _conv_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(3 * 5 * 5, 4))
    return model, torch.randn(6, 2, 5, 5), torch.randint(0, 4, (6,))


def _conv_rows(factor):
    """The conv weight's rows (the first parameter's block)."""
    return factor.blocks[0].rows


def test_a_buffer_is_handed_out_again_only_when_nothing_holds_it():
    buffers, like = RowBuffers(), torch.zeros(1)
    first = buffers.empty("conv", (4, 5), like)
    view = first[1:]
    assert held_elsewhere(first)
    second = buffers.empty("conv", (4, 5), like)
    assert second.data_ptr() != first.data_ptr()  # the view still reads the first
    del view, first
    second_ptr = second.data_ptr()
    del second
    assert buffers.empty("conv", (4, 5), like).data_ptr() == second_ptr
    assert buffers.empty("conv", (2, 5), like).shape == (2, 5)  # another shape: a new one
    assert buffers.empty("conv", (2, 5), like.double()).dtype == torch.float64


def test_a_kept_factor_keeps_its_rows_when_the_next_pass_runs():
    """The reuse never overwrites a factor the caller still holds, and the rows are BackPACK's."""
    model, X, y = _conv_problem()
    with ll.FactorEngine(model, nn.CrossEntropyLoss(), backend="backpack") as engine:
        first = engine.compute(X[:3], y[:3])
        kept = _conv_rows(first).clone()
        second = engine.compute(X[3:], y[3:])
        torch.testing.assert_close(_conv_rows(first), kept, rtol=0, atol=0)
        assert _conv_rows(second).data_ptr() != _conv_rows(first).data_ptr()
        again = engine.compute(X[:3], y[:3])
        torch.testing.assert_close(_conv_rows(again), kept)
        ptr = _conv_rows(again).data_ptr()
        del first, again
        reused = engine.compute(X[:3], y[:3])
        assert _conv_rows(reused).data_ptr() == ptr  # the dropped factor's buffer
        torch.testing.assert_close(_conv_rows(reused), kept)
    with ll.FactorEngine(model, nn.CrossEntropyLoss(), backend="functorch") as engine:
        reference = engine.compute(X[:3], y[:3])
    torch.testing.assert_close(reference.blocks[0].to_dense(), kept, rtol=1e-5, atol=1e-6)


def test_passes_through_overlapping_max_pools_reusing_their_zeros_stay_exact():
    """Pools whose windows overlap (DeepOBS' 3x3, stride 2) scatter-add into zeros that
    the engine reuses: every pass's GGN factor equals the functorch one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(),
                          nn.MaxPool2d(3, stride=2, padding=1), nn.Flatten(),
                          nn.Linear(3 * 3 * 3, 4))
    X, y = torch.randn(8, 2, 7, 7), torch.randint(0, 4, (8,))
    loss_func = nn.CrossEntropyLoss()
    with ll.FactorEngine(model, loss_func, backend="functorch") as engine:
        expected = [engine.compute(X[i:i + 4], y[i:i + 4]).gram() for i in (0, 4, 0)]
    with ll.FactorEngine(model, loss_func, backend="backpack") as engine:
        for i, gram in zip((0, 4, 0), expected):
            torch.testing.assert_close(engine.compute(X[i:i + 4], y[i:i + 4]).gram(), gram,
                                       rtol=1e-5, atol=1e-6)
