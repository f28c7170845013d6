"""``la.refine_complement`` (Lanczos quadrature) against the exact full-GGN posterior.

On ``bench_faithful``'s cached exact references (``--cache``): the default fit at rank
100 with its marglik prior, then ``la.refine_complement(train_loader)``; both posteriors'
functional variance against the exact one's, at their own marglik prior and at the exact
one (``docs/posterior_quality.md``, "Lanczos quadrature of the dropped curvature", was
measured at commit b321eca)::

    python -m benchmarks.bench_quadrature --problems mnist_aug_early --cache CACHE
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from benchmarks import _faithful_report as report
from benchmarks import bench_faithful as faithful
from benchmarks._faithful_problems import build_model, make_data


def errors(fitted, model, data, ref) -> dict:
    """Median f-var errors (own / exact prior), NLL and the complement ratio per test set."""
    la = fitted.la
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(method="marglik", n_steps=faithful.MARGLIK_STEPS, lr=0.1)
    v = la.residual_model.complement_variance(torch.tensor(1.0), torch.tensor(ref["delta"]))
    fitted.record.update(measured_v_at_exact_prior=float(v), sets={})
    faithful.evaluate([fitted], model, data, ref)
    out = {"prior": float(la.prior_precision.reshape(-1)[0]), "v_at_exact_prior": float(v)}
    for name, metrics in fitted.record["sets"].items():
        out[name] = {"fvar_error": metrics["fvar_error"]["median"],
                     "fvar_error_at_exact_prior": metrics["fvar_error_at_exact_prior"]["median"],
                     "nll": metrics["nll"],
                     "complement_ratio": metrics.get("complement_ratio_median")}
    return out


def run_problem(name: str, cache: Path) -> dict:
    """The default fit, then its refined complement, on one cached problem."""
    ref = torch.load(cache / f"{name}.pt", weights_only=False)
    problem = faithful.PROBLEMS[name]
    data = make_data(problem)
    model = build_model(problem, data.features).double()
    model.load_state_dict(ref["state"])
    model.eval()
    fitted = faithful.fit_method("default", 100, model, data.fit, faithful.MARGLIK_STEPS)
    exact = {k: s["exact"]["nll"] for k, s in report.exact_sets(ref, data).items()}
    record = {"exact_prior": ref["delta"], "fit_s": fitted.record["fit_s"], "exact_nll": exact,
              "commit": (faithful.git("rev-parse", "--short", "HEAD") or "unknown").strip()}
    record["default"] = errors(fitted, model, data, ref)
    start = time.perf_counter()
    fitted.la.refine_complement(faithful.loader(*data.fit))
    record["refine_s"] = time.perf_counter() - start
    record["refine_steps"] = fitted.la.fit_report.quadrature_steps
    record["refine_converged"] = fitted.la.fit_report.quadrature_converged
    fitted.la.prior_precision = 1.0
    record["refined"] = errors(fitted, model, data, ref)
    print(name, json.dumps(record), flush=True)
    return record


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", default="mnist_aug_early")
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/quadrature"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.out / "quadrature.json"
    result = json.loads(path.read_text()) if path.exists() else {"problems": {}}
    for name in args.problems.split(","):
        result["problems"].setdefault(name, {})["refine_complement"] = run_problem(
            name, args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
