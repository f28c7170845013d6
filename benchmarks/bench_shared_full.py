"""The exact GGN posterior on ``bench_shared``'s digits MLP: is the default's test NLL its own?

Fits laplace-torch's ``FullLaplace``, the default ``lowrank_ggn`` and ``kron`` to the
digits MLP of ``bench_shared`` (D = 6,310, 1,400 training images, 397 test images), and
compares the GLM probit predictive's test NLL and the log marginal likelihood at equal
prior precisions, then at each one's marglik-tuned prior. One process, about 4 minutes on
2 CPU cores (``FullLaplace``'s prior tuning is most of it)::

    python -m benchmarks.bench_shared_full --out docs/benchmarks/shared_cost

Writes ``<out>/full_reference.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers hessian_structure="lowrank_ggn")
from benchmarks._problems import make_digits

STRUCTURES = ("full", "lowrank_ggn", "kron")
#: The default's and kron's marglik priors in ``bench_shared``, and a larger one.
PRIORS = (0.627, 1.16, 5.0)


def _nll(la, X, y) -> float:
    probs = la(X, pred_type="glm", link_approx="probit")
    return float(torch.nn.functional.nll_loss(probs.clamp_min(1e-12).log(), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks/shared_cost")
    parser.add_argument("--full-steps", type=int, default=30,
                        help="Prior steps of FullLaplace's marglik tuning.")
    args = parser.parse_args()
    model, _, X, y = make_digits(1797, 1400, seed=0)
    loader = DataLoader(TensorDataset(X[:1400], y[:1400]), batch_size=128)
    test_X, test_y = X[1400:], y[1400:]
    fitted, record = {}, {"fit_s": {}, "at_prior": [], "tuned": {}}
    for structure in STRUCTURES:
        start = time.perf_counter()
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure=structure)
        la.fit(loader)
        record["fit_s"][structure] = time.perf_counter() - start
        fitted[structure] = la
    for prior in PRIORS:
        row = {"prior_precision": prior}
        for structure, la in fitted.items():
            la.prior_precision = prior
            row[structure] = {"test_nll": _nll(la, test_X, test_y),
                              "log_marglik": float(la.log_marginal_likelihood())}
        record["at_prior"].append(row)
        print(json.dumps(row), flush=True)
    for structure, la in fitted.items():
        start = time.perf_counter()
        steps = args.full_steps if structure == "full" else 100
        la.optimize_prior_precision(method="marglik", n_steps=steps)
        record["tuned"][structure] = {
            "prior_precision": float(la.prior_precision), "test_nll": _nll(la, test_X, test_y),
            "tune_s": time.perf_counter() - start}
    full_prior = record["tuned"]["full"]["prior_precision"]
    fitted["lowrank_ggn"].prior_precision = full_prior
    record["lowrank_ggn_at_full_prior_nll"] = _nll(fitted["lowrank_ggn"], test_X, test_y)
    print(json.dumps(record["tuned"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "full_reference.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"Wrote {out / 'full_reference.json'}")


if __name__ == "__main__":
    main()
