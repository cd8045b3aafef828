"""The MLA + MoE and GQA presets' forward on CUDA (triton kernels on a latent / K-V pool) equal
the CPU reference's logits; a prefix-cached extend and a decode step included. Runs where torch
sees a CUDA device (scripts/gpu_check.sh); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.loader import allocate_device_kv, load_model
from pdcache.kernels import KernelSet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PAGE = 16
PROMPT = [(13 * i + 5) % 250 for i in range(150)]


def _logits(model, kv, ids: list[int], start: int, kernels: KernelSet) -> torch.Tensor:
    device = kv.device
    n = len(ids)
    pages = torch.arange(kv.shape[2], device=device)
    positions = torch.arange(start, start + n, device=device)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE if n == 1 and start else ForwardMode.EXTEND,
        input_ids=torch.tensor(ids, device=device), positions=positions,
        out_slots=pages[positions // PAGE] * PAGE + positions % PAGE, page_table=pages[None],
        prefix_lens=[start], extend_lens=[n], logits_indices=torch.arange(n, device=device),
        kernels=kernels)
    with torch.inference_mode():
        return model(batch, kv).float().cpu()


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla", "small-mla"])
@pytest.mark.parametrize("dtype, atol", [("float32", 2e-3), ("bfloat16", 0.25)])
def test_cuda_forward_matches_cpu(preset: str, dtype: str, atol: float) -> None:
    cpu_model, _ = load_model(preset, dtype=dtype)
    cuda_model, _ = load_model(preset, dtype=dtype, device="cuda")
    cpu_kv = allocate_device_kv(cpu_model.config, 16, PAGE)
    cuda_kv = allocate_device_kv(cuda_model.config, 16, PAGE, device="cuda")
    steps = [(PROMPT[:100], 0), (PROMPT[100:149], 100), (PROMPT[149:], 149)]
    for ids, start in steps:  # cold extend, extend after a cached prefix, one decode step
        want = _logits(cpu_model, cpu_kv, ids, start, KernelSet("reference"))
        got = _logits(cuda_model, cuda_kv, ids, start, KernelSet("triton"))
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1)) or dtype == "bfloat16"
