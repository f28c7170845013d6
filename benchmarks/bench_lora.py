"""Benchmark Laplace over the LoRA adapters of a Hugging Face GPT-2 classifier.

laplace-torch's Hugging Face recipe: ``GPT2ForSequenceClassification`` built from a
``GPT2Config`` with random weights (``_from_config``, nothing downloaded), PEFT LoRA
adapters (``task_type="SEQ_CLS"``, so the classification head ``score`` is trained as
well), wrapped in a module whose forward takes the dict batch and returns ``.logits``;
dict batches (``input_ids``, ``attention_mask``, ``labels``) from a ``Dataset`` of
padded random token sequences, batch size 32, ``dict_key_y="labels"``, two classes.
The Laplace parameters are the trainable ones (``subset_of_weights="all"``). Methods:

- ``lowrank_ggn``: ``hessian_structure="lowrank_ggn"`` with its defaults (this
  library, registered with laplace-torch's ``Laplace`` by ``import lowrank_laplace``;
  ``factor_backend="auto"`` should pick the hooks backend; recorded as
  ``la.factor_backend_used``),
- ``kron`` and ``diag``: laplace-torch with ``backend=CurvlinopsGGN``.

Problems:

``small``
    2 layers of width 64 (2 heads, vocabulary 200, 32 positions), LoRA ``r=4``,
    ``lora_alpha=16`` on ``c_attn``; 256 training sequences of 6-16 tokens, 128 test
    sequences. Both attention implementations (``sdpa``, the default, and ``eager``),
    each on a quiet machine and beside other work: a competing process (this script
    with ``--load``) that keeps ``--load-threads`` torch threads busy with a loop of
    512 x 512 float32 matmuls, started before the worker and stopped after it.
    Repeated ``--repeat`` times (default 3, fresh processes in rounds over the
    methods); every phase's time is the median.
``large``
    4 layers of width 256 (4 heads, vocabulary 1,000, 64 positions), LoRA ``r=8``,
    ``lora_alpha=16`` on ``c_attn``, ``c_proj`` and ``c_fc`` (attention and MLP
    projections); 1,024 training sequences of 8-64 tokens, 128 test sequences; ``sdpa``,
    quiet, one run.
``gpt2``
    GPT-2-small-sized (12 layers of width 768, 12 heads, vocabulary 50,257, 1,024
    positions: 124 M frozen weights), LoRA ``r=8``, ``lora_alpha=16`` on ``c_attn``;
    1,024 training sequences of 8-128 tokens, 128 test sequences; ``sdpa``, quiet.
    Not in the default ``--problems``: meant for ``--device cuda`` (``gpu_check.sh
    lora``).

Every configuration (problem, attention, condition, method) runs in a fresh worker
process (this script with ``--worker``, started with ``_harness.module_command`` and
``_harness.worker_env``) with three phases, each timed and memory-measured separately
(imports, model and data creation are excluded):

1. ``fit``: construct ``Laplace(...)`` and call ``la.fit(train_loader)``,
2. ``marglik``: ``la.optimize_prior_precision(method="marglik")`` (laplace-torch's
   defaults),
3. ``glm``: ``la(test_batch, pred_type="glm", link_approx="probit")`` on the test
   sequences as one dict batch.

The worker prints one JSON record per phase as soon as the phase ends, so a failing
predictive still reports the fit. Failures are results: out-of-memory errors (the
address-space cap ``RLIMIT_AS`` of ``--mem-limit-gib`` turns them into catchable
allocation failures; a worker killed by ``SIGKILL`` counts as out of memory too), other
exceptions, and phases that exceed ``--timeout`` (the worker is killed; its earlier
phases are kept). The memory column is the worker's peak RSS (the largest high-water
mark over setup and phases; on CUDA the largest allocator peak of a phase); each
phase's peak above the memory held before it is recorded as well.

On a shared machine, ``--wait-for``/``--wait-idle`` delay each worker until other
processes leave the CPU; the CPU share that other processes (not counting the
synthetic load) used during each worker and phase is recorded, and ``--retry-busy``
repeats a disturbed configuration, keeping the least disturbed run. ``--resume`` reuses
the records of an interrupted run (``--rerun`` names configurations to run again) and
``--replot`` rewrites summaries, figures and tables from the JSON files.

Targets (printed with PASS/FAIL; ratios within one run):

- ``small``, default attention (``sdpa``): ``lowrank_ggn`` fit + marglik <= 1.5x
  ``kron``'s, quiet and beside other work;
- ``small``, default attention: ``lowrank_ggn``'s GLM predictive no slower than
  ``kron``'s (quiet and beside other work);
- ``large``: ``lowrank_ggn`` fit + marglik <= 1.5x ``kron``'s.

Examples:
    Smoke test (fewer sequences, one run each, written to
    ``benchmarks/results/quick``)::

        python -m benchmarks.bench_lora --quick

    Full CPU run, waiting for tests and other benchmarks to leave the CPU::

        python -m benchmarks.bench_lora --wait-for pytest bench_ --wait-idle 600

    On a GPU::

        python -m benchmarks.bench_lora --device cuda --problems large gpt2

Results are written to ``<out>/lora_<problem>.json`` and ``<out>/lora_<problem>.png``;
the rows of the docs' tables (``render_tables.py`` format) to
``<out>/lora_tables/lora_<problem>.json`` and ``lora_targets.json`` (their ``sources``
name ``--table-source``/``lora_<problem>.json``, where the raw runs are kept).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import resource
import statistics
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import _harness, _laplace_worker, _load
from benchmarks._harness import BUSY_WARN_PERCENT, REPO_ROOT, GiB

RESULT_MARKER = "__BENCH_LORA_PHASE__"
LOAD_MARKER = "__BENCH_LORA_LOAD__"

#: Problem name -> model, adapters, data and which configurations run by default.
PROBLEMS: dict[str, dict[str, Any]] = {
    "small": {"layers": 2, "width": 64, "heads": 2, "vocab": 200, "positions": 32,
              "seq_len": 16, "min_len": 6, "r": 4, "alpha": 16, "targets": ("c_attn",),
              "n_train": 256, "n_test": 128, "attentions": ("sdpa", "eager"),
              "conditions": ("quiet", "loaded"), "repeat": 3,
              "quick": {"n_train": 64, "n_test": 32}},
    "large": {"layers": 4, "width": 256, "heads": 4, "vocab": 1000, "positions": 64,
              "seq_len": 64, "min_len": 8, "r": 8, "alpha": 16,
              "targets": ("c_attn", "c_proj", "c_fc"), "n_train": 1024, "n_test": 128,
              "attentions": ("sdpa",), "conditions": ("quiet",), "repeat": 1,
              "quick": {"n_train": 64, "n_test": 16, "seq_len": 32}},
    "gpt2": {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "positions": 1024,
             "seq_len": 128, "min_len": 8, "r": 8, "alpha": 16, "targets": ("c_attn",),
             "n_train": 1024, "n_test": 128, "attentions": ("sdpa",), "conditions": ("quiet",),
             "repeat": 1, "quick": {"n_train": 16, "n_test": 4, "seq_len": 32}},
}
#: Problems run without ``--problems``.
DEFAULT_PROBLEMS: tuple[str, ...] = ("small", "large")
METHODS: tuple[str, ...] = ("lowrank_ggn", "kron", "diag")
LABELS = {"lowrank_ggn": "`lowrank_ggn` (defaults)", "kron": "`kron`, CurvlinopsGGN",
          "diag": "`diag`, CurvlinopsGGN"}
ATTENTIONS: tuple[str, ...] = ("sdpa", "eager")
CONDITIONS: tuple[str, ...] = ("quiet", "loaded")
CONDITION_LABELS = {"quiet": "quiet", "loaded": "beside other work"}
PHASES: tuple[str, ...] = ("fit", "marglik", "glm")
NUM_CLASSES = 2
BATCH_SIZE = 32
#: The peer of the ratios and targets.
PEER = "kron"
OURS = "lowrank_ggn"
#: Target: ours fit + marglik <= this times kron's.
TARGET_FIT_MARGLIK_VS_KRON = 1.5
#: Target: ours GLM predictive <= this times kron's.
TARGET_GLM_VS_KRON = 1.0
#: Package versions recorded besides the harness defaults.
PACKAGES: tuple[str, ...] = (*_harness.DEFAULT_PACKAGES, "laplace-torch", "transformers",
                             "peft")
#: Time limit of a worker's start (imports, model and data), at least ``--timeout``.
SETUP_TIMEOUT_S = 300.0


###############################################################################
#                             Model and data                                  #
###############################################################################


class Logits(nn.Module):
    """laplace-torch's Hugging Face recipe: take the dict batch, return the logits.

    Args:
        model: The (PEFT-wrapped) Hugging Face classifier.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> torch.Tensor:
        """Classify a dict batch.

        Args:
            batch: ``input_ids`` and ``attention_mask`` (other keys are ignored).

        Returns:
            The logits, shape ``(N, 2)``.
        """
        return self.model(input_ids=batch["input_ids"],
                          attention_mask=batch["attention_mask"]).logits


class Sequences(torch.utils.data.Dataset):
    """Padded random token sequences with random binary labels (dict samples).

    Args:
        n: Number of sequences.
        seq_len: Padded length.
        min_len: Shortest sequence.
        vocab: Vocabulary size (tokens 0 and 1 are padding and BOS/EOS, not drawn).
        seed: Seed of the lengths, tokens and labels.
        device: Device of the tensors (the default collate stacks them there).
    """

    def __init__(self, n: int, seq_len: int, min_len: int, vocab: int, seed: int,
                 device: torch.device):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, seq_len + 1, (n,), generator=gen)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
        self.mask = mask.to(device)
        self.ids = (torch.randint(2, vocab, (n, seq_len), generator=gen) * mask).to(device)
        self.labels = torch.randint(0, NUM_CLASSES, (n,), generator=gen).to(device)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def make_model(problem: str, attention: str, seed: int) -> nn.Module:
    """The LoRA-adapted GPT-2 classifier of a problem (random weights, eval mode).

    Args:
        problem: Problem name (a key of :data:`PROBLEMS`).
        attention: ``attn_implementation`` (``'sdpa'`` or ``'eager'``).
        seed: Seed of the weights.

    Returns:
        The wrapped model: dict batch in, logits out.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2ForSequenceClassification

    spec = PROBLEMS[problem]
    config = GPT2Config(n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"],
                        vocab_size=spec["vocab"], n_positions=spec["positions"],
                        num_labels=NUM_CLASSES, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(seed)
    base = GPT2ForSequenceClassification._from_config(config, attn_implementation=attention)
    lora = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=list(spec["targets"]),
                      task_type="SEQ_CLS")
    return Logits(get_peft_model(base, lora)).eval()


###############################################################################
#                                  Worker                                     #
###############################################################################


def _emit(record: dict[str, Any]):
    """Print a phase record as one JSON line on stdout (see :func:`_harness.emit`).

    Args:
        record: The record.
    """
    _harness.emit(RESULT_MARKER, record)


def _measure(phase: str, fn, device: torch.device, load_pid: int) -> tuple[dict, Any]:
    """Time and memory-measure a phase; separate the synthetic load from others' CPU.

    Args:
        phase: Phase name.
        fn: The phase (no arguments).
        device: Device of the run.
        load_pid: Process id of the competing load (``0``: none).

    Returns:
        The phase record of :func:`_laplace_worker._measure` (with
        ``other_cpu_percent_during_phase`` not counting the load, whose share is
        ``load_cpu_percent_during_phase``) and the output of ``fn``.
    """
    load0 = _load.process_cpu_seconds(load_pid)
    start = time.perf_counter()
    record, out = _laplace_worker._measure(phase, fn, device)
    wall = time.perf_counter() - start
    load1 = _load.process_cpu_seconds(load_pid)
    if load0 is not None and load1 is not None and wall > 0:
        share = 100.0 * (load1 - load0) / (wall * (os.cpu_count() or 1))
        record["load_cpu_percent_during_phase"] = share
        others = record.get("other_cpu_percent_during_phase")
        if others is not None:
            record["other_cpu_percent_during_phase"] = max(0.0, others - share)
    return record, out


def run_worker(args: argparse.Namespace):
    """Build the problem, then run and report the phases of one method.

    The first record is ``phase='setup'`` (sizes, memory cap, RSS after setup); a
    failed phase ends the worker.

    Args:
        args: Parsed command line arguments of the worker.
    """
    from torch.utils.data import DataLoader

    device = torch.device(args.device)
    base = {"problem": args.problem, "attention": args.attention, "method": args.method}
    setup: dict[str, Any] = {**base, "phase": "setup", "status": "ok"}
    setup.update(_laplace_worker._set_memory_cap(int(args.mem_limit_gib * GiB), device))
    threads = args.threads or _harness.num_cores()
    torch.set_num_threads(threads)

    import laplace
    from laplace.curvature import CurvlinopsGGN

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    spec = PROBLEMS[args.problem]
    model = make_model(args.problem, args.attention, args.seed).to(device)
    train = Sequences(args.n_train, args.seq_len, spec["min_len"], spec["vocab"],
                      args.seed + 1, device)
    test_set = Sequences(args.n_test, args.seq_len, spec["min_len"], spec["vocab"],
                         args.seed + 2, device)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=False)
    test = next(iter(DataLoader(test_set, batch_size=args.n_test)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    setup.update({
        "D": sum(p.numel() for p in trainable),
        "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
        "n_train": args.n_train, "n_test": args.n_test, "seq_len": args.seq_len,
        "batch_size": args.batch_size, "threads": threads, "device": str(device),
        "attention_used": getattr(model.model.config, "_attn_implementation", None),
        "lowrank_laplace": _laplace_worker.library_fingerprint(),
    })
    if args.method == OURS:
        kwargs: dict[str, Any] = {"hessian_structure": "lowrank_ggn"}
    else:
        kwargs = {"hessian_structure": args.method, "backend": CurvlinopsGGN}
    setup["laplace_kwargs"] = {k: getattr(v, "__name__", v) for k, v in kwargs.items()}
    _harness.preimport((*_harness.DEFAULT_PREIMPORTS, "curvlinops", "laplace"))
    setup["rss_peak_bytes"] = _harness.peak_rss_bytes()
    if device.type == "cuda":
        setup["cuda_allocated_bytes"] = torch.cuda.memory_allocated(device)
    _emit(setup)

    def fit():
        torch.manual_seed(args.seed)
        la = laplace.Laplace(model, "classification", subset_of_weights="all",
                             dict_key_y="labels", **kwargs)
        la.fit(loader)
        return la

    record, la = _measure("fit", fit, device, args.load_pid)
    record.update(base)
    if la is not None:
        record["H_type"] = type(la.H).__name__
        for key in ("factor_backend_used", "fit_path", "rank"):
            value = getattr(la, key, None)
            if isinstance(value, (str, int)):
                record[key] = value
        if args.method == OURS:
            record["kept_fraction"] = float(la.kept_fraction)
    _emit(record)
    if la is None:
        return

    record, _ = _measure("marglik", lambda: la.optimize_prior_precision(method="marglik"),
                         device, args.load_pid)
    record.update(base)
    if record["status"] == "ok":
        record["prior_precision"] = la.prior_precision.detach().cpu().reshape(-1).tolist()[:4]
    _emit(record)
    if record["status"] != "ok":
        return

    torch.manual_seed(args.seed)
    record, probs = _measure(
        "glm", lambda: la(test, pred_type="glm", link_approx="probit").detach(), device,
        args.load_pid)
    record.update(base)
    if probs is not None:
        problems = _laplace_worker._check_probs(probs, args.n_test, NUM_CLASSES)
        if problems:
            record["warnings"] = problems
    _emit(record)


def worker_main(args: argparse.Namespace):
    """Run the worker (or, with ``--load``, the competing load).

    Args:
        args: Parsed command line arguments of the worker.
    """
    if args.load:
        load_main(args)
        return
    with _harness.failures_reported(RESULT_MARKER, problem=args.problem,
                                    attention=args.attention, method=args.method,
                                    phase="setup"):
        run_worker(args)


def load_main(args: argparse.Namespace):
    """The competing work: 512 x 512 float32 matmuls on ``--load-threads`` threads.

    Args:
        args: Parsed command line arguments (``load_threads``).
    """
    _load.matmul_load(args.load_threads, 512, LOAD_MARKER)


###############################################################################
#                                  Driver                                     #
###############################################################################


def start_load(args: argparse.Namespace) -> _load.CompetingLoad:
    """Start the competing process of the ``loaded`` condition (this script with ``--load``).

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        The running load.
    """
    cmd = _harness.module_command("benchmarks.bench_lora", "--worker", "--load",
                                  f"--load-threads={args.load_threads}")
    return _load.CompetingLoad(cmd, _harness.worker_env(args), LOAD_MARKER)


def config_key(problem: str, attention: str, condition: str, method: str) -> str:
    """Name of a configuration, e.g. ``'small/sdpa/quiet/kron'``."""
    return f"{problem}/{attention}/{condition}/{method}"


def run_worker_process(problem: str, attention: str, condition: str, method: str,
                       args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in a fresh worker, with a time limit per phase.

    In the ``loaded`` condition the competing load starts before the worker and stops
    after it.

    Args:
        problem: Problem name.
        attention: Attention implementation.
        condition: ``'quiet'`` or ``'loaded'``.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        The configuration's record: ``setup``, ``phases`` (phase -> record with
        ``status`` and, if ``'ok'``, ``time_s`` and memory), ``worker_peak_bytes``,
        the other processes' CPU share during the worker and, if loaded, ``load``.
    """
    size = sizes(problem, args)
    busy_procs = _harness.wait_for_processes(args.wait_for, args.wait_max,
                                             poll_s=args.wait_poll)
    busy = _harness.wait_for_idle_cpu(args.wait_idle)
    record: dict[str, Any] = {"problem": problem, "attention": attention,
                              "condition": condition, "method": method, "sizes": size,
                              "cpu_busy_before_percent": busy, "phases": {}}
    if busy_procs:
        record["busy_processes_before"] = busy_procs
    load = start_load(args) if condition == "loaded" else None
    cmd = _harness.module_command(
        "benchmarks.bench_lora", "--worker", f"--problem={problem}",
        f"--attention={attention}", f"--method={method}", f"--device={args.device}",
        f"--n-train={size['n_train']}", f"--n-test={size['n_test']}",
        f"--seq-len={size['seq_len']}", f"--batch-size={args.batch_size}",
        f"--seed={args.seed}", f"--threads={args.threads}",
        f"--mem-limit-gib={args.mem_limit_gib}", f"--load-pid={load.pid if load else 0}")

    busy0 = _harness.system_busy_cpu_seconds()
    children0 = _harness.own_cpu_seconds(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, env=_harness.worker_env(args),
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    stderr_tail: deque = deque(maxlen=60)
    threads = [threading.Thread(target=_harness.read_lines, args=(proc.stdout, lines), daemon=True),
               threading.Thread(target=_harness.read_lines, args=(proc.stderr, None, stderr_tail),
                                daemon=True)]
    for t in threads:
        t.start()
    expected = ["setup", *PHASES]
    current, failure = 0, None
    deadline = time.perf_counter() + max(args.timeout, SETUP_TIMEOUT_S)
    while current < len(expected):
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            _harness.kill_group(proc)
            limit = args.timeout if current else max(args.timeout, SETUP_TIMEOUT_S)
            failure = {"status": "timeout", "time_to_failure_s": limit,
                       "reason": f"phase exceeded the time limit of {limit:g} s (worker "
                                 "killed)"}
            break
        if line is None:  # the worker ended before reporting every phase
            proc.wait()
            status, reason = _harness.classify_exit(proc.returncode)
            failure = {"status": status, "reason": reason}
            break
        if not line.startswith(RESULT_MARKER):
            continue
        phase_record = json.loads(line[len(RESULT_MARKER):])
        phase = phase_record["phase"]
        if phase == "setup":
            record["setup"] = phase_record
        else:
            record["phases"][phase] = phase_record
        if phase_record.get("status") != "ok":
            break  # the worker reports a failed phase and ends
        current = expected.index(phase) + 1
        deadline = time.perf_counter() + args.timeout
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _harness.kill_group(proc)
    for t in threads:
        t.join(timeout=5)
    wall = time.perf_counter() - start
    # before the load is stopped and reaped (its CPU time then joins the children's)
    busy1 = _harness.system_busy_cpu_seconds()
    own = _harness.own_cpu_seconds(resource.RUSAGE_CHILDREN) - children0
    load_cpu = load.cpu_seconds() if load else 0.0
    if load is not None:
        record["load"] = load.stop()
    record["subprocess_wall_s"] = wall
    if busy0 is not None and busy1 is not None:
        record["other_cpu_percent_during"] = _harness.other_cpu_percent(
            busy1 - busy0, own + (load_cpu or 0.0), wall)
    if load is not None and load_cpu is not None:
        record["load"]["cpu_percent_during"] = 100.0 * load_cpu / (
            wall * (os.cpu_count() or 1))

    if failure is not None:
        phase = expected[current] if current < len(expected) else PHASES[-1]
        if phase == "setup" and record.get("setup", {}).get("status") == "ok":
            phase = PHASES[0]
        failure["stderr_tail"] = "".join(stderr_tail)[-2000:]
        if phase == "setup":
            record["setup"] = {"phase": "setup", **failure}
        else:
            record["phases"][phase] = {"phase": phase, **failure}
    setup = record.get("setup", {})
    if setup.get("status") != "ok":
        for phase in PHASES:
            record["phases"].setdefault(phase, {"phase": phase, "status": "skipped",
                                                "reason": f"setup failed: "
                                                          f"{setup.get('reason')}"})
    for phase in PHASES:  # after a failed phase the worker ends
        if phase not in record["phases"]:
            record["phases"][phase] = {"phase": phase, "status": "skipped",
                                       "reason": "an earlier phase failed"}
    peaks = [r.get("rss_peak_bytes") for r in (setup, *record["phases"].values())]
    if args.device == "cuda":
        peaks = [r.get("cuda_peak_bytes") for r in record["phases"].values()]
    peaks = [p for p in peaks if p is not None]
    record["worker_peak_bytes"] = max(peaks) if peaks else None
    return record


def run_config(problem: str, attention: str, condition: str, method: str,
               args: argparse.Namespace) -> dict[str, Any]:
    """Run a configuration; repeat it if other processes competed for the CPU meanwhile.

    Up to ``--retry-busy`` repetitions while other processes (not counting the
    synthetic load) used more than :data:`BUSY_WARN_PERCENT` of the CPU during the
    worker; the least disturbed run is kept (``busy_attempt_loads`` lists them all).

    Args:
        problem: Problem name.
        attention: Attention implementation.
        condition: ``'quiet'`` or ``'loaded'``.
        method: Method name.
        args: Parsed command line arguments of the driver.

    Returns:
        The configuration's record (see :func:`run_worker_process`).
    """
    best, loads = None, []
    for attempt in range(1 + max(0, args.retry_busy)):
        record = run_worker_process(problem, attention, condition, method, args)
        load = record.get("other_cpu_percent_during")
        loads.append(load)
        if best is None or (load is not None and
                            load < (best.get("other_cpu_percent_during") or 0.0)):
            best = record
        if load is None or load <= BUSY_WARN_PERCENT:
            break
        if any(r.get("status") == "timeout" for r in record["phases"].values()):
            break  # repeating a run that hit the time limit is not worth it
        if attempt < args.retry_busy:
            print(f"  {config_key(problem, attention, condition, method)}: other processes "
                  f"used {load:.0f}% of the CPU during the run; repeating it", flush=True)
    if len(loads) > 1:
        best["busy_attempt_loads"] = loads
    return best


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from repeated runs: every phase's median time.

    The record is the run whose fit + marglik time is the median (its memory and other
    fields stay as measured); each phase's ``time_s`` becomes the median over the runs
    in which it succeeded, and ``repeat_time_s`` lists them.

    Args:
        runs: Records of the same configuration (one or more).

    Returns:
        The combined record (the record itself for a single run).
    """
    if len(runs) == 1:
        return runs[0]
    totals = [(_fit_marglik(r), i) for i, r in enumerate(runs)]
    totals = sorted(t for t in totals if t[0] is not None)
    base = runs[totals[(len(totals) - 1) // 2][1]] if totals else runs[0]
    record = json.loads(json.dumps(base))
    for phase, entry in record["phases"].items():
        values = [r["phases"][phase]["time_s"] for r in runs
                  if r["phases"].get(phase, {}).get("status") == "ok"]
        if entry.get("status") == "ok" and values:
            entry["time_s"] = statistics.median(values)
            entry["repeat_time_s"] = values
        loads = [r["phases"][phase].get("other_cpu_percent_during_phase") for r in runs
                 if phase in r["phases"]]
        loads = [v for v in loads if v is not None]
        if loads:  # the most disturbed of the runs
            entry["repeat_other_cpu_percent_during_phase"] = loads
            entry["other_cpu_percent_during_phase"] = max(loads)
    others = [r.get("other_cpu_percent_during") for r in runs]
    record["repeat_other_cpu_percent_during"] = others
    others = [v for v in others if v is not None]
    if others:
        record["other_cpu_percent_during"] = max(others)
    record["repeats"] = len(runs)
    return record


def sizes(problem: str, args: argparse.Namespace) -> dict[str, int]:
    """Numbers of sequences and the padded length of a problem's run.

    Args:
        problem: Problem name.
        args: Parsed command line arguments of the driver.

    Returns:
        ``n_train``, ``n_test`` and ``seq_len`` (problem defaults, ``--quick`` sizes,
        then the command line's overrides).
    """
    spec = PROBLEMS[problem]
    size = {key: spec[key] for key in ("n_train", "n_test", "seq_len")}
    if args.quick:
        size.update(spec["quick"])
    for key in size:
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    size["seq_len"] = min(size["seq_len"], spec["positions"])
    return size


def plan(problem: str, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The ``(attention, condition, method)`` configurations of a problem.

    Args:
        problem: Problem name.
        args: Parsed command line arguments of the driver.

    Returns:
        The configurations, in the order they run in every round.
    """
    spec = PROBLEMS[problem]
    attentions = [a for a in spec["attentions"] if a in args.attentions]
    conditions = [c for c in spec["conditions"] if c in args.conditions]
    return [(a, c, m) for a in attentions for c in conditions for m in args.methods]


def repeats(problem: str, args: argparse.Namespace) -> int:
    """Runs per configuration of a problem (``--repeat``, else the problem's default)."""
    if args.repeat is not None:
        return args.repeat
    return 1 if args.quick else PROBLEMS[problem]["repeat"]


###############################################################################
#                                  Report                                     #
###############################################################################


def _find(records: Sequence[dict], attention: str, condition: str, method: str
          ) -> dict | None:
    """The record of a configuration, ``None`` if it did not run."""
    for r in records:
        if (r["attention"], r["condition"], r["method"]) == (attention, condition, method):
            return r
    return None


def _ok(record: dict | None, phase: str) -> dict | None:
    """A phase's record if it succeeded, else ``None``."""
    if record is None:
        return None
    r = record["phases"].get(phase)
    return r if r and r.get("status") == "ok" else None


def _fit_marglik(record: dict | None) -> float | None:
    """Fit plus marglik time of a configuration (``None`` if either failed)."""
    fit, marglik = _ok(record, "fit"), _ok(record, "marglik")
    return None if fit is None or marglik is None else fit["time_s"] + marglik["time_s"]


def _glm(record: dict | None) -> float | None:
    """GLM predictive time of a configuration (``None`` if it failed)."""
    glm = _ok(record, "glm")
    return None if glm is None else glm["time_s"]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (``'-'`` for ``None``)."""
    return "-" if value is None else f"{value:.{digits}g}"


def _status(record: dict | None, phase: str) -> str:
    """The cell of a phase: short status of a failure or skip."""
    if record is None:
        return "not run"
    r = record["phases"].get(phase) or {}
    status = str(r.get("status", "?"))
    if status == "skipped":
        return "-"
    if status == "timeout":
        return f"timeout (> {r.get('time_to_failure_s', 0):.0f} s)"
    if status == "oom":
        text = "out of memory" + (f" after {r['time_to_failure_s']:.0f} s"
                                  if r.get("time_to_failure_s") else "")
        match = re.search(r"allocate (\d+) bytes", str(r.get("reason") or ""))
        if match:
            text += f" (allocating {int(match[1]) / GiB:.2g} GiB more)"
        return text
    reason = str(r.get("reason") or "").splitlines()
    return f"{status}: {reason[0][:60]}" if reason else status


def _others(record: dict | None) -> float | None:
    """Largest CPU share of other processes during a configuration's measured phases."""
    if record is None:
        return None
    values = [r.get("other_cpu_percent_during_phase") for r in record["phases"].values()
              if r.get("status") == "ok"]
    values = [v for v in values if v is not None]
    if not values and record.get("other_cpu_percent_during") is not None:
        values.append(record["other_cpu_percent_during"])
    return max(values) if values else None


def summarize(problem: str, records: Sequence[dict]) -> dict[str, Any]:
    """Ratios against ``kron`` of every group and the targets of a problem.

    Args:
        problem: Problem name.
        records: Configuration records of the problem.

    Returns:
        ``ratios`` (per ``attention/condition``: ours' fit + marglik and GLM time over
        kron's) and ``targets`` (name, value, bound, ``passed``; ``None``: not
        measurable).
    """
    ratios, targets = {}, []
    groups = sorted({(r["attention"], r["condition"]) for r in records},
                    key=lambda g: (ATTENTIONS.index(g[0]), CONDITIONS.index(g[1])))
    for attention, condition in groups:
        ours, peer = (_find(records, attention, condition, m) for m in (OURS, PEER))
        fm = _ratio(_fit_marglik(ours), _fit_marglik(peer))
        glm = _ratio(_glm(ours), _glm(peer))
        ratios[f"{attention}/{condition}"] = {"fit_marglik_vs_kron": fm, "glm_vs_kron": glm}
        if attention != "sdpa" or problem not in ("small", "large"):
            continue
        where = f"{problem}, sdpa, {CONDITION_LABELS[condition]}"

        def add(name, value, bound, phases=("fit", "marglik"), ours=ours, peer=peer,
                where=where):
            failed = [p for p in phases if peer is not None and
                      _ok(peer, p) is None and _ok(ours, p) is not None]
            note = f"{PEER} {_status(peer, failed[0])}" if failed else None
            targets.append({"name": name, "where": where, "value": value, "bound": bound,
                            "passed": None if value is None else value <= bound,
                            "peer_failure": note})

        add(f"{OURS} fit + marglik <= {TARGET_FIT_MARGLIK_VS_KRON:g}x {PEER}'s", fm,
            TARGET_FIT_MARGLIK_VS_KRON)
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
        fit = _ok(r, "fit") or {}
        peak = r.get("worker_peak_bytes")
        print(f"  {r['attention']:<5} {r['condition']:<6} {r['method']:<11} "
              f"{_fmt(fm) if fm is not None else _status(r, 'fit' if not fit else 'marglik'):>12}"
              f" {_fmt(glm) if glm is not None else _status(r, 'glm'):>12} "
              f"{'-' if peak is None else f'{peak / GiB:.2f}':>6} "
              f"{fit.get('factor_backend_used', '')}", flush=True)
    for t in summary["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}x"
        extra = f" ({t['peer_failure']})" if t.get("peer_failure") else ""
        print(f"  TARGET [{t['where']}] {t['name']}: {value} -> "
              f"{'PASS' if t['passed'] else 'FAIL' if t['passed'] is False else 'n/a'}{extra}",
              flush=True)
    others = [v for v in (_others(r) for r in records) if v is not None]
    if others and max(others) > BUSY_WARN_PERCENT:
        print(f"  WARNING: other processes used up to {max(others):.0f}% of the CPU during "
              "a measured phase; timings may be inflated.", flush=True)


def _progress(record: dict[str, Any]) -> str:
    """One line about a finished configuration."""
    parts = []
    for phase in PHASES:
        r = record["phases"].get(phase, {})
        if r.get("status") == "ok":
            parts.append(f"{phase} {r['time_s']:.3g} s")
        else:
            parts.append(f"{phase} {_status(record, phase)}")
    fit = _ok(record, "fit") or {}
    if fit.get("factor_backend_used"):
        parts.append(f"engine {fit['factor_backend_used']}")
    peak = record.get("worker_peak_bytes")
    if peak is not None:
        parts.append(f"peak {peak / GiB:.2f} GiB")
    others = record.get("other_cpu_percent_during")
    if others is not None:
        parts.append(f"others {others:.0f}% CPU")
    if record.get("load"):
        parts.append(f"load {record['load'].get('matmuls_per_s', 0):.0f} matmuls/s")
    key = config_key(record["problem"], record["attention"], record["condition"],
                     record["method"])
    return f"  {key}: " + ", ".join(parts)


def plot(problem: str, payload: dict[str, Any], path: Path):
    """Bar charts: fit + marglik and GLM time (log scale) and worker peak memory.

    Args:
        problem: Problem name.
        payload: The run as written to ``lora_<problem>.json``.
        path: Output path of the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = payload["records"]
    groups = sorted({(r["attention"], r["condition"]) for r in records},
                    key=lambda g: (ATTENTIONS.index(g[0]), CONDITIONS.index(g[1])))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    width = 0.8 / max(1, len(METHODS))
    colors = {"lowrank_ggn": "tab:blue", "kron": "tab:gray", "diag": "tab:olive"}
    panels = [("fit + marglik [s]", _fit_marglik, True), ("GLM predictive [s]", _glm, True),
              ("worker peak memory [GiB]",
               lambda r: None if r.get("worker_peak_bytes") is None
               else r["worker_peak_bytes"] / GiB, False)]
    for ax, (label, value_of, log) in zip(axes, panels):
        for j, method in enumerate(METHODS):
            for i, (attention, condition) in enumerate(groups):
                r = _find(records, attention, condition, method)
                if r is None:
                    continue
                x = i + (j - (len(METHODS) - 1) / 2) * width
                value = value_of(r)
                if value is None:
                    ax.plot(x, 1.0 if log else 0.0, "x", color="tab:red", ms=9)
                    continue
                ax.bar(x, value, width, color=colors[method])
                ax.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{a}\n{CONDITION_LABELS[c]}" for a, c in groups], fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(label)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in METHODS]
    fig.legend(handles, list(METHODS), loc="upper right", fontsize=8, ncol=len(METHODS))
    info = payload["machine"]
    where = info.get("device_name") if info.get("device") == "cuda" else \
        f"{info.get('cpu_name')} ({info.get('cpu_count_usable')} cores)"
    s = payload["settings"]
    fig.suptitle(f"LoRA {problem}: D = {s.get('D', '?')}, {s['n_train']} / {s['n_test']} "
                 f"sequences; {where}, torch {info.get('torch')}; red x: failed", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_records(payloads: dict[str, dict], source_dir: str) -> dict[str, dict]:
    """The docs' table records (``render_tables.py`` format) of a run.

    Args:
        payloads: The runs by problem, as written to ``lora_<problem>.json``.
        source_dir: Folder of the kept raw runs, relative to the repository root.

    Returns:
        Records by table id: ``lora_<problem>`` for every problem and
        ``lora_targets``.
    """
    tables: dict[str, dict] = {}
    target_rows, sources, commits = [], [], []
    for problem, payload in payloads.items():
        info, records, s = payload["machine"], payload["records"], payload["settings"]
        machine = {key: info.get(key) for key in (
            "cpu_name", "cpu_count", "cpu_count_usable", "device", "device_name",
            "total_memory_bytes", "platform")}
        versions = {"python": info.get("python"), "torch": info.get("torch")}
        versions.update({key[len("version_"):]: value for key, value in info.items()
                         if key.startswith("version_")})
        # the workers' state of the library (it may change while a run goes on)
        prints = [r["setup"]["lowrank_laplace"] for r in records
                  if r.get("setup", {}).get("lowrank_laplace")]
        heads = sorted({f.get("git_head", "?")[:7] for f in prints}) or \
            [payload.get("git_head", "?")[:7]]
        versions["lowrank_laplace commit"] = ", ".join(heads) + (
            " (sources changed during the run)"
            if len({f.get("sources_sha1") for f in prints}) > 1 else "")
        source = f"{source_dir}/lora_{problem}.json"
        sources.append(source)
        common = {"date": info["date"][:10], "machine": machine, "versions": versions,
                  "sources": [source]}
        cuda = info.get("device") == "cuda"
        rows = []
        for r in records:
            fm, glm = _fit_marglik(r), _glm(r)
            peer = _find(records, r["attention"], r["condition"], PEER)
            fit, marglik = _ok(r, "fit"), _ok(r, "marglik")
            peak = r.get("worker_peak_bytes")
            others = _others(r)
            engine = (fit or {}).get("factor_backend_used") or "-"
            if fit and fit.get("kept_fraction") is not None:
                engine += (f" (rank {fit.get('rank', '?')}, keeps "
                           f"{100 * fit['kept_fraction']:.0f}% of the trace)")
            rows.append([
                r["attention"], CONDITION_LABELS[r["condition"]], LABELS[r["method"]],
                _fmt(fit["time_s"]) if fit else _status(r, "fit"),
                _fmt(marglik["time_s"]) if marglik else _status(r, "marglik"),
                _fmt(fm),
                "-" if r["method"] == PEER or fm is None else
                _fmt(_ratio(fm, _fit_marglik(peer))) + "x" if _fit_marglik(peer) else "-",
                _fmt(glm) if glm is not None else _status(r, "glm"),
                "-" if r["method"] == PEER or glm is None else
                _fmt(_ratio(glm, _glm(peer))) + "x" if _glm(peer) else "-",
                "-" if peak is None else f"{peak / GiB:.2f}", engine,
                "-" if others is None else f"{others:.0f}"])
        repeat = s.get("repeat", 1)
        note = (f"D = {s.get('D')} trainable of {s.get('frozen_params')} frozen weights; "
                f"{s['n_train']} / {s['n_test']} sequences of up to {s['seq_len']} tokens, "
                f"batch {s['batch_size']}; {s['threads']} torch threads per worker; "
                + (f"median of {repeat} runs (fresh processes, rounds over the methods); "
                   if repeat > 1 else "one run; ")
                + "beside other work: a process with "
                f"{s.get('load_threads')} threads of 512x512 matmuls runs meanwhile; "
                "others' CPU: share of other processes (not the synthetic load) during the "
                "measured phases.")
        tables[f"lora_{problem}"] = {**common, "note": note, "columns": [
            "attention", "machine", "method", "fit [s]", "marglik [s]", "fit + marglik [s]",
            "/ kron's", "GLM predictive [s]", "/ kron's",
            "peak CUDA memory [GiB]" if cuda else "worker peak RSS [GiB]", "engine",
            "others' CPU [%]"], "rows": rows}
        for t in payload["summary"]["targets"]:
            value = "-" if t["value"] is None else f"{t['value']:.2f}x"
            if t.get("peer_failure"):
                value += f" ({t['peer_failure']})"
            verdict = {True: "PASS", False: "FAIL", None: "not measurable"}[t["passed"]]
            target_rows.append([t["name"], t["where"], value, verdict])
        target_common = common
        commits.append(versions["lowrank_laplace commit"])
    if target_rows:
        target_common = {**target_common, "versions": {
            **target_common["versions"], "lowrank_laplace commit": "; ".join(
                f"{problem}: {commit}" for problem, commit in zip(payloads, commits))}}
        tables["lora_targets"] = {**target_common, "sources": sources,
                                  "note": "Ratios of the tables above, within one run.",
                                  "columns": ["target", "where", "measured", "verdict"],
                                  "rows": target_rows}
    return tables


###############################################################################
#                                  Driver main                                #
###############################################################################


def _settings(problem: str, args: argparse.Namespace, setup: dict | None) -> dict[str, Any]:
    """The settings of a problem's run (written first in its JSON file)."""
    spec = PROBLEMS[problem]
    settings = {"problem": problem, **sizes(problem, args), "batch_size": args.batch_size,
                "model": {k: spec[k] for k in ("layers", "width", "heads", "vocab",
                                                "positions", "min_len")},
                "lora": {"r": spec["r"], "lora_alpha": spec["alpha"],
                         "target_modules": list(spec["targets"])},
                "methods": list(args.methods), "configurations": [
                    config_key(problem, *c) for c in plan(problem, args)],
                "repeat": repeats(problem, args), "threads": args.threads,
                "load_threads": args.load_threads, "timeout_s_per_phase": args.timeout,
                "mem_limit_gib": args.mem_limit_gib, "retry_busy": args.retry_busy,
                "seed": args.seed, "wait_for": list(args.wait_for), "wait_idle": args.wait_idle}
    if setup:
        settings.update({k: setup.get(k) for k in ("D", "frozen_params")})
    return settings


def _payload(problem, args, info, head, records, summary, started) -> dict[str, Any]:
    setup = next((r["setup"] for r in records if r.get("setup", {}).get("status") == "ok"),
                 None)
    return {"settings": _settings(problem, args, setup), "machine": info, "git_head": head,
            "worker_env": {"OPENBLAS_NUM_THREADS": args.blas_threads or None,
                           "OMP_WAIT_POLICY": args.omp_wait_policy or None},
            "records": records, "summary": summary,
            "total_wall_s": time.perf_counter() - started}


#: Settings that must match for ``--resume`` to reuse a previous record.
RESUME_KEYS = ("n_train", "n_test", "seq_len", "batch_size", "seed", "threads",
               "load_threads", "mem_limit_gib")


def _previous(path: Path, problem: str, args: argparse.Namespace) -> dict[str, dict]:
    """Records of a previous run with the same settings, by configuration key."""
    if not path.exists():
        return {}
    payload = json.loads(path.read_text())
    now = _settings(problem, args, None)
    mismatch = [k for k in RESUME_KEYS if payload["settings"].get(k) != now[k]]
    if payload.get("machine", {}).get("device") != args.device:
        mismatch.append("device")
    if mismatch:
        print(f"  --resume: not reusing {path} (different {', '.join(mismatch)})")
        return {}
    return {config_key(r["problem"], r["attention"], r["condition"], r["method"]): r
            for r in payload["records"]}


def _records_so_far(problem: str, configs: Sequence[tuple], done: dict[str, dict],
                    runs: dict[str, list]) -> list[dict]:
    """The records of a problem's configurations so far, in plan order.

    Args:
        problem: Problem name.
        configs: The ``(attention, condition, method)`` configurations.
        done: Records reused from a previous run, by configuration key.
        runs: The runs of this invocation, by configuration key.

    Returns:
        One record per configuration that has one (repeats combined by median).
    """
    records = []
    for config in configs:
        key = config_key(problem, *config)
        if key in done:
            records.append(done[key])
        elif runs.get(key):
            records.append(median_record(runs[key]))
    return records


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration, write JSON, figures and tables, print the targets.

    Args:
        args: Parsed command line arguments of the driver.

    Returns:
        Summaries by problem.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    payloads: dict[str, dict] = {}
    if args.replot:
        for problem in args.problems:
            path = out / f"lora_{problem}.json"
            if not path.exists():
                print(f"--replot: no {path}")
                continue
            payload = json.loads(path.read_text())
            payload["summary"] = summarize(problem, payload["records"])
            path.write_text(json.dumps(payload, indent=2))
            plot(problem, payload, out / f"lora_{problem}.png")
            print_summary(problem, payload["records"], payload["summary"])
            payloads[problem] = payload
    else:
        info = _harness.machine_info(args.device, PACKAGES)
        info["lowrank_laplace_sources"] = _laplace_worker.library_fingerprint()
        head = info["lowrank_laplace_sources"].get("git_head", "?")
        print(f"Machine: {info['cpu_name']} ({info['cpu_count']} CPUs, "
              f"{info['cpu_count_usable']} usable), torch {info['torch']}, laplace-torch "
              f"{info.get('version_laplace-torch')}, transformers "
              f"{info.get('version_transformers')}, peft {info.get('version_peft')}, "
              f"device {args.device} ({info['device_name']})", flush=True)
        for problem in args.problems:
            configs = plan(problem, args)
            n = repeats(problem, args)
            print(f"\n### {problem}: {sizes(problem, args)}, {len(configs)} configurations x "
                  f"{n} run(s), timeout {args.timeout:g} s per phase", flush=True)
            path = out / f"lora_{problem}.json"
            previous = _previous(path, problem, args) if args.resume else {}
            done = {config_key(problem, *c): previous[config_key(problem, *c)]
                    for c in configs if config_key(problem, *c) in previous
                    and config_key(problem, *c) not in args.rerun}
            for record in done.values():
                print(_progress(record) + " (from the previous run)", flush=True)
            runs: dict[str, list] = {config_key(problem, *c): [] for c in configs
                                     if config_key(problem, *c) not in done}

            for round_ in range(n):
                for config in configs:
                    key = config_key(problem, *config)
                    if key not in runs:
                        continue
                    runs[key].append(run_config(problem, *config, args))
                    suffix = f" (run {round_ + 1} of {n})" if n > 1 else ""
                    print(_progress(runs[key][-1]) + suffix, flush=True)
                    records = _records_so_far(problem, configs, done, runs)
                    path.write_text(json.dumps(
                        _payload(problem, args, info, head, records, None, started), indent=2))
            records = _records_so_far(problem, configs, done, runs)
            summary = summarize(problem, records)
            payload = _payload(problem, args, info, head, records, summary, started)
            path.write_text(json.dumps(payload, indent=2))
            plot(problem, payload, out / f"lora_{problem}.png")
            print_summary(problem, records, summary)
            print(f"Wrote {path} and {out / f'lora_{problem}.png'}", flush=True)
            payloads[problem] = payload
    if payloads:
        tables_dir = out / "lora_tables"
        tables_dir.mkdir(exist_ok=True)
        for table_id, record in table_records(payloads, args.table_source).items():
            (tables_dir / f"{table_id}.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"\nWrote the table records to {tables_dir}/ "
              f"({(time.perf_counter() - started) / 60:.1f} min in all)", flush=True)
    return {problem: p["summary"] for problem, p in payloads.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse command line arguments.

    Args:
        argv: Arguments; defaults to ``sys.argv[1:]``.

    Returns:
        Parsed arguments.
    """
    parser = _harness.script_parser(__doc__)
    parser.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS),
                        choices=list(PROBLEMS), help="Problems.")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="Methods.")
    parser.add_argument("--attentions", nargs="+", default=list(ATTENTIONS),
                        choices=ATTENTIONS,
                        help="Attention implementations (of those a problem runs).")
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS),
                        choices=CONDITIONS,
                        help="Machine conditions (of those a problem runs): quiet, or "
                        "loaded (beside a competing process).")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="Device of models, data and curvature.")
    parser.add_argument("--n-train", type=int, default=None,
                        help="Training sequences (default: the problem's).")
    parser.add_argument("--n-test", type=int, default=None,
                        help="Test sequences (default: the problem's).")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="Padded sequence length (default: the problem's).")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="Loader batch.")
    parser.add_argument("--repeat", type=int, default=None,
                        help="Runs per configuration, median times (default: small 3, "
                        "otherwise 1; 1 with --quick).")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads in workers (0: number of usable cores).")
    parser.add_argument("--load-threads", type=int, default=2,
                        help="torch threads of the competing load (loaded condition).")
    _harness.add_worker_env_arguments(parser)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="Time limit per phase of a worker in seconds.")
    parser.add_argument("--mem-limit-gib", type=float, default=18.0,
                        help="Address-space cap (RLIMIT_AS) of CPU workers in GiB, lowered "
                        "to what the machine can back; 0: no cap.")
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument("--out", default=None,
                        help="Output directory (default: benchmarks/results, with --quick "
                        "benchmarks/results/quick).")
    parser.add_argument("--table-source", default="docs/benchmarks/lora",
                        help="Where the raw runs are kept (named as the tables' sources).")
    parser.add_argument("--wait-for", nargs="*", default=[], metavar="PATTERN",
                        help="Before each worker, wait while other processes whose command "
                        "line contains one of these strings use CPU (e.g. pytest bench_).")
    parser.add_argument("--wait-max", type=float, default=1200.0,
                        help="Maximum wait for --wait-for [s].")
    parser.add_argument("--wait-poll", type=float, default=30.0,
                        help="Polling interval of --wait-for [s].")
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="Before each worker, wait up to this many seconds for the CPU "
                        f"to be < {BUSY_WARN_PERCENT:g}%% busy; 0: do not wait.")
    parser.add_argument("--retry-busy", type=int, default=2,
                        help="Repeat a configuration up to this many times if other "
                        f"processes used more than {BUSY_WARN_PERCENT:g}%% of the CPU during "
                        "its worker (the least disturbed run is kept).")
    parser.add_argument("--resume", action="store_true",
                        help="Reuse the records of configurations already in "
                        "<out>/lora_<problem>.json from a run with the same settings.")
    parser.add_argument("--rerun", nargs="*", default=[], metavar="PROBLEM/ATTN/COND/METHOD",
                        help="With --resume: run these configurations again.")
    parser.add_argument("--replot", action="store_true",
                        help="Run nothing: summaries, figures and tables of the existing "
                        "<out>/lora_<problem>.json files.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: fewer sequences (small 64 / 32, large 64 / 16 of "
                        "up to 32 tokens), one run per configuration, timeout 300 s, no "
                        "--retry-busy.")
    # worker-only arguments
    parser.add_argument("--problem", help=argparse.SUPPRESS)
    parser.add_argument("--attention", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--load-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(_harness.RESULTS_DIR / "quick") if args.quick else \
            str(_harness.RESULTS_DIR)
    if args.quick and not args.worker:
        args.timeout = min(args.timeout, 300.0)
        args.retry_busy = 0
    for key in args.rerun:
        if key.count("/") != 3:
            parser.error(f"--rerun expects PROBLEM/ATTENTION/CONDITION/METHOD, got {key!r}.")
    return args


def main(argv: Sequence[str] | None = None):
    """Entry point (``argv`` defaults to ``sys.argv[1:]``): see :func:`_harness.run_script`."""
    _harness.run_script(argv, parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
