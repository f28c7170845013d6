"""The benchmark harness and smoke runs of every benchmark script at tiny sizes.

The harness is checked with a stand-in worker (a few lines of Python that print records,
hang, die or fail on request), so that every way a worker can end is covered in
seconds; every script's driver path then runs once on the CPU at a tiny size (slow).
"""

import argparse
import ast
import json
import os
import sys
import types
from pathlib import Path

import pytest

from benchmarks import _harness, _worker, bench_laplace

#: The scripts' end-to-end runs of a minute or more each (worker processes, a loaded
#: machine, torchrun, ResNet-18): beyond the test command's budget on 2 cores, so they run
#: where ``LOWRANK_LAPLACE_HEAVY=1`` is set (before a benchmark run, or on a device).
HEAVY = pytest.mark.skipif(not os.environ.get("LOWRANK_LAPLACE_HEAVY"),
                           reason="a benchmark script's end-to-end run of minutes: set "
                                  "LOWRANK_LAPLACE_HEAVY=1")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

FAKE_WORKER = """
import json, os, signal, sys, time
config = json.loads(sys.argv[sys.argv.index("--config") + 1])
def emit(record):
    print(MARKER + json.dumps(record), flush=True)
todo = config.get("todo" if "fit" in config["phases"] else "rerun", {})
if todo.get("setup") == "exit":
    sys.exit(3)
emit({"phase": "setup", "status": todo.get("setup", "ok"), "reason": "no data",
      "rss_peak_bytes": 100})
if todo.get("setup"):
    sys.exit(0)
for phase in ["fit"] + [p for p in config["phases"] if p != "fit"]:
    if todo.get(phase) == "hang":
        time.sleep(60)
    if todo.get(phase) == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if todo.get(phase) == "error":
        emit({"phase": phase, "status": "error", "reason": "boom"})
        sys.exit(0)
    emit({"phase": phase, "status": "ok", "time_s": config.get("time", 1.0),
          "peak_bytes": 300, "peak_delta_bytes": 30, "rss_peak_bytes": 300,
          "other_cpu_percent_during_phase": 1.0})
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """The module name of a stand-in worker, importable by the harness's workers."""
    (tmp_path / "fakebench.py").write_text(f"MARKER = {_worker.MARKER!r}\n" + FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "fakebench"


def _run(module, todo=None, phases=("fit", "glm", "nn"), timeout=2.0, **config):
    args = argparse.Namespace(timeout=timeout)
    return _harness.run_worker(module, {"method": "m", "phases": list(phases),
                                        "todo": todo or {}, **config}, args)


def test_a_worker_reports_its_setup_and_every_phase(fake):
    record = _run(fake)
    assert record["setup"]["status"] == "ok" and record["method"] == "m"
    assert [r["status"] for r in record["phases"].values()] == ["ok", "ok", "ok"]
    assert record["worker_peak_bytes"] == 300 and record["subprocess_wall_s"] > 0
    assert "other_cpu_percent_during" in record and "expected" not in record


@pytest.mark.parametrize("todo, status", [
    ({"glm": "hang"}, "timeout"), ({"glm": "kill"}, "oom"), ({"glm": "error"}, "error")])
def test_a_failed_phase_is_recorded_and_the_later_ones_skipped(fake, todo, status):
    record = _run(fake, todo, timeout=1.0)
    fit, glm, nn = (record["phases"][p] for p in ("fit", "glm", "nn"))
    assert fit["status"] == "ok" and glm["status"] == status
    assert nn == {"phase": "nn", "status": "skipped", "reason": "an earlier phase failed"}
    if status == "timeout":
        assert glm["time_to_failure_s"] == 1.0 and "time limit of 1 s" in glm["reason"]


def test_a_failed_setup_skips_every_phase(fake):
    record = _run(fake, {"setup": "error"})
    assert record["setup"]["status"] == "error" and record["setup"]["reason"] == "no data"
    assert {r["reason"] for r in record["phases"].values()} == {"setup failed: no data"}
    record = _run(fake, {"setup": "exit"})
    assert record["setup"]["status"] == "error"
    assert record["setup"]["reason"] == "exit code 3 without result"


def test_a_killed_predictive_leaves_the_next_ones_to_a_new_worker(fake):
    """bench_laplace's workers refit where a predictive's worker was killed."""
    args = argparse.Namespace(timeout=1.0)
    config = {"method": "m", "phases": ["fit", "glm", "nn"], "todo": {"glm": "hang"}}
    record = bench_laplace.run_method(fake, config, args)
    assert record["phases"]["glm"]["status"] == "timeout"
    assert record["phases"]["nn"]["status"] == "ok"
    assert record["phases"]["fit"]["refits"] == [
        {"status": "ok", "time_s": 1.0, "peak_delta_bytes": 30}]
    assert len(record["restarts"]) == 1
    config["rerun"] = {"fit": "hang"}  # the new worker's refit times out too
    record = bench_laplace.run_method(fake, config, args)
    assert record["phases"]["nn"]["status"] == "timeout"
    assert record["phases"]["nn"]["reason"].startswith("refit before this phase failed")
    assert "refits" not in record["phases"]["fit"]


def test_repeats_give_median_times_and_largest_peaks():
    def run(t, peak):
        return {"phases": {"fit": {"status": "ok", "time_s": t, "peak_bytes": peak,
                                   "peak_delta_bytes": peak,
                                   "other_cpu_percent_during_phase": t}},
                "other_cpu_percent_during": t, "worker_peak_bytes": peak}

    record = _harness.median_record([run(3.0, 1), run(1.0, 5), run(2.0, 2)])
    fit = record["phases"]["fit"]
    assert fit["time_s"] == 2.0 and fit["repeat_time_s"] == [3.0, 1.0, 2.0]
    assert fit["peak_bytes"] == 5 and fit["other_cpu_percent_during_phase"] == 3.0
    assert record["repeats"] == 3 and record["worker_peak_bytes"] == 5


def test_a_plan_writes_after_every_run_and_resumes(fake, tmp_path):
    configs = [{"method": m, "phases": ["fit"], "time": t} for m, t in (("a", 1.0), ("b", 2.0))]
    configs.append({"method": "c", "phases": ["fit"], "skip": "does not fit"})
    plan = _harness.Plan(fake, configs, ("method",), tmp_path / "run.json",
                         {"device": "cpu", "n": 1, "D": None}, {"lowrank_laplace_sources": {}})
    args = argparse.Namespace(timeout=2.0, repeat=2)
    records = plan.run(args)
    assert [r["method"] for r in records] == ["a", "b", "c"]
    assert [r.get("repeats") for r in records] == [2, 2, None]
    assert records[2]["phases"]["fit"] == {"phase": "fit", "status": "skipped",
                                           "reason": "does not fit"}
    plan.write(records, {"done": True}, args)
    payload = json.loads(plan.path.read_text())
    assert payload["summary"] == {"done": True} and payload["settings"]["n"] == 1
    again = _harness.Plan(fake, configs, ("method",), plan.path,
                          {"device": "cpu", "n": 1}, {"lowrank_laplace_sources": {}})
    resumed = argparse.Namespace(timeout=2.0, resume=True, rerun=["b"], repeat=1)
    assert [r.get("repeats") for r in again.run(resumed, ("n",))] == [2, None, None]


def test_set_tuning_assigns_a_constant_or_passes_the_option(monkeypatch):
    module = types.ModuleType("fake_tuned")
    module.LIMIT = 1
    monkeypatch.setitem(sys.modules, "fake_tuned", module)
    monkeypatch.setitem(_worker.TUNINGS, "limit", _worker.Tuning("fake_tuned", "LIMIT"))
    monkeypatch.setitem(_worker.TUNINGS, "extra",
                        _worker.FractionOfRank("fake_tuned", "EXTRA"))
    assert _worker.set_tuning("limit", 7) == {} and module.LIMIT == 7
    assert _worker.set_tuning("extra", 0.25, rank=40) == {"extra": 10}
    assert not hasattr(module, "EXTRA")
    assert set(_worker.TUNINGS) >= {"sketch_test_matrix", "dense_max_dim", "oversampling",
                                    "probe_size"}


def test_a_fit_and_a_predictive_shrink_to_their_budgets(monkeypatch):
    """A fit gets the first batches whose estimated time (fixed cost and cost per batch
    from fits of one and two batches) fits the budget; a predictive the chunks whose pace
    fits it."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    clock = [0.0]
    monkeypatch.setattr(_worker, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    sizes = []

    def fit(loader):  # 1 s fixed, 2 s per batch
        sizes.append(len(loader.dataset))
        clock[0] += 1.0 + 2.0 * len(loader)

    loader = DataLoader(TensorDataset(torch.zeros(40, 1)), batch_size=4)
    shrunk, info = _worker.fit_within(fit, loader, budget_s=12.0)
    assert sizes == [4, 4, 8] and info == {"n_fit": 20, "n_requested": 40}
    assert len(shrunk) == 5 and len(shrunk.dataset) == 20
    assert _worker.fit_within(fit, loader, budget_s=100.0) == (loader, {"n_fit": 40})
    assert _worker.fit_within(fit, loader, budget_s=0.0) == (loader, {"n_fit": 40})

    def fails(loader):
        raise NotImplementedError("Found parameters in un-supported layers.")

    kept, info = _worker.fit_within(fails, loader, budget_s=12.0)
    assert kept is loader and "un-supported layers" in info["probe_failure"]

    def predict(x):
        clock[0] += 1.0
        return x

    chunks = torch.arange(10.0).reshape(10, 1).split(1)
    assert _worker.chunks_within(predict, chunks, 3.5).flatten().tolist() == [0.0, 1.0, 2.0]
    assert len(_worker.chunks_within(predict, chunks, 0.0)) == 10
    samples = _worker.chunks_within(lambda x: x.expand(3, -1, -1), chunks, 0.0)
    assert samples.shape == (3, 10, 1)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_benchmark_modules_follow_the_house_rules(path):
    """At most 500 lines a module, 80 a function, 8 parameters; no private name crosses
    modules."""
    text = path.read_text()
    assert len(text.splitlines()) <= 500
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno < 80, node.name
            params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            assert len(params) <= 8, node.name
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert not (node.value.id.startswith("_") and node.attr.startswith("_")), \
                f"line {node.lineno}: {node.value.id}.{node.attr}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
            assert not [a.name for a in node.names if a.name.startswith("_")], node.lineno
        assert not (isinstance(node, ast.ImportFrom) and "utils.threads" in (node.module or ""))


@pytest.mark.slow
@HEAVY
def test_gpu_trace_profiles_the_first_fit_on_the_cpu(tmp_path):
    """``benchmarks/gpu_trace.py --top`` falls back to the CPU without CUDA, profiles the
    first fit of its worker process and lists its costliest operators by host time."""
    from benchmarks import gpu_trace

    record = gpu_trace.main(["--device", "cpu", "--problem", "mlp", "--n-train", "64",
                             "--batch-size", "32", "--rank", "5", "--top", "4",
                             "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_trace_mlp.json").read_text())
    assert saved["device"] == "cpu" and saved["batches"] == 2
    assert saved["fit_s"] > 0 and saved["cold_profiled_fit_s"] > 0
    assert len(saved["top_host"]) == 4 and len(saved["top_device"]) == 4
    host = [op["self_ms"] for op in saved["top_host"]]
    assert host == sorted(host, reverse=True) and host[0] > 0
    assert all(op["calls"] >= 1 and op["name"] for op in saved["top_host"])
    assert saved["events"]["memcpy_htod"]["count"] == 0  # nothing crosses to a device
    assert record["top_host"] == saved["top_host"]


###############################################################################
#                 Every script's driver path, once, at a tiny size            #
###############################################################################


def _statuses(records):
    return {r["method"]: {p: v["status"] for p, v in r["phases"].items()} for r in records}


@pytest.mark.slow
@HEAVY
def test_bench_eigh_runs_its_methods_and_checks_them(tmp_path):
    from benchmarks import bench_eigh

    summary = bench_eigh.main(["--problems", "mlp", "--N", "16", "--ks", "2", "--methods",
                               "ours_exact_sub", "power", "eigsh", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "eigh_mlp.json").read_text())
    assert payload["machine"]["date"] and (tmp_path / "eigh_mlp.png").is_file()
    assert all(r["phases"]["eigh"]["status"] == "ok" for r in payload["records"])
    assert summary["mlp"]["sanity_power_vs_eigsh"]["passed"]
    assert payload["records"][0]["phases"]["eigh"]["sub_rel_residual"][0] < 1e-2


@pytest.mark.slow
@HEAVY
def test_bench_laplace_runs_skips_and_replots(tmp_path):
    argv = ["--quick", "--methods", "lowrank_exact", "kron_backpack", "full_backpack",
            "lanczos", "--marglik", "--out", str(tmp_path)]
    summaries = bench_laplace.main(argv)
    payload = json.loads((tmp_path / "laplace_mlp.json").read_text())
    statuses = _statuses(payload["records"])
    assert statuses["lowrank_exact"] == {"fit": "ok", "glm": "ok", "nn": "ok"}
    assert set(statuses["full_backpack"].values()) == {"skipped"}
    assert statuses["lanczos"] == {"fit": "ok"}
    assert payload["records"][0]["phases"]["fit"]["marglik_status"] == "ok"
    assert summaries["mlp"]["targets"][0]["value"] > 0
    assert bench_laplace.main([*argv, "--replot"])["mlp"]["targets"] == \
        summaries["mlp"]["targets"]


@pytest.mark.slow
@HEAVY
def test_bench_lora_runs_quiet_and_beside_a_load(tmp_path):
    from benchmarks import bench_lora

    bench_lora.main(["--quick", "--problems", "small", "--attentions", "sdpa",
                     "--methods", "lowrank_ggn", "--n-train", "16", "--n-test", "8",
                     "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "lora_small.json").read_text())
    quiet, loaded = payload["records"]
    assert quiet["condition"] == "quiet" and "load" not in quiet
    assert loaded["load"]["ready"] and loaded["load"]["matmuls"] > 0
    assert all(p["status"] == "ok" for r in (quiet, loaded) for p in r["phases"].values())
    assert "load_cpu_percent_during_phase" in loaded["phases"]["fit"]
    tables = json.loads((tmp_path / "lora_tables" / "lora_small.json").read_text())
    assert len(tables["rows"]) == 2 and tables["machine"]["cpu_name"]


@pytest.mark.slow
@HEAVY
def test_bench_lora_runs_the_bert_full_fine_tune_against_its_torch_func_fit(tmp_path):
    """Every BERT weight trainable: the default fit (hooks) and the torch.func one, and
    the target's ratio is their fit times'."""
    from benchmarks import bench_lora

    summary = bench_lora.main(["--quick", "--problems", "bert", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "lora_bert.json").read_text())["records"]
    assert [r["method"] for r in records] == ["lowrank_ggn", "lowrank_ggn_functorch"]
    assert all(p["status"] == "ok" for r in records for p in r["phases"].values())
    engines = [r["phases"]["fit"]["factor_backend_used"] for r in records]
    assert engines == ["hooks", "functorch"]
    (target,) = summary["bert"]["targets"]
    fits = [r["phases"]["fit"]["time_s"] for r in records]
    assert target["value"] == pytest.approx(fits[0] / fits[1])


@pytest.mark.slow
@HEAVY
def test_bench_lora_runs_the_llama_choice_head_on_one_and_two_processes(tmp_path):
    """The tiny Llama: bfloat16 base, float32 adapters, 4 answer logits; kron beside ours,
    and ours on two torchrun processes (gloo) gives the same tuned prior."""
    import torch

    from benchmarks import bench_lora

    model = bench_lora.make_model("llama_tiny", "sdpa", 0, torch.device("cpu"))
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert trained == {torch.float32} and torch.bfloat16 in {p.dtype for p in model.parameters()}
    batch = next(iter(torch.utils.data.DataLoader(bench_lora.Sequences(
        2, 16, bench_lora.PROBLEMS["llama_tiny"], 0, torch.device("cpu")), batch_size=2)))
    logits = model(batch)
    assert logits.shape == (2, 4) and logits.dtype == torch.float32
    argv = ["--problems", "llama_tiny", "--retry-busy", "0", "--repeat", "1"]
    summary = bench_lora.main([*argv, "--methods", "lowrank_ggn", "kron", "--out",
                               str(tmp_path / "one")])
    assert [t["name"].split()[1] for t in summary["llama_tiny"]["targets"]] == ["fit", "GLM"]
    bench_lora.main([*argv, "--methods", "lowrank_ggn", "--processes", "2", "--out",
                     str(tmp_path / "two")])
    one, two = (json.loads((tmp_path / d / "lora_llama_tiny.json").read_text())["records"]
                for d in ("one", "two"))
    assert all(p["status"] == "ok" for r in (*one, *two) for p in r["phases"].values())
    assert two[0]["setup"]["processes"] == 2 and one[0]["setup"]["processes"] == 1
    ours, kron = ([r["phases"][p]["time_s"] for p in ("fit", "marglik")] for r in one)
    assert summary["llama_tiny"]["targets"][0]["value"] == pytest.approx(sum(ours) / sum(kron))
    assert two[0]["phases"]["marglik"]["prior_precision"] == pytest.approx(
        one[0]["phases"]["marglik"]["prior_precision"], rel=1e-4)
    with pytest.raises(SystemExit):
        bench_lora.parse_args([*argv, "--processes", "2"])  # kron cannot merge processes


@pytest.mark.slow
@HEAVY
def test_bench_models_runs_resnet18_at_scale_and_on_mnist_tiny(tmp_path):
    """The ``scale`` part's rows (laplace-torch's all-weights kron failing as rows) and the
    ``mnist`` part's metrics, on the CPU at tiny sizes."""
    from benchmarks import bench_models

    summary = bench_models.main(["--parts", "scale", "mnist", "--n-train", "8", "--n-test",
                                 "4", "--batch-size", "8", "--pred-batch", "4", "--samples",
                                 "2", "--epochs", "1", "--marglik-steps", "3", "--out",
                                 str(tmp_path)])
    records = json.loads((tmp_path / "models.json").read_text())["records"]
    scale = {r["method"]: r["phases"] for r in records if r["part"] == "scale"}
    for method in ("lowrank_default", "ll_kron", "ll_full"):
        assert {p["status"] for p in scale[method].values()} == {"ok"}, method
        assert scale[method]["glm"]["n_pred"] == 4 and scale[method]["samples"]["n_pred"] == 4
    assert 0 < scale["lowrank_default"]["fit"]["kept_fraction"] <= 1 + 1e-6
    assert scale["kron_default"]["fit"]["status"] == "error"
    assert scale["train_epoch"]["fit"]["status"] == "ok"
    assert summary["scale_fit_marglik"]["value"] > 0 and summary["scale_fit_marglik"]["ok"] is None
    mnist = next(r for r in records if r["part"] == "mnist")["phases"]
    assert 0 < mnist["lowrank_default"]["metrics"]["nll"] and "accuracy" in mnist["map"]["metrics"]
    tables = tmp_path / "models_tables"
    assert (tables / "models_scale.json").is_file() and (tables / "models_mnist.json").is_file()


@pytest.mark.slow
@HEAVY
def test_bench_shared_runs_both_parts_and_writes_tables(tmp_path):
    from benchmarks import bench_shared

    summary = bench_shared.main(["--quick", "--conditions", "quiet", "--fit-methods",
                                 "lowrank_ggn", "--epochs", "1", "--out", str(tmp_path),
                                 "--tables-out", str(tmp_path / "tables")])
    assert summary["targets"][0]["value"] is None  # kron's fit did not run
    fit = json.loads((tmp_path / "tables" / "shared_fit.json").read_text())
    train = json.loads((tmp_path / "tables" / "shared_train.json").read_text())
    assert len(fit["rows"]) == 1 and len(train["rows"]) == 2
    assert float(train["rows"][0][5]) > 0  # a test NLL


@pytest.mark.slow
@HEAVY
def test_bench_models_runs_eigenpairs_and_laplace_of_the_transformer(tmp_path):
    from benchmarks import bench_models

    summary = bench_models.main(["--quick", "--parts", "eigh", "laplace", "--models",
                                 "transformer", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "quick" / "models.json").read_text())
    ours = [r for r in payload["records"] if r["method"] in ("ours", "lowrank_mc")]
    assert all(p["status"] == "ok" for r in ours for p in r["phases"].values())
    assert summary["eigh_speedup_transformer"]["value"] > 0
    assert (tmp_path / "quick" / "models_tables" / "models_targets.json").is_file()


@pytest.mark.slow
@HEAVY
def test_bench_ncrit_bisects_under_a_budget(tmp_path):
    from benchmarks import bench_ncrit

    bench_ncrit.main(["--problem", "mlp", "--tasks", "eigvals", "--structures", "full",
                      "--approximations", "mc", "--data", "mb", "--budget-gib", "1",
                      "--n-start", "8", "--n-max", "16", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "ncrit_mlp.json").read_text())["records"][0]
    assert record["n_crit"] == 16 and record["capped"]
    assert [p["status"] for p in record["probes"]] == ["ok", "ok"]


@pytest.mark.slow
@HEAVY
def test_bench_scaling_fits_with_one_and_two_processes(tmp_path):
    from benchmarks import bench_scaling

    # 16 points of 9 loss-Hessian columns each: rank 150 keeps the whole GGN
    records = bench_scaling.main(["--problem", "mlp", "--mc-samples", "0", "--n-train",
                                  "16", "--batch-size", "8", "--rank", "150", "--cores", "2",
                                  "--out", str(tmp_path)])
    assert [r["processes"] for r in records] == [1, 2]
    assert records[1]["top10_eigenvalue_rel_diff_vs_1"] < 1e-3


@pytest.mark.slow
@HEAVY
def test_bench_sketch_test_matrix_sets_the_test_matrix_per_worker(tmp_path):
    from benchmarks import bench_sketch_test_matrix

    payload = bench_sketch_test_matrix.main(["--quick", "--out", str(tmp_path)])
    runs = payload["problems"]["mlp"]["runs"]
    assert [len(runs[k]) for k in ("streaming", "kronecker", "gaussian")] == [1, 1, 1]
    assert all(0 < r[0]["kept_fraction"] <= 1 for r in runs.values())


@pytest.mark.slow
@HEAVY
def test_the_quality_scripts_run_a_problem_each(tmp_path):
    from benchmarks import bench_posterior_quality, bench_sketch_quality

    report = bench_posterior_quality.main(["--problems", "breast_cancer", "--ranks", "5",
                                           "--epochs", "1", "--out", str(tmp_path)])
    record = report["problems"]["breast_cancer"]
    assert len(record["lowrank"]) == 4 and record["peers"]["full"]["nll"] > 0
    assert (tmp_path / "posterior_quality.png").is_file()
    report = bench_posterior_quality.main(["--problems", "wine", "--ranks", "default",
                                           "--residuals", "spectral", "--epochs", "1",
                                           "--out", str(tmp_path)])
    (row,) = report["problems"]["wine"]["lowrank"]
    assert row["rank"] == bench_posterior_quality.DEFAULT.rank
    assert set(report["checks"]["wine"]) == {"default", "kron"}
    report = bench_sketch_quality.main(["--problems", "breast_cancer", "--epochs", "1",
                                        "--out", str(tmp_path)])
    assert len(report["problems"]["breast_cancer"]["lowrank"]) == 4
