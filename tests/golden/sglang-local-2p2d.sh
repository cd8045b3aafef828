#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology local-2p2d.toml
# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host
# named above it; the JSON files must exist on every host that uses them.
# NOTE: model.preset = 'small' has random weights in pdcache; SGLang needs a checkpoint:
#       MODEL_PATH.
# NOTE: SGLang's hf3fs backend reads and writes through the 3FS usrbio client: storage.path must
#       be a 3FS mount there (a plain directory works with the file backend).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:?preset 'small' exists only in pdcache; set MODEL_PATH to a Llama-family checkpoint}"
CONFIG_DIR="${CONFIG_DIR:-./sglang-configs}"
mkdir -p "$CONFIG_DIR"

cat > "$CONFIG_DIR/hf3fs.json" <<'EOF'
{
  "file_path_prefix": "./.pdcache/storage/hicache",
  "file_size": 8589934592,
  "numjobs": 16,
  "entries": 8,
  "metadata_server_url": "http://127.0.0.1:18000"
}
EOF

# --- 3FS metadata service (on 127.0.0.1)
python3 -m sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server \
    --host 127.0.0.1 \
    --port 18000 \
    --persistence-path ./.pdcache/metadata/sglang-3fs-metadata.json &

# --- prefill server p0 (on 127.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
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
    --hicache-storage-backend hf3fs \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config '{"prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- prefill server p1 (on 127.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
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
    --hicache-storage-backend hf3fs \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config '{"prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- decode server d0 (on 127.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
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
    --hicache-storage-backend hf3fs &

# --- decode server d1 (on 127.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30004 \
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
    --hicache-storage-backend hf3fs &

# --- router (on 127.0.0.1)
python3 -m sglang_router.launch_router \
    --host 127.0.0.1 \
    --port 8000 \
    --pd-disaggregation \
    --prefill http://127.0.0.1:30001 8998 \
    --prefill http://127.0.0.1:30003 8999 \
    --decode http://127.0.0.1:30002 \
    --decode http://127.0.0.1:30004 \
    --prefill-policy cache_aware \
    --decode-policy power_of_two \
    --request-timeout-secs 600 &

wait
