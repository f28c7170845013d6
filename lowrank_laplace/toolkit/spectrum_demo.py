"""The GGN spectrum demo behind ``lowrank-laplace spectrum``.

Trains a small network on scikit-learn's digits, then prints the mini-batch GGN spectrum
for the ViViT paper's four cases (exact / Monte-Carlo loss Hessian, full / sub-sampled
batch), the top-k's kept trace and median SNRs. The report's schema::

    {"config": {<the command's options>, "num_params"},
     "cases": {name: {"rank", "eigenvalues", "trace", "top_k_kept_fraction",
                      "gamma_snr", "lambda_snr", "time_s"}, ...}}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Tuple

import torch
from torch import Tensor, nn

from lowrank_laplace.directional import directional_from_factor
from lowrank_laplace.engine import FactorEngine
from lowrank_laplace.spectrum import gram_eigh
from lowrank_laplace.toolkit import datasets, plots
from lowrank_laplace.toolkit.options import UserError, check_spectrum
from lowrank_laplace.toolkit.training import make_cnn

#: The four cases: ``mc_samples`` and whether the curvature is sub-sampled.
CASES = {"exact, full batch": (0, False), "exact, sub-sampled": (0, True),
         "mc (M=1), full batch": (1, False), "mc (M=1), sub-sampled": (1, True)}
#: The networks for 8x8 single-channel images with 10 classes.
MODELS = {"cnn": lambda: make_cnn("digits"),
          "mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.Tanh(),
                                       nn.Linear(64, 10))}
#: The printed table: header, alignment and width, number format.
COLUMNS = (("case", "<24", ""), ("rank", ">6", ""), ("lambda_1", ">11", ".4g"),
           ("trace", ">11", ".4g"), ("top-k kept", ">12", ".3f"), ("grad SNR", ">10", ".3g"),
           ("curv SNR", ">10", ".3g"), ("time [s]", ">10", ".3f"))


def load_digits(seed: int) -> Tuple[Tensor, Tensor]:
    """Return scikit-learn's digits, shuffled: ``(N, 1, 8, 8)`` images in ``[0, 1]``, labels.

    Args:
        seed: Seed of the shuffling permutation.
    """
    return datasets.split(*datasets.load_images("digits"), fractions=(1, 0, 0), seed=seed).train


def train(model: nn.Module, X: Tensor, y: Tensor, epochs: int, device: torch.device) -> None:
    """Train with Adam on the cross-entropy, in shuffled mini-batches of 64.

    Args:
        model: The network, trained in place.
        X: The inputs.
        y: The labels.
        epochs: Passes over the data.
        device: Where the network lives.
    """
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_func = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for idx in torch.randperm(len(y)).split(64):
            opt.zero_grad()
            loss_func(model(X[idx].to(device)), y[idx].to(device)).backward()
            opt.step()


def run(args: argparse.Namespace) -> dict:
    """Run the demo: check the options, train, print the table, write the report.

    Args:
        args: Parsed arguments of :data:`~lowrank_laplace.toolkit.options.SPECTRUM_OPTIONS`.

    Returns:
        The report (also printed, and written to ``args.out`` if given).

    Raises:
        UserError: For invalid options or an unwritable output directory.
    """
    check_spectrum(args)
    device = torch.device(args.device)
    X, y = load_digits(args.seed)
    sub = list(range(max(args.batch_size // 8, 2)))
    torch.manual_seed(args.seed)
    model = MODELS[args.model]().to(device)
    train(model, X, y, args.epochs, device)
    model.eval()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"config": config | {"num_params": sum(p.numel() for p in model.parameters())}}
    print(f"GGN spectrum of a {args.model} on digits: D = {report['config']['num_params']:,}, "
          f"N = {args.batch_size}, sub-sample = {len(sub)}, top-k = {args.top_k}")
    header = "".join(f"{name:{align}}" for name, align, _ in COLUMNS)
    print(header + "\n" + "-" * len(header))
    Xb, yb = X[: args.batch_size].to(device), y[: args.batch_size].to(device)
    report["cases"] = _compute_cases(model, Xb, yb, sub, args.top_k)
    print("SNRs are medians over the top-k directions (squared mean / variance over samples).")
    if args.out is not None:
        _write_report(report, args.out)
    return report


def _compute_cases(model: nn.Module, X: Tensor, y: Tensor, sub: list, top_k: int) -> dict:
    """The four cases' report entries on one mini-batch, printing a row each."""
    out = {}
    with FactorEngine(model, nn.CrossEntropyLoss()) as engine:
        engine.compute(X[:8], y[:8])  # warm-up: the first call installs the hooks
        for name, (mc_samples, subsampled) in CASES.items():
            start = time.perf_counter()
            factor = engine.compute(X, y, batch_grad=True, mc_samples=mc_samples,
                                    subsampling=sub if subsampled else None)
            dd = directional_from_factor(factor, top_k=top_k)
            elapsed = time.perf_counter() - start
            evals = gram_eigh(factor, solver="eigh")[2]
            trace = float(factor.trace())
            out[name] = {"rank": int(evals.numel()), "eigenvalues": evals.tolist(),
                         "trace": trace, "top_k_kept_fraction": float(dd.eigenvalues.sum()) / trace,
                         "gamma_snr": dd.gamma_snr.tolist(), "lambda_snr": dd.lambda_snr.tolist(),
                         "time_s": elapsed}
            row = (name, out[name]["rank"], float(evals[0]), trace,
                   out[name]["top_k_kept_fraction"], float(dd.gamma_snr.median()),
                   float(dd.lambda_snr.median()), elapsed)
            print("".join(f"{v:{align}{fmt}}" for v, (_, align, fmt) in zip(row, COLUMNS)))
    return out


def _write_report(report: dict, out: Path) -> None:
    """Write ``spectrum.json``, the spectrum plot and the SNR plot to ``out``."""
    try:  # check_spectrum made the folder
        (out / "spectrum.json").write_text(json.dumps(report, indent=2))
        evals = {n: torch.tensor(c["eigenvalues"]) for n, c in report["cases"].items()}
        plots.close(plots.spectrum(evals, title="Mini-batch GGN spectrum",
                                   path=out / "spectrum.png"))
        plots.close(plots.snr_curves(report["cases"], path=out / "snr.png"))
    except OSError as err:
        raise UserError(f"cannot write to output directory {str(out)!r}: {err.strerror}") from err
    print(f"wrote {out / 'spectrum.json'}, {out / 'spectrum.png'} and {out / 'snr.png'}")
