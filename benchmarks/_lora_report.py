"""Ratios against ``kron`` and targets (:func:`summarize`), printed results, figures and the
docs' table records (:func:`table_records`) of ``bench_lora.py``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _report
from benchmarks._report import find, fmt, gib, others_cpu, phase_ok, ratio, target
from benchmarks._worker import GiB

#: ``lowrank_ggn`` on the torch.func backend (``factor_backend="functorch"``).
FUNCTORCH = "lowrank_ggn_functorch"
#: The methods of a problem that names none.
PROBLEM_METHODS: tuple[str, ...] = ("lowrank_ggn", "kron", "diag")
METHODS: tuple[str, ...] = (*PROBLEM_METHODS, FUNCTORCH)
LABELS = {"lowrank_ggn": "`lowrank_ggn` (defaults)", "kron": "`kron`, CurvlinopsGGN",
          "diag": "`diag`, CurvlinopsGGN", FUNCTORCH: "`lowrank_ggn`, torch.func backend"}
ATTENTIONS: tuple[str, ...] = ("sdpa", "eager")
CONDITIONS: tuple[str, ...] = ("quiet", "loaded")
CONDITION_LABELS = {"quiet": "quiet", "loaded": "beside other work"}
PHASES: tuple[str, ...] = ("fit", "marglik", "glm")
NUM_CLASSES = 2
#: The peer of the ratios and targets.
PEER = "kron"
OURS = "lowrank_ggn"
#: Target: ours fit + marglik <= this times kron's.
TARGET_FIT_MARGLIK_VS_KRON = 1.5
#: Target: ours GLM predictive <= this times kron's.
TARGET_GLM_VS_KRON = 1.0
#: Targets of the Llama problems: ours fit + marglik <= this times kron's, and the GLM
#: predictive's peak memory (above what the process held before it) <= this times kron's.
TARGET_LLAMA_FIT_MARGLIK_VS_KRON = 1.0
TARGET_LLAMA_GLM_MEMORY_VS_KRON = 0.1
#: Target of the BERT full fine-tune: the default fit <= this times the torch.func
#: backend's.
TARGET_BERT_FIT_VS_FUNCTORCH = 0.2


def _find(records: Sequence[dict], attention: str, condition: str, method: str
          ) -> dict | None:
    return find(records, attention=attention, condition=condition, method=method)


def _status(record: dict | None, phase: str) -> str:
    return "not run" if record is None else _report.status_text(record["phases"].get(phase) or {})


def _fit_marglik(record: dict | None) -> float | None:
    """Fit plus marglik time of a configuration, a shrunk fit's (``n_fit`` of
    ``n_requested`` points) scaled to all points (``None`` if either failed)."""
    fit, marglik = phase_ok(record, "fit"), phase_ok(record, "marglik")
    if fit is None or marglik is None:
        return None
    n_fit = fit.get("n_fit", 1)
    return fit["time_s"] * fit.get("n_requested", n_fit) / n_fit + marglik["time_s"]


def _glm(record: dict | None) -> float | None:
    """GLM predictive time of a configuration (``None`` if it failed)."""
    return (phase_ok(record, "glm") or {}).get("time_s")


def summarize(problem: str, records: Sequence[dict]) -> dict[str, Any]:
    """A problem's ``ratios`` (per ``attention/condition``: ours' fit + marglik and GLM time
    over kron's) and ``targets`` (``name``, ``where``, ``value``, ``bound``, ``passed``;
    ``None``: not measurable)."""
    ratios, targets = {}, []
    groups = sorted({(r["attention"], r["condition"]) for r in records},
                    key=lambda g: (ATTENTIONS.index(g[0]), CONDITIONS.index(g[1])))
    for attention, condition in groups:
        ours, peer = (_find(records, attention, condition, m) for m in (OURS, PEER))
        fm = ratio(_fit_marglik(ours), _fit_marglik(peer))
        glm = ratio(_glm(ours), _glm(peer))
        ratios[f"{attention}/{condition}"] = {"fit_marglik_vs_kron": fm, "glm_vs_kron": glm}
        if attention != "sdpa" or problem == "gpt2":
            continue
        where = f"{problem}, sdpa, {CONDITION_LABELS[condition]}"

        def add(name, value, bound, phases=("fit", "marglik"), ours=ours, peer=peer,
                where=where):
            failed = [p for p in phases if peer is not None and
                      phase_ok(peer, p) is None and phase_ok(ours, p) is not None]
            note = f"{PEER} {_status(peer, failed[0])}" if failed else None
            targets.append(target(name, where, value, bound, peer_failure=note))

        if problem == "bert":
            functorch = _find(records, attention, condition, FUNCTORCH)
            fit = ratio(*((phase_ok(r, "fit") or {}).get("time_s") for r in (ours, functorch)))
            add(f"{OURS} fit <= {TARGET_BERT_FIT_VS_FUNCTORCH:g}x its torch.func backend's",
                fit, TARGET_BERT_FIT_VS_FUNCTORCH, peer=functorch)
            continue
        llama = problem.startswith("llama")
        bound = TARGET_LLAMA_FIT_MARGLIK_VS_KRON if llama else TARGET_FIT_MARGLIK_VS_KRON
        add(f"{OURS} fit + marglik <= {bound:g}x {PEER}'s", fm, bound)
        if llama:
            memory = ratio(*((phase_ok(r, "glm") or {}).get("peak_delta_bytes")
                             for r in (ours, peer)))
            add(f"{OURS} GLM predictive memory <= {TARGET_LLAMA_GLM_MEMORY_VS_KRON:g}x "
                f"{PEER}'s (or {PEER} out of memory)", memory,
                TARGET_LLAMA_GLM_MEMORY_VS_KRON, phases=("fit", "marglik", "glm"))
            if phase_ok(ours, "glm") and any(p.get("status") == "oom" for p in
                                             (peer or {"phases": {}})["phases"].values()):
                targets[-1]["passed"] = True
        if problem == "small":
            add(f"{OURS} GLM predictive <= {PEER}'s", glm, TARGET_GLM_VS_KRON,
                phases=("glm",))
    return {"ratios": ratios, "targets": targets}


def print_summary(problem: str, records: Sequence[dict], summary: dict[str, Any]):
    """Print the result table and the targets of a problem."""
    print(f"\n[{problem}] attention / machine / method: fit + marglik [s], GLM [s], "
          "worker peak [GiB], engine")
    for r in records:
        fm, glm = _fit_marglik(r), _glm(r)
        fit = phase_ok(r, "fit") or {}
        print(f"  {r['attention']:<5} {r['condition']:<6} {r['method']:<11} "
              f"{fmt(fm) if fm is not None else _status(r, 'fit' if not fit else 'marglik'):>12}"
              f" {fmt(glm) if glm is not None else _status(r, 'glm'):>12} "
              f"{gib(r.get('worker_peak_bytes')):>6} "
              f"{fit.get('factor_backend_used', '')}", flush=True)
    _report.print_targets(summary["targets"])
    _report.warn_others(records)


def plot(problem: str, payload: dict[str, Any], path: Path):
    """Bar charts of a run: fit + marglik and GLM time, worker peak memory."""
    records = payload["records"]
    groups = sorted({(r["attention"], r["condition"]) for r in records},
                    key=lambda g: (ATTENTIONS.index(g[0]), CONDITIONS.index(g[1])))
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    width = 0.8 / max(1, len(methods))
    colors = {"lowrank_ggn": "tab:blue", "kron": "tab:gray", "diag": "tab:olive",
              FUNCTORCH: "tab:cyan"}
    panels = [("fit + marglik [s]", _fit_marglik, True), ("GLM predictive [s]", _glm, True),
              ("worker peak memory [GiB]",
               lambda r: None if r.get("worker_peak_bytes") is None
               else r["worker_peak_bytes"] / GiB, False)]
    with _report.figure(path, 1, 3, figsize=(15, 4.4), rect=(0, 0, 1, 0.95)) as (fig, axes):
        for ax, (label, value_of, log) in zip(axes, panels):
            for j, method in enumerate(methods):
                for i, (attention, condition) in enumerate(groups):
                    r = _find(records, attention, condition, method)
                    if r is not None:
                        _report.value_bar(ax, i + (j - (len(methods) - 1) / 2) * width,
                                          value_of(r), 1.0 if log else 0.0, fontsize=6,
                                          width=width, color=colors[method])
            ax.set_xticks(range(len(groups)))
            ax.set_xticklabels([f"{a}\n{CONDITION_LABELS[c]}" for a, c in groups], fontsize=8)
            if log:
                ax.set_yscale("log")
            ax.set_ylabel(label)
        _report.box_legend(fig, [colors[m] for m in methods], methods)
        info, s = payload["machine"], payload["settings"]
        fig.suptitle(f"LoRA {problem}: D = {s.get('D', '?')}, {s['n_train']} / {s['n_test']} "
                     f"sequences; {_report.machine_text(info)}, torch {info.get('torch')}; "
                     "red x: failed", fontsize=9)


def _row(r: dict[str, Any], records: Sequence[dict]) -> list[str]:
    """A configuration's row of the ``lora_<problem>`` table."""
    fm, glm = _fit_marglik(r), _glm(r)
    peer = _find(records, r["attention"], r["condition"], PEER)
    fit, marglik = phase_ok(r, "fit"), phase_ok(r, "marglik")
    others = others_cpu(r)
    engine = (fit or {}).get("factor_backend_used") or "-"
    if fit and fit.get("kept_fraction") is not None:
        engine += (f" (rank {fit.get('rank', '?')}, keeps "
                   f"{100 * fit['kept_fraction']:.0f}% of the trace)")
    return [r["attention"], CONDITION_LABELS[r["condition"]], LABELS[r["method"]],
            fmt(fit["time_s"]) if fit else _status(r, "fit"),
            fmt(marglik["time_s"]) if marglik else _status(r, "marglik"),
            fmt(fm),
            "-" if r["method"] == PEER or fm is None else
            fmt(ratio(fm, _fit_marglik(peer))) + "x" if _fit_marglik(peer) else "-",
            fmt(glm) if glm is not None else _status(r, "glm"),
            "-" if r["method"] == PEER or glm is None else
            fmt(ratio(glm, _glm(peer))) + "x" if _glm(peer) else "-",
            gib(r.get("worker_peak_bytes")), engine,
            "-" if others is None else f"{others:.0f}"]


def table_records(payloads: dict[str, dict], source_dir: str) -> dict[str, dict]:
    """The docs' table records ``lora_<problem>`` and ``lora_targets`` of the runs."""
    tables: dict[str, dict] = {}
    targets, commits = [], {}
    for problem, payload in payloads.items():
        common = _report.table_common(payload, [f"{source_dir}/lora_{problem}.json"])
        commits[problem] = common["versions"]["lowrank_laplace commit"]
        s, repeat = payload["settings"], payload["settings"].get("repeat", 1)
        note = (f"D = {s.get('D')} trainable of {s.get('frozen_params')} frozen weights; "
                f"{s['n_train']} / {s['n_test']} sequences of up to {s['seq_len']} tokens, "
                f"batch {s['batch_size']}; {s['threads']} torch threads per worker; "
                + (f"median of {repeat} runs (fresh processes, rounds over the methods); "
                   if repeat > 1 else "one run; ")
                + "beside other work: a process with "
                f"{s.get('load_threads')} threads of 512x512 matmuls runs meanwhile; "
                "others' CPU: share of other processes (not the synthetic load) during the "
                "measured phases.")
        cuda = payload["machine"].get("device") == "cuda"
        tables[f"lora_{problem}"] = {**common, "note": note, "columns": [
            "attention", "machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
            "/ kron's", "GLM predictive [s]", "/ kron's",
            "peak CUDA memory [GiB]" if cuda else "worker peak RSS [GiB]", "engine",
            "others' CPU [%]"], "rows": [_row(r, payload["records"])
                                         for r in payload["records"]]}
        targets += _report.target_rows(payload["summary"]["targets"])
    if targets:
        last = tables[f"lora_{list(payloads)[-1]}"]
        tables["lora_targets"] = {
            **last, "versions": {**last["versions"], "lowrank_laplace commit": "; ".join(
                f"{problem}: {commit}" for problem, commit in commits.items())},
            "sources": [f"{source_dir}/lora_{problem}.json" for problem in payloads],
            "note": "Ratios of the tables above, within one run.",
            "columns": ["target", "where", "measured", "verdict"], "rows": targets}
    return tables
