"""Posterior quality of the truncated lowrank_ggn posterior against the full GGN's.

On small real problems where laplace-torch's ``FullLaplace`` fits, every residual model of
``lowrank_ggn`` at several ranks, each prior tuned by the marginal likelihood: test
metrics of the GLM predictive next to the full posterior's, ``kron``'s, ``diag``'s and
the MAP network's (trained under Laplace's Gaussian prior); one worker per problem.

    python -m benchmarks.bench_posterior_quality --out benchmarks/results/quality

writes ``posterior_quality.json`` (with date, machine and versions) and
``posterior_quality.png`` (NLL and prior-precision ratio against rank per problem).
Where the run holds the library's default posterior (``--residuals spectral --ranks
default`` runs only it and the peers), it also checks :data:`TARGETS`: the default's and
``kron``'s test NLL and prior precision against the full GGN's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)
from benchmarks._harness import run_results, script_main, script_parser
from benchmarks._report import figure, machine_info
from benchmarks._worker import default_dtype, run_result
from lowrank_laplace.laplace_torch.options import LowRankOptions
from lowrank_laplace.toolkit import metrics

RESIDUALS = ("spectral", "isotropic", "diagonal", "none")
#: The library's default posterior: ``Laplace(..., hessian_structure="lowrank_ggn")``'s options.
DEFAULT = LowRankOptions()
#: Names ``--ranks`` accepts besides integers.
RANK_NAMES = {"default": DEFAULT.rank}
#: Targets against the full GGN's posterior: metric -> largest ``|ratio - 1|``.
TARGETS = {"nll": 0.05, "prior_precision": 0.25}


def standardized(a):
    """Zero mean and unit variance per column."""
    return (a - a.mean(0)) / a.std(0)


#: sklearn's offline data sets: name -> (loader, likelihood, hidden widths, input scaling);
#: regression targets are standardized.
PROBLEMS = {
    "digits": ("load_digits", "classification", [50], lambda X: X / 16.0),
    "breast_cancer": ("load_breast_cancer", "classification", [50], standardized),
    "wine": ("load_wine", "classification", [50], standardized),
    "diabetes": ("load_diabetes", "regression", [50, 50], standardized),
}


def problem(name: str):
    """``(X_train, y_train, X_test, y_test, likelihood, hidden)`` of an offline data set."""
    from sklearn import datasets as skd

    loader, likelihood, hidden, scale = PROBLEMS[name]
    data = getattr(skd, loader)()
    X, y = scale(data.data), data.target
    if likelihood == "regression":
        y = standardized(y)
    X = torch.tensor(X, dtype=torch.float64)
    y = torch.tensor(y)
    y = y.long() if likelihood == "classification" else y[:, None].double()
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))
    cut = int(0.75 * len(X))
    return X[perm[:cut]], y[perm[:cut]], X[perm[cut:]], y[perm[cut:]], likelihood, hidden


def train_map(X, y, likelihood, hidden, epochs: int, weight_decay: float = 1.0) -> nn.Module:
    """An MLP trained to the MAP under a Gaussian prior of precision ``weight_decay``."""
    torch.manual_seed(0)
    out = int(y.max()) + 1 if likelihood == "classification" else 1
    dims = [X.shape[1]] + hidden + [out]
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1]).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n = len(X)
    for _ in range(epochs):
        for idx in torch.randperm(n).split(64):
            opt.zero_grad()
            f = model(X[idx])
            if likelihood == "classification":
                loss = nn.functional.cross_entropy(f, y[idx])
            else:
                loss = 0.5 * ((f - y[idx]) ** 2).mean()
            decay = weight_decay / (2 * n) * sum((p**2).sum() for p in model.parameters())
            (loss + decay).backward()
            opt.step()
    return model.eval()


def scores(la, model, X, y, likelihood, sigma: float) -> dict:
    """Test metrics of the GLM predictive (``la=None``: the MAP network)."""
    with torch.no_grad():
        if likelihood == "classification":
            probs = torch.softmax(model(X), -1) if la is None else la(X, link_approx="probit")
            m = metrics.classification_metrics(probs.float(), y)
            return {k: m[k] for k in ("nll", "ece", "brier", "accuracy")}
        if la is None:
            mu, var = model(X), torch.zeros_like(y)
        else:
            mu, var = la(X)
            var = var.reshape(mu.shape)
        var = var + sigma**2
        nll = 0.5 * (torch.log(2 * math.pi * var) + (y - mu) ** 2 / var).mean()
        return {"nll": float(nll), "rmse": float(((y - mu) ** 2).mean().sqrt())}


def tuned(la) -> float:
    """Scalar marglik prior precision (laplace-torch's Adam on log delta, 300 steps)."""
    if la.__class__.__name__ == "FullLaplace":
        return tuned_full(la)
    la.optimize_prior_precision(method="marglik", n_steps=300, lr=0.1)
    return float(la.prior_precision)


def tuned_full(la) -> float:
    """The same objective for the dense GGN from its eigenvalues ``lambda``, computed once
    (``FullLaplace`` re-factors the precision every step): ``log det = sum log(h lambda +
    delta)``, so 300 steps cost ``O(300 D)``."""
    lam = torch.linalg.eigvalsh(la.H).clamp(min=0) * la._H_factor
    sq = float(((la.mean - la.prior_mean) ** 2).sum())
    D = lam.numel()
    log_delta = torch.zeros((), dtype=lam.dtype, requires_grad=True)
    opt = torch.optim.Adam([log_delta], lr=0.1)
    for _ in range(300):
        opt.zero_grad()
        delta = log_delta.exp()
        # -(marglik) up to constants: 0.5 (log det(H + delta) - D log delta + delta |theta|^2)
        loss = 0.5 * (torch.log(lam + delta).sum() - D * log_delta + delta * sq)
        loss.backward()
        opt.step()
    la.prior_precision = float(log_delta.exp())
    return float(la.prior_precision)


def run_problem(name: str, ranks, epochs: int, residuals=RESIDUALS) -> dict:
    X, y, Xt, yt, likelihood, hidden = problem(name)
    model = train_map(X, y, likelihood, hidden, epochs)
    loader = DataLoader(TensorDataset(X, y), batch_size=128)
    sigma = 1.0
    if likelihood == "regression":
        with torch.no_grad():
            sigma = float(((model(X) - y) ** 2).mean().sqrt())
    D = sum(p.numel() for p in model.parameters())
    record = {"D": D, "n_train": len(X), "n_test": len(Xt), "likelihood": likelihood,
              "sigma_noise": sigma, "map": scores(None, model, Xt, y=yt, likelihood=likelihood,
                                                  sigma=sigma), "peers": {}, "lowrank": []}
    with default_dtype(torch.float64):  # laplace-torch's curvlinops builds eye() in it
        from laplace.curvature import BackPackGGN  # curvlinops' dense GGN is D matvecs

        for structure in ("full", "kron", "diag"):
            la = Laplace(model, likelihood, subset_of_weights="all", hessian_structure=structure,
                         sigma_noise=sigma, backend=BackPackGGN)
            la.fit(loader)
            prior = tuned(la)
            record["peers"][structure] = {"prior_precision": prior,
                                          **scores(la, model, Xt, yt, likelihood, sigma)}
    full_prior = record["peers"]["full"]["prior_precision"]
    for rank in ranks:
        shared = None
        for residual in residuals:
            if residual == "diagonal" or shared is None:
                la = Laplace(model, likelihood, subset_of_weights="all",
                             hessian_structure="lowrank_ggn", sigma_noise=sigma, rank=rank,
                             residual=residual)
                la.fit(loader)
                if residual != "diagonal":
                    shared = la
            else:
                la = shared
                la.residual = residual
            prior = tuned(la)
            record["lowrank"].append({
                "rank": rank, "residual": residual, "kept_fraction": float(la.kept_fraction),
                "quadrature_steps": la.fit_report.quadrature_steps,
                "prior_precision": prior, "prior_ratio": prior / full_prior,
                **scores(la, model, Xt, yt, likelihood, sigma)})
        print(f"{name}: rank {rank} done", flush=True)
    return record


def checks(rec: dict) -> dict:
    """The default posterior's and ``kron``'s ratios to the full GGN's in each metric of
    :data:`TARGETS` and whether they are within it (no ``default``: not run)."""
    full = rec["peers"]["full"]
    default = next((r for r in rec["lowrank"] if r["rank"] == DEFAULT.rank
                    and r["residual"] == DEFAULT.residual), None)
    out = {}
    for name, r in (("default", default), ("kron", rec["peers"]["kron"])):
        if r is not None:
            ratios = {metric: r[metric] / full[metric] for metric in TARGETS}
            out[name] = {metric: {"ratio": ratio, "met": abs(ratio - 1) <= TARGETS[metric]}
                         for metric, ratio in ratios.items()}
    if default is not None:
        out["default"]["kept_fraction"] = default["kept_fraction"]
    return out


def plot(report: dict, path: Path) -> None:
    """Test NLL and the marglik prior against the full GGN's, per rank and residual (grey:
    the :data:`TARGETS` bands)."""
    names = list(report["problems"])
    with figure(path, 2, len(names), dpi=110, figsize=(4.6 * len(names), 7),
                squeeze=False) as (_, axes):
        for col, name in enumerate(names):
            rec = report["problems"][name]
            for residual in report["residuals"]:
                rows = [r for r in rec["lowrank"] if r["residual"] == residual]
                ranks = [r["rank"] for r in rows]
                axes[0, col].plot(ranks, [r["nll"] for r in rows], "o-", label=residual)
                axes[1, col].plot(ranks, [r["prior_ratio"] for r in rows], "o-",
                                  label=residual)
            for label, value, style in (("full GGN", rec["peers"]["full"]["nll"], "k--"),
                                        ("kron", rec["peers"]["kron"]["nll"], "k:"),
                                        ("diag", rec["peers"]["diag"]["nll"], "k-."),
                                        ("MAP", rec["map"]["nll"], "r:")):
                axes[0, col].axhline(value, color=style[0], linestyle=style[1:], label=label,
                                     linewidth=1)
            full = rec["peers"]["full"]
            for row, (metric, at) in enumerate((("nll", full["nll"]), ("prior_precision", 1))):
                bound = TARGETS[metric]  # the target's band around the full GGN
                axes[row, col].axhspan(at * (1 - bound), at * (1 + bound), color="0.9")
            kron = rec["peers"]["kron"]["prior_precision"] / full["prior_precision"]
            axes[1, col].axhline(1.0, color="k", linestyle="--", linewidth=1, label="full GGN")
            axes[1, col].axhline(kron, color="k", linestyle=":", linewidth=1, label="kron")
            for row in range(2):
                axes[row, col].set_xscale("log")
                axes[row, col].set_xlabel("Rank")
            axes[0, col].set_title(f"{name} (D = {rec['D']:,})")
            axes[0, col].set_ylabel("Test NLL")
            axes[1, col].set_ylabel("Marglik prior / full GGN's")
            axes[1, col].set_yscale("log")
        axes[0, -1].legend(fontsize=8)
        axes[1, -1].legend(fontsize=8)


def driver_main(args: argparse.Namespace) -> dict:
    """Run every problem in its own worker; write the report and its figure."""
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    ranks = [int(RANK_NAMES.get(r, r)) for r in args.ranks.split(",")]
    residuals = args.residuals.split(",")
    report = {"machine": machine_info("cpu"), "ranks": ranks, "residuals": residuals,
              "default": {"rank": DEFAULT.rank, "residual": DEFAULT.residual},
              "targets": TARGETS, "problems": run_results(
                  "benchmarks.bench_posterior_quality",
                  {name: {"problem": name, "ranks": ranks, "residuals": residuals,
                          "epochs": args.epochs, "threads": args.threads}
                   for name in args.problems.split(",")}, args)}
    done = {name: rec for name, rec in report["problems"].items() if "lowrank" in rec}
    report["checks"] = {name: checks(rec) for name, rec in done.items()}
    (args.out / "posterior_quality.json").write_text(json.dumps(report, indent=2))
    if done:
        plot({**report, "problems": done}, args.out / "posterior_quality.png")
    for name, rec in done.items():
        full = rec["peers"]["full"]
        print(f"\n{name} (D={rec['D']}): MAP NLL {rec['map']['nll']:.4f}; full GGN NLL "
              f"{full['nll']:.4f}, prior {full['prior_precision']:.3g}; kron NLL "
              f"{rec['peers']['kron']['nll']:.4f}")
        for r in rec["lowrank"]:
            print(f"  rank {r['rank']:>4} {r['residual']:<10} kept {r['kept_fraction']:.3f} "
                  f"NLL {r['nll']:.4f} ({r['nll'] / full['nll'] - 1:+.1%}) "
                  f"prior x{r['prior_ratio']:.2f}")
    print(f"\nAgainst the full GGN (targets: |ratio - 1| <= "
          f"{', '.join(f'{v:.0%} in {k}' for k, v in TARGETS.items())}):")
    for name, check in report["checks"].items():
        for posterior, c in check.items():
            print(f"  {name:<14} {posterior:<8}" + "".join(
                f" {metric} x{c[metric]['ratio']:.3f} ({'met' if c[metric]['met'] else 'NOT met'})"
                for metric in TARGETS))
    return report


def worker_main(config: dict) -> None:
    """One problem's posteriors (phase ``result``)."""
    run_result(config, lambda: run_problem(config["problem"], config["ranks"],
                                           config["epochs"],
                                           config.get("residuals", RESIDUALS)))


def parse_args(argv=None) -> argparse.Namespace:
    """Parse command line arguments."""
    parser = script_parser(__doc__, "threads", "timeout", "blas_threads", "omp_wait_policy",
                           "out", out="benchmarks/results/quality", threads=None,
                           timeout=14400.0)
    parser.add_argument("--problems", default="digits,breast_cancer,diabetes")
    parser.add_argument("--ranks", default="10,37,100,200,400",
                        help=f"Comma-separated ranks; 'default': the library's "
                        f"({DEFAULT.rank}).")
    parser.add_argument("--residuals", default=",".join(RESIDUALS),
                        help="Comma-separated residual models of lowrank_ggn.")
    parser.add_argument("--epochs", type=int, default=300)
    return parser.parse_args(argv)


main = script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
