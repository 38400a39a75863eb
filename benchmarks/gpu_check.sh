#!/usr/bin/env bash
# hfreduce on a machine with a CUDA GPU: builds the compiled core, then the correctness tests on CUDA tensors (several
# processes share one GPU, since hfreduce uses only copy engines), then D2H/H2D bandwidth
# next to the engine's stage-in and stage-out throughput.
#
# Runs with the machine's own python3 and torch (no install step; src/ goes on PYTHONPATH).
# Usage: benchmarks/gpu_check.sh            PYTHON=/path/to/python benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c 'import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print("gpu_check:", torch.__version__, torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'
status=0
# The compiled core (C, no torch headers), built in place for this python: the CUDA tests check
# that a CUDA tensor's result is the bits of the same collective on CPU through the core.
if ! "$PY" setup.py -q build_ext --inplace >/tmp/gpu_check_build.log 2>&1; then
    echo "gpu_check: the compiled core did not build (see /tmp/gpu_check_build.log); the CUDA tests will say so"
    tail -5 /tmp/gpu_check_build.log
fi
"$PY" -c 'from fireflyer.hfreduce import kernels; print("gpu_check: hfreduce kernels:", kernels.isa())'
"$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m cuda tests/hfreduce/test_cuda.py tests/haiscale/test_ddp_cuda.py tests/validator/test_validator_cuda.py tests/storage/test_storage_cache.py || status=$?
"$PY" -m fireflyer.bench.gpu || status=$?
"$PY" -m fireflyer.cli validate --quick || status=$?
exit $status
