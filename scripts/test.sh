#!/usr/bin/env bash
# Sets up ./.venv (scripts/setup.sh), lints, and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_LOG_LEVEL=ERROR
export UCX_NET_DEVICES=lo UCX_MODULES='^ib*'
# Two OpenMP threads on a loaded 2-core machine make small forwards 10x slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
