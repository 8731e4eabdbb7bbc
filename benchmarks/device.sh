#!/usr/bin/env bash
# The accelerator checks of issues 8 and 14 as one prepared run (at most ~9.5 minutes on an H200):
#   benchmarks/gpu.py    plain decode of a ~1B random-init Llama GGUF at B=1 and B=32 against
#                        the memory bandwidth, and the speed-up at synthetic acceptance 3.5, K=4
#   benchmarks/batch.py  continuous batching with and without speculation at N = 1, 8, 32, 128
# Results go to $OUT (the device tool's folder) or benchmarks/results/. Packages the machine
# lacks (gguf) travel as wheels in .whl/ (see the device tool's README): they are installed
# into /tmp/site first. Pass `tiny` to smoke-test the script on a CPU in a few minutes, and
# `profile` for `benchmarks/gpu.py profile` (where a decode step's time goes, ~3-5 minutes)
# instead. The first run on an H200 (2026-12-04) took 488 s of command time and 41 s to start;
# a 15-minute lease holds one full run, or a profile run and then the full run back to back
# (a machine stays warm for 30 s after a call).
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
export SPECJAX_COMPILE_CACHE=0  # a fresh machine: storing executables would only cost time
if [[ "${1:-}" == profile ]]; then  # where a decode step's time goes (~3-5 minutes)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
    mkdir -p /tmp/gguf
    for b in 1 32; do
        timeout 280 $PY benchmarks/gpu.py profile --dir /tmp/gguf --batch $b \
            --out "$RESULTS/gpu-profile-B$b.json" 2> >(tee -a "$RESULTS/profile.log" >&2) ||
            echo "gpu.py profile B=$b ended with status $?" >&2
    done
    exit
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
# A lease has a hard limit: gpu.py gets at most GPU_SECONDS, batch.py what is left of
# TOTAL_SECONDS; each writes what it measured so far after each batch size or slot count,
# and its log goes beside the results, so a run cut short still says where the time went.
total=${TOTAL_SECONDS:-555}
timeout "${GPU_SECONDS:-300}" $PY benchmarks/gpu.py --out "$RESULTS/gpu.json" \
    2> >(tee "$RESULTS/gpu.log" >&2) || echo "gpu.py ended with status $?" >&2
# the most slots first: N = 1 runs the 256 requests one by one and takes longest
timeout "$((total - SECONDS))" $PY benchmarks/batch.py --parallel 128,32,8,1 \
    --configs continuous,spec --repeats 1 --out "$RESULTS/batch-gpu.json" \
    2> >(tee "$RESULTS/batch.log" >&2) || echo "batch.py ended with status $?" >&2
