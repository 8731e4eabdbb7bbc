#!/usr/bin/env bash
# The accelerator checks of issues 8 and 14 as one prepared run (about 10 minutes on an H200):
#   benchmarks/gpu.py    plain decode of a ~1B random-init Llama GGUF at B=1 and B=32 against
#                        the memory bandwidth, and the speed-up at synthetic acceptance 3.5, K=4
#   benchmarks/batch.py  continuous batching with and without speculation at N = 1, 8, 32, 128
# Results go to $OUT (the device tool's folder) or benchmarks/results/. Packages the machine
# lacks (gguf) travel as wheels in .whl/ (see the device tool's README): they are installed
# into /tmp/site first. Pass `tiny` to smoke-test the script on a CPU in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RESULTS=${OUT:-benchmarks/results}
if [[ "${1:-}" == tiny ]]; then
    $PY benchmarks/gpu.py --size tiny --tokens 64 --prompt 32 --batches 1,4 --repeats 1 \
        --out "$RESULTS/gpu-smoke.json"
    $PY benchmarks/batch.py --parallel 1,4 --requests 8 --configs continuous,spec \
        --repeats 1 --out "$RESULTS/batch-smoke.json"
    exit
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
$PY benchmarks/gpu.py --out "$RESULTS/gpu.json"
$PY benchmarks/batch.py --parallel 1,8,32,128 --configs continuous,spec --repeats 1 \
    --out "$RESULTS/batch-gpu.json"
