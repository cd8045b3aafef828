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
# SGLang's storage-plugin interface, for the plugin tests: sglang pins a CUDA torch, so it is
# installed without its dependencies plus the light packages its storage modules import.
if [ "${PDCACHE_SKIP_SGLANG:-0}" != 1 ] && ! .venv/bin/python -c "import sglang" 2>/dev/null; then
  echo "[setup] installing sglang==0.5.23 (--no-deps, storage plugin interface only)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "sglang==0.5.23" \
      > .venv/sglang.log 2>&1 || echo "[setup] WARNING: sglang unavailable; its plugin tests skip"
  # pip then lists sglang's own (CUDA) requirements as unmet: expected, so that report is muted
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[sglang]" \
      > .venv/sglang-extra.log 2>&1 || { cat .venv/sglang-extra.log; exit 1; }
fi
# NIXL (DRAM-to-DRAM over UCX on loopback) for the nixl transfer engine's tests.
if [ "${PDCACHE_SKIP_NIXL:-0}" != 1 ] && ! .venv/bin/python -c "import nixl_cu12" 2>/dev/null; then
  echo "[setup] installing nixl-cu12 (nixl transfer engine)"
  .venv/bin/python -m pip install -q --disable-pip-version-check "nixl-cu12==1.5.1" \
    > .venv/nixl.log 2>&1 || echo "[setup] WARNING: nixl-cu12 unavailable; its tests skip"
fi
.venv/bin/python -c "import pdcache, torch; print('[setup] ok: torch', torch.__version__)"
