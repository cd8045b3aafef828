"""Triton kernels against the same oracles as the torch backends.

With CUDA: the kernels run compiled on the GPU. Without: this module re-runs itself in a
subprocess with TRITON_INTERPRET=1 (which triton reads when a kernel is decorated, so it must be
set before `pdcache.kernels.triton_kernels` is imported, and stays set while kernels run);
shapes are small because the interpreter runs every program in Python. A separate test compiles
every kernel to a CUDA binary (sm_90) on the CPU, which catches type errors the interpreter
forgives.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdcache.kernels import testing

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA and not INTERPRETED else "cpu"
runs_kernels = pytest.mark.skipif(
    not (INTERPRETED or HAS_CUDA), reason="run through test_interpreter_suite (subprocess)"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="this process runs the kernels itself")
def test_interpreter_suite():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" in proc.stdout


def _backend():
    from pdcache.kernels import triton_kernels

    return triton_kernels


SHAPES = [
    testing.CopyShape(layers=2, device_pages=5, host_pages=4, page_size=4, heads=2, dim=8,
                      num_pages=3),
    testing.CopyShape(layers=1, device_pages=3, host_pages=6, page_size=16, heads=1, dim=12,
                      num_pages=2),
    testing.CopyShape(layers=2, device_pages=4, host_pages=5, page_size=4, heads=1, dim=12,
                      num_pages=3, slabs=1),  # an MLA latent pool
]


@runs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", [None, 1])
def test_layout_copies(dtype, layer):
    for seed, shape in enumerate(SHAPES):
        layer_here = None if layer is None else layer % shape.layers
        testing.check_copies(_backend(), shape, dtype, seed, device=DEVICE, layer=layer_here)


@runs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_store(dtype):
    testing.check_pack_store(_backend(), SHAPES[0], dtype, seed=5, device=DEVICE)


ATTENTION_CASES = [
    # seq_lens, new_tokens, page_size, q_heads, kv_heads, dim, sliding_window
    ([7, 20, 1], [1, 1, 1], 4, 4, 2, 8, None),
    ([9, 33], [1, 1], 16, 2, 2, 12, 5),
    ([7, 20], [7, 3], 4, 4, 2, 8, None),
    ([18, 5], [17, 2], 4, 2, 1, 16, 6),
]


@runs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ATTENTION_CASES)))
def test_attention(dtype, case):
    seq_lens, new, page_size, q_heads, kv_heads, dim, window = ATTENTION_CASES[case]
    testing.check_attention(_backend(), seq_lens, new, page_size, q_heads, kv_heads, dim, dtype,
                            seed=case, sliding_window=window, device=DEVICE)


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [0, 1, 3])
def test_attention_with_sinks(dtype, case):
    """gpt-oss's sinks: the online softmax starts from the sink logit."""
    seq_lens, new, page_size, q_heads, kv_heads, dim, window = ATTENTION_CASES[case]
    testing.check_attention(_backend(), seq_lens, new, page_size, q_heads, kv_heads, dim, dtype,
                            seed=case, sliding_window=window, device=DEVICE, with_sinks=True)


@runs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", [[1, 1], [5, 2]])
def test_latent_attention(dtype, new):
    """A latent pool (MLA, absorbed): K is the row, V its first 16 of 24 elements."""
    testing.check_attention(_backend(), [9, 18], new, 4, 4, 1, 24, dtype, seed=7,
                            value_dim=16, device=DEVICE)


@pytest.mark.skipif(INTERPRETED, reason="compiles real kernels")
def test_kernels_compile_for_hopper(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    compiled = _backend().compile_all(arch=90)
    assert sorted(compiled) == ["copy_blocks", "decode", "decode_mla", "decode_sinks",
                                "extend_bf16", "extend_fp32", "extend_mla_bf16",
                                "extend_sinks_bf16"]
    assert all(binary for binary in compiled.values())
