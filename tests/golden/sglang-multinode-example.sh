#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology multinode-example.toml
# (rendered by `pdcache launch CONFIG --render sglang`). Run each command on the host
# named above it; the JSON files must exist on every host that uses them.
# NOTE: SGLang's hf3fs backend reads and writes through the 3FS usrbio client: storage.path must
#       be a 3FS mount there (a plain directory works with the file backend).
set -euo pipefail
MODEL_PATH="${MODEL_PATH:-/models/Qwen3-8B}"
CONFIG_DIR="${CONFIG_DIR:-./sglang-configs}"
mkdir -p "$CONFIG_DIR"

cat > "$CONFIG_DIR/hf3fs.json" <<'EOF'
{
  "file_path_prefix": "/mnt/3fs/pdcache/hicache",
  "file_size": 1099511627776,
  "numjobs": 16,
  "entries": 8,
  "metadata_server_url": "http://10.0.0.1:18000"
}
EOF

# --- 3FS metadata service (on 10.0.0.1)
python3 -m sglang.srt.mem_cache.storage.hf3fs.mini_3fs_metadata_server \
    --host 10.0.0.1 \
    --port 18000 \
    --persistence-path /var/lib/pdcache/metadata/sglang-3fs-metadata.json &

# --- prefill server p0 (on 10.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
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
    --hicache-storage-backend hf3fs \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config '{"prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- decode server d0 (on 10.0.0.2)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" MC_FORCE_TCP=1 python3 -m sglang.launch_server \
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
    --hicache-storage-backend hf3fs &

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
