#!/bin/bash
# The goodput measurement of docs/benchmarks.md: goodput + hit rate + TTFT of four topologies in one run,
# under pressure, on free ports. usage: scripts/bench_goodput.sh OUTDIR [ARGS] (ARGS override)
#
# Trace: agentic sessions x 5 turns (system prompt 512 shared, user 128, tool result 256,
# answer 32 tokens, think 0.5 s). The reference pass (hit rates, TTFT ratios) replays the first
# REF_SESSIONS sessions as fast as possible at concurrency 4; their working set (every final
# context, in 16-token pages) is 2x the prefill device pool: DEVICE_PAGES = working set / 2,
# host pool = device pool. The sweep's points replay as many sessions as their rate needs for
# POINT_SECONDS of session starts, so the trace holds SESSIONS = MAX_RATE x POINT_SECONDS / 5.
# Budget on the 2-core machine: the run prints its estimate (an upper bound) first; ~15 min.
set -e
OUT=${1:?outdir}; shift
export MC_TCP_BIND_ADDRESS=${MC_TCP_BIND_ADDRESS:-127.0.0.1} MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
# each of these (and DEVICE_PAGES, HOST_PAGES, DECODE_STEP_MS, PREFILL_THREADS, DECODE_THREADS,
# CONFIGS below) can be set from the environment (the pressure run: docs/benchmarks.md "Under pressure")
TURNS=${TURNS:-5} SYSTEM=512 USER=128 TOOL=256 ANSWER=32 THINK=${THINK:-0.5} PAGE=16
REF_SESSIONS=16 POINT_SECONDS=${POINT_SECONDS:-15} MAX_RATE=${MAX_RATE:-64}
SESSIONS=$(( MAX_RATE * POINT_SECONDS / TURNS ))
SESSION_PAGES=$(( (USER + (TURNS - 1) * TOOL + TURNS * ANSWER) / PAGE ))
WORKING_SET=$(( SYSTEM / PAGE + REF_SESSIONS * SESSION_PAGES ))
DEVICE_PAGES=${DEVICE_PAGES:-$(( WORKING_SET / 2 ))}
HOST_PAGES=${HOST_PAGES:-$DEVICE_PAGES}
# the ideal (and the decode node, so it never bounds PD) holds everything live at any rate
# tried: 8192 pages = 99 sessions' final contexts
IDEAL_PAGES=8192
echo "bench_goodput: reference working set $WORKING_SET pages ($REF_SESSIONS sessions);" \
     "prefill device pool $DEVICE_PAGES pages, host $HOST_PAGES; ideal $IDEAL_PAGES;" \
     "trace $SESSIONS sessions" >&2
rm -rf .pdcache/goodput
PD="+node.p0.port=18301+node.p0.bootstrap_port=18302+node.d0.port=18303+node.d0.cache.device_pages=$IDEAL_PAGES"
PD="$PD+storage.metadata=tcp://127.0.0.1:18304+node.p0.cache.device_pages=$DEVICE_PAGES"
NEW="+node.p0.cache.device_eviction=session+node.p0.cache.host_eviction=session"
NEW="$NEW+node.p0.cache.host_mode=exclusive+storage.eviction=session"
# prefill and decode share this machine's cores: decode steps wait while prefill computes
# (docs/design.md §4.13), as a unified engine puts prefill between its decode steps; that
# replaces decode pacing, so DECODE_STEP_MS does not apply to this config
SHARE="+scheduler.compute_share=\"./.pdcache/goodput/compute.share\""
SHARE="$SHARE+node.d0.scheduler.decode_step_interval_ms=0"
# the decode node's least time between decode steps, ms (0: off; docs/benchmarks.md "Decode pacing")
PD="$PD+node.d0.scheduler.decode_step_interval_ms=${DECODE_STEP_MS:-0}"
# torch threads of the PD nodes (unset: torch's default, one per core, for every process)
if [ -n "${PREFILL_THREADS:-}" ]; then PD="$PD+node.p0.env.OMP_NUM_THREADS=\"$PREFILL_THREADS\""; fi
if [ -n "${DECODE_THREADS:-}" ]; then PD="$PD+node.d0.env.OMP_NUM_THREADS=\"$DECODE_THREADS\""; fi
ALL=(
  "ideal=configs/unified.toml+node.u0.port=18305+node.u0.cache.device_pages=$IDEAL_PAGES+node.u0.cache.host_pages=$IDEAL_PAGES"
  "pd-device=configs/local-1p1d.toml$PD+storage.backend=none+node.p0.cache.host_pages=1+node.d0.offload=false"
  "pd-device-shared=configs/local-1p1d.toml$PD+storage.backend=none+node.p0.cache.host_pages=1+node.d0.offload=false$SHARE"
  "pd-hicache-lru=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=$HOST_PAGES"
  "pd-hicache-session=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=$HOST_PAGES$NEW"
  "pd-hicache-shared=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=$HOST_PAGES$NEW$SHARE"
  # the same without decode's prefix cache: prefill sends every prompt page every turn
  "pd-session-no-decode-cache=configs/local-1p1d.toml$PD+node.p0.cache.host_pages=$HOST_PAGES$NEW+node.d0.cache.prefix_cache=false"
)
# CONFIGS="ideal pd-hicache-session" runs only those (the first one listed is the ideal);
# pd-device-shared and pd-hicache-shared run with the compute share (--baseline LABEL picks the
# goodput_x_baseline column's config)
RUN=()
for label in ${CONFIGS:-ideal pd-device pd-hicache-lru pd-hicache-session}; do
  match=""
  for config in "${ALL[@]}"; do [ "${config%%=*}" = "$label" ] && match=$config; done
  [ -n "$match" ] || { echo "bench_goodput: no config named $label" >&2; exit 2; }
  RUN+=("$match")
done
exec python -m pdcache bench goodput "${RUN[@]}" \
  --set model.preset=tiny --set router.port=18300 \
  --set storage.path=./.pdcache/goodput/storage \
  --set storage.metadata_service.state_dir=./.pdcache/goodput/metadata \
  --trace "synthetic:sessions=$SESSIONS,turns=$TURNS,system_prompt=$SYSTEM,user=$USER,tool_result=$TOOL,answer=$ANSWER,think=$THINK" \
  --reference-requests $(( REF_SESSIONS * TURNS )) --reference-concurrency 4 \
  --unloaded-requests 10 --slo-factor 5 \
  --point-seconds $POINT_SECONDS --max-rate $MAX_RATE --max-points 6 --tolerance 0.3 \
  --noisy-retries 1 --out "$OUT" "$@"
