#!/usr/bin/env bash
# The GPU checks in one call on a GPU machine (about 5 minutes): CUDA tests, the
# host-device traffic of a fit, the Laplace benchmark on the device.
#
# A bare GPU image may have PyTorch but not BackPACK, laplace-torch or curvlinops, and
# no network, so their pure-Python wheels travel with the working tree.
#
#   On a CPU machine with pip:  bash benchmarks/gpu_check.sh prepare
#       downloads the wheels into .whl/ (ignored by git, ~0.6 MB).
#   On the GPU machine, with .whl/ copied along ($OUT: output folder, /tmp/gpu_check):
#                               bash benchmarks/gpu_check.sh run
#       installs them into /tmp/site and writes into $OUT (at most 8 files):
#       card.txt (GPU, driver, torch), pytest_cuda.log (the CUDA-parametrised tests),
#       gpu_trace_3c3d.json (host-device copies and scalar reads during a fit, see
#       benchmarks/gpu_trace.py), laplace.log + laplace_3c3d.json/.png (fit, GLM and
#       NN predictive of lowrank_ggn exact/MC vs BackPACK-kron on the GPU).
#
# SKIP_INSTALL=1 uses the current environment instead of the wheels (to try the
# script on a CPU machine, where every step falls back to or skips CUDA).
set -uo pipefail
mode=${1:-run}
cd "$(dirname "$0")/.."

if [ "$mode" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl laplace-torch==0.3 backpack-for-pytorch==1.7.1 \
        curvlinops-for-pytorch==3.0.1 asdfghjkl==0.1a5 unfoldNd==0.2.3 einconv==0.1.0
    exit $?
fi
if [ "$mode" != run ]; then
    echo "usage: bash benchmarks/gpu_check.sh prepare|run" >&2
    exit 2
fi

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

{ nvidia-smi -L 2>&1 || echo "no nvidia-smi"
  python3 -c "import torch; c = torch.cuda.is_available(); print('torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if c else 'no CUDA device')"
} > "$OUT/card.txt"
cat "$OUT/card.txt"

echo "== CUDA-parametrised tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_factor.py \
    tests/test_spectrum.py tests/test_laplace_backend.py tests/test_cli.py \
    > "$OUT/pytest_cuda.log" 2>&1
rc=$?
tail -2 "$OUT/pytest_cuda.log"
echo "pytest rc=$rc" | tee -a "$OUT/pytest_cuda.log"

echo "== profiler trace of a 3c3d fit"
timeout 150 python3 benchmarks/gpu_trace.py --device cuda --problem 3c3d --out "$OUT" 2>&1 \
    | grep -v -i warn

echo "== Laplace benchmark on the device"
timeout 300 python3 benchmarks/bench_laplace.py --device cuda --problems 3c3d \
    --methods lowrank_exact lowrank_mc kron_backpack --retry-busy 0 --out "$OUT" \
    > "$OUT/laplace.log" 2>&1
echo "bench_laplace rc=$?"
grep -E "PASS|FAIL|\[3c3d\]" "$OUT/laplace.log"
