#!/usr/bin/env bash
# What the lead runs on the lent GPU machine (device tool): install the wheels carried in .whl,
# then the GPU-marked tests of every plane. Writes logs to $OUT when set.
set -uo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
export PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -m gpu -x -q -p no:cacheprovider --basetemp=/tmp/pt "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
rc=${PIPESTATUS[0]}
for f in /tmp/pt/*/*/run.log /tmp/pt/*/run.log; do [ -f "$f" ] && cp "$f" "${OUT:-/tmp}/$(echo "$f" | tr '/' '_')" 2>/dev/null; done
exit $rc
