"""Ratios and targets (:func:`summarize`), printed results, figures and the docs' table
records (:func:`table_records`) of ``bench_shared.py``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _report
from benchmarks._report import find, fmt, others_cpu, phase_ok, ratio
from benchmarks._worker import GiB

N_TRAIN, N_TEST, BATCH_SIZE = 1400, 397, 128
PARTS: tuple[str, ...] = ("fit", "train")
CONDITIONS: tuple[str, ...] = ("quiet", "loaded")
CONDITION_LABELS = {"quiet": "quiet", "loaded": "beside a busy process"}
#: Methods of each part.
FIT_METHODS: tuple[str, ...] = ("lowrank_ggn", "lowrank_ggn_sketch", "kron", "diag")
TRAIN_METHODS: tuple[str, ...] = ("lowrank_ggn", "kron", "full")
LABELS = {"lowrank_ggn": "`lowrank_ggn` (defaults)",
          "lowrank_ggn_sketch": '`lowrank_ggn`, `solver="sketch"`',
          "kron": "`kron`", "diag": "`diag`", "full": "`full`"}
FIT_PHASES: tuple[str, ...] = ("fit", "marglik", "glm")
OURS, PEER = "lowrank_ggn", "kron"
#: Target factors.
TARGET_VS_KRON = 3.0
TARGET_LOADED_VS_QUIET = 3.0


def config_key(part: str, condition: str, method: str) -> str:
    """Name of a configuration, e.g. ``'fit/quiet/kron'``."""
    return f"{part}/{condition}/{method}"


def _find(records: Sequence[dict], part: str, condition: str, method: str) -> dict | None:
    return find(records, part=part, condition=condition, method=method)


def _time(record: dict | None) -> float | None:
    """The measured time: fit + marglik (``fit`` part) or marglik_training (``train``)."""
    if record is None:
        return None
    if record["part"] == "train":
        r = phase_ok(record, "train")
        return None if r is None else r["time_s"]
    fit, marglik = phase_ok(record, "fit"), phase_ok(record, "marglik")
    return None if fit is None or marglik is None else fit["time_s"] + marglik["time_s"]


def _metrics(record: dict | None) -> dict | None:
    """The phase that holds the test metrics (``glm`` or ``train``), if it succeeded."""
    if record is None:
        return None
    return phase_ok(record, "glm" if record["part"] == "fit" else "train")


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """A run's ``ratios`` (by configuration key: time over kron's in the same condition and,
    if loaded, over its own quiet time) and ``targets`` (as ``_lora_report.summarize``)."""
    ratios: dict[str, dict] = {}
    for r in records:
        peer = _find(records, r["part"], r["condition"], PEER)
        quiet = _find(records, r["part"], "quiet", r["method"])
        ratios[config_key(r["part"], r["condition"], r["method"])] = {
            "vs_kron": ratio(_time(r), _time(peer)),
            "vs_own_quiet": ratio(_time(r), _time(quiet)) if r["condition"] != "quiet"
            else None}
    targets = []

    def add(name, where, value, bound):
        targets.append({"name": name, "where": where, "value": value, "bound": bound,
                        "passed": None if value is None else value <= bound})

    fit = "digits, fit + marglik"
    add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, quiet",
        ratios.get(config_key("fit", "quiet", OURS), {}).get("vs_kron"), TARGET_VS_KRON)
    if _find(records, "fit", "loaded", OURS) is not None:
        add(f"{OURS} beside a busy process <= {TARGET_LOADED_VS_QUIET:g}x its quiet time",
            fit, ratios[config_key("fit", "loaded", OURS)]["vs_own_quiet"],
            TARGET_LOADED_VS_QUIET)
        add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s", f"{fit}, beside a busy process",
            ratios[config_key("fit", "loaded", OURS)]["vs_kron"], TARGET_VS_KRON)
    for condition in CONDITIONS:
        if _find(records, "train", condition, OURS) is None:
            continue
        add(f"{OURS} <= {TARGET_VS_KRON:g}x {PEER}'s",
            f"digits, marglik_training, {CONDITION_LABELS[condition]}",
            ratios[config_key("train", condition, OURS)]["vs_kron"], TARGET_VS_KRON)
        ours = _metrics(_find(records, "train", condition, OURS))
        full = _metrics(_find(records, "train", condition, "full"))
        if _find(records, "train", condition, "full") is not None:
            value = None if ours is None or full is None else \
                ours["test_nll"] / full["test_nll"]
            add(f"{OURS}'s test NLL <= full's (ratio)",
                f"digits, marglik_training, {CONDITION_LABELS[condition]}", value, 1.0)
    return {"ratios": ratios, "targets": targets}


def _row_line(r: dict, ratios: dict) -> str:
    t, m = _time(r), _metrics(r) or {}
    ratio = ratios[config_key(r["part"], r["condition"], r["method"])]
    peak = r.get("worker_peak_bytes")
    parts = [f"{r['part']:<5} {r['condition']:<6} {r['method']:<18}",
             f"{fmt(t) if t is not None else _report.failure_text(r):>10} s",
             f"{fmt(ratio['vs_kron'])}x kron",
             f"{fmt(ratio['vs_own_quiet'])}x own quiet" if r["condition"] != "quiet" else "",
             f"NLL {fmt(m.get('test_nll'), 4)}", f"acc {fmt(m.get('test_acc'), 3)}",
             f"peak {'-' if peak is None else f'{peak / GiB:.2f}'} GiB",
             f"others {fmt(others_cpu(r), 2)}%"]
    return "  " + ", ".join(p for p in parts if p)


def print_summary(records: Sequence[dict], summary: dict[str, Any]):
    """Print the results and the targets."""
    print("\nResults (fit: median of the runs of fit + marglik; train: one run of "
          "marglik_training):")
    for r in records:
        print(_row_line(r, summary["ratios"]), flush=True)
    _report.print_targets(summary["targets"])
    _report.warn_others(records)


def plot(payload: dict[str, Any], path: Path):
    """Bar charts of a run (``shared.json``): fit + marglik and marglik_training time (log
    scales), test NLL."""
    records = payload["records"]
    colors = {"quiet": "tab:blue", "loaded": "tab:orange"}
    with _report.figure(path, 1, 3, figsize=(15, 4.4), rect=(0, 0, 1, 0.93)) as (fig, axes):
        quiet = [r for r in records if r["condition"] == "quiet"]
        for i, r in enumerate(quiet):
            _report.value_bar(axes[2], i, (_metrics(r) or {}).get("test_nll"), 0.0, "{:.3f}",
                              width=0.7,
                              color="tab:green" if r["part"] == "fit" else "tab:purple")
        axes[2].set_xticks(range(len(quiet)))
        axes[2].set_xticklabels([r["part"] + "\n" + r["method"].replace("_sketch", "\nsketch")
                                 for r in quiet], fontsize=7)
        axes[2].set_ylabel("test NLL, GLM probit (quiet runs)")
        for ax, part, label in ((axes[0], "fit", "fit + marglik [s] (median of runs)"),
                                (axes[1], "train", "marglik_training [s] (one run)")):
            methods = [m for m in (FIT_METHODS if part == "fit" else TRAIN_METHODS)
                       if any(r["part"] == part and r["method"] == m for r in records)]
            for i, method in enumerate(methods):
                for j, condition in enumerate(CONDITIONS):
                    r = _find(records, part, condition, method)
                    if r is not None:
                        _report.value_bar(ax, i + (j - 0.5) * 0.4, _time(r), width=0.4,
                                          color=colors[condition])
            ax.set_xticks(range(len(methods)))
            ax.set_xticklabels([m.replace("_sketch", "\nsketch") for m in methods], fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel(label)
        _report.box_legend(fig, [colors[c] for c in CONDITIONS],
                           [CONDITION_LABELS[c] for c in CONDITIONS])
        info = payload["machine"]
        fig.suptitle(f"digits MLP (D = {payload['settings'].get('D', '?')}), {N_TRAIN} / "
                     f"{N_TEST} points; {_report.machine_text(info)}, torch "
                     f"{info.get('torch')}, commit {payload['git_head'][:7]}; red x: failed",
                     fontsize=9)


def _row(r: dict[str, Any], ratios: dict[str, dict]) -> list[str]:
    """A configuration's row of the ``shared_fit`` or ``shared_train`` table."""
    t, m = _time(r), _metrics(r) or {}
    ratio_ = ratios[config_key(r["part"], r["condition"], r["method"])]
    peak, others = r.get("worker_peak_bytes"), others_cpu(r)
    vs_kron = "-" if r["method"] == PEER or ratio_["vs_kron"] is None else \
        fmt(ratio_["vs_kron"]) + "x"
    vs_quiet = "-" if ratio_["vs_own_quiet"] is None else fmt(ratio_["vs_own_quiet"]) + "x"
    head = [CONDITION_LABELS[r["condition"]], LABELS[r["method"]]]
    metrics = [fmt(m.get("test_nll"), 4), fmt(m.get("test_acc"), 3)]
    tail = ["-" if peak is None else f"{peak / GiB:.2f}", "-" if others is None else
            f"{others:.0f}"]
    if r["part"] == "train":
        prior = m.get("prior_precision") or []
        return [*head, fmt(t) if t is not None else _report.failure_text(r), vs_kron, vs_quiet,
                *metrics, ", ".join(f"{p:.3g}" for p in prior) or "-", *tail]
    fit, marglik = phase_ok(r, "fit"), phase_ok(r, "marglik")
    prior = (marglik or {}).get("prior_precision") or []
    return [*head, fmt(fit["time_s"]) if fit else _report.failure_text(r),
            fmt(marglik["time_s"]) if marglik else "-", fmt(t), vs_kron, vs_quiet, *metrics,
            fmt(prior[0]) if len(prior) == 1 else "-", *tail]


def table_records(payload: dict[str, Any], source: str) -> dict[str, dict]:
    """The docs' table records ``shared_fit``, ``shared_train`` (if run) and
    ``shared_targets`` of a run (``source``: where the raw run is kept)."""
    common, records = _report.table_common(payload, [source]), payload["records"]
    ratios, s = payload["summary"]["ratios"], payload["settings"]
    tables = {"shared_fit": {
        **common,
        "note": f"Median of {s['repeat']} fresh processes per row; D = {s.get('D')}.",
        "columns": ["machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
                    "/ kron's", "/ own quiet", "test NLL", "test acc.", "prior prec.",
                    "worker peak RSS [GiB]", "others' CPU [%]"],
        "rows": [_row(r, ratios) for r in records if r["part"] == "fit"]}}
    if any(r["part"] == "train" for r in records):
        tables["shared_train"] = {
            **common, "note": "One run (a fresh process) per row.",
            "columns": ["machine", "method", "marglik_training [s]", "/ kron's",
                        "/ own quiet", "test NLL", "test acc.",
                        "prior precisions (per parameter tensor)",
                        "worker peak RSS [GiB]", "others' CPU [%]"],
            "rows": [_row(r, ratios) for r in records if r["part"] == "train"]}
    tables["shared_targets"] = {**common, "note": "Ratios within one run.",
                                "columns": ["target", "where", "measured", "verdict"],
                                "rows": _report.target_rows(payload["summary"]["targets"])}
    return tables
