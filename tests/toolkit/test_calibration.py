"""Text output of the calibration study (hand-made reports) and its prior tuning."""

import pytest

from lowrank_laplace.toolkit import calibration, options, posteriors, training

ENTRY = {"in_distribution": {"accuracy": 0.9, "nll": 0.3, "ece": 0.02, "mce": 0.1,
                             "brier": 0.15, "confidence": 0.88},
         "shift": {"0": {"ece": 0.02}, "45": {"ece": 0.11}},
         "ood_auroc": 0.8, "fit_s": 1.5, "predict_s": 0.25}


def test_format_table_has_a_column_per_entry_and_reports_errors():
    report = {"methods": {"map": ENTRY, "kron_all": {"error": "RuntimeError: out of memory"}}}
    lines = calibration.format_report(report).splitlines()
    for header, _, _ in calibration.TABLE_COLUMNS:
        assert header in lines[0]
    assert set(lines[1]) == {"-"} and len(lines[1]) == len(lines[0]) == len(lines[2])
    assert lines[2].split() == ["map", "0.9000", "0.3000", "0.0200", "0.1000", "0.1500",
                                "0.8800", "0.8000", "nan", "nan", "1.50", "0.25"]
    assert lines[3].startswith("kron_all") and "could not run: RuntimeError" in lines[3]


def test_format_shift_and_methods_table():
    lines = calibration.format_report({"methods": {"map": ENTRY}}).splitlines()
    shift = lines.index(next(line for line in lines if line.startswith("ECE under rotation")))
    assert lines[shift].split()[-2:] == ["0deg", "45deg"]
    assert lines[shift + 1].split() == ["map", "0.0200", "0.1100"]
    assert calibration.METHODS[0] == "map"
    assert set(calibration.METHODS[1:]) == set(calibration.LAPLACE_METHODS) | set(
        options.TRAINED_METHODS)
    assert not set(options.TRAINED_METHODS) & set(calibration.default_methods("digits"))


def test_faithfulness_of_the_default_row_against_full_all():
    ours = dict(ENTRY, shift={"0": {"nll": 0.3, "ece": 0.02}, "45": {"nll": 1.1, "ece": 0.11}})
    full = dict(ENTRY, in_distribution=dict(ENTRY["in_distribution"], nll=0.25, ece=0.025),
                shift={"0": {"nll": 0.25, "ece": 0.025}, "45": {"nll": 1.0, "ece": 0.1}})
    report = {"methods": {"lowrank_ggn_all": ours, "full_all": full}}
    faithful = calibration.faithfulness(report)
    assert faithful["in_distribution"] == pytest.approx({"nll": 0.2, "ece": -0.2})
    assert faithful["shift"]["45"] == pytest.approx({"nll": 0.1, "ece": 0.1})
    assert faithful["largest"] == pytest.approx(0.2)
    lines = calibration.format_report(report).splitlines()
    lines = lines[lines.index(next(x for x in lines if x.startswith("lowrank_ggn_all / "))):]
    assert len(lines) == 4
    assert lines[0].split()[-3:] == ["in-dist", "0deg", "45deg"]
    assert lines[1].split() == ["NLL", "20.0%", "20.0%", "10.0%"]
    assert lines[2].split() == ["ECE", "-20.0%", "-20.0%", "10.0%"]
    assert lines[3].endswith("20.0%")
    # without the reference (MNIST), or where it failed: nothing
    assert calibration.faithfulness({"methods": {"lowrank_ggn_all": ours}}) == {}
    report["methods"]["full_all"] = {"error": "RuntimeError: out of memory"}
    assert "lowrank_ggn_all / full_all" not in calibration.format_report(report)


def test_default_methods_and_notes():
    assert "full_all" in calibration.default_methods("digits")
    assert "full_all" not in calibration.default_methods("mnist")
    assert not set(options.ABLATIONS) & set(calibration.default_methods("mnist"))
    entry = dict(ENTRY, posterior={"prior_precision": 2.5, "rank": 100, "kept_fraction": 0.9,
                                   "residual": "spectral"})
    report = {"methods": {"lowrank_ggn_all": entry, "full_last_layer": ENTRY}}
    assert "2.5" in calibration.format_report(report).splitlines()[2]
    notes = calibration.format_report(report)
    assert "lowrank_ggn_all: rank 100, kept 0.900, residual='spectral'" in notes
    assert "full_*" in notes
    # the two lines under the table: which row is the product and how to read it
    lines = notes.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("lowrank_ggn_all is the product")))
    assert at == 4 and "faithful to the exact GGN posterior" in lines[at]
    assert lines[at + 1] == "--dataset digits shows the exact posterior (full_all) beside it."
    report["methods"]["full_all"] = ENTRY
    assert "full_all is that exact posterior." in calibration.format_report(report).splitlines()
    del report["methods"]["full_all"]
    assert "is the product" not in calibration.format_report({"methods": {"map": ENTRY}})
    check = {"name": "sketch self-check", "value": 0.97, "threshold": 0.95, "passed": True,
             "action": "kept the sketch"}
    entry["posterior"]["fit_report"] = {
        "rank": 100, "num_params": 3658, "kept_fraction": 0.9, "fit_path": "sketch",
        "factor_backend": "backpack", "residual": "isotropic", "check": check,
        "variance_change": 0.012, "warm_started": False, "ranks_tried": [[100, 0.012]]}
    notes = calibration.format_report(report)
    assert "lowrank_ggn_all: lowrank_ggn fit: rank 100 of 3,658 parameters, a one-pass" in notes
    assert "kept share of the GGN trace: 0.900 (the rest: residual='isotropic')" in notes
    assert "sketch self-check: passed (0.970, needs 0.95); kept the sketch" in notes
    assert "changes by 1.2% from rank 50 to 100" in notes


def test_marglik_prior_full_matches_laplace_torch():
    """The eigenvalue shortcut gives laplace-torch's own marglik prior of a FullLaplace."""
    import torch
    from laplace import FullLaplace
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    X, y = torch.randn(60, 4, dtype=torch.float64), torch.randint(0, 3, (60,))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # curvlinops builds eye() in the default dtype
    try:
        la = FullLaplace(model, "classification")
        la.fit(DataLoader(TensorDataset(X, y), batch_size=20))
    finally:
        torch.set_default_dtype(old)
    ours = posteriors.marglik_prior_full(la)
    la.optimize_prior_precision(method="marglik")
    assert ours == pytest.approx(float(la.prior_precision), rel=1e-6)


def test_names_moved_out_of_calibration_are_still_there():
    assert calibration.CalibrationConfig is options.CalibrationConfig
    assert calibration.UserError is options.UserError
    assert calibration.LAPLACE_METHODS is options.LAPLACE_METHODS
    assert calibration.default_methods is options.default_methods
    assert calibration.make_cnn is training.make_cnn
    assert calibration.marglik_prior_full is posteriors.marglik_prior_full


def test_posterior_info_and_map_predictor():
    import torch

    assert posteriors.posterior_info(None) == {}
    model = torch.nn.Linear(3, 4)
    X = torch.randn(10, 3)
    probs = posteriors.predict_batched(posteriors.make_predictor("map", model, None), X, 4,
                                       torch.device("cpu"))
    assert probs.shape == (10, 4)
    assert torch.allclose(probs, torch.softmax(model(X), -1).detach())


def test_every_residual_model_switches_one_fit_as_its_own_fit_would():
    """The study fits lowrank_ggn once per subset: the spectral fit tracks the GGN
    diagonal, so the diagonal model switched on it is the diagonal model's own fit."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lowrank_laplace import LowRankGGNLaplace

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    X, y = torch.randn(90, 6, dtype=torch.float64), torch.randint(0, 3, (90,))
    loaders = {"train": DataLoader(TensorDataset(X, y), batch_size=30)}
    config = options.CalibrationConfig(rank=8, prior="marglik")
    fitted = {}
    shared = [posteriors.fit_laplace(name, model, config, loaders, fitted)
              for name in ("lowrank_ggn_all", "lowrank_ggn_all_diag")]
    assert shared[0] is shared[1] and len(fitted) == 1 and shared[1].residual == "diagonal"
    own = LowRankGGNLaplace(model, "classification", rank=8, residual="diagonal")
    own.fit(loaders["train"])
    own.optimize_prior_precision(method="marglik")
    torch.testing.assert_close(shared[1].prior_precision, own.prior_precision)
    torch.testing.assert_close(shared[1].posterior_variance, own.posterior_variance)


def test_rotation_scores_reuse_the_unrotated_probabilities_at_zero_degrees():
    import torch

    torch.manual_seed(0)
    X, y = torch.rand(12, 1, 8, 8), torch.randint(0, 3, (12,))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 3))
    seen = []

    def predict(inputs):
        seen.append(inputs.shape[0])
        return torch.softmax(model(inputs), -1)

    config = options.CalibrationConfig(angles=(0.0, 90.0, 360.0), batch_size=12)
    device = torch.device("cpu")
    fresh = posteriors.rotation_scores(predict, (X, y), config, device, ("nll", "ece"))
    assert len(seen) == 3
    unrotated = posteriors.predict_batched(predict, X, 12, device)
    seen.clear()
    reused = posteriors.rotation_scores(predict, (X, y), config, device, ("nll", "ece"),
                                        unrotated=unrotated)
    assert len(seen) == 1  # 90 degrees only
    for angle in fresh:
        for key in fresh[angle]:
            assert reused[angle][key] == pytest.approx(fresh[angle][key], rel=1e-6)
