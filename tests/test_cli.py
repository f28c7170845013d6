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


@pytest.mark.parametrize("args, message", [
    (["--dataset", "cifar"], "unknown dataset 'cifar'"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--batch-size", "3"], "--batch-size must lie in"),
])
def test_user_errors_are_one_line(args, message, capsys):
    assert main(TINY + args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("lowrank-laplace: error")


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
