"""Critical batch sizes N_crit: the largest mini-batch that fits a memory budget.

For each task (GGN eigenvalues, top eigenpair, damped Newton step; the last two also
with ``low_memory=True``), structure (whole network, per-layer blocks), GGN (exact, MC)
and curvature data (the mini-batch ``mb``, or its first eighth ``sub``), the batch size
grows and is bisected. A probe is a fresh worker that runs the task at ``N = 2``, caps
its memory at what it holds plus ``--budget-gib`` and runs it at ``N``. The ViViT
paper's values for the Newton step on ``3c3d`` (other machines) are printed beside ours.

Examples::

    python -m benchmarks.bench_ncrit --problem mlp --tasks eigvals --budget-gib 0.25
    python -m benchmarks.bench_ncrit --problem 3c3d --budget-gib 1

Writes ``<out>/ncrit_<problem>.json`` and ``<out>/ncrit_<problem>.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any, Sequence

from benchmarks import _harness, _problems, _worker
from benchmarks._report import figure, machine_info

TASKS = ("eigvals", "eigpair", "eigpair_lowmem", "newton", "newton_lowmem")
STRUCTURES = ("full", "blocks")
APPROXIMATIONS = ("exact", "mc")
DATA = ("mb", "sub")
SUBSAMPLE_FRACTION = 8  # "sub": curvature from N // 8 samples

#: ViViT paper, damped Newton step, DeepOBS 3c3d: (structure, device) -> approx -> (mb, sub)
PAPER_NEWTON_3C3D = {
    ("full", "GPU"): {"exact": (208, 727), "mc": (1055, 1816)},
    ("full", "CPU"): {"exact": (667, 2215), "mc": (3473, 5632)},
    ("blocks", "GPU"): {"exact": (349, 795), "mc": (1659, 2112)},
    ("blocks", "CPU"): {"exact": (1046, 2423), "mc": (4997, 6838)},
}


def run_task(task: str, structure: str, approx: str, data: str, problem: str, N: int,
             device: str = "cpu"):
    """A function that runs one configuration of the task (``structure`` ``"full"`` or
    ``"blocks"``, ``approx`` ``"exact"`` or ``"mc"``, ``data`` ``"mb"`` or ``"sub"``) on a
    random batch of size ``N``, built now."""
    import lowrank_laplace as ll

    model, loss_func, X, y = _problems.make_problem(problem, N, device=device)
    kwargs: dict[str, Any] = {"mc_samples": 1 if approx == "mc" else 0}
    if data == "sub":
        kwargs["subsampling"] = list(range(max(1, N // SUBSAMPLE_FRACTION)))
    if structure == "blocks":
        kwargs["param_groups"] = ll.layerwise_param_groups(model)

    def call():
        if task == "eigvals":
            return ll.ggn_eigvals(model, loss_func, X, y, **kwargs)
        if task == "eigpair":
            return ll.ggn_eigh(model, loss_func, X, y, top_k=1, **kwargs)
        if task == "eigpair_lowmem":
            return ll.ggn_eigh(model, loss_func, X, y, top_k=1, low_memory=True, **kwargs)
        low_memory = task == "newton_lowmem"
        return ll.damped_newton_step(model, loss_func, X, y, damping=1.0,
                                     low_memory=low_memory, **kwargs)

    return call


def worker_main(config: dict[str, Any]) -> None:
    """Worker: run one configuration at batch size ``N`` under the budget (phase ``probe``)."""
    setup = _worker.worker_setup({**config, "threads": None})
    task = {k: config[k] for k in ("task", "structure", "approx", "data")}
    where = {"problem": config["problem"], "device": config["device"]}
    run_task(**task, **where, N=2)()  # warm-up
    call = run_task(**task, **where, N=config["N"])
    budget = int(config["budget_gib"] * _worker.GiB)
    if config["device"] == "cuda":  # RLIMIT_AS does not apply to device memory
        import torch

        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        held = torch.cuda.memory_allocated()
        torch.cuda.set_per_process_memory_fraction(min(1.0, (held + budget) / total))
    else:
        held = _worker.proc_status_bytes("VmSize") or 0
        setup["mem_limit_bytes"] = _worker.limit_address_space(held + budget)
    _worker.run_phases(setup, [("probe", call)], config, preimports=())


def probe(config: str, N: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run one probe in a fresh worker: ``N``, ``status`` (and ``reason``), ``seconds``."""
    task = dict(zip(("task", "structure", "approx", "data"), config.split(",")))
    record = _harness.run_worker("benchmarks.bench_ncrit", {
        **task, "problem": args.problem, "N": N, "budget_gib": args.budget_gib,
        "device": args.device, "phases": ["probe"]}, args)
    setup, phase = record.get("setup", {}), record["phases"]["probe"]
    if setup.get("status") != "ok":
        phase = setup
    result = {"N": N, "status": phase.get("status"),
              "seconds": phase.get("time_s", phase.get("time_to_failure_s"))}
    if phase.get("status") != "ok":
        result["reason"] = str(phase.get("reason"))[:500]
    return result


def critical_batch_size(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Grow ``N`` geometrically until a probe fails, then bisect to ``--rtol``: ``n_crit``
    is the largest successful ``N``, ``capped`` whether ``--n-max`` succeeded."""
    probes, lo, hi = [], 0, None
    N = args.n_start
    while hi is None:
        result = probe(config, N, args)
        probes.append(result)
        if result["status"] != "ok":
            hi = N
        else:
            lo = N
            if N >= args.n_max:
                return {"config": config, "n_crit": lo, "probes": probes, "capped": True}
            N = min(args.n_max, 2 * N)
    while hi - lo > max(1, int(args.rtol * lo)):
        N = (lo + hi) // 2
        result = probe(config, N, args)
        probes.append(result)
        lo, hi = (N, hi) if result["status"] == "ok" else (lo, N)
    failures = {p["status"] for p in probes if p["status"] != "ok"}
    return {"config": config, "n_crit": lo, "probes": probes, "capped": False,
            "failures": sorted(failures)}


def plot(records: Sequence[dict], path: Path, title: str) -> None:
    """Bar chart of N_crit per configuration."""
    labels = [r["config"].replace(",", "\n") for r in records]
    with figure(path, figsize=(max(6, 0.55 * len(records)), 4)) as (_, ax):
        ax.bar(range(len(records)), [r["n_crit"] for r in records], color="tab:blue")
        ax.set_xticks(range(len(records)), labels, fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel(r"$N_{\mathrm{crit}}$")
        ax.set_title(title, fontsize=9)


def table(records: Sequence[dict], problem: str) -> str:
    """Markdown table of N_crit, with the paper's Newton-step values for 3c3d."""
    by = {r["config"]: r for r in records}
    lines = ["| task | structure | GGN | N_crit mb | N_crit sub | paper CPU (mb, sub) "
             "| paper GPU (mb, sub) |", "|---|---|---|---|---|---|---|"]
    for task, structure, approx in itertools.product(TASKS, STRUCTURES, APPROXIMATIONS):
        cells = []
        for data in DATA:
            r = by.get(f"{task},{structure},{approx},{data}")
            cells.append("-" if r is None else f"{r['n_crit']}{'+' if r['capped'] else ''}")
        paper = ["-", "-"]
        if task.startswith("newton") and problem == "3c3d":
            paper = [str(PAPER_NEWTON_3C3D[(structure, dev)][approx]) for dev in ("CPU", "GPU")]
        if any(c != "-" for c in cells):
            lines.append(f"| {task} | {structure} | {approx} | {' | '.join(cells)} | "
                         f"{' | '.join(paper)} |")
    return "\n".join(lines)


def driver_main(args: argparse.Namespace) -> None:
    """Bisect every requested configuration and write JSON, PNG and a table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [",".join(c) for c in itertools.product(args.tasks, args.structures,
                                                      args.approximations, args.data)]
    records = []
    for config in configs:
        start = time.perf_counter()
        record = critical_batch_size(config, args)
        record["wall_s"] = time.perf_counter() - start
        records.append(record)
        print(f"  {config:<28} N_crit = {record['n_crit']}{'+' if record['capped'] else ''}"
              f"  ({len(record['probes'])} probes, {record['wall_s']:.0f} s)", flush=True)
    payload = {
        "problem": args.problem, "budget_gib": args.budget_gib, "rtol": args.rtol,
        "subsample_fraction": 1 / SUBSAMPLE_FRACTION, "n_max": args.n_max,
        "device": args.device, "machine": machine_info(args.device),
        "records": records,
    }
    (out / f"ncrit_{args.problem}.json").write_text(json.dumps(payload, indent=1))
    plot(records, out / f"ncrit_{args.problem}.png",
         f"{args.problem}: largest batch within {args.budget_gib:g} GiB (address space)")
    print(table(records, args.problem))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments."""
    parser = _harness.script_parser(__doc__, "timeout", "out", "blas_threads",
                                    "omp_wait_policy", timeout=600.0,
                                    out=str(_harness.RESULTS_DIR))
    parser.add_argument("--problem", default="3c3d", choices=_problems.PROBLEMS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda caps the caching allocator's share of device memory.")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    parser.add_argument("--approximations", nargs="+", default=list(APPROXIMATIONS),
                        choices=APPROXIMATIONS)
    parser.add_argument("--data", nargs="+", default=list(DATA), choices=DATA)
    parser.add_argument("--budget-gib", type=float, default=1.0,
                        help="Memory a probe may allocate beyond its set-up state [GiB].")
    parser.add_argument("--n-start", type=int, default=16, help="First batch size tried.")
    parser.add_argument("--n-max", type=int, default=8192, help="Largest batch size tried.")
    parser.add_argument("--rtol", type=float, default=0.05, help="Bisection tolerance.")
    return parser.parse_args(argv)


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
