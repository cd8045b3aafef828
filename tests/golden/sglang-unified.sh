#!/usr/bin/env bash
# SGLang deployment equivalent to the pdcache topology unified.toml
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
  "file_path_prefix": "./.pdcache/storage-unified/hicache",
  "file_size": 4294967296,
  "numjobs": 16,
  "entries": 8
}
EOF

# --- unified server u0 (on 127.0.0.1)
SGLANG_HICACHE_HF3FS_CONFIG_PATH="$CONFIG_DIR/hf3fs.json" python3 -m sglang.launch_server \
    --model-path "$MODEL_PATH" \
    --host 127.0.0.1 \
    --port 30000 \
    --dtype float32 \
    --random-seed 0 \
    --page-size 16 \
    --max-total-tokens 32768 \
    --enable-cache-report \
    --enable-metrics \
    --enable-hierarchical-cache \
    --hicache-ratio 2 \
    --hicache-write-policy write_through \
    --hicache-mem-layout page_first \
    --hicache-storage-backend hf3fs \
    --hicache-storage-prefetch-policy timeout \
    --hicache-storage-backend-extra-config '{"prefetch_timeout_base":2.0,"prefetch_timeout_per_ki_token":0.1,"prefetch_timeout_max":30.0}' &

# --- router (on 127.0.0.1)
python3 -m sglang_router.launch_router \
    --host 127.0.0.1 \
    --port 8000 \
    --worker-urls http://127.0.0.1:30000 \
    --policy round_robin \
    --request-timeout-secs 600 &

wait
