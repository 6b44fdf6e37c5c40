#!/usr/bin/env bash
# What the lead runs on the lent GPU machine (device tool): install the wheels carried in .whl, then the GPU-marked
# tests of the files given (default: every file with a gpu-marked test), EACH FILE IN ITS OWN pytest process under
# real torchrun: a CUDA device-side assert poisons the process that hit it, and every later test of that process
# would fail with it (2026-12-07: one bad test took 13 others down). Stops starting files after BUDGET_S seconds
# (default 520, under the device's 600 s a command). Writes summary.txt and all.log to $OUT when set.
#   bash tools/gpu_check.sh                                   # every gpu-marked file
#   bash tools/gpu_check.sh tests/unit/engine/test_gpu.py     # some files (or file::test ids)
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 MILES_TEST_REAL_TORCHRUN=1
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/summary.txt"
if [ $# -eq 0 ]; then
  set -- $(grep -rl "mark.gpu" tests --include='test_*.py' | sort)
fi
start=$(date +%s)
rc=0
for f in "$@"; do
  if [ $(( $(date +%s) - start )) -gt "${BUDGET_S:-520}" ]; then echo "NOT RUN (time) $f" >> "$out/summary.txt"; continue; fi
  log=/tmp/gpu_$(echo "$f" | tr '/:[]' '____').log
  timeout "${FILE_TIMEOUT_S:-200}" python3 -m pytest -m gpu -q -s -rA -p no:cacheprovider -o addopts="" "$f" > "$log" 2>&1
  code=$?
  [ $code -ne 0 ] && [ $code -ne 5 ] && rc=1       # 5: no gpu-marked test selected in that file
  echo "== $f rc=$code t=$(( $(date +%s) - start ))s" >> "$out/summary.txt"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$log" >> "$out/summary.txt"
  grep -v "IndexKernelUtils" "$log" >> "$out/all.log"
done
exit $rc
