"""The fit's own Lanczos quadrature (held out) against ``refine_complement`` and the exact GGN.

On ``bench_faithful``'s committed exact references (``--references``): the default fit
at each ``--ranks`` (default 100), whose quadrature runs on its own kept factors with the
Jacobian runs' inputs held out, with its marglik prior; then
``la.refine_complement(train_loader)`` (passes over the data, in sample); both
posteriors' functional variance against the exact one's, at their own marglik prior and
at the exact one, and the quadrature's share of the fit's time
(``docs/benchmarks/posterior_quality.md``, "One estimator")::

    python -m benchmarks.bench_quadrature --problems mnist_aug_early
    python -m benchmarks.bench_quadrature --digits   # the digits MLP over ranks
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch
from laplace import Laplace

from benchmarks import _faithful_report as report
from benchmarks import bench_faithful as faithful
from benchmarks._faithful_problems import build_model, make_data
from benchmarks._worker import default_dtype


def errors(fitted, model, data, ref, steps: int) -> dict:
    """Median f-var errors (own / exact prior), NLL and the complement ratio per test set."""
    la = fitted.la
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(method="marglik", n_steps=steps, lr=0.1)
    v = la.residual_model.complement_variance(torch.tensor(1.0), torch.tensor(ref["delta"]))
    fitted.record.update(measured_v_at_exact_prior=float(v), sets={})
    with default_dtype(la.mean.dtype):
        faithful.evaluate([fitted], model, data, ref)
    out = {"prior": float(la.prior_precision.reshape(-1)[0]), "v_at_exact_prior": float(v)}
    for name, metrics in fitted.record["sets"].items():
        out[name] = {"fvar_error": metrics["fvar_error"]["median"],
                     "fvar_error_at_exact_prior": metrics["fvar_error_at_exact_prior"]["median"],
                     "nll": metrics["nll"],
                     "complement_ratio": metrics.get("complement_ratio_median")}
    return out


def run_problem(name: str, rank: int, references: Path) -> dict:
    """The default fit (held out), then ``refine_complement`` (in sample), on one problem.

    The fit runs in the problem's dtype with its marglik steps, as ``bench_faithful``'s.
    """
    ref = faithful.load_reference(references / f"{name}.pt")
    problem = faithful.PROBLEMS[name]
    data = make_data(problem)
    model = build_model(problem, data.features).double()
    model.load_state_dict(ref["state"])
    model.eval()
    dtype = getattr(torch, problem.dtype)
    work = model if dtype == torch.float64 else copy.deepcopy(model).to(dtype)
    fit_set = (faithful.cast(data.fit[0], dtype), data.fit[1])
    steps = problem.marglik_steps or faithful.MARGLIK_STEPS
    with default_dtype(dtype):  # the default fit and its own measurement
        fitted = faithful.fit_method("default", rank, work, fit_set, steps)
    exact = {k: s["exact"]["nll"] for k, s in report.exact_sets(ref, data).items()}
    record = {"rank": rank, "kept_fraction": float(fitted.la.kept_fraction),
              "exact_prior": ref["delta"], "fit_s": fitted.record["fit_s"], "exact_nll": exact,
              "commit": (faithful.git("rev-parse", "--short", "HEAD") or "unknown").strip()}
    record["quadrature_s"] = fitted.la.dropped_quadrature.seconds
    record["quadrature_steps"] = fitted.la.fit_report.quadrature_steps
    record["default"] = errors(fitted, model, data, ref, steps)
    start = time.perf_counter()
    with default_dtype(dtype):
        fitted.la.refine_complement(faithful.loader(*fit_set))
    record["refine_s"] = time.perf_counter() - start
    record["refine_steps"] = fitted.la.fit_report.quadrature_steps
    record["refine_converged"] = fitted.la.fit_report.quadrature_converged
    fitted.la.prior_precision = 1.0
    record["refined"] = errors(fitted, model, data, ref, steps)
    print(name, json.dumps(record), flush=True)
    return record


DIGITS_RANKS = (4, 6, 10, 20, 40)


def digits_problem(hidden: int = 16, n_train: int = 500, epochs: int = 60):
    """sklearn digits' MLP 64-16-10 at its MAP, as the package's real-data tests train it:
    the model, the training loader and 400 held-out images with their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    X = torch.tensor(data.data / 16.0, dtype=torch.float64)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 10)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(epochs):
        for idx in torch.randperm(n_train).split(100):
            opt.zero_grad()
            decay = sum((p**2).sum() for p in model.parameters()) / (2 * n_train)
            (torch.nn.functional.cross_entropy(model(X[idx]), y[idx]) + decay).backward()
            opt.step()
    train = torch.utils.data.TensorDataset(X[:n_train], y[:n_train])
    return model, torch.utils.data.DataLoader(train, batch_size=100), X[500:900], y[500:900]


def digits_study() -> dict:
    """The digits MLP over ranks, measured (the default) and flat (``isotropic``), against
    its full-GGN posterior: marglik prior, median functional-variance error and NLL on 400
    held-out images, and the quadrature's share of the fit's time."""
    from laplace import FullLaplace

    model, loader, X_test, y_test = digits_problem()

    def measure(la) -> dict:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
            probs = la(X_test, link_approx="probit")
        var = la._glm_predictive_distribution(X_test)[1].diagonal(dim1=1, dim2=2).sum(1)
        return {"prior": float(la.prior_precision.reshape(-1)[0]), "var": var,
                "nll": float(torch.nn.functional.nll_loss(probs.log(), y_test))}

    with default_dtype(torch.float64):  # laplace-torch's backend builds float64 eyes
        full = FullLaplace(model, "classification")
        full.fit(loader)
    exact = measure(full)
    records = {"exact_prior": exact["prior"], "exact_nll": exact["nll"], "ranks": {}}
    for rank in DIGITS_RANKS:
        for residual in ("spectral", "isotropic"):
            la = Laplace(model, "classification", subset_of_weights="all",
                         hessian_structure="lowrank_ggn", rank=rank, residual=residual)
            start = time.perf_counter()
            la.fit(loader)
            seconds = time.perf_counter() - start
            found = la.dropped_quadrature
            got = measure(la)
            error = ((got["var"] - exact["var"]).abs() / exact["var"]).median()
            records["ranks"].setdefault(str(rank), {})[residual] = {
                "kept_fraction": float(la.kept_fraction), "fit_s": seconds,
                "quadrature_s": 0.0 if found is None else found.seconds,
                "steps": la.fit_report.quadrature_steps, "prior": got["prior"],
                "fvar_error": float(error), "nll": got["nll"]}
    print("digits", json.dumps(records), flush=True)
    return records


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="mnist_aug_early")
    parser.add_argument("--ranks", default="100", help="comma-separated ranks")
    parser.add_argument("--references", type=Path, default=faithful.REFERENCES)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quadrature"))
    parser.add_argument("--digits", action="store_true",
                        help="instead: the digits MLP over ranks, measured and flat")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.out / "quadrature.json"
    result = json.loads(path.read_text()) if path.exists() else {"problems": {}}
    if args.digits:
        result["digits"] = digits_study()
    for name in [] if args.digits else args.problems.split(","):
        for rank in (int(r) for r in args.ranks.split(",")):
            key = "held_out" + ("" if rank == 100 else f" r={rank}")
            result["problems"].setdefault(name, {})[key] = run_problem(name, rank, args.references)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
