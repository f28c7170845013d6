"""Smoke tests of benchmark scripts that a CPU machine can run in seconds."""

import json


def test_gpu_trace_profiles_the_first_fit_on_the_cpu(tmp_path):
    """``benchmarks/gpu_trace.py --top`` falls back to the CPU without CUDA, profiles the
    process's first fit and lists its costliest operators by host time."""
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
