#!/usr/bin/env bash
# The GPU checks on a GPU machine; docs/benchmarks/measurements.md ("GPU checks") says what each mode
# runs and how long it takes. A bare GPU image may lack BackPACK, laplace-torch and
# curvlinops and the network, so their pure-Python wheels travel with the working tree:
#
#   bash benchmarks/gpu_check.sh prepare        # on a CPU machine: wheels into .whl/
#   bash benchmarks/gpu_check.sh prepare-lora   # the same for transformers, peft (.whl/lora/)
#   bash benchmarks/gpu_check.sh MODE           # on the GPU machine, .whl/ copied along
#
# MODE: run (CUDA tests, top-10 eigenpairs of ResNet-18 and the transformer, the 3c3d
# Laplace benchmark, a profiled fit), fits, tests (the CUDA tests alone), sketch, default,
# profile, lora, resnet50k, llama1b, llama1b-multi. Logs, JSON and tables go to $OUT
# (/tmp/gpu_check).
# SKIP_INSTALL=1 uses the current environment instead of the wheels (on a CPU machine
# every step falls back to or skips CUDA); SKIP_TESTS=1 leaves out the CUDA tests of the
# modes that run them first.
set -uo pipefail
mode=${1:-run}
cd "$(dirname "$0")/.."

if [ "$mode" = prepare ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl laplace-torch==0.3 backpack-for-pytorch==1.7.1 \
        curvlinops-for-pytorch==3.0.1 asdfghjkl==0.1a5 unfoldNd==0.2.3 einconv==0.1.0 \
        mlxtend==0.25.0
    exit $?
fi
if [ "$mode" = prepare-lora ]; then  # transformers, peft and their dependencies
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    pins=$(python3 -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}'
for n in ['transformers', 'peft', 'accelerate', 'huggingface-hub', 'tokenizers',
'safetensors', 'hf-xet', 'regex', 'pyyaml', 'tqdm', 'psutil', 'packaging', 'filelock',
'fsspec', 'httpx2', 'httpcore2', 'h11', 'anyio', 'idna', 'truststore', 'typer', 'click',
'rich', 'markdown-it-py', 'mdurl', 'pygments', 'shellingham', 'annotated-doc', 'pydantic',
'pydantic-core', 'annotated-types', 'typing-inspection', 'typing-extensions']))") || exit 1
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform any -d .whl/lora $pins
    exit $?
fi
case "$mode" in
    run|fits|tests|sketch|default|profile|lora|resnet50k|llama1b|llama1b-multi) ;;
    *) echo -n "usage: bash benchmarks/gpu_check.sh prepare|prepare-lora|run|fits|tests|" >&2
       echo "sketch|default|profile|lora|resnet50k|llama1b|llama1b-multi" >&2
       exit 2 ;;
esac

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    case "$mode" in lora|llama*) hf=1 ;; *) hf=0 ;; esac
    if [ $hf = 1 ] && ! python3 -c "import transformers, peft" 2>/dev/null; then
        ls .whl/lora/*.whl > /dev/null 2>&1 || {
            echo "transformers/peft missing: run bash benchmarks/gpu_check.sh prepare-lora" >&2
            exit 1; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/lora/*.whl || exit 1
    fi
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

if [ "$mode" = fits ]; then  # a second call: the fits at the models' full sizes
    echo "== Laplace fits of ResNet-18 and the transformer (1,024 / 128 points)"
    timeout 300 python3 -m benchmarks.bench_models --device cuda --parts laplace \
        --n-train 1024 --n-test 128 --timeout 80 --out /tmp/gpu_fits \
        > "$OUT/models_laplace.log" 2>&1
    echo "bench_models rc=$?"
    cp /tmp/gpu_fits/models.json "$OUT/models_laplace.json" 2>/dev/null
    grep -E "\[laplace" "$OUT/models_laplace.log"
    echo "== Laplace benchmark on 3c3d"
    timeout 130 python3 -m benchmarks.bench_laplace --device cuda --problems 3c3d \
        --methods lowrank_exact lowrank_mc kron_backpack --retry-busy 0 --out /tmp/gpu_fits \
        > "$OUT/laplace.log" 2>&1
    cp /tmp/gpu_fits/laplace_3c3d.json "$OUT/" 2>/dev/null
    grep -E "PASS|FAIL|\[3c3d\]" "$OUT/laplace.log"
    exit 0
fi

if [ "$mode" = profile ]; then  # where the MLP's first default fit goes
    timeout 90 python3 -m benchmarks.gpu_trace --device cuda --problem mlp --top 30 \
        --out "$OUT" 2>&1 | grep -v -i warn
    exit 0
fi

cuda=1; python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" || cuda=0
if [ "$mode" = resnet50k ]; then  # ResNet-18 at real sizes, then MNIST
    args="--device cuda --n-train 50000 --n-test 10000 --fit-budget-s 80 --pred-budget-s 30"
    [ $cuda = 1 ] || { echo "no CUDA device: tiny sizes on the CPU"
        args="--n-train 8 --n-test 4 --batch-size 8 --pred-batch 4 --epochs 1 --marglik-steps 3"; }
    timeout 470 python3 -m benchmarks.bench_models --parts scale mnist $args --timeout 150 \
        --out /tmp/gpu_resnet > "$OUT/resnet50k.log" 2>&1
    echo "bench_models rc=$?"
    cp /tmp/gpu_resnet/models.json "$OUT/resnet50k.json" 2>/dev/null
    cp -r /tmp/gpu_resnet/models_tables "$OUT/resnet50k_tables" 2>/dev/null
    grep -E "\[(scale|mnist)|scale_" "$OUT/resnet50k.log"
    exit 0
fi
if [ "${mode#llama1b}" != "$mode" ]; then  # LoRA on a Llama of about 1B weights
    args="--device cuda --problems llama1b --fit-budget-s 120"; procs=$(nvidia-smi -L 2>/dev/null | wc -l)
    [ $cuda = 1 ] || { args="--problems llama_tiny"; procs=2; echo "no CUDA device: tiny sizes"; }
    methods="lowrank_ggn kron"; [ "$mode" = llama1b-multi ] && methods=lowrank_ggn || procs=1
    timeout 470 python3 -m benchmarks.bench_lora $args --methods $methods --processes "$procs" \
        --timeout 200 --retry-busy 0 --repeat 1 --out /tmp/gpu_$mode > "$OUT/$mode.log" 2>&1
    echo "bench_lora rc=$?"
    for f in /tmp/gpu_$mode/lora_llama*.json; do
        cp "$f" "$OUT/$(basename "$f" .json)${mode#llama1b}.json"; done
    cp -r /tmp/gpu_$mode/lora_tables "$OUT/${mode}_tables" 2>/dev/null
    grep -E "TARGET|llama.*/sdpa" "$OUT/$mode.log"
    exit 0
fi

if [ "$mode" = lora ]; then  # LoRA adapters of GPT-2: `large` and GPT-2-small-sized
    dev=cuda; quick=""
    if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
        dev=cpu; quick=--quick; echo "no CUDA device: --quick sizes on the CPU"
    fi
    echo "== Laplace over LoRA adapters on $dev: lowrank_ggn and kron, large and gpt2"
    timeout 420 python3 -m benchmarks.bench_lora --device "$dev" $quick \
        --problems large gpt2 --methods lowrank_ggn kron --timeout 150 --retry-busy 0 \
        --out /tmp/gpu_lora > "$OUT/lora.log" 2>&1
    echo "bench_lora rc=$?"
    cp /tmp/gpu_lora/lora_large.json /tmp/gpu_lora/lora_large.png \
        /tmp/gpu_lora/lora_gpt2.json /tmp/gpu_lora/lora_gpt2.png "$OUT/" 2>/dev/null
    echo "== diag on large (short limit)"
    timeout 150 python3 -m benchmarks.bench_lora --device "$dev" $quick \
        --problems large --methods diag --timeout 60 --retry-busy 0 \
        --out /tmp/gpu_lora_diag >> "$OUT/lora.log" 2>&1
    echo "bench_lora diag rc=$?"
    cp /tmp/gpu_lora_diag/lora_large.json "$OUT/lora_diag_large.json" 2>/dev/null
    grep -E "TARGET|(large|gpt2)/sdpa" "$OUT/lora.log"
    ls "$OUT"
    exit 0
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
echo "== CUDA tests (tests/test_cuda.py and the device-parametrised tests)"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/factor/test_factor.py::test_device_and_dtype_follow_model \
    tests/test_spectrum.py::test_results_follow_device_and_dtype \
    tests/laplace_torch/test_laplace.py::test_device_and_dtype > "$OUT/pytest_cuda.log" 2>&1
rc=$?
tail -2 "$OUT/pytest_cuda.log"
echo "pytest rc=$rc" | tee -a "$OUT/pytest_cuda.log"
fi
[ "$mode" = tests ] && exit 0
if [ "$mode" = sketch ]; then
    echo "== streaming against the sketch solver on 3c3d and the MLP"
    for problem in 3c3d mlp; do  # 3c3d's five workers took 102 s on an H100
        limit=100; [ "$problem" = 3c3d ] && limit=170
        timeout "$limit" python3 -m benchmarks.bench_laplace --device cuda --problems "$problem" \
            --methods lowrank_exact lowrank_exact_sketch lowrank_mc lowrank_mc_sketch \
            kron_backpack --retry-busy 0 --out /tmp/gpu_sketch >> "$OUT/sketch.log" 2>&1
        echo "bench_laplace $problem rc=$?"
        cp "/tmp/gpu_sketch/laplace_$problem.json" "$OUT/laplace_sketch_$problem.json" 2>/dev/null
    done
    grep -E "PASS|FAIL|\[(3c3d|mlp)\]" "$OUT/sketch.log"
    exit 0
fi

if [ "$mode" = default ]; then
    echo "== the default arguments against streaming, the sketch and kron on 3c3d and the MLP"
    for problem in mlp 3c3d; do  # five workers: 3c3d's took 200 s on an H200
        limit=150; [ "$problem" = 3c3d ] && limit=230
        timeout "$limit" python3 -m benchmarks.bench_laplace --device cuda --problems "$problem" \
            --methods lowrank_default lowrank_exact lowrank_exact_sketch kron_backpack \
            kron_default --warm-fit --retry-busy 0 --out /tmp/gpu_default \
            >> "$OUT/default.log" 2>&1
        echo "bench_laplace $problem rc=$?"
        cp "/tmp/gpu_default/laplace_$problem.json" "$OUT/laplace_default_$problem.json" \
            2>/dev/null
    done
    grep -E "PASS|FAIL|\[(3c3d|mlp)\]" "$OUT/default.log"
    exit 0
fi

echo "== top-10 eigenpairs of ResNet-18 and the transformer at N = 128"
work=/tmp/gpu_check_work
mkdir -p "$work"
timeout 150 python3 -m benchmarks.bench_models --device cuda --parts eigh --N 128 \
    --timeout 75 --out "$work/models" > "$OUT/models.log" 2>&1
echo "bench_models rc=$?" | tee -a "$OUT/models.log"
cp "$work/models/models.json" "$OUT/models.json" 2>/dev/null
timeout 80 python3 -m benchmarks.bench_models --device cuda --parts eigh --N 128 \
    --models resnet18 --low-memory --timeout 60 --out "$work/models_lowmem" \
    >> "$OUT/models.log" 2>&1
echo "bench_models --low-memory rc=$?" | tee -a "$OUT/models.log"
cp "$work/models_lowmem/models.json" "$OUT/models_lowmem.json" 2>/dev/null
grep -E "\[eigh|PASS|FAIL" "$OUT/models.log"

echo "== Laplace benchmark on the device"
timeout 120 python3 -m benchmarks.bench_laplace --device cuda --problems 3c3d \
    --methods lowrank_exact lowrank_mc kron_backpack --retry-busy 0 --out "$work/laplace" \
    > "$OUT/laplace.log" 2>&1
echo "bench_laplace rc=$?"
cp "$work/laplace/laplace_3c3d.json" "$OUT/" 2>/dev/null
grep -E "PASS|FAIL|\[3c3d\]" "$OUT/laplace.log"

echo "== profiler trace of a 3c3d fit"
timeout 50 python3 -m benchmarks.gpu_trace --device cuda --problem 3c3d --out "$OUT" 2>&1 \
    | grep -v -i warn
ls "$OUT"
