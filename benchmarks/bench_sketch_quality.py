"""The sketch solver's posterior quality against the full GGN, beside streaming merges.

On the problems of ``bench_posterior_quality`` (and ``digits2``, ``bench_shared``'s deeper
MLP), ``lowrank_ggn`` with defaults and every ``solver`` on float64 and float32 copies of
the MAP network, priors tuned as there: the plan's path, test NLL and prior relative to
``FullLaplace``'s, the kept trace and the kept eigenvalues' errors; one worker per problem.

    python -m benchmarks.bench_sketch_quality --out benchmarks/results/sketch_quality
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)
from benchmarks._harness import run_results, script_main, script_parser
from benchmarks._report import machine_info
from benchmarks._worker import default_dtype, run_result
from benchmarks.bench_posterior_quality import problem, scores, train_map, tuned_full

SOLVERS = ("streaming", "sketch")


def load_problem(name: str):
    """``bench_posterior_quality``'s problem; ``digits2``: digits with two hidden layers."""
    if name == "digits2":
        *data, likelihood, _ = problem("digits")
        return (*data, likelihood, [50, 50])
    return problem(name)


def eigen_errors(lam: torch.Tensor, exact: torch.Tensor) -> dict:
    """Largest relative error of the kept eigenvalues against the exact leading ones."""
    lam = lam.double().sort(descending=True).values
    ref = exact[: lam.numel()]
    rel = (lam - ref).abs() / ref
    return {f"top{k}": float(rel[:k].max()) for k in (10, 50) if k <= lam.numel()} | {
        "all_kept": float(rel.max()), "kept": lam.numel()}


def run(name: str, epochs: int, solvers) -> dict:
    X, y, Xt, yt, likelihood, hidden = load_problem(name)
    model = train_map(X, y, likelihood, hidden, epochs)
    sigma = 1.0
    if likelihood == "regression":
        with torch.no_grad():
            sigma = float(((model(X) - y) ** 2).mean().sqrt())
    with default_dtype(torch.float64):
        from laplace.curvature import BackPackGGN

        full = Laplace(model, likelihood, subset_of_weights="all", hessian_structure="full",
                       sigma_noise=sigma, backend=BackPackGGN)
        full.fit(DataLoader(TensorDataset(X, y), batch_size=128))
        exact = torch.linalg.eigvalsh(full.H).flip(0).clamp(min=0)
        full_prior = tuned_full(full)
        full_scores = scores(full, model, Xt, yt, likelihood, sigma)
    D = exact.numel()
    record = {"D": D, "n_train": len(X), "likelihood": likelihood, "sigma_noise": sigma,
              "full": {"prior_precision": full_prior, **full_scores}, "lowrank": []}
    for dtype in (torch.float64, torch.float32):
        net = copy.deepcopy(model).to(dtype)
        loader = DataLoader(TensorDataset(X.to(dtype), y if likelihood == "classification"
                                          else y.to(dtype)), batch_size=128)
        for solver in solvers:
            la = Laplace(net, likelihood, subset_of_weights="all",
                         hessian_structure="lowrank_ggn", sigma_noise=sigma, solver=solver)
            start = time.perf_counter()
            la.fit(loader)
            seconds = time.perf_counter() - start
            la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
            prior = float(la.prior_precision)
            s = scores(la, net, Xt.to(dtype), yt if likelihood == "classification"
                       else yt.to(dtype), likelihood, sigma)
            row = {"dtype": str(dtype).split(".")[-1], "solver": solver,
                   "path": la.fit_path, "fit_s": seconds, "prior_precision": prior,
                   "prior_ratio": prior / full_prior, "nll": s["nll"],
                   "nll_rel": s["nll"] / full_scores["nll"] - 1,
                   "kept_fraction": float(la.kept_fraction),
                   "eigen_rel_error": eigen_errors(la.H[1], exact)}
            record["lowrank"].append(row)
            print(f"{name} {row['dtype']} {solver:<9} ({row['path']}): NLL "
                  f"{row['nll']:.4f} ({row['nll_rel']:+.1%}) prior x{row['prior_ratio']:.2f} "
                  f"kept {row['kept_fraction']:.3f} eig err {row['eigen_rel_error']} "
                  f"fit {seconds:.2f}s", flush=True)
    print(f"{name} (D={D}): full NLL {full_scores['nll']:.4f} prior {full_prior:.3g}",
          flush=True)
    return record


def worker_main(config: dict) -> None:
    """One problem's fits (phase ``result``)."""
    run_result(config, lambda: run(config["problem"], config["epochs"], config["solvers"]))


def driver_main(args: argparse.Namespace) -> dict:
    """Run every problem in its own worker; write the report."""
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_info("cpu"), "problems": run_results(
        "benchmarks.bench_sketch_quality",
        {name: {"problem": name, "epochs": args.epochs, "solvers": args.solvers.split(","),
                "threads": args.threads} for name in args.problems.split(",")}, args)}
    (args.out / "sketch_quality.json").write_text(json.dumps(report, indent=2))
    return report


def parse_args(argv=None) -> argparse.Namespace:
    """Parse command line arguments."""
    parser = script_parser(__doc__, "threads", "timeout", "blas_threads", "omp_wait_policy",
                           "out", out="benchmarks/results/sketch_quality", threads=None,
                           timeout=14400.0)
    parser.add_argument("--problems", default="digits,diabetes,breast_cancer,digits2")
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--solvers", default=",".join(SOLVERS))
    return parser.parse_args(argv)


main = script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
