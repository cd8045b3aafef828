#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology local-ha.toml
# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host
# named above it. SGLang keeps KV pages in pdcache storage through the pdcache plugin:
# every host needs `pip install sglang==0.5.23 pdcache` (see docs/sglang.md).
# NOTE: model.preset = 'small' has random weights in pdcache; SGLang needs a checkpoint:
#       MODEL_PATH. Its pages are not shared with pdcache nodes running the preset (other
#       weights, other model name).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:?preset 'small' exists only in pdcache; set MODEL_PATH to a Llama-family checkpoint}"
# The model name in pdcache's KV fingerprint for the weights at MODEL_PATH (what pdcache
# nodes serving that checkpoint use): pages are shared only where it is equal.
PDCACHE_MODEL_NAME="${PDCACHE_MODEL_NAME:-$(python3 -c 'import sys; from pdcache.offload_manager.builder import model_identity; print(model_identity(sys.argv[1], int(sys.argv[2])))' "$MODEL_PATH" 0)}"

# --- etcd member etcd-0 (on 127.0.0.1)
etcd \
    --name pdcache-etcd-0 \
    --data-dir ./.pdcache/etcd/pdcache-etcd-0 \
    --listen-client-urls http://127.0.0.1:2379 \
    --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 \
    --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster pdcache-etcd-0=http://127.0.0.1:2380,pdcache-etcd-1=http://127.0.0.1:2382,pdcache-etcd-2=http://127.0.0.1:2384 \
    --initial-cluster-state new \
    --initial-cluster-token pdcache \
    --heartbeat-interval 100 \
    --election-timeout 1000 \
    --auto-compaction-mode periodic \
    --auto-compaction-retention 10m \
    --log-level error &

# --- etcd member etcd-1 (on 127.0.0.1)
etcd \
    --name pdcache-etcd-1 \
    --data-dir ./.pdcache/etcd/pdcache-etcd-1 \
    --listen-client-urls http://127.0.0.1:2381 \
    --advertise-client-urls http://127.0.0.1:2381 \
    --listen-peer-urls http://127.0.0.1:2382 \
    --initial-advertise-peer-urls http://127.0.0.1:2382 \
    --initial-cluster pdcache-etcd-0=http://127.0.0.1:2380,pdcache-etcd-1=http://127.0.0.1:2382,pdcache-etcd-2=http://127.0.0.1:2384 \
    --initial-cluster-state new \
    --initial-cluster-token pdcache \
    --heartbeat-interval 100 \
    --election-timeout 1000 \
    --auto-compaction-mode periodic \
    --auto-compaction-retention 10m \
    --log-level error &

# --- etcd member etcd-2 (on 127.0.0.1)
etcd \
    --name pdcache-etcd-2 \
    --data-dir ./.pdcache/etcd/pdcache-etcd-2 \
    --listen-client-urls http://127.0.0.1:2383 \
    --advertise-client-urls http://127.0.0.1:2383 \
    --listen-peer-urls http://127.0.0.1:2384 \
    --initial-advertise-peer-urls http://127.0.0.1:2384 \
    --initial-cluster pdcache-etcd-0=http://127.0.0.1:2380,pdcache-etcd-1=http://127.0.0.1:2382,pdcache-etcd-2=http://127.0.0.1:2384 \
    --initial-cluster-state new \
    --initial-cluster-token pdcache \
    --heartbeat-interval 100 \
    --election-timeout 1000 \
    --auto-compaction-mode periodic \
    --auto-compaction-retention 10m \
    --log-level error &

# --- pdcache metadata service replica 0 (on 127.0.0.1)
pdcache metadata-server \
    --host 127.0.0.1 \
    --port 18000 \
    --state-dir ./.pdcache/metadata \
    --store etcd \
    --etcd-endpoints 127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383 \
    --etcd-prefix /pdcache/metadata \
    --lease-ttl 3 \
    --advertise tcp://127.0.0.1:18000 &

# --- pdcache metadata service replica 1 (on 127.0.0.1)
pdcache metadata-server \
    --host 127.0.0.1 \
    --port 18001 \
    --state-dir ./.pdcache/metadata \
    --store etcd \
    --etcd-endpoints 127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383 \
    --etcd-prefix /pdcache/metadata \
    --lease-ttl 3 \
    --advertise tcp://127.0.0.1:18001 &

# --- prefill server p0 (on 127.0.0.1)
MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30001 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 16384 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode prefill \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port 8998 \
    --enable-hierarchical-cache \
    --hicache-ratio 2 \
    --hicache-write-policy write_through \
    --hicache-mem-layout page_first \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"pdcache","module_path":"pdcache.integrations.sglang","class_name":"PdcacheHiCacheStorage","interface_v1":1,"storage":{"backend":"hf3fs","path":"./.pdcache/storage","capacity_bytes":8589934592,"io_engine":"posix","metadata":"tcp://127.0.0.1:18000,tcp://127.0.0.1:18001","namespace":"default"},"model_name":"'"$PDCACHE_MODEL_NAME"'","prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- prefill server p1 (on 127.0.0.1)
MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30003 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 16384 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode prefill \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port 8999 \
    --enable-hierarchical-cache \
    --hicache-ratio 2 \
    --hicache-write-policy write_through \
    --hicache-mem-layout page_first \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"pdcache","module_path":"pdcache.integrations.sglang","class_name":"PdcacheHiCacheStorage","interface_v1":1,"storage":{"backend":"hf3fs","path":"./.pdcache/storage","capacity_bytes":8589934592,"io_engine":"posix","metadata":"tcp://127.0.0.1:18000,tcp://127.0.0.1:18001","namespace":"default"},"model_name":"'"$PDCACHE_MODEL_NAME"'","prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- decode server d0 (on 127.0.0.1)
MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30002 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 16384 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode decode \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-decode-enable-offload-kvcache \
    --hicache-ratio 2 \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"pdcache","module_path":"pdcache.integrations.sglang","class_name":"PdcacheHiCacheStorage","interface_v1":1,"storage":{"backend":"hf3fs","path":"./.pdcache/storage","capacity_bytes":8589934592,"io_engine":"posix","metadata":"tcp://127.0.0.1:18000,tcp://127.0.0.1:18001","namespace":"default"},"model_name":"'"$PDCACHE_MODEL_NAME"'","origin":"decode"}' &

# --- router (on 127.0.0.1)
python3 -m sglang_router.launch_router \
    --host 127.0.0.1 \
    --port 8000 \
    --pd-disaggregation \
    --prefill http://127.0.0.1:30001 8998 \
    --prefill http://127.0.0.1:30003 8999 \
    --decode http://127.0.0.1:30002 \
    --prefill-policy cache_aware \
    --decode-policy power_of_two \
    --request-timeout-secs 600 &

wait
