#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology local-mooncake-store.toml
# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host
# named above it; the JSON files must exist on every host that uses them.
# NOTE: model.preset = 'small' has random weights in pdcache; SGLang needs a checkpoint:
#       MODEL_PATH.
set -euo pipefail
MODEL_PATH="${MODEL_PATH:?preset 'small' exists only in pdcache; set MODEL_PATH to a Llama-family checkpoint}"
CONFIG_DIR="${CONFIG_DIR:-./sglang-configs}"
mkdir -p "$CONFIG_DIR"

cat > "$CONFIG_DIR/mooncake-p0.json" <<'EOF'
{
  "local_hostname": "127.0.0.1",
  "metadata_server": "http://127.0.0.1:8080/metadata",
  "master_server_address": "127.0.0.1:50051",
  "protocol": "tcp",
  "device_name": "",
  "global_segment_size": 1073741824,
  "local_buffer_size": 67108864
}
EOF

cat > "$CONFIG_DIR/mooncake-d0.json" <<'EOF'
{
  "local_hostname": "127.0.0.1",
  "metadata_server": "http://127.0.0.1:8080/metadata",
  "master_server_address": "127.0.0.1:50051",
  "protocol": "tcp",
  "device_name": "",
  "global_segment_size": 1073741824,
  "local_buffer_size": 67108864
}
EOF

# --- Mooncake Store master (on 127.0.0.1)
mooncake_master \
    --rpc_address=127.0.0.1 \
    --rpc_port=50051 \
    --metrics_host=127.0.0.1 \
    --metrics_port=9003 \
    --enable_http_metadata_server=true \
    --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port=8080 &

# --- prefill server p0 (on 127.0.0.1)
SGLANG_HICACHE_MOONCAKE_CONFIG_PATH="$CONFIG_DIR/mooncake-p0.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30001 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 32768 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode prefill \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-bootstrap-port 8998 \
    --enable-hierarchical-cache \
    --hicache-ratio 2 \
    --hicache-write-policy write_through \
    --hicache-mem-layout page_first \
    --hicache-storage-backend mooncake \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config '{"prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- decode server d0 (on 127.0.0.1)
SGLANG_HICACHE_MOONCAKE_CONFIG_PATH="$CONFIG_DIR/mooncake-d0.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30002 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 32768 \
    --enable-cache-report \
    --enable-metrics \
    --disaggregation-mode decode \
    --disaggregation-transfer-backend mooncake \
    --disaggregation-decode-enable-offload-kvcache \
    --hicache-ratio 2 \
    --hicache-storage-backend mooncake &

# --- router (on 127.0.0.1)
python3 -m sglang_router.launch_router \
    --host 127.0.0.1 \
    --port 8000 \
    --pd-disaggregation \
    --prefill http://127.0.0.1:30001 8998 \
    --decode http://127.0.0.1:30002 \
    --prefill-policy cache_aware \
    --decode-policy round_robin \
    --request-timeout-secs 600 &

wait
