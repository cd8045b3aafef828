#!/bin/bash
# The README's issue-16 measurement: goodput + hit rate + TTFT of four topologies in one run,
# under pressure (16 agentic sessions x 5 turns; the prefill device pool = half the working
# set, host pool = device pool), on free ports. usage: scripts/bench_goodput.sh OUTDIR [ARGS]
set -e
OUT=${1:?outdir}; shift
export MC_TCP_BIND_ADDRESS=${MC_TCP_BIND_ADDRESS:-127.0.0.1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
rm -rf .pdcache/goodput
PD="+node.p0.port=18301+node.p0.bootstrap_port=18302+node.d0.port=18303"
PD="$PD+storage.metadata=tcp://127.0.0.1:18304+node.p0.cache.device_pages=672"
NEW="+node.p0.cache.device_eviction=session+node.p0.cache.host_eviction=session"
NEW="$NEW+node.p0.cache.host_mode=exclusive+storage.eviction=session"
exec python -m pdcache bench goodput \
  "ideal=configs/unified.toml+node.u0.port=18305" \
  "pd-device=configs/local-1p1d.toml$PD+storage.backend=none+node.p0.cache.host_pages=1+node.d0.offload=false" \
  "pd-hicache-lru=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=672" \
  "pd-hicache-session=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=672$NEW" \
  --set model.preset=tiny --set router.port=18300 \
  --set storage.path=./.pdcache/goodput/storage \
  --set storage.metadata_service.state_dir=./.pdcache/goodput/metadata \
  --trace synthetic:sessions=16,turns=5,system_prompt=512,user=128,tool_result=256,answer=32,think=0.5 \
  --reference-concurrency 4 --unloaded-requests 10 --slo-factor 5 --max-points 4 --tolerance 0.3 \
  --out "$OUT" "$@"
