"""Offline data sets and plots."""

import pytest
import torch

from lowrank_laplace.toolkit import datasets, plots


@pytest.mark.slow
def test_image_splits_are_seeded_and_disjoint():
    a = datasets.image_split("digits", seed=1)
    b = datasets.image_split("digits", seed=1)
    assert torch.equal(a.train[0], b.train[0])
    n = sum(len(s[1]) for s in (a.train, a.val, a.test))
    assert n == 1797 and a.num_classes == 10
    assert a.train[0].shape[1:] == (1, 8, 8) and a.train[0].max() <= 1
    small = datasets.image_split("mnist", max_train=300)
    assert small.train[0].shape == (300, 1, 28, 28) and len(small.test[1]) == 1000
    loaders = small.loaders(batch_size=64)
    assert len(loaders["train"].dataset) == 300
    with pytest.raises(ValueError, match="unknown dataset 'svhn'"):
        datasets.load_images("svhn")


def test_rotation_and_ood():
    X = torch.zeros(1, 1, 9, 9)
    X[0, 0, 4, 6:] = 1.0  # a bar to the right of the centre
    r = datasets.rotate(X, 90)
    # rotated by 90 degrees the bar lies on the vertical axis through the centre
    assert r[0, 0, :, 4].sum() > 1.5 and r[0, 0, 4, 6:].sum() < 0.5
    torch.testing.assert_close(datasets.rotate(X, 360), X)
    ood = datasets.ood_images(5, 28)
    assert ood.shape == (5, 1, 28, 28) and 0 <= ood.min() and ood.max() <= 1


def test_toy_sets():
    X, y = datasets.moons(50)
    assert X.shape == (50, 2) and set(y.tolist()) == {0, 1}
    X, y = datasets.sine(40)
    assert X.shape == y.shape == (40, 1)
    split = datasets.diabetes()
    assert split.train[1].shape[1] == 1


def test_plots_write_png(tmp_path):
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(100, 4), 1)
    y = torch.randint(0, 4, (100,))
    files = {
        "rel.png": lambda p: plots.reliability_diagram(probs, y, title="t", path=p),
        "conf.png": lambda p: plots.confidence_histograms({"a": probs.max(1).values}, path=p),
        "spec.png": lambda p: plots.spectrum({"x": torch.rand(20).sort(descending=True)[0]},
                                            path=p),
        "band.png": lambda p: plots.regression_band(
            torch.randn(10, 1), torch.randn(10, 1), torch.linspace(-2, 2, 30)[:, None],
            {"m": (torch.zeros(30), torch.ones(30))}, path=p),
        "map.png": lambda p: plots.uncertainty_map(
            lambda g: torch.softmax(g @ torch.ones(2, 2), 1), torch.randn(20, 2),
            torch.randint(0, 2, (20,)), path=p),
        "shift.png": lambda p: plots.shift_curves({"m": {"0": {"ece": 0.1}, "30": {"ece": 0.2}}},
                                                  path=p),
    }
    for name, make in files.items():
        fig = make(tmp_path / name)
        plots.close(fig)
        assert (tmp_path / name).stat().st_size > 2000


def _labels(fig):
    return [t for ax in fig.axes for t in (ax.get_xlabel(), ax.get_ylabel()) if t]


def test_reliability_diagram_labels_and_ece():
    from lowrank_laplace.toolkit import metrics

    torch.manual_seed(0)
    logits = 3 * torch.randn(400, 10)
    y = torch.where(torch.rand(400) < 0.7, logits.argmax(1), torch.randint(0, 10, (400,)))
    probs = torch.softmax(logits, 1)
    fig = plots.reliability_diagram(probs, y, title="map")
    title = fig._suptitle.get_text()
    assert title.startswith("map: ECE = ")
    # the ECE in the title is the metric the report gives (same 15 bins)
    assert float(title.split("= ")[1]) == pytest.approx(metrics.ece(probs, y), abs=1e-4)
    top = fig.axes[0]
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert "Accuracy vs. mean confidence" in legend
    assert not any("per-bin confidence" in t for t in legend)
    # the legend lies above the axes, off the bars
    fig.canvas.draw()
    box = top.get_legend().get_window_extent()
    assert box.y0 >= top.get_window_extent().y1 - 1
    assert all(label[0].isupper() for label in _labels(fig))
    plots.close(fig)


def test_shift_plot_titled_and_labelled():
    results = {"map": {"0": {"ece": 0.1}, "30": {"ece": 0.2}},
               "lowrank": {"0": {"ece": 0.05}, "30": {"ece": 0.1}}}
    fig = plots.shift_curves(results, "ece")
    ax = fig.axes[0]
    assert ax.get_title() == "ECE under rotation" and ax.get_ylabel() == "ECE"
    assert all(label[0].isupper() for label in _labels(fig))
    plots.close(fig)
    fig = plots.shift_curves(results, "ece", title="ECE (digits)")
    assert fig.axes[0].get_title() == "ECE (digits)"
    plots.close(fig)
    for make in (lambda: plots.spectrum({"x": torch.rand(5).sort(descending=True)[0]}),
                 lambda: plots.snr_curves({"c": {"gamma_snr": [1, 2], "lambda_snr": [3, 4]}}),
                 lambda: plots.confidence_histograms({"a": torch.rand(10)})):
        fig = make()
        assert all(label[0].isupper() or label.startswith("log10") for label in _labels(fig))
        plots.close(fig)
