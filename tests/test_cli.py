"""The lowrank-laplace command end to end on a tiny configuration."""

import json
import subprocess
import sys

import pytest
import torch

from lowrank_laplace.cli import main

TINY = ["spectrum", "--epochs", "0", "--batch-size", "24", "--top-k", "3", "--model", "mlp"]


def test_spectrum_writes_report(tmp_path, capsys):
    assert main(TINY + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "exact, full batch" in out and "mc (M=1), sub-sampled" in out
    report = json.loads((tmp_path / "spectrum.json").read_text())
    assert len(report["cases"]) == 4
    for entry in report["cases"].values():
        evals = torch.tensor(entry["eigenvalues"])
        assert entry["rank"] == evals.numel() > 0
        assert torch.all(evals[:-1] >= evals[1:])
        # the trace is the sum of all eigenvalues, so the top-k keep at most all of it
        assert evals.sum().item() == pytest.approx(entry["trace"], rel=1e-4)
        assert 0 < entry["top_k_kept_fraction"] <= 1 + 1e-6
        assert len(entry["gamma_snr"]) == len(entry["lambda_snr"]) == 3
    assert (tmp_path / "spectrum.png").stat().st_size > 1000
    assert (tmp_path / "snr.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--dataset", "cifar"], "unknown dataset 'cifar'"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--batch-size", "3"], "--batch-size must lie in"),
])
def test_user_errors_are_one_line(args, message, capsys):
    assert main(TINY + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert err.startswith("lowrank-laplace: error")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_absent(capsys):
    assert main(TINY + ["--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(TINY + ["--out", str(blocker / "sub")]) == 2
    assert "cannot write to output directory" in capsys.readouterr().err


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "lowrank_laplace", "--help"],
                          capture_output=True, text=True, check=True)
    assert "spectrum" in proc.stdout


CAL = ["calibrate", "--dataset", "digits", "--epochs", "1", "--n-train", "300", "--n-test", "80",
       "--rank", "20", "--angles", "0,45"]
SCHEMA_ID = {"accuracy", "nll", "ece", "mce", "brier", "confidence"}


def test_calibrate_end_to_end(tmp_path, capsys):
    ckpt = tmp_path / "cnn.pt"
    assert main(CAL + ["--out", str(tmp_path), "--save-checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "lowrank_ggn_all" in out and "ECE under rotation" in out
    report = json.loads((tmp_path / "calibration.json").read_text())
    from lowrank_laplace.calibration import METHODS

    assert set(report["methods"]) == set(METHODS)
    for name, m in report["methods"].items():
        assert "error" not in m, (name, m)
        assert set(m["in_distribution"]) == SCHEMA_ID
        assert set(m["shift"]) == {"0", "45"}
        assert set(m["shift"]["45"]) == {"accuracy", "nll", "ece"}
        assert 0 <= m["ood_auroc"] <= 1 and m["fit_s"] >= 0 and m["predict_s"] > 0
        assert (tmp_path / f"reliability_{name}.png").stat().st_size > 2000
    assert report["config"]["n_train_used"] == 300
    # rotation by 0 degrees is the identity: shift "0" equals in-distribution
    m = report["methods"]["map"]
    assert m["shift"]["0"]["ece"] == pytest.approx(m["in_distribution"]["ece"])
    # loading the checkpoint reproduces the MAP predictions
    out2 = tmp_path / "again"
    assert main(CAL + ["--out", str(out2), "--checkpoint", str(ckpt), "--methods", "map"]) == 0
    again = json.loads((out2 / "calibration.json").read_text())
    assert again["methods"]["map"]["in_distribution"] == m["in_distribution"]


@pytest.mark.parametrize("args, message", [
    (["--dataset", "cifar10"], "unknown dataset 'cifar10'"),
    (["--checkpoint", "/nonexistent/cnn.pt"], "does not exist"),
    (["--methods", "map,swag"], "unknown method 'swag'"),
    (["--prior", "cv"], "unknown prior tuning 'cv'"),
    (["--angles", "0,abc"], "--angles must be comma-separated numbers"),
])
def test_calibrate_user_errors(args, message, capsys, tmp_path):
    assert main(CAL + ["--out", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_calibrate_wrong_checkpoint_and_unwritable_out(tmp_path, capsys):
    ckpt = tmp_path / "other.pt"
    torch.save(torch.nn.Linear(3, 3).state_dict(), ckpt)
    assert main(CAL + ["--out", str(tmp_path), "--checkpoint", str(ckpt)]) == 2
    assert "does not fit the digits CNN" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(CAL + ["--out", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_calibrate_cuda_absent(tmp_path, capsys):
    assert main(CAL + ["--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
