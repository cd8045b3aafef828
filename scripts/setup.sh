#!/usr/bin/env bash
# Creates ./.venv with pdcache and everything its demo and tests need (CPU machine, no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Mooncake's wheel links libibverbs even for TCP transfers.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing libibverbs1 (needed by mooncake)"
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null
  else
    echo "[setup] WARNING: libibverbs1 missing and cannot apt-get it; mooncake will be unavailable" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
# torch first, pinned, so the CPU build on this machine is used instead of a multi-GB CUDA one.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 \
  | grep -v "^WARNING: Location" || true
echo "[setup] installing pdcache and its extras"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[all,test]" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import pdcache, torch; print('[setup] ok: torch', torch.__version__)"
