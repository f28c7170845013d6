"""Data-parallel fit: 1 process vs P processes (torch.distributed, gloo on CPU).

Every configuration starts fresh processes (``torch.multiprocessing.spawn``) that
join a gloo group on 127.0.0.1, build the same model, take the shard ``rank::P`` of
the same random training set (``--n-train`` points) and fit ``lowrank_ggn`` on it
(``LowRankGGNLaplace.fit`` merges the local factors across ranks at the end). The
cores are split evenly between the processes (``torch.set_num_threads``), so on a
machine with ``c`` cores the comparison is ``c`` threads in one process against
``c / P`` threads in each of ``P`` processes: the speed-up shows how well streaming
plus one all-gather merge parallelises, not extra hardware. Each fit is timed between
two barriers (the slowest rank counts); the result of every ``P`` is compared with
the single process (eigenvalues, relative) and recorded.

Example::

    python -m benchmarks.bench_scaling --problem 3c3d --processes 1 2

Results go to ``<out>/scaling_<problem>.json`` and ``<out>/scaling_<problem>.png``.
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

from benchmarks import _harness, _problems


def _worker(rank: int, world: int, port: int, out: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import lowrank_laplace  # noqa: F401 - registers the structure

    torch.set_num_threads(max(1, args.cores // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        model, _, X, y = _problems.make_problem(args.problem, args.n_train, seed=args.seed)
        shard = TensorDataset(X[rank::world], y[rank::world])
        loader = DataLoader(shard, batch_size=args.batch_size)
        la = Laplace(model, "classification", subset_of_weights="all",
                     hessian_structure="lowrank_ggn", rank=args.rank, mc_samples=args.mc)
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


def run(world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Fit with ``world`` processes; returns the time and rank 0's result."""
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_worker, args=(world, _free_port(), out, args), nprocs=world, join=True)
        return torch.load(out)


def plot(records: Sequence[dict], path: Path, title: str) -> None:
    """Fit time and speed-up against the number of processes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label in sorted({r["label"] for r in records}):
        rows = [r for r in records if r["label"] == label]
        ax.plot([r["processes"] for r in rows], [r["seconds"] for r in rows], "o-",
                label=label)
    ax.set_xlabel("processes (cores split evenly)")
    ax.set_ylabel("fit time [s]")
    ax.set_xticks(sorted({r["processes"] for r in records}))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> None:
    """Run every process count for exact and MC, write JSON, PNG and a table."""
    import torch

    os.environ.update(_harness.worker_env(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for mc in args.mc_samples:
        label = "exact" if mc == 0 else f"MC({mc})"
        base = None
        for world in args.processes:
            args.mc = mc
            result = run(world, args)
            lam = result["eigenvalues"].double()
            base = base or {"seconds": result["seconds"], "eigenvalues": lam}
            k = min(lam.numel(), base["eigenvalues"].numel())
            dev = (lam[:k] - base["eigenvalues"][:k]).abs() / base["eigenvalues"][:k]
            rel, rel10 = float(dev.max()), float(dev[:10].max())
            records.append({"label": label, "mc_samples": mc, "processes": world,
                            "threads_per_process": max(1, args.cores // world),
                            "seconds": result["seconds"],
                            "speedup": base["seconds"] / result["seconds"],
                            "eigenvalue_rel_diff_vs_1": rel,
                            "top10_eigenvalue_rel_diff_vs_1": rel10, "n_data": result["n_data"]})
            print(f"  {label:<6} P={world}: fit {result['seconds']:.2f} s, speed-up "
                  f"{records[-1]['speedup']:.2f}x, eigenvalues vs P=1: top 10 {rel10:.1e}, "
                  f"all {rel:.1e}", flush=True)
    payload = {"problem": args.problem, "n_train": args.n_train, "batch_size": args.batch_size,
               "rank": args.rank, "cores": args.cores, "torch": torch.__version__,
               "machine": _harness.machine_info("cpu"), "records": records}
    (out / f"scaling_{args.problem}.json").write_text(json.dumps(payload, indent=1))
    plot(records, out / f"scaling_{args.problem}.png",
         f"{args.problem}: lowrank_ggn fit, {args.n_train} points, {args.cores} cores")
    print("| GGN | processes | threads each | fit [s] | speed-up | top-10 / all eigenvalues vs 1 |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['label']} | {r['processes']} | {r['threads_per_process']} | "
              f"{r['seconds']:.2f} | {r['speedup']:.2f}x | "
              f"{r['top10_eigenvalue_rel_diff_vs_1']:.1e} / {r['eigenvalue_rel_diff_vs_1']:.1e} |")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", default="3c3d", choices=_problems.PROBLEMS)
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--mc-samples", nargs="+", type=int, default=[0, 1],
                        help="0 for the exact GGN.")
    parser.add_argument("--n-train", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=128, help="Per process.")
    parser.add_argument("--rank", type=int, default=100)
    parser.add_argument("--cores", type=int, default=_harness.num_cores())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(_harness.RESULTS_DIR))
    _harness.add_worker_env_arguments(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
