"""The rank study (``lowrank-laplace rank-study``) end to end on a tiny digits run."""

import json

import pytest

from lowrank_laplace.toolkit import calibration, rank_study
from lowrank_laplace.toolkit.cli import main

STUDY = ["rank-study", "--dataset", "digits", "--epochs", "2", "--n-train", "300",
         "--n-test", "80", "--ranks", "4,40", "--angles", "45",
         "--residuals", "spectral,diagonal,none"]


@pytest.mark.slow
def test_rank_study_end_to_end(tmp_path, capsys):
    assert main(STUDY + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("posterior") and "rank 40 spectral" in out
    report = json.loads((tmp_path / "rank_study.json").read_text())
    assert (tmp_path / "rank_study.png").stat().st_size > 5000
    assert report["config"]["angles"] == [0.0, 45.0]  # 0 is always scored
    assert set(report["references"]) == {"map", "full_all", "kron_all", "diag_all"}
    rows = report["lowrank"]
    assert [(r["requested_rank"], r["residual"]) for r in rows] == [
        (rank, residual) for rank in (4, 40) for residual in ("spectral", "diagonal", "none")]
    for row in rows:
        assert set(row["scores"]) == {"0", "45"}
        for scores in row["scores"].values():
            assert set(scores) == {"nll", "ece", "brier", "accuracy"}
            assert scores["nll"] > 0 and 0 <= scores["ece"] <= 1
        assert row["prior_precision"] > 0 and 0 < row["kept_fraction"] <= 1 + 1e-6
        assert row["quadrature_steps"] >= 0
    kept = {r["requested_rank"]: r["kept_fraction"] for r in rows}
    assert kept[40] > kept[4]
    # residual models share a fit: same kept trace, different posteriors
    at4 = [r for r in rows if r["requested_rank"] == 4]
    assert len({round(r["kept_fraction"], 12) for r in at4 if r["residual"] != "diagonal"}) == 1
    assert len({r["scores"]["0"]["nll"] for r in at4}) == 3
    # the MAP reference is the network's own softmax: rotation 0 is the test set
    cal = calibration.CalibrationConfig()
    assert cal.rank == 100  # the calibration study's default rank is a point of the study


@pytest.mark.slow
def test_rank_study_of_the_marglik_trained_network(tmp_path, capsys):
    """Every posterior keeps the layerwise priors marglik_training learned."""
    study = STUDY[:STUDY.index("--residuals")] + ["--residuals", "spectral", "--epochs", "1",
                                                 "--train", "marglik", "--out", str(tmp_path)]
    assert main(study) == 0
    report = json.loads((tmp_path / "rank_study.json").read_text())
    refs = report["references"]
    assert set(refs) == {"map", "full_all", "kron_all", "diag_all", "lowrank_ggn_marglik"}
    learned = refs["lowrank_ggn_marglik"]["posterior"]["prior_precisions"]
    assert report["config"]["train"] == "marglik"
    for name in ("full_all", "kron_all", "diag_all"):
        assert refs[name]["posterior"]["prior_precisions"] == pytest.approx(learned)
    mean = sum(learned) / len(learned)
    assert [r["prior_precision"] for r in report["lowrank"]] == pytest.approx([mean] * 2)
    assert len({round(v, 6) for v in learned}) > 1  # layerwise: learned per parameter tensor


@pytest.mark.parametrize("change, message", [
    ({"train": "swa"}, "unknown training 'swa'"),
    ({"train": "marglik", "checkpoint": "cnn.pt"}, "--train marglik trains its own network"),
    ({"ranks": [0]}, "ranks must be integers >= 1"),
    ({"ranks": []}, "ranks must be integers >= 1"),
    ({"residuals": ["tail"]}, "unknown residual model"),
    ({"dataset": "cifar10"}, "unknown dataset"),
])
def test_rank_study_options_checked_before_work(change, message, tmp_path):
    config = rank_study.RankStudyConfig(dataset="digits", out=str(tmp_path / "out"))
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(calibration.UserError, match=message):
        rank_study.run(config)


def test_rank_study_cli_errors_are_one_line(capsys, tmp_path):
    assert main(STUDY + ["--out", str(tmp_path), "--residuals", "spectral,tail"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown residual model" in err and len(err.splitlines()) == 1
