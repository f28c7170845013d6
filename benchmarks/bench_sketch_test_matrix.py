"""Kept trace of the sketch solver with Khatri-Rao against fully Gaussian test matrices.

``solver="sketch"`` draws Khatri-Rao columns ``p_k (x) q_k`` in the slices of
matrix-shaped weights by default (the option ``sketch_test_matrix="kronecker"``). This
script fits the exact-GGN sketch with both kinds of test matrix over several seeds on the
problems of ``bench_laplace.py`` (the MLP, 3c3d and 2c2d on random data, the trained
sklearn digits MLP) and records the kept trace, the leading and the
last kept eigenvalues, and, for reference, the streaming fit's. Quality is the point,
not time: one process runs everything (the fit times are recorded but not comparable
to ``bench_laplace.py``'s).

    python -m benchmarks.bench_sketch_test_matrix --out benchmarks/results/sketch_test_matrix

writes ``sketch_test_matrix.json`` with date, machine and versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

import lowrank_laplace  # noqa: F401  (registers lowrank_ggn)
from benchmarks._harness import machine_info
from benchmarks._laplace_worker import make_problem

#: problem -> (training points, batch size, rank), as in bench_laplace.py's runs
SETTINGS = {"mlp": (1024, 128, 100), "digits": (1400, 64, 100),
            "3c3d": (1024, 128, 100), "2c2d": (1024, 128, 100)}


def fit(model, loader, rank: int, solver: str, seed: int,
        test_matrix: str = "kronecker") -> dict:
    """One exact-GGN fit; its kept trace, eigenvalues and time."""
    la = Laplace(model, "classification", subset_of_weights="all",
                 hessian_structure="lowrank_ggn", rank=rank, solver=solver, seed=seed,
                 sketch_test_matrix=test_matrix)
    start = time.perf_counter()
    la.fit(loader)
    seconds = time.perf_counter() - start
    lam = la.H[1]
    return {"kept_fraction": float(la.kept_fraction), "lambda_1": float(lam[0]),
            "lambda_r": float(lam[-1]), "fit_path": la.fit_path, "fit_s": seconds}


def main(argv=None) -> dict:
    """Run every problem, test matrix and seed; write and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/sketch_test_matrix")
    args = parser.parse_args(argv)
    results = {}
    for name in args.problems:
        n_train, batch, rank = SETTINGS[name]
        model, _, X, y = make_problem(name, n_train, n_train, seed=0)
        loader = DataLoader(TensorDataset(X, y), batch_size=batch)
        runs = {"streaming": [fit(model, loader, rank, "streaming", 0)]}
        for kind in ("kronecker", "gaussian"):
            runs[kind] = [fit(model, loader, rank, "sketch", seed, kind)
                          for seed in range(args.seeds)]
        results[name] = {"n_train": n_train, "batch_size": batch, "rank": rank, "runs": runs}
        mean = {k: sum(r["kept_fraction"] for r in v) / len(v) for k, v in runs.items()}
        print(f"{name}: kept trace streaming {mean['streaming']:.4f}, sketch Khatri-Rao "
              f"{mean['kronecker']:.4f}, Gaussian {mean['gaussian']:.4f} "
              f"(mean of {args.seeds} seeds)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"seeds": args.seeds, "machine": machine_info("cpu"), "problems": results}
    (out / "sketch_test_matrix.json").write_text(json.dumps(payload, indent=2))
    print(f"wrote {out / 'sketch_test_matrix.json'}")
    return payload


if __name__ == "__main__":
    main()
