"""Benchmark Laplace over the LoRA adapters of a Hugging Face GPT-2 classifier.

laplace-torch's Hugging Face recipe (``docs/lora.md``) on config-built models with random
weights (nothing downloaded) and PEFT LoRA adapters: ``lowrank_ggn`` with its defaults
against laplace-torch's ``kron`` and ``diag`` (``backend=CurvlinopsGGN``) on the problems
of :data:`PROBLEMS` (``gpt2`` and the Llama of about 1B weights with Laplace-LoRA's
multiple-choice head, ``llama1b``, are meant for a GPU; ``llama_tiny`` is its CPU
version; ``bert`` is a full fine-tune, fitted by default and on the torch.func backend).
Every configuration (attention, machine condition ``quiet`` or ``loaded`` beside a
``_load.CompetingLoad``, method) runs in fresh workers with the phases ``fit``,
``marglik`` and the GLM probit predictive ``glm``. ``--fit-budget-s`` shrinks a fit to
its first batches; ``--processes`` fits ``lowrank_ggn`` on several torchrun processes.

Examples::

    python -m benchmarks.bench_lora --quick   # smoke test, into benchmarks/results/quick
    python -m benchmarks.bench_lora --wait-for pytest bench_ --wait-idle 600
    python -m benchmarks.bench_lora --device cuda --problems large gpt2

Writes ``<out>/lora_<problem>.json`` and ``.png``, and the docs' table records
``<out>/lora_tables/lora_<problem>.json`` and ``lora_targets.json`` (their ``sources``
name ``--table-source``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import _harness, _problems
from benchmarks import _lora_report as report
from benchmarks._lora_report import FUNCTORCH, NUM_CLASSES, OURS, PROBLEM_METHODS
from benchmarks._report import DEFAULT_PACKAGES, machine_info, print_machine, read_run, write_tables
from benchmarks._worker import fit_within, probs_warnings, run_phases, worker_setup

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
#: A Llama-architecture model of about 1B weights (bfloat16, float32 adapters) and its
#: tiny CPU version: the multiple-choice head of Laplace-LoRA over 4 answer tokens.
LLAMA = {"arch": "llama", "r": 8, "alpha": 16, "targets": ("q_proj", "v_proj"), "classes": 4,
         "attentions": ("sdpa",), "conditions": ("quiet",), "repeat": 1}
PROBLEMS.update({
    "llama1b": {**LLAMA, "layers": 16, "width": 2048, "heads": 32, "kv_heads": 4,
                "intermediate": 5632, "vocab": 32000, "positions": 256, "seq_len": 256,
                "min_len": 256, "answers": (319, 350, 315, 360), "n_train": 4096,
                "n_test": 256, "test_batch": 32, "quick": {"n_train": 64, "n_test": 32}},
    "llama_tiny": {**LLAMA, "layers": 2, "width": 64, "heads": 4, "kv_heads": 2,
                   "intermediate": 128, "vocab": 200, "positions": 16, "seq_len": 16,
                   "min_len": 16, "answers": (10, 11, 12, 13), "n_train": 16, "n_test": 8,
                   "test_batch": 4, "quick": {}}})
#: A BERT full fine-tune (every weight trainable; no LoRA): the default fit against the
#: same posterior on the torch.func backend.
PROBLEMS["bert"] = {"arch": "bert", "layers": 2, "width": 128, "heads": 2, "intermediate": 256,
                    "vocab": 100, "positions": 32, "seq_len": 16, "min_len": 4,
                    "n_train": 256, "n_test": 128, "methods": (OURS, FUNCTORCH),
                    "attentions": ("sdpa",), "conditions": ("quiet",), "repeat": 3,
                    "quick": {"n_train": 32, "n_test": 8}}
#: Problems run without ``--problems``.
DEFAULT_PROBLEMS: tuple[str, ...] = ("small", "large")
BATCH_SIZE = 32
#: Size of the competing load's square matrices.
LOAD_SIZE = 512
#: Settings that must match for ``--resume`` to reuse a previous record.
RESUME_KEYS = ("n_train", "n_test", "seq_len", "batch_size", "seed", "threads",
               "load_threads", "mem_limit_gib")


class Sequences(torch.utils.data.Dataset):
    """``n`` random token sequences of ``min_len`` to ``seq_len`` tokens, padded, with
    random binary labels (dict samples on ``device``, where the default collate stacks
    them). Tokens 0 and 1 (padding and BOS/EOS) are not drawn."""

    def __init__(self, n: int, seq_len: int, spec: dict[str, Any], seed: int,
                 device: torch.device):
        min_len, vocab = min(spec["min_len"], seq_len), spec["vocab"]
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(min_len, seq_len + 1, (n,), generator=gen)
        mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
        self.mask = mask.to(device)
        self.ids = (torch.randint(2, vocab, (n, seq_len), generator=gen) * mask).to(device)
        self.labels = torch.randint(0, spec.get("classes", NUM_CLASSES), (n,),
                                    generator=gen).to(device)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.labels[i]}


def make_model(problem: str, attention: str, seed: int, device: torch.device) -> nn.Module:
    """The LoRA-adapted model of a problem (random weights, eval mode, the
    ``attn_implementation`` ``attention``), wrapped: dict batch in, logits out (a Llama:
    :func:`_problems.make_llama`, built on ``device``)."""
    import transformers as hf
    from peft import LoraConfig, get_peft_model

    spec = PROBLEMS[problem]
    if spec.get("arch") == "llama":
        return _problems.make_llama(spec, attention, seed, device)
    if spec.get("arch") == "bert":
        config = hf.BertConfig(vocab_size=spec["vocab"], hidden_size=spec["width"],
                               num_hidden_layers=spec["layers"],
                               num_attention_heads=spec["heads"],
                               intermediate_size=spec["intermediate"],
                               max_position_embeddings=spec["positions"],
                               num_labels=NUM_CLASSES, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        torch.manual_seed(seed)
        return _problems.Logits(hf.BertForSequenceClassification._from_config(
            config, attn_implementation=attention)).eval()
    config = hf.GPT2Config(n_layer=spec["layers"], n_embd=spec["width"], n_head=spec["heads"],
                        vocab_size=spec["vocab"], n_positions=spec["positions"],
                        num_labels=NUM_CLASSES, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(seed)
    base = hf.GPT2ForSequenceClassification._from_config(config, attn_implementation=attention)
    lora = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], target_modules=list(spec["targets"]),
                      task_type="SEQ_CLS")
    return _problems.Logits(get_peft_model(base, lora)).eval()


def worker_main(config: dict[str, Any]):
    """Build the problem, then run and report the phases of one configuration."""
    from torch.utils.data import DataLoader

    setup = worker_setup(config)
    device = torch.device(config["device"])
    import laplace
    from laplace.curvature import CurvlinopsGGN

    import lowrank_laplace  # noqa: F401 (registers hessian_structure="lowrank_ggn")

    spec, seed = PROBLEMS[config["problem"]], config["seed"]
    rank, world, device = distributed_start(device)
    model = make_model(config["problem"], config["attention"], seed, device).to(device)
    data = [Sequences(config[n], config["seq_len"], spec, seed + i, device)
            for i, n in ((1, "n_train"), (2, "n_test"))]
    shard = torch.utils.data.Subset(data[0], range(rank, len(data[0]), world))
    loader = DataLoader(shard, batch_size=config["batch_size"], shuffle=False)
    tests = list(DataLoader(data[1], batch_size=spec.get("test_batch", config["n_test"])))
    setup.update(D=sum(p.numel() for p in model.parameters() if p.requires_grad),
                 frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
                 attention_used=getattr(model.model.config, "_attn_implementation", None),
                 processes=world)
    kwargs: dict[str, Any] = {
        OURS: {"hessian_structure": OURS},
        FUNCTORCH: {"hessian_structure": OURS, "factor_backend": "functorch"},
    }.get(config["method"], {"hessian_structure": config["method"], "backend": CurvlinopsGGN})
    setup["laplace_kwargs"] = {k: getattr(v, "__name__", v) for k, v in kwargs.items()}
    state: dict[str, Any] = {}

    def make():
        torch.manual_seed(seed)
        return laplace.Laplace(model, "classification", subset_of_weights="all",
                               dict_key_y="labels", **kwargs)

    loader, sizes = fit_within(lambda part: make().fit(part), loader,
                               config["fit_budget_s"] if world == 1 else 0)

    def fit():
        state["la"] = make()
        state["la"].fit(loader)
        return state["la"]

    def fitted(la) -> dict[str, Any]:
        fields = {"H_type": type(la.H).__name__, **sizes}
        for key in ("factor_backend_used", "fit_path", "rank"):
            if isinstance(getattr(la, key, None), (str, int)):
                fields[key] = getattr(la, key)
        if config["method"] == OURS:
            fields["kept_fraction"] = float(la.kept_fraction)
        return fields

    def marglik():
        state["la"].optimize_prior_precision(method="marglik")
        return state["la"].prior_precision.detach().cpu().reshape(-1).tolist()[:4]

    def glm():
        torch.manual_seed(seed)
        return torch.cat([state["la"](batch, pred_type="glm", link_approx="probit").detach()
                          for batch in tests])

    run_phases(setup, [("fit", fit, fitted),
                       ("marglik", marglik, lambda prior: {"prior_precision": prior}),
                       ("glm", glm, probs_warnings(config["n_test"],
                                                   spec.get("classes", NUM_CLASSES)))], config)


def distributed_start(device: torch.device) -> tuple[int, int, torch.device]:
    """Join torchrun's process group, if any: ``(rank, world size, device)``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if torch.distributed.get_rank() > 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
    return int(os.environ.get("RANK", "0")), world, device


def sizes(problem: str, args: argparse.Namespace) -> dict[str, int]:
    """``n_train``, ``n_test`` and ``seq_len`` of a problem's run."""
    spec = PROBLEMS[problem]
    size = {key: spec[key] for key in ("n_train", "n_test", "seq_len")}
    if args.quick:
        size.update(spec["quick"])
    size.update({key: getattr(args, key) for key in size if getattr(args, key) is not None})
    size["seq_len"] = min(size["seq_len"], spec["positions"])
    return size


def repeats(problem: str, args: argparse.Namespace) -> int:
    """Runs per configuration of a problem (``--repeat``, else the problem's default)."""
    if args.repeat is not None:
        return args.repeat
    return 1 if args.quick else PROBLEMS[problem]["repeat"]


def configurations(problem: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The configurations of a problem, in the order they run in every round."""
    spec = PROBLEMS[problem]
    common = {**sizes(problem, args), "phases": list(report.PHASES),
              "repeat": repeats(problem, args), **{k: getattr(args, k) for k in (
                  "batch_size", "seed", "threads", "device", "mem_limit_gib", "fit_budget_s")}}
    load = {"threads": args.load_threads, "size": LOAD_SIZE, "env": "worker"}
    if args.processes > 1:  # torchrun's processes: the first one reports
        common["launcher"] = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={args.processes}"]
    return [{"problem": problem, "attention": a, "condition": c, "method": m, **common,
             **({"load": load} if c == "loaded" else {})}
            for a in spec["attentions"] if a in args.attentions
            for c in spec["conditions"] if c in args.conditions for m in args.methods
            if m in spec.get("methods", PROBLEM_METHODS)]


def settings(problem: str, args: argparse.Namespace) -> dict[str, Any]:
    """The settings of a problem's run (``D`` and ``frozen_params`` from its workers)."""
    spec = PROBLEMS[problem]
    return {"problem": problem, **sizes(problem, args), "batch_size": args.batch_size,
            "model": {k: spec[k] for k in ("layers", "width", "heads", "vocab", "positions",
                                            "min_len")},
            "lora": {"r": spec["r"], "lora_alpha": spec["alpha"],
                     "target_modules": list(spec["targets"])} if "r" in spec else None,
            "methods": [m for m in args.methods if m in spec.get("methods", PROBLEM_METHODS)],
            "repeat": repeats(problem, args),
            "device": args.device, "D": None, "frozen_params": None,
            "processes": args.processes,
            **{k: getattr(args, k) for k in ("threads", "load_threads", "mem_limit_gib",
                                             "retry_busy", "seed", "wait_for", "wait_idle")},
            "timeout_s_per_phase": args.timeout}


def driver_main(args: argparse.Namespace) -> dict[str, Any]:
    """Run every configuration, write JSON, figures and tables; the summaries by problem."""
    out, payloads = Path(args.out), {}
    info = None if args.replot else machine_info(args.device, (
        *DEFAULT_PACKAGES, "laplace-torch", "transformers", "peft"))
    if info:
        print_machine(info)
    for problem in args.problems:
        path = out / f"lora_{problem}.json"
        if args.replot:
            payload = read_run(path)
            if payload is None:
                continue
            payload["summary"] = report.summarize(problem, payload["records"])
            path.write_text(json.dumps(payload, indent=2))
        else:
            plan = _harness.Plan("benchmarks.bench_lora", configurations(problem, args),
                                 ("problem", "attention", "condition", "method"), path,
                                 settings(problem, args), info)
            print(f"\n### {problem}: {sizes(problem, args)}, {len(plan.configs)} "
                  f"configurations x {repeats(problem, args)} run(s), timeout "
                  f"{args.timeout:g} s per phase", flush=True)
            records = plan.run(args, RESUME_KEYS)
            payload = plan.write(records, report.summarize(problem, records), args)
        report.plot(problem, payload, out / f"lora_{problem}.png")
        report.print_summary(problem, payload["records"], payload["summary"])
        print(f"Wrote {path} and {out / f'lora_{problem}.png'}", flush=True)
        payloads[problem] = payload
    if payloads:
        write_tables(report.table_records(payloads, args.table_source), out / "lora_tables")
    return {problem: p["summary"] for problem, p in payloads.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line (``argv``; default ``sys.argv[1:]``)."""
    parser = _harness.script_parser(
        __doc__, "device", "threads", "blas_threads", "omp_wait_policy", "timeout",
        "mem_limit_gib", "seed", "out", "repeat", "wait_for", "wait_max", "wait_poll",
        "wait_idle", "retry_busy", "resume", "rerun", "replot", threads=2, timeout=900.0,
        repeat=None, retry_busy=2)
    parser.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS),
                        choices=list(PROBLEMS), help="Problems.")
    parser.add_argument("--methods", nargs="+", default=list(report.METHODS),
                        choices=report.METHODS, help="Methods.")
    parser.add_argument("--attentions", nargs="+", default=list(report.ATTENTIONS),
                        choices=report.ATTENTIONS,
                        help="Attention implementations (of those a problem runs).")
    parser.add_argument("--conditions", nargs="+", default=list(report.CONDITIONS),
                        choices=report.CONDITIONS, help="Machine conditions (of those a problem "
                        "runs): quiet, or loaded (beside a competing process).")
    for name, what in (("n-train", "Training sequences"), ("n-test", "Test sequences"),
                       ("seq-len", "Padded sequence length")):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"{what} (default: the problem's).")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="Loader batch.")
    parser.add_argument("--load-threads", type=int, default=2,
                        help="torch threads of the competing load (loaded condition).")
    parser.add_argument("--fit-budget-s", type=float, default=0.0, help="Fit only the "
                        "first batches that fit this budget (0: all; one process only).")
    parser.add_argument("--processes", type=int, default=1, help="Data-parallel fit: "
                        "processes per worker, started by torchrun (nccl on CUDA, one GPU "
                        "each; else gloo); for lowrank_ggn, whose fit merges across them.")
    parser.add_argument("--table-source", default="docs/benchmarks/lora",
                        help="Where the raw runs are kept (named as the tables' sources).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke test: fewer sequences (small 64 / 32, large 64 / 16 of "
                        "up to 32 tokens), one run per configuration, timeout 300 s, no "
                        "--retry-busy.")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(_harness.RESULTS_DIR / ("quick" if args.quick else ""))
    if args.quick:
        args.timeout, args.retry_busy = min(args.timeout, 300.0), 0
    if args.processes > 1 and set(args.methods) != {OURS}:
        parser.error(f"--processes {args.processes} fits {OURS} only (--methods {OURS}).")
    for key in args.rerun:
        if key.count("/") != 3:
            parser.error(f"--rerun expects PROBLEM/ATTENTION/CONDITION/METHOD, got {key!r}.")
    return args


main = _harness.script_main(parse_args, worker_main, driver_main)


if __name__ == "__main__":
    main()
