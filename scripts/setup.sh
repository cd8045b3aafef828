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

# Prometheus (and promtool) for the dashboard / alert-rule test (tests/server/test_dashboard.py).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing prometheus (for the dashboard test)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends prometheus) >/dev/null 2>&1 \
      || echo "[setup] WARNING: prometheus unavailable; the dashboard test skips" >&2
  else
    echo "[setup] WARNING: prometheus missing and cannot apt-get it; the dashboard test skips" >&2
  fi
fi

# etcd (the replicated hf3fs metadata and Mooncake's master HA: their tests, configs/local-ha.toml)
# and redis-server (`pdcache bench metadata --redis`).
if ! command -v etcd >/dev/null || ! command -v redis-server >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing etcd-server and redis-server (replicated metadata tests)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq --no-install-recommends etcd-server redis-server) >/dev/null 2>&1 \
      || echo "[setup] WARNING: etcd/redis unavailable; the replicated-metadata tests skip" >&2
  else
    echo "[setup] WARNING: etcd missing and cannot apt-get it; the replicated-metadata tests skip" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
# A required install that fails stops the setup here, with pip's own words (a full disk, no
# network), instead of a later "No module named ..." from the tests.
pip_required() {
  local log=.venv/pip-last.log
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" > "$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    echo "[setup] ERROR: 'pip install $*' failed (pip's output above; full log: $log)" >&2
    df -h . 2>/dev/null | tail -n 1 | awk '{print "[setup] disk: " $4 " free on " $6}' >&2
    exit 1
  fi
  grep -v "^WARNING: Location" "$log" || true
}
# torch first, pinned, so the CPU build on this machine is used instead of a multi-GB CUDA one.
pip_required "torch==2.13.0"
echo "[setup] installing pdcache and its extras"
pip_required -e ".[all,test]"
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
# From outside the checkout, so a pdcache that pip did not install is not found by accident.
(cd / && "$OLDPWD/.venv/bin/python" -c "
import importlib.metadata as md, pdcache, pytest, torch
print('[setup] ok: pdcache', md.version('pdcache'), '| torch', torch.__version__)")
