#!/bin/bash
# Window pages at equal device memory (docs/measured.md "gpt-oss sliding pool"): the same
# device bytes spent as N full + N sliding pages (sliding_pages = device_pages, the one-pool
# split) or as more full pages and a sliding pool near its floor, on a unified device-only
# small-gpt-oss node (window pages run there), one `bench compare` run, under pressure.
# usage: scripts/bench_sliding_pool.sh OUTDIR [ARGS] (ARGS go to bench compare)
set -e
OUT=${1:?outdir}; shift
export MC_TCP_BIND_ADDRESS=${MC_TCP_BIND_ADDRESS:-127.0.0.1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the page budget, in page-equivalents (small-gpt-oss: 4 full + 4 sliding layers, so a full
# page and a sliding page weigh the same). The trace's working set is ~990 full pages (8
# sessions x 4 turns: 512-token system prompt, 256 user, 512 tool result, 32 answer tokens),
# ~2x the split config's full pages; the windows its restorable points keep, ~380 sliding
BUDGET=${BUDGET:-1000}
RUNNING=4 CHUNK=256 PAGE=16 WINDOW=128
TAIL=$(( (WINDOW - 1 + PAGE - 1) / PAGE + 2 ))
FLOOR=$(( RUNNING * (2 * TAIL + 2) + CHUNK / PAGE ))
mkdir -p "$OUT"
cat > "$OUT/unified-device.toml" <<TOML
# device-only unified node: window pages (docs/design.md §4.14) run here
[model]
preset = "small-gpt-oss"
dtype = "float32"
seed = 0
[cache]
page_size = $PAGE
device_pages = $(( BUDGET / 2 ))
host_pages = 0
[scheduler]
max_running_requests = $RUNNING
chunked_prefill_tokens = $CHUNK
[router]
port = 18401
prefill_policy = "round_robin"
[[node]]
name = "u0"
role = "unified"
port = 18402
TOML
MID=$(( BUDGET * 3 / 8 ))
echo "bench_sliding_pool: $BUDGET page-equivalents: split $(( BUDGET / 2 )) full + $(( BUDGET / 2 ))" \
     "sliding, mid $(( BUDGET - MID )) + $MID, floor $(( BUDGET - FLOOR )) + $FLOOR" >&2
exec .venv/bin/python -m pdcache bench compare --out "$OUT" \
    --trace synthetic:sessions=8,turns=4,system_prompt=512,user=256,tool_result=512,answer=32,seed=0 \
    --concurrency 2 \
    "split=$OUT/unified-device.toml" \
    "mid=$OUT/unified-device.toml+cache.device_pages=$(( BUDGET - MID ))+cache.sliding_pages=$MID" \
    "floor=$OUT/unified-device.toml+cache.device_pages=$(( BUDGET - FLOOR ))+cache.sliding_pages=$FLOOR" \
    "$@"
