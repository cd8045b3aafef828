#!/usr/bin/env bash
# GPU check of pdcache's KV kernels, one command, a few minutes at most:
#   1. the kernel tests with CUDA visible (Triton kernels compiled and run on the GPU, not the
#      interpreter; pinned-host and device pools; compared with the same oracles as on CPU);
#      the latent (MLA) pool kernels included (one slab per layer; V = the row's first columns);
#   2. the tiny / tiny-mla / small-mla forward on CUDA (MLA + MoE through the triton kernels)
#      against the CPU reference, cold, after a cached prefix and one decode step;
#   3. `pdcache bench kernels --device cuda` (copy GB/s vs device memcpy, attention tokens/s vs
#      SDPA), table on stdout, JSON in $GPU_CHECK_OUT (default .gpu_check/).
# Exits 2 with a message when torch sees no CUDA device, 3 when triton is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python /work/venv/bin/python python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)')) -- nothing to check; run this on a GPU machine with a CUDA build of torch." >&2
  exit 2
fi
if ! "$PY" -c 'import triton' 2>/dev/null; then
  echo "gpu_check: CUDA is available but triton is not installed: pip install triton" >&2
  exit 3
fi

OUT="${GPU_CHECK_OUT:-.gpu_check}"
mkdir -p "$OUT"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'

echo "== kernel tests (CUDA) =="
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts= \
  tests/kernels/test_copies.py tests/kernels/test_attention.py tests/kernels/test_triton.py

echo "== model forward on CUDA vs CPU (GQA, MLA + MoE) =="
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -o addopts= tests/engine/test_cuda_forward.py

echo "== pdcache bench kernels --device cuda =="
timeout 300 "$PY" -m pdcache bench kernels --device cuda --json "$OUT/kernel_bench_cuda.json" "$@"
echo "gpu_check: OK (results in $OUT/)"
