"""Building blocks every decoder shares: RMSNorm (and Qwen3-Next's zero-centred and gated
variants) and rotary position embeddings (default, llama3 and YaRN frequency scaling;
half-split, partial and interleaved rotation)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdcache.engine.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as in Hugging Face Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: the weight is stored centred on 0 and scales by `1 + weight`,
    multiplied in fp32 before the cast back (transformers' `Qwen3NextRMSNorm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm then a SiLU gate, `norm(x) * silu(gate)` (transformers'
    `Qwen3NextRMSNormGated`: norm before gate, the weight applied in the input dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * xf.to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse RoPE frequencies `[head_dim // 2]` (fp32), with llama3 or YaRN scaling."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (fp32) and the factor cos and sin are scaled by
    (1 but for YaRN)."""
    if scaling is not None and scaling.rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    return _llama3_scale(inv_freq, scaling), 1.0


def model_rope(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """The model's RoPE frequencies and cos/sin factor (MLA rotates `qk_rope_head_dim`)."""
    dim = config.qk_rope_head_dim if config.is_mla else config.head_dim
    return rope_frequencies(dim, config.rope_theta, config.rope_scaling)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction, `0.1 * mscale * ln(factor) + 1` (1 at 1x)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies `[dim // 2]` and the factor cos/sin are scaled by: dims that
    turn more than `beta_fast` times over the original context keep their frequency, fewer
    than `beta_slow` are interpolated by `factor`, a linear ramp between."""
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor,
                                                                             s.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(s.factor)
    low, high = (_correction_dim(rotations, dim, theta, s.original_max_position_embeddings)
                 for rotations in (s.beta_fast, s.beta_slow))
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    # on the CPU explicitly: models are built under torch.device("meta") when loaded
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


def _correction_dim(rotations: float, dim: int, theta: float, max_positions: int) -> float:
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, 1, head_dim]` for arbitrary (not necessarily contiguous) positions,
    scaled by `factor` (YaRN's attention factor; 1 otherwise)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    if factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x[T, H, D]` by half-split RoPE (the Hugging Face `rotate_half` convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on the first `cos.shape[-1]` dims of `x[T, H, D]`, the rest passed
    through (Qwen3-Next rotates a quarter of each head)."""
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs `(x0, x1), (x2, x3), ...` (DeepSeek's layout), written out
    de-interleaved (rotated evens, then rotated odds) as transformers does: queries and keys
    get the same order, so their products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                  scale: float) -> torch.Tensor:
    """Plain causal attention of sequences concatenated along dim 0 (`lens` tokens each), all
    of whose keys and values are in hand: `q[T, Hq, D]`, `k[T, Hkv, D]`, `v[T, Hkv, Dv]` ->
    `[T, Hq, Dv]`."""
    outs = []
    for qs, ks, vs in zip(*(t.split(lens) for t in (q, k, v))):
        # 4-D [1, H, T, D] inputs: 3-D ones take torch's slow math path on CPU.
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )
        outs.append(o[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
