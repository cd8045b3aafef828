#!/bin/bash
# docs/benchmarks.md's "burst of long prompts on a small decode pool" bench, on free ports.
# usage: scripts/bench_admission.sh LABEL OUTDIR [--set KEY=VALUE ...]   (run from a checkout)
# before/after: run it from a worktree of the old commit and from this one, same OUTDIR parent.
set -e
LABEL=${1:?label}; OUT=${2:?outdir}; shift 2
export MC_TCP_BIND_ADDRESS=${MC_TCP_BIND_ADDRESS:-127.0.0.1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
rm -rf .pdcache/adm
exec python -m pdcache bench compare "$LABEL=configs/local-1p1d.toml" \
  --set router.port=18100 --set node.p0.port=18101 --set node.p0.bootstrap_port=18102 \
  --set node.d0.port=18103 --set storage.metadata=tcp://127.0.0.1:18104 \
  --set storage.path=./.pdcache/adm/storage \
  --set storage.metadata_service.state_dir=./.pdcache/adm/metadata \
  --set node.d0.cache.device_pages=1600 "$@" \
  --trace synthetic:sessions=8,turns=1,system_prompt=16,user=6000,answer=32 \
  --concurrency 8 --no-plots --out "$OUT"
