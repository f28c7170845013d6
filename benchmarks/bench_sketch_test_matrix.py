"""Kept trace of the sketch solver with Khatri-Rao against fully Gaussian test matrices.

The exact-GGN sketch with either test matrix (``"kronecker"``, the default, or
``"gaussian"``, set by ``_worker.set_tuning``) over several seeds, and the streaming fit,
on the problems of ``bench_laplace.py``: kept trace, leading and last kept eigenvalues,
one worker per fit::

    python -m benchmarks.bench_sketch_test_matrix --out benchmarks/results/sketch_test_matrix

writes ``sketch_test_matrix.json`` with date, machine and versions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import _harness
from benchmarks._problems import make_laplace_problem
from benchmarks._report import machine_info, progress_line
from benchmarks._worker import run_phases, set_tuning, worker_setup

#: problem -> (training points, batch size, rank), as in bench_laplace.py's runs
SETTINGS = {"mlp": (1024, 128, 100), "digits": (1400, 64, 100),
            "3c3d": (1024, 128, 100), "2c2d": (1024, 128, 100)}
#: The sketch's test matrices.
KINDS = ("kronecker", "gaussian")


def worker_main(config: dict[str, Any]):
    """One exact-GGN fit (phase ``fit``): its kept trace and eigenvalues."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)

    setup = worker_setup(config)
    n_train, batch, rank = config["n_train"], config["batch_size"], config["rank"]
    model, _, X, y = make_laplace_problem(config["problem"], n_train, n_train, seed=0)
    loader = DataLoader(TensorDataset(X, y), batch_size=batch)
    kwargs = {} if config["solver"] == "streaming" else \
        set_tuning("sketch_test_matrix", config["kind"], rank)

    def fit():
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", rank=rank, solver=config["solver"],
                     seed=config["seed"], **kwargs)
        la.fit(loader)
        return la

    def kept(la) -> dict[str, Any]:
        lam = la.H[1]
        return {"kept_fraction": float(la.kept_fraction), "lambda_1": float(lam[0]),
                "lambda_r": float(lam[-1]), "fit_path": la.fit_path}

    run_phases(setup, [("fit", fit, kept)], config)


def driver_main(args) -> dict:
    """Run every problem, test matrix and seed; write and return the results."""
    results = {}
    for name in args.problems:
        n_train, batch, rank = args.sizes or SETTINGS[name]
        configs = [("streaming", "streaming", 0)] + [
            (kind, "sketch", seed) for kind in KINDS for seed in range(args.seeds)]
        runs: dict[str, list] = {"streaming": [], **{kind: [] for kind in KINDS}}
        for kind, solver, seed in configs:
            record = _harness.run_config("benchmarks.bench_sketch_test_matrix", {
                "problem": name, "kind": kind, "solver": solver, "seed": seed,
                "n_train": n_train, "batch_size": batch, "rank": rank,
                "threads": args.threads, "phases": ["fit"]}, args)
            print(progress_line(f"{name}/{kind}/{seed}", record), flush=True)
            fit = record["phases"]["fit"]
            runs[kind].append({key: fit.get(key) for key in (
                "kept_fraction", "lambda_1", "lambda_r", "fit_path", "status", "reason")
                if fit.get(key) is not None} | {"fit_s": fit.get("time_s")})
        results[name] = {"n_train": n_train, "batch_size": batch, "rank": rank, "runs": runs}
        mean = {k: torch.tensor([r["kept_fraction"] for r in v if "kept_fraction" in r]
                                or [float("nan")]).mean().item() for k, v in runs.items()}
        print(f"{name}: kept trace streaming {mean['streaming']:.4f}, sketch Khatri-Rao "
              f"{mean['kronecker']:.4f}, Gaussian {mean['gaussian']:.4f} "
              f"(mean of {args.seeds} seeds)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"seeds": args.seeds, "machine": machine_info("cpu"), "problems": results}
    (out / "sketch_test_matrix.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'sketch_test_matrix.json'}")
    return payload


def parse_args(argv: Sequence[str] | None = None):
    """Parse command line arguments."""
    parser = _harness.script_parser(__doc__, "threads", "timeout", "blas_threads",
                                    "omp_wait_policy", "out",
                                    out="benchmarks/results/sketch_test_matrix")
    parser.add_argument("--problems", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: mlp, 64 points in batches of 32, rank 5, one seed.")
    args = parser.parse_args(argv)
    args.sizes = (64, 32, 5) if args.quick else None
    if args.quick:
        args.problems, args.seeds = ["mlp"], 1
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
