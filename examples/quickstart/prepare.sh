#!/usr/bin/env bash
# Build the quickstart locally (no hub): tiny Qwen3-architecture model + char tokenizer, and the data.
#   bash examples/quickstart/prepare.sh [DIR]        # default outputs/quickstart
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DIR="${1:-${QUICKSTART_DIR:-outputs/quickstart}}"
PYTHON="${PYTHON:-python}"
cd "$REPO"
HF_HUB_OFFLINE=1 "$PYTHON" "$HERE/build.py" --out "$DIR"
