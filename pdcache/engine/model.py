"""A compact decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3), gpt-oss and DeepSeek's
MLA models (DeepSeek-V2/V3, Kimi K2) that reads and writes paged KV.

Parameter names are exactly Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...), so a
checkpoint's safetensors load without renaming and our state dict loads into `transformers`.

The model owns no KV memory: every forward stores the new tokens' cache rows (K and V, or the
MLA latent: `pdcache.engine.kv_geometry`) into the caller's `device_kv` pool at
`batch.out_slots` (through `batch.kernels.store_kv`) and reads cached rows only through the
paged-attention kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from pdcache.engine.config import ModelConfig
from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.layers import RMSNorm, apply_rope, attend_causal, model_rope, rope_cos_sin
from pdcache.engine.mla import LatentAttention
from pdcache.engine.moe import make_mlp


class Attention(nn.Module):
    """GQA self-attention over the paged pool; optional q/k/v bias (Qwen2), q/k norm (Qwen3);
    gpt-oss: a per-layer sliding window (`ModelConfig.layer_window`), o_proj bias and learned
    attention sinks (`sinks [Hq]`: one more logit per head in every softmax, no value)."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.scale = c.head_dim**-0.5
        self.sliding_window = c.layer_window(layer_id)
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if c.attention_sinks else None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        device_kv: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self._project(x, cos, sin)
        if batch.wait_layer is not None:
            # Before the store too: a per-layer host->device load may still be writing pages.
            batch.wait_layer(self.layer_id)
        pool, row, table, slots = self._cache_of(batch, device_kv)
        batch.kernels.store_kv(pool, row, slots, k, v)
        out = self._attend(q, k, v, batch, pool, row, table)
        return self.o_proj(out.reshape(x.shape[0], -1))

    def _cache_of(self, batch: ForwardBatch, device_kv: torch.Tensor
                  ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """The pool, row, page table and new slots of this layer's K/V: row `layer_id` of
        `device_kv`, unless the sliding layers keep their own pages (`batch.window`)."""
        window = batch.window
        if window is None:
            return device_kv, self.layer_id, batch.page_table, batch.out_slots
        if self.sliding_window is None:
            return device_kv, window.full_rows[self.layer_id], batch.page_table, batch.out_slots
        return (window.device_kv, window.sliding_rows[self.layer_id], window.page_table,
                window.out_slots)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        device_kv: torch.Tensor,
        row: int | None = None,
        page_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over `device_kv` row `row` through `page_table` (by default row
        `layer_id` through `batch.page_table`)."""
        row = self.layer_id if row is None else row
        page_table = batch.page_table if page_table is None else page_table
        if batch.mode is ForwardMode.DECODE:
            return batch.kernels.paged_attention_decode(
                q, device_kv, row, page_table, batch.seq_lens, self.scale,
                self.sliding_window, sinks=self.sinks,
            )
        if self._can_attend_fresh(batch):
            return attend_causal(q, k, v, batch.extend_lens, self.scale)
        return batch.kernels.paged_attention_extend(
            q, device_kv, row, page_table, batch.prefix_lens, batch.extend_lens,
            self.scale, self.sliding_window, sinks=self.sinks,
        )

    def _can_attend_fresh(self, batch: ForwardBatch) -> bool:
        # Without a cached prefix all K/V are in hand: plain causal attention, no pool reads
        # (the kernels add the sinks).
        if any(batch.prefix_lens) or self.sinks is not None:
            return False
        return self.sliding_window is None or max(batch.extend_lens) <= self.sliding_window


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = (LatentAttention(config, layer_id) if config.is_mla
                          else Attention(config, layer_id))
        self.mlp = make_mlp(config.moe, config.hidden_size, config.intermediate_size, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        device_kv: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, device_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """The `model.` part of a Hugging Face causal LM: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A causal LM (GQA or MLA attention, dense or MoE MLPs) over a paged KV pool.

    `forward` mutates only `device_kv` (the new tokens' slots in every layer) and returns fp32
    logits `[n, vocab]` for the rows `batch.logits_indices` (default: each sequence's last new
    token). It holds no per-request state, so one instance serves any number of sequences.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self._inv_freq, self._rope_factor = model_rope(config)

    def forward(self, batch: ForwardBatch, device_kv: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = rope_cos_sin(batch.positions, self._inv_freq_on(x.device), x.dtype,
                                self._rope_factor)
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, device_kv)
        rows = batch.logits_indices
        if rows is None:
            rows = batch.last_token_indices()
        # The final norm is per row, so norming only the returned rows changes nothing.
        return self.lm_head(self.model.norm(x[rows])).float()

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq
