"""Data-parallel fit: 1 process vs P processes (torch.distributed, gloo on CPU).

Every configuration (GGN, ``P``) is a fresh worker that spawns ``P`` processes in a gloo
group, each fitting ``lowrank_ggn`` on the shard ``rank::P`` on ``cores / P`` threads
(the fit merges across ranks), timed between two barriers; the eigenvalues are compared
with the single process's::

    python -m benchmarks.bench_scaling --problem 3c3d --processes 1 2

Writes ``<out>/scaling_<problem>.json`` and ``<out>/scaling_<problem>.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmarks import _harness, _problems, _worker
from benchmarks._report import failure_text, figure, machine_info


def _worker_fit(rank: int, world: int, port: int, out: str, config: dict[str, Any]) -> None:
    import torch.distributed as dist
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401 - registers the structure

    torch.set_num_threads(max(1, config["cores"] // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, _, X, y = _problems.make_problem(config["problem"], config["n_train"],
                                                seed=config["seed"])
        shard = TensorDataset(X[rank::world], y[rank::world])
        loader = DataLoader(shard, batch_size=config["batch_size"])
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", rank=config["rank"],
                     mc_samples=config["mc"])
        dist.barrier()
        start = time.perf_counter()
        la.fit(loader)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            torch.save({"seconds": seconds, "eigenvalues": la.H[1], "n_data": la.n_data,
                        "trace": la.trace}, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_main(config: dict[str, Any]) -> None:
    """Fit with ``world`` processes (phase ``fit``; its own time is ``seconds``)."""
    import torch.multiprocessing as mp

    setup = _worker.worker_setup({**config, "threads": None})

    def run() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.pt")
            mp.spawn(_worker_fit, args=(config["world"], _free_port(), out, config),
                     nprocs=config["world"], join=True)
            return torch.load(out)

    def result(r: dict[str, Any]) -> dict[str, Any]:
        return {"seconds": r["seconds"], "eigenvalues": r["eigenvalues"].double().tolist(),
                "n_data": int(r["n_data"]), "trace": float(r["trace"])}

    _worker.run_phases(setup, [("fit", run, result)], config)


def plot(records: Sequence[dict], path: Path, title: str) -> None:
    """Fit time and speed-up against the number of processes."""
    with figure(path, figsize=(5, 3.5)) as (_, ax):
        for label in sorted({r["label"] for r in records}):
            rows = [r for r in records if r["label"] == label]
            ax.plot([r["processes"] for r in rows], [r["seconds"] for r in rows], "o-",
                    label=label)
        ax.set_xlabel("processes (cores split evenly)")
        ax.set_ylabel("fit time [s]")
        ax.set_xticks(sorted({r["processes"] for r in records}))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)


def driver_main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run every process count for exact and MC, write JSON, PNG and a table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for mc in args.mc_samples:
        label, base = "exact" if mc == 0 else f"MC({mc})", None
        for world in args.processes:
            run = _harness.run_worker("benchmarks.bench_scaling", {
                "problem": args.problem, "n_train": args.n_train, "mc": mc, "world": world,
                "batch_size": args.batch_size, "rank": args.rank, "cores": args.cores,
                "seed": args.seed, "phases": ["fit"]}, args)
            result = run["phases"]["fit"]
            if result.get("status") != "ok":
                print(f"  {label:<6} P={world}: {failure_text(run)}", flush=True)
                continue
            lam = torch.tensor(result["eigenvalues"])
            base = base or {"seconds": result["seconds"], "eigenvalues": lam}
            k = min(lam.numel(), base["eigenvalues"].numel())
            dev = (lam[:k] - base["eigenvalues"][:k]).abs() / base["eigenvalues"][:k]
            rel, rel10 = float(dev.max()), float(dev[:10].max())
            records.append({"label": label, "mc_samples": mc, "processes": world,
                            "threads_per_process": max(1, args.cores // world),
                            "seconds": result["seconds"],
                            "speedup": base["seconds"] / result["seconds"],
                            "eigenvalue_rel_diff_vs_1": rel,
                            "top10_eigenvalue_rel_diff_vs_1": rel10, "n_data": result["n_data"],
                            "other_cpu_percent_during": run.get("other_cpu_percent_during")})
            print(f"  {label:<6} P={world}: fit {result['seconds']:.2f} s, speed-up "
                  f"{records[-1]['speedup']:.2f}x, eigenvalues vs P=1: top 10 {rel10:.1e}, "
                  f"all {rel:.1e}", flush=True)
    payload = {"problem": args.problem, "n_train": args.n_train, "batch_size": args.batch_size,
               "rank": args.rank, "cores": args.cores, "torch": torch.__version__,
               "machine": machine_info("cpu"), "records": records}
    (out / f"scaling_{args.problem}.json").write_text(json.dumps(payload, indent=1))
    plot(records, out / f"scaling_{args.problem}.png",
         f"{args.problem}: lowrank_ggn fit, {args.n_train} points, {args.cores} cores")
    print("| GGN | processes | threads each | fit [s] | speed-up | top-10 / all eigenvalues vs 1 |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['label']} | {r['processes']} | {r['threads_per_process']} | "
              f"{r['seconds']:.2f} | {r['speedup']:.2f}x | "
              f"{r['top10_eigenvalue_rel_diff_vs_1']:.1e} / {r['eigenvalue_rel_diff_vs_1']:.1e} |")
    return records


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments."""
    parser = _harness.script_parser(__doc__, "seed", "out", "timeout", "blas_threads",
                                    "omp_wait_policy", out=str(_harness.RESULTS_DIR),
                                    timeout=3600.0)
    parser.add_argument("--problem", default="3c3d", choices=_problems.PROBLEMS)
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--mc-samples", nargs="+", type=int, default=[0, 1],
                        help="0 for the exact GGN.")
    parser.add_argument("--n-train", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128, help="Per process.")
    parser.add_argument("--rank", type=int, default=100)
    parser.add_argument("--cores", type=int, default=_worker.num_cores())
    return parser.parse_args(argv)


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
