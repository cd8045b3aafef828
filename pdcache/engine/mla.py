"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache.

Parameter names are Hugging Face's (`self_attn.kv_a_proj_with_mqa.weight`, ...). Per token and
layer the cache holds one latent row (`KVGeometry.mla`): the normed compressed KV
(`kv_lora_rank`) followed by the RoPE'd shared key (`qk_rope_head_dim`).

Two ways to attend, mathematically equal:
- *expanded* (a prompt with nothing cached: every latent is in hand): `kv_b_proj` expands the
  latents into per-head keys and values and plain causal SDPA runs over them, as transformers
  computes it;
- *absorbed* (decode, and prefill after a cached prefix): `kv_b_proj`'s key half is folded into
  the query (`q_nope @ W_uk` lives in the latent space) and its value half applied after, so
  attention reads the paged latent rows directly as an MQA with one kv head whose keys are the
  rows and whose values are their first `kv_lora_rank` elements (`value_dim` of the kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from pdcache.engine.config import ModelConfig
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.layers import (
    RMSNorm,
    apply_rope,
    apply_rope_interleaved,
    attend_causal,
    yarn_mscale,
)


def softmax_scale(config: ModelConfig) -> float:
    """`qk_head_dim ** -0.5`, times YaRN's mscale(mscale_all_dim) squared when it is set."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


class LatentAttention(nn.Module):
    """MLA of one layer; stores each new token's latent row into `device_kv[layer, 0]`."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = c.v_head_dim, c.kv_lora_rank
        self.interleaved = c.rope_interleave
        self.scale = softmax_scale(c)
        q_width = self.num_heads * (self.nope_dim + self.rope_dim)
        bias = c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope_dim,
                                            bias=bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        device_kv: torch.Tensor,
    ) -> torch.Tensor:
        q_nope, q_pe, latent = self._project(x, cos, sin)
        if batch.wait_layer is not None:
            # Before the store too: a per-layer host->device load may still be writing pages.
            batch.wait_layer(self.layer_id)
        batch.kernels.store_kv(device_kv, self.layer_id, batch.out_slots, latent)
        if self._can_expand(batch):
            out = self._attend_expanded(q_nope, q_pe, latent, batch.extend_lens)
        else:
            out = self._attend_absorbed(q_nope, q_pe, batch, device_kv)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries split into `[T, H, nope]` and RoPE'd `[T, H, rope]`, and the latent rows
        `[T, 1, kv_lora_rank + rope]` to cache."""
        n = x.shape[0]
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(n, self.num_heads, -1).split([self.nope_dim, self.rope_dim], -1)
        compressed, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim],
                                                            -1)
        rope = apply_rope_interleaved if self.interleaved else apply_rope
        q_pe, k_pe = rope(q_pe, cos, sin), rope(k_pe[:, None], cos, sin)
        latent = torch.cat((self.kv_a_layernorm(compressed)[:, None], k_pe), dim=-1)
        return q_nope, q_pe, latent

    def _can_expand(self, batch: ForwardBatch) -> bool:
        # Nothing cached before the new tokens: every latent is in hand.
        return batch.mode is not ForwardMode.DECODE and not any(batch.prefix_lens)

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as `W_uk [H, nope, rank]` and `W_uv [H, v, rank]`."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _attend_expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
        extend_lens: list[int],
    ) -> torch.Tensor:
        kv = self.kv_b_proj(latent[:, 0, : self.kv_lora_rank])
        k_nope, v = kv.view(-1, self.num_heads, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], -1)
        k_pe = latent[:, :, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        q, k = torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1)
        return attend_causal(q, k, v, extend_lens, self.scale)

    def _attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch,
        device_kv: torch.Tensor,
    ) -> torch.Tensor:
        w_uk, w_uv = self._kv_b_halves()
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)
        q = torch.cat((q_latent, q_pe), dim=-1)
        if batch.mode is ForwardMode.DECODE:
            out = batch.kernels.paged_attention_decode(
                q, device_kv, self.layer_id, batch.page_table, batch.seq_lens, self.scale,
                value_dim=self.kv_lora_rank,
            )
        else:
            out = batch.kernels.paged_attention_extend(
                q, device_kv, self.layer_id, batch.page_table, batch.prefix_lens,
                batch.extend_lens, self.scale, value_dim=self.kv_lora_rank,
            )
        return torch.einsum("thc,hvc->thv", out, w_uv)
