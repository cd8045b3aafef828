#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology multinode-example.toml
# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host
# named above it. SGLang keeps KV pages in pdcache storage through the pdcache plugin:
# every host needs `pip install sglang==0.5.23 pdcache` (see docs/sglang.md).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-/models/Qwen3-8B}"
# The model name in pdcache's KV fingerprint for the weights at MODEL_PATH (what pdcache
# nodes serving that checkpoint use): pages are shared only where it is equal.
PDCACHE_MODEL_NAME="${PDCACHE_MODEL_NAME:-$(python3 -c 'import sys; from pdcache.offload_manager.builder import model_identity; print(model_identity(sys.argv[1], int(sys.argv[2])))' "$MODEL_PATH" 0)}"

# --- pdcache metadata service (on 10.0.0.1)
pdcache metadata-server \
    --host 10.0.0.1 \
    --port 18000 \
    --state-dir /var/lib/pdcache/metadata \
    --secret-file /etc/pdcache/cluster.secret &

# --- prefill server p0 (on 10.0.0.1)
MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 10.0.0.1 \
    --port 30001 \
    --dtype bfloat16 \
    --random-seed 0 \
    --page-size 64 \
    --max-total-tokens 524288 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode prefill \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port 8998 \
    --enable-hierarchical-cache \
    --hicache-size 64 \
    --hicache-write-policy write_through \
    --hicache-mem-layout page_first \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"pdcache","module_path":"pdcache.integrations.sglang","class_name":"PdcacheHiCacheStorage","interface_v1":1,"storage":{"backend":"hf3fs","path":"/mnt/3fs/pdcache","capacity_bytes":1099511627776,"io_engine":"posix","metadata":"tcp://10.0.0.1:18000","namespace":"default"},"model_name":"'"$PDCACHE_MODEL_NAME"'","secret_file":"/etc/pdcache/cluster.secret","prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- decode server d0 (on 10.0.0.2)
MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 10.0.0.2 \
    --port 30002 \
    --dtype bfloat16 \
    --random-seed 0 \
    --page-size 64 \
    --max-total-tokens 524288 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode decode \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-decode-enable-offload-kvcache \
    --hicache-size 64 \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name":"pdcache","module_path":"pdcache.integrations.sglang","class_name":"PdcacheHiCacheStorage","interface_v1":1,"storage":{"backend":"hf3fs","path":"/mnt/3fs/pdcache","capacity_bytes":1099511627776,"io_engine":"posix","metadata":"tcp://10.0.0.1:18000","namespace":"default"},"model_name":"'"$PDCACHE_MODEL_NAME"'","origin":"decode","secret_file":"/etc/pdcache/cluster.secret"}' &

# --- router (on 10.0.0.1)
python3 -m sglang_router.launch_router \
    --host 10.0.0.1 \
    --port 8000 \
    --pd-disaggregation \
    --prefill http://10.0.0.1:30001 8998 \
    --decode http://10.0.0.2:30002 \
    --prefill-policy cache_aware \
    --decode-policy round_robin \
    --request-timeout-secs 600 &

wait
